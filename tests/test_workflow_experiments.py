"""Experiments through Snakemake: an `experiment` config namespaces results/ and logs/ and shares data/; a config
with compare.experiments builds the comparison of finished experiments (faked here: no training)."""

from __future__ import annotations

import json

from nanoeuler.config import REPO_ROOT
from test_compare import _fake_run
from workflow_helpers import snakemake

TINY = REPO_ROOT / "config" / "tiny.yaml"


def _outputs(dry_run: str) -> set[str]:
    return {
        path
        for line in dry_run.splitlines()
        if line.strip().startswith("output:")
        for path in line.split(":", 1)[1].replace(",", " ").split()
    }


def test_experiment_namespaces_results_and_logs(tmp_path):
    low = REPO_ROOT / "config" / "exp-lr-low.yaml"
    outputs = _outputs(snakemake(tmp_path, TINY, [], "-n", configfiles=[low]))
    assert {
        "results/lr-low/base.bin",
        "results/lr-low/hellaswag/chat.json",
        "results/lr-low/metrics.json",
        "results/lr-low/report/metrics.html",
        "data/corpus/train.parquet",
    } <= outputs
    assert not [p for p in outputs if p.startswith("results/") and not p.startswith("results/lr-low/")]
    log = snakemake(tmp_path, TINY, ["results/lr-low/base.bin"], "-n", "-p", configfiles=[low])
    assert "--run-dir results/lr-low/pretrain" in log and "logs/lr-low/pretrain.log" in log
    assert '"lr":0.001' in log and '"steps":600' in log  # the experiment's key over the tiny config's


def test_compare_rule_builds_table_and_plot(tmp_path):
    _fake_run(tmp_path / "results" / "lr-low", 3.25, 0.25)
    _fake_run(tmp_path / "results" / "lr-high", 2.75, 0.5)
    high = REPO_ROOT / "config" / "exp-lr-high.yaml"
    targets = ["results/lr-high/compare/metrics.html", "results/lr-high/compare/loss.png"]
    snakemake(tmp_path, TINY, targets, "--allowed-rules", "compare", configfiles=[high])
    table = (tmp_path / targets[0]).read_text()
    assert "<td>lr-low</td>" in table and "<td>lr-high</td>" in table and "<td>0.5000</td>" in table
    assert (tmp_path / targets[1]).stat().st_size > 10000
    assert (tmp_path / "logs/lr-high/compare.log").exists()
    assert json.loads((tmp_path / "results/lr-low/metrics.json").read_text())["base"]["val_loss"] == 3.25
