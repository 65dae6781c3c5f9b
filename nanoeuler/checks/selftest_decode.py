"""Self-test cases of the decode engine's kernels (`kernels/decode/`), a case per family, run by
`nanoeuler selftest` through the families' own launchers.

Same rules as the other cases: fresh random inputs, new allocations poisoned (NaN bytes), a float64 NumPy
reference on exactly the values the GPU sees (weights and caches stored as bf16 are rounded first), relative
error ||out - ref|| / ||ref||. Tolerances: 1e-5 where the kernel's arithmetic is float32 (the weights' own
rounding is in the reference); 1e-4 for the tensor-core GEMV, whose activations keep about 16 bits (bf16
hi + lo); 1e-2 for outputs stored as bf16; 0 for token ids and control words, which must be exact; the
sampler's drawn frequencies against `sampling_probs` within 0.08 (20,000 draws of 50 tokens: about 0.02
expected), and none outside the tokens it keeps.
"""

from __future__ import annotations

import numpy as np

from nanoeuler.checks.selftest_bf16 import TOL_BF16, TOL_FP32, from_bf16, to_bf16

TOL_TC = 1e-4
EPS = 1e-5


def _randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


def _g(a, dtype=np.float32):
    import cupy

    return cupy.asarray(np.asarray(a, dtype=dtype))


def _stored(rng, shape, dtype, scale=1.0):
    """Random values in a decode kernel's storage: (device array, the float64 values it holds)."""
    v = _randn(rng, shape, scale)
    if dtype == "bf16":
        b = to_bf16(v)
        return _g(b, np.uint16), from_bf16(b)
    return _g(v), v


def _host(a, dtype):
    """A device array of the storage as float64."""
    return from_bf16(a.get()) if dtype == "bf16" else a.get().astype(np.float64)


def _tol(dtype):
    """The tolerance of an output stored in `dtype`."""
    return TOL_BF16 if dtype == "bf16" else TOL_FP32


def _normed(x, gain):
    from nanoeuler.model import layers

    return layers.rmsnorm_forward(x, gain, EPS)[0]


def _swiglu(g, u):
    from nanoeuler.model import layers

    return layers.swiglu_forward(g, u)[0]


def _rotated(v, pos, cos, sin):
    """v (rows, heads, D) rotated at each row's position, as layers.rope_forward."""
    from nanoeuler.model import layers

    return np.stack(
        [
            layers.rope_forward(v[m][None, :, None, :], cos[p : p + 1], sin[p : p + 1])[0, :, 0]
            for m, p in enumerate(pos)
        ]
    )


def _meta(ids, slots, pos):
    return _g(np.concatenate([ids, slots, pos]), np.int32)


def _rope_world(rng, M, H, Hkv, D, L, K, dtype):
    """A qkv weight, rows of x, a cache of M slots with one row per slot at a random position, the tables."""
    from nanoeuler.model import layers

    w, wr = _stored(rng, ((H + 2 * Hkv) * D, K), dtype, 1 / np.sqrt(K))
    kc, kr = _stored(rng, (M, Hkv, L, D), dtype)
    vc, vr = _stored(rng, (M, Hkv, L, D), dtype)
    pos = rng.integers(0, L, M)
    pos[0] = L - 1
    cos, sin = layers.rope_tables(L, D, 10000.0, np, np.float32)
    return w, wr, kc, vc, pos, cos.astype(np.float64), sin.astype(np.float64)


def _qkv_rows(name, dtype, got_q, kc, vc, qkv, pos, H, Hkv, D, cos, sin, q_tol):
    """The rows of a qkv-with-RoPE check: q, and the cache rows each row wrote (its slot = its index)."""
    M = len(pos)
    q, k, v = np.split(qkv.reshape(M, H + 2 * Hkv, D), [H, H + Hkv], axis=1)
    rows = np.arange(M)
    return [
        (f"{name} q", got_q, _rotated(q, pos, cos, sin), q_tol),
        (f"{name} k cache", _host(kc, dtype)[rows, :, pos], _rotated(k, pos, cos, sin), _tol(dtype)),
        (f"{name} v cache", _host(vc, dtype)[rows, :, pos], v, _tol(dtype)),
    ]


# ---- gemv, tgemv ------------------------------------------------------------------------------------


