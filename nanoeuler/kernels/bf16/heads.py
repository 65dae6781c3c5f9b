"""Launchers of heads.cu: the multi-token cross-entropy over the K output heads, a chunk of rows at a time,
and the sequence log-probability head of DPO (head 0 only)."""

from __future__ import annotations

import numpy as np

from nanoeuler.kernels import kernel

i32, i64 = np.int32, np.int64


def ce_head_scale(targets, weights, scale) -> None:
    """scale[k] = w[k] / (valid targets of head k * the sum of w over the heads with any), targets (N, K)
    int32 (-1 ignored), weights (K,) float32 on the device (`transformer.head_loss_scales`)."""
    N, K = targets.shape
    kernel("bf16/heads", "ce_head_scale")((1,), (1024,), (targets, weights, scale, i64(N), i32(K)))


def ce_heads(logits, targets, scale, loss_rows, head: int) -> None:
    """Head `head`'s logits (R, V) bf16, overwritten by their gradient scale[head] (softmax - onehot); each
    row's loss into loss_rows (R, K)[:, head]. targets (R, K): the chunk's rows."""
    R, V = logits.shape
    K = targets.shape[1]
    kernel("bf16/heads", "ce_heads_fwd_bwd")(
        (R,), (256,), (logits, targets, scale, loss_rows, i32(V), i32(K), i32(head))
    )


def ce_loss_reduce(loss_rows, scale, loss) -> None:
    """loss[0] = sum over heads k of scale[k] * sum of loss_rows[:, k]."""
    N, K = loss_rows.shape
    kernel("bf16/heads", "ce_loss_reduce")((1,), (1024,), (loss_rows, scale, loss, i64(N), i32(K)))


def seq_logp_rows(logits, targets, tok, lse) -> None:
    """Pass 1 of the sequence log-prob head: head 0's logits (R, V) bf16 -> each row's log-prob of its target
    tok (R,) and logsumexp lse (R,), both 0 where targets (R, K)[:, 0] is -1."""
    R, V = logits.shape
    kernel("bf16/heads", "seq_logp_rows")((R,), (256,), (logits, targets, tok, lse, i32(V), i32(targets.shape[1])))


def dpo_pair_loss(tok, ref, weight, logp, dlogp, loss, T: int, beta: float, label_smoothing: float) -> None:
    """Sequence log-probs logp (B,) from the rows' tok (B*T,); the DPO loss of its B/2 pairs (chosen first)
    against ref (B,), pair i weighted by weight[i], into loss[0]; dloss/dlogp (B,)."""
    B = logp.shape[0]
    kernel("bf16/heads", "dpo_pair_loss")(
        (1,),
        (1024,),
        (tok, ref, weight, logp, dlogp, loss, i32(B), i32(T), np.float32(beta), np.float32(label_smoothing)),
    )


def seq_logp_grad(logits, targets, lse, dlogp, r0: int, T: int) -> None:
    """Pass 2: head 0's logits (R, V) of rows r0.. overwritten by dlogp[row's sequence] (onehot - softmax)."""
    R, V = logits.shape
    kernel("bf16/heads", "seq_logp_grad")(
        (R,), (256,), (logits, targets, lse, dlogp, i32(V), i32(targets.shape[1]), i64(r0), i32(T))
    )
