"""Launchers of optim.cu: the gradient norm's sum of squares, AdamW with clipping read from the device,
and the bf16 GEMM image of the master weights (norm gains folded in)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16 import grid_1d

i32, i64, f32 = np.int32, np.int64, np.float32


def sumsq(g, sq) -> None:
    """sq[0] += sum of g^2 (g flat float32)."""
    n = g.size
    kernel("bf16/optim", "sumsq")((min(4096, -(-n // 256)),), (256,), (g, i64(n), sq))


def f32_to_bf16(x, y, gain, cols: int) -> None:
    """y = bf16(x * gain[i % cols]) (a null gain: bf16(x)); x flat float32."""
    n = x.size
    kernel("bf16/optim", "f32_to_bf16")(grid_1d(n), (256,), (x, y, i64(n), gain, i32(cols)))


def adamw_clip(p, g, m, v, pb, sq, hyper, decayed: bool, max_norm: float, beta1: float, beta2: float, eps: float,
               gain, cols: int) -> None:
    """Clip g by sqrt(sq[0]) against max_norm, AdamW on one flat range (hyper: step size, 1/sqrt(1 - b2^t),
    decay factor, on the device), and the range's bf16 image pb = bf16(p * gain)."""
    n = p.size
    kernel("bf16/optim", "adamw_clip_bf16")((min(4096, -(-n // 256)),), (256,), (
        p, g, m, v, pb, i64(n), sq, hyper, i32(decayed), f32(max_norm), f32(beta1), f32(beta2), f32(eps), gain,
        i32(cols)))


def grad_accumulate(g, acc, loss, loss_acc) -> None:
    """acc += g (flat float32) and loss_acc[0] += loss[0]: one micro-batch into the step's sums."""
    n = g.size
    kernel("bf16/optim", "grad_accumulate")((min(4096, -(-n // 1024)),), (256,), (g, acc, i64(n), loss, loss_acc))
