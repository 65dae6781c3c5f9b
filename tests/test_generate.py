"""Generation: sampling rules on given logits, KV-cache decoding equal to full recomputation, the context policy."""

import subprocess
import sys
from collections import Counter

import numpy as np
import pytest

from nanoeuler.infer.generate import Generator, fit_prompt
from nanoeuler.infer.sampling import Sampling, sample_token
from nanoeuler.model import transformer
from nanoeuler.model.config import ModelConfig
from train_fixtures import make_tokenizer, save_random_model

GREEDY = Sampling(temperature=0.0)


def draws(logits, n=400, seed=0, **kw):
    rng = np.random.default_rng(seed)
    return Counter(sample_token(logits, rng, **kw) for _ in range(n))


def test_greedy_and_degenerate_settings_pick_the_argmax():
    logits = np.array([0.1, 2.0, -1.0, 1.9])
    assert sample_token(logits, np.random.default_rng(0), 0.0) == 1
    assert set(draws(logits, 50, temperature=5.0, top_k=1)) == {1}
    assert set(draws(logits, 50, temperature=1.0, top_p=1e-6)) == {1}


def test_top_k_keeps_only_the_k_best():
    logits = np.log(np.array([0.1, 0.4, 0.2, 0.3]))
    assert set(draws(logits, temperature=1.0, top_k=2)) == {1, 3}
    assert set(draws(logits, temperature=1.0, top_k=0)) == {0, 1, 2, 3}


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = np.log(np.array([0.05, 0.5, 0.15, 0.3]))
    assert set(draws(logits, temperature=1.0, top_p=0.79)) == {1, 3}  # 0.5 + 0.3 reaches 0.79
    assert set(draws(logits, temperature=1.0, top_p=0.81)) == {1, 2, 3}


def test_sampling_follows_the_distribution_and_the_seed():
    p = np.array([0.2, 0.5, 0.3])
    c = draws(np.log(p), n=4000, temperature=1.0)
    freq = np.array([c[i] for i in range(3)]) / 4000
    np.testing.assert_allclose(freq, p, atol=0.03)
    assert draws(np.log(p), 100, seed=3, temperature=1.0) == draws(np.log(p), 100, seed=3, temperature=1.0)
    # low temperature sharpens towards the argmax
    assert draws(np.log(p), 400, temperature=0.1)[1] > 390


def test_fit_prompt_left_truncates():
    assert fit_prompt([1, 2, 3], ctx_len=10, room=4) == ([1, 2, 3], 0)
    assert fit_prompt(list(range(20)), ctx_len=10, room=4) == (list(range(14, 20)), 14)
    assert fit_prompt(list(range(20)), ctx_len=10, room=50) == ([19], 19)


@pytest.fixture(scope="module")
def model():
    cfg = ModelConfig(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=24, mtp_heads=2)
    params = transformer.init_params(cfg, seed=3)
    # larger output weights make the logits far from uniform, so greedy choices are not near-ties
    params["lm_head.weight"] = params["lm_head.weight"] * 20
    return params, cfg


def greedy_without_cache(params, cfg, prompt, n):
    """Reference: recompute the logits of the whole visible context for every token, same window policy."""
    history, out = list(prompt[-cfg.ctx_len :]), []
    for _ in range(n):
        lg = transformer.logits(params, np.array([history]), cfg)[0, -1]
        tok = int(np.argmax(lg))
        out.append(tok)
        history.append(tok)
        if len(history) > cfg.ctx_len:
            history = history[-(cfg.ctx_len // 2) :]
    return out


def test_greedy_with_cache_equals_greedy_without_cache(model):
    params, cfg = model
    gen = Generator(params, cfg)
    prompt = [5, 17, 42, 8, 8, 1]
    n = cfg.ctx_len - len(prompt)  # fills the context exactly
    assert gen.generate(prompt, n, GREEDY) == greedy_without_cache(params, cfg, prompt, n)


def test_cached_step_logits_match_full_logits(model):
    params, cfg = model
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(2, 20))
    full = transformer.logits(params, ids, cfg)
    cache = transformer.new_kv_cache(cfg, 2, cfg.ctx_len, np, np.float32)
    parts = [transformer.forward_step(params, ids[:, :7], cache, cfg)]
    for t in range(7, 20):
        parts.append(transformer.forward_step(params, ids[:, t : t + 1], cache, cfg))
    np.testing.assert_allclose(np.concatenate(parts, axis=1), full, rtol=1e-4, atol=1e-4)


def test_generation_past_the_context_slides_and_matches_the_reference(model):
    params, cfg = model
    gen = Generator(params, cfg)
    prompt = list(range(1, cfg.ctx_len + 5))  # longer than the context: only its tail is seen
    n = 3 * cfg.ctx_len
    out = gen.generate(prompt, n, GREEDY)
    assert len(out) == n
    assert out == greedy_without_cache(params, cfg, prompt, n)


def test_stops_after_a_stop_token_and_is_seeded(model):
    params, cfg = model
    gen = Generator(params, cfg)
    first = gen.generate([3, 4], 10, GREEDY)[0]
    assert gen.generate([3, 4], 10, GREEDY, stop_ids={first}) == [first]
    s = Sampling(temperature=1.0, top_k=0, top_p=1.0, seed=11)
    assert gen.generate([3, 4], 15, s) == gen.generate([3, 4], 15, s)
    assert gen.generate([3, 4], 0, s) == []


def test_sample_command(tmp_path):
    tok = make_tokenizer()
    save_random_model(tmp_path / "m.bin", tok)
    cmd = [
        sys.executable,
        "-m",
        "nanoeuler",
        "sample",
        "--ckpt",
        str(tmp_path / "m.bin"),
        "--prompt",
        "It was",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0.9",
        "--seed",
        "5",
        "--device",
        "cpu",
    ]
    a = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    b = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert a.returncode == 0, a.stderr
    assert a.stdout.startswith("It was") and a.stdout == b.stdout
    bad = subprocess.run(cmd[:5] + [str(tmp_path / "missing.bin"), "--prompt", "x"], capture_output=True, text=True)
    assert bad.returncode == 1 and "missing.bin" in bad.stderr
