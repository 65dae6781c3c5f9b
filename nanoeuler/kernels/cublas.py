"""Matrix products on the tensor cores: cuBLAS's `cublasGemmEx` called through ctypes.

The engine calls cuBLAS directly rather than through CuPy's binding because CuPy refuses every cuBLAS
call while a stream is being captured into a CUDA graph, and the engine captures its whole step
(cuBLAS itself supports capture). Operands are row-major CuPy matrices, bf16 (stored as uint16 words)
or float32, with float32 accumulation; cuBLAS picks the algorithm by its own heuristic:

    >>> gemm = Gemm(stream)                                     # doctest: +SKIP
    >>> gemm(Matrix(c), Matrix(a), Matrix(b), tb=True)          # c = a @ b.T   # doctest: +SKIP

Row-major c (M, N) = op(a) op(b) is, to column-major cuBLAS, c^T (N, M) = op(b)^T op(a)^T: every call
passes b first and a second.
"""

from __future__ import annotations

import ctypes

import cupy as cp
import numpy as np

BF16_STORAGE = np.uint16  # bf16 words; converted by the kernels

# cuBLAS / CUDA enums
_CUDA_R_32F = 0
_CUDA_R_16BF = 14
_CUBLAS_COMPUTE_32F = 68
_CUBLAS_GEMM_DEFAULT = -1
_OP_N, _OP_T = 0, 1

# cuBLAS's workspace in bytes. With none, cuBLAS picks algorithms that need none, which rules out its
# split-K products of the weight gradients (K = batch x seq) and the memsets and reduction kernels they
# add: no slower, and less memory (docs/benchmarks-log.md, run 16).
WORKSPACE = 0


def load_cublas():
    """The cuBLAS library CuPy uses, opened with ctypes."""
    cp.cuda.device.get_cublas_handle()  # makes CuPy load its cuBLAS into the process
    major = cp.cuda.runtime.runtimeGetVersion() // 1000
    try:
        return ctypes.CDLL(f"libcublas.so.{major}")  # the loaded library, found by its soname
    except OSError:
        pass
    with open("/proc/self/maps") as maps:  # CuPy loaded it from a path of its own: open that one
        for line in maps:
            path = line.split()[-1]
            if "/libcublas.so" in path:
                return ctypes.CDLL(path)
    raise RuntimeError(f"cannot find the cuBLAS library (libcublas.so.{major}) that CuPy loaded")


def _check(status, what):
    if status != 0:
        raise RuntimeError(f"{what} failed: cuBLAS status {status}")


class Matrix:
    """A row-major matrix view for cuBLAS: pointer, shape, leading dimension, CUDA data type."""

    __slots__ = ("arr", "ptr", "rows", "cols", "ld", "dt")

    def __init__(self, arr):
        if arr.ndim != 2 or arr.strides[1] != arr.itemsize:
            raise ValueError(f"GEMM operand must be 2-D with unit column stride, got {arr.shape} {arr.strides}")
        self.arr = arr
        self.ptr = arr.data.ptr
        self.rows, self.cols = arr.shape
        self.ld = arr.strides[0] // arr.itemsize
        if arr.dtype == np.float32:
            self.dt = _CUDA_R_32F
        elif arr.dtype == BF16_STORAGE:
            self.dt = _CUDA_R_16BF
        else:
            raise ValueError(f"GEMM operand dtype {arr.dtype}")


