"""`nanoeuler fineweb`: download FineWeb-Edu parquet files and sample them with DuckDB.

FineWeb-Edu rows carry the text and its metadata (text, id, dump, url, date, file_path, language,
language_score, token_count, score, int_score). One SQL query

1. keeps documents that pass the `int_score` / `language_score` thresholds,
2. orders them by md5(seed, id), a shuffle that is the same on every machine and DuckDB version,
3. keeps the longest prefix of that order whose running sum of UTF-8 bytes stays within the budget.

Step 3 is a window sum over (id, bytes) pairs only; the text is joined back afterwards, so the
sort never carries gigabytes of text. The query is printed to the log as it runs.

Output: a parquet file with columns source ("fineweb"), doc_id, text, in sample order.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.common import add_source_root_argument, atomic_path, check_column_types, duckdb_connection, info
from nanoeuler.errors import UserError


def sources(section: dict) -> list[str]:
    """Where each configured parquet file comes from."""
    base = section["base_url"].rstrip("/")
    return [f"{base}/{name.lstrip('/')}" for name in section["files"]]


def _sql_str(value: str) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def check_files(paths: list[Path], section: dict) -> set[str]:
    """Fail with one line naming the file if one is not readable parquet or lacks a needed column.

    Returns the columns every file has.
    """
    import pyarrow.parquet as pq

    common: set[str] | None = None
    for path in paths:
        try:
            schema = pq.read_schema(path)
        except Exception as exc:  # truncated or not parquet at all: pyarrow says which
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise UserError(f"{path} is not a readable parquet file (truncated or corrupt?): {first}") from None
        names = set(schema.names)
        if "text" not in names:
            raise UserError(f"{path} has no 'text' column (columns: {', '.join(schema.names)})")
        check_column_types(path, schema, {"text": "string", "int_score": "number", "language_score": "number"})
        for key, column in (("min_int_score", "int_score"), ("min_language_score", "language_score")):
            if section[key] is not None and column not in names:
                raise UserError(f"{path} has no '{column}' column, needed by config key 'fineweb.{key}' "
                                "(set it to null to filter nothing)")
        common = names if common is None else common & names
    return common or set()


def sample_query(paths: list[Path], section: dict, out: Path, has_id: bool = True) -> str:
    """The DuckDB statement that filters, samples to the byte budget and writes `out`."""
    files = "[" + ", ".join(_sql_str(p) for p in paths) + "]"
    where = ["text IS NOT NULL", "strlen(text) > 0"]
    if section["min_int_score"] is not None:
        where.append(f"int_score >= {int(section['min_int_score'])}")
    if section["min_language_score"] is not None:
        where.append(f"language_score >= {float(section['min_language_score'])!r}")
    doc_id = ("CAST(id AS VARCHAR)" if has_id
              else "parse_filename(filename) || ':' || CAST(file_row_number AS VARCHAR)")
    seed = int(section["seed"])
    budget = int(section["byte_budget"])
    return f"""COPY (
  WITH docs AS (
    SELECT filename, file_row_number, {doc_id} AS doc_id, strlen(text) AS nbytes
    FROM read_parquet({files}, filename = true, file_row_number = true, union_by_name = true)
    WHERE {' AND '.join(where)}
  ),
  ordered AS (
    SELECT filename, file_row_number, doc_id,
           sum(nbytes) OVER (ORDER BY md5('{seed}:' || doc_id), filename, file_row_number
                             ROWS BETWEEN UNBOUNDED PRECEDING AND CURRENT ROW) AS running_bytes
    FROM docs
  ),
  picked AS (
    SELECT * FROM ordered WHERE running_bytes <= {budget}
  )
  SELECT 'fineweb' AS source, picked.doc_id, t.text
  FROM read_parquet({files}, filename = true, file_row_number = true, union_by_name = true) AS t
  JOIN picked ON t.filename = picked.filename AND t.file_row_number = picked.file_row_number
  ORDER BY picked.running_bytes
) TO {_sql_str(out)} (FORMAT parquet, COMPRESSION zstd)"""


def sample(paths: list[Path], section: dict, out: Path) -> tuple[int, int]:
    """Run the sampling query into `out` (atomically). Returns (documents, bytes) written."""
    import duckdb

    if not paths:
        raise UserError("config key 'fineweb.files' is empty: list at least one parquet file")
    columns = check_files(paths, section)
    with atomic_path(out) as tmp:
        sql = sample_query(paths, section, tmp, has_id="id" in columns)
        info("DuckDB query:\n" + sql)
        with duckdb_connection(out.parent / ".duckdb_tmp") as con:
            try:
                con.execute(sql)
            except duckdb.Error as exc:
                first = str(exc).strip().splitlines()[0]
                raise UserError(f"DuckDB could not read {', '.join(map(str, paths))}: {first}") from None
            total_docs, docs, nbytes = con.execute(
                f"SELECT (SELECT count(*) FROM read_parquet([{', '.join(_sql_str(p) for p in paths)}], "
                f"union_by_name = true)), count(*), coalesce(sum(strlen(text)), 0) "
                f"FROM read_parquet({_sql_str(tmp)})").fetchone()
        if docs == 0:
            raise UserError(f"no FineWeb document passed the filters and fits the byte budget of "
                            f"{section['byte_budget']:,} (from {total_docs:,} documents in {len(paths)} files)")
    info(f"wrote {out}: {docs:,} of {total_docs:,} documents, {nbytes:,} bytes "
         f"(budget {section['byte_budget']:,})")
    return docs, nbytes


def build(section: dict, raw_dir: Path, out: Path, root: str = ".") -> tuple[int, int]:
    from nanoeuler.data.download import fetch, fetch_options

    paths: list[Path] = []
    for source in sources(section):
        path = raw_dir / Path(source.rstrip("/")).name
        if path in paths:
            raise UserError(f"config key 'fineweb.files' names two files called {path.name}; "
                            "they would share one cache file")
        if fetch(source, path, root=root, check=lambda p: check_files([p], section), **fetch_options(section)):
            info(f"fetched {source} -> {path} ({path.stat().st_size:,} bytes)")
        else:
            info(f"{path} already there")
        paths.append(path)
    return sample(paths, section, out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="data/web/web.parquet", help="output parquet file")
    parser.add_argument("--raw-dir", default="data/web/raw", help="download cache for the parquet files")
    add_source_root_argument(parser)


def run(args: argparse.Namespace) -> int:
    section = sections(args, "fineweb")["fineweb"]
    build(section, Path(args.raw_dir), Path(args.out), root=args.source_root)
    return 0
