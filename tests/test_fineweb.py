"""FineWeb-Edu sampling with DuckDB on generated parquet files: filters, byte budget, determinism, bad files."""

from __future__ import annotations

import hashlib
import random

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from nanoeuler.config import REPO_ROOT, load_config
from nanoeuler.data import fineweb
from nanoeuler.errors import UserError

COLUMNS = [
    "text",
    "id",
    "dump",
    "url",
    "date",
    "file_path",
    "language",
    "language_score",
    "token_count",
    "score",
    "int_score",
]


def make_parquet(path, n=200, seed=0, start=0, drop=()):
    rng = random.Random(seed)
    rows = []
    for i in range(start, start + n):
        words = " ".join(
            rng.choice(["water", "light", "cell", "énergie", "map", "number"]) for _ in range(rng.randint(5, 120))
        )
        rows.append(
            {
                "text": f"Doc {i}. {words}",
                "id": f"<urn:uuid:{i:08d}>",
                "dump": "CC-MAIN-2024-10",
                "url": f"https://example.org/{i}",
                "date": "2024-02-01T00:00:00Z",
                "file_path": "s3://x",
                "language": "en",
                "language_score": round(rng.uniform(0.5, 1.0), 3),
                "token_count": len(words.split()),
                "score": 0.0,
                "int_score": rng.randint(1, 5),
            }
        )
    table = pa.Table.from_pylist(rows).drop_columns(list(drop))
    pq.write_table(table, path, row_group_size=50)
    return rows


def section(**over):
    base = {
        "base_url": "",
        "files": [],
        "min_int_score": 3,
        "min_language_score": 0.8,
        "byte_budget": 10**9,
        "seed": 0,
        "delay_s": 0.0,
        "timeout_s": 60.0,
        "retries": 0,
    }
    return {**base, **over}


def expected(rows, cfg):
    """The same sample, computed in Python: filter, order by md5(seed:id), longest prefix within budget."""
    keep = [
        r
        for r in rows
        if (cfg["min_int_score"] is None or r["int_score"] >= cfg["min_int_score"])
        and (cfg["min_language_score"] is None or r["language_score"] >= cfg["min_language_score"])
    ]
    keep.sort(key=lambda r: hashlib.md5(f"{cfg['seed']}:{r['id']}".encode()).hexdigest())
    out, total = [], 0
    for r in keep:
        total += len(r["text"].encode("utf-8"))
        if total > cfg["byte_budget"]:
            break
        out.append(r["id"])
    return out


def read_ids(path):
    table = pq.read_table(path)
    assert table.column_names == ["source", "doc_id", "text"]
    assert set(table.column("source").to_pylist()) == {"fineweb"}
    return table.column("doc_id").to_pylist(), sum(len(t.encode()) for t in table.column("text").to_pylist())