class Gemm:
    """c (M,N) = op(a) @ op(b) [+ c] by `cublasGemmEx` on a handle of its own, bound to `stream`.

    The handle's workspace is set (to `workspace` bytes: WORKSPACE, none, unless a bench asks for more), so
    cuBLAS never allocates one inside a captured step; alpha and beta are host values, fixed at capture."""

    def __init__(self, stream=None, workspace: int = WORKSPACE):
        lib = load_cublas()
        c_int, c_void_p, c_longlong = ctypes.c_int, ctypes.c_void_p, ctypes.c_longlong
        self._lib = lib
        self._call = lib.cublasGemmEx
        # handle, transa, transb, m, n, k, alpha, (A, its type, its leading dimension), (B ...), beta, (C ...),
        # compute type, algo
        operand = [c_void_p, c_int, c_int]
        self._call.argtypes = [c_void_p] + [c_int] * 5 + [c_void_p] + operand * 2 + [c_void_p] + operand + [c_int] * 2
        self._call.restype = c_int
        handle = c_void_p()
        _check(lib.cublasCreate_v2(ctypes.byref(handle)), "cublasCreate")
        self.handle = handle
        stream = cp.cuda.get_current_stream() if stream is None else stream
        _check(lib.cublasSetStream_v2(handle, c_void_p(stream.ptr)), "cublasSetStream")
        self.workspace = cp.empty(workspace, dtype=np.uint8)  # of size 0: a null pointer
        _check(
            lib.cublasSetWorkspace_v2(handle, c_void_p(self.workspace.data.ptr), ctypes.c_size_t(workspace)),
            "cublasSetWorkspace",
        )
        _check(lib.cublasSetPointerMode_v2(handle, 0), "cublasSetPointerMode")  # alpha/beta on the host
        self._one = np.ones(1, dtype=np.float32)
        self._zero = np.zeros(1, dtype=np.float32)
        self._batched = lib.cublasGemmStridedBatchedEx
        # cublasGemmEx's, with each operand's stride between matrices, and the batch count before the compute type
        strided = operand + [c_longlong]
        self._batched.argtypes = (
            [c_void_p] + [c_int] * 5 + [c_void_p] + strided * 2 + [c_void_p] + strided + [c_int] * 3
        )
        self._batched.restype = c_int
        self._scalars = {}  # host alpha/beta values of the batched products, kept alive

    def __del__(self):
        if getattr(self, "handle", None) is not None:
            self._lib.cublasDestroy_v2(self.handle)
            self.handle = None

    def __call__(self, c: Matrix, a: Matrix, b: Matrix, ta=False, tb=False, beta=0.0):
        M, N = c.rows, c.cols
        K = a.rows if ta else a.cols
        am = a.cols if ta else a.rows
        bk, bn = (b.cols, b.rows) if tb else (b.rows, b.cols)
        if am != M or bk != K or bn != N:
            raise ValueError(f"GEMM shapes: c {M}x{N}, op(a) {am}x{K}, op(b) {bk}x{bn}")
        beta_ptr = self._one.ctypes.data if beta else self._zero.ctypes.data
        _check(
            self._call(
                self.handle,
                _OP_T if tb else _OP_N,
                _OP_T if ta else _OP_N,
                N,
                M,
                K,
                self._one.ctypes.data,
                b.ptr,
                b.dt,
                b.ld,
                a.ptr,
                a.dt,
                a.ld,
                beta_ptr,
                c.ptr,
                c.dt,
                c.ld,
                _CUBLAS_COMPUTE_32F,
                _CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmEx",
        )

    def _scalar(self, value: float) -> int:
        arr = self._scalars.setdefault(float(value), np.full(1, value, dtype=np.float32))
        return arr.ctypes.data

    def batched(
        self,
        c: Matrix,
        a: Matrix,
        b: Matrix,
        count: int,
        strides: tuple,
        ta=False,
        tb=False,
        alpha: float = 1.0,
        beta: float = 0.0,
    ):
        """c_i = alpha op(a_i) @ op(b_i) + beta c_i for i < count by `cublasGemmStridedBatchedEx`: c, a, b
        are the first matrices, `strides` = (c's, a's, b's) in elements between consecutive ones."""
        M, N = c.rows, c.cols
        K = a.rows if ta else a.cols
        am = a.cols if ta else a.rows
        bk, bn = (b.cols, b.rows) if tb else (b.rows, b.cols)
        if am != M or bk != K or bn != N:
            raise ValueError(f"GEMM shapes: c {M}x{N}, op(a) {am}x{K}, op(b) {bk}x{bn}")
        sc, sa, sb = (int(s) for s in strides)
        _check(
            self._batched(
                self.handle,
                _OP_T if tb else _OP_N,
                _OP_T if ta else _OP_N,
                N,
                M,
                K,
                self._scalar(alpha),
                b.ptr,
                b.dt,
                b.ld,
                sb,
                a.ptr,
                a.dt,
                a.ld,
                sa,
                self._scalar(beta),
                c.ptr,
                c.dt,
                c.ld,
                sc,
                int(count),
                _CUBLAS_COMPUTE_32F,
                _CUBLAS_GEMM_DEFAULT,
            ),
            "cublasGemmStridedBatchedEx",
        )
