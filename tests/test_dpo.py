"""The DPO stages: pairs as batches, reference log-probs, training through the shared loop, resume, errors."""

import json
import subprocess
import sys

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.errors import UserError
from nanoeuler.train import pairs as P
from train_fixtures import make_tokenizer, save_random_model, write_config, write_shards

PAIRS = [
    {"prompt": "Name a color.\n", "chosen": "Blue.", "rejected": "I will not."},
    {"prompt": "What is the capital of France?\n", "chosen": "Paris.", "rejected": "Rome, of course."},
    {
        "prompt": "Give three tips for staying healthy.\n",
        "chosen": "Eat well, sleep well, walk.",
        "rejected": "the sea was calm " * 30,
    },
    {"prompt": "Translate to French: the sea\n", "chosen": "La mer", "rejected": "The sea"},
]


def write_pairs(path, n=24):
    with open(path, "w", encoding="utf-8") as f:
        for i in range(n):
            f.write(json.dumps(PAIRS[i % len(PAIRS)]) + "\n")
    return path


def nanoeuler(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "nanoeuler", *map(str, args)], capture_output=True, text=True)
    if check:
        assert proc.returncode == 0, proc.stderr
    return proc


def ref_logps(tmp, conf, prefs, out, *extra):
    """`nanoeuler ref-logps` of the run's chat model on the pairs, to out."""
    nanoeuler(
        "ref-logps",
        "--config",
        conf,
        *extra,
        "--ckpt",
        tmp / "chat.bin",
        "--prefs",
        prefs,
        "--out",
        out,
        "--no-progress",
    )


@pytest.fixture()
def setup(tmp_path):
    tok = make_tokenizer()
    save_random_model(tmp_path / "chat.bin", tok)
    conf = write_config(
        tmp_path / "c.yaml",
        dpo={
            "epochs": 2,
            "batch_size": 4,
            "lr": 1e-3,
            "warmup_steps": 1,
            "val_pairs": 4,
            "log_every": 1,
            "eval_every": 3,
            "checkpoint_every": 2,
            "beta": 0.5,
        },
    )
    prefs = write_pairs(tmp_path / "prefs.jsonl")
    return tmp_path, conf, prefs, tok


def test_fit_pair_keeps_one_prompt_for_both_answers():
    p, c, r = P.fit_pair(list(range(10)), [20] * 8, [30] * 2, ctx_len=11)  # 12 tokens; room max(2, 5) = 5
    assert (p, c, r) == (tuple(range(3, 10)), (20,) * 5, (30,) * 2)
    p, c, r = P.fit_pair([1, 2], [3], [4, 5], ctx_len=8)
    assert (p, c, r) == ((1, 2), (3,), (4, 5))


def test_pair_batch_puts_chosen_rows_first_and_marks_responses_on_head_0():
    x, y = P.pair_batch([((1, 2), (3, 4), (5,)), ((6,), (7,), (8, 9, 10))], K=3, pad_id=0)
    assert x.tolist() == [[1, 2, 3], [6, 0, 0], [1, 2, 0], [6, 8, 9]]  # inputs: every token but the last
    assert y[:, :, 0].tolist() == [[-1, 3, 4], [7, -1, -1], [-1, 5, -1], [8, 9, 10]]
    assert (y[:, :, 1:] == -1).all()


