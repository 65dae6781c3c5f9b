"""Kernel dispatch: which implementation of the layer functions the model calls.

`transformer.py` reaches every layer through `ops_for(xp)`, never through `layers` directly, so the
GPU engine can swap in fused kernels without touching the model. Any replacement module must offer
the functions of `nanoeuler.model.layers` with identical names, signatures and semantics (including
`linear_cross_entropy`, the output head and its loss in one call, which a kernel module may fuse).
"""

from __future__ import annotations

import importlib

import numpy as np

from nanoeuler.model import layers

_CACHE: dict[str, object] = {}


def ops_for(xp):
    """The layer namespace for array module `xp`: `layers` on NumPy; on CuPy `nanoeuler.kernels.ops`
    when that module exists, else `layers` (whose xp-generic code runs on CuPy too)."""
    if xp is np:
        return layers
    name = getattr(xp, "__name__", "")
    if name not in _CACHE:
        ops = layers
        if name == "cupy":
            try:
                ops = importlib.import_module("nanoeuler.kernels.ops")
            except ModuleNotFoundError as exc:
                if exc.name not in ("nanoeuler.kernels.ops", "nanoeuler.kernels"):
                    raise
        _CACHE[name] = ops
    return _CACHE[name]