def test_filters_and_byte_budget_match_a_python_reference(tmp_path):
    rows = make_parquet(tmp_path / "a.parquet")
    filtered_bytes = sum(len(r["text"].encode()) for r in rows if r["int_score"] >= 3 and r["language_score"] >= 0.8)
    cfg = section(byte_budget=filtered_bytes // 3)
    docs, nbytes = fineweb.sample([tmp_path / "a.parquet"], cfg, tmp_path / "web.parquet")
    ids, got_bytes = read_ids(tmp_path / "web.parquet")
    assert ids == expected(rows, cfg)
    assert (docs, nbytes) == (len(ids), got_bytes)
    assert 0 < got_bytes <= cfg["byte_budget"]
    assert got_bytes > cfg["byte_budget"] - 2000  # the prefix stops only when the next document would not fit


def test_budget_larger_than_the_data_keeps_every_filtered_document(tmp_path):
    rows = make_parquet(tmp_path / "a.parquet")
    cfg = section()
    fineweb.sample([tmp_path / "a.parquet"], cfg, tmp_path / "web.parquet")
    ids, _ = read_ids(tmp_path / "web.parquet")
    assert sorted(ids) == sorted(r["id"] for r in rows if r["int_score"] >= 3 and r["language_score"] >= 0.8)
    assert ids == expected(rows, cfg)


def test_null_thresholds_filter_nothing(tmp_path):
    rows = make_parquet(tmp_path / "a.parquet", n=50)
    fineweb.sample(
        [tmp_path / "a.parquet"], section(min_int_score=None, min_language_score=None), tmp_path / "web.parquet"
    )
    assert len(read_ids(tmp_path / "web.parquet")[0]) == len(rows)


def test_sample_is_deterministic_and_seeded(tmp_path):
    make_parquet(tmp_path / "a.parquet")
    cfg = section(byte_budget=20_000)
    fineweb.sample([tmp_path / "a.parquet"], cfg, tmp_path / "one.parquet")
    fineweb.sample([tmp_path / "a.parquet"], cfg, tmp_path / "two.parquet")
    fineweb.sample([tmp_path / "a.parquet"], {**cfg, "seed": 1}, tmp_path / "three.parquet")
    one, two, three = (read_ids(tmp_path / f"{n}.parquet")[0] for n in ("one", "two", "three"))
    assert one == two
    assert one != three


def test_several_files_are_sampled_together(tmp_path):
    rows = make_parquet(tmp_path / "a.parquet", n=80, seed=1) + make_parquet(
        tmp_path / "b.parquet", n=80, seed=2, start=80
    )
    cfg = section(byte_budget=15_000)
    fineweb.sample([tmp_path / "a.parquet", tmp_path / "b.parquet"], cfg, tmp_path / "web.parquet")
    ids, _ = read_ids(tmp_path / "web.parquet")
    assert ids == expected(rows, cfg)
    assert any(int(i[10:18]) < 80 for i in ids) and any(int(i[10:18]) >= 80 for i in ids)


def test_query_is_logged(tmp_path, capsys):
    make_parquet(tmp_path / "a.parquet", n=20)
    fineweb.sample([tmp_path / "a.parquet"], section(), tmp_path / "web.parquet")
    err = capsys.readouterr().err
    assert "DuckDB query:" in err and "read_parquet" in err and "int_score >= 3" in err and "running_bytes <=" in err


def test_file_without_text_column_is_an_error_naming_it(tmp_path):
    make_parquet(tmp_path / "a.parquet", n=10, drop=["text"])
    with pytest.raises(UserError, match=r"a\.parquet has no 'text' column"):
        fineweb.sample([tmp_path / "a.parquet"], section(), tmp_path / "web.parquet")
    assert not (tmp_path / "web.parquet").exists()


def test_missing_score_column_is_an_error_unless_its_filter_is_off(tmp_path):
    make_parquet(tmp_path / "a.parquet", n=10, drop=["int_score"])
    with pytest.raises(UserError, match=r"no 'int_score' column, needed by config key 'fineweb.min_int_score'"):
        fineweb.sample([tmp_path / "a.parquet"], section(), tmp_path / "web.parquet")
    fineweb.sample([tmp_path / "a.parquet"], section(min_int_score=None), tmp_path / "web.parquet")


def test_file_without_id_column_gets_ids_from_file_and_row(tmp_path):
    make_parquet(tmp_path / "a.parquet", n=10, drop=["id"])
    fineweb.sample(
        [tmp_path / "a.parquet"], section(min_int_score=None, min_language_score=None), tmp_path / "web.parquet"
    )
    ids, _ = read_ids(tmp_path / "web.parquet")
    assert sorted(ids) == sorted(f"a.parquet:{i}" for i in range(10))


@pytest.mark.parametrize("keep", [0.5, 0.99])
def test_truncated_file_is_an_error_naming_it(tmp_path, keep):
    make_parquet(tmp_path / "whole.parquet", n=100)
    data = (tmp_path / "whole.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(UserError, match=r"cut\.parquet is not a readable parquet file"):
        fineweb.sample([tmp_path / "cut.parquet"], section(), tmp_path / "web.parquet")
    assert not (tmp_path / "web.parquet").exists()


def test_nothing_left_is_an_error(tmp_path):
    make_parquet(tmp_path / "a.parquet", n=10)
    with pytest.raises(UserError, match="no FineWeb document passed the filters"):
        fineweb.sample([tmp_path / "a.parquet"], section(byte_budget=1), tmp_path / "web.parquet")
    assert not (tmp_path / "web.parquet").exists()


def test_stage_on_the_sample_file(tmp_path):
    cfg = load_config(REPO_ROOT / "config" / "tiny.yaml")["fineweb"]
    docs, nbytes = fineweb.build(cfg, tmp_path / "raw", tmp_path / "web.parquet", root=REPO_ROOT)
    sample = pq.read_table(REPO_ROOT / "data" / "sample" / "fineweb" / "sample_000.parquet")
    assert sample.column_names == COLUMNS
    assert 0 < docs < sample.num_rows  # the low-score and non-English rows are filtered out
    ids, got = read_ids(tmp_path / "web.parquet")
    assert (len(ids), got) == (docs, nbytes)
