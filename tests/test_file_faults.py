"""Every file a stage reads, given something that is not that file: one error line, quickly, in bounded memory.

The table is OPTIONS x FAULTS. Each option names one input of one stage; every other input of the command
is valid, so the stage gets as far as reading the faulty one. Each fault replaces that input with a
directory, a missing file, a symlink loop, a 2 GB sparse file (must be refused or read in part, never
whole), /dev/zero (never ends), a FIFO with no writer (must not wait) or bytes of the wrong format.

All cases run in one child process (startup paid once) under a 2 GB address-space limit (about 1.1 GB
of it is taken by the imports) and a per-case alarm, so an unbounded read ends as a MemoryError and a
wait on a FIFO as a hang: both fail their case.
The child calls `nanoeuler.cli.main` as the command line would and reports exit status, stderr and time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from train_fixtures import make_tokenizer, save_random_model, write_alpaca, write_config, write_shards

X = "{X}"  # where the faulty path goes in a command line

# option -> the command line with X for the faulty file; {name} are the valid inputs built below,
# {out} a folder that must stay empty (no partial output)
OPTIONS = {
    "--config (any stage)": ["sample", "--config", X, "--ckpt", "{base}"],
    "tokenizer --corpus": ["tokenizer", "--config", "{config}", "--corpus", X, "--out", "{out}/tok.json"],
    "tokenize --tokenizer": [
        "tokenize",
        "--config",
        "{config}",
        "--tokenizer",
        X,
        "--train",
        "{corpus}",
        "--val",
        "{corpus}",
        "--out",
        "{out}/manifest.json",
    ],
    "tokenize --train": [
        "tokenize",
        "--config",
        "{config}",
        "--tokenizer",
        "{tokenizer}",
        "--train",
        X,
        "--val",
        "{corpus}",
        "--out",
        "{out}/manifest.json",
    ],
    "pretrain --tokenizer": [
        "pretrain",
        "--config",
        "{config}",
        "--shards",
        "{manifest}",
        "--tokenizer",
        X,
        "--out",
        "{out}/base.bin",
    ],
    "pretrain --shards": [
        "pretrain",
        "--config",
        "{config}",
        "--shards",
        X,
        "--tokenizer",
        "{tokenizer}",
        "--out",
        "{out}/base.bin",
    ],
    "sft --base": ["sft", "--config", "{config}", "--base", X, "--data", "{alpaca}", "--out", "{out}/chat.bin"],
    "sft --data": ["sft", "--config", "{config}", "--base", "{base}", "--data", X, "--out", "{out}/chat.bin"],
    "hellaswag-eval --ckpt": [
        "hellaswag-eval",
        "--config",
        "{config}",
        "--ckpt",
        X,
        "--data",
        "{hellaswag}",
        "--name",
        "base",
        "--out",
        "{out}/hs.json",
    ],
    "hellaswag-eval --data": [
        "hellaswag-eval",
        "--config",
        "{config}",
        "--ckpt",
        "{base}",
        "--data",
        X,
        "--name",
        "base",
        "--out",
        "{out}/hs.json",
    ],
    "ref-logps --ckpt": [
        "ref-logps",
        "--config",
        "{config}",
        "--ckpt",
        X,
        "--prefs",
        "{prefs}",
        "--out",
        "{out}/ref.npz",
        "--no-progress",
    ],
    "ref-logps --prefs": [
        "ref-logps",
        "--config",
        "{config}",
        "--ckpt",
        "{base}",
        "--prefs",
        X,
        "--out",
        "{out}/ref.npz",
        "--no-progress",
    ],
    "dpo --ref": [
        "dpo",
        "--config",
        "{config}",
        "--ckpt",
        "{base}",
        "--prefs",
        "{prefs}",
        "--ref",
        X,
        "--out",
        "{out}/dpo.bin",
        "--no-progress",
    ],
    "evaluate --hellaswag": [
        "evaluate",
        "--config",
        "{config}",
        "--base",
        "{base}",
        "--chat",
        "{base}",
        "--shards",
        "{manifest}",
        "--samples",
        "{out}/samples.md",
        "--metrics",
        "{out}/metrics.json",
        "--plot",
        "{out}/loss.png",
        "--hellaswag",
        X,
    ],
    "report-pages --metrics": [
        "report-pages",
        "--metrics",
        X,
        "--samples",
        "{samples}",
        "--run-config",
        "{{}}",
        "--out-dir",
        "{out}",
    ],
    "report-pages --samples": [
        "report-pages",
        "--metrics",
        "{metrics}",
        "--samples",
        X,
        "--run-config",
        "{{}}",
        "--out-dir",
        "{out}",
    ],
    "sample --ckpt": ["sample", "--config", "{config}", "--ckpt", X, "--prompt", "The sea"],
    "export-hf --ckpt": ["export-hf", "--ckpt", X, "--out", "{out}/hf"],
    "alpaca (a local url)": [
        "alpaca",
        "--params",
        '{{"alpaca": {{"url": "X_URL", "sha256": null}}}}',
        "--out",
        "{out}/alpaca.jsonl",
        "--raw-dir",
        "{raw}",
    ],
}

FAULTS = ["directory", "missing", "symlink loop", "sparse 2 GB", "/dev/zero", "FIFO", "wrong format"]


def make_fault(kind: str, folder: Path) -> str:
    """A path of the given fault kind inside `folder` (or a device outside it)."""
    path = folder / kind.replace(" ", "_").replace("/", "_")
    if kind == "directory":
        path.mkdir()
    elif kind == "symlink loop":
        path.symlink_to(path.name)
    elif kind == "sparse 2 GB":
        with open(path, "wb") as f:
            f.truncate(2 << 30)
    elif kind == "/dev/zero":
        return "/dev/zero"
    elif kind == "FIFO":
        os.mkfifo(path)
    elif kind == "wrong format":
        path.write_bytes(bytes(range(256)) * 16)
    return str(path)


def valid_inputs(d: Path) -> dict[str, str]:
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = make_tokenizer()
    tok.save(d / "tokenizer.json")
    save_random_model(d / "base.bin", tok)
    pq.write_table(pa.table({"text": ["The sea was calm.", "It was the best of times."] * 4}), d / "corpus.parquet")
    pair = {"prompt": "Name a color.", "chosen": "Blue.", "rejected": "Seven."}
    (d / "prefs.jsonl").write_text("".join(json.dumps(pair) + "\n" for _ in range(4)))
    item = {"ctx": "The sea", "endings": ["was calm.", "is blue.", "ran.", "sat."], "label": 0}
    (d / "hellaswag.jsonl").write_text(json.dumps(item) + "\n")
    (d / "metrics.json").write_text(json.dumps({"base": {"val_loss": 3.0, "steps": 1}}))
    (d / "samples.md").write_text("# Samples\n")
    np.save(d / "unused.npy", np.zeros(1))
    return {
        "config": str(write_config(d / "config.yaml", eval={"max_new_tokens": 4})),
        "tokenizer": str(d / "tokenizer.json"),
        "base": str(d / "base.bin"),
        "corpus": str(d / "corpus.parquet"),
        "manifest": str(write_shards(d / "shards", tok)),
        "alpaca": str(write_alpaca(d / "alpaca.jsonl")),
        "prefs": str(d / "prefs.jsonl"),
        "hellaswag": str(d / "hellaswag.jsonl"),
        "metrics": str(d / "metrics.json"),
        "samples": str(d / "samples.md"),
    }


# Runs in the child: each case through the real command-line entry point, one JSON result per case.
DRIVER = textwrap.dedent("""
    import contextlib, io, json, resource, signal, sys, time, traceback
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from nanoeuler import cli

    class Hang(BaseException):  # not caught by a stage's `except Exception`
        pass

    def alarm(*_):
        raise Hang("no answer within 15 s")

    signal.signal(signal.SIGALRM, alarm)
    results = {}
    for key, argv in json.load(sys.stdin).items():
        err, start = io.StringIO(), time.monotonic()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                signal.alarm(15)
                try:
                    rc = cli.main(argv)
                finally:
                    signal.alarm(0)
        except SystemExit as exc:
            rc = exc.code
        except BaseException:
            rc, err = "traceback", io.StringIO(traceback.format_exc())
        results[key] = {"rc": rc, "stderr": err.getvalue(), "seconds": time.monotonic() - start}
    print(json.dumps(results))
