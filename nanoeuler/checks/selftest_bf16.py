"""Self-test cases of the bf16 engine (`kernels/bf16/*.cu`, `engine.py`), run by `nanoeuler selftest`.

Same rules as the float32 cases: fresh random inputs, outputs poisoned (NaN bytes), a float64 NumPy
reference on exactly the values the GPU sees (inputs the kernel reads as bf16 are rounded to bf16 first),
relative error ||out - ref|| / ||ref||. Tolerance 1e-2 for bf16 operands (docs/ARCHITECTURE.md); float32 results
of bf16 kernels that involve no bf16 rounding are held to float32's 1e-5.

Cases: the engine's cuBLAS wrapper at the step's layouts; each bf16 kernel on its own; the whole model's
loss and every gradient from the engine against `transformer.loss_and_grads` in float64 (with the
cross-entropy head, and with DPO's sequence log-prob head against `dpo_head_loss`); one engine
optimizer step (clipping + AdamW) against `optim.clip_grad_norm` + `optim.AdamW.step` in float64.
"""

from __future__ import annotations

import math

import numpy as np

TOL_BF16 = 1e-2
TOL_FP32 = 1e-5


def to_bf16(x) -> np.ndarray:
    """float -> bf16 words (uint16), round to nearest even (as the kernels do)."""
    u = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def from_bf16(b) -> np.ndarray:
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def bf16_round(x) -> np.ndarray:
    return from_bf16(to_bf16(x))


