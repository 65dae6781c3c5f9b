"""Muon, the schedules and the init options on the CPU: the Newton-Schulz iteration against the exact polar
factor from an SVD (float64), the reference Muon against a PyTorch Muon written here, the data-parallel hook
and the state a checkpoint keeps under Muon, warmup-stable-decay, per-group learning rates, zero-initialised
output projections."""

import math

import numpy as np
import pytest

from nanoeuler.config import validate
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import GROUPS, AdamW, Muon, lr_at, muon_scale, newton_schulz, param_group
from nanoeuler.train.config import PretrainConfig
from nanoeuler.train.stepper import make_stepper
from train_fixtures import step_in_threads, thread_mean_hooks

CFG = ModelConfig(vocab_size=40, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)


def _settings(**kw):
    return PretrainConfig.from_section(dict(validate({})["pretrain"], **kw))


def _params(seed=0):
    return {n: p.astype(np.float64) for n, p in transformer.init_params(CFG, seed=seed).items()}


def _micro(seed, B=2):
    rng = np.random.default_rng(seed)
    w = rng.integers(0, CFG.vocab_size, size=(B, CFG.ctx_len + CFG.mtp_heads))
    y = np.stack([w[:, 1 + k : CFG.ctx_len + 1 + k] for k in range(CFG.mtp_heads)], axis=-1)
    return w[:, : CFG.ctx_len], y


def _with_singular_values(rows, cols, s, seed=0):
    rng = np.random.default_rng(seed)
    u, _ = np.linalg.qr(rng.standard_normal((rows, len(s))))
    v, _ = np.linalg.qr(rng.standard_normal((cols, len(s))))
    return u @ np.diag(s) @ v.T, u, v


@pytest.mark.parametrize("rows,cols", [(24, 40), (40, 24), (32, 32)])
def test_newton_schulz_is_the_polar_factor_up_to_a_band_of_singular_values(rows, cols):
    """U^T NS(G) V is diagonal (the singular vectors are kept exactly, in float64), and every singular
    value of G at least 1/250 of its Frobenius norm comes out in [0.6, 1.25] (the quintic's promise);
    NS(G) is thus within that band of the exact polar factor U V^T."""
    s = np.geomspace(1e-2, 1.0, min(rows, cols))
    g, u, v = _with_singular_values(rows, cols, s)
    o = newton_schulz(g)
    d = u.T @ o @ v
    assert np.abs(d - np.diag(np.diag(d))).max() < 1e-12
    kept = s / np.linalg.norm(g) >= 1 / 250
    assert kept.all()
    assert np.all((np.diag(d) >= 0.6) & (np.diag(d) <= 1.25)), np.diag(d)
    polar = u @ v.T
    assert np.linalg.norm(o - polar, 2) <= 0.4  # the spectral distance is the band's width at most


def test_newton_schulz_of_a_transpose_and_of_a_stack():
    rng = np.random.default_rng(1)
    g = rng.standard_normal((3, 12, 20))
    stacked = newton_schulz(g)
    for i in range(3):
        np.testing.assert_allclose(stacked[i], newton_schulz(g[i]), rtol=0, atol=1e-12)
        np.testing.assert_allclose(newton_schulz(g[i].T), stacked[i].T, rtol=0, atol=1e-12)


def test_param_groups_cover_the_model_and_hidden_is_the_muon_set():
    groups = {n: param_group(n) for n in CFG.param_shapes()}
    assert set(groups.values()) == set(GROUPS)
    hidden = [n for n, g in groups.items() if g == "hidden"]
    assert len(hidden) == 7 * CFG.n_layers and all(len(CFG.param_shapes()[n]) == 2 for n in hidden)


