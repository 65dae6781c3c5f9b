"""Layers as forward/backward pairs, written once against `xp` (NumPy or CuPy).

Each `*_forward` returns its output and, where the backward needs more than its inputs, a cache;
each `*_backward` takes the upstream gradient (and the cache) and returns the input gradients.
The array module is taken from the arrays themselves, so the same code runs on NumPy (float32 for
training, float64 for gradient checks) and on CuPy. These functions are also the reference that
every fused GPU kernel is tested against.

Shape letters: B batch, T query positions, S key positions (S = T in training; S >= T with a KV cache),
C model width, H query heads, Hkv key/value heads, G = H / Hkv, D head width, F SwiGLU width,
N = B*T rows, V vocabulary.

A backward may reuse (and overwrite) the buffers held in its cache: call it at most once per forward.
"""

from __future__ import annotations

import math

import numpy as np

from nanoeuler.backend import array_module


# ---- linear (no bias) -------------------------------------------------------------------------


def linear_forward(x, w):
    """y = x @ w.T ; x (..., in), w (out, in) as in HF/PyTorch -> y (..., out)."""
    lead = x.shape[:-1]
    y = x.reshape(-1, x.shape[-1]) @ w.T  # (N, in) @ (in, out): one big GEMM
    return y.reshape(*lead, w.shape[0])


def linear_backward(dy, x, w):
    """dy (..., out), x (..., in), w (out, in) -> dx (..., in), dw (out, in)."""
    dy2 = dy.reshape(-1, dy.shape[-1])  # (N, out)
    x2 = x.reshape(-1, x.shape[-1])  # (N, in)
    dx = (dy2 @ w).reshape(x.shape)  # (N, in)
    dw = dy2.T @ x2  # (out, in)
    return dx, dw


# ---- RMSNorm with a gain ----------------------------------------------------------------------


def rmsnorm_forward(x, w, eps):
    """y = x / sqrt(mean(x^2) + eps) * w ; x (..., C), w (C,)."""
    xp = array_module(x)
    ms = xp.mean(x * x, axis=-1, keepdims=True)  # (..., 1)
    rstd = 1.0 / xp.sqrt(ms + eps)  # (..., 1)
    xhat = x * rstd  # (..., C)
    y = xhat * w
    return y, (xhat, rstd, w)


def rmsnorm_backward(dy, cache):
    """dy (..., C) -> dx (..., C), dw (C,)."""
    xhat, rstd, w = cache
    C = xhat.shape[-1]
    dw = (dy * xhat).reshape(-1, C).sum(axis=0)  # (C,)
    dxhat = dy * w  # (..., C)
    # d/dx of x*rstd: rstd * (dxhat - xhat * mean(dxhat * xhat))
    proj = (dxhat * xhat).mean(axis=-1, keepdims=True)  # (..., 1)
    dxhat -= xhat * proj
    dxhat *= rstd
    return dxhat, dw


def folded_gain_grads(w, dw_folded, gain):
    """Gradients of a linear layer's weight w (out, in) and of the norm gain (in,) before it, from the
    weight gradient of the folded product.

    A norm's gain can be folded into the weight that reads the norm: (xhat * gain) @ w.T equals
    xhat @ (w * gain).T, since w * gain scales column j of w by gain[j]. Training the folded product
    gives dw_folded = dy.T @ xhat, and by the chain rule through w_folded = w * gain:

        dw = dw_folded * gain            dgain[j] = sum_o w[o, j] * dw_folded[o, j]

    Worked example: w = [[1, 2]], gain = [3, 4], so w * gain = [[3, 8]]; with dw_folded = [[0.5, 1]],

        >>> dw, dgain = folded_gain_grads(np.array([[1., 2.]]), np.array([[0.5, 1.]]), np.array([3., 4.]))
        >>> dw.tolist(), dgain.tolist()
        ([[1.5, 4.0]], [0.5, 2.0])
    """
    return dw_folded * gain, (w * dw_folded).sum(axis=0)


# ---- rotary position embedding (half-split pairing, HF rotate_half) ---------------------------


