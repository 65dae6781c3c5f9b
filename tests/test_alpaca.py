"""Alpaca validation and cleaning: bad records reported by number in one line, empties and repeats dropped."""

from __future__ import annotations

import json

import pytest

from nanoeuler import cli
from nanoeuler.config import REPO_ROOT, load_config
from nanoeuler.data import alpaca
from nanoeuler.errors import UserError


def rec(i="Say hi.", x="", o="Hi!"):
    return {"instruction": i, "input": x, "output": o}


def test_clean_strips_drops_empty_outputs_and_exact_repeats():
    records = [
        rec(o=" Hi! \n"),
        rec(),
        rec(o="   "),
        rec(i="Add.", x="1, 2", o="3"),
        rec(i="Add.", x="1, 2", o="3"),
        rec(i="Add.", x="2, 2", o="4"),
        rec(i="  ", o="x"),
    ]
    kept, counts = alpaca.clean(records)
    assert kept == [rec(), rec(i="Add.", x="1, 2", o="3"), rec(i="Add.", x="2, 2", o="4")]
    assert counts == {"read": 7, "malformed": 0, "empty": 2, "duplicate": 2, "cut": 0, "written": 3}


def test_bad_records_are_reported_by_number_in_one_line():
    records = [rec(), "just a string", {"instruction": "x", "output": "y"}, rec(), rec(o=5), rec(x=None, o=["a"])]
    with pytest.raises(UserError) as err:
        alpaca.clean(records, source="alpaca_data.json")
    msg = str(err.value)
    assert "\n" not in msg
    assert msg.startswith("alpaca_data.json: 4 of 6 records are malformed (numbered from 1): ")
    assert "#2 is a str, not an object" in msg
    assert "#3 missing 'input'" in msg
    assert "#5 'output' is int (must be a string)" in msg
    assert "#6 'input' is NoneType, 'output' is list (must be a string)" in msg
    assert "#1 " not in msg and "#4 " not in msg


def test_many_bad_records_are_counted_not_all_listed():
    with pytest.raises(UserError, match=r"25 of 25 records are malformed .*#10 is a int.*; and 15 more$"):
        alpaca.clean(list(range(25)))


def test_skip_bad_drops_them_with_a_warning(capsys):
    kept, counts = alpaca.clean([rec(), 7, rec(i="Two.")], skip_bad=True)
    assert kept == [rec(), rec(i="Two.")]
    assert counts["malformed"] == 1
    assert "warning:" in capsys.readouterr().err


def test_max_records_keeps_the_first_ones():
    kept, counts = alpaca.clean([rec(i=f"Q{i}.") for i in range(10)], max_records=4)
    assert [r["instruction"] for r in kept] == ["Q0.", "Q1.", "Q2.", "Q3."]
    assert counts["cut"] == 6 and counts["written"] == 4


def test_nothing_usable_is_an_error():
    with pytest.raises(UserError, match="no usable records"):
        alpaca.clean([rec(o="")])


@pytest.mark.parametrize(
    "content, match",
    [
        ('{"instruction": "x"}', "must hold a JSON list of records, got a JSON dict"),
        ('[{"instruction": "x",]', r"not valid JSON \(.* at line 1 column"),
        (b"\xff\xfe[]", "is not UTF-8"),
    ],
)
def test_unreadable_files(tmp_path, content, match):
    path = tmp_path / "alpaca_data.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(UserError, match=match):
        alpaca.load_records(path)


def test_stage_on_the_sample_file(tmp_path, capsys):
    section = load_config(REPO_ROOT / "config" / "tiny.yaml")["alpaca"]
    out = tmp_path / "alpaca.jsonl"
    counts = alpaca.build(section, tmp_path / "raw", out, root=REPO_ROOT)
    lines = out.read_text(encoding="utf-8").splitlines()
    rows = [json.loads(line) for line in lines]
    assert len(rows) == counts["written"] > 100
    assert all(
        set(r) == {"instruction", "input", "output"} and all(isinstance(v, str) for v in r.values()) for r in rows
    )
    assert all(r["output"].strip() for r in rows)
    assert len({json.dumps(r, sort_keys=True) for r in rows}) == len(rows)
    assert counts["duplicate"] == 2 and counts["empty"] == 1  # what the sample file plants
    assert f"wrote {out}: {len(rows)} records" in capsys.readouterr().err


def test_cli_bad_file_fails_in_one_line_without_output(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.json").write_text(json.dumps([rec(), {"instruction": 1, "input": "", "output": "x"}]))
    params = json.dumps({"alpaca": {"url": "bad.json"}})
    assert cli.main(["alpaca", "--params", params, "--out", "out.jsonl"]) == 1
    err = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(err) == 1 and err[0].startswith("nanoeuler alpaca: error: ")
    assert "1 of 2 records are malformed" in err[0] and "#2 'instruction' is int" in err[0]
    assert not (tmp_path / "out.jsonl").exists()
