"""The CPU data stages at the full config's size (1 GB of web text): wall time and peak RSS per stage.

    python scripts/mirror/build.py                       # the mirror: real text to grow the scale data from
    python bench/stages_cpu.py make-data --gb 2.2        # FineWeb-Edu-schema parquet files, never a repeated document
    python bench/stages_cpu.py run                       # gutenberg, fineweb, corpus, tokenizer, tokenize
                                                         # with 2 and 1 workers

Scale data. The mirror holds ~105 MB of web text; 1 GB of distinct documents is grown from it: each
new document takes a mirror document's sentences (or lines, for code and dictionary entries) in a
seeded random order, cut at a seeded start and length, with a few sentences of another document
spliced in, so every document is new text made of real sentences (duplicates are counted and
reported: none expected). Two files of >= 1 GB each, as FineWeb-Edu's sample/10BT files are ~2 GB.

Each stage runs as `nanoeuler <stage>` under /usr/bin/time -v (wall time, peak RSS of the process and
of its largest child), with the load average beside it: the machine may be shared. Targets (issue):
peak RSS <= 4 GB, merge learning on the 50 MB sample <= 3 minutes, tokenize >= 10 MB/s per worker.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
_SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'(])")


def units(text: str) -> list[str]:
    """A document's sentences; its lines when it has too few (code, dictionary entries, lists)."""
    parts = _SENTENCE.split(text)
    if len(parts) < 8:
        parts = [p for p in text.split("\n") if p.strip()]
    return parts


