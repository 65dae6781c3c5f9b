"""HellaSwag: the data stage on the real-format sample, the scorer against a hand-computed example, and the
scorer against `transformers` running llm.c's scoring on the HF export of the same model (same picks)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.cli import main
from nanoeuler.config import REPO_ROOT
from nanoeuler.data.hellaswag import read_items
from nanoeuler.errors import UserError
from nanoeuler.eval.hellaswag import item_rows, score_items, score_rows
from nanoeuler.model.config import ModelConfig

SAMPLE = REPO_ROOT / "data" / "sample" / "hellaswag_val.jsonl"
CHARS = " abcd"


def _encode(text):
    return [CHARS.index(c) for c in text]


def _constant_model(log_probs, dim=8, ctx_len=16):
    """A model whose next-token log-probabilities are `log_probs` at every position, whatever the input.

    Every token embeds to the same vector of ones; zero attention and MLP weights leave it alone, the final
    RMSNorm keeps ones, so the logits are the row sums of lm_head: lm_head[v] = log_probs[v] / dim.
    """
    cfg = ModelConfig(
        vocab_size=len(log_probs), dim=dim, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=ctx_len, mtp_heads=1
    )
    params = {name: np.zeros(shape, np.float32) for name, shape in cfg.param_shapes().items()}
    for name in params:
        if name.endswith("norm.weight"):
            params[name][:] = 1
    params["embed_tokens.weight"][:] = 1
    params["lm_head.weight"][:] = np.asarray(log_probs, np.float32)[:, None] / dim
    return params, cfg


def test_scores_match_a_hand_computed_example():
    # p(' ') = 1/16, p(a) = 1/16, p(b) = 2/16, p(c) = 4/16, p(d) = 8/16 at every position
    params, cfg = _constant_model([math.log(p) for p in (1 / 16, 1 / 16, 2 / 16, 4 / 16, 8 / 16)])
    item = {"ctx": "ab", "endings": ["a", "ddd", "c", "dddddd"], "label": 3}
    # log2-probabilities of the ending tokens (' ' then the letters):
    #   " a": -4 - 4 = -8 (mean -4); " ddd": -4 - 3 = -7 (mean -1.75);
    #   " c": -4 - 2 = -6 (mean -3); " dddddd": -4 - 6 = -10 (mean -10/7)
    # so acc picks " c" (largest sum) and acc_norm picks " dddddd" (largest mean).
    total, mean = score_rows(params, cfg, item_rows(_encode, item, cfg.ctx_len), np)
    ln2 = math.log(2)
    np.testing.assert_allclose(total, np.array([-8, -7, -6, -10]) * ln2, rtol=1e-5)
    np.testing.assert_allclose(mean, np.array([-4, -1.75, -3, -10 / 7]) * ln2, rtol=1e-5)
    result = score_items(params, cfg, _encode, [item, {**item, "label": 2}], batch_size=1, xp=np)
    assert result["picks"] == [2, 2] and result["picks_norm"] == [3, 3]
    assert (result["acc"], result["acc_norm"], result["correct"], result["correct_norm"]) == (0.5, 0.5, 1, 1)


def test_long_rows_keep_the_ending_and_the_end_of_the_context():
    item = {"ctx": "abcdabcd", "endings": ["a", "bb", "c", "d"], "label": 0}
    rows = item_rows(_encode, item, ctx_len=5)
    assert rows[1] == ([2, 3, 4, 0, 2, 2], 3)  # last 6 tokens: ..."bcd" + " bb"; scored from index 3
    assert all(len(tokens) <= 6 for tokens, _ in rows)
    rows = item_rows(_encode, {**item, "endings": ["aaaaaaaa"] * 4}, ctx_len=5)
    assert rows[0] == ([1] * 6, 1)  # an ending longer than the context: its last tokens, from position 1


def test_batches_do_not_change_the_picks():
    rng = np.random.default_rng(0)
    params, cfg = _constant_model(rng.standard_normal(5))
    params = {k: (v + 0.3 * rng.standard_normal(v.shape)).astype(np.float32) for k, v in params.items()}
    words = ["a", "bc", "dd a", "cab", "b b b", "d"]
    items = [
        {
            "ctx": "".join(rng.choice(list("abcd"), 5)),
            "label": int(rng.integers(4)),
            "endings": [str(w) for w in rng.choice(words, 4, replace=False)],
        }
        for _ in range(7)
    ]
    one = score_items(params, cfg, _encode, items, batch_size=1, xp=np)
    many = score_items(params, cfg, _encode, items, batch_size=3, xp=np)
    assert one["picks"] == many["picks"] and one["picks_norm"] == many["picks_norm"]
    # the largest forward (for the memory report): (items, their padded length), largest by their product
    forwards = [
        (
            len(items[lo : lo + 3]),
            max(len(t) for it in items[lo : lo + 3] for t, _ in item_rows(_encode, it, cfg.ctx_len)) - 1,
        )
        for lo in range(0, 7, 3)
    ]
    assert many["largest_forward"] == max(forwards, key=lambda f: f[0] * f[1])


def test_transformers_on_the_hf_export_makes_the_same_picks(tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    F = torch.nn.functional
    cfg = ModelConfig(vocab_size=31, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ctx_len=24, mtp_heads=2)
    rng = np.random.default_rng(3)
    params = {}
    for name, shape in cfg.param_shapes().items():
        scale = 0.2 if name.endswith("norm.weight") else 1 / np.sqrt(shape[1])
        params[name] = (1.0 if name.endswith("norm.weight") else 0.0) + scale * rng.standard_normal(shape)
        params[name] = params[name].astype(np.float32)
    checkpoint.save_model(tmp_path / "m.bin", params, cfg, step=1, tokenizer_json=None)
    assert main(["export-hf", "--ckpt", str(tmp_path / "m.bin"), "--out", str(tmp_path / "hf")]) == 0
    model = transformers.LlamaForCausalLM.from_pretrained(
        tmp_path / "hf", dtype=torch.float32, local_files_only=True
    ).eval()
    letters = "abcdefghijklmnopqrstuvwxyz"

    def encode(text):  # one id per character, 0 for a space
        return [0 if c == " " else 1 + letters.index(c) for c in text]

    def word(n):
        return "".join(rng.choice(list(letters), n))

    # rows of at most 11 + 10 tokens: within the context, so neither side truncates
    items = [
        {
            "ctx": " ".join(word(int(rng.integers(2, 6))) for _ in range(int(rng.integers(1, 3)))),
            "endings": [word(int(rng.integers(1, 9))) for _ in range(4)],
            "label": int(rng.integers(4)),
        }
        for _ in range(12)
    ]
    ours = score_items(params, cfg, encode, items, batch_size=5, xp=np)

    picks, picks_norm, sums = [], [], []
    for item in items:  # llm.c's dev/data/hellaswag.py, one item (4 padded rows) at a time
        ctx = encode(item["ctx"])
        rows = [ctx + encode(" " + e) for e in item["endings"]]
        width = max(map(len, rows))
        tokens = torch.zeros((4, width), dtype=torch.long)
        mask = torch.zeros((4, width))
        for i, row in enumerate(rows):
            tokens[i, : len(row)] = torch.tensor(row)
            mask[i, len(ctx) : len(row)] = 1
        with torch.no_grad():
            logits = model(tokens).logits
        losses = F.cross_entropy(
            logits[:, :-1].reshape(-1, cfg.vocab_size), tokens[:, 1:].reshape(-1), reduction="none"
        ).view(4, -1)
        sum_loss = (losses * mask[:, 1:]).sum(dim=1)
        sums.append(-sum_loss.numpy())
        picks.append(int(sum_loss.argmin()))
        picks_norm.append(int((sum_loss / mask[:, 1:].sum(dim=1)).argmin()))
    assert ours["picks"] == picks and ours["picks_norm"] == picks_norm
    rows = [row for item in items for row in item_rows(encode, item, cfg.ctx_len)]
    np.testing.assert_allclose(score_rows(params, cfg, rows, np)[0], np.concatenate(sums), rtol=1e-4)
    assert len(set(picks)) > 1  # the model does not always pick the same position


def test_sample_file_has_the_real_fields():
    lines = [json.loads(line) for line in SAMPLE.read_text().splitlines()]
    assert len(lines) >= 10
    for item in lines:
        assert set(item) == {
            "ind",
            "activity_label",
            "ctx_a",
            "ctx_b",
            "ctx",
            "split",
            "split_type",
            "label",
            "endings",
            "source_id",
        }
        assert item["ctx"] == (f"{item['ctx_a']} {item['ctx_b']}" if item["ctx_b"] else item["ctx_a"])
    assert len({item["label"] for item in lines}) > 1
    assert [i["label"] for i in read_items(SAMPLE, 3)] == [i["label"] for i in lines[:3]]


def test_data_stage_copies_and_checks(tmp_path):
    out = tmp_path / "hs.jsonl"
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"hellaswag: {{url: {SAMPLE}, delay_s: 0}}\n")
    assert main(["hellaswag", "--config", str(cfg), "--raw-dir", str(tmp_path / "raw"), "--out", str(out)]) == 0
    assert len(read_items(out)) == len(SAMPLE.read_text().splitlines())

    bad = tmp_path / "bad.jsonl"
    good = SAMPLE.read_text().splitlines()[0]
    item = json.loads(good)
    bad.write_text(
        "\n".join(
            [good, json.dumps({**item, "label": 4}), "{not json", json.dumps({**item, "endings": item["endings"][:3]})]
        )
        + "\n"
    )
    with pytest.raises(
        UserError,
        match=r"3 HellaSwag items are malformed: line 2 'label' must be an integer 0..3, "
        r"got 4; line 3 is not valid JSON .*; line 4 'endings' must be a list of 4",
    ):
        read_items(bad)


def test_scoring_command_writes_the_result(tmp_path, capsys):
    from nanoeuler.tokenizer.bpe import train_bpe

    tok = train_bpe("a man walks the dog and a woman reads the book. " * 10, 260)
    cfg = ModelConfig(vocab_size=tok.vocab_size, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ctx_len=32, mtp_heads=1)
    from nanoeuler.model import transformer

    checkpoint.save_model(
        tmp_path / "m.bin", transformer.init_params(cfg, 0), cfg, step=5, tokenizer_json=tok.to_json()
    )
    conf = tmp_path / "c.yaml"
    conf.write_text("eval: {hellaswag_items: 5, hellaswag_batch_size: 2}\n")
    out = tmp_path / "hs" / "base.json"
    assert (
        main(
            [
                "hellaswag-eval",
                "--config",
                str(conf),
                "--device",
                "cpu",
                "--ckpt",
                str(tmp_path / "m.bin"),
                "--data",
                str(SAMPLE),
                "--name",
                "base",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert result["model"] == "base" and result["items"] == 5 and len(result["picks"]) == 5
    assert result["acc"] == result["correct"] / 5 and result["steps"] == 5
    assert "acc_norm 0." in capsys.readouterr().err


@pytest.mark.gpu
def test_gpu_scores_equal_cpu_scores():
    import cupy

    rng = np.random.default_rng(5)
    cfg = ModelConfig(vocab_size=5, dim=16, n_layers=2, n_heads=2, n_kv_heads=1, ctx_len=12, mtp_heads=2)
    params = {
        name: (rng.standard_normal(shape) / np.sqrt(shape[-1])).astype(np.float32)
        for name, shape in cfg.param_shapes().items()
    }
    items = [
        {
            "ctx": "".join(rng.choice(list("abcd"), int(rng.integers(1, 9)))),
            "label": int(rng.integers(4)),
            "endings": ["".join(rng.choice(list("abcd "), int(rng.integers(1, 6)))) for _ in range(4)],
        }
        for _ in range(9)
    ]
    rows = [row for item in items for row in item_rows(_encode, item, cfg.ctx_len)]
    on_gpu = {k: cupy.asarray(v) for k, v in params.items()}
    for ours, ref in zip(score_rows(on_gpu, cfg, rows, cupy), score_rows(params, cfg, rows, np)):
        np.testing.assert_allclose(ours, ref, rtol=1e-4, atol=1e-5)
    gpu = score_items(on_gpu, cfg, _encode, items, batch_size=4, xp=cupy)
    cpu = score_items(params, cfg, _encode, items, batch_size=4, xp=np)
    assert gpu["acc"] == cpu["acc"] and gpu["acc_norm"] == cpu["acc_norm"]


def test_evaluate_reads_the_scores_and_names_a_bad_file(tmp_path):
    from nanoeuler.eval.report import read_hellaswag

    good = tmp_path / "base.json"
    good.write_text(
        json.dumps(
            {
                "model": "base",
                "items": 4,
                "acc": 0.5,
                "acc_norm": 0.25,
                "correct": 2,
                "correct_norm": 1,
                "steps": 9,
                "file": "results/base.bin",
                "picks": [0, 1, 2, 3],
            }
        )
    )
    assert read_hellaswag([str(good)]) == {
        "base": {
            "items": 4,
            "acc": 0.5,
            "acc_norm": 0.25,
            "correct": 2,
            "correct_norm": 1,
            "steps": 9,
            "file": "results/base.bin",
        }
    }
    bad = tmp_path / "chat.json"
    bad.write_text('{"model": "chat"}')
    with pytest.raises(UserError, match=r"chat.json is not a HellaSwag result of `nanoeuler hellaswag-eval`"):
        read_hellaswag([str(good), str(bad)])