def _products(rng, M, N, K, dtype, run, epis):
    """y = W norm(x + x2) by `run(epi, w, x, x2, gain, y, N)` for each epilogue: store, store2, swiglu on
    the norm, add (y +=) on x alone."""
    import cupy

    x, x2, gain = _randn(rng, (M, K)), _randn(rng, (M, K), 0.5), 1.0 + _randn(rng, (K,), 0.3)
    w, wr = _stored(rng, (2 * N, K), dtype, 1 / np.sqrt(K))
    h = _normed(x + x2, gain)
    out = []
    for epi in epis:
        width = {"store": N, "store2": 2 * N, "swiglu": N, "add": N}[epi]
        y0 = _randn(rng, (M, width))
        y = _g(y0) if epi == "add" else cupy.empty((M, width), cupy.float32)
        if epi == "add":
            run(epi, w, _g(x), None, None, y, N)
            ref = y0 + x @ wr[:N].T
        else:
            run(epi, w, _g(x), _g(x2), _g(gain), y, N)
            ref = {"store": h @ wr[:N].T, "store2": h @ wr.T, "swiglu": _swiglu(h @ wr[:N].T, h @ wr[N:].T)}[epi]
        out.append((epi, y, ref))
    return out


def case_decode_gemv(rng, shape):
    """shape (M, N, K, dtype): the float GEMV's epilogues over M rows of K (store, store2, swiglu on
    norm(x + x2), add on x), the qkv product with RoPE and the cache write, and head 0's argmax of one row
    with the chained step's bookkeeping."""
    import cupy

    from nanoeuler.kernels.decode import Launch, gemv

    M, N, K, dtype = shape
    go = Launch(dtype)

    def run(epi, w, x, x2, gain, y, n):
        gemv.gemv(go, epi, w, x, x2, gain, y, M, n, K, EPS)

    rows = [
        (f"decode gemv {epi}", y, ref, TOL_FP32)
        for epi, y, ref in _products(rng, M, N, K, dtype, run, ("store", "store2", "swiglu", "add"))
    ]
    H, Hkv, D, L = 4, 2, 32, 40
    w, wr, kc, vc, pos, cos, sin = _rope_world(rng, M, H, Hkv, D, L, K, dtype)
    x, x2, gain = _randn(rng, (M, K)), _randn(rng, (M, K), 0.5), 1.0 + _randn(rng, (K,), 0.3)
    q = cupy.empty((M, H, D), cupy.float32)
    gemv.gemv_rope(
        go,
        w,
        _g(x),
        _g(x2),
        _g(gain),
        q,
        kc,
        vc,
        _meta(np.zeros(M), np.arange(M), pos),
        _g(cos),
        _g(sin),
        M,
        H,
        Hkv,
        D,
        L,
        K,
        EPS,
    )
    rows += _qkv_rows(
        "decode gemv_rope", dtype, q, kc, vc, _normed(x + x2, gain) @ wr.T, pos, H, Hkv, D, cos, sin, TOL_FP32
    )
    return rows + _head_argmax(rng, go, K, dtype)


def _head_argmax(rng, go, K, dtype):
    """One row's head-0 argmax (`chain`: the step's record and the next input, as argmax_chain does)."""
    import cupy

    from nanoeuler.kernels.decode import gemv

    V, L, cap, step, pos = 1000, 64, 8, 11, 63
    x, x2, gain = _randn(rng, (1, K)), _randn(rng, (1, K), 0.5), 1.0 + _randn(rng, (K,), 0.3)
    h = _normed(x + x2, gain)
    wv = _randn(rng, (V, K), 1 / np.sqrt(K))
    wv[np.argmax(h @ wv.T)] *= 1.25  # a clear winner: float sums in any order agree on it
    w, wr = (_g(to_bf16(wv), np.uint16), from_bf16(to_bf16(wv))) if dtype == "bf16" else (_g(wv), wv)
    want = int(np.argmax(h @ wr.T))
    best, arrive = cupy.zeros(1, cupy.uint64), cupy.zeros(1, cupy.int32)
    out, hist = cupy.empty(1, cupy.int32), cupy.zeros(cap, cupy.int32)
    ctl0 = np.array([7, 0, pos, 0, step, 0, 0], np.int32)
    ctl = _g(ctl0, np.int32)
    gemv.head_argmax(go, w, _g(x), _g(x2), _g(gain), V, K, EPS, best, arrive, out, ctl, hist, cap, L, True)
    ctl_want = ctl0.copy()
    ctl_want[[0, 2, 4]] = want, min(pos + 1, L - 1), step + 1
    hist_want = np.zeros(cap)
    hist_want[step % cap] = want
    return [
        ("decode head_argmax id", out, [want], 0.0),
        ("decode head_argmax next ctl", ctl, ctl_want, 0.0),
        ("decode head_argmax record", hist, hist_want, 0.0),
        (
            "decode head_argmax reset",
            cupy.concatenate([best.view(cupy.int64), arrive.astype(cupy.int64)]),
            np.zeros(2),
            0.0,
        ),
    ]


