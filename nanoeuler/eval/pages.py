"""`nanoeuler report-pages`: the HTML pages of a run that the Snakemake report shows.

`snakemake --report` frames HTML files and shows images, but offers other files only as downloads;
so the metrics table, the HellaSwag scores, the samples and the run's config become small pages:

    nanoeuler report-pages --metrics results/metrics.json --samples results/samples.md \\
        --run-config "$(cat config.json)" --out-dir results/report

writes `metrics.html`, `hellaswag.html`, `samples.html` and `config.html` there.
"""

from __future__ import annotations

import argparse
import html
import re
from pathlib import Path

import yaml

from nanoeuler.eval.compare import check_metrics, html_table, model_entries, page, table_rows
from nanoeuler.files import SMALL_JSON, parse_json, read_json, read_text


def metrics_page(metrics: dict) -> str:
    header, rows = table_rows([{"name": "this run", "models": model_entries(metrics)}])
    defs = "".join(
        f"<li><b>{html.escape(k)}</b>: {html.escape(str(v))}</li>" for k, v in metrics.get("definitions", {}).items()
    )
    return page("Metrics", html_table(header[1:], [r[1:] for r in rows]) + f"<ul>{defs}</ul>")


def hellaswag_page(metrics: dict) -> str:
    scores = metrics.get("hellaswag")
    if not scores:
        return page("HellaSwag", "<p>No HellaSwag scores in this run.</p>")
    rows = "".join(
        f"<tr><td>{html.escape(name)}</td><td>{s['items']:,}</td><td>{s['acc']:.4f} ({s['correct']})</td>"
        f"<td>{s['acc_norm']:.4f} ({s['correct_norm']})</td></tr>\n"
        for name, s in scores.items()
    )
    return page(
        "HellaSwag",
        "<table><tr><th>model</th><th>items</th><th>acc</th><th>acc_norm</th></tr>\n"
        f"{rows}</table><p>Completion-style scoring as in llm.c: <code>acc</code> picks the ending with "
        "the largest summed log-probability of its tokens, <code>acc_norm</code> the largest mean "
        "log-probability per token. Chance is 0.25.</p>",
    )


def markdown_to_html(text: str) -> str:
    """The Markdown that `evaluate` writes (headings, tables, fenced blocks, paragraphs), as HTML.

    >>> markdown_to_html("## Hi\\n\\n**a** `b`")
    '<h3>Hi</h3>\\n<p><b>a</b> <code>b</code></p>'
    """
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if fence := re.match(r"^(`{3,})", line):
            end = next((j for j in range(i + 1, len(lines)) if lines[j] == fence.group(1)), len(lines))
            out.append(f"<pre>{html.escape(chr(10).join(lines[i + 1 : end]))}</pre>")
            i = end + 1
            continue
        if line.startswith("|"):
            block = []
            while i < len(lines) and lines[i].startswith("|"):
                block.append([html.escape(c.strip()) for c in lines[i].strip("|").split("|")])
                i += 1
            cells = [r for r in block if not all(set(c) <= set("-:") for c in r)]
            out.append(
                "<table>" + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in cells) + "</table>"
            )
            continue
        if heading := re.match(r"^(#+) (.*)", line):
            level = min(6, len(heading.group(1)) + 1)
            out.append(f"<h{level}>{html.escape(heading.group(2))}</h{level}>")
        elif line.strip() and not line.startswith("!["):  # images: the report shows the plot itself
            inline = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", html.escape(line))
            out.append("<p>" + re.sub(r"`(.+?)`", r"<code>\1</code>", inline) + "</p>")
        i += 1
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics", required=True, metavar="JSON", help="results/metrics.json")
    parser.add_argument("--samples", required=True, metavar="MD", help="results/samples.md")
    parser.add_argument("--run-config", required=True, metavar="JSON", help="the run's whole config as JSON")
    parser.add_argument("--out-dir", required=True, metavar="DIR", help="where the pages go, e.g. results/report")


def run(args: argparse.Namespace) -> int:
    from nanoeuler.data.common import atomic_path

    metrics = check_metrics(read_json(args.metrics, "metrics file"), args.metrics)
    config = parse_json(args.run_config, "--run-config")
    samples = read_text(args.samples, "samples file", SMALL_JSON)
    pages = {
        "metrics.html": metrics_page(metrics),
        "hellaswag.html": hellaswag_page(metrics),
        "samples.html": page("Samples", markdown_to_html(samples)),
        "config.html": page("Config", f"<pre>{html.escape(yaml.safe_dump(config, sort_keys=False))}</pre>"),
    }
    for name, text in pages.items():
        with atomic_path(Path(args.out_dir) / name) as tmp:
            tmp.write_text(text, encoding="utf-8")
    return 0
