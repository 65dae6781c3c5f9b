"""`nanoeuler compare`: several experiments side by side, one metrics table and one loss-curve plot.

An experiment is a run with its own `experiment` name in the config; its outputs live in
`results/<name>/` and its logs in `logs/<name>/` (the unnamed run: `results/`, `logs/`), while the
downloads in `data/` are shared. After each experiment's run:

    nanoeuler compare small-lr large-lr --table compare.html --plot compare.png

reads `metrics.json` (evaluation) and `pretrain/metrics.jsonl`, `sft/metrics.jsonl` (training) of
each, and writes the table (HTML, or Markdown when the name ends in `.md`) and the plot: the loss of
pretraining and SFT against the step, one colour per experiment.
"""

from __future__ import annotations

import argparse
import html
import os
import re
import sys
from pathlib import Path

from nanoeuler.errors import UserError
from nanoeuler.files import check_outputs, read_json

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
# Directories and files of the unnamed run's results/; an experiment of the same name would mix with
# them (or, for a file, have no directory at all).
_TAKEN = {
    "shards",
    "pretrain",
    "sft",
    "dpo",
    "hellaswag",
    "report",
    "compare",
    "base.bin",
    "chat.bin",
    "dpo.bin",
    "tokenizer.json",
    "tokenizer.hf.json",
    "metrics.json",
    "samples.md",
    "loss.png",
    "ref_logps.npz",
}


def experiment_dirs(name: str) -> tuple[str, str]:
    """(results dir, logs dir) of an experiment, relative to the working directory.

    >>> experiment_dirs("lr-3e-3")
    ('results/lr-3e-3', 'logs/lr-3e-3')
    >>> experiment_dirs("")
    ('results', 'logs')
    """
    if name == "":
        return "results", "logs"
    if not _NAME.fullmatch(name) or name in _TAKEN:
        kind = "file" if "." in name else "directory"
        why = f"is a {kind} of the run itself" if name in _TAKEN else "may hold only letters, digits, '.', '_', '-'"
        raise UserError(f"config key 'experiment': {name!r} {why}")
    return f"results/{name}", f"logs/{name}"


# columns of the table: (heading, key in metrics.json's model entry or hellaswag entry, format)
COLUMNS = [
    ("params", "params", "{:,}"),
    ("steps", "steps", "{}"),
    ("val loss", "val_loss", "{:.4f}"),
    ("val CE", "val_ce", "{:.4f}"),
    ("val bits/byte", "val_bpb", "{:.4f}"),
    ("HellaSwag acc", "acc", "{:.4f}"),
    ("HellaSwag acc_norm", "acc_norm", "{:.4f}"),
]


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


HELLASWAG_KEYS = ("items", "acc", "acc_norm", "correct", "correct_norm")


def check_metrics(metrics, path) -> dict:
    """`metrics` (read from `path`) after checking the shape that the tables and pages read.

    {model: {"val_loss": number, ...}, "hellaswag": {model: {"acc": number, ...}}, "definitions": {...}};
    anything else is a UserError naming the key.

        >>> check_metrics({"base": {"val_loss": 3.2, "steps": "many"}}, "m.json")
        Traceback (most recent call last):
        nanoeuler.errors.UserError: m.json: key 'base.steps' must be a number, not str
    """
    if not isinstance(metrics, dict):
        raise UserError(f"{path} must hold a JSON object (metrics by model), not a JSON {type(metrics).__name__}")
    hellaswag, definitions = metrics.get("hellaswag", {}), metrics.get("definitions", {})
    if not isinstance(hellaswag, dict) or not all(isinstance(v, dict) for v in hellaswag.values()):
        raise UserError(f"{path}: key 'hellaswag' must map each model to an object of scores")
    if not isinstance(definitions, dict):
        raise UserError(f"{path}: key 'definitions' must be an object")
    for model, entry in metrics.items():
        if model in ("hellaswag", "definitions") or not isinstance(entry, dict):
            continue
        for _, key, _ in COLUMNS:
            if entry.get(key) is not None and not _number(entry[key]):
                raise UserError(f"{path}: key '{model}.{key}' must be a number, not {type(entry[key]).__name__}")
    for model, scores in hellaswag.items():
        for key in HELLASWAG_KEYS:
            if not _number(scores.get(key)):
                raise UserError(f"{path}: key 'hellaswag.{model}.{key}' must be a number")
    return metrics


