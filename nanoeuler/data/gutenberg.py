"""`nanoeuler gutenberg`: download Project Gutenberg books and keep only the book itself.

Every plain-text Gutenberg file wraps the book in a header (title, author, release date) and a
license, with one marker line on each side:

    Title: Pride and Prejudice
    ...
    *** START OF THE PROJECT GUTENBERG EBOOK PRIDE AND PREJUDICE ***
    <the book>
    *** END OF THE PROJECT GUTENBERG EBOOK PRIDE AND PREJUDICE ***
    <license>

`strip_license` keeps exactly the text between the two marker lines. Older files say "THIS
PROJECT GUTENBERG EBOOK", some omit the space after the stars, and files come with CRLF line ends,
a byte-order mark or trailing spaces; all of these are accepted.

Output: a parquet file with one row per book: source ("gutenberg"), doc_id (the ebook number),
title, text.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from nanoeuler.config import add_config_arguments, sections
from nanoeuler.data.common import add_source_root_argument, atomic_path, info, warn
from nanoeuler.errors import UserError
from nanoeuler.files import BOOK, read_bytes

_MARKER = r"^[ \t]*\*{3}[ \t]*{which}[ \t]+OF[ \t]+(?:THE|THIS)[ \t]+PROJECT[ \t]+GUTENBERG[ \t]+E-?BOOK\b.*$"
START_RE = re.compile(_MARKER.replace("{which}", "START"), re.IGNORECASE | re.MULTILINE)
END_RE = re.compile(_MARKER.replace("{which}", "END"), re.IGNORECASE | re.MULTILINE)
TITLE_RE = re.compile(r"^Title:[ \t]*(.*)$", re.MULTILINE)


def normalize(text: str) -> str:
    """Drop a byte-order mark, turn CRLF/CR into LF and remove trailing spaces on every line."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    return re.sub(r"[ \t]+$", "", text, flags=re.MULTILINE)


def strip_license(raw: str, book_id: int | str = "?") -> tuple[str, str]:
    """Return (title, body) of one Gutenberg file; body is the text strictly between the markers.

    >>> strip_license("Title: Tiny\\n*** START OF THE PROJECT GUTENBERG EBOOK TINY ***\\nHello.\\n"
    ...               "*** END OF THE PROJECT GUTENBERG EBOOK TINY ***\\nlicense")
    ('Tiny', 'Hello.')
    """
    text = normalize(raw)
    start = START_RE.search(text)
    if start is None:
        raise UserError(f"gutenberg book {book_id}: no '*** START OF THE PROJECT GUTENBERG EBOOK' marker line")
    end = END_RE.search(text, start.end())
    if end is None:
        raise UserError(f"gutenberg book {book_id}: no '*** END OF THE PROJECT GUTENBERG EBOOK' marker line "
                        "after the START marker")
    body = text[start.end():end.start()].strip("\n")
    if not body.strip():
        raise UserError(f"gutenberg book {book_id}: nothing between the START and END markers")
    return _title(text[:start.start()]), body


def _title(header: str) -> str:
    """The `Title:` header line, with its indented continuation lines (long titles wrap)."""
    m = TITLE_RE.search(header)
    if m is None:
        return ""
    parts = [m.group(1).strip()]
    for line in header[m.end() + 1:].split("\n"):
        if not line[:1].isspace() or not line.strip():
            break
        parts.append(line.strip())
    return " ".join(p for p in parts if p)


def decode(data: bytes, book_id) -> str:
    """Gutenberg's cache serves UTF-8; a few old files are Latin-1."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        warn(f"gutenberg book {book_id} is not valid UTF-8; reading it as Latin-1")
        return data.decode("latin-1")


def sources(section: dict) -> list[str]:
    """Where each configured book comes from (one per id)."""
    template = section["url_template"]
    if "{id}" not in template:
        raise UserError(f"config key 'gutenberg.url_template' must contain {{id}}, got {template!r}")
    try:
        return [template.format(id=book_id) for book_id in section["ids"]]
    except (KeyError, IndexError, ValueError) as exc:
        raise UserError(f"config key 'gutenberg.url_template' has a bad placeholder ({exc}): {template!r}") from None


def build(section: dict, raw_dir: Path, out: Path, root: str = ".") -> int:
    """Download (or reuse) every book, strip it and write the parquet file. Returns the book count."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from tqdm import tqdm

    from nanoeuler.data.download import NetworkError, fetch, fetch_options

    ids = list(dict.fromkeys(section["ids"]))  # keep the order, drop repeats
    if not ids:
        raise UserError("config key 'gutenberg.ids' is empty: list at least one book")
    rows: dict[str, list] = {"source": [], "doc_id": [], "title": [], "text": []}
    skipped = []
    fetched = cached = 0
    for book_id, source in tqdm(list(zip(ids, sources({**section, "ids": ids}))), desc="books",
                                unit="book", disable=None):
        path = raw_dir / f"{book_id}.txt"

        def check(p, book_id=book_id):
            return strip_license(decode(read_bytes(p, "book", BOOK), book_id), book_id)

        try:
            if fetch(source, path, root=root, check=check, limit=BOOK, **fetch_options(section)):
                fetched += 1
            else:
                cached += 1
            title, body = check(path)
        except UserError as exc:
            if not section["skip_bad"] or isinstance(exc, NetworkError):  # no network: no book will come
                raise
            warn(f"skipping book {book_id}: {exc}")
            skipped.append(book_id)
            continue
        rows["source"].append("gutenberg")
        rows["doc_id"].append(str(book_id))
        rows["title"].append(title)
        rows["text"].append(body)
        info(f"book {book_id}: {title or '(no title)'}: {len(body.encode()):,} bytes")
    if not rows["text"]:
        raise UserError(f"no usable books: all {len(ids)} were skipped")
    table = pa.table(rows, schema=pa.schema([("source", pa.string()), ("doc_id", pa.string()),
                                             ("title", pa.string()), ("text", pa.string())]))
    with atomic_path(out) as tmp:
        pq.write_table(table, tmp, compression="zstd")
    total = sum(len(t.encode()) for t in rows["text"])
    info(f"wrote {out}: {len(rows['text'])} books, {total:,} bytes of text "
         f"({fetched} fetched, {cached} already there, {len(skipped)} skipped"
         + (f": {', '.join(map(str, skipped))}" if skipped else "") + ")")
    return len(rows["text"])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser)
    parser.add_argument("--out", default="data/gutenberg/books.parquet", help="output parquet file")
    parser.add_argument("--raw-dir", default="data/gutenberg/raw", help="download cache, one {id}.txt per book")
    add_source_root_argument(parser)


def run(args: argparse.Namespace) -> int:
    section = sections(args, "gutenberg")["gutenberg"]
    build(section, Path(args.raw_dir), Path(args.out), root=args.source_root)
    return 0
