"""AdamW and clipping against PyTorch's, and the learning-rate schedule."""

import math

import numpy as np
import pytest

from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from nanoeuler.optim import AdamW, clip_grad_norm, default_no_decay, lr_at

torch = pytest.importorskip("torch")

CFG = ModelConfig(vocab_size=30, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=8, mtp_heads=2)


def test_default_no_decay_is_norms_and_embedding():
    params = transformer.init_params(CFG, seed=0)
    opt = AdamW(params)
    assert opt.no_decay == {
        "embed_tokens.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
        "norm.weight",
    }
    assert not default_no_decay("lm_head.weight", (30, 16))
    with pytest.raises(ValueError, match="unknown"):
        AdamW(params, no_decay=["nope"])


def test_adamw_matches_torch():
    rng = np.random.default_rng(0)
    params = {n: p.astype(np.float64) for n, p in transformer.init_params(CFG, seed=0).items()}
    opt = AdamW(params, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    tp = {n: torch.tensor(p.copy(), requires_grad=True) for n, p in params.items()}
    groups = [
        {"params": [tp[n] for n in tp if n not in opt.no_decay], "weight_decay": 0.1},
        {"params": [tp[n] for n in tp if n in opt.no_decay], "weight_decay": 0.0},
    ]
    topt = torch.optim.AdamW(groups, lr=1.0, betas=(0.9, 0.95), eps=1e-8)
    for step in range(5):
        lr = 1e-2 * (step + 1)
        grads = {n: rng.standard_normal(p.shape) for n, p in params.items()}
        opt.step(params, grads, lr)
        for group in topt.param_groups:
            group["lr"] = lr
        for n, t in tp.items():
            t.grad = torch.tensor(grads[n])
        topt.step()
    assert opt.t == 5
    for n in params:
        np.testing.assert_allclose(params[n], tp[n].detach().numpy(), rtol=1e-12, atol=1e-14)


def test_state_round_trip_continues_identically():
    rng = np.random.default_rng(1)
    a = transformer.init_params(CFG, seed=0)
    opt = AdamW(a)
    grads = [{n: rng.standard_normal(p.shape).astype(np.float32) for n, p in a.items()} for _ in range(4)]
    for g in grads[:2]:
        opt.step(a, g, 1e-3)
    b = {n: p.copy() for n, p in a.items()}
    opt2 = AdamW(b)
    opt2.load_state_tensors({k: v.copy() for k, v in opt.state_tensors().items()}, opt.t)
    for g in grads[2:]:
        opt.step(a, g, 1e-3)
        opt2.step(b, g, 1e-3)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert set(opt.state_tensors()) == {f"{k}.{n}" for n in a for k in ("m", "v")}
    with pytest.raises(ValueError, match="lacks"):
        opt2.load_state_tensors({}, 1)


def test_clip_grad_norm_matches_torch():
    rng = np.random.default_rng(2)
    grads = {"a": rng.standard_normal((3, 4)), "b": rng.standard_normal(5)}
    tg = [torch.tensor(g.copy(), requires_grad=True) for g in grads.values()]
    for t, g in zip(tg, grads.values()):
        t.grad = torch.tensor(g.copy())
    want = torch.nn.utils.clip_grad_norm_(tg, 1.0).item()
    norm = clip_grad_norm(grads, 1.0)
    assert norm == pytest.approx(want, rel=1e-12)
    for t, g in zip(tg, grads.values()):
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-12)
    # below the limit nothing changes; max_norm <= 0 turns clipping off
    small = {"a": np.array([0.3, 0.4])}
    assert clip_grad_norm(small, 1.0) == pytest.approx(0.5) and small["a"][0] == 0.3
    assert clip_grad_norm(small, 0.0) == pytest.approx(0.5)


def test_lr_schedule_warmup_then_cosine():
    kw = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(4, **kw) == pytest.approx(0.5)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(10, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)
    assert lr_at(35, **kw) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 4)))
    assert lr_at(110, **kw) == pytest.approx(0.1) and lr_at(500, **kw) == pytest.approx(0.1)
    lrs = [lr_at(s, **kw) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    assert lr_at(0, max_lr=1.0, min_lr=0.0, warmup_steps=0, total_steps=10) == pytest.approx(1.0)
