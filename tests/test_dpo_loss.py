"""The DPO loss and its hand-written gradient, checked three ways: float64 finite differences through the
whole model, PyTorch autograd of the same loss on a PyTorch rendering of the model, and GPU vs CPU."""

import math

import numpy as np
import pytest

from nanoeuler.checks import gradcheck, problem
from nanoeuler.model import dpo, transformer
from nanoeuler.model.config import ModelConfig


def pair_problem(seed=0, pairs=3, T=7, cfg=problem.CHECK_CONFIG):
    """(params, inputs (2P,T), targets (2P,T,K), ref (2P,)): a shared prompt per pair, then responses of
    different lengths; only head 0 has targets, and one rejected response is a single token."""
    params, _, _ = problem.random_problem(cfg, seed=seed, batch=2 * pairs, T=T)
    rng = np.random.default_rng(seed + 10)
    seqs = rng.integers(0, cfg.vocab_size, size=(2 * pairs, T + 1))
    targets = np.full((2 * pairs, T, cfg.mtp_heads), -1)
    for i in range(pairs):
        n_prompt = 2 + i % 3
        seqs[pairs + i, :n_prompt] = seqs[i, :n_prompt]  # chosen and rejected share the prompt
        for b, end in ((i, T), (pairs + i, n_prompt + (1 if i == 0 else T - n_prompt - 1))):
            targets[b, n_prompt - 1 : end, 0] = seqs[b, n_prompt : end + 1]
    ref = rng.normal(-8.0, 2.0, size=2 * pairs)
    return params, seqs[:, :T], targets, ref


def reference_loss(params, inputs, targets, ref, cfg, beta, eps):
    """The DPO loss from the full logits (log-softmax over every position, then the response mask):
    a forward written independently of dpo.py's row gathering."""
    lg = transformer.logits(params, inputs, cfg)  # (B,T,V)
    lse = np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1)) + lg.max(-1)
    t = targets[:, :, 0]
    picked = np.take_along_axis(lg, np.maximum(t, 0)[..., None], -1)[..., 0] - lse
    logp = np.where(t >= 0, picked, 0.0).sum(1)
    P = len(logp) // 2
    h = beta * ((logp[:P] - ref[:P]) - (logp[P:] - ref[P:]))
    return float(np.mean((1 - eps) * np.logaddexp(0, -h) + eps * np.logaddexp(0, h)))


@pytest.mark.parametrize("beta,eps", [(0.1, 0.0), (2.0, 0.2)])
def test_loss_matches_full_logits_and_gradients_match_finite_differences(beta, eps):
    cfg = problem.CHECK_CONFIG
    params, inputs, targets, ref = pair_problem(seed=1)
    loss, grads = transformer.loss_and_grads(
        params, inputs, targets, cfg, head_loss=dpo.dpo_head_loss(ref, beta=beta, label_smoothing=eps)
    )
    assert loss == pytest.approx(reference_loss(params, inputs, targets, ref, cfg, beta, eps), rel=1e-12)
    rng = np.random.default_rng(0)
    h, worst = gradcheck.STEP, 0.0
    for name, p in params.items():
        g = grads[name]
        if name.startswith("mtp_heads."):
            assert not g.any()  # DPO trains head 0 only
            continue
        picks = np.unique(np.append(rng.choice(p.size, size=min(p.size, 12), replace=False), np.argmax(np.abs(g))))
        for j in picks:
            idx = np.unravel_index(j, p.shape)
            orig = p[idx]
            vals = []
            for d in (h, -h, 2 * h, -2 * h):
                p[idx] = orig + d
                vals.append(reference_loss(params, inputs, targets, ref, cfg, beta, eps))
            p[idx] = orig
            num = (8 * (vals[0] - vals[1]) - (vals[2] - vals[3])) / (12 * h)
            worst = max(worst, gradcheck.relative_error(g[idx], num))
    print(f"DPO gradients vs float64 finite differences (beta {beta}, eps {eps}): max relative error {worst:.2e}")
    assert worst <= 1e-6, f"max relative error {worst:.2e}"


