"""SFT: the Alpaca template, response-only targets for every MTP head, fitting to the context, the stage."""

import json
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.data.template import render_prompt
from nanoeuler.errors import UserError
from nanoeuler.train.sft import EpochBatches, read_records
from nanoeuler.train.sft import encode_example, fit_example, sft_batch
from train_fixtures import make_tokenizer, save_random_model, write_alpaca, write_config


@pytest.fixture(scope="module")
def tok():
    return make_tokenizer()


def test_template_with_and_without_input():
    assert render_prompt("Add.", "1 and 2") == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n### Instruction:\nAdd.\n\n"
        "### Input:\n1 and 2\n\n### Response:\n"
    )
    no_input = (
        "Below is an instruction that describes a task. Write a response that appropriately completes "
        "the request.\n\n### Instruction:\nAdd.\n\n### Response:\n"
    )
    assert render_prompt("Add.") == no_input
    assert render_prompt("Add.", "  ") == no_input


def test_example_is_prompt_response_and_end_marker(tok):
    rec = {"instruction": "Say it.", "input": "", "output": "It was </s> here"}
    ids, n_prompt = encode_example(tok, rec)
    assert tok.decode(ids[:n_prompt]) == render_prompt("Say it.")
    assert ids[-1] == tok.end_id
    assert ids[:-1].count(tok.end_id) == 0  # a literal "</s>" in the data stays text
    assert tok.decode(ids[n_prompt:-1]) == "It was </s> here"


def test_targets_mask_prompt_and_padding_for_each_head():
    p, r, E, PAD = [10, 11, 12], [20, 21], 99, 0
    long = (p + r + [E], 3)
    short = ([10, 11, 20, E], 2)
    x, y = sft_batch([long, short], K=2, pad_id=PAD)
    assert x.tolist() == [[10, 11, 12, 20, 21], [10, 11, 20, PAD, PAD]]
    assert y[0, :, 0].tolist() == [-1, -1, 20, 21, E]
    assert y[0, :, 1].tolist() == [-1, 20, 21, E, -1]
    assert y[1, :, 0].tolist() == [-1, 20, E, -1, -1]
    assert y[1, :, 1].tolist() == [20, E, -1, -1, -1]


def test_targets_rule_holds_on_random_examples():
    rng = np.random.default_rng(0)
    examples = []
    for _ in range(20):
        L = int(rng.integers(3, 30))
        n_prompt = int(rng.integers(1, L))
        examples.append((rng.integers(1, 50, size=L).tolist(), n_prompt))
    K = 3
    x, y = sft_batch(examples, K=K, pad_id=0)
    for b, (ids, n_prompt) in enumerate(examples):
        for t in range(x.shape[1]):
            for k in range(K):
                j = t + 1 + k
                want = ids[j] if n_prompt <= j < len(ids) else -1
                assert y[b, t, k] == want, (b, t, k)


def test_fit_example_truncates_or_drops():
    ids = list(range(10))
    assert fit_example(ids, 3, ctx_len=9, too_long="truncate") == (ids, 3)
    assert fit_example(ids, 3, ctx_len=6, too_long="truncate") == (ids[:7], 3)  # the response's tail goes
    assert fit_example(ids, 3, ctx_len=6, too_long="drop") is None
    # a prompt that leaves less than ctx_len // 4 response tokens loses its start instead
    assert fit_example(ids, 8, ctx_len=6, too_long="truncate") == ([2, 3, 4, 5, 6, 7, 8], 6)
    long = list(range(100))
    fitted, n_prompt = fit_example(long, 90, ctx_len=16, too_long="truncate")
    assert len(fitted) == 17 and fitted[n_prompt - 1] == 89 and fitted[n_prompt] == 90 and 17 - n_prompt == 4


def test_epoch_batches_visit_every_example_once_per_epoch():
    examples = [([1, 2, i + 3], 1) for i in range(10)]
    b = EpochBatches(examples, batch_size=4, grad_accum=1, seed=0, K=1, pad_id=0)
    assert b.per_epoch == 3 and b.steps(2) == 6
    for epoch in range(2):
        seen = [int(v) for s in range(3 * epoch, 3 * epoch + 3) for v in b.batch(s, 0)[1][:, 1, 0]]
        assert sorted(seen) == list(range(3, 13))
    first = [b.batch(s, 0)[1].tolist() for s in range(3)]
    assert first != [b.batch(s, 0)[1].tolist() for s in range(3, 6)]  # a new order each epoch
    fresh = EpochBatches(examples, batch_size=4, grad_accum=1, seed=0, K=1, pad_id=0)
    assert fresh.batch(1, 0)[1].tolist() == first[1]  # the order is a function of the step
    acc = EpochBatches(examples, batch_size=2, grad_accum=2, seed=0, K=1, pad_id=0)
    assert acc.steps(1) == 3 and acc.batch(0, 1)[1].tolist() == b.batch(0, 0)[1][2:].tolist()


