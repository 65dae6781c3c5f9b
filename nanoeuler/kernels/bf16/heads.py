"""Launchers of heads.cu: the multi-token cross-entropy over the K output heads, a chunk of rows at a time."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel

i32, i64 = np.int32, np.int64


def ce_head_scale(targets, scale) -> None:
    """scale[k] = 1 / (valid targets of head k * heads with any), targets (N, K) int32, -1 ignored."""
    N, K = targets.shape
    kernel("bf16/heads", "ce_head_scale")((1,), (1024,), (targets, scale, i64(N), i32(K)))


def ce_heads(logits, targets, scale, loss_rows, head: int) -> None:
    """Head `head`'s logits (R, V) bf16, overwritten by their gradient scale[head] (softmax - onehot); each
    row's loss into loss_rows (R, K)[:, head]. targets (R, K): the chunk's rows."""
    R, V = logits.shape
    K = targets.shape[1]
    kernel("bf16/heads", "ce_heads_fwd_bwd")((R,), (256,), (logits, targets, scale, loss_rows, i32(V), i32(K),
                                                             i32(head)))


def ce_loss_reduce(loss_rows, scale, loss) -> None:
    """loss[0] = sum over heads k of scale[k] * sum of loss_rows[:, k]."""
    N, K = loss_rows.shape
    kernel("bf16/heads", "ce_loss_reduce")((1,), (1024,), (loss_rows, scale, loss, i64(N), i32(K)))
