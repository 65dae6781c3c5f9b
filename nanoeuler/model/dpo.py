"""Direct Preference Optimization: the loss on the final normed state, with its gradient by hand.

A batch holds P preference pairs as 2P sequences, the P chosen ones first, then the P rejected ones
in the same order. Head 0's targets (B,T,K)[..., 0] mark the response tokens (-1 elsewhere); a
sequence's log-probability under the model is the sum of its response tokens' log-probabilities

    logp[b] = sum_t log softmax(xn[b,t] @ lm_head^T)[target[b,t]]      over t with target[b,t] >= 0

and with the reference model's log-probabilities `ref` (precomputed, so only one model is in memory)
pair i's implicit reward margin and loss are (Rafailov et al. 2023; label smoothing eps as in
"conservative DPO", the chance that a label is flipped)

    h_i  = beta * ((logp[c_i] - ref[c_i]) - (logp[r_i] - ref[r_i]))
    loss = mean_i  -(1 - eps) log sigmoid(h_i) - eps log sigmoid(-h_i)

The MTP heads 1..K-1 play no part: their targets are ignored and they get zero gradients, so DPO
leaves them as SFT made them while the trunk under them moves.

    >>> import numpy as np
    >>> xn = np.zeros((2, 1, 3)); w = np.zeros((4, 3)); tgt = np.array([[[1]], [[2]]])
    >>> loss, dxn, grads = dpo_head_loss(np.zeros(2), beta=0.1)(xn, {"lm_head.weight": w}, tgt, None)
    >>> round(loss, 6)    # h = 0: -log sigmoid(0) = log 2
    0.693147
"""

from __future__ import annotations

from collections import deque

from nanoeuler.backend import array_module


def response_rows(targets):
    """Flat indices (n,) of the positions with a head-0 target, their targets (n,) and sequence numbers (n,)."""
    xp = array_module(targets)
    B, T = targets.shape[:2]
    flat = targets[:, :, 0].reshape(B * T)
    idx = xp.nonzero(flat >= 0)[0]
    return idx, flat[idx], idx // T


def token_logps(logits, tgt):
    """logits (n,V), targets (n,) -> log-probabilities of the targets (n,) and the softmax (n,V).

    Shifted by the row maximum before exp, so large logits do not overflow."""
    xp = array_module(logits)
    z = logits - logits.max(axis=1, keepdims=True)  # (n,V)
    e = xp.exp(z)
    s = e.sum(axis=1, keepdims=True)  # (n,1)
    rows = xp.arange(logits.shape[0])
    return z[rows, tgt] - xp.log(s[:, 0]), e / s


def target_logps(rows, w, tgt, chunk: int):
    """Log-probabilities (n,) of targets (n,) under softmax(rows (n,C) @ w (V,C)^T), `chunk` rows of logits
    at a time, so scoring never holds (n, V) arrays for a whole batch.

        >>> import numpy as np
        >>> target_logps(np.zeros((3, 2)), np.zeros((4, 2)), np.array([0, 1, 3]), chunk=2).round(4)  # uniform: log 1/4
        array([-1.3863, -1.3863, -1.3863])
    """
    xp = array_module(rows)
    out = xp.empty(rows.shape[0], dtype=rows.dtype)
    for lo in range(0, rows.shape[0], chunk):
        lg = rows[lo : lo + chunk] @ w.T  # (r,V)
        top = lg.max(axis=1, keepdims=True)
        lse = xp.log(xp.exp(lg - top).sum(axis=1)) + top[:, 0]
        out[lo : lo + chunk] = lg[xp.arange(lg.shape[0]), tgt[lo : lo + chunk]] - lse
    return out


def sequence_logps(tok_logp, seq, n_seqs: int):
    """Sum token log-probabilities (n,) by sequence number (n,) -> (n_seqs,)."""
    xp = array_module(tok_logp)
    onehot = (seq[None, :] == xp.arange(n_seqs)[:, None]).astype(tok_logp.dtype)  # (B,n)
    return onehot @ tok_logp