def _randn(rng, shape, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(np.float32).astype(np.float64)


def _g(a, dtype=np.float32):
    import cupy

    return cupy.asarray(np.asarray(a, dtype=dtype))


def _k(name):
    from nanoeuler.kernels.bf16 import bf16_kernel

    return bf16_kernel(name)


def _dev_bf16(x):
    """A float64 array -> (device bf16 words, the float64 values they hold)."""
    b = to_bf16(x)
    return _g(b, np.uint16), from_bf16(b)


def case_bf16_rmsnorm(rng, shape):
    """shape (N, C): forward to bf16 xhat = x / rms(x) (no gain: the engine folds it into the next GEMM's
    weights), alone and with one and two bf16 residual branches added in (the sum also stored); backward
    from dL/dxhat (bf16 for the layers' norms, float32 for the final norm's) and the bf16 xhat and 1/rms
    of the forward: dx accumulated in place, and its bf16 copy."""
    from nanoeuler.model import layers

    N, C = shape
    x = _randn(rng, (N, C), 2.0) + 0.5
    ones = np.ones(C)
    dy = _randn(rng, (N, C))
    dx0 = _randn(rng, (N, C))
    branch_b, branch = _dev_bf16(_randn(rng, (N, C)))
    branch2_b, branch2 = _dev_bf16(_randn(rng, (N, C)))
    fwd = _k("rmsnorm_fwd_bf16")
    grid, dims = ((N + 3) // 4,), (np.int32(N), np.int32(C), np.float32(1e-5))

    def forward(nadd, store):
        """(xhat, rstd, stored sum) of the forward kernel on x plus the first `nadd` branches."""
        xhat = _g(np.full((N, C), 0xFFFF), np.uint16)  # poisoned: bf16 NaN
        rstd = _g(np.full(N, np.nan))
        xout = _g(np.full((N, C), np.nan))
        fwd(grid, (128,), (_g(x), branch_b, branch2_b, xhat, rstd, xout, *dims, np.int32(nadd), np.int32(store)))
        return xhat, rstd, xout

    y, rstd, _ = forward(0, 0)
    ya, _, xa = forward(1, 1)
    yaa, _, xaa = forward(2, 1)
    yr, cr = layers.rmsnorm_forward(x, ones, 1e-5)
    yar, _ = layers.rmsnorm_forward(x + branch, ones, 1e-5)
    yaar, _ = layers.rmsnorm_forward(x + branch + branch2, ones, 1e-5)
    rows_out = [
        ("bf16 rmsnorm fwd xhat", from_bf16(y.get()), yr, TOL_BF16),
        ("bf16 rmsnorm fwd rstd", rstd, cr[1].reshape(N), TOL_FP32),
        ("bf16 rmsnorm fwd xhat of x + bf16 branch", from_bf16(ya.get()), yar, TOL_BF16),
        ("bf16 rmsnorm fwd stored x + bf16 branch", xa, x + branch, TOL_FP32),
        ("bf16 rmsnorm fwd xhat of x + 2 bf16 branches", from_bf16(yaa.get()), yaar, TOL_BF16),
        ("bf16 rmsnorm fwd stored x + 2 bf16 branches", xaa, x + branch + branch2, TOL_FP32),
    ]
    # the backward reads the forward's own bf16 xhat and float32 rstd: the reference takes those values
    cache = (from_bf16(y.get()), rstd.get().astype(np.float64).reshape(N, 1), ones)
    for name, bwd, (dy_dev, dy_ref) in (
        ("rmsnorm_bwd_bf16_f32dy", _k("rmsnorm_bwd_bf16_f32dy"), (_g(dy), dy)),
        ("rmsnorm_bwd_bf16", _k("rmsnorm_bwd_bf16"), _dev_bf16(dy)),
    ):
        dx = _g(dx0)
        dxb = _g(np.full((N, C), 0xFFFF), np.uint16)
        bwd((-(-N // 8),), (256,), (dy_dev, y, rstd, dx, dxb, np.int32(N), np.int32(C), np.int32(1)))
        dxr, _ = layers.rmsnorm_backward(dy_ref.copy(), cache)
        rows_out += [
            (f"{name} dx (+=)", dx, dx0 + dxr, TOL_FP32),
            (f"{name} dx bf16 copy", from_bf16(dxb.get()), dx0 + dxr, TOL_BF16),
        ]
    dx = _g(np.full((N, C), np.nan))  # accumulate = 0 overwrites (the final norm's first gradient)
    dxb = _g(np.full((N, C), 0xFFFF), np.uint16)
    _k("rmsnorm_bwd_bf16_f32dy")(
        (-(-N // 8),), (256,), (_g(dy), y, rstd, dx, dxb, np.int32(N), np.int32(C), np.int32(0))
    )
    rows_out.append(("rmsnorm_bwd_bf16_f32dy dx (=)", dx, layers.rmsnorm_backward(dy.copy(), cache)[0], TOL_FP32))
    return rows_out


def case_bf16_gain_fold(rng, shape):
    """shape (R, C): the gradient of a weight matrix read with a norm gain folded in (dW' in place ->
    dW = dW' * gain), the gain's gradient (per-split column sums of W * dW', then column_sums) and the
    squares added to the gradient norm's accumulator."""
    from nanoeuler.kernels.bf16.plan import gain_fold_columns, gain_fold_splits
    from nanoeuler.model import layers

    R, C = shape
    w, dwf, gain = _randn(rng, (R, C)), _randn(rng, (R, C)), 1.0 + _randn(rng, (C,), 0.3)
    g = _g(dwf)
    acc0 = 3.0
    acc = _g(np.array([acc0]))
    splits, per_split = gain_fold_splits(R)
    part = _g(np.full((splits, C), np.nan))
    dgain = _g(np.full(C, np.nan))
    _k("gain_fold_grad")(
        (-(-C // gain_fold_columns(C)), splits),
        (256,),
        (_g(w), g, _g(gain), part, np.int32(R), np.int32(C), np.int32(per_split), acc),
    )
    _k("column_sums")((-(-C // 32),), (32, 32), (part, dgain, np.int32(splits), np.int32(C)))
    dw_ref, dgain_ref = layers.folded_gain_grads(w, dwf, gain)
    return [
        ("gain_fold_grad dW = dW' * gain", g, dw_ref, TOL_FP32),
        ("gain_fold_grad + column_sums: the gain's gradient", dgain, dgain_ref, TOL_FP32),
        ("gain_fold_grad sum of squares", acc, np.array([acc0 + (dw_ref**2).sum()]), TOL_FP32),
    ]


def case_bf16_rope(rng, shape):
    """shape (B, T, H, Hkv, D): qkv rows -> rotated q, k and v; and the backward packing."""
    import cupy

    from nanoeuler.model import layers

    B, T, H, Hkv, D = shape
    N, W = B * T, (H + 2 * Hkv) * D
    qkv_b, qkv = _dev_bf16(_randn(rng, (N, W)))
    cos, sin = layers.rope_tables(T, D, 10000.0, np, np.float32)
    q = cupy.empty((B, H, T, D), dtype=np.float32)
    k = cupy.empty((B, Hkv, T, D), dtype=np.float32)
    v = cupy.empty((B, Hkv, T, D), dtype=np.float32)
    pairs = N * (H + 2 * Hkv) * (D // 2)
    args = (np.int32(T), np.int32(H), np.int32(Hkv), np.int32(D), np.int64(pairs))
    _k("qkv_rope_split")(((pairs + 255) // 256,), (256,), (qkv_b, _g(cos), _g(sin), q, k, v, *args))
    qh = cupy.empty((B, H, T, D), dtype=np.uint16)
    kh = cupy.empty((B, Hkv, T, D), dtype=np.uint16)
    vh = cupy.empty((B, Hkv, T, D), dtype=np.uint16)
    row_grid = (-(-((H + 2 * Hkv) * (D // 2)) // 256), min(N, 65535))
    rargs = (np.int32(T), np.int32(H), np.int32(Hkv), np.int32(D), np.int32(N))
    split_grid = (-(-(N * (H + 2 * Hkv) * (D // 16)) // 256),)
    _k("qkv_rope_split_bf16")(split_grid, (256,), (qkv_b, _g(cos), _g(sin), qh, kh, vh, *rargs))
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    x = qkv.reshape(B, T, H + 2 * Hkv, D).transpose(0, 2, 1, 3)
    qr = layers.rope_forward(x[:, :H], c64, s64)
    kr = layers.rope_forward(x[:, H : H + Hkv], c64, s64)
    vr = x[:, H + Hkv :]
    dq, dk, dv = _randn(rng, (B, H, T, D)), _randn(rng, (B, Hkv, T, D)), _randn(rng, (B, Hkv, T, D))
    out = cupy.empty((N, W), dtype=np.uint16)
    _k("rope_bwd_pack")(row_grid, (256,), (_g(dq), _g(dk), _g(dv), _g(cos), _g(sin), out, *rargs))
    ref = np.concatenate([layers.rope_backward(dq, c64, s64), layers.rope_backward(dk, c64, s64), dv], axis=1)
    ref = ref.transpose(0, 2, 1, 3).reshape(N, W)
    return [
        ("bf16 qkv_rope_split_bf16 q", from_bf16(qh.get()), qr, TOL_BF16),
        ("bf16 qkv_rope_split_bf16 k", from_bf16(kh.get()), kr, TOL_BF16),
        ("bf16 qkv_rope_split_bf16 v", from_bf16(vh.get()), vr, TOL_FP32),
        ("bf16 qkv_rope_split q", q, qr, TOL_FP32),
        ("bf16 qkv_rope_split k", k, kr, TOL_FP32),
        ("bf16 qkv_rope_split v", v, vr, TOL_FP32),
        ("bf16 rope_bwd_pack", from_bf16(out.get()), ref, TOL_BF16),
    ]


def case_bf16_attn_layout(rng, shape):
    """shape (B, T, H, D): attention output to the o_proj operand, and delta = rowsum(dO * O)."""
    import cupy

    B, T, H, D = shape
    N = B * T
    out = _randn(rng, (B, H, T, D))
    a = cupy.empty((N, H * D), dtype=np.uint16)
    _k("attn_pack")(
        ((N * H * D + 255) // 256,), (256,), (_g(out), a, np.int32(T), np.int32(H), np.int32(D), np.int64(N * H * D))
    )
    a_ref = out.transpose(0, 2, 1, 3).reshape(N, H * D)
    da = _randn(rng, (N, H * D))
    a_b, a64 = _dev_bf16(a_ref)
    delta = cupy.empty((B, H, T), dtype=np.float32)
    _k("attn_delta")(
        (-(-(N * H) // 8),), (256,), (a_b, _g(da), delta, np.int32(T), np.int32(H), np.int32(D), np.int64(N * H))
    )
    d_ref = (a64 * da).reshape(B, T, H, D).sum(-1).transpose(0, 2, 1)
    return [("bf16 attn_pack", from_bf16(a.get()), a_ref, TOL_BF16), ("bf16 attn_delta", delta, d_ref, TOL_FP32)]


def case_bf16_swiglu(rng, shape):
    """shape (N, F): gu (N, 2F) bf16 -> m bf16; backward dm bf16 -> dgu bf16, and m again (bit-identical)."""
    import cupy

    from nanoeuler.model import layers

    N, F = shape
    gu_b, gu = _dev_bf16(np.concatenate([_randn(rng, (N, F), 3.0), _randn(rng, (N, F))], axis=1))
    m = cupy.empty((N, F), dtype=np.uint16)
    grid = (-(-F // (256 * (8 if F % 8 == 0 else 2))), min(N, 4096))
    _k("swiglu_fwd_bf16")(grid, (256,), (gu_b, m, np.int32(F), np.int32(N)))
    dm_b, dm = _dev_bf16(_randn(rng, (N, F)))
    dgu = cupy.empty((N, 2 * F), dtype=np.uint16)
    m2 = cupy.empty((N, F), dtype=np.uint16)
    _k("swiglu_bwd_bf16")(grid, (256,), (dm_b, gu_b, dgu, m2, np.int32(F), np.int32(N)))
    hr, cr = layers.swiglu_forward(gu[:, :F], gu[:, F:])
    dgr, dur = layers.swiglu_backward(dm, cr)
    m_fwd = from_bf16(m.get())
    return [
        ("bf16 swiglu fwd", m_fwd, hr, TOL_BF16),
        ("bf16 swiglu bwd dgu", from_bf16(dgu.get()), np.concatenate([dgr, dur], axis=1), TOL_BF16),
        ("bf16 swiglu bwd m == fwd m", from_bf16(m2.get()), m_fwd, 0.0),
    ]


def case_bf16_swiglu_gemm(rng, shape):
    """shape (N, C, F): the SwiGLU backward inside its GEMM (`swiglu_bwd_gemm`, sm_90a builds only, else
    no rows): dm = dy Wd in float32, then dgu and m, against float64 on the bf16 operands. Wd's image comes
    from `wdt_image` out of a flat buffer (two matrices at given offsets; the kernel reads the second
    through a tensor map of both, as the engine reads its layers), checked exactly: transposed, rows
    permuted by 128-row block."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.gemm_tma import prepare_fused_gemm, run_swiglu_bwd_gemm
    from nanoeuler.kernels.bf16.plan import wdt_image_rows
    from nanoeuler.kernels.tma import tile_map
    from nanoeuler.model import layers

    if not has_sm90a():
        return []
    N, C, F = shape
    dy_b, dy = _dev_bf16(_randn(rng, (N, C)))
    flat = to_bf16(_randn(rng, 2 * C * F + 64, 0.05))  # two Wd (C, F) at offsets 64 and 64 + C F
    offs = np.array([64, 64 + C * F], dtype=np.int64)
    wd = from_bf16(flat[offs[1] : offs[1] + C * F]).reshape(C, F)
    wdt = cupy.full((2, F, C), 0xFFFF, dtype=np.uint16)
    _k("wdt_image")(
        (-(-F // 32), -(-C // 32), 2), (32, 8), (_g(flat, np.uint16), _g(offs, np.int64), wdt, np.int32(C), np.int32(F))
    )
    gu_b, gu = _dev_bf16(np.concatenate([_randn(rng, (N, F), 3.0), _randn(rng, (N, F))], axis=1))
    dgu = cupy.full((N, 2 * F), 0xFFFF, dtype=np.uint16)  # NaN words
    m = cupy.full((N, F), 0xFFFF, dtype=np.uint16)
    fn = prepare_fused_gemm(_k("swiglu_bwd_gemm"))
    run_swiglu_bwd_gemm(
        fn,
        tile_map(dy_b, 128),
        tile_map(wdt.reshape(2 * F, C), 128),
        F,
        tile_map(gu_b, 64),
        tile_map(dgu, 64),
        tile_map(m, 64),
        N,
        C,
        F,
        cupy.cuda.Device().attributes["MultiProcessorCount"],
    )
    hr, cr = layers.swiglu_forward(gu[:, :F], gu[:, F:])
    dgr, dur = layers.swiglu_backward(dy @ wd, cr)
    return [
        ("bf16 wdt_image (Wd^T, rows permuted)", from_bf16(wdt[1].get())[wdt_image_rows(F)], wd.T, 0.0),
        ("bf16 swiglu_bwd_gemm dgu", from_bf16(dgu.get()), np.concatenate([dgr, dur], axis=1), TOL_BF16),
        ("bf16 swiglu_bwd_gemm m", from_bf16(m.get()), hr, TOL_BF16),
    ]


def case_bf16_swiglu_fwd_gemm(rng, shape):
    """shape (N, C, F): the gate/up projection with the SwiGLU forward inside (`swiglu_fwd_gemm`, sm_90a
    builds only, else no rows): gu = x Wgu^T in float32 and m, against float64 on the bf16 operands, and m
    bit-identical to `swiglu_fwd_bf16` applied to the kernel's own gu (what the backward recomputes). Wgu
    sits at an offset in a flat buffer, as the engine's bf16 image holds it, read through `gate_up_map`."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.gemm_tma import prepare_fused_gemm, run_swiglu_fwd_gemm
    from nanoeuler.kernels.tma import gate_up_map, tile_map
    from nanoeuler.model import layers

    if not has_sm90a():
        return []
    N, C, F = shape
    x_b, x = _dev_bf16(_randn(rng, (N, C)))
    flat = to_bf16(_randn(rng, 2 * F * C + 128, 0.1))
    w = from_bf16(flat[128:]).reshape(2 * F, C)
    wgu = _g(flat, np.uint16)[128:].reshape(2 * F, C)
    gu = cupy.full((N, 2 * F), 0xFFFF, dtype=np.uint16)  # NaN words
    m = cupy.full((N, F), 0xFFFF, dtype=np.uint16)
    run_swiglu_fwd_gemm(
        prepare_fused_gemm(_k("swiglu_fwd_gemm")),
        tile_map(x_b, 128),
        gate_up_map(wgu),
        tile_map(gu, 64),
        tile_map(m, 64),
        N,
        C,
        F,
        cupy.cuda.Device().attributes["MultiProcessorCount"],
    )
    m_ref = cupy.full((N, F), 0xFFFF, dtype=np.uint16)
    _k("swiglu_fwd_bf16")((-(-F // 2048), min(N, 4096)), (256,), (gu, m_ref, np.int32(F), np.int32(N)))
    gur = x @ w.T
    hr, _ = layers.swiglu_forward(gur[:, :F], gur[:, F:])
    return [
        ("bf16 swiglu_fwd_gemm gu", from_bf16(gu.get()), gur, TOL_BF16),
        ("bf16 swiglu_fwd_gemm m", from_bf16(m.get()), hr, TOL_BF16),
        ("bf16 swiglu_fwd_gemm m == swiglu_fwd_bf16 of its gu", from_bf16(m.get()), from_bf16(m_ref.get()), 0.0),
    ]


def case_bf16_qkv_rope_gemm(rng, shape):
    """shape (B, T, H, Hkv, C): the qkv projection with RoPE and the attention layouts inside
    (`qkv_rope_gemm`, sm_90a builds only, else no rows): q/k/v (head size 64) against float64 on the bf16
    operands. Wqkv sits at an offset in a flat buffer, as in the engine's bf16 image. The outputs start as
    NaN words, so a row or head that no store reached fails the comparison."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.gemm_tma import prepare_fused_gemm, run_qkv_rope_gemm
    from nanoeuler.kernels.tma import heads_map, tile_map
    from nanoeuler.model import layers

    if not has_sm90a():
        return []
    B, T, H, Hkv, C = shape
    N, W, D = B * T, (H + 2 * Hkv) * 64, 64
    x_b, x = _dev_bf16(_randn(rng, (N, C)))
    flat = to_bf16(_randn(rng, W * C + 128, 0.1))
    w = from_bf16(flat[128:]).reshape(W, C)
    wqkv = _g(flat, np.uint16)[128:].reshape(W, C)
    outs = [cupy.full((B, n, T, D), 0xFFFF, dtype=np.uint16) for n in (H, Hkv, Hkv)]  # NaN words
    cos, sin = layers.rope_tables(T, D, 10000.0, np, np.float32)
    run_qkv_rope_gemm(
        prepare_fused_gemm(_k("qkv_rope_gemm")),
        tile_map(x_b, 128),
        tile_map(wqkv, 128),
        *(heads_map(o) for o in outs),
        _g(cos),
        _g(sin),
        N,
        C,
        T,
        H,
        Hkv,
        cupy.cuda.Device().attributes["MultiProcessorCount"],
    )
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)
    heads = (x @ w.T).reshape(B, T, H + 2 * Hkv, D).transpose(0, 2, 1, 3)
    refs = (
        layers.rope_forward(heads[:, :H], c64, s64),
        layers.rope_forward(heads[:, H : H + Hkv], c64, s64),
        heads[:, H + Hkv :],
    )
    return [
        (f"bf16 qkv_rope_gemm {name}", from_bf16(o.get()), ref, TOL_BF16) for name, o, ref in zip("qkv", outs, refs)
    ]


def case_bf16_ce_heads(rng, shape):
    """shape (N, K, V[, head weights]): per-head scales (the heads' loss weights read from the device), fused
    loss + bf16 dlogits, the loss reduction."""
    import cupy

    from nanoeuler.model import layers
    from nanoeuler.model.transformer import head_loss_scales

    N, K, V, *weights = shape
    weights = weights[0] if weights else None
    z = bf16_round(_randn(rng, (N, K * V), 3.0))  # the logits are bf16 (the head GEMM's output)
    t = rng.integers(0, V, size=(N, K))
    t[rng.random((N, K)) < 0.25] = -1
    t[0, :] = rng.integers(0, V, size=K)
    if K > 1:
        t[:, K - 1] = -1  # a head with no valid target: left out of the mean
    tg = _g(t, np.int32)
    scale = cupy.empty(K, dtype=np.float32)
    w = _g(np.ones(K) if weights is None else weights)
    _k("ce_head_scale")((1,), (1024,), (tg, w, scale, np.int64(N), np.int32(K)))
    loss_rows = cupy.empty((N, K), dtype=np.float32)
    dlg = cupy.empty((N, K * V), dtype=np.uint16)
    for k in range(K):  # one launch per head, on that head's logits (N, V), as the engine does
        zk = _g(to_bf16(z[:, k * V : (k + 1) * V]), np.uint16)  # overwritten in place by the gradient
        _k("ce_heads_fwd_bwd")((N,), (256,), (zk, tg, scale, loss_rows, np.int32(V), np.int32(K), np.int32(k)))
        dlg[:, k * V : (k + 1) * V] = zk
    loss = cupy.empty(1, dtype=np.float32)
    _k("ce_loss_reduce")((1,), (1024,), (loss_rows, scale, loss, np.int64(N), np.int32(K)))
    sc = np.array(head_loss_scales([int(c) for c in (t >= 0).sum(axis=0)], weights))
    total, dref = 0.0, np.zeros((N, K * V))
    for k in range(K):
        if sc[k] == 0:  # no target, or a weight of 0: no loss, a zero gradient
            continue
        ls, nv, cache = layers.cross_entropy_forward(z[:, k * V : (k + 1) * V].copy(), t[:, k])
        total += float(ls) * sc[k]
        dref[:, k * V : (k + 1) * V] = layers.cross_entropy_backward(sc[k], cache)
    return [
        ("bf16 ce_head_scale", scale, sc, TOL_FP32),
        ("bf16 ce_heads loss", loss, np.array([total]), TOL_FP32),
        ("bf16 ce_heads dlogits", from_bf16(dlg.get()), dref, TOL_BF16),
    ]


def case_bf16_seq_logp(rng, shape):
    """shape (B, T, K, V, R): DPO's sequence log-prob head on its own. Pass 1 over row chunks of R
    (each row's log-prob of its head-0 target and logsumexp), the pair loss and dloss/dlogp (a padding
    pair of weight 0 included), pass 2 (the logits' gradient in place), against model.dpo in float64."""
    from nanoeuler.model import dpo

    B, T, K, V, R = shape
    N, P = B * T, B // 2
    z = bf16_round(_randn(rng, (N, V), 3.0))
    t = rng.integers(0, V, size=(N, K))
    t[rng.random(N) < 0.4, 0] = -1
    t[:, 1:] = -1
    t[(P - 1) * T : P * T, 0] = -1  # the last pair is padding: no targets, weight 0
    t[(B - 1) * T :, 0] = -1
    ref = _randn(rng, B, 20.0) - 100.0
    w = np.full(P, 1.0 / (P - 1))
    w[P - 1] = 0.0
    beta, eps = 0.3, 0.1
    tg = _g(t, np.int32)
    tok, lse = _g(np.full(N, np.nan)), _g(np.full(N, np.nan))
    zd = _g(to_bf16(z), np.uint16)
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        _k("seq_logp_rows")(
            (r1 - r0,), (256,), (zd[r0:r1], tg[r0:r1], tok[r0:r1], lse[r0:r1], np.int32(V), np.int32(K))
        )
    logp, dlogp, loss = (_g(np.full(n, np.nan)) for n in (B, B, 1))
    _k("dpo_pair_loss")(
        (1,),
        (1024,),
        (tok, _g(ref), _g(w), logp, dlogp, loss, np.int32(B), np.int32(T), np.float32(beta), np.float32(eps)),
    )
    for r0 in range(0, N, R):
        r1 = min(N, r0 + R)
        _k("seq_logp_grad")(
            (r1 - r0,),
            (256,),
            (zd[r0:r1], tg[r0:r1], lse[r0:r1], dlogp, np.int32(V), np.int32(K), np.int64(r0), np.int32(T)),
        )
    valid = t[:, 0] >= 0
    tok_r, probs = dpo.token_logps(z, np.where(valid, t[:, 0], 0))
    tok_r = np.where(valid, tok_r, 0.0)
    logp_r = tok_r.reshape(B, T).sum(1)
    keep = np.r_[0 : P - 1, P : B - 1]  # the pairs with weight 1 / (P - 1): plain DPO over them
    loss_r, dl, _ = dpo.pair_loss(logp_r[keep], ref[keep], beta, eps)
    dlogp_r = np.zeros(B)
    dlogp_r[keep] = dl
    onehot = np.zeros((N, V))
    onehot[np.arange(N), np.where(valid, t[:, 0], 0)] = 1.0
    dz_r = np.where(valid[:, None], dlogp_r[np.arange(N) // T][:, None] * (onehot - probs), 0.0)
    return [
        ("seq_logp_rows log-probs", tok, tok_r, TOL_FP32),
        ("dpo_pair_loss logp", logp, logp_r, TOL_FP32),
        ("dpo_pair_loss loss", loss, np.array([loss_r]), TOL_FP32),
        ("dpo_pair_loss dloss/dlogp", dlogp, dlogp_r, TOL_FP32),
        ("seq_logp_grad dlogits", from_bf16(zd.get()), dz_r, TOL_BF16),
    ]


def case_bf16_grad_accumulate(rng, shape):
    """shape (n,): acc += g over a flat range (a scalar tail when n % 4), and the loss into its sum."""
    n = shape[0]
    g, acc0 = _randn(rng, n), _randn(rng, n)
    acc, loss_acc = _g(acc0), _g(np.array([1.5]))
    _k("grad_accumulate")(
        (min(4096, -(-n // 1024)),), (256,), (_g(g), acc, np.int64(n), _g(np.array([2.25])), loss_acc)
    )
    return [
        ("grad_accumulate sum", acc, acc0 + g, TOL_FP32),
        ("grad_accumulate loss", loss_acc, np.array([3.75]), TOL_FP32),
    ]


def case_bf16_sumsq(rng, shape):
    """shape (n,): the gradient norm's sum of squares against float64, and twice over: the same bits (its
    blocks' partial sums are added in a fixed order; float atomics would add them as the blocks finish)."""
    import cupy

    from nanoeuler.kernels.bf16 import optim

    g = _randn(rng, shape[0])
    g_dev, outs = _g(g), []
    for _ in range(2):
        sq = cupy.zeros(1, dtype=np.float32)
        optim.sumsq(g_dev, sq)
        outs.append(sq.get())
    return [
        ("sumsq", outs[0], np.array([g @ g]), TOL_FP32),
        ("sumsq twice: bit-identical", outs[1], outs[0].astype(np.float64), 0.0),
    ]


def case_bf16_muon_momentum(rng, shape):
    """shape (layers, rows, cols, gap): Muon's clipped Nesterov momentum over every layer's matrix (layers
    rows x cols + gap apart), its bf16 copy and each matrix's sum of squares, against float64; run twice
    from the same state, the sums are the same bits (a fixed order, not atomics)."""
    import cupy

    from nanoeuler.kernels.bf16 import optim

    L, rows, cols, gap = shape
    n, stride = rows * cols, rows * cols + gap
    g, m0 = _randn(rng, L * stride), _randn(rng, L * stride, 0.1)
    norm2, max_norm, mu = float(g @ g), 0.5 * math.sqrt(float(g @ g)), 0.95
    c = max_norm / (math.sqrt(norm2) + 1e-6)
    outs = []
    for _ in range(2):
        m, x = _g(m0), cupy.zeros(2 * L * stride, dtype=np.uint16)
        ss = cupy.zeros(L, dtype=np.float32)
        optim.muon_momentum(_g(g), m, x, n, stride, 2 * stride, L, ss, _g(np.array([norm2])), max_norm, mu)
        outs.append((m.get(), x.get(), ss.get()))
    m_ref = mu * m0 + c * g
    u = c * g + mu * m_ref
    keep = np.concatenate([np.arange(layer * stride, layer * stride + n) for layer in range(L)])
    x_got = np.concatenate([from_bf16(outs[0][1][2 * layer * stride :][:n]) for layer in range(L)])
    ss_ref = np.array([u[layer * stride :][:n] @ u[layer * stride :][:n] for layer in range(L)])
    return [
        ("muon_momentum m", outs[0][0][keep], m_ref[keep], TOL_FP32),
        ("muon_momentum bf16 u", x_got, u[keep], TOL_BF16),
        ("muon_momentum sums of squares", outs[0][2], ss_ref, TOL_FP32),
        ("muon_momentum sums twice: bit-identical", outs[1][2], outs[0][2].astype(np.float64), 0.0),
    ]


def case_bf16_muon_poly_init(rng, shape):
    """shape (m, count): b = cb a + ca I for count packed m x m bf16 matrices (16-byte accesses when
    m % 8 == 0, one value at a time otherwise)."""
    import cupy

    from nanoeuler.kernels.bf16 import optim

    m, count = shape
    a_dev, a = _dev_bf16(_randn(rng, (count, m, m)))
    b = cupy.full(count * m * m, 0xFFFF, dtype=np.uint16)  # NaN: every value must be written
    optim.muon_poly_init(a_dev, b, m, count, 3.4445, -4.775)
    ref = -4.775 * a + 3.4445 * np.eye(m)
    return [("muon_poly_init", from_bf16(b.get()).reshape(count, m, m), ref, TOL_BF16)]


def case_bf16_flash(rng, shape):
    """shape (B, H, Hkv, T, D, variant): tensor-core causal GQA attention forward and backward on bf16
    operands, against the float64 layer on the same (bf16-valued) inputs. The backward's output is the
    qkv GEMM's gradient operand dqkv (N, (H+2Hkv)*D): dq and dk with the RoPE rotation undone, and dv.
    Variants: "mma" / "ldm"; "wg" (wgmma; sm_90a builds only, else no rows)."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.flash import flash_kernels
    from nanoeuler.model import layers

    B, H, Hkv, T, D, var = shape
    if var == "wg" and not has_sm90a():
        return []
    N, W = B * T, (H + 2 * Hkv) * D
    qb, q = _dev_bf16(_randn(rng, (B, H, T, D), 1.5))
    kb, k = _dev_bf16(_randn(rng, (B, Hkv, T, D), 1.5))
    vb, v = _dev_bf16(_randn(rng, (B, Hkv, T, D)))
    dout = _randn(rng, (B, H, T, D))
    db, d64 = _dev_bf16(dout.transpose(0, 2, 1, 3).reshape(N, H * D))  # dO in the (N, H*D) layout
    cos, sin = layers.rope_tables(T, D, 10000.0, np, np.float32)
    scale = np.float32(1.0 / math.sqrt(D))
    dims = (np.int32(H), np.int32(Hkv), np.int32(T), scale)
    nb = -(-T // 64)
    o = cupy.empty((N, H * D), dtype=np.uint16)
    lse = cupy.empty((B, H, T), dtype=np.float32)
    flash = flash_kernels(var, D)
    flash["flash_fwd"]((B * H, nb), (128,), (qb, kb, vb, o, lse, *dims))
    delta = cupy.empty((B, H, T), dtype=np.float32)
    dqkv = cupy.empty((N, W), dtype=np.uint16)
    rope = (dqkv, _g(cos), _g(sin), *dims)
    # the dq kernel runs first: it also writes delta = rowsum(dO * O), which the dk/dv kernel reads
    flash["flash_bwd_dq"]((B * H, nb), (128,), (qb, kb, vb, db, o, lse, delta, *rope))
    flash["flash_bwd_dkdv"]((B * Hkv, nb), (128,), (qb, kb, vb, db, lse, delta, *rope))
    out_r, cache = layers.attention_forward(q, k, v)
    dq_r, dk_r, dv_r = layers.attention_backward(d64.reshape(B, T, H, D).transpose(0, 2, 1, 3), cache)
    c64, s64 = cos.astype(np.float64), sin.astype(np.float64)

    def to_rows(x):  # (B, heads, T, D) -> (N, heads*D)
        return x.transpose(0, 2, 1, 3).reshape(N, -1)

    got = from_bf16(dqkv.get())
    s = np.einsum("bhtd,bhsd->bhts", q, np.repeat(k, H // Hkv, axis=1)) / math.sqrt(D)
    s = np.where(np.tril(np.ones((T, T), dtype=bool)), s, -np.inf)
    lse_r = np.log(np.exp(s - s.max(-1, keepdims=True)).sum(-1)) + s.max(-1)
    HD, KD = H * D, Hkv * D
    o64 = from_bf16(o.get())
    delta_r = (o64 * d64).reshape(B, T, H, D).sum(-1).transpose(0, 2, 1)
    return [
        (f"flash {var} fwd out", o64, to_rows(out_r), TOL_BF16),
        (f"flash {var} bwd delta (from the dq kernel)", delta, delta_r, TOL_FP32),
        (f"flash {var} fwd lse", lse, lse_r, TOL_FP32),
        (
            f"flash {var} bwd dq (unrotated, in dqkv)",
            got[:, :HD],
            to_rows(layers.rope_backward(dq_r, c64, s64)),
            TOL_BF16,
        ),
        (
            f"flash {var} bwd dk (unrotated, in dqkv)",
            got[:, HD : HD + KD],
            to_rows(layers.rope_backward(dk_r, c64, s64)),
            TOL_BF16,
        ),
        (f"flash {var} bwd dv (in dqkv)", got[:, HD + KD :], to_rows(dv_r), TOL_BF16),
    ]


def case_bf16_gemm(rng, shape):
    """shape (M, N, K, ta, tb, out, beta): c (M,N) = op(a) @ op(b) [+ c] through the engine's cuBLAS
    wrapper (`cublas.Gemm`), bf16 operands, a bf16 or float32 output, against float64 on the bf16 values."""
    import cupy

    from nanoeuler.kernels.cublas import Gemm, Matrix

    M, N, K, ta, tb, out, beta = shape
    a, a64 = _dev_bf16(_randn(rng, (K, M) if ta else (M, K)))
    b, b64 = _dev_bf16(_randn(rng, (N, K) if tb else (K, N)))
    c0 = _randn(rng, (M, N))
    c0 = c0 if out == "f32" else bf16_round(c0)  # what c holds before an accumulating product
    ref = (a64.T if ta else a64) @ (b64.T if tb else b64) + (c0 if beta else 0.0)
    if beta:
        c = _g(c0) if out == "f32" else _dev_bf16(c0)[0]
    else:
        c = cupy.empty((M, N), dtype=np.float32 if out == "f32" else np.uint16)
    Gemm()(Matrix(c), Matrix(a), Matrix(b), ta=ta, tb=tb, beta=float(beta))
    got = c.get().astype(np.float64) if out == "f32" else from_bf16(c.get())
    # float32 outputs differ from the reference by the float32 accumulation alone
    return [(f"gemm {out}{' +c' if beta else ''}", got, ref, TOL_BF16 if out == "bf16" else 1e-4)]


def case_bf16_gemm_batched(rng, shape):
    """shape (count, M, N, K, ta, tb, alpha, beta): c_i = alpha op(a_i) @ op(b_i) + beta c_i, bf16 in and out,
    through `Gemm.batched` (Muon's Newton-Schulz products); a's matrices lie `gap` elements apart beyond
    their size (the layers' matrices in the flat buffers), b and c packed."""
    from nanoeuler.kernels.cublas import Gemm, Matrix

    L, M, N, K, ta, tb, alpha, beta = shape
    gap = 64
    a_shape, b_shape = ((K, M) if ta else (M, K)), ((N, K) if tb else (K, N))
    sa = M * K + gap
    a_flat = _randn(rng, (L, sa))
    a_dev, a_flat64 = _dev_bf16(a_flat)
    a64 = a_flat64[:, : M * K].reshape((L,) + a_shape)
    b_dev, b64 = _dev_bf16(_randn(rng, (L,) + b_shape))
    c_dev, c64 = _dev_bf16(_randn(rng, (L, M, N)))
    if not beta:  # poisoned: a product that skipped a matrix leaves NaN
        c_dev.fill(0xFFFF)
        c64 = np.zeros_like(c64)
    ref = alpha * np.matmul(np.swapaxes(a64, 1, 2) if ta else a64, np.swapaxes(b64, 1, 2) if tb else b64) + beta * c64
    first = lambda arr, shp: Matrix(arr.reshape(-1)[: int(np.prod(shp))].reshape(shp))  # noqa: E731
    Gemm().batched(
        first(c_dev, (M, N)),
        first(a_dev, a_shape),
        first(b_dev, b_shape),
        L,
        (M * N, sa, N * K),
        ta=ta,
        tb=tb,
        alpha=alpha,
        beta=beta,
    )
    return [("gemm batched bf16", from_bf16(c_dev.get()).reshape(L, M, N), ref, TOL_BF16)]


def _engine_problem(rng, cfg, B, T):
    from nanoeuler.checks.problem import random_problem

    params, inputs, targets = random_problem(cfg, int(rng.integers(2**31)), batch=B, T=T)
    # gradcheck's weights are of order one; scale the matrices like a trained model's so that bf16
    # rounding of the activations is measured, not amplified by saturated softmaxes
    params = {
        n: (p * (0.5 if p.ndim == 2 and not n.startswith("embed") else 1.0)).astype(np.float32)
        for n, p in params.items()
    }
    return params, inputs, targets


def case_engine(rng, shape):
    """shape (label, B, T): the engine's loss and every gradient vs float64 loss_and_grads; then one
    optimizer step (clip + AdamW) vs float64 optim on the engine's own gradients."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.optim import AdamW, clip_grad_norm

    which, B, T, attention = shape
    if attention == "wg" and not has_sm90a():
        return []
    if which == "small":
        cfg = ModelConfig.named("small")
    elif which == "d384":  # hidden 1024, head size 64: the SwiGLU and RoPE run inside their GEMMs on sm_90a
        cfg = ModelConfig(vocab_size=1024, dim=384, n_layers=2, n_heads=6, n_kv_heads=2, ctx_len=256, mtp_heads=4)
    else:
        cfg = ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=256, mtp_heads=4)
    params, inputs, targets = _engine_problem(rng, cfg, B, T)
    # output-head chunks of 48 rows: several per step, the last one short, so the weight gradients'
    # accumulation over chunks (and dxn's over heads) is checked
    eng = TrainEngine(
        cfg, params, batch=B, seq=T, max_norm=0.5, attention=attention, chunk_bytes=2 * cfg.vocab_size * 48
    )
    if which == "d384" and not (eng.fuse_swiglu and eng.fuse_rope):
        raise RuntimeError("the d384 engine case is meant to run the fused SwiGLU and RoPE kernels, and does not")
    for _ in range(2):  # twice: a gradient that accumulated instead of being overwritten would double
        eng.forward_backward(_g(inputs, np.int32), _g(targets, np.int32))
    p64 = {n: p.astype(np.float64) for n, p in params.items()}
    loss_ref, g_ref = transformer.loss_and_grads(p64, inputs, targets, cfg)
    got = {n: np.asarray(g.get(), dtype=np.float64) for n, g in eng.grads().items()}
    names = list(params)
    errs = {n: float(np.linalg.norm(got[n] - g_ref[n]) / max(np.linalg.norm(g_ref[n]), 1e-30)) for n in names}
    worst = max(names, key=lambda n: errs[n] if np.isfinite(errs[n]) else np.inf)
    rows = [
        ("engine loss", np.array([eng.last_loss()]), np.array([loss_ref]), TOL_BF16),
        (
            "engine grads, all tensors",
            np.concatenate([got[n].ravel() for n in names]),
            np.concatenate([g_ref[n].ravel() for n in names]),
            TOL_BF16,
        ),
        (f"engine grad, worst: {worst.replace('layers.', 'L')}", got[worst], g_ref[worst], 2 * TOL_BF16),
    ]
    # one optimizer step on the engine's gradients, against the float64 reference
    g_dev = {n: got[n].astype(np.float32).astype(np.float64) for n in names}
    ref_p = {n: p.copy() for n, p in p64.items()}
    opt = AdamW(ref_p, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    clip_grad_norm(g_dev, 0.5)
    opt.step(ref_p, g_dev, 1e-2)
    eng.optimizer_step(1e-2)
    cupy.cuda.get_current_stream().synchronize()
    new = eng.params()
    upd = np.concatenate([(new[n].get().astype(np.float64) - p64[n]).ravel() for n in names])
    upd_ref = np.concatenate([(ref_p[n] - p64[n]).ravel() for n in names])
    rows.append(("engine clip+adamw update", upd, upd_ref, 1e-4))
    rows.append(_image_row("engine bf16 weight image (gains folded)", eng, ref_p, names))
    del eng
    return rows


def case_engine_head_weights(rng, shape):
    """shape (attention,): the engine's loss and every gradient with the output heads' loss weights of a
    schedule (head 2 at 0: not trained, a zero gradient) vs float64 loss_and_grads with the same weights;
    the step before ran with other weights, which the engine must not keep."""
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import transformer
    from nanoeuler.model.config import ModelConfig

    cfg = ModelConfig(vocab_size=1024, dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=128, mtp_heads=4)
    params, inputs, targets = _engine_problem(rng, cfg, 2, 128)
    weights = [1.0, 0.5, 0.0, 0.125]
    eng = TrainEngine(cfg, params, batch=2, seq=128, attention=shape[0])
    for w in ([1.0, 1.0, 1.0, 1.0], weights):
        eng.forward_backward(_g(inputs, np.int32), _g(targets, np.int32), head_weights=w)
    p64 = {n: p.astype(np.float64) for n, p in params.items()}
    loss_ref, g_ref = transformer.loss_and_grads(p64, inputs, targets, cfg, head_weights=weights)
    got = {n: np.asarray(g.get(), dtype=np.float64) for n, g in eng.grads().items()}
    loss_got, names = eng.last_loss(), list(params)
    del eng
    return [
        ("engine loss, head weights 1 .5 0 .125", np.array([loss_got]), np.array([loss_ref]), TOL_BF16),
        (
            "engine grads, head weights 1 .5 0 .125",
            np.concatenate([got[n].ravel() for n in names]),
            np.concatenate([g_ref[n].ravel() for n in names]),
            TOL_BF16,
        ),
        ("engine grad of a head of weight 0 is zero", got["mtp_heads.2.weight"], g_ref["mtp_heads.2.weight"], 0.0),
    ]


def _image_row(label, eng, ref_p, names):
    """The engine's bf16 GEMM image against the reference weights: the matrices that read a norm carry
    the norm's (updated) gain."""
    pb = eng.Pb.get()
    img = np.concatenate([from_bf16(pb[eng.offsets[n] : eng.offsets[n] + ref_p[n].size]) for n in names])
    img_ref = [ref_p[n] * ref_p[eng.gain_of[n]] if n in eng.gain_of else ref_p[n] for n in names]
    return label, img, np.concatenate([r.ravel() for r in img_ref]), TOL_BF16


def newton_schulz_bf16(g, steps):
    """`optim.newton_schulz` rounding to bf16 where the engine's Muon does: the momentum u, then u scaled
    to norm 1, and each output of a step (A = X X^T, B = a I + b A, B += c A A, X' = B X), in float64 else."""
    from nanoeuler.optim import NS_COEFFS

    a, b, c = NS_COEFFS
    tall = g.shape[0] > g.shape[1]
    x = bf16_round(bf16_round(g) / (np.linalg.norm(g) + 1e-7))
    for _ in range(steps):
        A = bf16_round(x.T @ x if tall else x @ x.T)
        B = bf16_round(c * (A @ A) + bf16_round(b * A + a * np.eye(len(A))))
        x = bf16_round(x @ B if tall else B @ x)
    return x


def _well_conditioned(rng, rows, cols):
    """A rows x cols matrix of Frobenius norm 1 with singular values spread over [0.1, 1] before scaling."""
    k = min(rows, cols)
    u, _ = np.linalg.qr(rng.standard_normal((rows, k)))
    v, _ = np.linalg.qr(rng.standard_normal((cols, k)))
    x = u @ np.diag(np.linspace(0.1, 1.0, k)) @ v.T
    return x / np.linalg.norm(x)


def case_engine_muon(rng, shape):
    """shape (label, B, T, attention): two steps of the engine under Muon (its momentum, the Newton-Schulz
    iteration as batched bf16 GEMMs, the scaled update, per-group learning rates) vs float64 `optim.Muon`
    on the engine's own gradients: the hidden matrices' update, the other tensors' (AdamW), the image."""
    import cupy

    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model.config import ModelConfig
    from nanoeuler.optim import Muon, clip_grad_norm, group_lr_scale, newton_schulz, param_group

    which, B, T, attention = shape
    if attention == "wg" and not has_sm90a():
        return []
    if which == "small":
        cfg = ModelConfig.named("small")
    else:  # q 384x384, k/v 128x384, gate/up 1024x384 (tall), down 384x1024 (wide)
        cfg = ModelConfig(vocab_size=1024, dim=384, n_layers=3, n_heads=6, n_kv_heads=2, ctx_len=256, mtp_heads=4)
    params, inputs, targets = _engine_problem(rng, cfg, B, T)
    scale = group_lr_scale(params, {"hidden": 3.0, "embed": 2.0})
    eng = TrainEngine(cfg, params, batch=B, seq=T, max_norm=0.5, attention=attention, optimizer="muon", lr_scale=scale)
    p64 = {n: p.astype(np.float64) for n, p in params.items()}
    refs = {"float64": {n: p.copy() for n, p in p64.items()}, "bf16": {n: p.copy() for n, p in p64.items()}}
    opts = {
        k: Muon(
            ref_p,
            betas=(0.9, 0.95),
            eps=1e-8,
            weight_decay=0.1,
            lr_scale=scale,
            orthogonalize=newton_schulz_bf16 if k == "bf16" else None,
        )
        for k, ref_p in refs.items()
    }
    for lr in (1e-2, 5e-3):  # the second step carries the first's momentum
        eng.forward_backward(_g(inputs, np.int32), _g(targets, np.int32))
        g_dev = {n: np.asarray(g.get(), dtype=np.float64) for n, g in eng.grads().items()}
        clip_grad_norm(g_dev, 0.5)
        for k in refs:
            opts[k].step(refs[k], g_dev, lr)
        eng.optimizer_step(lr)
    cupy.cuda.get_current_stream().synchronize()
    new = eng.params()
    hidden = [n for n in params if param_group(n) == "hidden"]
    rest = [n for n in params if param_group(n) != "hidden"]
    rows = []
    # The whole update against the reference that rounds where the engine rounds, and against exact
    # float64 Newton-Schulz: to 2e-2 and 3e-2, as bf16 products cost that much. Small singular values
    # grow ~3.4x per step (the quintic's slope at 0), and with them any difference in the last bit of a
    # bf16 rounding (float32 vs float64 sums): the rounded reference is about as far from the engine
    # (1.0-1.1e-2 on an H200) as exact float64 is (1.4-1.7e-2; 1.1-1.5e-2 between the two on the CPU).
    # A wrong transpose, scale or gain is off by order one. The iteration alone, below, on matrices with
    # singular values in [0.1, 1] before scaling: 1.3-2.1e-2 from float64 on an H200, so held to 3e-2.
    for label, names, ref_p, tol in (
        ("hidden matrices vs bf16-rounded Newton-Schulz", hidden, refs["bf16"], 2e-2),
        ("hidden matrices vs float64 Newton-Schulz", hidden, refs["float64"], 3e-2),
        ("AdamW groups", rest, refs["float64"], 1e-4),
    ):
        upd = np.concatenate([(new[n].get().astype(np.float64) - p64[n]).ravel() for n in names])
        upd_ref = np.concatenate([(ref_p[n] - p64[n]).ravel() for n in names])
        rows.append((f"engine muon 2 steps, {label}", upd, upd_ref, tol))
    # the batched Newton-Schulz alone: each shape's matrices with singular values in [0.1, 1]
    for sh in eng.muon_shapes:
        if sh.name not in ("self_attn.k_proj", "mlp.gate_proj", "mlp.down_proj"):
            continue
        L = cfg.n_layers
        mats = [_well_conditioned(rng, sh.rows, sh.cols) for _ in range(L)]
        x_in = [from_bf16(to_bf16(x)) for x in mats]
        for layer, x in enumerate(x_in):
            sh.x[2 * layer * sh.stride :][: x.size].set(to_bf16(x).ravel())
        with eng._on_stream():
            out = eng._newton_schulz(sh)
        cupy.cuda.get_current_stream().synchronize()
        got = np.stack(
            [
                from_bf16(out[2 * layer * sh.stride :][: sh.rows * sh.cols].get()).reshape(sh.rows, sh.cols)
                for layer in range(L)
            ]
        )
        ref = np.stack([newton_schulz(x) for x in x_in])  # their norm is 1 already: scaling changes nothing
        rows.append((f"engine newton-schulz, {L} x {sh.name.split('.')[1]} {sh.rows}x{sh.cols}", got, ref, 3e-2))
    ref_p = refs["float64"]
    names = list(params)
    rows.append(_image_row("engine muon bf16 weight image (gains folded)", eng, ref_p, names))
    del eng
    return rows


def case_engine_dpo(rng, shape):
    """shape (label, pairs, T, attention, checkpoint): the engine with the DPO head (sequence log-probs of
    head 0, the pair loss against reference log-probs, label smoothing): loss and every gradient (the MTP
    heads' zero) vs float64 `loss_and_grads(..., head_loss=dpo_head_loss(...))`, responses masked as
    `train.pairs.pair_batch` masks them."""
    from nanoeuler.kernels import has_sm90a
    from nanoeuler.kernels.bf16.engine import TrainEngine
    from nanoeuler.model import dpo, transformer
    from nanoeuler.model.config import ModelConfig

    which, P, T, attention, checkpoint = shape
    if attention == "wg" and not has_sm90a():
        return []
    if which == "d384":
        cfg = ModelConfig(vocab_size=1024, dim=384, n_layers=2, n_heads=6, n_kv_heads=2, ctx_len=256, mtp_heads=4)
    else:
        cfg = ModelConfig.named("small")
    B = 2 * P
    params, inputs, targets = _engine_problem(rng, cfg, B, T)
    targets[:, :, 1:] = -1
    for b in range(B):  # a prompt, then a response of its own length, then padding
        start, stop = int(rng.integers(2, T // 3)), int(rng.integers(T // 2, T + 1))
        targets[b, :start, 0] = -1
        targets[b, stop:, 0] = -1
    p64 = {n: p.astype(np.float64) for n, p in params.items()}
    # reference log-probs near the policy's, so that the margins are of order one (not saturated)
    idx, tgt, seq = dpo.response_rows(targets)
    tok, _ = dpo.token_logps(transformer.logits(p64, inputs, cfg).reshape(B * T, -1)[idx], tgt)
    ref = dpo.sequence_logps(tok, seq, B) + rng.standard_normal(B) * 10.0
    beta, eps = 0.1, 0.1
    eng = TrainEngine(
        cfg,
        params,
        batch=B,
        seq=T,
        attention=attention,
        chunk_bytes=2 * cfg.vocab_size * 48,
        head="dpo",
        dpo_beta=beta,
        dpo_label_smoothing=eps,
        checkpoint=checkpoint,
    )
    weights = np.full(P, 1.0 / P)
    for _ in range(2):
        eng.forward_backward(_g(inputs, np.int32), _g(targets, np.int32), ref, weights)
    loss_ref, g_ref = transformer.loss_and_grads(
        p64, inputs, targets, cfg, head_loss=dpo.dpo_head_loss(ref, beta=beta, label_smoothing=eps)
    )
    got = {n: np.asarray(g.get(), dtype=np.float64) for n, g in eng.grads().items()}
    names = [n for n in params if not n.startswith("mtp_heads.")]
    mtp = [n for n in params if n.startswith("mtp_heads.")]
    errs = {n: float(np.linalg.norm(got[n] - g_ref[n]) / max(np.linalg.norm(g_ref[n]), 1e-30)) for n in names}
    worst = max(names, key=lambda n: errs[n] if np.isfinite(errs[n]) else np.inf)
    logp = eng.last_logps()[0]
    rows = [
        ("engine dpo sequence log-probs", logp, dpo.sequence_logps(tok, seq, B), TOL_BF16),
        ("engine dpo loss", np.array([eng.last_loss()]), np.array([loss_ref]), TOL_BF16),
        (
            "engine dpo grads, all tensors",
            np.concatenate([got[n].ravel() for n in names]),
            np.concatenate([g_ref[n].ravel() for n in names]),
            TOL_BF16,
        ),
        (f"engine dpo grad, worst: {worst.replace('layers.', 'L')}", got[worst], g_ref[worst], 2 * TOL_BF16),
    ]
    if mtp:
        rows.append(
            (
                "engine dpo MTP heads' gradients are zero",
                np.concatenate([got[n].ravel() for n in mtp]),
                np.zeros(sum(got[n].size for n in mtp)),
                0.0,
            )
        )
    del eng
    return rows


CASES_BF16 = [
    # the engine's products, at the step's layouts (op(a), op(b)), output types and accumulation
    (case_bf16_gemm, (300, 1280, 768, False, True, "bf16", 0), "M300 N1280 K768 a b^T", {}),
    (case_bf16_gemm, (300, 768, 2048, False, False, "bf16", 0), "M300 N768 K2048 a b", {}),
    (case_bf16_gemm, (768, 2048, 300, True, False, "f32", 0), "M768 N2048 K300 a^T b", {}),
    (case_bf16_gemm, (4096, 768, 300, True, False, "f32", 1), "M4096 N768 K300 a^T b +c", {}),
    (case_bf16_gemm, (300, 768, 4096, False, False, "f32", 1), "M300 N768 K4096 a b +c", {}),
    (case_bf16_gemm, (37, 100, 64, False, True, "bf16", 1), "M37 N100 K64 a b^T +c (unaligned rows)", {}),
    (case_bf16_gemm_batched, (3, 96, 96, 160, False, True, 1.0, 0.0), "3 x X X^T, X 96x160", {}),
    (case_bf16_gemm_batched, (3, 64, 64, 160, True, False, 1.0, 0.0), "3 x X^T X, X 160x64", {}),
    (case_bf16_gemm_batched, (2, 96, 96, 96, False, False, 2.0315, -4.775), "2 x c A A + b B", {}),
    (case_bf16_gemm_batched, (3, 64, 160, 64, False, False, 1.0, 3.4445), "3 x B X + a X", {}),
    (case_bf16_rmsnorm, (300, 768), "N300 C768", {}),
    (case_bf16_rmsnorm, (37, 341), "N37 C341", {}),
    (case_bf16_rmsnorm, (1000, 1024), "N1000 C1024", {}),
    (case_bf16_rmsnorm, (300, 1152), "N300 C1152 (the 270M's width)", {}),
    (case_bf16_rmsnorm, (20, 1540), "N20 C1540 (scalar path)", {}),
    (case_bf16_gain_fold, (1280, 768), "R1280 C768", {}),
    (case_bf16_gain_fold, (16384, 768), "R16384 C768", {}),
    (case_bf16_gain_fold, (37, 341), "R37 C341 (scalar path)", {}),
    (case_bf16_gain_fold, (100, 200), "R100 C200", {}),
    (case_bf16_rope, (2, 37, 12, 4, 64), "B2 T37 H12/4 D64", {}),
    (case_bf16_rope, (1, 50, 4, 2, 32), "B1 T50 H4/2 D32", {}),
    (case_bf16_attn_layout, (2, 37, 12, 64), "B2 T37 H12 D64", {}),
    (case_bf16_swiglu, (100, 2048), "N100 F2048", {}),
    (case_bf16_swiglu, (37, 341), "N37 F341", {}),
    (case_bf16_swiglu, (37, 342), "N37 F342", {}),
    (case_bf16_swiglu, (70000, 6), "N70000 F6 (rows > grid)", {}),
    (case_bf16_swiglu_gemm, (300, 768, 2048), "N300 C768 F2048 (a short row tile)", {}),
    (case_bf16_swiglu_gemm, (64, 64, 128), "N64 C64 F128 (one tile, one k step)", {}),
    (case_bf16_swiglu_gemm, (190, 128, 128), "N190 C128 F128 (2 row tiles, the second short)", {}),
    (case_bf16_swiglu_gemm, (40000, 256, 256), "N40000 C256 F256 (several tiles a block)", {}),
    (case_bf16_swiglu_gemm, (1000, 384, 1024), "N1000 C384 F1024", {}),
    (case_bf16_swiglu_fwd_gemm, (300, 768, 2048), "N300 C768 F2048 (a short row tile)", {}),
    (case_bf16_swiglu_fwd_gemm, (64, 64, 64), "N64 C64 F64 (one tile, one k step)", {}),
    (case_bf16_swiglu_fwd_gemm, (190, 128, 128), "N190 C128 F128 (2 row tiles, the second short)", {}),
    (case_bf16_swiglu_fwd_gemm, (40000, 256, 192), "N40000 C256 F192 (several tiles a block)", {}),
    (case_bf16_swiglu_fwd_gemm, (1000, 384, 1024), "N1000 C384 F1024", {}),
    (case_bf16_qkv_rope_gemm, (3, 192, 6, 2, 384), "B3 T192 H6/2 C384 (a short row tile)", {}),
    (case_bf16_qkv_rope_gemm, (1, 64, 1, 1, 64), "B1 T64 H1/1 C64 (one tile, one k step, 3 heads)", {}),
    (case_bf16_qkv_rope_gemm, (2, 320, 5, 1, 128), "B2 T320 H5/1 C128 (tiles across q/k and k/v)", {}),
    (case_bf16_qkv_rope_gemm, (8, 512, 12, 4, 768), "B8 T512 H12/4 C768 (several tiles a block)", {}),
    (case_bf16_ce_heads, (70, 4, 4096), "N70 K4 V4096", {}),
    (case_bf16_ce_heads, (33, 2, 100), "N33 K2 V100", {}),
    (case_bf16_ce_heads, (33, 2, 101), "N33 K2 V101 (scalar path)", {}),
    (case_bf16_ce_heads, (70, 4, 4096, (1.0, 0.5, 0.0, 0.25)), "N70 K4 V4096 head weights 1, .5, 0, .25", {}),
    (case_bf16_seq_logp, (6, 37, 4, 4096, 50), "B6 T37 K4 V4096 R50 (a padding pair)", {}),
    (case_bf16_seq_logp, (4, 20, 2, 101, 80), "B4 T20 K2 V101 R80 (scalar path, one chunk)", {}),
    (case_bf16_grad_accumulate, (1000,), "n1000", {}),
    (case_bf16_grad_accumulate, (12345,), "n12345 (a scalar tail)", {}),
    (case_bf16_sumsq, (3_000_001,), "n3000001 (4096 blocks)", {}),
    (case_bf16_sumsq, (1000,), "n1000 (4 blocks)", {}),
    (case_bf16_muon_momentum, (3, 96, 160, 64), "3 layers 96x160, 64 apart", {}),
    (case_bf16_muon_momentum, (16, 768, 768, 0), "16 layers 768x768 (the gpu preset's q)", {}),
    (case_bf16_muon_poly_init, (96, 3), "m96 x3", {}),
    (case_bf16_muon_poly_init, (37, 2), "m37 x2 (one value at a time)", {}),
    (case_bf16_flash, (2, 12, 4, 100, 64, "mma"), "B2 H12/4 T100 D64", {}),
    (case_bf16_flash, (1, 4, 4, 129, 64, "mma"), "B1 H4/4 T129 D64", {}),
    (case_bf16_flash, (2, 4, 2, 37, 32, "mma"), "B2 H4/2 T37 D32", {}),
    (case_bf16_flash, (1, 12, 4, 512, 64, "mma"), "B1 H12/4 T512 D64", {}),
    (case_bf16_flash, (2, 12, 4, 100, 64, "ldm"), "B2 H12/4 T100 D64", {}),
    (case_bf16_flash, (1, 4, 4, 129, 64, "ldm"), "B1 H4/4 T129 D64", {}),
    (case_bf16_flash, (2, 4, 2, 37, 32, "ldm"), "B2 H4/2 T37 D32", {}),
    (case_bf16_flash, (1, 12, 4, 512, 64, "ldm"), "B1 H12/4 T512 D64", {}),
    (case_bf16_flash, (3, 12, 4, 1024, 64, "ldm"), "B3 H12/4 T1024 D64", {}),
    (case_bf16_flash, (2, 12, 4, 100, 64, "wg"), "B2 H12/4 T100 D64", {}),
    (case_bf16_flash, (1, 4, 4, 129, 64, "wg"), "B1 H4/4 T129 D64", {}),
    (case_bf16_flash, (1, 12, 4, 512, 64, "wg"), "B1 H12/4 T512 D64", {}),
    (case_bf16_flash, (3, 12, 4, 1024, 64, "wg"), "B3 H12/4 T1024 D64", {}),
    (case_engine, ("small", 2, 100, "mma"), "small preset B2 T100 D32", {}),
    (case_engine, ("d64", 2, 200, "mma"), "2 layers D64 B2 T200", {}),
    (case_engine, ("d64", 2, 200, "fp32"), "2 layers D64 B2 T200 fp32-attn", {}),
    (case_engine, ("d64", 2, 200, "ldm"), "2 layers D64 B2 T200 ldm-attn", {}),
    (case_engine, ("small", 2, 100, "ldm"), "small preset B2 T100 ldm-attn", {}),
    (case_engine, ("d64", 2, 200, "wg"), "2 layers D64 B2 T200 wg-attn", {}),
    (case_engine, ("d384", 2, 256, "wg"), "2 layers C384 F1024 B2 T256 wg-attn, fused SwiGLU and RoPE", {}),
    (case_engine_head_weights, ("mma",), "head weights, 2 layers D64 B2 T128", {}),
    (case_engine_muon, ("small", 2, 100, "mma"), "Muon, small preset B2 T100", {}),
    (case_engine_muon, ("d384", 2, 256, "wg"), "Muon, 3 layers C384 F1024 B2 T256 wg-attn", {}),
    (case_engine_dpo, ("small", 2, 100, "mma", False), "DPO head, small preset 2 pairs T100", {}),
    (case_engine_dpo, ("d384", 2, 256, "wg", True), "DPO head, 2 layers C384 2 pairs T256 wg, checkpointing", {}),
]

__all__ = ["CASES_BF16", "to_bf16", "from_bf16", "bf16_round", "math"]
