"""Kernel launches with programmatic dependent launch (PDL), through the CUDA driver's cuLaunchKernelEx.

    >>> launch = pdl_launcher()                                  # None where the GPU has no PDL   # doctest: +SKIP
    >>> launch(fn, (96,), (256,), (w, x, np.int32(768)), shared_mem=0, stream=stream)          # doctest: +SKIP

A kernel launched this way may start while the kernel before it on the stream still runs; it waits for that
one inside, at `griddepcontrol.wait` (kernels/decode/decode.cuh's pdl_wait), after requesting what does not
depend on it, such as its weights. On a chain of small kernels this hides each kernel's start and its first memory
latency behind the one before. CuPy's own launch has no way to set launch attributes, hence ctypes; stream
capture records such launches as graph edges of the same kind. Needs compute capability 9.0 or later.
"""

from __future__ import annotations

import ctypes

import numpy as np

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID in cuda.h


class _AttrValue(ctypes.Union):  # CUlaunchAttributeValue: 64 bytes, 8-byte aligned
    _fields_ = [("pad", ctypes.c_char * 64), ("i", ctypes.c_int), ("p", ctypes.c_void_p)]


class _Attr(ctypes.Structure):  # CUlaunchAttribute
    _fields_ = [("id", ctypes.c_int), ("value", _AttrValue)]


class _Config(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("hStream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_Attr)),
        ("numAttrs", ctypes.c_uint),
    ]


_SCALARS = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64, np.uint64: ctypes.c_uint64, np.float32: ctypes.c_float}


def _arg(a):
    """A kernel argument as a ctypes value: a device array's pointer, or a NumPy scalar of its own width."""
    ptr = getattr(getattr(a, "data", None), "ptr", None)
    if ptr is not None:
        return ctypes.c_void_p(ptr)
    kind = _SCALARS.get(type(a))
    if kind is None:
        raise TypeError(f"kernel argument of type {type(a).__name__}: pass a device array or a NumPy scalar")
    return kind(a)


def _fn_ptr(fn) -> int:
    """The CUfunction of a CuPy kernel (cupy.cuda.Function, or a RawKernel's)."""
    ptr = getattr(fn, "ptr", None)
    return int(ptr if ptr is not None else fn.kernel.ptr)


class PdlLauncher:
    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self._launch = lib.cuLaunchKernelEx
        self._launch.argtypes = [
            ctypes.POINTER(_Config),
            ctypes.c_void_p,
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_void_p,
        ]
        self._launch.restype = ctypes.c_int
        self._attr = _Attr(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
        self._attr.value.i = 1

    def __call__(self, fn, grid, block, args, shared_mem: int = 0, stream=None) -> None:
        grid, block = tuple(grid) + (1,) * (3 - len(grid)), tuple(block) + (1,) * (3 - len(block))
        vals = [_arg(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
        cfg = _Config(
            *grid,
            *block,
            int(shared_mem),
            ctypes.c_void_p(stream.ptr if stream is not None else 0),
            ctypes.pointer(self._attr),
            1,
        )
        err = self._launch(ctypes.byref(cfg), ctypes.c_void_p(_fn_ptr(fn)), params, None)
        if err != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUDA driver error {err}")


def pdl_launcher() -> PdlLauncher | None:
    """A launcher with PDL on a GPU of compute capability 9.0 or later, else None (CuPy's own launch)."""
    import cupy

    if int(cupy.cuda.Device().compute_capability) < 90:
        return None
    return PdlLauncher()
