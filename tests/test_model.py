"""The whole model: configs and parameter counts, init, loss and gradients, KV-cache decoding, gradcheck."""

import io
import math
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler.config import validate
from nanoeuler.errors import UserError
from nanoeuler.checks import gradcheck, problem
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig

TINY = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=16, mtp_heads=3)


def windows(cfg, B, T, seed=0):
    w = np.random.default_rng(seed).integers(0, cfg.vocab_size, size=(B, T + cfg.mtp_heads))
    return w[:, :T], np.stack([w[:, 1 + k : T + 1 + k] for k in range(cfg.mtp_heads)], axis=-1)


# ---- configs ------------------------------------------------------------------------------------


def test_named_configs_and_parameter_counts():
    small, gpu = ModelConfig.named("small"), ModelConfig.named("gpu")
    assert (
        small.dim,
        small.n_heads,
        small.n_kv_heads,
        small.n_layers,
        small.ctx_len,
        small.vocab_size,
        small.hidden,
        small.mtp_heads,
    ) == (128, 4, 2, 4, 128, 512, 341, 4)
    assert (
        gpu.dim,
        gpu.n_heads,
        gpu.n_kv_heads,
        gpu.n_layers,
        gpu.ctx_len,
        gpu.vocab_size,
        gpu.hidden,
        gpu.mtp_heads,
    ) == (768, 12, 4, 16, 512, 4096, 2048, 4)
    assert small.n_params() == 1_049_216
    assert gpu.n_params() == 116_417_280  # counted from shapes; the 116M model is never built in tests
    p = transformer.init_params(small, seed=0)
    assert sum(a.size for a in p.values()) == 1_049_216


def test_param_names_follow_hf_llama():
    names = list(ModelConfig.named("small").param_shapes())
    assert names[0] == "embed_tokens.weight"
    assert names[1:10] == [
        f"layers.0.{n}.weight"
        for n in (
            "input_layernorm",
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    ]
    assert names[-5:] == [
        "norm.weight",
        "lm_head.weight",
        "mtp_heads.1.weight",
        "mtp_heads.2.weight",
        "mtp_heads.3.weight",
    ]


def test_config_round_trip_and_errors():
    cfg = ModelConfig.named("small")
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(UserError, match="unknown key"):
        ModelConfig.from_dict({**cfg.to_dict(), "dropout": 0.1})
    with pytest.raises(UserError, match="lacks"):
        ModelConfig.from_dict({"dim": 8})
    with pytest.raises(UserError, match="divisible by model.n_heads"):
        ModelConfig(vocab_size=10, dim=30, n_layers=1, n_heads=4, n_kv_heads=2, ctx_len=8)
    with pytest.raises(UserError, match="n_kv_heads"):
        ModelConfig(vocab_size=10, dim=24, n_layers=1, n_heads=4, n_kv_heads=3, ctx_len=8)
    with pytest.raises(UserError, match="even"):
        ModelConfig(vocab_size=10, dim=12, n_layers=1, n_heads=4, n_kv_heads=2, ctx_len=8)
    with pytest.raises(UserError, match="unknown model preset"):
        ModelConfig.named("huge")


def test_config_sections_of_the_three_runs():
    import yaml

    from nanoeuler.config import REPO_ROOT

    def section(name):
        with open(REPO_ROOT / "config" / name, encoding="utf-8") as f:
            return validate({"model": (yaml.safe_load(f) or {}).get("model", {})})["model"]

    assert ModelConfig.from_section(validate({})["model"], 4096) == ModelConfig.named("gpu")
    assert ModelConfig.from_section(section("config.yaml"), 4096).n_params() == 116_417_280
    assert ModelConfig.from_section(section("small.yaml"), 512).n_params() == 1_049_216
    tiny = ModelConfig.from_section(section("tiny.yaml"), 300)
    shape = (tiny.dim, tiny.n_layers, tiny.n_heads, tiny.n_kv_heads, tiny.ctx_len, tiny.mtp_heads)
    assert shape == (64, 2, 4, 2, 256, 2)
    assert tiny.vocab_size == 300  # always the tokenizer's
    with pytest.raises(UserError, match="model.dim"):
        validate({"model": {"dim": "wide"}})


# ---- init ---------------------------------------------------------------------------------------


def test_init_is_deterministic_and_documented():
    cfg = ModelConfig.named("small")
    a, b = transformer.init_params(cfg, seed=3), transformer.init_params(cfg, seed=3)
    c = transformer.init_params(cfg, seed=4)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["lm_head.weight"], c["lm_head.weight"])
    assert all(p.dtype == np.float32 for p in a.values())
    assert (a["norm.weight"] == 1).all() and (a["layers.2.input_layernorm.weight"] == 1).all()
    assert abs(a["lm_head.weight"].std() - 0.02) < 0.001
    assert abs(a["layers.0.self_attn.o_proj.weight"].std() - 0.02 / math.sqrt(8)) < 0.0005
    assert abs(a["layers.0.mlp.down_proj.weight"].std() - 0.02 / math.sqrt(8)) < 0.0005
    d = transformer.init_params(cfg, seed=3, dtype=np.float64)
    assert all(np.array_equal(d[n].astype(np.float32), a[n]) for n in a)


# ---- loss and gradients -------------------------------------------------------------------------


def test_loss_at_init_is_near_log_vocab_and_paths_agree():
    params = transformer.init_params(TINY, seed=0)
    x, y = windows(TINY, 3, 12)
    loss, grads = transformer.loss_and_grads(params, x, y, TINY)
    assert abs(loss - math.log(TINY.vocab_size)) < 0.05
    assert list(grads) == list(params)
    assert all(grads[n].shape == params[n].shape and grads[n].dtype == np.float32 for n in params)
    loss2, heads = transformer.forward_loss(params, x, y, TINY)
    assert loss2 == pytest.approx(loss, rel=1e-6)
    assert len(heads) == 3 and np.mean(heads) == pytest.approx(loss, rel=1e-6)
    lg = transformer.logits(params, x, TINY)
    assert lg.shape == (3, 12, TINY.vocab_size) and lg.dtype == np.float32