def case_decode_tgemv(rng, shape):
    """shape (M, N, K): the tensor-core GEMV (bf16 weights) of M rows: store and add with the chunks a warp
    that K takes (4 or 8), swiglu and the qkv product with RoPE (4 chunks) where K allows them."""
    import cupy

    from nanoeuler.kernels.decode import Launch, plan, tgemv

    M, N, K = shape
    go = Launch("bf16")
    ch = plan.tc_chunks(M, K, "bf16")
    paired = plan.tc_chunks(M, K, "bf16", paired=True)
    if not ch:
        raise ValueError(f"no tensor-core GEMV for {M} rows of {K}")

    def run(epi, w, x, x2, gain, y, n):
        tgemv.tgemv(go, epi, paired if epi == "swiglu" else ch, w, x, x2, gain, y, M, n, K, EPS)

    epis = ("store", "add") + (("swiglu",) if paired else ())
    rows = [
        (f"decode tgemv {epi} c{paired if epi == 'swiglu' else ch}", y, ref, TOL_TC)
        for epi, y, ref in _products(rng, M, N, K, "bf16", run, epis)
    ]
    if paired:
        H, Hkv, D, L = 4, 2, 32, 40
        w, wr, kc, vc, pos, cos, sin = _rope_world(rng, M, H, Hkv, D, L, K, "bf16")
        x, x2, gain = _randn(rng, (M, K)), _randn(rng, (M, K), 0.5), 1.0 + _randn(rng, (K,), 0.3)
        q = cupy.empty((M, H, D), cupy.float32)
        tgemv.tgemv_rope(
            go,
            paired,
            w,
            _g(x),
            _g(x2),
            _g(gain),
            q,
            kc,
            vc,
            _meta(np.zeros(M), np.arange(M), pos),
            _g(cos),
            _g(sin),
            M,
            H,
            Hkv,
            D,
            L,
            K,
            EPS,
        )
        rows += _qkv_rows(
            f"decode tgemv_rope c{paired}",
            "bf16",
            q,
            kc,
            vc,
            _normed(x + x2, gain) @ wr.T,
            pos,
            H,
            Hkv,
            D,
            cos,
            sin,
            TOL_TC,
        )
    return rows


# ---- attend, attend_o -------------------------------------------------------------------------------


def _attention_world(rng, M, H, Hkv, D, L, dtype):
    """q of M rows (one a slot, positions from 0 to L - 1), the slots' caches, and each row's attention over
    its keys 0..pos in float64, (M, H, D)."""
    from nanoeuler.model import layers

    kc, kr = _stored(rng, (M, Hkv, L, D), dtype)
    vc, vr = _stored(rng, (M, Hkv, L, D), dtype)
    pos = rng.integers(0, L, M)
    pos[0], pos[-1] = 0, L - 1
    q = _randn(rng, (M, H, D), 1.5)
    ref = np.stack(
        [
            layers.attention_forward(q[m][None, :, None, :], kr[m][None, :, : p + 1], vr[m][None, :, : p + 1])[0][
                0, :, 0
            ]
            for m, p in enumerate(pos)
        ]
    )
    return q, kc, vc, _meta(np.zeros(M), np.arange(M), pos), pos, ref


