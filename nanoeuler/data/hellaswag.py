"""`nanoeuler hellaswag`: download and check the HellaSwag validation set.

The input is `hellaswag_val.jsonl` of the rowanz/hellaswag repository (10,042 items), one JSON
object per line with the fields

    {"ind": 24, "activity_label": "Roof shingle removal", "ctx_a": "...", "ctx_b": "he",
     "ctx": "A man is sitting on a roof. he", "split": "val", "split_type": "indomain",
     "label": 3, "endings": ["...", "...", "...", "..."], "source_id": "activitynet~v_..."}

Every item must have a string `ctx`, a list of four non-empty string `endings` and an integer
`label` in 0..3; all bad lines are reported together, by line number (counting from 1). The items
are written as JSON lines with the fields the scorer and the report read: `ind`, `activity_label`,
`ctx`, `endings`, `label`. The scorer takes the first `eval.hellaswag_items` of them, so experiments
that score different numbers of items share this one file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.alpaca import write_jsonl
from nanoeuler.data.common import add_source_root_argument, info
from nanoeuler.errors import UserError
from nanoeuler.files import DATA_JSONL, JsonError, lines, parse_json

RAW_NAME = "hellaswag_val.jsonl"
N_ENDINGS = 4
_SHOW = 10  # bad lines named in the message; the rest are counted


def sources(section: dict) -> list[str]:
    return [section["url"]]


def problem(item) -> str | None:
    """What is wrong with one item, or None if the scorer can use it."""
    if not isinstance(item, dict):
        return f"is a {type(item).__name__}, not an object"
    missing = [k for k in ("ctx", "endings", "label") if k not in item]
    if missing:
        return "missing " + ", ".join(repr(k) for k in missing)
    if not isinstance(item["ctx"], str):
        return f"'ctx' is {type(item['ctx']).__name__} (must be a string)"
    endings = item["endings"]
    if not (isinstance(endings, list) and len(endings) == N_ENDINGS
            and all(isinstance(e, str) and e.strip() for e in endings)):
        return f"'endings' must be a list of {N_ENDINGS} non-empty strings"
    label = item["label"]
    if isinstance(label, str) and label.isdigit():  # some copies of the file store it as text
        label = int(label)
    if not (isinstance(label, int) and not isinstance(label, bool) and 0 <= label < N_ENDINGS):
        return f"'label' must be an integer 0..{N_ENDINGS - 1}, got {item['label']!r}"
    return None


def read_items(path: Path, max_items: int | None = None) -> list[dict]:
    """The checked items of a HellaSwag JSON-lines file, the first `max_items` of them (None: all).

        >>> read_items(Path("data/sample/hellaswag_val.jsonl"), 2)[0]["label"]  # doctest: +SKIP
        2
    """
    items, bad = [], []
    for number, line in lines(path, "HellaSwag data"):
        if not line.strip():
            continue
        try:
            item = parse_json(line, f"{path}:{number}")
        except JsonError as exc:  # reported with the other bad lines
            bad.append((number, f"is {exc.why}"))
            continue
        if (why := problem(item)) is not None:
            bad.append((number, why))
            continue
        items.append({"ind": item.get("ind", len(items)), "activity_label": item.get("activity_label", ""),
                      "ctx": item["ctx"], "endings": item["endings"], "label": int(item["label"])})
    if bad:
        shown = "; ".join(f"line {n} {why}" for n, why in bad[:_SHOW])
        more = f"; and {len(bad) - _SHOW} more" if len(bad) > _SHOW else ""
        raise UserError(f"{path}: {len(bad)} HellaSwag items are malformed: {shown}{more}")
    if not items:
        raise UserError(f"{path} holds no HellaSwag items")
    return items[:max_items] if max_items else items


def build(section: dict, raw_dir: Path, out: Path, root: str = ".") -> int:
    from nanoeuler.data.download import fetch

    raw = raw_dir / RAW_NAME
    if fetch(section["url"], raw, root=root, sha256=section["sha256"], timeout_s=section["timeout_s"],
             retries=section["retries"], delay_s=section["delay_s"], limit=DATA_JSONL):
        info(f"fetched {section['url']} -> {raw} ({raw.stat().st_size:,} bytes)")
    else:
        info(f"{raw} already there")
    items = read_items(raw)
    write_jsonl(items, out)
    info(f"wrote {out}: {len(items):,} items")
    return len(items)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="data/hellaswag/hellaswag.jsonl", help="output JSON-lines file")
    parser.add_argument("--raw-dir", default="data/hellaswag/raw", help=f"download cache ({RAW_NAME})")
    add_source_root_argument(parser)


def run(args: argparse.Namespace) -> int:
    section = sections(args, "hellaswag")["hellaswag"]
    build(section, Path(args.raw_dir), Path(args.out), root=args.source_root)
    return 0