def test_head_losses_are_each_heads_cross_entropy():
    rng = np.random.default_rng(0)
    params = {
        n: p + 0.3 * rng.standard_normal(p.shape).astype(np.float32)
        for n, p in transformer.init_params(TINY, seed=1).items()
    }
    x, y = windows(TINY, 2, 8)
    y[0, :3, 1] = -1
    _, heads = transformer.forward_loss(params, x, y, TINY)
    for k in range(TINY.mtp_heads):
        lg = transformer.logits(params, x, TINY, head=k).astype(np.float64)
        logp = lg - np.log(np.exp(lg - lg.max(-1, keepdims=True)).sum(-1, keepdims=True)) - lg.max(-1, keepdims=True)
        t = y[..., k]
        ok = t >= 0
        want = -np.take_along_axis(logp, np.where(ok, t, 0)[..., None], -1)[..., 0][ok].mean()
        assert heads[k] == pytest.approx(want, rel=1e-5)


def test_a_head_without_targets_is_left_out_of_the_mean():
    params = transformer.init_params(TINY, seed=0)
    x, y = windows(TINY, 2, 8)
    y[..., 2] = -1
    loss, grads = transformer.loss_and_grads(params, x, y, TINY)
    _, heads = transformer.forward_loss(params, x, y, TINY)
    assert heads[2] == 0.0 and loss == pytest.approx((heads[0] + heads[1]) / 2, rel=1e-6)
    assert not grads["mtp_heads.2.weight"].any() and grads["mtp_heads.1.weight"].any()
    y[:] = -1
    loss, grads = transformer.loss_and_grads(params, x, y, TINY)
    assert loss == 0.0 and not any(g.any() for g in grads.values())
    assert transformer.forward_loss(params, x, y, TINY) == (0.0, [0.0, 0.0, 0.0])


def test_whole_model_against_finite_differences():
    errors = gradcheck.check(samples=6, seed=7, out=io.StringIO())
    assert set(errors) == set(problem.CHECK_CONFIG.param_shapes())
    assert max(errors.values()) <= 1e-6


def test_bad_inputs_are_rejected():
    params = transformer.init_params(TINY, seed=0)
    x, y = windows(TINY, 1, 4)
    with pytest.raises(ValueError, match="targets"):
        transformer.loss_and_grads(params, x, y[..., :2], TINY)
    with pytest.raises(ValueError, match="outside"):
        transformer.loss_and_grads(params, x + TINY.vocab_size, y, TINY)


def test_a_few_training_steps_reduce_the_loss():
    from nanoeuler.optim import AdamW

    params = transformer.init_params(TINY, seed=0)
    stream = np.tile(np.arange(10), 8)  # a pattern the model can learn quickly
    x = np.stack([stream[i : i + 16] for i in (0, 3)])
    y = np.stack([np.stack([stream[i + 1 + k : i + 17 + k] for k in range(3)], -1) for i in (0, 3)])
    opt = AdamW(params, weight_decay=0.0)
    first, _ = transformer.loss_and_grads(params, x, y, TINY)
    for _ in range(30):
        loss, grads = transformer.loss_and_grads(params, x, y, TINY)
        opt.step(params, grads, 1e-2)
    assert loss < 0.3 * first


# ---- incremental decoding -----------------------------------------------------------------------


def test_kv_cache_decoding_matches_full_forward():
    rng = np.random.default_rng(0)
    params = {
        n: p + 0.2 * rng.standard_normal(p.shape).astype(np.float32)
        for n, p in transformer.init_params(TINY, seed=2).items()
    }
    x, _ = windows(TINY, 2, 11)
    full = transformer.logits(params, x, TINY)
    cache = transformer.new_kv_cache(TINY, batch=2, max_len=16, xp=np, dtype=np.float32)
    parts = [transformer.forward_step(params, x[:, a:b], cache, TINY) for a, b in ((0, 5), (5, 6), (6, 11))]
    assert cache.length == 11
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, atol=2e-5)
    # rewinding forgets the last tokens: feeding them again gives the same logits
    cache.rewind(6)
    again = transformer.forward_step(params, x[:, 6:11], cache, TINY, all_heads=True)
    assert again.shape == (3, 2, 5, TINY.vocab_size)
    np.testing.assert_allclose(again[0], parts[2], atol=1e-6)
    np.testing.assert_allclose(again[2], transformer.logits(params, x, TINY, head=2)[:, 6:], atol=2e-5)
    with pytest.raises(ValueError, match="holds 16 positions"):
        transformer.forward_step(params, x[:, :6], cache, TINY)


# ---- the gradcheck stage ------------------------------------------------------------------------


def test_gradcheck_cli_passes_and_reports_every_tensor():
    out = subprocess.run(
        [sys.executable, "-m", "nanoeuler", "gradcheck", "--device", "cpu", "--samples", "8"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    for name in problem.CHECK_CONFIG.param_shapes():
        assert any(line.startswith(name + " ") for line in lines), name
    assert lines[-1].startswith("max relative error: ")
    assert float(lines[-1].split(": ")[1]) <= 1e-6


def test_gradcheck_fails_above_the_threshold(capsys):
    from nanoeuler.cli import main

    assert main(["gradcheck", "--device", "cpu", "--samples", "2", "--threshold", "1e-300"]) == 1
    assert "FAIL" in capsys.readouterr().out
