"""Tensor maps for Hopper's tensor memory accelerator (TMA): what `cp.async.bulk.tensor` copies from.

A tensor map describes a bf16 matrix in global memory (its address, shape and row stride) and the
box that one copy moves into shared memory or back, with the 128-byte swizzle that the warpgroup matrix
instructions read. `tile_map` sees the matrix as it is; `gate_up_map` sees a gate/up weight as a 5-D
tensor whose boxes arrive with their rows in the order the fused SwiGLU kernel's lanes want;
`heads_map` sees attention operands (B, heads, T, 64) as one 64 x 64 box per head and 64 positions.
The driver encodes a map (`cuTensorMapEncodeTiled`, called here through ctypes: CuPy does not wrap it);
the 128 bytes then live in device memory, and a kernel takes their address.

    >>> m = tile_map(dy, box_rows=128)      # dy: (N, C) bf16 words on the device      # doctest: +SKIP
    >>> kernel(grid, block, (m, ...))      # the kernel's `const void*` argument      # doctest: +SKIP

A map holds the matrix's address: it is valid while that buffer lives, which is why the engine builds
its maps once, over buffers it allocated once.
"""

from __future__ import annotations

import ctypes

import numpy as np

_BFLOAT16 = 9  # CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
_SWIZZLE_128B = 3  # CU_TENSOR_MAP_SWIZZLE_128B
_L2_PROMOTION_256B = 3  # CU_TENSOR_MAP_L2_PROMOTION_L2_256B
_MAP_BYTES = 128  # sizeof(CUtensorMap)

_driver = None


def _encode_tiled():
    global _driver
    if _driver is None:
        _driver = ctypes.CDLL("libcuda.so.1")
        _driver.cuTensorMapEncodeTiled.restype = ctypes.c_int
    return _driver.cuTensorMapEncodeTiled


def _encode(matrix, dims, strides, box, what: str):
    """A device copy of the tensor map over the bf16 words of `matrix` with these dimensions (innermost
    first, the innermost contiguous), byte strides of the outer ones and box, 128-byte swizzled."""
    import cupy

    raw = ctypes.create_string_buffer(_MAP_BYTES + 64)  # the encoder wants the map 64-byte aligned
    at = -(-ctypes.addressof(raw) // 64) * 64
    u64, u32, rank = ctypes.c_uint64, ctypes.c_uint32, len(dims)
    status = _encode_tiled()(
        ctypes.c_void_p(at),
        _BFLOAT16,
        u32(rank),
        ctypes.c_void_p(matrix.data.ptr),
        (u64 * rank)(*dims),
        (u64 * (rank - 1))(*strides),
        (u32 * rank)(*box),
        (u32 * rank)(*([1] * rank)),
        0,
        _SWIZZLE_128B,
        _L2_PROMOTION_256B,
        0,
    )
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for {what}")
    host = np.frombuffer(ctypes.string_at(at, _MAP_BYTES), dtype=np.uint8)
    return cupy.asarray(host)


def _check(matrix, name: str) -> None:
    if matrix.ndim != 2 or matrix.dtype.itemsize != 2 or matrix.strides[1] != 2:
        raise ValueError(
            f"{name} needs a matrix of bf16 words with unit column stride, got {matrix.dtype} "
            f"shape {matrix.shape} strides {matrix.strides}"
        )
    if matrix.data.ptr % 16 or matrix.strides[0] % 16:
        raise ValueError(
            f"{name} needs a 16-byte aligned matrix and row stride (address {matrix.data.ptr:#x}, "
            f"row stride {matrix.strides[0]})"
        )


def tile_map(matrix, box_rows: int, box_cols: int = 64):
    """A device copy of the tensor map of `matrix` (2-D bf16 words, unit column stride) whose copies move
    boxes of box_rows x box_cols (box_cols x 2 bytes = one 128-byte swizzle row) into shared memory,
    128-byte swizzled. Rows and columns past the matrix's edge arrive as zeros."""
    _check(matrix, "tile_map")
    if box_cols * 2 > 128:
        raise ValueError(f"tile_map's boxes hold at most 64 columns (one 128-byte swizzle row), got {box_cols}")
    rows, cols = matrix.shape
    return _encode(
        matrix,
        (cols, rows),
        (matrix.strides[0],),
        (box_cols, box_rows),
        f"a {rows} x {cols} matrix, box {box_rows} x {box_cols}",
    )


def gate_up_map(w):
    """The tensor map through which `swiglu_fwd_gemm` (kernels/bf16/gemm_tma.cu) reads a gate/up weight `w` (2F x C bf16
    words, F % 64 == 0, C % 64 == 0): the rows of each block of 64 (block b = rows 64 b .. 64 b + 63) in the
    order of the kernel's lanes. Row 16 q + 2 nc + e of a block is box row 8 nc + 2 q + e, i.e. the map is
    5-D, (k, e, q, nc, b) with row strides 1, 16, 2 and 64, and a box (64, 2, 4, 8, 1) is one block's 64
    rows by 64 k. Nothing is copied: the map reorders rows as it reads them.

        >>> [16 * q + 2 * nc + e for nc in (0, 1) for q in range(4) for e in (0, 1)][:10]
        [0, 1, 16, 17, 32, 33, 48, 49, 2, 3]
    """
    _check(w, "gate_up_map")
    rows, cols = w.shape
    if rows % 128 or cols % 64:
        raise ValueError(f"gate_up_map needs 2F x C with F % 64 == 0 and C % 64 == 0, got {rows} x {cols}")
    r = w.strides[0]
    return _encode(
        w,
        (cols, 2, 4, 8, rows // 64),
        (r, 16 * r, 2 * r, 64 * r),
        (64, 2, 4, 8, 1),
        f"the gate/up weight ({rows} x {cols})",
    )


def heads_map(x):
    """The tensor map through which `qkv_rope_gemm` (kernels/bf16/gemm_tma.cu) stores into an attention
    operand `x` (B, heads, T, 64) of bf16 words: 3-D, (64, T, B heads), a box (64, 64, 1) being 64
    positions of one head of one sequence (T % 64 == 0)."""
    if x.ndim != 4 or x.shape[3] != 64 or x.dtype.itemsize != 2 or not x.flags.c_contiguous:
        raise ValueError(f"heads_map needs contiguous bf16 words (B, heads, T, 64), got {x.dtype} shape {x.shape}")
    B, heads, T, D = x.shape
    if T % 64:
        raise ValueError(f"heads_map needs T % 64 == 0 (boxes of 64 positions), got T {T}")
    _check(x.reshape(B * heads * T, D), "heads_map")
    return _encode(
        x, (D, T, B * heads), (2 * D, 2 * D * T), (64, 64, 1), f"attention operands ({B}, {heads}, {T}, {D})"
    )
