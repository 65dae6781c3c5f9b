"""The one place that picks GPU implementations: which layer functions the model calls, and which
update AdamW applies, for the arrays at hand.

    >>> import numpy as np
    >>> ops_for(np).__name__, fused_adamw({"w": np.zeros(2, np.float32)}) is None
    ('nanoeuler.model.layers', True)

`transformer.py` reaches every layer through `ops_for(xp)`, never through `layers` directly, and
`optim.AdamW` asks `fused_adamw` for a one-kernel update; both get the NumPy reference on NumPy arrays
and the kernels of `nanoeuler.kernels` on CuPy ones. A replacement layer module offers the functions of
`nanoeuler.model.layers` with identical names, signatures and semantics (`linear_cross_entropy`
included, the output head and its loss in one call, which a kernel module may fuse). So the model and
the optimizer import nothing from the kernels, and a new GPU implementation is registered here.

The kernels sit below the model (they import its layers as their reference), so this module reaches
them by name, at run time and only for CuPy arrays: the one way up that docs/ARCHITECTURE.md allows.
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


def fused_adamw(params: dict):
    """The GPU's one-kernel update of (p, m, v) for float32 CuPy parameters (`kernels.adamw.step_tensor`),
    else None (AdamW's xp code, the kernel's self-test reference)."""
    first = next(iter(params.values()), None)
    if first is None or isinstance(first, np.ndarray) or first.dtype != np.float32:
        return None
    return importlib.import_module("nanoeuler.kernels.adamw").step_tensor
