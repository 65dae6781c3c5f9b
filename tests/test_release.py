"""`nanoeuler release` and the `release` rule: a finished tiny run becomes a folder that transformers and our own
commands load, whose checksums verify and whose model card states what the run's files hold."""

import hashlib
import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import yaml

from nanoeuler import checkpoint
from nanoeuler.cli import main
from nanoeuler.model import transformer
from nanoeuler.serve.prompts import chat_prompt
from nanoeuler.data.template import render_prompt
from train_fixtures import TINY_MODEL, make_tokenizer, write_alpaca, write_config, write_shards
from workflow_helpers import snakemake

PRETRAIN = dict(
    steps=6, batch_size=4, lr=1e-3, warmup_steps=1, log_every=2, eval_every=3, checkpoint_every=3, val_tokens=128
)
SFT = dict(
    epochs=1, batch_size=4, lr=1e-3, warmup_steps=1, log_every=1, eval_every=2, checkpoint_every=2, val_examples=4
)
EVAL = dict(
    max_new_tokens=6, val_tokens=256, base_prompts=["It was"], chat_prompts=["Name a color."], hellaswag_items=4
)
RELEASE_FILES = [
    "README.md",
    "SHA256SUMS",
    "chat.bin",
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "run_config.yaml",
    "tokenizer.json",
    "tokenizer_config.json",
]
# Snakemake's benchmark file: the wall time of each rule in column s
BENCH = (
    "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    "{s}\t0:00:00\t1\t1\t1\t1\t0\t0\t0\t1\n"
)


def cli(*argv) -> None:
    assert main([str(a) for a in argv]) == 0, argv


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished run in results/: pretraining, SFT, HellaSwag, evaluation, and Snakemake's benchmark files."""
    work = tmp_path_factory.mktemp("run")
    res = work / "results"
    tok = make_tokenizer()
    res.mkdir()
    tok.save(res / "tokenizer.json")
    manifest = write_shards(res / "shards", tok)
    write_alpaca(work / "alpaca.jsonl", n=12)
    item = {"ctx": "The sea", "endings": ["was calm.", "is blue.", "ran.", "sat."], "label": 0}
    (work / "hellaswag.jsonl").write_text((json.dumps(item) + "\n") * 4)
    conf = write_config(work / "config.yaml", pretrain=PRETRAIN, sft=SFT, eval=EVAL)
    cli(
        "pretrain",
        "--config",
        conf,
        "--shards",
        manifest,
        "--tokenizer",
        res / "tokenizer.json",
        "--out",
        res / "base.bin",
        "--no-progress",
    )
    cli(
        "sft",
        "--config",
        conf,
        "--base",
        res / "base.bin",
        "--data",
        work / "alpaca.jsonl",
        "--out",
        res / "chat.bin",
        "--no-progress",
    )
    for name in ("base", "chat"):
        cli(
            "hellaswag-eval",
            "--config",
            conf,
            "--ckpt",
            res / f"{name}.bin",
            "--data",
            work / "hellaswag.jsonl",
            "--name",
            name,
            "--out",
            res / "hellaswag" / f"{name}.json",
        )
    cli(
        "evaluate",
        "--config",
        conf,
        "--base",
        res / "base.bin",
        "--chat",
        res / "chat.bin",
        "--shards",
        manifest,
        "--samples",
        res / "samples.md",
        "--metrics",
        res / "metrics.json",
        "--plot",
        res / "loss.png",
        "--hellaswag",
        res / "hellaswag" / "base.json",
        res / "hellaswag" / "chat.json",
    )
    (work / "benchmarks").mkdir()
    for rule, seconds in (("pretrain", 125.4), ("sft", 3725.0), ("corpus", 2.0)):
        (work / "benchmarks" / f"{rule}.tsv").write_text(BENCH.format(s=seconds))
    return work, conf


@pytest.fixture(scope="module")
def release(run):
    work, conf = run
    cli(
        "release",
        "--config",
        conf,
        "--model",
        work / "results" / "chat.bin",
        "--out",
        work / "results" / "release",
        "--benchmarks",
        work / "benchmarks",
    )
    return work / "results" / "release"


def card_parts(path):
    """(metadata header as parsed YAML, body) of a model card file."""
    return card_parts_of(path.read_text(encoding="utf-8"))