def case_decode_attend(rng, shape):
    """shape (M, H, Hkv, D, L, dtype): attention of M rows over their slots' caches: attend (float out, the
    GEMV path), attend_act (out in the storage, the cuBLAS path), attend_kv_act where its shapes apply."""
    import cupy

    from nanoeuler.kernels.decode import Launch, attend, plan

    M, H, Hkv, D, L, dtype = shape
    go = Launch(dtype)
    q, kc, vc, meta, _, ref = _attention_world(rng, M, H, Hkv, D, L, dtype)
    wt = cupy.uint16 if dtype == "bf16" else cupy.float32
    out, act = cupy.empty((M, H, D), cupy.float32), cupy.empty((M, H, D), wt)
    attend.attend(go, _g(q), kc, vc, meta, out, M, H, Hkv, D, L)
    attend.attend_act(go, _g(q), kc, vc, meta, act, M, H, Hkv, D, L)
    rows = [("decode attend", out, ref, TOL_FP32), ("decode attend_act", _host(act, dtype), ref, _tol(dtype))]
    lanes = D // plan.vec(dtype)
    if D % plan.vec(dtype) == 0 and 32 % lanes == 0 and H // Hkv <= plan.KV_MAXG:
        kv = cupy.empty((M, H, D), wt)
        attend.attend_kv_act(go, _g(q), kc, vc, meta, kv, M, H, Hkv, D, L)
        rows.append(("decode attend_kv_act", _host(kv, dtype), ref, _tol(dtype)))
    return rows


def case_decode_attend_o(rng, shape):
    """shape (M, H, Hkv, D, L, C, dtype): x += dx + W_o attention(q over the cache), dx cleared: attend_o
    (every block over all keys), and on compute capability 9.0 attend_o_cluster with the keys split over
    the cluster (from 3 keys on: blocks with no key, one and several) and with every block alone."""
    import cupy

    from nanoeuler.kernels.decode import Launch, attend_o, plan

    M, H, Hkv, D, L, C, dtype = shape
    go = Launch(dtype)
    q, kc, vc, meta, _, att = _attention_world(rng, M, H, Hkv, D, L, dtype)
    wo, wor = _stored(rng, (C, H * D), dtype, 1 / np.sqrt(H * D))
    x0, dx0 = _randn(rng, (M, C)), _randn(rng, (M, C), 0.5)
    want = x0 + dx0 + att.reshape(M, H * D) @ wor.T
    dev = cupy.cuda.Device()
    runs = [
        (
            "attend_o",
            lambda x, dx: attend_o.attend_o(
                go, _g(q), kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C, dev.attributes["MultiProcessorCount"]
            ),
        )
    ]
    if int(dev.compute_capability) >= 90 and D % plan.vec(dtype) == 0 and D // plan.vec(dtype) <= 32:
        for label, alone in (("split", 2), ("alone", L)):
            runs.append(
                (
                    f"attend_o_cluster {label}",
                    lambda x, dx, alone=alone: attend_o.attend_o_cluster(
                        go, _g(q), kc, vc, meta, wo, x, dx, M, H, Hkv, D, L, C, alone
                    ),
                )
            )
    rows = []
    for label, run in runs:
        x, dx = _g(x0), _g(dx0)
        run(x, dx)
        rows += [(f"decode {label} x", x, want, TOL_FP32), (f"decode {label} dx cleared", dx, np.zeros((M, C)), 0.0)]
    return rows


# ---- mlp, elementwise ---------------------------------------------------------------------------------


def case_decode_mlp(rng, shape):
    """shape (C, F, dtype): one row's dx += W_down (silu(W_gate norm(x)) * W_up norm(x)) in one kernel."""
    from nanoeuler.kernels.decode import Launch, mlp

    C, F, dtype = shape
    go = Launch(dtype)
    x, gain, dx0 = _randn(rng, (1, C)), 1.0 + _randn(rng, (C,), 0.3), _randn(rng, (1, C))
    wgu, wgur = _stored(rng, (2 * F, C), dtype, 1 / np.sqrt(C))
    wd, wdr = _stored(rng, (C, F), dtype, 1 / np.sqrt(F))
    h = _normed(x, gain)
    dx = _g(dx0)
    mlp.swiglu_down(go, wgu, wd, _g(x), _g(gain), dx, F, C, EPS)
    return [("decode swiglu_down dx", dx, dx0 + _swiglu(h @ wgur[:F].T, h @ wgur[F:].T) @ wdr.T, TOL_FP32)]


