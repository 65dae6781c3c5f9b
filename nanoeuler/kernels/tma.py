"""Tensor maps for Hopper's tensor memory accelerator (TMA): what `cp.async.bulk.tensor` copies from.

A tensor map describes a 2-D bf16 matrix in global memory (its address, shape and row stride) and the
box that one copy moves into shared memory, with the 128-byte swizzle that the warpgroup matrix
instructions read. The driver encodes it (`cuTensorMapEncodeTiled`, called here through ctypes: CuPy
does not wrap it); the 128 bytes then live in device memory, and a kernel takes their address.

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


def tile_map(matrix, box_rows: int, box_cols: int = 64):
    """A device copy of the tensor map of `matrix` (2-D bf16 words, unit column stride) whose copies move
    boxes of box_rows x box_cols (box_cols x 2 bytes = one 128-byte swizzle row) into shared memory,
    128-byte swizzled. Rows and columns past the matrix's edge arrive as zeros."""
    import cupy

    rows, cols = matrix.shape
    row_bytes = matrix.strides[0]
    if matrix.dtype.itemsize != 2 or matrix.strides[1] != 2:
        raise ValueError(f"tile_map needs bf16 words with unit column stride, got {matrix.dtype} strides {matrix.strides}")
    if matrix.data.ptr % 16 or row_bytes % 16 or box_cols * 2 > 128:
        raise ValueError(f"tile_map needs a 16-byte aligned matrix and row stride, and boxes of at most 64 columns "
                         f"(address {matrix.data.ptr:#x}, row stride {row_bytes}, box columns {box_cols})")
    raw = ctypes.create_string_buffer(_MAP_BYTES + 64)  # the encoder wants the map 64-byte aligned
    at = -(-ctypes.addressof(raw) // 64) * 64
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    status = _encode_tiled()(
        ctypes.c_void_p(at), _BFLOAT16, u32(2), ctypes.c_void_p(matrix.data.ptr), (u64 * 2)(cols, rows),
        (u64 * 1)(row_bytes), (u32 * 2)(box_cols, box_rows), (u32 * 2)(1, 1), 0, _SWIZZLE_128B,
        _L2_PROMOTION_256B, 0)
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed (CUresult {status}) for a {rows} x {cols} matrix, "
                           f"box {box_rows} x {box_cols}")
    host = np.frombuffer(ctypes.string_at(at, _MAP_BYTES), dtype=np.uint8)
    return cupy.asarray(host)
