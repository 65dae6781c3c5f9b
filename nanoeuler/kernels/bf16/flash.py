"""Launchers of the attention: flash_mma.cu and flash_wg.cu (bf16 operands, tensor cores), and the float32
FlashAttention of attention.cu that the engine's "fp32" variant runs on float32 q/k/v.

Grids: x over (batch, head) pairs, y over 64-row tiles (the tensor-core kernels; flash_mma.cu says why),
x over row tiles and y over pairs (attention.cu)."""

from __future__ import annotations

import functools
import math

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16.plan import FLASH

i32, i64, f32 = np.int32, np.int64, np.float32
# The warpgroup attention (flash_wg.cu) keeps 64 x 64 bf16 tiles of 8 KiB in dynamic shared memory, after
# 1 KiB of alignment: the forward K and V in two stages and the block's Q (5 tiles); dq K and V in two
# stages, the block's Q and dO (6); dk/dv Q and dO in two stages, the block's K and V (6). Operands that
# stay the same for a whole block are read by the tensor cores from there rather than from registers,
# which leaves room for more blocks per multiprocessor (5, 4 and 3).
FLASH_WG_SMEM = {"flash_fwd": 1024 + 5 * 8192, "flash_bwd_dq": 1024 + 6 * 8192, "flash_bwd_dkdv": 1024 + 6 * 8192}


def flash_kernels(variant: str, D: int) -> dict:
    """{"flash_fwd", "flash_bwd_dq", "flash_bwd_dkdv": launch(grid, block, args)}: the attention of one
    variant ("wg", "ldm", "mma": tensor cores; "fp32": attention.cu) and head size D, each launch with the
    shared memory its kernel needs (FLASH_WG_SMEM for "wg"; the others' is static)."""
    if variant == "fp32":
        return {name: kernel("attention", f"{name}_d{D}") for name in FLASH_WG_SMEM}
    out = {}
    for name, smem in FLASH_WG_SMEM.items():
        fn = kernel("bf16/flash_wg" if variant == "wg" else "bf16/flash_mma", f"{name}_{variant}_d{D}")
        smem = smem if variant == "wg" else 0
        if smem:
            fn.max_dynamic_shared_size_bytes = smem
        out[name] = functools.partial(fn, shared_mem=smem)
    return out


def flash_fwd(kern: dict, q, k, v, o, lse) -> None:
    """Causal GQA attention: q (B,H,T,D), k/v (B,Hkv,T,D) bf16 -> O into o (N, H D) bf16, the o_proj
    operand, and the logsumexp of every row into lse (B,H,T)."""
    B, H, T, D = q.shape
    kern["flash_fwd"](
        (B * H, -(-T // 64)), (128,), (q, k, v, o, lse, i32(H), i32(k.shape[1]), i32(T), f32(1.0 / math.sqrt(D)))
    )


def flash_bwd(kern: dict, q, k, v, o, do, lse, delta, dqkv, cos, sin) -> None:
    """dq, dk (the RoPE rotation undone: cos/sin) and dv as bf16 into the qkv GEMM's gradient operand dqkv
    (N, (H+2Hkv) D), from dO (N, H D); the dq kernel also computes delta = rowsum(dO * O) for dk/dv's."""
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    rope = (dqkv, cos, sin, i32(H), i32(Hkv), i32(T), f32(1.0 / math.sqrt(D)))
    kern["flash_bwd_dq"]((B * H, -(-T // 64)), (128,), (q, k, v, do, o, lse, delta, *rope))
    kern["flash_bwd_dkdv"]((B * Hkv, -(-T // 64)), (128,), (q, k, v, do, lse, delta, *rope))


def _f32_args(q, k):
    B, H, T, D = q.shape
    Hkv = k.shape[1]
    qs = (i64(H * T * D), i64(T * D), i64(D))  # strides of (B, H, T)
    ks = (i64(Hkv * T * D), i64(T * D), i64(D))
    dims = (i32(H), i32(Hkv), i32(T), i32(T), f32(1.0 / math.sqrt(D)))
    return B, H, Hkv, T, D, qs, ks, dims


def flash_fwd_f32(kern: dict, q, k, v, out, lse) -> None:
    """The float32 attention: q, k, v float32 -> out (B,H,T,D) float32 and lse."""
    B, H, Hkv, T, D, qs, ks, dims = _f32_args(q, k)
    G, rows = FLASH[D]
    kern["flash_fwd"]((-(-T // rows), B * H), (rows * G,), (q, *qs, k, *ks, v, *ks, out, lse, *dims))


def flash_bwd_f32(kern: dict, q, k, v, do, lse, delta, dq, dk, dv) -> None:
    """The float32 attention's backward: dO (N, H D) float32 -> dq (B,H,T,D), dk, dv (B,Hkv,T,D) float32."""
    B, H, Hkv, T, D, qs, ks, dims = _f32_args(q, k)
    G, rows = FLASH[D]
    das = (i64(T * H * D), i64(D), i64(H * D))  # dO's strides of (B, H, T) in the (N, H D) layout
    qkv = (q, *qs, k, *ks, v, *ks)
    kern["flash_bwd_dkdv"]((-(-T // rows), B * Hkv), (rows * G,), (*qkv, do, *das, lse, delta, dk, dv, *dims))
    kern["flash_bwd_dq"]((-(-T // rows), B * H), (rows * G,), (*qkv, do, *das, lse, delta, dq, *dims))