def case_decode_elementwise(rng, shape):
    """shape (M, C, F, V, dtype): the embedding (x = emb[id], dx = 0), the norm and the SwiGLU into GEMM
    operands of the storage, and RoPE with the cache write, for decode rows (one a slot) and for a prefill
    (one slot, positions 0..M-1, also into the FlashAttention's operands)."""
    import cupy

    from nanoeuler.kernels.decode import Launch, elementwise

    M, C, F, V, dtype = shape
    go = Launch(dtype)
    wt = cupy.uint16 if dtype == "bf16" else cupy.float32
    emb, embr = _stored(rng, (V, C), dtype)
    ids = rng.integers(0, V, M)
    x, dx = cupy.empty((M, C), cupy.float32), cupy.empty((M, C), cupy.float32)
    elementwise.embed(go, _meta(ids, np.arange(M), np.zeros(M)), emb, x, dx, M, C)
    rows = [("decode embed x", x, embr[ids], TOL_FP32), ("decode embed dx", dx, np.zeros((M, C)), 0.0)]
    xs, gain = _randn(rng, (M, C)), 1.0 + _randn(rng, (C,), 0.3)
    a = cupy.empty((M, C), wt)
    elementwise.rmsnorm_act(go, _g(xs), _g(gain), a, M, C, EPS)
    gu = _randn(rng, (M, 2 * F), 2.0)
    m = cupy.empty((M, F), wt)
    elementwise.swiglu_act(go, _g(gu), m, M, F)
    rows += [
        ("decode rmsnorm_act", _host(a, dtype), _normed(xs, gain), _tol(dtype)),
        ("decode swiglu_act", _host(m, dtype), _swiglu(gu[:, :F], gu[:, F:]), _tol(dtype)),
    ]
    H, Hkv, D, L = 4, 2, 32, max(40, M)
    _, _, kc, vc, pos, cos, sin = _rope_world(rng, M, H, Hkv, D, L, 8, dtype)
    qkv = _randn(rng, (M, (H + 2 * Hkv) * D))
    q = cupy.empty((M, H, D), cupy.float32)
    elementwise.rope_cache(
        go,
        _g(qkv),
        _meta(np.zeros(M), np.arange(M), pos),
        q,
        kc,
        vc,
        _g(cos),
        _g(sin),
        None,
        None,
        None,
        M,
        H,
        Hkv,
        D,
        L,
    )
    rows += _qkv_rows("decode rope_cache", dtype, q, kc, vc, qkv, pos, H, Hkv, D, cos, sin, TOL_FP32)
    # a prefill: slot 0, positions 0..M-1; q, k, v also into the FlashAttention's (heads, rows, D) operands
    _, _, kc, vc, _, _, _ = _rope_world(rng, 1, H, Hkv, D, L, 8, dtype)
    qh, kh, vh = cupy.empty((H, M, D), wt), cupy.empty((Hkv, M, D), wt), cupy.empty((Hkv, M, D), wt)
    elementwise.rope_cache(
        go,
        _g(qkv),
        _meta(np.zeros(M), np.zeros(M), np.arange(M)),
        q,
        kc,
        vc,
        _g(cos),
        _g(sin),
        qh,
        kh,
        vh,
        M,
        H,
        Hkv,
        D,
        L,
    )
    qr, kr, vr = np.split(qkv.reshape(M, H + 2 * Hkv, D), [H, H + Hkv], axis=1)
    qr, kr = _rotated(qr, np.arange(M), cos, sin), _rotated(kr, np.arange(M), cos, sin)
    rows += [
        ("decode rope_cache prefill q", _host(qh, dtype), qr.transpose(1, 0, 2), _tol(dtype)),
        ("decode rope_cache prefill k", _host(kh, dtype), kr.transpose(1, 0, 2), _tol(dtype)),
        ("decode rope_cache prefill v", _host(vh, dtype), vr.transpose(1, 0, 2), _tol(dtype)),
        ("decode rope_cache prefill k cache", _host(kc, dtype)[0, :, :M], kr.transpose(1, 0, 2), _tol(dtype)),
    ]
    return rows


# ---- sampling -------------------------------------------------------------------------------------------


