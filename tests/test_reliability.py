"""Regression tests for the reliability promises: each test names the failure it guards against.

The downloader's fault cases are in test_faults.py (a misbehaving loopback server), the parsers'
properties in test_properties.py (hypothesis).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nanoeuler import checkpoint
from nanoeuler.errors import UserError

REPO = Path(__file__).resolve().parents[1]


# ---- checkpoints: the checksum covers the header ------------------------------------------------


def _header_span(raw: bytes) -> tuple[int, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8 : 8 + n]


def test_a_changed_dtype_in_the_header_is_refused(tmp_path):
    # F32 -> I32 keeps every size and offset valid: only the header says the bytes mean something else
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"w": np.arange(4, dtype=np.float32)}, {"step": 1})
    raw = path.read_bytes()
    assert raw.count(b'"F32"') == 1
    path.write_bytes(raw.replace(b'"F32"', b'"I32"'))
    with pytest.raises(UserError, match="checksum"):
        checkpoint.load(path)


def test_changed_metadata_and_tensor_names_are_refused(tmp_path):
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"wa": np.ones(2, np.float32), "wb": np.zeros(2, np.float32)}, {"step": 7})
    raw = path.read_bytes()
    for old, new in ((b'"7"', b'"8"'), (b'"wa"', b'"wc"')):
        assert raw.count(old) == 1
        path.write_bytes(raw.replace(old, new))
        with pytest.raises(UserError, match="checksum"):
            checkpoint.load(path)


def test_header_padding_is_not_meaning(tmp_path):
    """Padding spaces may become other JSON whitespace: the file still means the same and loads."""
    path = tmp_path / "c.bin"
    checkpoint.save(path, {"w": np.ones(3, np.float32)}, {"step": 1})
    raw = bytearray(path.read_bytes())
    n, blob = _header_span(bytes(raw))
    if blob.endswith(b" "):
        raw[8 + n - 1] = ord("\n")
        path.write_bytes(bytes(raw))
        tensors, meta = checkpoint.load(path)
        assert meta == {"step": 1}


def test_version_1_files_still_load_with_their_data_checksum(tmp_path):
    path = tmp_path / "old.bin"
    w = np.arange(6, dtype=np.float32)
    meta = {
        "step": json.dumps(3),
        "format": "nanoeuler",
        "format_version": "1",
        "checksum": hashlib.sha256(w.tobytes()).hexdigest(),
    }
    checkpoint.write_safetensors(path, {"w": w}, meta)
    tensors, got = checkpoint.load(path)
    np.testing.assert_array_equal(tensors["w"], w)
    assert got == {"step": 3}
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(UserError, match="checksum"):
        checkpoint.load(path)


# ---- file permissions ---------------------------------------------------------------------------


def test_atomic_text_outputs_get_the_usual_mode(tmp_path):
    """tokenizer.json, tokenizer.hf.json and manifest.json were written 0600 (mkstemp's mode)."""
    from nanoeuler.tokenizer.bpe import write_text_atomic

    old = os.umask(0o022)
    try:
        write_text_atomic(tmp_path / "t.json", "{}\n")
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "t.json").stat().st_mode) == 0o644


# ---- one line instead of a traceback --------------------------------------------------------------


def _nanoeuler(*args, stdin: bytes | None = None):
    return subprocess.run([sys.executable, "-m", "nanoeuler", *args], input=stdin, capture_output=True, timeout=120)


@pytest.fixture(scope="module")
def model_file(tmp_path_factory):
    from train_fixtures import make_tokenizer, save_random_model

    path = tmp_path_factory.mktemp("model") / "chat.bin"
    save_random_model(path, make_tokenizer())
    return path


def test_sample_refuses_a_prompt_that_is_not_utf8(model_file):
    r = _nanoeuler("sample", "--ckpt", str(model_file), "--device", "cpu", "--prompt", b"caf\xe9 au lait")
    err = r.stderr.decode()
    assert r.returncode == 1 and r.stdout == b""
    assert err.strip() == "nanoeuler sample: error: --prompt is not valid UTF-8 text (at character 3: the byte 0xe9)"


