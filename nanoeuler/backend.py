"""The array backend: `xp` is NumPy on the CPU and CuPy on the GPU.

Layer code is written once against `xp`; this module decides which module that is.
CuPy is imported only when the GPU is asked for (or `auto` finds one), so a CPU-only
install never needs it.

Dtype policy: float32 for training on either device, float64 for gradient checks
(CPU reference), bf16/fp16 only inside GPU kernels and GEMMs.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np

from nanoeuler.errors import UserError

GPU_INSTALL_HINT = "install the gpu extra: pip install -e '.[gpu]' (CuPy for CUDA 12, plus ml_dtypes)"
TF32_ENV = "CUPY_TF32"  # CuPy runs float32 GEMMs on TF32 tensor cores only when this is "1"


def _cupy_or_reason():
    """(cupy module, None) when a usable CUDA device exists, else (None, why not)."""
    try:
        import cupy
    except ImportError:
        return None, "CuPy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDA driver missing or broken
        first = (str(exc).splitlines() or [type(exc).__name__])[0]
        return None, f"CuPy cannot reach a CUDA driver ({first})"
    if count == 0:
        return None, "no CUDA device is visible"
    return cupy, None


def gpu_unavailable_reason() -> str | None:
    """None when CuPy and a CUDA device are usable, else what is missing (one phrase)."""
    return _cupy_or_reason()[1]


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


def is_gpu_array(a) -> bool:
    """True for a CuPy array, without importing CuPy."""
    return type(a).__module__.startswith("cupy")


def synchronize(xp) -> None:
    """Wait for the device (a no-op on NumPy): for timings and before reading host clocks."""
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def tf32_enabled() -> bool:
    """Whether CuPy's cuBLAS may use TF32 for float32 GEMMs (CUPY_TF32=1): ~1e-3 relative error,
    far above the 1e-5 of the float32 checks, so `selftest` and the GPU gradcheck refuse it."""
    return os.environ.get(TF32_ENV, "0") not in ("", "0")


def is_out_of_memory(exc: BaseException) -> bool:
    """A CuPy device-memory exhaustion (pool allocation or cuBLAS workspace), recognised by type name so
    CPU-only code never imports CuPy."""
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if name == "OutOfMemoryError" and module.startswith("cupy"):
        return True
    return module.startswith("cupy") and "CUDA_ERROR_OUT_OF_MEMORY" in str(exc)


def oom_message(batch_size: int, context: int, exc: BaseException | None = None) -> str:
    """The one line to show when the GPU runs out of memory at a given batch size and context."""
    detail = ""
    if exc is not None:
        first = str(exc).splitlines()[0] if str(exc) else ""
        detail = f" ({first})" if first else ""
    return (
        f"the GPU ran out of memory at batch size {batch_size} and context {context}{detail}; "
        "set gpu_memory below what the card has (the stage then cuts its batches smaller, same result), "
        "or free the GPU of other processes"
    )


@contextlib.contextmanager
def oom_guard(batch_size: int, context: int):
    """Turn a GPU out-of-memory error inside the block into a UserError naming batch size and context.

    with oom_guard(sec["batch_size"], cfg.ctx_len):
        loss, grads = transformer.loss_and_grads(...)
    """
    try:
        yield
    except Exception as exc:
        if is_out_of_memory(exc):
            raise UserError(oom_message(batch_size, context, exc)) from None
        raise