""")


@pytest.fixture(scope="module")
def outcomes(request, tmp_path_factory):
    """{(option, fault): (result, faulty path, output folder)} for the selected cases, from one child."""
    selected = {
        (item.callspec.params["option"], item.callspec.params["fault"])
        for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    base = tmp_path_factory.mktemp("faults")
    inputs = valid_inputs(base)
    cases, where = {}, {}
    for i, (option, template) in enumerate(OPTIONS.items()):
        for j, fault in enumerate(FAULTS):
            if (option, fault) not in selected:
                continue
            case = base / f"case{i}_{j}"
            case.mkdir()
            bad = make_fault(fault, case)
            values = {**inputs, "out": str(case / "out"), "raw": str(case / "raw")}
            argv = [bad if a == X else a.format(**values).replace("X_URL", bad) for a in template]
            cases[f"{option}|{fault}"] = argv
            where[(option, fault)] = (bad, case / "out")
    import nanoeuler  # the child runs the code this test imported

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(nanoeuler.__file__).parents[1])] + sys.path),
        # one BLAS thread: each thread's buffers count against the address-space limit on a many-core host
        "OPENBLAS_NUM_THREADS": "1",
        "OMP_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [sys.executable, "-c", DRIVER],
        input=json.dumps(cases),
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
        cwd=base,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    return {key: (results[f"{key[0]}|{key[1]}"], *where[key]) for key in where}


@pytest.mark.parametrize("fault", FAULTS)
@pytest.mark.parametrize("option", OPTIONS)
def test_a_bad_file_is_one_line_naming_it(outcomes, option, fault):
    result, bad, out = outcomes[(option, fault)]
    stage = OPTIONS[option][0]
    lines = result["stderr"].strip().splitlines()
    assert result["rc"] == 1, result["stderr"][-2000:]
    assert "Traceback" not in result["stderr"], result["stderr"][-2000:]
    assert lines[-1].startswith(f"nanoeuler {stage}: error: "), lines[-1]
    assert bad in lines[-1], lines[-1]  # names the file
    assert result["seconds"] < 10, result
    assert not out.exists() or not any(out.iterdir()), sorted(out.iterdir())  # no partial output
