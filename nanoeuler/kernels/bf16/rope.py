"""Launchers of rope.cu: qkv rows to rotated q/k/v heads (bf16 or float32), and back for the gradient;
the o_proj operand and delta = rowsum(dO * O) for the float32 attention."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16 import grid_1d

i32, i64 = np.int32, np.int64


def _dims(q, k):
    B, H, T, D = q.shape
    return B * T, H, k.shape[1], T, D


def qkv_rope_split(qkv, cos, sin, q, k, v) -> None:
    """qkv (N, (H+2Hkv) D) bf16 -> q (B,H,T,D), k (B,Hkv,T,D) rotated, v, in q's dtype (bf16: 8 pairs a
    thread, the tensor-core attention's operands; float32: a pair a thread, the float32 attention's)."""
    N, H, Hkv, T, D = _dims(q, k)
    if q.dtype == np.float32:
        pairs = N * (H + 2 * Hkv) * (D // 2)
        kernel("bf16/rope", "qkv_rope_split")(
            grid_1d(pairs), (256,), (qkv, cos, sin, q, k, v, i32(T), i32(H), i32(Hkv), i32(D), i64(pairs))
        )
    else:
        kernel("bf16/rope", "qkv_rope_split_bf16")(
            grid_1d(N * (H + 2 * Hkv) * (D // 16)),
            (256,),
            (qkv, cos, sin, q, k, v, i32(T), i32(H), i32(Hkv), i32(D), i32(N)),
        )


def rope_bwd_pack(dq, dk, dv, cos, sin, dqkv) -> None:
    """dq (B,H,T,D), dk, dv (B,Hkv,T,D) float32 -> dqkv (N, (H+2Hkv) D) bf16, the rotation undone on dq, dk."""
    N, H, Hkv, T, D = _dims(dq, dk)
    grid = (-(-((H + 2 * Hkv) * (D // 2)) // 256), min(N, 65535))
    kernel("bf16/rope", "rope_bwd_pack")(
        grid, (256,), (dq, dk, dv, cos, sin, dqkv, i32(T), i32(H), i32(Hkv), i32(D), i32(N))
    )


def attn_pack(out, a) -> None:
    """out (B,H,T,D) float32 -> a (N, H D) bf16, the o_proj GEMM's operand."""
    B, H, T, D = out.shape
    n = B * T * H * D
    kernel("bf16/rope", "attn_pack")(grid_1d(n), (256,), (out, a, i32(T), i32(H), i32(D), i64(n)))


def attn_delta(a, da, delta) -> None:
    """delta (B,H,T) = rowsum(dO * O), O the bf16 operand a (N, H D), dO float32 da (N, H D)."""
    B, H, T = delta.shape
    N, D = B * T, a.shape[1] // H
    kernel("bf16/rope", "attn_delta")((-(-(N * H) // 8),), (256,), (a, da, delta, i32(T), i32(H), i32(D), i64(N * H)))
