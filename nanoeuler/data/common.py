"""Small helpers shared by the data stages: logging, atomic outputs, where a source lives."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import sys
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Iterator


def info(msg: str) -> None:
    """One progress line on stderr (Snakemake sends it to the rule's log)."""
    print(msg, file=sys.stderr, flush=True)


def warn(msg: str) -> None:
    info(f"warning: {msg}")


@contextlib.contextmanager
def atomic_path(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary path next to `dest`; move it onto `dest` only if the block succeeds.

    The temporary file sits in the same directory so the final `os.replace` is atomic: readers see
    either the old file or the complete new one, and an error leaves no partial output behind. An
    existing directory at `dest` is refused before the block runs.
    """
    from nanoeuler.errors import UserError
    from nanoeuler.files import naming

    dest = Path(dest)
    if dest.is_dir():  # checked first: os.replace would fail only after all the work
        raise UserError(f"output {dest} is a directory; name a file")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp{os.getpid()}")
    try:
        with naming(dest):  # a full disk seen by write() names no file
            yield tmp
            os.replace(tmp, dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


# DuckDB's buffer budget. By default it may take 80% of the machine's memory, and the corpus query's
# sort of 1 GB of text then held it all (5.5 GB peak RSS); with a budget it spills to disk instead.
# Each thread's sort and parquet-writer state comes on top of the budget (4.15 GB peak with 2 threads,
# 3.7 GB with 1; 1 GB of budget is too little for the fineweb join), so the data stages use one thread.
DUCKDB_MEMORY_LIMIT = "2GB"


def json_list(path: str | os.PathLike, what: str, *, limit: int | None = None, gunzip: bool = False) -> list:
    """The JSON list a whole file holds (read by `nanoeuler.files.read_json`), or a one-line error.

        >>> json_list("data/sample/alpaca.json", "Alpaca data")[0]["instruction"]   # doctest: +SKIP
        'Give three tips for staying healthy.'
    """
    from nanoeuler.errors import UserError
    from nanoeuler.files import DATA_JSON, read_json

    data = read_json(path, what, DATA_JSON if limit is None else limit, gunzip=gunzip)
    if not isinstance(data, list):
        raise UserError(f"{path} must hold a JSON list of records, got a JSON {type(data).__name__}")
    return data


def jsonl_objects(path: str | os.PathLike, what: str) -> Iterator[tuple[int, dict]]:
    """(line number, object) for each non-blank line of a JSONL file, read by `nanoeuler.files.json_lines`
    (bounded lines, one JSON parser); a line that is not a JSON object is a one-line error naming it.

        >>> list(jsonl_objects("pairs.jsonl", "preference pairs"))   # doctest: +SKIP
        [(1, {'prompt': ..., 'chosen': ..., 'rejected': ...}), ...]
    """
    from nanoeuler.errors import UserError
    from nanoeuler.files import json_lines

    for n, rec in json_lines(path, what):
        if not isinstance(rec, dict):
            raise UserError(f"{path}:{n}: expected a JSON object")
        yield n, rec


@contextlib.contextmanager
def duckdb_connection(spill_dir: str | os.PathLike) -> Iterator:
    """A DuckDB connection on one thread that keeps at most DUCKDB_MEMORY_LIMIT of buffers and spills
    the rest to `spill_dir` (removed afterwards if it is empty); closed when the block ends."""
    import duckdb

    spill_dir = Path(spill_dir)
    con = duckdb.connect()
    try:
        con.execute(f"SET memory_limit = '{DUCKDB_MEMORY_LIMIT}'")
        con.execute("SET threads = 1")
        con.execute("SET temp_directory = '" + str(spill_dir).replace("'", "''") + "'")
        yield con
    finally:
        con.close()
        with contextlib.suppress(OSError):
            spill_dir.rmdir()


def is_remote(source: str) -> bool:
    """True for http(s) URLs; local paths and file:// URLs are copied instead of downloaded."""
    return urllib.parse.urlsplit(source).scheme.lower() in ("http", "https")


def local_path(source: str, root: str | os.PathLike | None = None) -> Path:
    """The file a local source names: a file:// URL or a path (a relative one is taken from `root`)."""
    if source.lower().startswith("file:"):
        return Path(urllib.request.url2pathname(urllib.parse.urlsplit(source).path))
    path = Path(source).expanduser()
    if not path.is_absolute() and root is not None:
        path = Path(root) / path
    return path


def add_source_root_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source-root",
        metavar="DIR",
        default=".",
        help="directory that relative local source paths in the config are taken from (default: .; "
        "the Snakemake rules pass the repository root)",
    )


def local_sources(sources: list[str], root: str | os.PathLike) -> list[str]:
    """The local files among `sources`, as Snakemake rule inputs (so editing one re-runs the stage).

    A relative source is given relative to the working directory, an absolute one stays absolute:
    Snakemake records inputs by name, so an absolute name would change, and re-run the stage, every
    time the project moves.
    """
    return [str(local_path(s, root)) if _absolute(s) else os.path.relpath(local_path(s, root))
            for s in sources if not is_remote(s)]


def _absolute(source: str) -> bool:
    return source.lower().startswith("file:") or Path(source).expanduser().is_absolute()


def failure_causes(snakemake_logs: str | os.PathLike | list) -> list[str]:
    """'<log>: <its last line>' for the log of every job that failed, whatever that line says.

    Snakemake's own log (`snakemake_logs`: the path, or list of paths, that `onerror` gets) names each
    failed job's logs in its error ("log: logs/x.log (check log file(s) for error details)"). Their
    last line is the cause: `nanoeuler <stage>: error: ...`, an exception, or the shell's
    `nanoeuler: command not found`; this puts it where the console ends.
    """
    found: dict[str, None] = {}  # the failed jobs' logs in order, each once (a retried job fails again)
    for path in [snakemake_logs] if isinstance(snakemake_logs, (str, os.PathLike)) else snakemake_logs:
        with contextlib.suppress(OSError):
            for line in Path(path).read_text(encoding="utf-8", errors="replace").splitlines():
                named = _FAILED_LOGS.match(line)
                if named:
                    found.update(dict.fromkeys(named.group(1).split(", ")))
    return [f"{log}: {_last_line(Path(log))}" for log in found]


_FAILED_LOGS = re.compile(r"^\s+log: (.+) \(check log file\(s\) for error details\)$")


def _last_line(log: Path) -> str:
    try:
        lines = [line for line in log.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip()]
    except OSError as exc:
        return f"(cannot be read: {exc.strerror or exc})"
    return lines[-1].strip() if lines else "(empty)"


# Arrow type families a data stage accepts for a column (pyarrow.types predicates by name).
_KINDS = {
    "string": ("is_string", "is_large_string"),
    "string or integer": ("is_string", "is_large_string", "is_integer"),
    "number": ("is_integer", "is_floating"),
}


def check_column_types(path: str | os.PathLike, schema, wanted: dict[str, str]) -> None:
    """UserError naming the file and column when a present column is not of the wanted kind.

    `wanted` maps column -> a key of _KINDS; absent columns are the caller's business.

        >>> import pyarrow as pa
        >>> check_column_types("x.parquet", pa.schema([("text", pa.int64())]), {"text": "string"})
        Traceback (most recent call last):
        nanoeuler.errors.UserError: column 'text' of x.parquet must hold string values, not int64
    """
    import pyarrow.types as pat

    from nanoeuler.errors import UserError

    for name, kind in wanted.items():
        if name not in schema.names:
            continue
        arrow_type = schema.field(name).type
        if not any(getattr(pat, test)(arrow_type) for test in _KINDS[kind]):
            raise UserError(f"column '{name}' of {path} must hold {kind} values, not {arrow_type}")