def test_read_records_names_the_bad_line(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text('{"instruction": "a", "input": "", "output": "b"}\n{"instruction": 3, "output": "x"}\n')
    with pytest.raises(UserError, match="a.jsonl:2: key 'instruction'"):
        read_records(path)
    path.write_text("{not json\n")
    with pytest.raises(UserError, match="a.jsonl:1: not valid JSON"):
        read_records(path)


def sft(tmp_path, conf, out="chat.bin"):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "nanoeuler",
            "sft",
            "--config",
            str(conf),
            "--base",
            str(tmp_path / "base.bin"),
            "--data",
            str(tmp_path / "alpaca.jsonl"),
            "--out",
            str(tmp_path / out),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )


SFT = dict(
    epochs=2, batch_size=4, lr=1e-3, warmup_steps=2, log_every=1, eval_every=4, checkpoint_every=4, val_examples=4
)


def test_sft_stage_trains_responses_and_counts_long_examples(tmp_path, tok):
    save_random_model(tmp_path / "base.bin", tok)
    write_alpaca(tmp_path / "alpaca.jsonl", n=48)
    conf = write_config(tmp_path / "c.yaml", sft=SFT)
    r = sft(tmp_path, conf)
    assert r.returncode == 0, r.stderr
    assert "truncated" in r.stderr and "dropped" in r.stderr
    params, cfg, meta = checkpoint.load_model(tmp_path / "chat.bin")
    assert meta["tokenizer"] == tok.to_json()  # one file runs chat
    counts = meta["sft_data"]
    assert counts["train_examples"] + counts["dropped"] == 44 and counts["dropped"] == 0  # 4 held out
    assert counts["truncated"] > 0 and counts["prompt_cut"] > 0
    recs = [json.loads(line) for line in open(tmp_path / "sft" / "metrics.jsonl")]
    losses = [r["loss"] for r in recs if "loss" in r]
    assert len(losses) == meta["step"] and losses[-1] < losses[0]
    assert any("val_loss" in r for r in recs)

    dropped = write_config(tmp_path / "d.yaml", sft={**SFT, "too_long": "drop"})
    r = sft(tmp_path, dropped, out="chat2.bin")
    assert r.returncode == 0, r.stderr
    _, _, meta2 = checkpoint.load_model(tmp_path / "chat2.bin")
    assert meta2["sft_data"]["truncated"] == 0
    assert meta2["sft_data"]["dropped"] == counts["truncated"]
    assert meta2["sft_data"]["train_examples"] == 44 - counts["truncated"]


def test_sft_rerun_resumes_and_new_settings_start_fresh(tmp_path, tok):
    save_random_model(tmp_path / "base.bin", tok)
    write_alpaca(tmp_path / "alpaca.jsonl", n=24)
    conf = write_config(tmp_path / "c.yaml", sft=SFT)
    assert sft(tmp_path, conf).returncode == 0
    first = (tmp_path / "chat.bin").read_bytes()
    (tmp_path / "chat.bin").unlink()
    r = sft(tmp_path, conf)
    assert r.returncode == 0 and "resuming from step" in r.stderr
    assert (tmp_path / "chat.bin").read_bytes() == first

    changed = write_config(tmp_path / "c2.yaml", sft={**SFT, "lr": 5e-4})
    r = sft(tmp_path, changed)
    assert r.returncode == 0, r.stderr
    assert "other settings" in r.stderr and "lr" in r.stderr
    assert (tmp_path / "sft" / "previous").is_dir()
    assert (tmp_path / "chat.bin").read_bytes() != first


def test_sft_after_a_new_base_model_of_another_shape_starts_fresh(tmp_path, tok):
    save_random_model(tmp_path / "base.bin", tok)
    write_alpaca(tmp_path / "alpaca.jsonl", n=24)
    conf = write_config(tmp_path / "c.yaml", sft=SFT)
    assert sft(tmp_path, conf).returncode == 0
    from train_fixtures import TINY_MODEL

    save_random_model(tmp_path / "base.bin", tok, model={**TINY_MODEL, "n_layers": 1})
    r = sft(tmp_path, conf)
    assert r.returncode == 0, r.stderr
    assert "another model" in r.stderr and (tmp_path / "sft" / "previous").is_dir()
    _, cfg, _ = checkpoint.load_model(tmp_path / "chat.bin")
    assert cfg.n_layers == 1
