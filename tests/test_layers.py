"""Each layer on its own: forward against a direct formula, backward against float64 finite differences."""

import math

import numpy as np
import pytest

from nanoeuler.model import layers as L
from nanoeuler.model.dispatch import ops_for

RNG = np.random.default_rng(1234)


def numeric_vjp(f, inputs, dy, h=1e-6):
    """d/d inputs of sum(f(*inputs) * dy), by central differences over every entry (float64)."""
    grads = []
    for x in inputs:
        g = np.zeros_like(x)
        it = np.nditer(x, flags=["multi_index"])
        for _ in it:
            i = it.multi_index
            orig = x[i]
            x[i] = orig + h
            up = np.sum(f(*inputs) * dy)
            x[i] = orig - h
            down = np.sum(f(*inputs) * dy)
            x[i] = orig
            g[i] = (up - down) / (2 * h)
        grads.append(g)
    return grads


def assert_close(analytic, numeric, tol=1e-7):
    err = np.abs(analytic - numeric).max() / max(np.abs(numeric).max(), 1e-12)
    assert err <= tol, f"relative error {err:.2e}"


def randn(*shape):
    return RNG.standard_normal(shape)


def test_ops_for_numpy_is_the_reference():
    assert ops_for(np) is L


# ---- linear -------------------------------------------------------------------------------------


def test_linear():
    x, w = randn(2, 3, 5), randn(4, 5)
    y = L.linear_forward(x, w)
    np.testing.assert_allclose(y, np.einsum("bti,oi->bto", x, w), rtol=1e-12)
    dy = randn(2, 3, 4)
    dx, dw = L.linear_backward(dy, x, w)
    nx, nw = numeric_vjp(L.linear_forward, [x, w], dy)
    assert_close(dx, nx)
    assert_close(dw, nw)


# ---- RMSNorm ------------------------------------------------------------------------------------


def test_rmsnorm():
    x, w = randn(2, 3, 8), 1 + 0.3 * randn(8)
    y, cache = L.rmsnorm_forward(x, w, 1e-5)
    np.testing.assert_allclose(y, x / np.sqrt((x**2).mean(-1, keepdims=True) + 1e-5) * w, rtol=1e-12)
    dy = randn(2, 3, 8)
    dx, dw = L.rmsnorm_backward(dy.copy(), cache)
    nx, nw = numeric_vjp(lambda a, b: L.rmsnorm_forward(a, b, 1e-5)[0], [x, w], dy)
    assert_close(dx, nx)
    assert_close(dw, nw)


def test_rmsnorm_float32_stays_float32():
    x, w = randn(4, 16).astype(np.float32), np.ones(16, np.float32)
    y, cache = L.rmsnorm_forward(x, w, 1e-5)
    dx, dw = L.rmsnorm_backward(np.ones_like(y), cache)
    assert y.dtype == dx.dtype == dw.dtype == np.float32


