"""The layer functions on the GPU: the names, signatures and semantics of `nanoeuler.model.layers`,
with fused CUDA kernels (the `.cu` files beside this one) where they pay off.

`nanoeuler.model.dispatch.ops_for(cupy)` returns this module, so `transformer.py` runs on these without
knowing. Matrix products stay cuBLAS GEMMs through CuPy (`linear_*` are the layers' own functions).
The kernels are float32; any other dtype (a float64 check on the GPU, say) and any shape a kernel
does not cover falls back to the xp-generic layer, which stays the reference for every kernel here.

Caches are this module's own small classes; a backward handed a cache made by `layers` defers to
`layers`, so the two namespaces never mix up each other's caches.

Beyond the layers' API, `linear_cross_entropy` fuses an output head with its cross-entropy: logits
exist one chunk of rows at a time and are overwritten in place by their gradient.
"""

from __future__ import annotations

import functools
import math

import cupy as cp
import numpy as np

from nanoeuler.kernels import kernel, launch_per_item
from nanoeuler.model import layers

F32 = np.dtype(np.float32)

# Unchanged: cuBLAS GEMMs and a gather, through CuPy.
linear_forward = layers.linear_forward
linear_backward = layers.linear_backward
embedding_forward = layers.embedding_forward


def _f32(*arrays) -> bool:
    return all(isinstance(a, cp.ndarray) and a.dtype == F32 for a in arrays)


def _i32(n) -> np.int32:
    return np.int32(n)


def _i64(n) -> np.int64:
    return np.int64(n)