def test_chat_survives_a_line_that_is_not_utf8(model_file):
    r = _nanoeuler(
        "chat",
        "--ckpt",
        str(model_file),
        "--device",
        "cpu",
        "--max-new-tokens",
        "4",
        stdin=b"\xff\xfe broken\nName a color.\n",
    )
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "nanoeuler chat: error: that line is not valid UTF-8 text (at character 0: the byte 0xff); try again" in err
    assert "Traceback" not in err
    assert r.stdout.decode().count("> ") == 3  # the bad line, the good one, and the prompt Ctrl-D answered


def test_os_errors_are_one_line_and_leave_no_output(tmp_path, capsys, monkeypatch):
    from nanoeuler.cli import main

    (tmp_path / "a_file").write_text("x")
    sample = REPO / "data" / "sample" / "alpaca_data.json"
    args = ["alpaca", "--params", json.dumps({"alpaca": {"url": str(sample)}}), "--raw-dir", str(tmp_path / "raw")]
    assert main([*args, "--out", str(tmp_path / "a_file" / "alpaca.jsonl")]) == 1  # a file where a folder is
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"nanoeuler alpaca: error: {tmp_path / 'a_file'}: File exists"

    def full_disk(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    corpus_file = tmp_path / "train.parquet"
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["the sea was calm " * 20] * 10}), corpus_file)
    out = tmp_path / "tok" / "tokenizer.json"
    assert (
        main(
            [
                "tokenizer",
                "--params",
                json.dumps({"tokenizer": {"vocab_size": 300}}),
                "--corpus",
                str(corpus_file),
                "--out",
                str(out),
            ]
        )
        == 1
    )
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last == f"nanoeuler tokenizer: error: {out}: No space left on device"
    assert list(out.parent.iterdir()) == []  # no partial or temporary file


def _corpus_inputs(tmp_path, books: dict, web: dict):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table(books), tmp_path / "books.parquet")
    pq.write_table(pa.table(web), tmp_path / "web.parquet")
    return tmp_path / "books.parquet", tmp_path / "web.parquet"


CORPUS = {"weights": {"gutenberg": 1.0, "fineweb": 1.0}, "val_fraction": 0.1, "chunk_bytes": 1024, "seed": 0}


def test_a_corpus_column_of_the_wrong_type_is_named(tmp_path):
    from nanoeuler.data import corpus

    books, web = _corpus_inputs(tmp_path, {"doc_id": ["1"], "text": [17]}, {"doc_id": ["a"], "text": ["web text"]})
    with pytest.raises(UserError, match=r"column 'text' of .*books\.parquet must hold string values, not int64"):
        corpus.build(CORPUS, books, web, tmp_path / "t.parquet", tmp_path / "v.parquet")
    assert not (tmp_path / "t.parquet").exists()


