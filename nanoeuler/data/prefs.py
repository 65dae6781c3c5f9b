"""`nanoeuler prefs`: download preference pairs and write them as {prompt, chosen, rejected} in our template.

Three real layouts are read (`prefs.format`):

- `hh`: Anthropic HH-RLHF (`helpful-base/train.jsonl.gz`, plain or gzipped JSON lines). Each record is
  two whole transcripts, `{"chosen": "\\n\\nHuman: ... \\n\\nAssistant: ...", "rejected": ...}`, equal up
  to the last assistant turn. The prompt is their longest common prefix cut after its last
  "\\n\\nAssistant:"; the rest of each transcript is its response.
- `ultrafeedback`: UltraFeedback binarized (parquet, read with DuckDB): `prompt`, and `chosen` / `rejected`
  as lists of {role, content} messages whose last one is the assistant's answer.
- `sharegpt`: LLaMA-Factory's preference JSON (`dpo_en_demo.json`): a list of {conversations: [{from,
  value}], chosen: {from, value}, rejected: {from, value}}.

Multi-turn dialogues: the last user turn becomes the template's instruction and the turns before it
(as "Human: ..." / "Assistant: ..." lines, a system message as "System: ...") its `### Input:` block,
so the model sees the whole conversation and answers its last question, e.g.

    [user "Hi", assistant "Hello!", user "Name a colour."] -> instruction "Name a colour.",
                                                               input "Human: Hi\\nAssistant: Hello!"

A malformed record (not an object, a field missing or of the wrong type) stops the stage with one line
numbering every such record (or is dropped with `prefs.skip_bad`); unusable pairs are dropped and
counted with their numbers in the log: chosen == rejected, an empty response or instruction, no shared
prompt (the transcripts or message lists differ before the final answer, or it does not end with a
user turn), and exact repeats.

Output: JSON lines {"prompt": rendered template text, "chosen": response, "rejected": response}.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.alpaca import write_jsonl
from nanoeuler.data.common import add_source_root_argument, info, json_list, warn
from nanoeuler.files import DATA_JSONL, check_input, json_lines
from nanoeuler.errors import UserError

RAW_NAMES = {"hh": "train.jsonl.gz", "ultrafeedback": "train_prefs.parquet", "sharegpt": "prefs.json"}
_SHOW = 10  # record numbers named per problem; the rest are counted
DROPS = {"same": "chosen == rejected", "empty": "empty response or instruction",
         "no_prompt": "no shared prompt", "duplicate": "exact repeats"}


class Bad(Exception):
    """A record that cannot be used; `kind` is malformed or one of DROPS."""

    def __init__(self, kind: str, why: str = ""):
        super().__init__(why)
        self.kind = kind


def sources(section: dict) -> list[str]:
    return [section["url"]]


# ---- reading each layout: records -> (turns [(role, text)], chosen, rejected) -----------------


def read_raw(path: Path, fmt: str) -> list:
    """The records of a raw file, as Python objects (dicts, or whatever a malformed line holds)."""
    if fmt == "ultrafeedback":
        return _read_parquet(path)
    if fmt == "sharegpt":
        return json_list(path, "LLaMA-Factory preference data", gunzip=True)
    return [record for _, record in json_lines(path, "preference data", gunzip=True)]


def _read_parquet(path: Path) -> list:
    import duckdb

    check_input(path, "preference data")  # DuckDB would wait on a FIFO or read a device for ever
    con = duckdb.connect()
    try:
        cols = [r[0] for r in con.execute("SELECT name FROM parquet_schema(?)", [str(path)]).fetchall()]
        missing = [c for c in ("prompt", "chosen", "rejected") if c not in cols]
        if missing:
            raise UserError(f"{path} lacks column(s) {', '.join(missing)} of the UltraFeedback layout")
        rows = con.execute("SELECT prompt, chosen, rejected FROM read_parquet(?)", [str(path)]).fetchall()
    except duckdb.Error as exc:
        raise UserError(f"{path} is not a readable parquet file: {str(exc).splitlines()[0]}") from None
    finally:
        con.close()
    return [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in rows]


def _need(record, fields: dict):
    if not isinstance(record, dict):
        raise Bad("malformed", f"is a {type(record).__name__}, not an object")
    missing = [k for k in fields if k not in record]
    if missing:
        raise Bad("malformed", "missing " + ", ".join(repr(k) for k in missing))
    wrong = [f"{k!r} is {type(record[k]).__name__}" for k, t in fields.items() if not isinstance(record[k], t)]
    if wrong:
        raise Bad("malformed", ", ".join(wrong))


def parse_hh(record) -> tuple[list, str, str]:
    """Split two HH transcripts into the shared turns and the two final answers."""
    _need(record, {"chosen": str, "rejected": str})
    c, r = record["chosen"], record["rejected"]
    n = 0
    while n < min(len(c), len(r)) and c[n] == r[n]:
        n += 1
    cut = c.rfind("\n\nAssistant:", 0, n)  # the last assistant turn both transcripts reach
    if cut < 0:
        raise Bad("no_prompt")
    end = cut + len("\n\nAssistant:")
    if "\n\nHuman:" in c[end:] or "\n\nHuman:" in r[end:]:
        raise Bad("no_prompt")  # the transcripts part before the last answer
    turns = []
    for chunk in c[:cut].split("\n\nHuman:")[1:]:
        human, *answers = chunk.split("\n\nAssistant:")
        turns.append(("user", human))
        turns += [("assistant", a) for a in answers]
    if not turns or c[:cut].split("\n\nHuman:")[0].strip():
        raise Bad("no_prompt")
    return turns, c[end:], r[end:]


def _messages(value, role_key: str, text_key: str, where: str) -> list:
    if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get(role_key), str) and isinstance(m.get(text_key), str)
            for m in value):
        raise Bad("malformed", f"{where!r} must be a list of {{{role_key}, {text_key}}} messages")
    return [("user" if m[role_key] in ("user", "human") else m[role_key], m[text_key]) for m in value]


def parse_ultrafeedback(record) -> tuple[list, str, str]:
    _need(record, {"prompt": str, "chosen": list, "rejected": list})
    c = _messages(record["chosen"], "role", "content", "chosen")
    r = _messages(record["rejected"], "role", "content", "rejected")
    if not c or not r or c[:-1] != r[:-1] or c[-1][0] != "assistant" or r[-1][0] != "assistant":
        raise Bad("no_prompt")
    turns = c[:-1] or [("user", record["prompt"])]
    return turns, c[-1][1], r[-1][1]


def parse_sharegpt(record) -> tuple[list, str, str]:
    _need(record, {"conversations": list, "chosen": dict, "rejected": dict})
    turns = [("assistant" if role == "gpt" else role, text)
             for role, text in _messages(record["conversations"], "from", "value", "conversations")]
    answers = _messages([record["chosen"], record["rejected"]], "from", "value", "chosen/rejected")
    return turns, answers[0][1], answers[1][1]


SPEAKERS = {"user": "Human", "assistant": "Assistant", "system": "System"}  # names in the history block
PARSERS = {"hh": parse_hh, "ultrafeedback": parse_ultrafeedback, "sharegpt": parse_sharegpt}


def to_pair(turns: list, chosen: str, rejected: str) -> dict:
    """Shared turns and two answers -> {prompt, chosen, rejected} in the Alpaca template."""
    from nanoeuler.data.template import render_prompt

    turns = [(role, text.strip()) for role, text in turns]
    if not turns or turns[-1][0] != "user":
        raise Bad("no_prompt")
    chosen, rejected = chosen.strip(), rejected.strip()
    if not chosen or not rejected or not turns[-1][1]:
        raise Bad("empty")
    if chosen == rejected:
        raise Bad("same")
    history = "\n".join(f"{SPEAKERS.get(role, role.capitalize())}: {text}" for role, text in turns[:-1])
    return {"prompt": render_prompt(turns[-1][1], history), "chosen": chosen, "rejected": rejected}


# ---- cleaning ----------------------------------------------------------------------------------


def clean(records: list, fmt: str, *, source: str = "input", skip_bad: bool = False,
          max_pairs: int | None = None) -> tuple[list[dict], dict[str, list[int]]]:
    """Records -> (pairs, {problem: record numbers from 1}); malformed ones raise unless skip_bad."""
    parse = PARSERS[fmt]
    pairs, seen = [], set()
    bad: dict[str, list] = {"malformed": [], **{k: [] for k in DROPS}}
    why = {}
    for i, record in enumerate(records, start=1):
        try:
            pair = to_pair(*parse(record))
            key = (pair["prompt"], pair["chosen"], pair["rejected"])
            if key in seen:
                raise Bad("duplicate")
        except Bad as exc:
            bad[exc.kind].append(i)
            why.setdefault(i, str(exc))
            continue
        seen.add(key)
        pairs.append(pair)
    if bad["malformed"]:
        shown = "; ".join(f"#{i} {why[i]}" for i in bad["malformed"][:_SHOW])
        more = f"; and {len(bad['malformed']) - _SHOW} more" if len(bad["malformed"]) > _SHOW else ""
        msg = (f"{source}: {len(bad['malformed'])} of {len(records)} records are malformed for "
               f"prefs.format {fmt} (numbered from 1): {shown}{more}")
        if not skip_bad:
            raise UserError(msg)
        warn(msg + " -- dropped")
    if max_pairs:
        pairs = pairs[:max_pairs]
    if not pairs:
        raise UserError(f"{source}: no usable preference pair left ({summary(bad, len(records), 0)})")
    return pairs, bad


def summary(bad: dict, read: int, written: int) -> str:
    parts = [f"read {read:,}", f"written {written:,}"]
    for kind, label in (("malformed", "malformed"), *DROPS.items()):
        nums = bad[kind]
        named = (": #" + ", #".join(map(str, nums[:_SHOW])) + (", ..." if len(nums) > _SHOW else "")) if nums else ""
        parts.append(f"{label} {len(nums):,}{named}")
    return "; ".join(parts)


def build(section: dict, raw_dir: Path, out: Path, root: str = ".") -> dict[str, list[int]]:
    from nanoeuler.data.download import fetch

    raw = raw_dir / RAW_NAMES[section["format"]]
    if fetch(section["url"], raw, root=root, sha256=section["sha256"], timeout_s=section["timeout_s"],
             retries=section["retries"], delay_s=section["delay_s"], limit=DATA_JSONL):
        info(f"fetched {section['url']} -> {raw} ({raw.stat().st_size:,} bytes)")
    else:
        info(f"{raw} already there")
    records = read_raw(raw, section["format"])
    pairs, bad = clean(records, section["format"], source=str(raw), skip_bad=section["skip_bad"],
                       max_pairs=section["max_pairs"])
    write_jsonl(pairs, out)
    info(f"wrote {out}: {len(pairs):,} pairs ({summary(bad, len(records), len(pairs))})")
    return bad


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="data/prefs/prefs.jsonl", help="output JSON-lines file")
    parser.add_argument("--raw-dir", default="data/prefs/raw", help="download cache")
    add_source_root_argument(parser)


def run(args: argparse.Namespace) -> int:
    section = sections(args, "prefs")["prefs"]
    build(section, Path(args.raw_dir), Path(args.out), root=args.source_root)
    return 0
