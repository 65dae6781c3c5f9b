"""Evaluation: metrics.json (val loss, bits per byte), samples.md with the plot linked, loss.png, clean failures."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler.model import transformer
from nanoeuler.train.metrics import evaluate_windows
from nanoeuler.train.plots import plot_losses
from train_fixtures import TEXT, make_tokenizer, save_random_model, write_config, write_shards

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("eval")
    tok = make_tokenizer()
    manifest = write_shards(d / "shards", tok, n_train=2000, n_val=1500)
    save_random_model(d / "base.bin", tok, seed=1)
    save_random_model(d / "chat.bin", tok, seed=2)
    (d / "pretrain").mkdir()
    with open(d / "pretrain" / "metrics.jsonl", "w") as f:
        for s in range(1, 21):
            f.write(json.dumps({"step": s, "loss": 6 - s / 10}) + "\n")
        f.write(json.dumps({"step": 20, "val_loss": 4.5}) + "\n")
    conf = write_config(
        d / "c.yaml",
        eval={
            "base_prompts": ["It was", "```fence```"],
            "chat_prompts": ["Name a color."],
            "max_new_tokens": 6,
            "val_tokens": 500,
            "batch_size": 3,
        },
    )
    return d, tok, manifest, conf


def evaluate(d, conf, manifest, chat="chat.bin"):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoeuler",
            "evaluate",
            "--config",
            str(conf),
            "--base",
            str(d / "base.bin"),
            "--chat",
            str(d / chat),
            "--shards",
            str(manifest),
            "--samples",
            str(d / "out" / "samples.md"),
            "--metrics",
            str(d / "out" / "metrics.json"),
            "--plot",
            str(d / "out" / "loss.png"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_evaluate_writes_samples_metrics_and_plot(setup):
    d, tok, manifest, conf = setup
    r = evaluate(d, conf, manifest)
    assert r.returncode == 0, r.stderr
    assert "no SFT metrics" in r.stderr  # the SFT run dir is missing: a warning, not a failure
    m = json.loads((d / "out" / "metrics.json").read_text())
    for name in ("base", "chat"):
        v = m[name]
        assert v["val_tokens"] == 448  # 7 windows of 64 input tokens (500 asked for)
        assert math.isfinite(v["val_loss"]) and v["val_loss"] > 0
        assert v["val_bpb"] == pytest.approx(v["val_ce"] / math.log(2) * 1500 / 4500)
    assert m["base"]["val_loss"] != m["chat"]["val_loss"]
    assert "val_bpb" in m["definitions"]
    md = (d / "out" / "samples.md").read_text()
    assert "![loss curves](loss.png)" in md
    assert "**Prompt:** `It was`" in md and "**Instruction:** Name a color." in md
    assert "````text\n```fence```" in md  # a longer fence keeps generated backticks inside the block
    assert (d / "out" / "loss.png").read_bytes()[:8] == PNG


def test_val_loss_matches_a_direct_computation(setup):
    d, tok, manifest, _ = setup
    from nanoeuler import checkpoint
    from nanoeuler.train.loader import ShardSplit, fixed_windows

    params, cfg, _ = checkpoint.load_model(d / "base.bin")
    x, y = fixed_windows(ShardSplit(manifest, "val"), cfg.ctx_len, cfg.mtp_heads, 500)
    loss, ce = evaluate_windows(params, cfg, x, y, batch_size=3, xp=np)
    lg = transformer.logits(params, x, cfg).astype(np.float64)
    lp = lg - lg.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    direct = -np.take_along_axis(lp, y[:, :, :1], axis=-1).mean()
    assert ce == pytest.approx(direct, rel=1e-5)
    full, _ = transformer.forward_loss(params, x, y, cfg)
    assert loss == pytest.approx(full, rel=1e-5)


def test_mismatched_models_fail_without_outputs(setup, tmp_path):
    d, _, manifest, conf = setup
    from nanoeuler.tokenizer.bpe import train_bpe

    other = train_bpe(TEXT, 400)
    save_random_model(d / "other.bin", other)
    out = d / "out"
    for f in out.glob("*"):
        f.unlink()
    r = evaluate(d, conf, manifest, chat="other.bin")
    assert r.returncode == 1 and "different tokenizers" in r.stderr
    assert not any(out.glob("*"))


def test_plot_losses_panels_and_atomic_output(tmp_path):
    recs = [{"step": s, "loss": 1.0 / s} for s in range(1, 30)] + [{"step": 10, "val_loss": 0.2}]
    path = plot_losses([("pretraining", recs), ("SFT", recs[:5]), ("empty", [])], tmp_path / "p.png")
    assert path.read_bytes()[:8] == PNG
    assert [p.name for p in tmp_path.iterdir()] == ["p.png"]
    plot_losses([], tmp_path / "none.png")  # nothing to plot still gives an image
    assert (tmp_path / "none.png").exists()


def test_evaluation_forwards_are_capped_in_positions(setup, monkeypatch):
    """A training batch of windows is evaluated in chunks of at most chunk_tokens positions (GPU memory at
    the full config), with the same result as one forward over everything."""
    d, tok, manifest, _ = setup
    from nanoeuler import checkpoint
    from nanoeuler.train.loader import ShardSplit, fixed_windows

    params, cfg, _ = checkpoint.load_model(d / "base.bin")
    x, y = fixed_windows(ShardSplit(manifest, "val"), cfg.ctx_len, cfg.mtp_heads, 10 * cfg.ctx_len)
    assert x.shape[0] >= 3
    seen = []
    real = transformer.forward_loss
    monkeypatch.setattr(transformer, "forward_loss", lambda p, a, b, c: seen.append(a.size) or real(p, a, b, c))
    loss, ce = evaluate_windows(params, cfg, x, y, batch_size=32, xp=np, chunk_tokens=2 * x.shape[1])
    assert max(seen) <= 2 * x.shape[1] and sum(seen) == x.size
    whole, _ = real(params, x, y, cfg)
    assert loss == pytest.approx(whole, rel=1e-5)
