"""Launchers of norms.cu: RMSNorm writing xhat = x / rms(x) (its gain folded into the next GEMM's weights),
its backward from dL/dxhat, and the gradients of a gain-folded matrix and of its gain."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel
from nanoeuler.kernels.bf16.plan import gain_fold_columns, gain_fold_splits

i32, f32 = np.int32, np.float32


def rmsnorm_fwd(x, xhat, rstd, eps: float, add=(), out=None) -> None:
    """xhat = bf16((x + the bf16 branches in `add`) * rstd), rstd = 1 / rms; the sum also into `out` (the
    residual stream carried on). x (N, C) float32, at most two branches."""
    N, C = xhat.shape
    y, y2 = (tuple(add) + (x, x))[:2]  # unread placeholders where fewer than two branches
    kernel("bf16/norms", "rmsnorm_fwd_bf16")(
        ((N + 3) // 4,),
        (128,),
        (
            x,
            y,
            y2,
            xhat,
            rstd,
            x if out is None else out,
            i32(N),
            i32(C),
            f32(eps),
            i32(len(add)),
            i32(out is not None),
        ),
    )


def rmsnorm_bwd(g, xhat, rstd, dx, dxb, accumulate: bool) -> None:
    """dx = (accumulate ? dx : 0) + rstd (g - xhat mean(g xhat)), dxb = bf16(dx); g = dL/dxhat, bf16 from
    a layer's GEMM or float32 (the final norm's, summed over the heads)."""
    N, C = xhat.shape
    name = "rmsnorm_bwd_bf16_f32dy" if g.dtype == np.float32 else "rmsnorm_bwd_bf16"
    kernel("bf16/norms", name)((-(-N // 8),), (256,), (g, xhat, rstd, dx, dxb, i32(N), i32(C), i32(accumulate)))


def gain_fold(w, dw, gain, dgain, rows: int, part, sq) -> None:
    """dW' (the folded GEMM image's weight gradient, in dw) -> dW = dW' * gain in place, and the gain's
    gradient dgain = column sums of W * dW' (by `part`, per-split sums); the squares of dW into sq."""
    C = gain.size
    splits, per_split = gain_fold_splits(rows)
    kernel("bf16/norms", "gain_fold_grad")(
        (-(-C // gain_fold_columns(C)), splits), (256,), (w, dw, gain, part, i32(rows), i32(C), i32(per_split), sq)
    )
    kernel("bf16/norms", "column_sums")((-(-C // 32),), (32, 32), (part, dgain, i32(splits), i32(C)))
