"""Experiments: the `experiment` key's directories, `nanoeuler compare` across experiments, and the report pages."""

from __future__ import annotations

import json

import pytest

from nanoeuler.cli import main
from nanoeuler.errors import UserError
from nanoeuler.eval.compare import experiment_dirs
from nanoeuler.eval.pages import markdown_to_html


def test_experiment_dirs():
    assert experiment_dirs("") == ("results", "logs")
    assert experiment_dirs("lr.3e-3_b-16") == ("results/lr.3e-3_b-16", "logs/lr.3e-3_b-16")
    with pytest.raises(UserError, match=r"config key 'experiment': '\.\./x' may hold only letters"):
        experiment_dirs("../x")
    with pytest.raises(UserError, match=r"'shards' is a directory of the run itself"):
        experiment_dirs("shards")


def _fake_run(results, val_loss, acc):
    """metrics.json and the pretraining/SFT metrics.jsonl of a finished run."""
    model = {"val_loss": val_loss, "val_ce": val_loss - 0.1, "val_bpb": 2.5, "params": 188480, "steps": 600}
    metrics = {
        "definitions": {"val_loss": "..."},
        "base": model,
        "chat": {**model, "val_loss": val_loss + 0.5},
        "hellaswag": {"base": {"items": 8, "acc": acc, "acc_norm": acc / 2, "correct": 2, "correct_norm": 1}},
    }
    (results / "pretrain").mkdir(parents=True)
    (results / "sft").mkdir()
    (results / "metrics.json").write_text(json.dumps(metrics))
    for sub, n in (("pretrain", 5), ("sft", 3)):
        lines = [{"step": 10 * i, "loss": val_loss + 1 / (i + 1)} for i in range(n)]
        lines += [{"step": 10 * i, "val_loss": val_loss + 1.2 / (i + 1)} for i in range(n)]
        (results / sub / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))


def test_compare_writes_one_table_and_one_plot(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "results" / "small-lr", 3.25, 0.25)
    _fake_run(tmp_path / "results" / "big-lr", 2.75, 0.375)
    assert main(["compare", "small-lr", "big-lr", "--table", "c/t.md", "--plot", "c/loss.png"]) == 0
    table = (tmp_path / "c/t.md").read_text().splitlines()
    assert table[0].startswith("| experiment | model | params | steps | val loss")
    assert "| small-lr | base | 188,480 | 600 | 3.2500 | 3.1500 | 2.5000 | 0.2500 | 0.1250 |" in table
    assert "| big-lr | chat | 188,480 | 600 | 3.2500 | 2.6500 | 2.5000 | – | – |" in table
    assert (tmp_path / "c/loss.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["compare", "small-lr", "big-lr", "--table", "c/t.html", "--plot", "c/loss.png"]) == 0
    page = (tmp_path / "c/t.html").read_text()
    assert page.count("<tr>") == 5 and "<td>big-lr</td>" in page


def test_compare_names_a_missing_experiment(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _fake_run(tmp_path / "results" / "a", 3.0, 0.25)
    assert main(["compare", "a", "b", "--table", "t.md", "--plot", "p.png"]) == 1
    assert "experiment 'b' has no results/b/metrics.json: run its pipeline first" in capsys.readouterr().err
    assert not (tmp_path / "t.md").exists() and not (tmp_path / "p.png").exists()


def test_report_pages(tmp_path):
    _fake_run(tmp_path / "results", 3.0, 0.25)
    samples = tmp_path / "samples.md"
    samples.write_text(
        "# nanoeuler samples\n\n| a | b |\n|---|---:|\n| 1 | <2> |\n\n**Prompt:** `It was`\n\n"
        "```text\nIt was <dark>\n```\n\n![loss curves](loss.png)\n"
    )
    assert (
        main(
            [
                "report-pages",
                "--metrics",
                str(tmp_path / "results/metrics.json"),
                "--samples",
                str(samples),
                "--run-config",
                json.dumps({"experiment": "x", "eval": {"seed": 1}}),
                "--out-dir",
                str(tmp_path / "pages"),
            ]
        )
        == 0
    )
    pages = {p.name: p.read_text() for p in (tmp_path / "pages").iterdir()}
    assert set(pages) == {"metrics.html", "hellaswag.html", "samples.html", "config.html"}
    assert "<td>base</td><td>188,480</td><td>600</td><td>3.0000</td>" in pages["metrics.html"]
    assert "<td>base</td><td>8</td><td>0.2500 (2)</td><td>0.1250 (1)</td>" in pages["hellaswag.html"]
    assert "<pre>It was &lt;dark&gt;</pre>" in pages["samples.html"] and "<td>&lt;2&gt;</td>" in pages["samples.html"]
    assert "loss.png" not in pages["samples.html"]
    assert "experiment: x" in pages["config.html"]


def test_markdown_to_html():
    assert markdown_to_html("## Hi\n\n**a** `b`") == "<h3>Hi</h3>\n<p><b>a</b> <code>b</code></p>"