def rope_tables(T, head_dim, theta, xp, dtype, offset=0):
    """cos, sin of shape (T, head_dim//2) for positions offset .. offset+T-1.

    Frequency i (0 <= i < D/2) rotates the pair (x[i], x[i + D/2]) by angle pos * theta^(-2i/D).
    The angles are computed in float64 and rounded once to `dtype`.
    """
    half = head_dim // 2
    inv_freq = 1.0 / (float(theta) ** (np.arange(0, half, dtype=np.float64) * 2.0 / head_dim))  # (D/2,)
    pos = np.arange(offset, offset + T, dtype=np.float64)  # (T,)
    ang = np.outer(pos, inv_freq)  # (T, D/2)
    return xp.asarray(np.cos(ang), dtype=dtype), xp.asarray(np.sin(ang), dtype=dtype)


def rope_forward(x, cos, sin):
    """x (B,H,T,D), cos/sin (T,D/2) -> y (B,H,T,D), C-contiguous.

    y[:half] = x1*cos - x2*sin ; y[half:] = x2*cos + x1*sin, with x1 = x[..., :D/2], x2 = x[..., D/2:].
    """
    xp = array_module(x)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    y = xp.empty(x.shape, dtype=x.dtype)
    y1, y2 = y[..., :half], y[..., half:]
    xp.multiply(x1, cos, out=y1)
    y1 -= x2 * sin
    xp.multiply(x2, cos, out=y2)
    y2 += x1 * sin
    return y


def rope_backward(dy, cos, sin):
    """The transpose of the rotation: rotate by the negative angle. dy (B,H,T,D) -> dx (B,H,T,D)."""
    return rope_forward(dy, cos, -sin)


# ---- causal grouped-query attention -----------------------------------------------------------


def _causal_bias(T, S):
    bias = np.zeros((T, S), dtype=np.float32)
    bias[np.triu_indices(T, k=S - T + 1, m=S)] = -np.inf
    return bias


def attention_forward(q, k, v):
    """Causal softmax attention where G = H/Hkv query heads share one key/value head.

    q (B,H,T,D), k/v (B,Hkv,S,D) with S >= T; query t sits at position S-T+t and sees keys 0..S-T+t
    (S = T in training; S > T when decoding with a KV cache). Query head h uses key/value head h // G,
    as in HF `repeat_kv`. Keys and values are never repeated: the G query heads of a group are stacked
    along the row axis, (B,Hkv,G*T,D), and multiplied against the group's keys in one batched GEMM.
    Returns out (B,H,T,D) and the cache for the backward.
    """
    xp = array_module(q)
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G = H // Hkv
    scale = 1.0 / math.sqrt(D)
    qg = (q * scale).reshape(B, Hkv, G * T, D)  # (B,Hkv,G*T,D); scaling q is cheaper than scaling scores
    s = qg @ k.transpose(0, 1, 3, 2)  # (B,Hkv,G*T,S)
    s = s.reshape(B, Hkv, G, T, S)
    # Causal mask: key j is visible to query t iff j <= t + (S - T).
    if T > 1:
        s += xp.asarray(_causal_bias(T, S), dtype=s.dtype)  # (T,S): 0 where visible, -inf where hidden
    # Numerically stable softmax over keys, in place.
    s -= s.max(axis=-1, keepdims=True)
    xp.exp(s, out=s)
    s *= 1.0 / s.sum(axis=-1, keepdims=True)
    p = s.reshape(B, Hkv, G * T, S)  # (B,Hkv,G*T,S) attention weights
    out = (p @ v).reshape(B, H, T, D)  # (B,Hkv,G*T,D) -> (B,H,T,D)
    return out, (qg, k, v, p, out, scale)


