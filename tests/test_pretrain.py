"""Pretraining: outputs, metrics, kill -9 and resume with identical losses, corrupt and foreign checkpoints, NaN."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from nanoeuler import checkpoint
from train_fixtures import make_tokenizer, write_config, write_shards

PRE = dict(
    steps=40,
    batch_size=4,
    lr=3e-3,
    warmup_steps=5,
    log_every=1,
    eval_every=10,
    checkpoint_every=10,
    keep_checkpoints=3,
    val_tokens=256,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("data")
    tok = make_tokenizer()
    tok.save(d / "tok.json")
    manifest = write_shards(d / "shards", tok)
    return d, tok, manifest


def cmd(data, work: Path, conf: Path):
    d, _, manifest = data
    return [
        sys.executable,
        "-m",
        "nanoeuler",
        "pretrain",
        "--config",
        str(conf),
        "--shards",
        str(manifest),
        "--tokenizer",
        str(d / "tok.json"),
        "--out",
        str(work / "base.bin"),
        "--run-dir",
        str(work / "run"),
    ]


def pretrain(data, work, conf, **kw):
    return subprocess.run(cmd(data, work, conf), capture_output=True, text=True, timeout=300, **kw)


def losses(work: Path) -> dict[int, float]:
    recs = [json.loads(line) for line in open(work / "run" / "metrics.jsonl")]
    out = {}
    for r in recs:
        if "loss" in r:
            assert r["step"] not in out, f"step {r['step']} logged twice"
            out[r["step"]] = r["loss"]
    return out


def tensors(path):
    t, _ = checkpoint.load(path)
    return t


def test_pretrain_writes_model_metrics_plot_and_rotates_checkpoints(data, tmp_path):
    conf = write_config(tmp_path / "c.yaml", pretrain=PRE)
    r = pretrain(data, tmp_path, conf)
    assert r.returncode == 0, r.stderr
    assert "tok/s" in r.stderr and "loss" in r.stderr
    params, cfg, meta = checkpoint.load_model(tmp_path / "base.bin")
    assert meta["tokenizer"] == data[1].to_json() and meta["step"] == 40
    assert cfg.ctx_len == 64 and cfg.vocab_size == data[1].vocab_size
    assert sorted(p.name for p in (tmp_path / "run").glob("ckpt_*.bin")) == [
        "ckpt_00000020.bin",
        "ckpt_00000030.bin",
        "ckpt_00000040.bin",
    ]
    recs = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    val = [r for r in recs if "val_bpb" in r]
    assert [r["step"] for r in val] == [10, 20, 30, 40]
    assert all(np.isfinite(r["val_bpb"]) and r["val_bpb"] > 0 for r in val)
    assert sorted(losses(tmp_path)) == list(range(1, 41))
    png = (tmp_path / "run" / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    ck, cmeta = checkpoint.load(tmp_path / "run" / "ckpt_00000040.bin")
    assert "optim.m.lm_head.weight" in ck and cmeta["optim_t"] == 40
    assert "bit_generator" in cmeta["loader"]
    # the final model equals the last checkpoint's parameters
    for name, p in params.items():
        np.testing.assert_array_equal(p, ck[name])


@pytest.mark.parametrize(
    "recipe", [{}, dict(optimizer="muon", muon_lr=1e-2, schedule="wsd", zero_init_out=True)], ids=["adamw", "muon"]
)
def test_kill_9_and_resume_gives_identical_losses(data, tmp_path, recipe):
    spec = dict(PRE, steps=150, checkpoint_every=25, eval_every=50, **recipe)
    conf = write_config(tmp_path / "c.yaml", pretrain=spec)
    whole, cut = tmp_path / "whole", tmp_path / "cut"
    r = pretrain(data, whole, conf)
    assert r.returncode == 0, r.stderr

    proc = subprocess.Popen(cmd(data, cut, conf), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    first = cut / "run" / "ckpt_00000025.bin"
    deadline = time.time() + 120
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
    assert not (cut / "base.bin").exists()
    killed_at = max(losses(cut))
    assert killed_at < 150

    r = pretrain(data, cut, conf)
    assert r.returncode == 0, r.stderr
    assert "resuming from step" in r.stderr
    a, b = losses(whole), losses(cut)
    assert sorted(a) == sorted(b) == list(range(1, 151))
    for step in a:
        assert a[step] == b[step], f"step {step}: {a[step]} != {b[step]}"
    ta, tb = tensors(whole / "base.bin"), tensors(cut / "base.bin")
    for name in ta:
        np.testing.assert_array_equal(ta[name], tb[name])


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(data, tmp_path):
    conf = write_config(tmp_path / "c.yaml", pretrain=PRE)
    assert pretrain(data, tmp_path, conf).returncode == 0
    reference = losses(tmp_path)
    newest = tmp_path / "run" / "ckpt_00000040.bin"
    blob = bytearray(newest.read_bytes())
    blob[-100] ^= 0xFF
    newest.write_bytes(bytes(blob))
    (tmp_path / "base.bin").unlink()
    r = pretrain(data, tmp_path, conf)
    assert r.returncode == 0, r.stderr
    assert "warning" in r.stderr and "ckpt_00000040.bin" in r.stderr
    assert "resuming from step 30" in r.stderr
    assert (tmp_path / "run" / "ckpt_00000040.bin.corrupt").exists()
    assert losses(tmp_path) == reference


def test_checkpoint_of_another_model_or_tokenizer_is_set_aside(data, tmp_path):
    conf = write_config(tmp_path / "c.yaml", pretrain=dict(PRE, steps=10))
    assert pretrain(data, tmp_path, conf).returncode == 0
    other = write_config(tmp_path / "o.yaml", pretrain=dict(PRE, steps=10), model={"n_layers": 3})
    r = pretrain(data, tmp_path, other)
    assert r.returncode == 0, r.stderr
    assert "another model or tokenizer" in r.stderr and "n_layers 2 -> 3" in r.stderr
    assert (tmp_path / "run" / "previous" / "ckpt_00000010.bin").exists()
    assert "resuming" not in r.stderr

    from nanoeuler.tokenizer.bpe import train_bpe
    from train_fixtures import TEXT

    rot = str.maketrans("abcdefghijklmnopqrstuvwxyz", "bcdefghijklmnopqrstuvwxyza")
    other_tok = train_bpe(TEXT.translate(rot), data[1].vocab_size)  # same vocabulary size, other merges
    assert other_tok.vocab_size == data[1].vocab_size and other_tok.sha256 != data[1].sha256
    other_tok.save(tmp_path / "tok2.json")
    shards2 = write_shards(tmp_path / "shards2", other_tok)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoeuler",
            "pretrain",
            "--config",
            str(conf),
            "--shards",
            str(shards2),
            "--tokenizer",
            str(tmp_path / "tok2.json"),
            "--out",
            str(tmp_path / "x.bin"),
            "--run-dir",
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert "another model or tokenizer" in r.stderr and "tokenizer sha256" in r.stderr


def test_changed_training_settings_start_a_fresh_run(data, tmp_path):
    conf = write_config(tmp_path / "c.yaml", pretrain=dict(PRE, steps=10))
    assert pretrain(data, tmp_path, conf).returncode == 0
    longer = write_config(tmp_path / "l.yaml", pretrain=dict(PRE, steps=10, lr=1e-3, log_every=5))
    r = pretrain(data, tmp_path, longer)
    assert r.returncode == 0, r.stderr
    assert "other settings" in r.stderr and "settings.lr" in r.stderr
    assert (tmp_path / "run" / "previous" / "ckpt_00000010.bin").exists()
    assert sorted(losses(tmp_path)) == [5, 10]
    # only logging keys changed: the run resumes
    quiet = write_config(tmp_path / "q.yaml", pretrain=dict(PRE, steps=10, lr=1e-3, log_every=2, eval_every=3))
    (tmp_path / "base.bin").unlink()
    r = pretrain(data, tmp_path, quiet)
    assert r.returncode == 0 and "resuming from step 10" in r.stderr


def test_nan_loss_stops_with_the_step_and_keeps_the_last_good_checkpoint(data, tmp_path):
    conf = write_config(
        tmp_path / "c.yaml", pretrain=dict(PRE, lr=1e20, warmup_steps=0, grad_clip=0.0, checkpoint_every=1)
    )
    r = pretrain(data, tmp_path, conf)
    assert r.returncode == 1
    msg = r.stderr.strip().splitlines()[-1]
    assert "at step" in msg and ("nan" in msg or "inf" in msg) and "last good checkpoint" in msg
    bad_step = int(msg.split("at step ")[1].split(";")[0])
    ckpts = sorted((tmp_path / "run").glob("ckpt_*.bin"))
    assert ckpts and int(ckpts[-1].stem.split("_")[1]) == bad_step - 1
    assert not (tmp_path / "base.bin").exists()
    t, _ = checkpoint.load(ckpts[-1])
    assert all(np.isfinite(v).all() for v in t.values())


def test_bf16_precision_on_the_cpu_is_one_clear_error(data, tmp_path):
    conf = write_config(tmp_path / "c.yaml", pretrain=dict(PRE, steps=5, precision="bf16"))  # device: cpu
    r = pretrain(data, tmp_path, conf)
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [
        "nanoeuler pretrain: error: pretrain.precision bf16 runs on the GPU engine; "
        "use --device gpu, or precision fp32 on the CPU"
    ]
    assert not (tmp_path / "base.bin").exists()


# holds a run directory as a writer would, until killed
HOLD = (
    "import sys, time\nfrom nanoeuler.train.rundir import writer_lock\n"
    "with writer_lock(sys.argv[1], 'pretrain'):\n    print('held', flush=True)\n    time.sleep(300)\n"
)


def _holder(run_dir: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline() == "held\n"
    return proc


def test_a_second_writer_of_a_run_directory_is_refused_naming_the_first(data, tmp_path):
    """Started by hand beside Snakemake's run, a second pretrain interleaved metrics.jsonl and overwrote checkpoints."""
    conf = write_config(tmp_path / "c.yaml", pretrain=PRE)
    run = tmp_path / "run"
    holder = _holder(run)
    try:
        r = pretrain(data, tmp_path, conf)
    finally:
        holder.kill()
        holder.wait()
    assert r.returncode == 1
    assert r.stderr.strip().splitlines() == [r.stderr.strip()], r.stderr
    assert r.stderr.startswith(
        f"nanoeuler pretrain: error: run directory {run} is in use by another writer "
        f"(pid {holder.pid} on {socket.gethostname()}, started 20"
    ), r.stderr
    assert f": nanoeuler {run}); wait for it to finish or stop it" in r.stderr
    assert [p.name for p in run.iterdir()] == [".lock"] and not (tmp_path / "base.bin").exists()


def test_the_run_directory_lock_dies_with_its_holder(tmp_path):
    from nanoeuler.errors import UserError
    from nanoeuler.train.rundir import writer_lock

    holder = _holder(tmp_path / "run")
    with pytest.raises(UserError, match=f"pid {holder.pid} on "):
        with writer_lock(tmp_path / "run", "sft"):
            pass
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    with writer_lock(tmp_path / "run", "sft"):  # taken at once: no stale lock to clean up
        with pytest.raises(UserError, match=f"pid {os.getpid()} on "):
            with writer_lock(tmp_path / "run", "dpo"):
                pass
    with writer_lock(tmp_path / "run", "dpo"):  # and given back when the run ends
        pass