def pair_loss(logp, ref, beta: float, label_smoothing: float = 0.0):
    """Sequence log-probs (2P,) of policy and reference -> (mean loss, dloss/dlogp (2P,), margins h (P,)).

    log sigmoid(x) = -logaddexp(0, -x) keeps large |h| finite."""
    xp = array_module(logp)
    P = logp.shape[0] // 2
    d = logp - ref  # (2P,) log-ratios to the reference
    h = beta * (d[:P] - d[P:])  # (P,)
    eps = label_smoothing
    loss = ((1 - eps) * xp.logaddexp(0.0, -h) + eps * xp.logaddexp(0.0, h)).mean()
    sig = xp.exp(-xp.logaddexp(0.0, -h))  # sigmoid(h), without overflow
    dh = (-(1 - eps) * (1 - sig) + eps * sig) / P  # (P,)
    dlogp = xp.concatenate([beta * dh, -beta * dh])
    return float(loss), dlogp, h


def dpo_head_loss(ref_logps, *, beta: float, label_smoothing: float = 0.0):
    """A `head_loss` for `transformer.loss_and_grads` that trains DPO against `ref_logps`.

    ref_logps: the reference model's sequence log-probabilities (2P,) of this batch's sequences
    (chosen first), on the host or the params' device.
    Returns fn(xn, params, targets, cfg) -> (loss, dxn (B,T,C), {"lm_head.weight": dW}).
    """

    def head_loss(xn, params, targets, cfg):
        xp = array_module(xn)
        w = params["lm_head.weight"]  # (V,C)
        B, T, C = xn.shape
        ref = xp.asarray(ref_logps, dtype=xn.dtype)
        if ref.shape != (B,) or B % 2:
            raise ValueError(
                f"DPO needs an even batch of sequences and one reference log-prob each; "
                f"got {B} sequences and {ref.shape[0]} reference values"
            )
        idx, tgt, seq = response_rows(xp.asarray(targets))
        x = xn.reshape(B * T, C)[idx]  # (n,C) response positions only
        logits = x @ w.T  # (n,V)
        tok, probs = token_logps(logits, tgt)
        del logits
        logp = sequence_logps(tok, seq, B)
        loss, dlogp, _ = pair_loss(logp, ref, beta, label_smoothing)
        # d logp_tok / d logits = onehot(target) - softmax; every token of sequence b weighs dlogp[b]
        g = dlogp[seq]  # (n,)
        dlogits = probs
        dlogits *= -g[:, None]
        dlogits[xp.arange(tgt.shape[0]), tgt] += g
        dxn = xp.zeros((B * T, C), dtype=xn.dtype)
        dxn[idx] = dlogits @ w  # (n,C)
        return loss, dxn.reshape(B, T, C), {"lm_head.weight": dlogits.T @ x}

    return head_loss


class DpoHead:
    """DPO's objective as a description that each training path reads its own way: the xp stepper calls it
    as a `head_loss` (`dpo_head_loss`), the bf16 engine runs its sequence log-prob head with `beta` and
    `label_smoothing`. The batch source `push`es each micro-batch's reference log-probs (2P,) in the order
    the stepper takes the micro-batches; each use `pop`s them.

    With a step cut into micro-batches (`totals`, from the xp stepper) a micro-batch's loss and gradients
    are its share of the mean over all the step's pairs, as the engine has them.

        >>> import numpy as np
        >>> head = DpoHead(beta=0.1); head.push(np.zeros(2))
        >>> xn = np.zeros((2, 1, 3)); w = np.zeros((4, 3)); tgt = np.array([[[1]], [[2]]])
        >>> round(head(xn, {"lm_head.weight": w}, tgt, None)[0], 6)
        0.693147
    """

    def __init__(self, beta: float, label_smoothing: float = 0.0):
        self.beta, self.label_smoothing = float(beta), float(label_smoothing)
        self._pending: deque = deque()

    def push(self, ref) -> None:
        self._pending.append(ref)

    def pop(self):
        return self._pending.popleft()

    def __call__(self, xn, params, targets, cfg, totals=None):
        loss, dxn, grads = dpo_head_loss(self.pop(), beta=self.beta, label_smoothing=self.label_smoothing)(
            xn, params, targets, cfg
        )
        if totals is not None and totals.rows != xn.shape[0]:  # this micro-batch's share of the step's mean
            share = xn.shape[0] / totals.rows
            loss, dxn = loss * share, dxn * share
            grads = {n: g * share for n, g in grads.items()}
        return loss, dxn, grads
