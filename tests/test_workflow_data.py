"""The tiny config's data targets through Snakemake: a full run, nothing left to do, and a re-run of exactly
the Alpaca rule after only an Alpaca parameter changes.

Snakemake runs in a temporary working directory (-d); the rules take the tiny config's relative sample
paths from the repository root (the Snakefile's directory), so nothing is copied.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from nanoeuler.config import REPO_ROOT

TARGETS = ["data/corpus/train.parquet", "data/corpus/val.parquet", "data/alpaca/alpaca.jsonl"]
BIN = Path(sys.executable).parent


def snakemake(workdir: Path, configfile: Path, *extra: str) -> str:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"}
    # targets first: --configfile takes every word that follows it
    cmd = [str(BIN / "snakemake"), *TARGETS, "-s", str(REPO_ROOT / "Snakefile"), "-d", str(workdir),
           "--cores", "2", *extra, "--configfile", str(configfile)]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    return out


def planned_jobs(out: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run: rule -> job count ({} when there is nothing to do)."""
    if "Nothing to be done" in out:
        return {}
    table = out.split("Job stats:", 1)[1]
    jobs = {}
    for line in table.splitlines()[3:]:
        m = re.match(r"^(\S+)\s+(\d+)$", line.strip())
        if not m or m.group(1) == "total":
            break
        jobs[m.group(1)] = int(m.group(2))
    return jobs


@pytest.mark.slow
def test_tiny_data_targets(tmp_path):
    tiny = REPO_ROOT / "config" / "tiny.yaml"
    out = snakemake(tmp_path, tiny)
    for target in TARGETS:
        assert (tmp_path / target).stat().st_size > 0, target
    for rule in ("gutenberg", "fineweb", "alpaca", "corpus"):
        assert (tmp_path / "logs" / f"{rule}.log").exists(), out
    assert "DuckDB query" in (tmp_path / "logs" / "fineweb.log").read_text()
    train = pq.read_table(tmp_path / "data/corpus/train.parquet")
    assert set(train.column("source").to_pylist()) == {"gutenberg", "fineweb"}
    assert pq.read_table(tmp_path / "data/corpus/val.parquet").num_rows > 0

    assert planned_jobs(snakemake(tmp_path, tiny, "-n")) == {}

    cfg = yaml.safe_load(tiny.read_text())
    cfg["alpaca"]["max_records"] = 50
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert planned_jobs(snakemake(tmp_path, changed, "-n")) == {"alpaca": 1}

    snakemake(tmp_path, changed)
    assert len((tmp_path / "data/alpaca/alpaca.jsonl").read_text().splitlines()) == 50
    assert planned_jobs(snakemake(tmp_path, changed, "-n")) == {}