def test_a_fineweb_column_of_the_wrong_type_is_named(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanoeuler.data import fineweb

    pq.write_table(pa.table({"text": ["a"], "int_score": ["high"], "language_score": [0.9]}), tmp_path / "f.parquet")
    section = {"min_int_score": 3, "min_language_score": 0.5}
    with pytest.raises(UserError, match=r"column 'int_score' of .*f\.parquet must hold number values, not string"):
        fineweb.check_files([tmp_path / "f.parquet"], section)


def test_an_empty_corpus_names_the_empty_inputs(tmp_path):
    from nanoeuler.data import corpus

    books, web = _corpus_inputs(tmp_path, {"doc_id": ["1"], "text": [""]}, {"doc_id": ["a"], "text": [""]})
    with pytest.raises(UserError) as err:
        corpus.build(CORPUS, books, web, tmp_path / "t.parquet", tmp_path / "v.parquet")
    msg = str(err.value)
    assert str(books) in msg and str(web) in msg and "no documents with text" in msg
    assert "weights" not in msg
    zero = {**CORPUS, "weights": {"gutenberg": 0.0, "fineweb": 0.0}}
    with pytest.raises(UserError, match="every corpus.weights entry is 0"):
        corpus.build(zero, books, web, tmp_path / "t.parquet", tmp_path / "v.parquet")


# ---- the DAG --------------------------------------------------------------------------------------


def _snakemake(cwd, *args, env_extra=None, timeout=300):
    bin_dir = Path(sys.executable).parent
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "PYTHONPATH": os.pathsep.join([*(env_extra or []), str(REPO)]),
    }
    return subprocess.run(
        [str(bin_dir / "snakemake"), *args, "--cores", "1"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_the_default_target_is_the_full_run(tmp_path):
    from workflow_helpers import planned_jobs, snakemake

    out = snakemake(tmp_path, REPO / "config" / "tiny.yaml", [], "-n")
    jobs = planned_jobs(out)
    assert jobs.get("all") == 1 and {"pretrain", "sft", "evaluate"} <= set(jobs), out[-2000:]


def _copy_project(dest):
    import shutil

    dest.mkdir()
    shutil.copy(REPO / "Snakefile", dest / "Snakefile")
    for folder in ("workflow", "config", "data/sample"):
        shutil.copytree(REPO / folder, dest / folder)


@pytest.mark.slow
def test_a_moved_project_re_runs_nothing(tmp_path):
    _copy_project(tmp_path / "a")
    target = ["data/alpaca/alpaca.jsonl", "--configfile", "config/tiny.yaml"]
    r = _snakemake(tmp_path / "a", *target)
    assert r.returncode == 0, r.stderr[-3000:]
    (tmp_path / "a").rename(tmp_path / "b")
    r = _snakemake(tmp_path / "b", "-n", *target)
    assert r.returncode == 0 and "Nothing to be done" in r.stdout + r.stderr, (r.stdout + r.stderr)[-3000:]


SITE = """
import socket
_real = socket.getaddrinfo
def _getaddrinfo(host, *args, **kw):  # *.invalid: as without DNS, and without asking anyone
    if str(host).endswith(".invalid"):
        raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
    return _real(host, *args, **kw)
socket.getaddrinfo = _getaddrinfo
"""


@pytest.mark.slow
def test_offline_fails_fast_with_the_cause_in_snakemakes_error(tmp_path):
    import time

    import yaml

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE)
    cfg = yaml.safe_load((REPO / "config" / "tiny.yaml").read_text())
    cfg["alpaca"]["url"] = "http://offline.invalid/alpaca_data.json"
    (tmp_path / "offline.yaml").write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    r = _snakemake(
        tmp_path,
        "data/alpaca/alpaca.jsonl",
        "-s",
        str(REPO / "Snakefile"),
        "--configfile",
        str(tmp_path / "offline.yaml"),
        env_extra=[str(site)],
    )
    assert r.returncode != 0
    cause = (
        "nanoeuler alpaca: error: download of http://offline.invalid/alpaca_data.json: could not resolve "
        "host offline.invalid (Temporary failure in name resolution)"
    )
    assert (tmp_path / "logs" / "alpaca.log").read_text().strip().splitlines()[-1].startswith(cause)
    assert f"logs/alpaca.log: {cause}" in r.stderr, r.stderr[-3000:]
    assert time.monotonic() - t0 < 60


def _alpaca_rule(tmp_path, path_dirs, python_path=()):
    """Run the quick `alpaca` rule of the tiny config with PATH = `path_dirs` and the system's /usr/bin:/bin."""
    path = os.pathsep.join([*map(str, path_dirs), "/usr/bin", "/bin"])
    env = {**os.environ, "PATH": path, "PYTHONPATH": os.pathsep.join([*map(str, python_path), str(REPO)])}
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "data/alpaca/alpaca.jsonl",
        "-s",
        str(REPO / "Snakefile"),
        "--cores",
        "1",
        "--configfile",
        str(REPO / "config" / "tiny.yaml"),
    ]
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


