"""`nanoeuler corpus`: mix books and web text into train/val splits with one DuckDB query.

- Books are first cut at paragraph breaks into pieces of about `chunk_bytes` (doc_id
  "<book>:<piece>"), so that the validation split holds passages from many books instead of a
  few whole ones.
- A document goes to val when md5("<source>:<doc_id>"), read as a number in [0, 1), is below
  `val_fraction`. The split depends on nothing else, so it is stable across runs, machines and
  changes of the weights.
- In train, a source with weight w contributes each of its documents floor(w) times, plus once
  more for the hashed fraction w - floor(w) of them (w = 0 leaves the source out). Val takes each
  document once, from every source whose weight is above 0.
- Train rows are written in a seeded hash order, so sources are interleaved.

Output: data/corpus/{train,val}.parquet with columns source, doc_id, text; byte counts per source
and split are logged.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.common import atomic_path, check_column_types, duckdb_connection, info
from nanoeuler.errors import UserError
from nanoeuler.files import check_input

SOURCES = ("gutenberg", "fineweb")
_HASH_DIV = 1_000_000_007  # md5 as a number -> a fraction in [0, 1)
_ROW_GROUP = 16384  # rows per parquet row group written: DuckDB buffers a whole group per thread


def chunk_text(text: str, chunk_bytes: int) -> list[str]:
    """Cut `text` at blank lines into pieces of about `chunk_bytes` UTF-8 bytes (0: one piece).

    A piece closes as soon as its paragraphs, each counted with the blank line after it, reach the
    size, so every piece but the last holds at least `chunk_bytes` of the text; a paragraph is never
    split.

    >>> chunk_text("aa\\n\\nbb\\n\\ncc", 6)    # "aa" and its blank line are 4 bytes, with "bb" 8
    ['aa\\n\\nbb', 'cc']
    >>> chunk_text("aa\\n\\nbb\\n\\ncc", 4)
    ['aa', 'bb', 'cc']
    """
    if chunk_bytes <= 0:
        return [text]
    pieces, current, size = [], [], 0
    for para in text.split("\n\n"):
        current.append(para)
        size += len(para.encode("utf-8")) + 2
        if size >= chunk_bytes:
            pieces.append("\n\n".join(current))
            current, size = [], 0
    if current:
        pieces.append("\n\n".join(current))
    return [p for p in pieces if p.strip()]


def _read_table(path: Path, what: str):
    import pyarrow.parquet as pq

    if not os.path.lexists(path):
        raise UserError(f"{what} file {path} does not exist (run the {what} stage first)")
    check_input(path, f"{what} file")  # a directory, device or FIFO: one line, not a hang
    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise UserError(f"{path} is not a readable parquet file: {str(exc).strip().splitlines()[0]}") from None
    missing = [c for c in ("doc_id", "text") if c not in table.column_names]
    if missing:
        raise UserError(f"{path} lacks column(s) {', '.join(missing)} (columns: {', '.join(table.column_names)})")
    check_column_types(path, table.schema, {"text": "string", "doc_id": "string or integer"})
    return table


def book_pieces(books: Path, chunk_bytes: int):
    """The books as an Arrow table of pieces: source, doc_id, text."""
    import pyarrow as pa

    table = _read_table(books, "gutenberg")
    doc_ids, texts = [], []
    for doc_id, text in zip(table.column("doc_id").to_pylist(), table.column("text").to_pylist()):
        for i, piece in enumerate(chunk_text(text or "", chunk_bytes)):
            doc_ids.append(f"{doc_id}:{i:05d}" if chunk_bytes > 0 else str(doc_id))
            texts.append(piece)
    return pa.table({"source": pa.array(["gutenberg"] * len(texts), pa.string()),
                     "doc_id": pa.array(doc_ids, pa.string()), "text": pa.array(texts, pa.string())})


def _sql_str(value) -> str:
    return "'" + str(value).replace("'", "''") + "'"


def mix_query(web: Path, section: dict) -> str:
    """The query that yields every output row with its split (the books come from table `book_pieces`)."""
    w = section["weights"]
    weights = ", ".join(f"({_sql_str(s)}, {float(w[s])!r})" for s in SOURCES)
    seed = int(section["seed"])
    return f"""WITH docs AS (
    SELECT source, doc_id, text FROM book_pieces
    UNION ALL
    SELECT 'fineweb' AS source, CAST(doc_id AS VARCHAR) AS doc_id, text FROM read_parquet({_sql_str(web)})
  ),
  weighted AS (
    SELECT d.*, w.weight,
           (md5_number(d.source || ':' || d.doc_id) % {_HASH_DIV})::DOUBLE / {_HASH_DIV} AS split_u,
           (md5_number('{seed}:w:' || d.source || ':' || d.doc_id) % {_HASH_DIV})::DOUBLE / {_HASH_DIV} AS weight_u
    FROM docs AS d JOIN (VALUES {weights}) AS w(source, weight) USING (source)
    WHERE d.text IS NOT NULL AND strlen(d.text) > 0 AND w.weight > 0
  ),
  rows AS (
    SELECT CASE WHEN split_u < {float(section['val_fraction'])!r} THEN 'val' ELSE 'train' END AS split,
           source, doc_id, text, weight, weight_u
    FROM weighted
  ),
  repeated AS (
    SELECT split, source, CASE WHEN rep = 0 THEN doc_id ELSE doc_id || '#' || CAST(rep AS VARCHAR) END AS doc_id,
           text, md5('{seed}:order:' || source || ':' || doc_id || ':' || CAST(rep AS VARCHAR)) AS order_key
    FROM rows, range(CAST(ceil(CASE WHEN split = 'val' THEN 1 ELSE weight END) AS BIGINT)) AS r(rep)
    WHERE split = 'val' OR rep < floor(weight) OR weight_u < weight - floor(weight)
  )
