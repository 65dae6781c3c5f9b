"""The whole tiny DAG through Snakemake, offline: raw sample data to chat.bin and the evaluation outputs;
then the Snakemake report of the run holds its parts; then nothing is left to do; then changing only an
SFT key re-runs exactly SFT and evaluation.

Snakemake runs in a temporary working directory (-d), with the repository's Snakefile.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
import yaml

from nanoeuler import checkpoint
from nanoeuler.config import REPO_ROOT
from workflow_helpers import planned_jobs, snakemake

TARGETS = [
    "results/chat.bin",
    "results/samples.md",
    "results/metrics.json",
    "results/loss.png",
    "results/report/metrics.html",
]
REPORT_PARTS = [
    "Loss curves",
    "loss.png",
    "Metrics",
    "metrics.html",
    "HellaSwag",
    "hellaswag.html",
    "Samples",
    "samples.html",
    "Config",
    "config.html",
    "scored completion-style as llm.c does",
]


def _ink(region):
    """The share of a region's pixels that differ from its dominant colour: 0 for a blank region,
    whatever the theme (the menu is dark once the page's styles have run, light before)."""
    pixels = region.reshape(-1, 3)
    return (abs(pixels - np.median(pixels, axis=0)) > 0.1).any(axis=1).mean()


def _check_rendering(html, png):
    """Headless Chromium (where installed) draws the report: the menu (left 240 px) and the page beside it
    both carry text, not a blank page. On a busy machine the scripts may not have run within the first
    time budget: one retry with more."""
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        return
    import matplotlib.image

    for budget_ms in (5000, 30000):
        subprocess.run(
            [
                browser,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--window-size=1200,800",
                f"--virtual-time-budget={budget_ms}",
                f"--screenshot={png}",
                html.as_uri(),
            ],
            capture_output=True,
            timeout=180,
            check=True,
        )
        pixels = matplotlib.image.imread(png)[..., :3]
        menu, page = _ink(pixels[:, :240]), _ink(pixels[:, 240:])
        if menu > 0.02 and page > 0.01:
            break
    assert menu > 0.02 and page > 0.01, f"the report renders blank (ink: menu {menu:.3f}, page {page:.3f})"


@pytest.mark.slow
def test_tiny_dag_end_to_end(tmp_path):
    tiny = REPO_ROOT / "config" / "tiny.yaml"
    snakemake(tmp_path, tiny, TARGETS)
    for target in TARGETS:
        assert (tmp_path / target).stat().st_size > 0, target
    for rule in ("pretrain", "sft", "evaluate"):
        assert (tmp_path / "logs" / f"{rule}.log").exists()
    metrics = json.loads((tmp_path / "results/metrics.json").read_text())
    assert metrics["base"]["val_bpb"] > 0 and metrics["chat"]["val_bpb"] > 0
    pre = [json.loads(line) for line in open(tmp_path / "results/pretrain/metrics.jsonl")]
    train = [r["loss"] for r in pre if "loss" in r]
    assert train[-1] < train[0] - 1.0, "pretraining did not learn"
    assert "loss.png" in (tmp_path / "results/samples.md").read_text()
    hellaswag = metrics["hellaswag"]
    assert set(hellaswag) == {"base", "chat"} and hellaswag["chat"]["items"] == 8
    assert all(0 <= s["acc"] <= 1 and 0 <= s["acc_norm"] <= 1 for s in hellaswag.values())
    assert "## HellaSwag" in (tmp_path / "results/samples.md").read_text()

    snakemake(tmp_path, tiny, TARGETS, "--report", str(tmp_path / "report.html"))
    report = (tmp_path / "report.html").read_text()
    missing = [part for part in REPORT_PARTS if part not in report]
    assert not missing, missing
    _check_rendering(tmp_path / "report.html", tmp_path / "report.png")
    _, _, meta = checkpoint.load_model(tmp_path / "results/chat.bin")
    assert meta["tokenizer"] and meta["stage"] == "sft"

    assert planned_jobs(snakemake(tmp_path, tiny, TARGETS, "-n")) == {}

    cfg = yaml.safe_load(tiny.read_text())
    cfg["sft"]["lr"] = cfg["sft"]["lr"] / 2
    changed = tmp_path / "changed.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    assert planned_jobs(snakemake(tmp_path, changed, TARGETS, "-n")) == {
        "sft": 1,
        "hellaswag_eval": 1,
        "evaluate": 1,
        "report_pages": 1,
    }
    before = (tmp_path / "results/base.bin").stat().st_mtime_ns
    snakemake(tmp_path, changed, TARGETS)
    assert (tmp_path / "results/base.bin").stat().st_mtime_ns == before
    assert "other settings" in (tmp_path / "logs/sft.log").read_text()  # a fresh SFT run, not a resume
    assert planned_jobs(snakemake(tmp_path, changed, TARGETS, "-n")) == {}
