"""The stage table of a pipeline run made by scripts/device_full_run.sh, as Markdown.

    python scripts/device_stage_table.py WORKDIR
    python scripts/device_stage_table.py --extrapolate PROGRESS_FILE 20000

Per rule: wall time and peak RSS (Snakemake's `benchmark:` files), CPU cores busy on average
(CPU time / wall time), the peak GPU memory in use while the stage ran (nvidia-smi samples between
the stage's start and end, noted by the `nanoeuler` wrapper), the stage's own measured and predicted
peak and how it cut its batches (its log's lines), and the size of the rule's outputs.
`--extrapolate` reads "wall_seconds step" lines taken while a run trained and prints the wall time
of the whole schedule at the measured rate.
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import re
import sys
from pathlib import Path

# rule -> (nanoeuler subcommand, outputs)
RULES = {
    "gutenberg": ("gutenberg", ["data/gutenberg/books.parquet"]),
    "fineweb": ("fineweb", ["data/web/web.parquet"]),
    "alpaca": ("alpaca", ["data/alpaca/alpaca.jsonl"]),
    "corpus": ("corpus", ["data/corpus/train.parquet", "data/corpus/val.parquet"]),
    "tokenizer": ("tokenizer", ["results/tokenizer.json", "results/tokenizer.hf.json"]),
    "shards": ("tokenize", ["results/shards"]),
    "pretrain": ("pretrain", ["results/base.bin"]),
    "sft": ("sft", ["results/chat.bin"]),
    "hellaswag": ("hellaswag", ["data/hellaswag/hellaswag.jsonl"]),
    "prefs": ("prefs", ["data/prefs/prefs.jsonl"]),
    "ref_logps": ("ref-logps", ["results/ref_logps.npz"]),
    "dpo": ("dpo", ["results/dpo.bin"]),
    "hellaswag_eval_base": ("hellaswag-eval", ["results/hellaswag/base.json"]),
    "hellaswag_eval_chat": ("hellaswag-eval", ["results/hellaswag/chat.json"]),
    "hellaswag_eval_dpo": ("hellaswag-eval", ["results/hellaswag/dpo.json"]),
    "evaluate": ("evaluate", ["results/samples.md", "results/metrics.json", "results/loss.png"]),
}


def size_of(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    return path.stat().st_size if path.exists() else 0


def human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return ""


def stage_windows(path: Path) -> dict[str, tuple[float, float]]:
    """subcommand -> (start, end) epoch seconds, from the wrapper's 'name start|end time' lines."""
    spans: dict[str, list[float]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        name, what, when = line.split()[:3]
        spans.setdefault(name, [0.0, 0.0])[0 if what == "start" else 1] = float(when)
    return {k: (a, b) for k, (a, b) in spans.items()}


def gpu_samples(path: Path) -> list[tuple[float, float]]:
    """(epoch seconds, MiB in use) from `nvidia-smi --query-gpu=timestamp,memory.used` csv lines."""
    out = []
    for row in csv.reader(path.open()) if path.exists() else []:
        try:
            t = dt.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f").timestamp()
            out.append((t, float(row[1])))
        except (ValueError, IndexError):
            continue
    return out


def own_memory(log: Path) -> tuple[str, str, str]:
    """(measured peak, predicted peak, how the batch was cut) from a stage's log: the lines
    `nanoeuler <stage>: device memory peak 9.1 GB measured, 9.4 GB predicted (0.97)` and
    `nanoeuler <stage>: batch 32 as 4 micro-batches of 8 to fit 11.0 GB` (`-` where absent); an uncut
    stage's batch is the peak line's tail (`...predicted (1.0); micro-batch 32`)."""
    measured = predicted = cut = "-"
    for line in log.read_text(errors="replace").splitlines() if log.exists() else []:
        m = re.search(r"device memory peak ([\d.]+ GB) measured, ([\d.]+ GB) predicted \([\d.]+\)(?:; (.*))?", line)
        if m:
            measured, predicted = m.group(1), m.group(2)
            cut = m.group(3) if m.group(3) and cut == "-" else cut
        m = re.search(r": (batch .* to fit [\d.]+ GB)", line)
        if m:
            cut = m.group(1)
    return measured, predicted, cut


def table(work: Path) -> str:
    windows = stage_windows(work / "stage_times.txt")
    samples = gpu_samples(work / "gpu_mem.csv")
    base = min((m for _, m in samples), default=0.0)  # memory in use before anything ran (the driver's own)
    lines = [
        "| stage | wall s | peak RSS | CPU cores busy (mean) | peak GPU memory (nvidia-smi) | own peak | "
        "predicted | batch | output |",
        "|---|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    total = 0.0
    for rule, (cmd, outputs) in RULES.items():
        bench = work / "benchmarks" / f"{rule}.tsv"
        if not bench.exists():
            continue
        row = next(csv.DictReader(bench.open(), delimiter="\t"))
        wall, rss = float(row["s"]), float(row["max_rss"] or 0)
        cpu = float(row.get("cpu_time") or 0)
        total += wall
        a, b = windows.get(cmd, (0.0, 0.0))
        peak = max((m for t, m in samples if a <= t <= b), default=base) - base
        out = human(sum(size_of(work / o) for o in outputs)) if all((work / o).exists() for o in outputs) else "n/a"
        own, predicted, cut = own_memory(work / "logs" / f"{rule}.log")
        lines.append(
            f"| {rule} | {wall:.1f} | {rss / 1000:.2f} GB | {cpu / max(wall, 1e-9):.1f} | "
            f"{peak / 1024:.1f} GiB | {own} | {predicted} | {cut} | {out} |"
        )
    done = work / "done"
    if done.exists() and (work / "started").exists():
        end = float(done.read_text().split()[1])
        lines.append(
            f"\nsum of stages {total:.0f} s; whole run (snakemake start to end) "
            f"{end - float((work / 'started').read_text()):.0f} s; exit status {done.read_text().split()[0]}"
        )
    return "\n".join(lines)


def extrapolate(progress: Path, steps: int) -> str:
    """Wall time of `steps` steps from (wall seconds, step) samples: start-up, then the measured rate."""
    pts = [tuple(map(float, line.split()[:2])) for line in progress.read_text().splitlines() if len(line.split()) >= 2]
    pts = [(t, s) for t, s in pts if s > 0]
    if len(pts) < 2:
        return "too few samples to extrapolate"
    (t0, s0), (t1, s1) = pts[0], pts[-1]
    rate = (s1 - s0) / (t1 - t0)
    startup = t0 - s0 / rate  # wall seconds before the first step, at the measured rate
    return (
        f"{s1 - s0:.0f} steps in {t1 - t0:.1f} s of training ({rate:.2f} steps/s, "
        f"{1000 / rate:.1f} ms/step incl. validation), start-up {startup:.0f} s -> "
        f"{steps} steps: {startup + steps / rate:.0f} s ({(startup + steps / rate) / 60:.1f} min, extrapolated)"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("work", nargs="?", help="the run's working directory")
    ap.add_argument("--extrapolate", nargs=2, metavar=("PROGRESS", "STEPS"))
    args = ap.parse_args(argv)
    if args.extrapolate:
        print(extrapolate(Path(args.extrapolate[0]), int(args.extrapolate[1])))
    else:
        print(table(Path(args.work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