def _elem_strides(a, inner_vec: int = 1):
    """Strides of `a` in elements, or None when a kernel cannot read it in place (the last axis must be
    contiguous; with inner_vec=4 the other strides and the base must allow 16-byte loads)."""
    item = a.itemsize
    if a.strides[-1] != item or any(s < 0 or s % item for s in a.strides):
        return None
    strides = [s // item for s in a.strides]
    if inner_vec > 1 and (any(s % inner_vec for s in strides[:-1]) or a.data.ptr % (4 * inner_vec)):
        return None
    return strides


# ---- RMSNorm -------------------------------------------------------------------------------------


class _NormCache:
    __slots__ = ("x2", "w", "rstd", "shape")

    def __init__(self, x2, w, rstd, shape):
        self.x2, self.w, self.rstd, self.shape = x2, w, rstd, shape


def rmsnorm_forward(x, w, eps):
    """y = x / sqrt(mean(x^2) + eps) * w ; x (..., C), w (C,)."""
    if not _f32(x, w) or x.size == 0:
        return layers.rmsnorm_forward(x, w, eps)
    C = x.shape[-1]
    x2 = cp.ascontiguousarray(x).reshape(-1, C)  # (N,C)
    w = cp.ascontiguousarray(w)
    N = x2.shape[0]
    y = cp.empty_like(x2)
    rstd = cp.empty(N, dtype=F32)
    kernel("rmsnorm", "rmsnorm_fwd")((N,), (256,), (x2, w, y, rstd, _i32(C), np.float32(eps)))
    return y.reshape(x.shape), _NormCache(x2, w, rstd, x.shape)


def rmsnorm_backward(dy, cache):
    """dy (..., C) -> dx (..., C), dw (C,)."""
    if not isinstance(cache, _NormCache):
        return layers.rmsnorm_backward(dy, cache)
    x2, w, rstd = cache.x2, cache.w, cache.rstd
    N, C = x2.shape
    dy2 = cp.ascontiguousarray(dy, dtype=F32).reshape(N, C)
    dx = cp.empty_like(x2)
    kernel("rmsnorm", "rmsnorm_bwd_dx")((N,), (256,), (dy2, x2, w, rstd, dx, _i32(C)))
    seg_rows = max(64, -(-N // 1024))
    nseg = -(-N // seg_rows)
    partial = cp.empty((nseg, C), dtype=F32)
    kernel("rmsnorm", "rmsnorm_bwd_dw_partial")(
        (-(-C // 32), nseg), (32, 8), (dy2, x2, rstd, partial, _i64(N), _i32(C), _i32(seg_rows))
    )
    return dx.reshape(cache.shape), partial.sum(axis=0)


# ---- RoPE ----------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=64)
def _rope_tables_cached(T, head_dim, theta, dtype_str, offset):
    return layers.rope_tables(T, head_dim, theta, cp, np.dtype(dtype_str), offset=offset)


def rope_tables(T, head_dim, theta, xp, dtype, offset=0):
    """cos, sin (T, head_dim//2), computed in float64 on the host once per shape and kept on the device."""
    if xp is not cp:
        return layers.rope_tables(T, head_dim, theta, xp, dtype, offset=offset)
    return _rope_tables_cached(int(T), int(head_dim), float(theta), np.dtype(dtype).str, int(offset))


def _rope(x, cos, sin, sign):
    B, H, T, D = x.shape
    strides = _elem_strides(x)
    if strides is None:
        x = cp.ascontiguousarray(x)
        strides = _elem_strides(x)
    cos = cp.ascontiguousarray(cos)
    sin = cp.ascontiguousarray(sin)
    y = cp.empty((B, H, T, D), dtype=F32)
    pairs = B * H * T * (D // 2)
    launch_per_item(
        kernel("elementwise", "rope_rotate"),
        pairs,
        (
            x,
            _i64(strides[0]),
            _i64(strides[1]),
            _i64(strides[2]),
            cos,
            sin,
            y,
            _i32(H),
            _i32(T),
            _i32(D),
            np.float32(sign),
            _i64(pairs),
        ),
    )
    return y


def _rope_ok(x, cos, sin):
    return (
        _f32(x, cos, sin)
        and x.ndim == 4
        and x.shape[-1] % 2 == 0
        and cos.shape == sin.shape == (x.shape[2], x.shape[3] // 2)
    )


def rope_forward(x, cos, sin):
    """x (B,H,T,D) (any strides), cos/sin (T,D/2) -> y (B,H,T,D), C-contiguous; half-split pairing."""
    if not _rope_ok(x, cos, sin):
        return layers.rope_forward(x, cos, sin)
    return _rope(x, cos, sin, 1.0)


def rope_backward(dy, cos, sin):
    """The transpose of the rotation. dy (B,H,T,D) -> dx (B,H,T,D)."""
    if not _rope_ok(dy, cos, sin):
        return layers.rope_backward(dy, cos, sin)
    return _rope(dy, cos, sin, -1.0)


# ---- causal grouped-query FlashAttention ---------------------------------------------------------

# head size -> (threads per row, rows per block); must match FLASH_KERNELS in attention.cu.
_FLASH = {16: (1, 128), 32: (1, 128), 64: (2, 64), 128: (4, 32)}


class _AttnCache:
    __slots__ = ("q", "k", "v", "out", "lse", "scale")

    def __init__(self, q, k, v, out, lse, scale):
        self.q, self.k, self.v, self.out, self.lse, self.scale = q, k, v, out, lse, scale


def _vec_view(a):
    """(a, strides): `a` itself when the kernels can read it with 16-byte loads, else a contiguous copy."""
    s = _elem_strides(a, inner_vec=4)
    if s is None:
        a = cp.ascontiguousarray(a)
        s = _elem_strides(a, inner_vec=4)
    return a, [_i64(x) for x in s[:3]]


def _attn_ok(q, k, v):
    if not (_f32(q, k, v) and q.ndim == k.ndim == v.ndim == 4):
        return False
    B, H, T, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    return D in _FLASH and k.shape == v.shape and Bk == B and Dk == D and Hkv >= 1 and H % Hkv == 0 and 1 <= T <= S


def attention_forward(q, k, v):
    """Causal GQA attention, q (B,H,T,D), k/v (B,Hkv,S,D), S >= T -> out (B,H,T,D) and the cache.
    Query t sits at position S-T+t; the kernel keeps only a logsumexp per row, never the T x S scores."""
    if not _attn_ok(q, k, v):
        return layers.attention_forward(q, k, v)
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, rows = _FLASH[D]
    scale = 1.0 / math.sqrt(D)
    q, qs = _vec_view(q)
    k, ks = _vec_view(k)
    v, vs = _vec_view(v)
    out = cp.empty((B, H, T, D), dtype=F32)
    lse = cp.empty((B, H, T), dtype=F32)
    kernel("attention", f"flash_fwd_d{D}")(
        (-(-T // rows), B * H),
        (rows * G,),
        (q, *qs, k, *ks, v, *vs, out, lse, _i32(H), _i32(Hkv), _i32(T), _i32(S), np.float32(scale)),
    )
    return out, _AttnCache(q, k, v, out, lse, scale)


def attention_backward(dout, cache):
    """dout (B,H,T,D) -> dq (B,H,T,D), dk (B,Hkv,S,D), dv (B,Hkv,S,D); probabilities recomputed from lse."""
    if not isinstance(cache, _AttnCache):
        return layers.attention_backward(dout, cache)
    q, k, v, out, lse = cache.q, cache.k, cache.v, cache.out, cache.lse
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    G, rows = _FLASH[D]
    qs = [_i64(x) for x in _elem_strides(q)[:3]]
    ks = [_i64(x) for x in _elem_strides(k)[:3]]
    vs = [_i64(x) for x in _elem_strides(v)[:3]]
    dout, ds = _vec_view(cp.asarray(dout, dtype=F32))
    dims = (_i32(H), _i32(Hkv), _i32(T), _i32(S), np.float32(cache.scale))
    delta = cp.empty((B, H, T), dtype=F32)
    n_rows = B * H * T
    kernel("attention", "flash_bwd_delta")(
        (-(-n_rows // 8),), (256,), (out, dout, *ds, delta, _i32(H), _i32(T), _i32(D), _i64(n_rows))
    )
    dk = cp.empty((B, Hkv, S, D), dtype=F32)
    dv = cp.empty((B, Hkv, S, D), dtype=F32)
    kernel("attention", f"flash_bwd_dkdv_d{D}")(
        (-(-S // rows), B * Hkv), (rows * G,), (q, *qs, k, *ks, v, *vs, dout, *ds, lse, delta, dk, dv, *dims)
    )
    dq = cp.empty((B, H, T, D), dtype=F32)
    kernel("attention", f"flash_bwd_dq_d{D}")(
        (-(-T // rows), B * H), (rows * G,), (q, *qs, k, *ks, v, *vs, dout, *ds, lse, delta, dq, *dims)
    )
    return dq, dk, dv


# ---- SwiGLU --------------------------------------------------------------------------------------


class _GluCache:
    __slots__ = ("g", "gld", "u", "uld", "shape")

    def __init__(self, g, gld, u, uld, shape):
        self.g, self.gld, self.u, self.uld, self.shape = g, gld, u, uld, shape


def _rows(a):
    """(a, row stride) for reading `a` (..., F) as N rows of F contiguous floats, copying only when its
    leading axes do not collapse into one evenly strided row axis."""
    item = a.itemsize
    shape, strides = a.shape, a.strides
    ok = strides[-1] == item and all(s >= 0 and s % item == 0 for s in strides)
    dims = [(n, s) for n, s in zip(shape[:-1], strides[:-1]) if n != 1]
    for (n0, s0), (n1, s1) in zip(dims, dims[1:]):
        ok = ok and s0 == n1 * s1
    if not ok:
        a = cp.ascontiguousarray(a)
        return a, a.shape[-1]
    return a, (dims[-1][1] // item if dims else shape[-1])


def swiglu_forward(g, u):
    """h = silu(g) * u ; g, u (..., F) (row-strided views are read in place) -> h (..., F)."""
    if not (_f32(g, u) and g.shape == u.shape and g.ndim >= 1):
        return layers.swiglu_forward(g, u)
    F = g.shape[-1]
    g, gld = _rows(g)
    u, uld = _rows(u)
    h = cp.empty(g.shape, dtype=F32)
    launch_per_item(kernel("elementwise", "swiglu_fwd"), h.size, (g, _i64(gld), u, _i64(uld), h, _i32(F), _i64(h.size)))
    return h, _GluCache(g, gld, u, uld, g.shape)


def swiglu_backward(dh, cache):
    """dh (..., F) -> dg, du (..., F), contiguous."""
    if not isinstance(cache, _GluCache):
        return layers.swiglu_backward(dh, cache)
    g, u, shape = cache.g, cache.u, cache.shape
    dh = cp.ascontiguousarray(dh, dtype=F32)
    dg = cp.empty(shape, dtype=F32)
    du = cp.empty(shape, dtype=F32)
    n = dg.size
    launch_per_item(
        kernel("elementwise", "swiglu_bwd"),
        n,
        (dh, g, _i64(cache.gld), u, _i64(cache.uld), dg, du, _i32(shape[-1]), _i64(n)),
    )
    return dg, du


# ---- token embedding -----------------------------------------------------------------------------


_EMB_SPAN = 16  # sorted keys a block of embedding_bwd scans for the starts of runs of one id


def embedding_backward(dx, ids, vocab):
    """dx (B,T,C) -> dw (V,C); rows of repeated ids accumulate, each id's rows added in position order.

    Deterministic (no float atomics; ZeRO-1 is checked bit for bit against plain data parallelism): the
    keys id * B*T + position, unique, are sorted (one sort of B*T int64s besides the kernel), so each id's
    rows sit together in order whatever the sort's stability, and one block adds each run of equal ids.
    Ids outside [0, V) add nowhere.

        >>> dw = embedding_backward(dx, cp.asarray([[2, 0, 2]]), 4)   # dw[2] = dx[0, 0] + dx[0, 2]  # doctest: +SKIP
    """
    if not _f32(dx):
        return layers.embedding_backward(dx, ids, vocab)
    C = dx.shape[-1]
    dx2 = cp.ascontiguousarray(dx).reshape(-1, C)
    N = dx2.shape[0]
    keys = cp.ascontiguousarray(cp.asarray(ids), dtype=np.int64).reshape(-1) * N  # a new array: ids stay
    if keys.shape[0] != N:
        raise ValueError(f"ids hold {keys.shape[0]} positions, dx {N}")
    dw = cp.zeros((vocab, C), dtype=F32)
    if N and C:
        keys += cp.arange(N, dtype=np.int64)
        keys.sort()
        kernel("elementwise", "embedding_bwd")(
            (-(-N // _EMB_SPAN), -(-C // 128)),
            (128,),
            (dx2, keys, dw, _i64(N), _i32(C), _i32(vocab), _i32(_EMB_SPAN)),
        )
    return dw


# ---- cross-entropy -------------------------------------------------------------------------------


class _CECache:
    __slots__ = ("logits", "targets", "lse")

    def __init__(self, logits, targets, lse):
        self.logits, self.targets, self.lse = logits, targets, lse


def _targets64(targets, n):
    t = cp.ascontiguousarray(cp.asarray(targets), dtype=np.int64).reshape(-1)
    if t.shape[0] != n:
        raise ValueError(f"targets hold {t.shape[0]} rows, logits {n}")
    return t


def _row_major(a):
    """(a, row stride) with unit stride along the last axis, copying only when needed."""
    if a.strides[-1] != a.itemsize or a.strides[0] % a.itemsize or a.strides[0] < 0:
        a = cp.ascontiguousarray(a)
    return a, a.strides[0] // a.itemsize


def _ce_rows(logits, ld, targets, loss_rows, lse, grad, gld, scale, write):
    N, V = logits.shape
    kernel("cross_entropy", "ce_fwd")(
        (N,),
        (256,),
        (
            logits,
            _i64(ld),
            targets,
            loss_rows,
            lse,
            grad,
            _i64(gld),
            np.float32(scale),
            _i32(V),
            _i32(1 if write else 0),
        ),
    )


def cross_entropy_forward(logits, targets):
    """logits (N,V), targets (N,) int with -1 = ignore -> (loss_sum: 0-d array, n_valid: int, cache).
    Keeps one logsumexp per row; the probabilities are recomputed in the backward."""
    if not _f32(logits) or logits.ndim != 2 or logits.shape[0] == 0:
        return layers.cross_entropy_forward(logits, targets)
    N, V = logits.shape
    logits, ld = _row_major(logits)
    t = _targets64(targets, N)
    loss_rows = cp.empty(N, dtype=F32)
    lse = cp.empty(N, dtype=F32)
    _ce_rows(logits, ld, t, loss_rows, lse, loss_rows, 0, 0.0, False)
    n_valid = int((t >= 0).sum())
    return loss_rows.sum(), n_valid, _CECache(logits, t, lse)


def cross_entropy_backward(dloss_sum, cache):
    """dloss_sum -> dlogits (N,V) = (softmax - onehot) * dloss_sum on valid rows, 0 on ignored rows."""
    if not isinstance(cache, _CECache):
        return layers.cross_entropy_backward(dloss_sum, cache)
    logits = cp.ascontiguousarray(cache.logits)
    N, V = logits.shape
    grad = cp.empty((N, V), dtype=F32)
    launch_per_item(
        kernel("cross_entropy", "ce_bwd"),
        N * V,
        (logits, cache.targets, cache.lse, grad, np.float32(float(dloss_sum)), _i32(V), _i64(N * V)),
    )
    return grad


DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024


def linear_cross_entropy(x, w, targets, dloss_sum=None, *, chunk_rows=None):
    """An output head and its cross-entropy, fused and chunked over rows.

    x (N,C) hidden states, w (V,C) head weight, targets (N,) with -1 ignored. Per chunk of rows:
    logits = x_c @ w.T (one GEMM), then one kernel writes each row's loss and, when `dloss_sum` is given,
    overwrites the logits in place with dloss_sum * (softmax - onehot); two more GEMMs give dx_c and add
    into dw. At most one chunk of logits (chunk_rows x V floats, ~64 MiB by default) exists at a time.

    -> (loss_sum: 0-d array, n_valid: int, dx (N,C) or None, dw (V,C) or None); grads only with dloss_sum.
    Equals linear_forward + cross_entropy_forward/backward + linear_backward of `layers`.
    """
    from cupy import cublas

    N, C = x.shape
    V = w.shape[0]
    t = _targets64(targets, N)
    x = cp.ascontiguousarray(x, dtype=F32)
    w = cp.ascontiguousarray(w, dtype=F32)
    R = int(chunk_rows or max(1, DEFAULT_CHUNK_BYTES // (4 * V)))
    R = max(1, min(R, N))
    grads = dloss_sum is not None
    scale = float(dloss_sum) if grads else 0.0
    buf = cp.empty((R, V), dtype=F32)
    loss_rows = cp.empty(N, dtype=F32)
    lse = cp.empty(N, dtype=F32)
    dx = cp.empty((N, C), dtype=F32) if grads else None
    dw = cp.zeros((V, C), dtype=F32) if grads else None
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        xc = x[r0:r1]
        lg = buf[: r1 - r0]
        cublas.gemm("N", "T", xc, w, out=lg)  # (R,V) = x_c @ w.T
        _ce_rows(lg, V, t[r0:r1], loss_rows[r0:r1], lse[r0:r1], lg, V, scale, grads)
        if grads:
            cublas.gemm("N", "N", lg, w, out=dx[r0:r1])  # (R,C) = dlogits @ w
            cublas.gemm("T", "N", lg, xc, out=dw, beta=1.0)  # (V,C) += dlogits.T @ x_c
    n_valid = int((t >= 0).sum())
    return loss_rows.sum(), n_valid, dx, dw