def torch_muon_steps(params, grads_of, lrs, lr_scale, momentum=0.95, wd=0.1):
    """An independent rendering: torch.optim.AdamW (groups for decay and lr) on the embedding, heads and
    gains; Muon written out on the hidden matrices. grads_of(params as NumPy) -> grads."""
    import torch

    P = {n: torch.tensor(p, dtype=torch.float64) for n, p in params.items()}
    hidden = [n for n in P if param_group(n) == "hidden"]
    rest = [n for n in P if n not in hidden]
    no_decay = [n for n in rest if P[n].ndim < 2 or n.endswith("norm.weight") or n.startswith("embed_tokens.")]
    groups = [{"params": [P[n]], "weight_decay": 0.0 if n in no_decay else wd, "scale": lr_scale[n]} for n in rest]
    opt = torch.optim.AdamW(groups, lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    buf = {n: torch.zeros_like(P[n]) for n in hidden}
    a, b, c = 3.4445, -4.7750, 2.0315
    for lr in lrs:
        grads = grads_of({n: p.numpy() for n, p in P.items()})
        for group, n in zip(opt.param_groups, rest):
            group["lr"] = lr * group["scale"]
            P[n].grad = torch.tensor(grads[n])
        opt.step()
        with torch.no_grad():
            for n in hidden:
                g = torch.tensor(grads[n])
                buf[n].mul_(momentum).add_(g)
                x = g + momentum * buf[n]
                x = x / (torch.linalg.matrix_norm(x) + 1e-7)
                tall = x.shape[0] > x.shape[1]
                if tall:
                    x = x.T
                for _ in range(5):
                    A = x @ x.T
                    x = a * x + (b * A + c * A @ A) @ x
                if tall:
                    x = x.T
                lr_n = lr * lr_scale[n]
                P[n].mul_(1 - lr_n * wd)
                P[n].add_(x, alpha=-lr_n * 0.2 * math.sqrt(max(P[n].shape)))
    return {n: p.numpy() for n, p in P.items()}


def test_reference_muon_matches_a_pytorch_muon():
    pytest.importorskip("torch")
    params, x = _params(), _micro(3)
    scale = _settings(optimizer="muon", lr=1e-2, muon_lr=3e-2, lr_scale={"embed": 2.0}).group_lr_scale(params)
    assert scale["layers.0.mlp.up_proj.weight"] == pytest.approx(3.0) and scale["embed_tokens.weight"] == 2.0

    def grads_of(p):
        return transformer.loss_and_grads(p, *x, CFG)[1]

    lrs = [1e-2, 8e-3, 5e-3]
    expect = torch_muon_steps(params, grads_of, lrs, scale)
    ours = {n: p.copy() for n, p in params.items()}
    opt = Muon(ours, lr_scale=scale)
    for lr in lrs:
        opt.step(ours, grads_of(ours), lr)
    assert opt.t == 3
    for n in params:
        np.testing.assert_allclose(ours[n], expect[n], rtol=1e-10, atol=1e-13, err_msg=n)
    assert not np.allclose(ours["layers.1.mlp.down_proj.weight"], params["layers.1.mlp.down_proj.weight"])


def test_muon_state_round_trips_and_keeps_only_momentum_for_hidden_matrices():
    a = make_stepper(_settings(optimizer="muon"), CFG, _params(), np)
    for s in range(3):
        a.step([_micro(s)], lr=1e-2)
    state = a.state_tensors()
    assert "m.layers.0.self_attn.q_proj.weight" in state and "v.layers.0.self_attn.q_proj.weight" not in state
    assert "v.embed_tokens.weight" in state
    b = make_stepper(_settings(optimizer="muon"), CFG, {n: p.copy() for n, p in a.params().items()}, np)
    b.load_state_tensors({n: t.copy() for n, t in state.items()}, a.t)
    x = _micro(9)
    assert a.step([x], lr=1e-2) == b.step([x], lr=1e-2) and b.t == 4
    for n, p in a.params().items():
        np.testing.assert_array_equal(p, b.params()[n])


def test_muon_under_a_data_parallel_hook_updates_every_rank_alike():
    """Two ranks average their gradients in the hook: each applies the update one stepper over the whole
    batch applies (Muon's orthogonalisation runs on the averaged gradient on every rank)."""
    halves = [_micro(4), _micro(5)]
    settings = _settings(optimizer="muon")
    reference = make_stepper(settings, CFG, _params(), np)
    reference.step(halves, lr=1e-2)
    hooks = thread_mean_hooks(2)
    ranks = [make_stepper(settings, CFG, _params(), np, grad_hook=hooks[r]) for r in range(2)]
    step_in_threads(ranks, halves, lr=1e-2)
    for n, p in reference.params().items():
        np.testing.assert_array_equal(ranks[0].params()[n], ranks[1].params()[n])
        np.testing.assert_allclose(ranks[0].params()[n], p, rtol=1e-10, atol=1e-13)


def test_adamw_lr_scale_is_a_group_learning_rate():
    params, x = _params(), _micro(2)
    grads = transformer.loss_and_grads(params, *x, CFG)[1]
    scaled, plain = ({n: p.copy() for n, p in params.items()} for _ in range(2))
    AdamW(scaled, lr_scale={"embed_tokens.weight": 3.0}).step(scaled, grads, 1e-3)
    AdamW(plain).step(plain, grads, 1e-3)
    moved = lambda p, n: p[n] - params[n]  # noqa: E731
    np.testing.assert_allclose(
        moved(scaled, "embed_tokens.weight"), 3.0 * moved(plain, "embed_tokens.weight"), rtol=1e-9, atol=1e-18
    )
    np.testing.assert_array_equal(scaled["norm.weight"], plain["norm.weight"])


def test_wsd_holds_then_cools_down_linearly():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=100, schedule="wsd", cooldown_frac=0.2)
    lrs = [lr_at(s, **kw) for s in range(101)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == 1.0 and lrs[79] == 1.0 and lrs[80] == 1.0
    assert lrs[90] == pytest.approx(0.55) and lrs[100] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))
    cos = [lr_at(s, **dict(kw, schedule="cosine")) for s in range(101)]
    assert cos[9] == 1.0 and cos[55] == pytest.approx(0.55) and cos[100] == pytest.approx(0.1)
    with pytest.raises(ValueError):
        lr_at(50, **dict(kw, schedule="linear"))


def test_zero_init_out_zeroes_only_the_output_projections():
    base, zero = transformer.init_params(CFG, 0), transformer.init_params(CFG, 0, zero_out=True)
    for n in base:
        if n.endswith(("o_proj.weight", "down_proj.weight")):
            assert not zero[n].any()
        else:
            np.testing.assert_array_equal(zero[n], base[n])


def test_muon_scale_matches_adamw_rms():
    rng = np.random.default_rng(0)
    for shape in [(16, 48), (48, 16)]:
        u, _, vt = np.linalg.svd(rng.standard_normal(shape), full_matrices=False)  # the exact polar factor
        assert np.sqrt(np.mean((muon_scale(shape) * (u @ vt)) ** 2)) == pytest.approx(0.2, rel=1e-12)
