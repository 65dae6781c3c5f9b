#!/usr/bin/env python3
"""The Python 3.11 documentation as input of `nanoeuler corpus`: one "book" per reStructuredText source.

    dpkg-deb -x python3.11-doc_*_all.deb dl/pydoc
    python scripts/pydoc_books.py dl/pydoc data    # -> data/books.parquet, data/web.parquet

Debian's python3.11-doc ships the sources of its HTML pages as usr/share/doc/python3.11/html/_sources/
**/*.rst.txt (about 10.8 MB in 3.11.2). Each file becomes a row of books.parquet with the gutenberg
stage's columns (source "gutenberg", doc_id = title = its path under _sources/, e.g. "library/os.rst.txt").
web.parquet is written empty, with the fineweb stage's columns, because `nanoeuler corpus` reads both.
Both files are written under a temporary name and renamed, so a stopped run leaves no partial output.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SOURCES = Path("usr/share/doc/python3.11/html/_sources")


def write_parquet(table, path: Path) -> None:
    import pyarrow.parquet as pq

    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(table, tmp)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    import pyarrow as pa

    if len(argv) != 2:
        print("usage: pydoc_books.py UNPACKED_DEB OUT_DIR", file=sys.stderr)
        return 2
    root, out = Path(argv[0]) / SOURCES, Path(argv[1])
    files = sorted(root.rglob("*.rst.txt"))
    if not files:
        print(
            f"pydoc_books: error: no *.rst.txt files under {root} (is {argv[0]} the unpacked python3.11-doc .deb?)",
            file=sys.stderr,
        )
        return 1
    texts = [f.read_text(encoding="utf-8") for f in files]
    ids = [str(f.relative_to(root)) for f in files]
    out.mkdir(parents=True, exist_ok=True)
    empty = pa.array([], pa.string())  # books.parquet last: once it exists, both files do
    write_parquet(pa.table({"source": empty, "doc_id": empty, "text": empty}), out / "web.parquet")
    write_parquet(
        pa.table({"source": ["gutenberg"] * len(ids), "doc_id": ids, "title": ids, "text": texts}),
        out / "books.parquet",
    )
    print(f"pydoc_books: {len(ids)} documents, {sum(len(t.encode()) for t in texts):,} bytes -> {out}/books.parquet")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