def case_decode_sampling(rng, shape):
    """shape (M, V): the argmax of rows (a stride past V; a row of ties gives 0), the greedy step that feeds
    itself (ids, positions kept below the context, the record, the step counter), the speculative pass
    that keeps the drafts head 0 confirms, and sampling: top_k = 1 is the argmax, and 20,000 draws of
    one row follow `sampling_probs` (temperature, top-k, top-p)."""
    import cupy

    from nanoeuler.infer.sampling import sampling_probs
    from nanoeuler.kernels.decode import Launch, sampling

    M, V = shape
    go = Launch("fp32")
    z = _randn(rng, (M, V + 3), 2.0)
    z[np.arange(M), rng.integers(0, V, M)] += 10.0  # a clear maximum in each row
    z[-1] = 1.0  # every logit the same: the lowest index
    want = np.argmax(z[:, :V], axis=1)
    out = cupy.empty(M, cupy.int32)
    sampling.argmax_rows(go, _g(z), V, V + 3, out, M)
    rows = [("decode argmax_rows", out, want, 0.0)]
    # a chained greedy step of M rows: the ids become the inputs, positions move on below L
    L, cap, step = 64, 8, 13
    zc = np.ascontiguousarray(z[:, :V])
    pos = rng.integers(0, L, M)
    pos[0] = L - 1
    ctl0 = np.concatenate([rng.integers(0, V, M), np.arange(M), pos, [0, step, 0, 0]]).astype(np.int32)
    ctl, hist, arrive = _g(ctl0, np.int32), cupy.zeros(cap * M, cupy.int32), cupy.zeros(1, cupy.int32)
    out = cupy.empty(M, cupy.int32)
    sampling.argmax_chain(go, _g(zc), V, out, ctl, hist, cap, L, arrive, M)
    ctl_want, hist_want = ctl0.copy(), np.zeros(cap * M)
    ctl_want[:M], ctl_want[2 * M : 3 * M], ctl_want[3 * M + 1] = want, np.minimum(pos + 1, L - 1), step + 1
    hist_want[(step % cap) * M : (step % cap + 1) * M] = want
    rows += [
        ("decode argmax_chain ids", out, want, 0.0),
        ("decode argmax_chain next ctl", ctl, ctl_want, 0.0),
        ("decode argmax_chain record", hist, hist_want, 0.0),
        ("decode argmax_chain reset", arrive, [0], 0.0),
    ]
    rows += _accept_chain(rng, go, V)
    # sampling: top_k 1 is the argmax; one row drawn 20,000 times follows sampling_probs
    samp = np.zeros(4, np.int32)
    samp[:2] = 1, 5
    samp[2:] = np.array([0.8, 1.0], np.float32).view(np.int32)
    picked = cupy.empty(M, cupy.int32)
    sampling.sample_rows(go, _g(z), V, V + 3, _g(samp, np.int32), cupy.arange(M, dtype=cupy.uint64), picked, M)
    rows.append(("decode sample_rows top_k 1", picked[: M - 1], want[: M - 1], 0.0))  # (the last row: all tie)
    R, row = 20000, _randn(rng, (50,), 2.0)
    for T, k, p in ((1.0, 0, 1.0), (0.7, 10, 0.9)):
        samp[:2] = k, 7
        samp[2:] = np.array([T, p], np.float32).view(np.int32)
        drawn = cupy.empty(R, cupy.int32)
        sampling.sample_rows(
            go,
            _g(np.tile(row, (R, 1))),
            row.size,
            row.size,
            _g(samp, np.int32),
            cupy.arange(R, dtype=cupy.uint64) * 0x9E3779B97F4A7C15,
            drawn,
            R,
        )
        freq, probs = np.bincount(drawn.get(), minlength=row.size) / R, sampling_probs(row, T, k, p)
        rows += [
            (f"decode sample_rows T{T} k{k} p{p}", freq, probs, 0.08),
            (f"decode sample_rows T{T} k{k} p{p} none outside", freq[probs == 0], np.zeros((probs == 0).sum()), 0.0),
        ]
    return rows