def test_gradients_match_torch_autograd():
    torch = pytest.importorskip("torch")
    from test_torch_oracle import torch_final_state

    cfg = ModelConfig(
        vocab_size=17,
        dim=16,
        n_layers=2,
        n_heads=4,
        n_kv_heads=1,
        ctx_len=12,
        ffn_hidden=20,
        mtp_heads=2,
        rope_theta=10000.0,
        norm_eps=1e-5,
    )
    params, inputs, targets, ref = pair_problem(seed=4, pairs=4, T=9, cfg=cfg)
    beta, eps = 0.5, 0.1
    P = {n: torch.tensor(p, dtype=torch.float64, requires_grad=True) for n, p in params.items()}
    xn = torch_final_state(P, torch.tensor(inputs), cfg)
    t = torch.tensor(targets[:, :, 0])
    logp_all = torch.log_softmax(xn @ P["lm_head.weight"].T, dim=-1)
    logp = torch.where(t >= 0, logp_all.gather(-1, t.clamp(min=0)[..., None])[..., 0], 0.0).sum(1)
    d = logp - torch.tensor(ref)
    h = beta * (d[:4] - d[4:])
    want = (-(1 - eps) * F_logsigmoid(torch, h) - eps * F_logsigmoid(torch, -h)).mean()
    want.backward()
    loss, grads = transformer.loss_and_grads(
        params, inputs, targets, cfg, head_loss=dpo.dpo_head_loss(ref, beta=beta, label_smoothing=eps)
    )
    assert abs(loss - want.item()) <= 1e-10 * abs(want.item())
    worst = 0.0
    for name in params:
        g = P[name].grad.numpy() if P[name].grad is not None else np.zeros_like(params[name])
        err = np.linalg.norm(grads[name] - g) / max(np.linalg.norm(g), 1e-300)
        worst = max(worst, err)
        assert err <= 1e-10, f"{name}: relative error {err:.2e}"
    print(f"DPO gradients vs PyTorch autograd: max relative error {worst:.2e}")


def F_logsigmoid(torch, x):
    return torch.nn.functional.logsigmoid(x)


def test_pair_loss_at_zero_margin_and_extremes():
    loss, dlogp, h = dpo.pair_loss(np.zeros(4), np.zeros(4), beta=0.1)
    assert loss == pytest.approx(math.log(2)) and not h.any()
    assert np.allclose(dlogp, [-0.025, -0.025, 0.025, 0.025])  # push chosen up, rejected down
    loss, dlogp, _ = dpo.pair_loss(np.array([1e4, -1e4]), np.zeros(2), beta=1.0)  # h = 2e4: no overflow
    assert loss == pytest.approx(0.0) and np.isfinite(dlogp).all()
    loss, _, _ = dpo.pair_loss(np.array([-1e4, 1e4]), np.zeros(2), beta=1.0)
    assert loss == pytest.approx(2e4)
    loss, _, _ = dpo.pair_loss(np.array([1e4, -1e4]), np.zeros(2), beta=1.0, label_smoothing=0.25)
    assert loss == pytest.approx(0.25 * 2e4)  # smoothing bounds how far a pair is pushed


def test_bad_reference_shape_is_refused():
    params, inputs, targets, ref = pair_problem(seed=2, pairs=2)
    with pytest.raises(ValueError, match="reference"):
        transformer.loss_and_grads(
            params, inputs, targets, problem.CHECK_CONFIG, head_loss=dpo.dpo_head_loss(ref[:3], beta=0.1)
        )


@pytest.mark.gpu
def test_gpu_gradients_match_cpu():
    import cupy as cp

    cfg = problem.CHECK_CONFIG
    params, inputs, targets, ref = pair_problem(seed=3, pairs=3)
    fn = dpo.dpo_head_loss(ref, beta=0.5, label_smoothing=0.1)
    loss, grads = transformer.loss_and_grads(params, inputs, targets, cfg, head_loss=fn)
    for dtype, tol in ((np.float64, 1e-10), (np.float32, 1e-5)):
        dev = {n: cp.asarray(p, dtype=dtype) for n, p in params.items()}
        gl, gg = transformer.loss_and_grads(
            dev,
            cp.asarray(inputs),
            cp.asarray(targets),
            cfg,
            head_loss=dpo.dpo_head_loss(ref, beta=0.5, label_smoothing=0.1),
        )
        assert abs(gl - loss) <= tol * abs(loss)
        worst = 0.0
        for name in params:
            got = cp.asnumpy(gg[name]).astype(np.float64)
            err = np.linalg.norm(got - grads[name]) / max(np.linalg.norm(grads[name]), 1e-300)
            worst = max(worst, err)
            assert err <= tol, f"{dtype.__name__} {name}: relative error {err:.2e}"
        print(f"DPO gradients, GPU {dtype.__name__} vs CPU float64: max relative error {worst:.2e}")