# a stage killed from outside (the OOM killer, say) after a line of progress: its log says nothing of an error
KILLED = """
import os, signal, sys
if sys.argv[1:2] == ["alpaca"]:
    print("alpaca: reading 3 records", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


SNAKEMAKE_LOG = """Error in rule tokenizer:
    jobid: 3
    log: logs/tokenizer.log (check log file(s) for error details)
Error in rule tokenizer:
    log: logs/tokenizer.log (check log file(s) for error details)
Error in rule both:
    log: logs/empty.log, logs/missing.log (check log file(s) for error details)
"""


def test_failure_causes_are_the_failed_jobs_logs_each_once(tmp_path, monkeypatch):
    from nanoeuler.data.common import failure_causes

    monkeypatch.chdir(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "tokenizer.log").write_text("merges 1/10\n/bin/bash: line 1: nanoeuler: command not found\n\n")
    (tmp_path / "logs" / "empty.log").write_text("")
    (tmp_path / "logs" / "corpus.log").write_text("a job that ran fine, whatever error its text mentions\n")
    (tmp_path / "snakemake.log").write_text(SNAKEMAKE_LOG)
    assert failure_causes([str(tmp_path / "snakemake.log")]) == [
        "logs/tokenizer.log: /bin/bash: line 1: nanoeuler: command not found",
        "logs/empty.log: (empty)",
        "logs/missing.log: (cannot be read: No such file or directory)",
    ]


@pytest.mark.slow
def test_a_failed_rule_shows_its_logs_last_line_whatever_it_says(tmp_path):
    """A log whose last line has no "error" in it (`nanoeuler: command not found`, a killed stage's progress)
    was not shown: Snakemake's error ended with no cause."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(KILLED)
    r = _alpaca_rule(tmp_path, [], python_path=[site])
    assert r.returncode != 0
    assert r.stderr.rstrip().splitlines().count("logs/alpaca.log: alpaca: reading 3 records") == 1, r.stderr[-3000:]


@pytest.mark.slow
def test_the_venvs_snakemake_runs_the_rules_without_the_venv_on_path(tmp_path):
    """`.venv/bin/snakemake` run without activating the venv failed every rule with exit 127."""
    assert shutil.which("nanoeuler", path="/usr/bin:/bin") is None
    r = _alpaca_rule(tmp_path, [])
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "data" / "alpaca" / "alpaca.jsonl").stat().st_size > 0