SELECT split, source, doc_id, text, order_key FROM repeated"""


def _why_no_train(section: dict, inputs: dict[str, tuple[Path, int]]) -> str:
    """Name the culprit of an empty train split: empty inputs, zero weights, or everything in val.

    `inputs` maps each source to (its file, its documents with text)."""
    weighted = [s for s in SOURCES if float(section["weights"][s]) > 0]
    if not weighted:
        return "the train split would be empty: every corpus.weights entry is 0"
    empty = [f"{inputs[s][0]}" for s in weighted if inputs[s][1] == 0]
    if len(empty) == len(weighted):
        return f"no text to mix: {' and '.join(empty)} hold no documents with text (check the data stages)"
    return (f"the train split would be empty: all {sum(inputs[s][1] for s in weighted):,} documents went to "
            f"val; lower corpus.val_fraction ({section['val_fraction']}) or add data")


def build(section: dict, books: Path, web: Path, train: Path, val: Path) -> dict:
    import duckdb

    book_table = book_pieces(books, section["chunk_bytes"])
    _read_table(web, "fineweb").schema  # checks the file before the query does
    with duckdb_connection(train.parent / ".duckdb_tmp") as con:
        con.register("book_pieces", book_table)
        sql = mix_query(web, section)
        con.execute(f"CREATE TEMP VIEW mixed AS {sql}")
        info("DuckDB query:\n" + sql)
        stats = con.execute(
            "SELECT split, source, count(*) AS docs, sum(strlen(text)) AS bytes FROM mixed "
            "GROUP BY ALL ORDER BY split, source").fetchall()
        if not any(row[0] == "train" and row[2] > 0 for row in stats):
            n_web = con.execute(f"SELECT count(*) FROM read_parquet({_sql_str(web)}) "
                                "WHERE text IS NOT NULL AND strlen(text) > 0").fetchone()[0]
            raise UserError(_why_no_train(section, {"gutenberg": (books, book_table.num_rows),
                                                    "fineweb": (web, n_web)}))
        if not any(row[0] == "val" and row[2] > 0 for row in stats):
            raise UserError("the val split would be empty: raise corpus.val_fraction or add data")
        with atomic_path(train) as tmp_train, atomic_path(val) as tmp_val:
            for split, tmp in (("train", tmp_train), ("val", tmp_val)):
                try:
                    con.execute(f"COPY (SELECT source, doc_id, text FROM mixed WHERE split = '{split}' "
                                f"ORDER BY order_key) TO {_sql_str(tmp)} "
                                f"(FORMAT parquet, COMPRESSION zstd, ROW_GROUP_SIZE {_ROW_GROUP})")
                except duckdb.Error as exc:  # a full disk or a read-only folder, in DuckDB's words
                    raise UserError(f"could not write the {split} split next to "
                                    f"{train if split == 'train' else val}: "
                                    f"{str(exc).strip().splitlines()[0]}") from None
    summary = {}
    for split, source, docs, nbytes in stats:
        summary.setdefault(split, {})[source] = {"documents": docs, "bytes": int(nbytes)}
        info(f"{split:5s} {source:9s} {docs:>9,} documents {int(nbytes):>14,} bytes")
    for split, path in (("train", train), ("val", val)):
        total = sum(v["bytes"] for v in summary.get(split, {}).values())
        info(f"wrote {path}: {total:,} bytes")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--books", default="data/gutenberg/books.parquet", help="books (gutenberg stage)")
    parser.add_argument("--web", default="data/web/web.parquet", help="web text (fineweb stage)")
    parser.add_argument("--train", default="data/corpus/train.parquet", help="output: training split")
    parser.add_argument("--val", default="data/corpus/val.parquet", help="output: validation split")


def run(args: argparse.Namespace) -> int:
    section = sections(args, "corpus")["corpus"]
    build(section, Path(args.books), Path(args.web), Path(args.train), Path(args.val))
    return 0
