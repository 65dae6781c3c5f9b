"""The array backend: `xp` is NumPy on the CPU and CuPy on the GPU.

Layer code is written once against `xp`; this module decides which module that is.
CuPy is imported only when the GPU is asked for (or `auto` finds one), so a CPU-only
install never needs it.

Dtype policy: float32 for training on either device, float64 for gradient checks
(CPU reference), bf16/fp16 only inside GPU kernels and GEMMs.
"""

from __future__ import annotations

import numpy as np

from nanoeuler.errors import UserError

GPU_INSTALL_HINT = "install the gpu extra: pip install -e '.[gpu]' (CuPy for CUDA 12, plus ml_dtypes)"


def _cupy_or_reason():
    """(cupy module, None) when a usable CUDA device exists, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken
        return None, f"CuPy cannot reach a CUDA driver ({str(exc).splitlines()[0]})"
    if count == 0:
        return None, "no CUDA device is visible"
    return cupy, None


def resolve_device(device: str) -> str:
    """'auto' | 'cpu' | 'gpu' -> 'cpu' | 'gpu'. Asking for 'gpu' without one is a clear error."""
    if device == "cpu":
        return "cpu"
    if device not in ("auto", "gpu"):
        raise UserError(f"device must be auto, cpu or gpu, got {device!r}")
    cupy, why = _cupy_or_reason()
    if cupy is not None:
        return "gpu"
    if device == "gpu":
        raise UserError(f"device 'gpu' was asked for but {why}; {GPU_INSTALL_HINT}, or use --device cpu")
    return "cpu"


def get_xp(device: str):
    """The array module for a resolved device name."""
    if resolve_device(device) == "gpu":
        import cupy

        return cupy
    return np


def array_module(a):
    """NumPy or CuPy, whichever owns array `a`."""
    return np if isinstance(a, np.ndarray) or np.isscalar(a) else __import__("cupy").get_array_module(a)


def to_numpy(a) -> np.ndarray:
    """A NumPy copy (or view) of a NumPy/CuPy array."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


def add_device_argument(parser, default: str | None = None) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default=default,
        help="where to compute (default: the config's `device`, itself default auto)",
    )