def test_the_tiny_configs_chat_prompts_fit_its_context():
    """With a 128-token context every demo chat prompt was left-truncated, with a notice each turn."""
    import pyarrow.parquet as pq

    from nanoeuler.config import load_config
    from nanoeuler.data.template import render_prompt
    from nanoeuler.tokenizer.bpe import train_bpe

    cfg = load_config(REPO / "config" / "tiny.yaml")
    sample = REPO / "data" / "sample"
    text = "\n\n".join(
        [p.read_text(encoding="utf-8") for p in sorted((sample / "gutenberg").glob("*.txt"))]
        + pq.read_table(sample / "fineweb" / "sample_000.parquet").column("text").to_pylist()
    )
    tok = train_bpe(text, cfg["tokenizer"]["vocab_size"])
    ctx = cfg["model"]["ctx_len"]
    room = min(cfg["eval"]["max_new_tokens"], ctx // 4)  # what chat and sample keep free for the answer
    for prompt in cfg["eval"]["chat_prompts"]:
        assert len(tok.encode(render_prompt(prompt))) <= ctx - room, prompt


# ---- nothing removed that a stage did not make ------------------------------------------------------


def test_export_hf_never_replaces_a_folder_that_holds_other_things(tmp_path, model_file, capsys, monkeypatch):
    """`export-hf --out results` deleted all of results/ (models, run directories) and exited 0."""
    from nanoeuler.cli import main

    results = tmp_path / "results"
    (results / "pretrain").mkdir(parents=True)
    (results / "pretrain" / "ckpt_00000010.bin").write_bytes(b"run")
    (results / "base.bin").write_bytes(b"model")
    before = sorted(p.relative_to(tmp_path) for p in results.rglob("*"))
    assert main(["export-hf", "--ckpt", str(model_file), "--out", str(results)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanoeuler export-hf: error: --out ") and "holds other files (base.bin, pretrain)" in err
    monkeypatch.chdir(results)  # `--out .` was a ValueError traceback
    assert main(["export-hf", "--ckpt", str(model_file), "--out", "."]) == 1
    assert "holds other files" in capsys.readouterr().err
    assert sorted(p.relative_to(tmp_path) for p in results.rglob("*")) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results"]  # no temporary folder left beside it

    hf = tmp_path / "hf"
    for _ in range(2):  # a new folder, then the previous export, which is replaced file by file
        assert main(["export-hf", "--ckpt", str(model_file), "--out", str(hf)]) == 0
    assert sorted(p.name for p in hf.iterdir()) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "results"]


def test_setting_a_run_aside_keeps_what_the_run_did_not_put_in_previous(tmp_path):
    """previous/ was removed whole, with whatever the user kept there."""
    from nanoeuler.train import rundir

    prev = tmp_path / "previous"
    (prev / "notes").mkdir(parents=True)
    (prev / "notes" / "plan.txt").write_text("mine")
    (prev / "ckpt_00000001.bin").write_bytes(b"older run")
    (tmp_path / "ckpt_00000005.bin").write_bytes(b"old run")
    (tmp_path / "metrics.jsonl").write_text('{"step": 5}\n')
    rundir.set_aside_all(tmp_path)
    assert sorted(p.name for p in prev.iterdir()) == ["ckpt_00000005.bin", "metrics.jsonl", "notes"]
    assert (prev / "notes" / "plan.txt").read_text() == "mine"


def test_tokenize_removes_only_the_shards_its_old_manifest_lists(tmp_path):
    """Every file named like a shard next to the manifest was deleted, the user's too."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from nanoeuler.tokenizer.shards import tokenize_corpus
    from train_fixtures import make_tokenizer

    tok = make_tokenizer()
    corpus = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": ["the sea was calm " * 30] * 4}), corpus)
    out = tmp_path / "shards" / "manifest.json"
    tokenize_corpus(tok, {"train": corpus, "val": corpus}, out, shard_tokens=100)
    first = sorted(p.name for p in out.parent.glob("train_*.npy"))
    assert len(first) > 1
    (out.parent / "train_0099.npy").write_bytes(b"the user's")
    tokenize_corpus(tok, {"train": corpus, "val": corpus}, out, shard_tokens=10_000)  # fewer shards now
    assert sorted(p.name for p in out.parent.glob("train_*.npy")) == ["train_0000.npy", "train_0099.npy"]


# ---- one JSON parser: every reader says the same about the same bad text ---------------------------------

BAD_JSON = {"a lone surrogate": '"\\ud800"', "nested 100,000 deep": "[" * 100_000 + "]" * 100_000}


def _read_alpaca_raw(path):
    from nanoeuler.data.alpaca import load_records

    return load_records(path)


def _read_prefs(fmt):
    def read(path):
        from nanoeuler.data.prefs import read_raw

        return read_raw(path, fmt)

    return read


def _read_hellaswag(path):
    from nanoeuler.data.hellaswag import read_items

    return read_items(path)


def _read_pairs(path):
    from nanoeuler.train.pairs import read_pairs

    return read_pairs(path)


def _read_sft(path):
    from nanoeuler.train.sft import read_records

    return read_records(path)


def _read_tokenizer(path):
    from nanoeuler.tokenizer.bpe import Tokenizer

    return Tokenizer.load(path)


def _read_manifest(path):
    from nanoeuler.train.loader import read_manifest

    return read_manifest(path)


# reader -> (what reads it, the file's text around the bad value V)
JSON_READERS = {
    "alpaca (raw JSON)": (_read_alpaca_raw, '[{"instruction": V, "input": "", "output": "x"}]'),
    "prefs (LLaMA-Factory JSON)": (_read_prefs("sharegpt"), '[{"conversations": V}]'),
    "prefs (HH JSON lines)": (_read_prefs("hh"), '{"chosen": V, "rejected": "x"}\n'),
    "hellaswag, hellaswag-eval": (_read_hellaswag, '{"ctx": V, "endings": ["a", "b", "c", "d"], "label": 0}\n'),
    "ref-logps, dpo (pairs)": (_read_pairs, '{"prompt": V, "chosen": "a", "rejected": "b"}\n'),
    "sft (Alpaca JSON lines)": (_read_sft, '{"instruction": V, "input": "", "output": "x"}\n'),
    "tokenizer.json": (_read_tokenizer, '{"format": V}'),
    "shard manifest": (_read_manifest, '{"splits": V}'),
}


@pytest.mark.parametrize("bad", BAD_JSON)
@pytest.mark.parametrize("reader", JSON_READERS)
def test_every_json_reader_refuses_the_same_bad_json_in_one_line(tmp_path, reader, bad):
    """A lone surrogate was a UnicodeEncodeError traceback (alpaca, prefs, hellaswag, ref-logps); deep
    nesting a RecursionError (prefs, hellaswag)."""
    read, text = JSON_READERS[reader]
    path = tmp_path / "input.json"
    path.write_text(text.replace("V", BAD_JSON[bad]), encoding="utf-8")
    with pytest.raises(UserError) as exc:
        read(path)
    message = str(exc.value)
    assert str(path) in message and "\n" not in message
    assert ("lone surrogate U+D800" if bad == "a lone surrogate" else "nested too deeply") in message


# ---- errors that name the file ------------------------------------------------------------------------


def test_a_full_disk_names_the_file(tmp_path):
    """A full disk said "20000 requested and 10176 written" (tokenize) or "No space left on device" (a
    checkpoint) without a path. A file-size limit makes the writes fail the same way."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from train_fixtures import make_tokenizer

    make_tokenizer().save(tmp_path / "tok.json")
    pq.write_table(pa.table({"text": ["the sea was calm and the sky was blue " * 400] * 20}), tmp_path / "c.parquet")
    script = f"""
import resource, signal, sys
import numpy as np
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
resource.setrlimit(resource.RLIMIT_FSIZE, (16384, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
from nanoeuler import checkpoint, cli
try:
    checkpoint.save({str(tmp_path / "ckpt.bin")!r}, {{"w": np.zeros(100_000, np.float32)}}, {{}})
except OSError as exc:
    print("checkpoint:", cli.os_error(exc), file=sys.stderr)
sys.exit(cli.main(["tokenize", "--tokenizer", {str(tmp_path / "tok.json")!r},
                   "--train", {str(tmp_path / "c.parquet")!r}, "--val", {str(tmp_path / "c.parquet")!r},
                   "--out", {str(tmp_path / "shards" / "m.json")!r}]))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 1, r.stderr[-2000:]
    assert f"checkpoint: {tmp_path / 'ckpt.bin'}: File too large" in lines
    assert lines[-1].startswith(f"nanoeuler tokenize: error: {tmp_path / 'shards'}/"), lines[-1]
    assert "train_0000.npy" in lines[-1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.parquet", "shards", "tok.json"]
    assert list((tmp_path / "shards").iterdir()) == []


def test_a_truncated_reference_file_is_one_line(tmp_path):
    """A cut ref_logps.npz was a BadZipFile traceback."""
    from nanoeuler.train.reflogps import load_reference

    path = tmp_path / "ref_logps.npz"
    with open(path, "wb") as f:
        np.savez(f, logps=np.zeros((4, 2)), meta=np.array("{}"))
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(UserError, match=f"reference log-probs {path} are unreadable .*re-run"):
        load_reference(path, {"pairs": 4})


@pytest.mark.parametrize(
    "metrics, complaint",
    [
        ([1, 2], "must hold a JSON object"),
        ({"base": {"val_loss": 3.0, "params": "many"}}, "key 'base.params' must be a number"),
        ({"base": {"val_loss": 3.0}, "hellaswag": [1]}, "key 'hellaswag' must map each model"),
        ({"hellaswag": {"base": {"acc": 0.3}}}, "key 'hellaswag.base.items' must be a number"),
    ],
)
def test_a_metrics_file_of_the_wrong_shape_is_named(tmp_path, capsys, monkeypatch, metrics, complaint):
    """compare and report-pages ended in AttributeError, TypeError or ValueError tracebacks."""
    from nanoeuler.cli import main

    monkeypatch.chdir(tmp_path)
    path = Path("results") / "exp" / "metrics.json"
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(metrics))
    Path("samples.md").write_text("# s\n")
    assert main(["compare", "exp", "--table", "t.md", "--plot", "p.png"]) == 1
    assert (
        main(
            [
                "report-pages",
                "--metrics",
                str(path),
                "--samples",
                "samples.md",
                "--run-config",
                "{}",
                "--out-dir",
                "pages",
            ]
        )
        == 1
    )
    lines = capsys.readouterr().err.strip().splitlines()
    assert [line.split(": error: ")[0] for line in lines] == ["nanoeuler compare", "nanoeuler report-pages"]
    assert all(str(path) in line and complaint in line for line in lines), lines
    assert sorted(os.listdir()) == ["results", "samples.md"]


def test_samples_that_are_not_utf8_are_named(tmp_path, capsys):
    from nanoeuler.cli import main

    (tmp_path / "m.json").write_text("{}")
    (tmp_path / "s.md").write_bytes(b"caf\xe9\n")
    assert (
        main(
            [
                "report-pages",
                "--metrics",
                str(tmp_path / "m.json"),
                "--samples",
                str(tmp_path / "s.md"),
                "--run-config",
                "{}",
                "--out-dir",
                str(tmp_path / "pages"),
            ]
        )
        == 1
    )
    assert capsys.readouterr().err.strip() == (
        f"nanoeuler report-pages: error: samples file {tmp_path / 's.md'} "
        "is not UTF-8 text (invalid continuation byte at byte 3)"
    )


def test_compare_plot_is_written_as_named_and_leaves_no_temporary(tmp_path, capsys, monkeypatch):
    """--plot DIR left `.<name>.tmp.png` behind; --plot x.pdf held PNG bytes."""
    from nanoeuler.cli import main

    monkeypatch.chdir(tmp_path)
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "metrics.json").write_text(json.dumps({"base": {"val_loss": 3.0}}))
    (tmp_path / "plots").mkdir()
    assert main(["compare", "", "--table", "t.md", "--plot", "plots"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "nanoeuler compare: error: --plot plots is a directory; name a file to write"
    assert sorted(os.listdir()) == ["plots", "results"] and os.listdir("plots") == []
    assert main(["compare", "", "--table", "t.md", "--plot", "plots/x.pdf"]) == 0
    assert (tmp_path / "plots" / "x.pdf").read_bytes().startswith(b"%PDF")
    assert main(["compare", "", "--table", "t.md", "--plot", "plots/x.nope"]) == 1
    assert "cannot write a .nope image" in capsys.readouterr().err
    assert os.listdir("plots") == ["x.pdf"]


def test_an_experiment_named_like_a_file_of_the_run_is_refused():
    """`experiment: base.bin` passed the name check and ended in a NotADirectoryError traceback."""
    from nanoeuler.eval.compare import experiment_dirs

    for name in ("base.bin", "metrics.json", "tokenizer.json"):
        with pytest.raises(UserError, match=f"'{name}' is a file of the run itself"):
            experiment_dirs(name)
