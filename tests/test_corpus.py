"""Corpus mixing: hash split, weights, book chunking, byte counts, and clear errors."""

from __future__ import annotations

import collections

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanoeuler.data import corpus
from nanoeuler.errors import UserError


def write_inputs(tmp_path, n_books=6, n_web=300):
    books = {"source": [], "doc_id": [], "title": [], "text": []}
    for b in range(n_books):
        paras = [f"Book {b}, paragraph {p}: " + "the sea was calm and grey. " * (3 + p % 5) for p in range(60)]
        books["source"].append("gutenberg")
        books["doc_id"].append(str(1000 + b))
        books["title"].append(f"Book {b}")
        books["text"].append("\n\n".join(paras))
    pq.write_table(pa.table(books), tmp_path / "books.parquet")
    web = {
        "source": ["fineweb"] * n_web,
        "doc_id": [f"<urn:uuid:{i:06d}>" for i in range(n_web)],
        "text": [f"Web page {i} about fractions and maps." for i in range(n_web)],
    }
    pq.write_table(pa.table(web), tmp_path / "web.parquet")
    return tmp_path / "books.parquet", tmp_path / "web.parquet"


def section(**over):
    return {"weights": {"gutenberg": 1.0, "fineweb": 1.0}, "val_fraction": 0.1, "chunk_bytes": 1024, "seed": 0, **over}


def run(tmp_path, cfg, name="c"):
    books, web = tmp_path / "books.parquet", tmp_path / "web.parquet"
    train, val = tmp_path / f"{name}_train.parquet", tmp_path / f"{name}_val.parquet"
    summary = corpus.build(cfg, books, web, train, val)
    t, v = pq.read_table(train), pq.read_table(val)
    assert t.column_names == v.column_names == ["source", "doc_id", "text"]
    return t.to_pylist(), v.to_pylist(), summary


def test_chunk_text_cuts_at_paragraphs():
    text = "\n\n".join(f"paragraph {i} " + "x" * 40 for i in range(30))
    pieces = corpus.chunk_text(text, 200)
    assert "\n\n".join(pieces) == text
    assert all(len(p.encode()) >= 200 for p in pieces[:-1])
    assert all(len(p.encode()) < 200 + 60 for p in pieces)
    assert corpus.chunk_text(text, 0) == [text]


def test_split_is_a_partition_and_deterministic(tmp_path):
    write_inputs(tmp_path)
    train, val, summary = run(tmp_path, section())
    train2, val2, _ = run(tmp_path, section(), "again")
    assert (train, val) == (train2, val2)
    train_keys = {(r["source"], r["doc_id"]) for r in train}
    val_keys = {(r["source"], r["doc_id"]) for r in val}
    assert not train_keys & val_keys
    n_web = sum(1 for s, _ in train_keys | val_keys if s == "fineweb")
    assert n_web == 300
    assert 0.05 < len(val) / (len(train) + len(val)) < 0.16
    assert {r["source"] for r in val} == {"gutenberg", "fineweb"}  # book chunks reach val too
    assert all(":" in r["doc_id"] for r in train + val if r["source"] == "gutenberg")
    for split, rows in (("train", train), ("val", val)):
        for source in ("gutenberg", "fineweb"):
            mine = [r for r in rows if r["source"] == source]
            assert summary[split][source] == {
                "documents": len(mine),
                "bytes": sum(len(r["text"].encode()) for r in mine),
            }


def test_book_text_is_kept_whole_across_pieces(tmp_path):
    write_inputs(tmp_path)
    train, val, _ = run(tmp_path, section())
    pieces = sorted((r["doc_id"], r["text"]) for r in train + val if r["source"] == "gutenberg")
    by_book = collections.defaultdict(list)
    for doc_id, text in pieces:
        by_book[doc_id.split(":")[0]].append(text)
    books = pq.read_table(tmp_path / "books.parquet").to_pylist()
    assert {b["doc_id"]: b["text"] for b in books} == {k: "\n\n".join(v) for k, v in by_book.items()}


def test_train_is_interleaved_not_grouped_by_source(tmp_path):
    write_inputs(tmp_path)
    train, _, _ = run(tmp_path, section())
    first = [r["source"] for r in train[:60]]
    assert "gutenberg" in first and "fineweb" in first


def test_weights_repeat_or_thin_a_source_and_leave_val_alone(tmp_path):
    write_inputs(tmp_path)
    base_train, base_val, _ = run(tmp_path, section(), "base")
    n_books = sum(r["source"] == "gutenberg" for r in base_train)
    n_web = sum(r["source"] == "fineweb" for r in base_train)

    train, val, _ = run(tmp_path, section(weights={"gutenberg": 2.0, "fineweb": 0.5}), "w")
    assert val == base_val
    assert sum(r["source"] == "gutenberg" for r in train) == 2 * n_books
    assert sum(r["doc_id"].endswith("#1") for r in train) == n_books
    web = sum(r["source"] == "fineweb" for r in train)
    assert 0.35 * n_web < web < 0.65 * n_web

    train, val, _ = run(tmp_path, section(weights={"gutenberg": 0.0, "fineweb": 1.0}), "nobooks")
    assert {r["source"] for r in train + val} == {"fineweb"}


def test_changing_the_seed_reorders_train_but_keeps_the_split(tmp_path):
    write_inputs(tmp_path)
    train, val, _ = run(tmp_path, section(), "s0")
    train1, val1, _ = run(tmp_path, section(seed=1), "s1")
    assert sorted(r["doc_id"] for r in val) == sorted(r["doc_id"] for r in val1)
    assert [r["doc_id"] for r in train] != [r["doc_id"] for r in train1]
    assert sorted(r["doc_id"] for r in train) == sorted(r["doc_id"] for r in train1)


def test_empty_val_is_an_error_and_writes_nothing(tmp_path):
    write_inputs(tmp_path, n_books=1, n_web=2)
    with pytest.raises(UserError, match="val split would be empty"):
        run(tmp_path, section(val_fraction=1e-9, chunk_bytes=0))
    assert not list(tmp_path.glob("c_*.parquet"))


def test_missing_input_names_the_stage(tmp_path):
    write_inputs(tmp_path)
    (tmp_path / "web.parquet").unlink()
    with pytest.raises(UserError, match=r"fineweb file .*web\.parquet does not exist \(run the fineweb stage first\)"):
        run(tmp_path, section())


def test_byte_counts_are_logged(tmp_path, capsys):
    write_inputs(tmp_path)
    run(tmp_path, section())
    err = capsys.readouterr().err
    assert "DuckDB query:" in err
    for split in ("train", "val"):
        for source in ("gutenberg", "fineweb"):
            assert any(line.startswith(split) and source in line and "bytes" in line for line in err.splitlines())


def test_duckdb_runs_with_a_memory_budget_and_spills(tmp_path):
    """The data stages' DuckDB connection: a buffer budget, one thread, spill files in the given folder,
    which is removed again when empty."""
    from nanoeuler.data.common import duckdb_connection

    spill = tmp_path / ".duckdb_tmp"
    with duckdb_connection(spill) as con:
        limit, threads, tmp = con.execute(
            "SELECT current_setting('memory_limit'), current_setting('threads'), current_setting('temp_directory')"
        ).fetchone()
        assert threads == 1 and tmp == str(spill)
        assert limit.endswith(("GiB", "GB")) and float(limit.split()[0]) <= 2.0
    assert not spill.exists()