def card_parts_of(text):
    assert text.startswith("---\n")
    header, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(header), body


def test_release_folder_holds_every_file_and_its_sums_verify(release):
    assert sorted(p.name for p in release.iterdir()) == RELEASE_FILES
    sums = checkpoint.parse_sums((release / "SHA256SUMS").read_text(), "SHA256SUMS")
    assert sorted(sums) == [n for n in RELEASE_FILES if n != "SHA256SUMS"]
    for name, digest in sums.items():
        assert hashlib.sha256((release / name).read_bytes()).hexdigest() == digest, name
    if shutil.which("sha256sum"):  # coreutils reads the same file
        assert subprocess.run(["sha256sum", "--check", "--quiet", "SHA256SUMS"], cwd=release).returncode == 0
    assert not [p for p in release.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left
    assert (release.stat().st_mode & 0o777) == (release.parent.stat().st_mode & 0o777)  # not mkdtemp's 0700


def test_the_native_checkpoint_is_the_run_model_byte_for_byte(run, release):
    work, _ = run
    assert (release / "chat.bin").read_bytes() == (work / "results" / "chat.bin").read_bytes()
    run_config = yaml.safe_load((release / "run_config.yaml").read_text())
    assert run_config["pretrain"]["steps"] == PRETRAIN["steps"] and run_config["release"]["license"] == "cc-by-nc-4.0"


def test_card_metadata_parses_and_its_numbers_are_the_runs(run, release):
    work, _ = run
    res = work / "results"
    meta, body = card_parts(release / "README.md")
    assert meta["license"] == "cc-by-nc-4.0" and meta["language"] == ["en"]
    assert meta["pipeline_tag"] == "text-generation" and meta["library_name"] == "transformers"
    assert {"nanoeuler", "sft"} <= set(meta["tags"]) and "dpo" not in meta["tags"]
    assert meta["datasets"] == ["HuggingFaceFW/fineweb-edu", "tatsu-lab/alpaca"]  # the config's default sources
    assert "| ODC-By 1.0 |" in body and "| CC BY-NC 4.0 |" in body and "| public domain in the USA |" in body
    hellaswag = json.loads((res / "hellaswag" / "chat.json").read_text())
    result = meta["model-index"][0]["results"][0]
    assert result["dataset"]["args"]["items"] == 4
    assert [(m["type"], m["value"]) for m in result["metrics"]] == [
        ("acc", hellaswag["acc"]),
        ("acc_norm", hellaswag["acc_norm"]),
    ]
    hub = pytest.importorskip("huggingface_hub")  # the Hub's own reader of card metadata
    card = hub.ModelCard.load(release / "README.md")
    assert card.data.license == "cc-by-nc-4.0"
    assert [r.metric_value for r in card.data.eval_results] == [hellaswag["acc"], hellaswag["acc_norm"]]

    _, cfg, chat_meta = checkpoint.load_model(res / "chat.bin")
    from safetensors.numpy import load_file

    exported = sum(a.size for a in load_file(release / "model.safetensors").values())
    assert f"| parameters | {cfg.n_params():,} ({exported:,} in `model.safetensors`" in body
    assert exported == cfg.n_params() - (cfg.mtp_heads - 1) * cfg.vocab_size * cfg.dim
    tokens = PRETRAIN["steps"] * PRETRAIN["batch_size"] * cfg.ctx_len
    assert f"Tokens seen in pretraining: {tokens:,} ({PRETRAIN['steps']} steps of {PRETRAIN['batch_size']} " in body
    metrics = json.loads((res / "metrics.json").read_text())
    for name in ("base", "chat"):
        m, hs = metrics[name], json.loads((res / "hellaswag" / f"{name}.json").read_text())
        assert re.search(
            rf"\| {name}[^|]* \| {m['val_loss']:.4f} \| {m['val_bpb']:.4f} \| {hs['acc']:.4f} \| "
            rf"{hs['acc_norm']:.4f} \|",
            body,
        ), name
    assert f"| sft | {chat_meta['step']} | {chat_meta['final_metrics']['loss']:.4f} | 1:02:05 (3,725 s) |" in body
    assert "| pretrain | 6 |" in body and "0:02:05 (125 s)" in body
    assert "3,852 s) in all" in body  # 125.4 + 3725 + 2
    assert "pretraining ran on the CPU" in body
    samples = (res / "samples.md").read_text()
    assert "**Instruction:** Name a color." in body and samples.split("**Instruction:** Name a color.")[1][:40] in body
    assert "knows little" not in body and "barely English" in body  # a 0.1M model is a smoke test, said so


def test_transformers_loads_the_release_and_its_logits_are_ours(run, release):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(release, dtype=torch.float32, local_files_only=True)
    params, cfg, _ = checkpoint.load_model(release / "chat.bin")
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, size=(2, cfg.ctx_len))
    with torch.no_grad():
        theirs = model.eval()(torch.tensor(ids)).logits.numpy()
    assert np.abs(theirs - transformer.logits(params, ids, cfg)).max() <= 1e-4

    hf_tok = transformers.AutoTokenizer.from_pretrained(release, local_files_only=True)
    tok = make_tokenizer()
    one = [{"role": "user", "content": "Name a color."}]
    assert hf_tok.apply_chat_template(one, tokenize=False, add_generation_prompt=True) == render_prompt("Name a color.")
    talk = [("system", "Be brief."), ("user", "Name a color."), ("assistant", "Blue."), ("user", "Another one.")]
    messages = [{"role": r, "content": t} for r, t in talk]
    ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)["input_ids"]
    assert ids == chat_prompt(tok, talk, 4096, 0)[0]  # the server's layout, token for token (all of it kept)
    gen = json.loads((release / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.end_id, tok.eot_id] and gen["temperature"] == 0.8


def test_sample_and_the_server_backend_load_the_release_folder(run, release, capsys):
    work, conf = run
    argv = ["sample", "--config", conf, "--prompt", "It was", "--temperature", "0", "--max-new-tokens", "8"]
    cli(*argv, "--ckpt", release)
    from_release = capsys.readouterr().out
    cli(*argv, "--ckpt", work / "results" / "chat.bin")
    assert from_release == capsys.readouterr().out and from_release.startswith("It was")

    from nanoeuler.infer.generate import Sampling
    from nanoeuler.serve.backend import Backend

    answers = []
    for path in (release, work / "results" / "chat.bin"):
        backend = Backend.load(path, device="cpu")
        assert backend.name == "chat"  # the model file's name, as the API's `model`
        stream = backend.open(backend.tok.encode(render_prompt("Name a color.")), 6, Sampling(temperature=0))
        tokens = []
        while not stream.done:
            (got,) = backend.step([stream])  # a stream's new token ids (several where drafts were kept)
            assert not isinstance(got, Exception), got
            tokens += got
        stream.close()
        answers.append(tokens)
    assert answers[0] == answers[1] and answers[0]


def test_a_changed_checkpoint_is_refused_in_one_line(run, release, tmp_path, capsys):
    work, conf = run
    for how in ("byte", "swapped"):
        bad = tmp_path / how
        shutil.copytree(release, bad)
        if how == "byte":  # a flipped data byte
            data = bytearray((bad / "chat.bin").read_bytes())
            data[-5] ^= 1
            (bad / "chat.bin").write_bytes(bytes(data))
        else:  # another valid model under its name: its own checksum passes, the release's does not
            shutil.copyfile(work / "results" / "base.bin", bad / "chat.bin")
        capsys.readouterr()
        assert main(["sample", "--config", str(conf), "--ckpt", str(bad), "--prompt", "It was"]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("nanoeuler sample: error: release ") and str(bad) in err[-1]
        assert "chat.bin does not match its sha256 in SHA256SUMS" in err[-1]


def test_missing_run_files_say_not_measured_and_a_missing_model_is_an_error(run, tmp_path, capsys):
    work, conf = run
    out = tmp_path / "rel"
    gone = tmp_path / "gone"
    local = write_config(
        tmp_path / "local.yaml",
        fineweb={"base_url": "data/sample/fineweb"},
        alpaca={"url": "data/sample/alpaca_data.json"},
    )
    cli(
        "release",
        "--config",
        local,
        "--model",
        work / "results" / "chat.bin",
        "--out",
        out,
        "--base",
        gone / "b.bin",
        "--metrics",
        gone / "metrics.json",
        "--samples",
        gone / "samples.md",
        "--pretrain-dir",
        gone,
        "--benchmarks",
    )
    meta, body = card_parts(out / "README.md")
    assert "model-index" not in meta
    assert "datasets" not in meta and "`data/sample/alpaca_data.json` | that of the copy (not known" in body
    assert "Tokens seen in pretraining: not measured." in body
    assert "| chat (this model) | not measured | not measured | not measured | not measured |" in body
    assert "| pretrain | not measured | not measured | not measured |" in body
    assert "## Samples\n\nnot measured (no samples.md)." in body
    assert "Hardware: not measured" in body and "(Snakemake's benchmark files): not measured." in body

    capsys.readouterr()
    missing = ["release", "--config", str(conf), "--model", str(gone / "chat.bin"), "--out", str(tmp_path / "x")]
    assert main(missing) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("nanoeuler release: error: ") and str(gone / "chat.bin") in err[0]
    assert not (tmp_path / "x").exists()
    assert main(["release", "--model", str(work / "results" / "chat.bin"), "--out", str(tmp_path / "x")]) == 1
    assert "--config FILE or --params JSON" in capsys.readouterr().err


def test_an_other_folder_is_refused_and_a_previous_release_replaced(run, tmp_path, capsys):
    work, conf = run
    argv = ["release", "--config", str(conf), "--model", str(work / "results" / "chat.bin")]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    (other / "README.md").write_text("mine too")
    assert main(argv + ["--out", str(other)]) == 1
    assert "holds other files (notes.txt)" in capsys.readouterr().err
    assert sorted(p.name for p in other.iterdir()) == ["README.md", "notes.txt"]  # untouched

    out = tmp_path / "rel"
    cli(*argv, "--out", out)
    first = (out / "README.md").read_text()
    (out / "SHA256SUMS").unlink()  # as Snakemake removes the rule's declared output before a re-run
    cli(*argv, "--out", out)
    assert sorted(p.name for p in out.iterdir()) == RELEASE_FILES and (out / "README.md").read_text() == first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other", "rel"]  # nothing left beside it


def test_a_card_of_the_full_config_model_claims_no_more_than_its_files():
    """The 116M model of the full run, with nothing but its config: the public data sets are named with their
    licenses, every measurement says it is missing, and the text is the candid one of a ~100M model."""
    from nanoeuler.config import validate
    from nanoeuler.export.card import RunFacts, model_card
    from nanoeuler.model.config import ModelConfig

    conf = validate({})
    cfg = ModelConfig.from_section({"preset": "gpu"}, 4096)
    card = model_card(RunFacts(name="chat", cfg=cfg, meta={}, exported_params=0, conf=conf, version="0"))
    meta, body = card_parts_of(card)
    assert meta["datasets"] == ["HuggingFaceFW/fineweb-edu", "tatsu-lab/alpaca"] and "model-index" not in meta
    assert f"# nanoeuler-chat-{round(cfg.n_params() / 1e6)}M" in body and f"A {cfg.n_params():,}-parameter" in body
    assert f"| Project Gutenberg books ({len(conf['gutenberg']['ids'])} books" in body
    assert "knows little and reasons not at all" in body and "barely English" not in body
    assert "Tokens seen in pretraining: not measured." in body and "| sft | not measured |" in body
    assert "Alpaca is CC BY-NC 4.0" in body


@pytest.mark.slow
def test_release_rule_runs_the_command_on_the_runs_files(run, tmp_path):
    work, conf = run
    shutil.copytree(work / "results", tmp_path / "results", ignore=shutil.ignore_patterns("release"))
    shutil.copytree(work / "benchmarks", tmp_path / "benchmarks")
    out = snakemake(tmp_path, conf, ["results/release/SHA256SUMS"], "--allowed-rules", "release")
    assert "release" in out
    release = tmp_path / "results" / "release"
    assert sorted(p.name for p in release.iterdir()) == RELEASE_FILES
    _, body = card_parts(release / "README.md")
    tokens = PRETRAIN["steps"] * PRETRAIN["batch_size"] * TINY_MODEL["ctx_len"]
    assert f"Tokens seen in pretraining: {tokens:,} (" in body and "1:02:05 (3,725 s)" in body
    assert (tmp_path / "logs" / "release.log").read_text().startswith("nanoeuler release: wrote results/release")