def model_entries(metrics: dict) -> dict:
    """{model: its entry} of a metrics.json written by `evaluate`, HellaSwag scores merged in."""
    hellaswag = metrics.get("hellaswag", {})
    return {
        model: {**entry, **hellaswag.get(model, {})}
        for model, entry in metrics.items()
        if isinstance(entry, dict) and isinstance(entry.get("val_loss"), (int, float))
    }


def load_experiment(name: str) -> dict:
    """{"name", "models": {model: row of COLUMNS keys}, "runs": [(title, metrics records)]} of one experiment."""
    from nanoeuler.train.rundir import read_jsonl

    results = Path(experiment_dirs(name)[0])
    path = results / "metrics.json"
    if results.exists() and not results.is_dir():
        raise UserError(f"experiment {name!r}: {results} is a file, not the experiment's results directory")
    if not os.path.lexists(path):
        raise UserError(f"experiment {name!r} has no {path}: run its pipeline first")
    metrics = check_metrics(read_json(path, "metrics file"), path)
    runs = [
        ("pretraining", read_jsonl(results / "pretrain" / "metrics.jsonl")),
        ("SFT", read_jsonl(results / "sft" / "metrics.jsonl")),
    ]
    return {"name": name or "(default)", "models": model_entries(metrics), "runs": runs}


def table_rows(experiments: list[dict]) -> tuple[list[str], list[list[str]]]:
    """Header and rows: one row per (experiment, model); a value the experiment lacks is '–'."""
    header = ["experiment", "model"] + [c[0] for c in COLUMNS]
    rows = []
    for exp in experiments:
        for model, m in exp["models"].items():
            cells = [fmt.format(m[key]) if m.get(key) is not None else "–" for _, key, fmt in COLUMNS]
            rows.append([exp["name"], model] + cells)
    return header, rows


def html_table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>\n" for r in rows)
    return f"<table>\n<tr>{head}</tr>\n{body}</table>"


def render_table(header: list[str], rows: list[list[str]], markdown: bool) -> str:
    """The comparison table as a Markdown table or an HTML page."""
    if markdown:
        lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows]) + "\n"
    return page("Experiments", html_table(header, rows))


def page(title: str, body: str) -> str:
    """A small self-contained HTML page (the report shows it in a frame)."""
    style = (
        "body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse}"
        "td,th{border:1px solid #bbb;padding:4px 10px;text-align:right}th{background:#eee}"
        "td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:8px;"
        "white-space:pre-wrap}"
    )
    return (
        f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{style}</style></head>\n<body>\n<h2>{html.escape(title)}</h2>\n{body}\n</body></html>\n"
    )


def plot_experiments(experiments: list[dict], out: Path) -> None:
    """Loss of pretraining and SFT against the step: per experiment one colour, validation loss as dots on a
    line, training loss as a faint line behind it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from nanoeuler.train.plots import save_figure, style_loss_axes

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), squeeze=False)
    for ax, (i, title) in zip(axes[0], enumerate(("pretraining", "SFT"))):
        for colour, exp in enumerate(experiments):
            recs = exp["runs"][i][1]
            for key, style, alpha, label in (("loss", "-", 0.3, None), ("val_loss", "o-", 1.0, exp["name"])):
                pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
                if pts:
                    ax.plot(*zip(*pts), style, color=f"C{colour}", alpha=alpha, label=label, markersize=3, linewidth=1)
        style_loss_axes(ax, f"{title} (dots: validation, faint: training)")
    save_figure(fig, Path(out))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "experiments",
        nargs="+",
        metavar="NAME",
        help="experiment names as in their configs ('' for the unnamed run's results/)",
    )
    parser.add_argument("--table", required=True, metavar="FILE", help="metrics table: .html, or .md for Markdown")
    parser.add_argument(
        "--plot",
        required=True,
        metavar="PNG",
        help="loss curves of all experiments (.png; .pdf or .svg by the name's ending)",
    )


def run(args: argparse.Namespace) -> int:
    from nanoeuler.data.common import atomic_path

    check_outputs(table=args.table, plot=args.plot)
    experiments = [load_experiment(name) for name in args.experiments]
    header, rows = table_rows(experiments)
    text = render_table(header, rows, markdown=args.table.endswith(".md"))
    with atomic_path(args.table) as tmp:  # the plot inside: a failed plot leaves no table either
        tmp.write_text(text, encoding="utf-8")
        plot_experiments(experiments, Path(args.plot))
    print(
        f"nanoeuler compare: {len(experiments)} experiments, {len(rows)} rows; wrote {args.table}, {args.plot}",
        file=sys.stderr,
    )
    return 0