def test_folded_gain_grads_match_the_unfolded_norm_and_linear():
    """Training xhat @ (w * gain).T gives the gradients of rmsnorm (with its gain) followed by linear."""
    x, gain, w = randn(3, 4, 8), 1 + 0.3 * randn(8), randn(5, 8)
    dy = randn(3, 4, 5)
    # unfolded: y = linear(rmsnorm(x, gain)), gradients through both layers
    h, cache = L.rmsnorm_forward(x, gain, 1e-5)
    dh, dw_ref = L.linear_backward(dy, h, w)
    dx_ref, dgain_ref = L.rmsnorm_backward(dh, cache)
    # folded: y = linear(xhat, w * gain), the norm without a gain
    xhat, cache1 = L.rmsnorm_forward(x, np.ones(8), 1e-5)
    np.testing.assert_allclose(L.linear_forward(xhat, w * gain), L.linear_forward(h, w), rtol=1e-12, atol=1e-12)
    dxhat, dw_folded = L.linear_backward(dy, xhat, w * gain)
    dx, _ = L.rmsnorm_backward(dxhat, cache1)
    dw, dgain = L.folded_gain_grads(w, dw_folded, gain)
    np.testing.assert_allclose(dx, dx_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dw, dw_ref, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(dgain, dgain_ref, rtol=1e-10, atol=1e-12)

    # and against finite differences of the folded product in (w, gain)
    def f(w_, g_):
        return L.linear_forward(xhat, w_ * g_)

    nw, ng = numeric_vjp(f, [w.copy(), gain.copy()], dy)
    assert_close(dw, nw)
    assert_close(dgain, ng)


# ---- RoPE ---------------------------------------------------------------------------------------


def test_rope_tables_and_half_split_rotation():
    T, D, theta = 5, 8, 10000.0
    cos, sin = L.rope_tables(T, D, theta, np, np.float64, offset=3)
    assert cos.shape == sin.shape == (T, D // 2)
    x = randn(1, 2, T, D)
    y = L.rope_forward(x, cos, sin)
    # element i pairs with i + D/2, rotated by angle pos * theta^(-2i/D): a complex multiplication
    for t in range(T):
        for i in range(D // 2):
            ang = (t + 3) * theta ** (-2 * i / D)
            z = (x[..., t, i] + 1j * x[..., t, i + D // 2]) * np.exp(1j * ang)
            np.testing.assert_allclose(y[..., t, i], z.real, atol=1e-12)
            np.testing.assert_allclose(y[..., t, i + D // 2], z.imag, atol=1e-12)
    assert y.flags.c_contiguous
    # a rotation keeps norms, and the backward (transpose) undoes it
    np.testing.assert_allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-12)
    np.testing.assert_allclose(L.rope_backward(y, cos, sin), x, atol=1e-12)


def test_rope_backward():
    cos, sin = L.rope_tables(4, 6, 100.0, np, np.float64)
    x = randn(2, 3, 4, 6).transpose(0, 2, 1, 3).copy().transpose(0, 2, 1, 3)  # non-contiguous input
    dy = randn(2, 3, 4, 6)
    (nx,) = numeric_vjp(lambda a: L.rope_forward(a, cos, sin), [x], dy)
    assert_close(L.rope_backward(dy, cos, sin), nx)


# ---- attention ----------------------------------------------------------------------------------


def naive_attention(q, k, v):
    """Loops, explicit repeated K/V, bottom-right causal mask."""
    B, H, T, D = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    out = np.zeros_like(q)
    for b in range(B):
        for h in range(H):
            kv = h // (H // Hkv)
            for t in range(T):
                visible = S - T + t + 1
                s = k[b, kv, :visible] @ q[b, h, t] / math.sqrt(D)
                p = np.exp(s - s.max())
                p /= p.sum()
                out[b, h, t] = p @ v[b, kv, :visible]
    return out


@pytest.mark.parametrize("H,Hkv,T,S", [(4, 2, 5, 5), (6, 2, 4, 4), (3, 3, 3, 3), (4, 1, 2, 6), (2, 1, 1, 4)])
def test_attention_forward_matches_loops(H, Hkv, T, S):
    q, k, v = randn(2, H, T, 4), randn(2, Hkv, S, 4), randn(2, Hkv, S, 4)
    out, _ = L.attention_forward(q, k, v)
    np.testing.assert_allclose(out, naive_attention(q, k, v), rtol=1e-10, atol=1e-12)


def test_attention_is_causal():
    q, k, v = randn(1, 2, 6, 4), randn(1, 1, 6, 4), randn(1, 1, 6, 4)
    out, _ = L.attention_forward(q, k, v)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 4:] += 5.0
    v2[:, :, 4:] -= 3.0
    out2, _ = L.attention_forward(q, k2, v2)
    np.testing.assert_array_equal(out[:, :, :4], out2[:, :, :4])


@pytest.mark.parametrize("H,Hkv,T,S", [(4, 2, 5, 5), (6, 3, 3, 3), (4, 1, 2, 5)])
def test_attention_backward(H, Hkv, T, S):
    q, k, v = randn(2, H, T, 4), randn(2, Hkv, S, 4), randn(2, Hkv, S, 4)
    dout = randn(2, H, T, 4)
    _, cache = L.attention_forward(q, k, v)
    dq, dk, dv = L.attention_backward(dout, cache)
    nq, nk, nv = numeric_vjp(lambda a, b, c: L.attention_forward(a, b, c)[0], [q, k, v], dout)
    assert_close(dq, nq)
    assert_close(dk, nk)
    assert_close(dv, nv)


def test_attention_large_scores_are_stable():
    q, k, v = 300 * randn(1, 2, 4, 4), 300 * randn(1, 1, 4, 4), randn(1, 1, 4, 4)
    out, _ = L.attention_forward(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    assert np.isfinite(out).all()


# ---- SwiGLU -------------------------------------------------------------------------------------


def test_swiglu():
    g, u = 3 * randn(3, 7), randn(3, 7)
    h, cache = L.swiglu_forward(g, u)
    np.testing.assert_allclose(h, g / (1 + np.exp(-g)) * u, rtol=1e-12)
    dh = randn(3, 7)
    dg, du = L.swiglu_backward(dh, cache)
    ng, nu = numeric_vjp(lambda a, b: L.swiglu_forward(a, b)[0], [g, u], dh)
    assert_close(dg, ng)
    assert_close(du, nu)


def test_swiglu_extreme_inputs_are_finite():
    g = np.array([-1e4, -100.0, 0.0, 100.0, 1e4], dtype=np.float32)
    h, cache = L.swiglu_forward(g, np.ones_like(g))
    dg, du = L.swiglu_backward(np.ones_like(g), cache)
    assert np.isfinite(h).all() and np.isfinite(dg).all()
    np.testing.assert_allclose(h, [0, 0, 0, 100, 1e4], atol=1e-30)


# ---- embedding ----------------------------------------------------------------------------------


def test_embedding_repeated_ids_accumulate():
    w = randn(6, 3)
    ids = np.array([[1, 4, 1], [0, 1, 5]])
    np.testing.assert_array_equal(L.embedding_forward(ids, w), w[ids])
    dx = randn(2, 3, 3)
    dw = L.embedding_backward(dx, ids, 6)
    (nw,) = numeric_vjp(lambda a: L.embedding_forward(ids, a), [w], dx)
    assert_close(dw, nw)
    np.testing.assert_allclose(dw[1], dx[0, 0] + dx[0, 2] + dx[1, 1])
    assert not dw[2].any() and not dw[3].any()


# ---- cross-entropy ------------------------------------------------------------------------------


def test_cross_entropy_with_ignored_targets():
    logits = 2 * randn(6, 5)
    targets = np.array([0, 4, -1, 2, -1, 1])
    loss_sum, n, cache = L.cross_entropy_forward(logits, targets)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    valid = targets >= 0
    assert n == 4
    np.testing.assert_allclose(loss_sum, -logp[valid, targets[valid]].sum(), rtol=1e-12)
    dl = L.cross_entropy_backward(0.7, cache)
    (nl,) = numeric_vjp(lambda a: np.asarray(L.cross_entropy_forward(a, targets)[0]), [logits], np.array(0.7))
    assert_close(dl, nl)
    assert not dl[~valid].any()


def test_cross_entropy_all_ignored():
    loss_sum, n, cache = L.cross_entropy_forward(randn(3, 4), np.full(3, -1))
    assert n == 0 and float(loss_sum) == 0.0
    assert not L.cross_entropy_backward(1.0, cache).any()


def test_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [-5e3, 5e3, 0.0]], dtype=np.float32)
    loss_sum, n, cache = L.cross_entropy_forward(logits, np.array([1, 1]))
    assert np.isfinite(loss_sum) and abs(float(loss_sum) - 1e4) < 1.0
    dl = L.cross_entropy_backward(1.0, cache)
    assert np.isfinite(dl).all()
    np.testing.assert_allclose(dl, [[1, -1, 0], [0, 0, 0]], atol=1e-6)


def test_linear_cross_entropy_is_the_composition():
    x, w = randn(6, 4), randn(5, 4)
    targets = np.array([0, 4, -1, 2, 3, -1])
    loss_sum, n, dx, dw = L.linear_cross_entropy(x, w, targets, 0.5)
    ref_sum, ref_n, _ = L.cross_entropy_forward(L.linear_forward(x, w), targets)
    assert n == ref_n == 4 and float(loss_sum) == pytest.approx(float(ref_sum), rel=1e-14)
    f = lambda a, b: np.asarray(L.linear_cross_entropy(a, b, targets)[0])  # noqa: E731
    nx, nw = numeric_vjp(f, [x, w], np.array(0.5))
    assert_close(dx, nx)
    assert_close(dw, nw)
    assert L.linear_cross_entropy(x, w, targets)[2:] == (None, None)
