"""`nanoeuler alpaca`: download, validate and clean the instruction data for supervised fine-tuning.

The input is a JSON list of records like Stanford Alpaca's `alpaca_data.json`:

    [{"instruction": "Name three primary colors.", "input": "", "output": "Red, yellow and blue."}, ...]

Every record must be an object whose `instruction`, `input` and `output` are strings. All bad
records are reported together in one line, by number (counting from 1), so one run shows every
problem. Whitespace around each field is trimmed, records with an empty output or instruction are
dropped, and so are exact repeats of an earlier record.

Output: JSON lines, one {"instruction", "input", "output"} object per line.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.common import add_source_root_argument, atomic_path, info, json_list, warn
from nanoeuler.errors import UserError
from nanoeuler.files import DATA_JSON

FIELDS = ("instruction", "input", "output")
RAW_NAME = "alpaca_data.json"
_SHOW = 10  # bad records named in the message; the rest are counted


def sources(section: dict) -> list[str]:
    return [section["url"]]


def load_records(path: Path) -> list:
    return json_list(path, "Alpaca data")


def problem(record) -> str | None:
    """What is wrong with one record, or None if it is well formed."""
    if not isinstance(record, dict):
        return f"is a {type(record).__name__}, not an object"
    missing = [k for k in FIELDS if k not in record]
    if missing:
        return "missing " + ", ".join(repr(k) for k in missing)
    wrong = [f"{k!r} is {type(record[k]).__name__}" for k in FIELDS if not isinstance(record[k], str)]
    if wrong:
        return ", ".join(wrong) + " (must be a string)"
    return None


def clean(records: list, *, source: str = "input", skip_bad: bool = False,
          max_records: int | None = None) -> tuple[list[dict], dict[str, int]]:
    """Validate and clean the records. Returns (kept records, counts)."""
    bad = [(i, p) for i, r in enumerate(records, start=1) if (p := problem(r)) is not None]
    if bad:
        shown = "; ".join(f"#{i} {p}" for i, p in bad[:_SHOW])
        more = f"; and {len(bad) - _SHOW} more" if len(bad) > _SHOW else ""
        msg = f"{source}: {len(bad)} of {len(records)} records are malformed (numbered from 1): {shown}{more}"
        if not skip_bad:
            raise UserError(msg)
        warn(msg + " -- dropped")
    bad_numbers = {i for i, _ in bad}
    kept, seen = [], set()
    counts = {"read": len(records), "malformed": len(bad), "empty": 0, "duplicate": 0}
    for i, record in enumerate(records, start=1):
        if i in bad_numbers:
            continue
        row = {k: record[k].strip() for k in FIELDS}
        if not row["output"] or not row["instruction"]:
            counts["empty"] += 1
            continue
        key = (row["instruction"], row["input"], row["output"])
        if key in seen:
            counts["duplicate"] += 1
            continue
        seen.add(key)
        kept.append(row)
    counts["cut"] = max(0, len(kept) - max_records) if max_records else 0
    if max_records:
        kept = kept[:max_records]
    counts["written"] = len(kept)
    if not kept:
        raise UserError(f"{source}: no usable records left after cleaning ({counts})")
    return kept, counts


def write_jsonl(rows: list[dict], out: Path) -> None:
    with atomic_path(out) as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")


def build(section: dict, raw_dir: Path, out: Path, root: str = ".") -> dict[str, int]:
    from nanoeuler.data.download import fetch, fetch_options

    raw = raw_dir / RAW_NAME
    if fetch(section["url"], raw, root=root, sha256=section["sha256"], check=load_records,
             limit=DATA_JSON, **fetch_options(section)):
        info(f"fetched {section['url']} -> {raw} ({raw.stat().st_size:,} bytes)")
    else:
        info(f"{raw} already there")
    rows, counts = clean(load_records(raw), source=str(raw), skip_bad=section["skip_bad"],
                         max_records=section["max_records"])
    write_jsonl(rows, out)
    info(f"wrote {out}: {counts['written']:,} records (read {counts['read']:,}, malformed {counts['malformed']:,}, "
         f"empty output {counts['empty']:,}, duplicates {counts['duplicate']:,}, over max_records {counts['cut']:,})")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="data/alpaca/alpaca.jsonl", help="output JSON-lines file")
    parser.add_argument("--raw-dir", default="data/alpaca/raw", help=f"download cache ({RAW_NAME})")
    add_source_root_argument(parser)


def run(args: argparse.Namespace) -> int:
    section = sections(args, "alpaca")["alpaca"]
    build(section, Path(args.raw_dir), Path(args.out), root=args.source_root)
    return 0