def grow(docs: list[str], i: int, variant: int, seed: int) -> str:
    """New document (i, variant): document i's units shuffled and cut, with units of another spliced in."""
    rng = np.random.default_rng([seed, variant, i])
    own = units(docs[i])
    other = units(docs[int(rng.integers(len(docs)))])
    order = rng.permutation(len(own))
    start = int(rng.integers(0, max(1, len(own) // 4)))
    picked = [own[j] for j in order[start:]]
    for _ in range(min(3, len(other))):
        picked.insert(int(rng.integers(len(picked) + 1)), other[int(rng.integers(len(other)))])
    sep = "\n" if "\n" in docs[i][:2000] and len(_SENTENCE.split(docs[i])) < 8 else " "
    return sep.join(picked)


def make_data(mirror: Path, out: Path, gb: float, files: int, seed: int) -> None:
    """Write `files` parquet files of grown documents adding up to `gb` GB of text, streaming."""
    import pyarrow.parquet as pq
    from tqdm import tqdm

    docs, meta = [], []
    for path in sorted((mirror / "fineweb/sample/10BT").glob("*.parquet")):
        t = pq.read_table(path)
        docs += t.column("text").to_pylist()
        meta += t.column("dump").to_pylist()
    out.mkdir(parents=True, exist_ok=True)
    target = int(gb * 1e9)
    per_file = target // files
    seen: set[bytes] = set()
    dupes = written = 0
    variant = 0
    bar = tqdm(total=target, unit="B", unit_scale=True, desc="scale data", file=sys.stderr, mininterval=2)
    for f in range(files):
        writer = pq.ParquetWriter(out / f"{f:03d}_00000.parquet", _schema())
        size = 0
        while size < per_file:
            rows = []
            for i in np.random.default_rng([seed, variant]).permutation(len(docs)).tolist():
                text = grow(docs, i, variant, seed)
                h = hashlib.md5(text.encode()).digest()
                if h in seen:
                    dupes += 1
                    continue
                seen.add(h)
                rows.append((text, f"<urn:uuid:{hashlib.md5(f'{variant}:{i}'.encode()).hexdigest()}>", meta[i]))
                size += len(text.encode())
                if size >= per_file:
                    break
            writer.write_table(_table(rows))
            bar.update(sum(len(r[0].encode()) for r in rows))
            written += len(rows)
            variant += 1
        writer.close()
    bar.close()
    info = {"documents": written, "duplicates_skipped": dupes, "files": files, "bytes": target}
    (out / "scale_data.json").write_text(json.dumps(info) + "\n")
    print(f"wrote {written:,} documents in {files} files under {out} ({dupes} duplicate texts skipped)")


def _schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("text", pa.string()),
            ("id", pa.string()),
            ("dump", pa.string()),
            ("url", pa.string()),
            ("date", pa.string()),
            ("file_path", pa.string()),
            ("language", pa.string()),
            ("language_score", pa.float64()),
            ("token_count", pa.int64()),
            ("score", pa.float64()),
            ("int_score", pa.int64()),
        ]
    )


def _table(rows):
    import pyarrow as pa

    n = len(rows)
    texts = [r[0] for r in rows]
    return pa.table(
        {
            "text": texts,
            "id": [r[1] for r in rows],
            "dump": [f"scale:{r[2]}" for r in rows],
            "url": [f"scale://{r[1]}" for r in rows],
            "date": ["2023-06-10T00:00:00Z"] * n,
            "file_path": ["scale"] * n,
            "language": ["en"] * n,
            "language_score": [1.0] * n,
            "token_count": [len(t) // 4 for t in texts],
            "score": [3.0] * n,
            "int_score": [3] * n,
        },
        schema=_schema(),
    )


# ---- the stages -----------------------------------------------------------------------------------


def timed(name: str, argv: list[str], log: Path) -> dict:
    """Run `nanoeuler argv` under /usr/bin/time -v: wall s, peak RSS GB, load average before and after."""
    load0 = os.getloadavg()[0]
    t0 = time.perf_counter()
    with log.open("w") as f:
        rc = subprocess.run(
            ["/usr/bin/time", "-v", sys.executable, "-m", "nanoeuler", *argv],
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
        ).returncode
    wall = time.perf_counter() - t0
    text = log.read_text()
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    if rc != 0:
        raise SystemExit(f"{name} failed (exit {rc}); see {log}")
    return {
        "stage": name,
        "wall_s": wall,
        "peak_rss_gb": rss_kb * 1024 / 1e9,
        "load_before": load0,
        "load_after": os.getloadavg()[0],
        "cpu_s": cpu_seconds(text),
    }


def cpu_seconds(time_v: str) -> float:
    """User + system CPU seconds of a process and its children, from /usr/bin/time -v's report. On a
    shared machine this, not the wall time, says how fast the work runs per core."""
    return sum(float(re.search(rf"{kind} time \(seconds\): ([\d.]+)", time_v).group(1)) for kind in ("User", "System"))


def run(data: Path, work: Path, mirror: Path, stages: list[str]) -> list[dict]:
    work.mkdir(parents=True, exist_ok=True)
    files = sorted(p.name for p in data.glob("*.parquet"))
    cfg = work / "config.yaml"
    cfg.write_text(
        json.dumps(
            {  # JSON is YAML
                "gutenberg": {
                    "ids": list(range(100001, 100057)),
                    "delay_s": 0,
                    "url_template": str(mirror / "gutenberg/cache/epub/{id}/pg{id}.txt"),
                },
                "fineweb": {"base_url": str(data), "files": files, "delay_s": 0},
                "tokenizer": {"vocab_size": 4096},
            },
            indent=1,
        )
    )
    c = ["--config", str(cfg)]
    w = str(work)
    steps = {
        "gutenberg": c + ["--raw-dir", f"{w}/raw/gutenberg", "--out", f"{w}/books.parquet"],
        "fineweb": c + ["--raw-dir", f"{w}/raw/web", "--out", f"{w}/web.parquet"],
        "corpus": c
        + [
            "--books",
            f"{w}/books.parquet",
            "--web",
            f"{w}/web.parquet",
            "--train",
            f"{w}/train.parquet",
            "--val",
            f"{w}/val.parquet",
        ],
        "tokenizer": c + ["--corpus", f"{w}/train.parquet", "--out", f"{w}/tokenizer.json"],
        "tokenize-1": c
        + [
            "--tokenizer",
            f"{w}/tokenizer.json",
            "--train",
            f"{w}/train.parquet",
            "--val",
            f"{w}/val.parquet",
            "--out",
            f"{w}/shards1/manifest.json",
            "--workers",
            "1",
        ],
        "tokenize-2": c
        + [
            "--tokenizer",
            f"{w}/tokenizer.json",
            "--train",
            f"{w}/train.parquet",
            "--val",
            f"{w}/val.parquet",
            "--out",
            f"{w}/shards2/manifest.json",
            "--workers",
            "2",
        ],
    }
    results = []
    for name in stages:
        argv = [name.split("-")[0] if name.startswith("tokenize-") else name] + steps[name]
        r = timed(name, argv, work / f"{name}.log")
        text = (work / f"{name}.log").read_text()
        if name.startswith("tokenize-"):
            m = json.loads((work / f"shards{name[-1]}/manifest.json").read_text())
            nbytes = sum(s["bytes"] for s in m["splits"].values())
            r["mb_per_s"] = nbytes / 1e6 / r["wall_s"]
            r["mb_per_s_per_worker"] = r["mb_per_s"] / int(name[-1])
            r["bytes"] = nbytes
        if name == "tokenizer":
            m = re.search(r"([\d,]+) unique chunks", text)
            r["unique_chunks"] = int(m.group(1).replace(",", "")) if m else None
            m = re.search(r"learned \d+ merges in ([\d.]+) s", text)
            r["merges_s"] = float(m.group(1)) if m else None
        results.append(r)
        print(json.dumps(r), flush=True)
        with (work / "results.jsonl").open("a") as f:
            f.write(json.dumps(r) + "\n")
    return results


def table(results: list[dict], work: Path) -> str:
    lines = [
        "| stage | wall s | CPU s | peak RSS GB | load avg (before/after) | notes |",
        "|---|---:|---:|---:|---|---|",
    ]
    for r in results:
        if "cpu_s" not in r:  # a result of an earlier version of this script: read its log
            r["cpu_s"] = cpu_seconds((work / f"{r['stage']}.log").read_text())
        notes = []
        if "mb_per_s" in r:
            notes.append(
                f"{r['bytes'] / 1e9:.2f} GB, {r['mb_per_s']:.2f} MB/s wall, "
                f"{r['mb_per_s_per_worker']:.2f} MB/s per worker, "
                f"{r['bytes'] / 1e6 / r['cpu_s']:.2f} MB per CPU second"
            )
        if r.get("unique_chunks"):
            notes.append(f"{r['unique_chunks']:,} distinct chunks; merges {r['merges_s']:.0f} s")
        lines.append(
            f"| {r['stage']} | {r['wall_s']:.0f} | {r['cpu_s']:.0f} | {r['peak_rss_gb']:.2f} | "
            f"{r['load_before']:.1f} / {r['load_after']:.1f} | {'; '.join(notes)} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["make-data", "run", "table"])
    ap.add_argument("--mirror", default="data/mirror", type=Path)
    ap.add_argument("--data", default="data/scale", type=Path, help="scale parquet files")
    ap.add_argument("--work", default="data/bench-stages", type=Path, help="stage outputs and logs")
    ap.add_argument("--gb", type=float, default=2.2, help="make-data: GB of text (web text is sampled to 1 GB)")
    ap.add_argument("--files", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stages", default="gutenberg,fineweb,corpus,tokenizer,tokenize-2,tokenize-1")
    args = ap.parse_args(argv)
    if args.what == "make-data":
        make_data(args.mirror.resolve(), args.data, args.gb, args.files, args.seed)
    elif args.what == "run":
        results = run(args.data.resolve(), args.work.resolve(), args.mirror.resolve(), args.stages.split(","))
        print(table(results, args.work.resolve()))
    else:
        lines = (args.work / "results.jsonl").read_text().splitlines()
        print(table([json.loads(x) for x in lines], args.work))
    return 0


if __name__ == "__main__":
    sys.exit(main())