def test_reference_and_dpo_stages_train_resume_and_score(setup):
    tmp, conf, prefs, tok = setup
    ref_logps(tmp, conf, prefs, tmp / "ref.npz")
    with np.load(tmp / "ref.npz") as z:
        ref, meta = z["logps"], json.loads(str(z["meta"]))
    assert ref.shape == (24, 2) and (ref < 0).all() and meta["pairs"] == 24
    # the reference equals a direct computation with the loaded model
    params, cfg, _ = checkpoint.load_model(tmp / "chat.bin")
    ex, _ = P.encode_pairs(P.read_pairs(prefs), tok, cfg.ctx_len)
    assert np.allclose(P.sequence_logps(params, cfg, ex[:3], 3, tok.eot_id, np), ref[:3], rtol=1e-5)

    args = [
        "dpo",
        "--config",
        conf,
        "--ckpt",
        tmp / "chat.bin",
        "--prefs",
        prefs,
        "--ref",
        tmp / "ref.npz",
        "--out",
        tmp / "dpo.bin",
        "--no-progress",
    ]
    out = nanoeuler(*args)
    assert "reward accuracy" in out.stdout
    lines = [json.loads(s) for s in (tmp / "dpo" / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    val = [r for r in lines if "reward_accuracy" in r]
    assert len(train) == 10 and abs(train[0]["loss"] - np.log(2)) < 1e-3  # 20 pairs / 4 x 2 epochs; starts at h=0
    assert train[-1]["loss"] < train[0]["loss"]
    assert val[-1]["step"] == 10 and {"margin", "chosen_logp", "rejected_logp", "val_loss"} <= set(val[-1])
    assert (tmp / "dpo" / "loss.png").exists()
    dpo_params = checkpoint.load_model(tmp / "dpo.bin")[0]
    assert np.array_equal(dpo_params["mtp_heads.1.weight"], params["mtp_heads.1.weight"])  # no gradient
    assert not np.array_equal(dpo_params["lm_head.weight"], params["lm_head.weight"])

    # resume: drop the last checkpoints and run again; the final model is bit-identical
    for ck in sorted((tmp / "dpo").glob("ckpt_*.bin"))[-2:]:
        ck.unlink()
    (tmp / "dpo.bin").unlink()
    out = nanoeuler(*args)
    assert "resuming from step 6" in out.stderr
    again = checkpoint.load_model(tmp / "dpo.bin")[0]
    assert all(np.array_equal(again[n], dpo_params[n]) for n in dpo_params)


def test_dpo_refuses_a_reference_of_other_pairs(setup):
    tmp, conf, prefs, tok = setup
    ref_logps(tmp, conf, prefs, tmp / "ref.npz")
    write_pairs(prefs, n=20)
    proc = nanoeuler(
        "dpo",
        "--config",
        conf,
        "--ckpt",
        tmp / "chat.bin",
        "--prefs",
        prefs,
        "--ref",
        tmp / "ref.npz",
        "--out",
        tmp / "dpo.bin",
        check=False,
    )
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines()[-1].startswith("nanoeuler dpo: error: reference log-probs")
    assert "re-run `nanoeuler ref-logps`" in proc.stderr and not (tmp / "dpo.bin").exists()


def test_read_pairs_names_a_bad_line(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(PAIRS[0]) + "\n" + json.dumps({"prompt": "x", "chosen": 1}) + "\n")
    with pytest.raises(UserError, match=r"p.jsonl:2: expected an object"):
        P.read_pairs(path)


def test_evaluate_shows_the_dpo_answers_beside_the_chat_answers(tmp_path):
    tok = make_tokenizer()
    manifest = write_shards(tmp_path / "shards", tok, n_train=1000, n_val=600)
    for seed, name in enumerate(("base", "chat", "dpo")):
        save_random_model(tmp_path / f"{name}.bin", tok, seed=seed)
    conf = write_config(
        tmp_path / "c.yaml",
        eval={
            "base_prompts": ["It was"],
            "chat_prompts": ["Name a color.", "Hi"],
            "max_new_tokens": 4,
            "val_tokens": 200,
            "batch_size": 2,
        },
    )
    out = tmp_path / "out"
    nanoeuler(
        "evaluate",
        "--config",
        conf,
        "--base",
        tmp_path / "base.bin",
        "--chat",
        tmp_path / "chat.bin",
        "--dpo",
        tmp_path / "dpo.bin",
        "--shards",
        manifest,
        "--samples",
        out / "samples.md",
        "--metrics",
        out / "metrics.json",
        "--plot",
        out / "loss.png",
    )
    m = json.loads((out / "metrics.json").read_text())
    assert m["dpo"]["file"].endswith("dpo.bin") and m["dpo"]["val_loss"] != m["chat"]["val_loss"]
    md = (out / "samples.md").read_text()
    sections = {part.split("\n", 1)[0]: part for part in md.split("\n## ")[1:]}  # heading -> its text
    assert list(sections) == ["Metrics", "Base model continuations", "Chat answers"]
    assert "| dpo |" in sections["Metrics"] and "DPO on held-out preference pairs" in sections["Metrics"]
    assert "DPO" not in sections["Base model continuations"]
    answers = sections["Chat answers"].split("**Instruction:** ")[1:]  # each chat answer, then the DPO model's
    assert [a.split("\n", 1)[0] for a in answers] == ["Name a color.", "Hi"]
    assert all(a.count("*DPO model:*") == 1 and a.index("```") < a.index("*DPO model:*") for a in answers)


@pytest.mark.gpu
def test_stages_on_the_gpu_track_the_cpu(setup):
    tmp, conf, prefs, tok = setup
    runs = {}
    for dev in ("cpu", "gpu"):
        ref = tmp / f"ref_{dev}.npz"
        ref_logps(tmp, conf, prefs, ref, "--device", dev)
        nanoeuler(
            "dpo",
            "--config",
            conf,
            "--device",
            dev,
            "--ckpt",
            tmp / "chat.bin",
            "--prefs",
            prefs,
            "--ref",
            ref,
            "--out",
            tmp / f"dpo_{dev}.bin",
            "--run-dir",
            tmp / f"run_{dev}",
            "--no-progress",
        )
        with np.load(ref) as z:
            metrics = (tmp / f"run_{dev}" / "metrics.jsonl").read_text().splitlines()
            runs[dev] = (z["logps"], [json.loads(s) for s in metrics])
    assert np.allclose(runs["gpu"][0], runs["cpu"][0], rtol=1e-5)
    for a, b in zip(runs["cpu"][1], runs["gpu"][1]):
        for key in ("loss", "val_loss", "margin", "chosen_logp"):
            if key in a:
                assert abs(a[key] - b[key]) <= 1e-3 * max(1.0, abs(a[key])), (key, a, b)


def test_the_dag_plans_the_dpo_stages_and_evaluate_pulls_them_in_with_eval_dpo(tmp_path):
    import yaml

    from nanoeuler.config import REPO_ROOT
    from workflow_helpers import planned_jobs, snakemake

    tiny = REPO_ROOT / "config" / "tiny.yaml"
    jobs = planned_jobs(snakemake(tmp_path, tiny, ["results/dpo.bin"], "-n"))
    assert jobs["prefs"] == jobs["ref_logps"] == jobs["dpo"] == 1 and "evaluate" not in jobs
    conf = yaml.safe_load(tiny.read_text())
    conf["eval"]["dpo"] = True
    (tmp_path / "with_dpo.yaml").write_text(yaml.safe_dump(conf))
    jobs = planned_jobs(snakemake(tmp_path, tmp_path / "with_dpo.yaml", ["results/samples.md"], "-n"))
    assert jobs["dpo"] == 1 and jobs["evaluate"] == 1