def _accept_chain(rng, go, V, K=4, cap=8, passes=5):
    """A verify pass of K rows [sure, drafts]: head 0 confirms the first two drafts, not the third."""
    import cupy

    from nanoeuler.kernels.decode import sampling

    block = rng.integers(0, V, K)
    heads = rng.integers(0, V, (K, K))  # heads[row, head]: every head's argmax at each row
    heads[0, 0], heads[1, 0], heads[2, 0] = block[1], block[2], (block[3] + 1) % V
    a, p0 = 2, 30
    ctl0 = np.concatenate([block, np.zeros(K), p0 + np.arange(K), [0, passes, 0, 0]]).astype(np.int32)
    ctl, hist = _g(ctl0, np.int32), cupy.zeros(cap * (2 * K + 1), cupy.int32)
    sampling.accept_chain(go, _g(heads.reshape(-1), np.int32), ctl, hist, cap, K)
    ctl_want = ctl0.copy()
    ctl_want[:K], ctl_want[2 * K : 3 * K], ctl_want[3 * K + 1] = heads[a], p0 + a + 1 + np.arange(K), passes + 1
    hist_want = np.zeros(cap * (2 * K + 1))
    rec = (passes % cap) * (2 * K + 1)
    hist_want[rec : rec + 2 * K + 1] = np.concatenate([[a], block, heads[a]])
    return [("decode accept_chain next ctl", ctl, ctl_want, 0.0), ("decode accept_chain record", hist, hist_want, 0.0)]


# (function, shape, shape label, keyword arguments); shapes of the `gpu` preset (C 768, F 2048, H 12/4,
# D 64, 4 heads of V 4096) and others that are not multiples of the kernels' tiles
CASES_DECODE = [
    (case_decode_gemv, (1, 768, 768, "bf16"), "M1 N768 K768 bf16", {}),
    (case_decode_gemv, (5, 300, 2048, "bf16"), "M5 N300 K2048 bf16 (U 8)", {}),
    (case_decode_gemv, (3, 100, 768, "fp32"), "M3 N100 K768 fp32", {}),
    (case_decode_gemv, (2, 37, 341, "fp32"), "M2 N37 K341 fp32 (rows not 16-byte aligned)", {}),
    (case_decode_tgemv, (4, 768, 768), "M4 N768 K768 (4 chunks)", {}),
    (case_decode_tgemv, (16, 100, 2048), "M16 N100 K2048 (8 chunks)", {}),
    (case_decode_tgemv, (2, 37, 96), "M2 N37 K96 (short chunks)", {}),
    (case_decode_attend, (4, 12, 4, 64, 300, "bf16"), "M4 H12/4 D64 L300 bf16", {}),
    (case_decode_attend, (3, 4, 2, 64, 100, "fp32"), "M3 H4/2 D64 L100 fp32", {}),
    (case_decode_attend, (2, 4, 1, 32, 70, "bf16"), "M2 H4/1 D32 L70 bf16", {}),
    (case_decode_attend_o, (1, 12, 4, 64, 300, 768, "bf16"), "M1 H12/4 D64 L300 C768 bf16", {}),
    (case_decode_attend_o, (2, 4, 2, 32, 100, 128, "fp32"), "M2 H4/2 D32 L100 C128 fp32", {}),
    (case_decode_mlp, (768, 2048, "bf16"), "C768 F2048 bf16", {}),
    (case_decode_mlp, (1280, 512, "bf16"), "C1280 F512 bf16 (U 8)", {}),
    (case_decode_mlp, (768, 2048, "fp32"), "C768 F2048 fp32 (U 8)", {}),
    (case_decode_mlp, (341, 100, "fp32"), "C341 F100 fp32 (a short last block)", {}),
    (case_decode_mlp, (2048, 5632, "bf16"), "C2048 F5632 bf16 (56 KB shared: opted in)", {}),
    (case_decode_mlp, (2048, 5632, "fp32"), "C2048 F5632 fp32 (104 KB shared: opted in)", {}),
    (case_decode_elementwise, (5, 768, 2048, 4096, "bf16"), "M5 C768 F2048 V4096 bf16", {}),
    (case_decode_elementwise, (33, 341, 100, 50, "fp32"), "M33 C341 F100 V50 fp32", {}),
    (case_decode_sampling, (6, 4096), "M6 V4096", {}),
    (case_decode_sampling, (3, 1001), "M3 V1001", {}),
]
