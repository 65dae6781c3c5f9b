"""The tiny config's data targets through Snakemake: a full run, nothing left to do, and a re-run of exactly
the Alpaca rule after only an Alpaca parameter changes.

Snakemake runs in a temporary working directory (-d); the rules take the tiny config's relative sample
paths from the repository root (the Snakefile's directory), so nothing is copied.
"""

from __future__ import annotations


import pyarrow.parquet as pq
import pytest
import yaml

from nanoeuler.config import REPO_ROOT
from workflow_helpers import planned_jobs, snakemake

TARGETS = ["data/corpus/train.parquet", "data/corpus/val.parquet", "data/alpaca/alpaca.jsonl"]


@pytest.mark.slow
def test_tiny_data_targets(tmp_path):
    tiny = REPO_ROOT / "config" / "tiny.yaml"
    out = snakemake(tmp_path, tiny, TARGETS)
    for target in TARGETS:
        assert (tmp_path / target).stat().st_size > 0, target
    for rule in ("gutenberg", "fineweb", "alpaca", "corpus"):
        assert (tmp_path / "logs" / f"{rule}.log").exists(), out
    assert "DuckDB query" in (tmp_path / "logs" / "fineweb.log").read_text()
    train = pq.read_table(tmp_path / "data/corpus/train.parquet")
    assert set(train.column("source").to_pylist()) == {"gutenberg", "fineweb"}
    assert pq.read_table(tmp_path / "data/corpus/val.parquet").num_rows > 0

    assert planned_jobs(snakemake(tmp_path, tiny, TARGETS, "-n")) == {}

    cfg = yaml.safe_load(tiny.read_text())
    cfg["alpaca"]["max_records"] = 50
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert planned_jobs(snakemake(tmp_path, changed, TARGETS, "-n")) == {"alpaca": 1}

    snakemake(tmp_path, changed, TARGETS)
    assert len((tmp_path / "data/alpaca/alpaca.jsonl").read_text().splitlines()) == 50
    assert planned_jobs(snakemake(tmp_path, changed, TARGETS, "-n")) == {}