def attention_backward(dout, cache):
    """dout (B,H,T,D) -> dq (B,H,T,D), dk (B,Hkv,S,D), dv (B,Hkv,S,D)."""
    qg, k, v, p, out, scale = cache
    B, Hkv, GT, D = qg.shape
    H = dout.shape[1]
    do = dout.reshape(B, Hkv, GT, D)  # (B,Hkv,G*T,D)
    dv = p.transpose(0, 1, 3, 2) @ do  # (B,Hkv,S,D): sums over the G heads of each group
    dp = do @ v.transpose(0, 1, 3, 2)  # (B,Hkv,G*T,S)
    # softmax backward: ds = p * (dp - sum_j dp_j p_j), where sum_j dp_j p_j = sum_d dout_d out_d
    # (a sum over D instead of over S).
    delta = (do * out.reshape(B, Hkv, GT, D)).sum(axis=-1, keepdims=True)  # (B,Hkv,G*T,1)
    dp -= delta
    dp *= p  # ds: gradient of the scaled scores
    dq = dp @ k  # (B,Hkv,G*T,D)
    dq *= scale
    dk = dp.transpose(0, 1, 3, 2) @ qg  # (B,Hkv,S,D); qg already carries the scale
    return dq.reshape(B, H, GT // (H // Hkv), D), dk, dv


# ---- SwiGLU gate ------------------------------------------------------------------------------


def _sigmoid(x):
    # tanh form: no overflow warnings for large |x|, exact in both tails.
    xp = array_module(x)
    s = xp.tanh(x * 0.5)
    s += 1.0
    s *= 0.5
    return s


def swiglu_forward(g, u):
    """h = silu(g) * u = g * sigmoid(g) * u ; g, u (..., F) -> h (..., F)."""
    sg = _sigmoid(g)
    silu = g * sg
    h = silu * u
    return h, (u, sg, silu)


def swiglu_backward(dh, cache):
    """dh (..., F) -> dg, du (..., F). silu'(g) = s + silu(g) * (1 - s)."""
    u, sg, silu = cache
    du = dh * silu
    dsilu = 1.0 - sg
    dsilu *= silu
    dsilu += sg  # silu'(g)
    dg = dh * u
    dg *= dsilu
    return dg, du


# ---- token embedding --------------------------------------------------------------------------


def embedding_forward(ids, w):
    """ids (B,T) int, w (V,C) -> x (B,T,C)."""
    return w[ids]


def embedding_backward(dx, ids, vocab):
    """dx (B,T,C) -> dw (V,C): rows of repeated ids accumulate."""
    xp = array_module(dx)
    C = dx.shape[-1]
    dw = xp.zeros((vocab, C), dtype=dx.dtype)
    xp.add.at(dw, ids.reshape(-1), dx.reshape(-1, C))
    return dw


# ---- cross-entropy over logits, -1 targets ignored ---------------------------------------------


def cross_entropy_forward(logits, targets):
    """Summed cross-entropy over the valid rows.

    logits (N,V), targets (N,) int with -1 = ignore -> (loss_sum: 0-d array, n_valid: int, cache).
    A fused, stable log-softmax: log p = (z - max) - log(sum(exp(z - max))).
    The cache holds the softmax probabilities; the backward turns them into the gradient in place.
    """
    xp = array_module(logits)
    N = logits.shape[0]
    valid = targets >= 0  # (N,)
    safe = xp.where(valid, targets, 0)  # (N,)
    rows = xp.arange(N)
    probs = logits - logits.max(axis=-1, keepdims=True)  # (N,V) shifted logits
    picked = probs[rows, safe]  # (N,)
    xp.exp(probs, out=probs)
    sums = probs.sum(axis=-1)  # (N,)
    nll = xp.log(sums) - picked  # (N,)
    loss_sum = (nll * valid).sum()
    probs /= sums[:, None]
    n_valid = int(valid.sum())
    return loss_sum, n_valid, (probs, safe, valid)


def cross_entropy_backward(dloss_sum, cache):
    """dloss_sum: scalar gradient of the summed loss -> dlogits (N,V) = (softmax - onehot) * dloss_sum on valid rows."""
    xp = array_module(cache[0])
    probs, safe, valid = cache
    N = probs.shape[0]
    w = valid.astype(probs.dtype) * dloss_sum  # (N,)
    dlogits = probs
    dlogits *= w[:, None]
    dlogits[xp.arange(N), safe] -= w
    return dlogits


def linear_cross_entropy(x, w, targets, dloss_sum=None):
    """An output head and its cross-entropy in one call: the composition of linear_forward,
    cross_entropy_forward and (when dloss_sum is given) their backwards. Kernel namespaces may fuse it.

    x (N,C), w (V,C), targets (N,) with -1 ignored
    -> (loss_sum: 0-d array, n_valid: int, dx (N,C) or None, dw (V,C) or None).
    """
    logits = linear_forward(x, w)  # (N,V)
    loss_sum, n_valid, cache = cross_entropy_forward(logits, targets)
    del logits
    if dloss_sum is None:
        return loss_sum, n_valid, None, None
    dlogits = cross_entropy_backward(dloss_sum, cache)  # (N,V), reuses the cache's buffer
    dx, dw = linear_backward(dlogits, x, w)
    return loss_sum, n_valid, dx, dw
