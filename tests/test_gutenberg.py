"""License stripping on every marker variant, titles, bad books, and the stage on the sample books."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from nanoeuler import cli
from nanoeuler.config import REPO_ROOT, load_config
from nanoeuler.data import gutenberg
from nanoeuler.data.gutenberg import strip_license
from nanoeuler.errors import UserError

BODY = "CHAPTER I.\n\nIt was a dark night.\n\n  An indented line stays indented.\n\nThe end."


def make(start: str, end: str, *, nl: str = "\n", bom: bool = False, title: str = "Title: Night") -> str:
    text = nl.join(
        [
            "The Project Gutenberg eBook of Night",
            "",
            title,
            "Author: Someone",
            "",
            start,
            "",
            "",
            *BODY.split("\n"),
            "",
            end,
            "",
            "*** license text that must go ***",
            "more license",
        ]
    )
    return ("\ufeff" if bom else "") + text


VARIANTS = {
    "the": ("*** START OF THE PROJECT GUTENBERG EBOOK NIGHT ***", "*** END OF THE PROJECT GUTENBERG EBOOK NIGHT ***"),
    "this": (
        "*** START OF THIS PROJECT GUTENBERG EBOOK NIGHT ***",
        "*** END OF THIS PROJECT GUTENBERG EBOOK NIGHT ***",
    ),
    "no-space": ("***START OF THE PROJECT GUTENBERG EBOOK NIGHT***", "***END OF THE PROJECT GUTENBERG EBOOK NIGHT***"),
    "trailing-spaces": (
        "*** START OF THE PROJECT GUTENBERG EBOOK NIGHT ***   ",
        "*** END OF THE PROJECT GUTENBERG EBOOK NIGHT ***\t ",
    ),
    "lower-case": (
        "*** Start of the Project Gutenberg eBook Night ***",
        "*** End of the Project Gutenberg eBook Night ***",
    ),
    "e-book": (
        "*** START OF THIS PROJECT GUTENBERG E-BOOK NIGHT ***",
        "*** END OF THIS PROJECT GUTENBERG E-BOOK NIGHT ***",
    ),
    "no-title-in-marker": (
        "*** START OF THE PROJECT GUTENBERG EBOOK ***",
        "*** END OF THE PROJECT GUTENBERG EBOOK ***",
    ),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("nl", ["\n", "\r\n"], ids=["lf", "crlf"])
@pytest.mark.parametrize("bom", [False, True], ids=["nobom", "bom"])
def test_strip_keeps_exactly_the_text_between_the_markers(variant, nl, bom):
    start, end = VARIANTS[variant]
    title, body = strip_license(make(start, end, nl=nl, bom=bom), 7)
    assert body == BODY
    assert title == "Night"


def test_trailing_spaces_inside_the_book_are_removed_but_indentation_kept():
    start, end = VARIANTS["the"]
    raw = make(start, end).replace("It was a dark night.", "It was a dark night.   ")
    assert strip_license(raw)[1] == BODY


def test_end_marker_text_inside_the_book_is_not_a_marker_unless_on_its_own_line():
    start, end = VARIANTS["the"]
    raw = make(start, end).replace("The end.", "He said: *** END OF THE PROJECT GUTENBERG EBOOK *** is a line.")
    assert strip_license(raw)[1].endswith("He said: *** END OF THE PROJECT GUTENBERG EBOOK *** is a line.")


@pytest.mark.parametrize("drop", ["start", "end"])
def test_missing_marker_names_the_book(drop):
    start, end = VARIANTS["the"]
    raw = make("no marker here" if drop == "start" else start, "no marker here" if drop == "end" else end)
    with pytest.raises(UserError, match=rf"gutenberg book 1342: no '\*\*\* {drop.upper()} OF"):
        strip_license(raw, 1342)


def test_empty_book_is_an_error():
    with pytest.raises(UserError, match="nothing between"):
        strip_license(VARIANTS["the"][0] + "\n\n  \n" + VARIANTS["the"][1] + "\n", 5)


def test_titles():
    start, end = VARIANTS["the"]
    wrapped = "Title: A Very Long Title\n       That Wraps Onto a Second Line"
    assert strip_license(make(start, end, title=wrapped))[0] == "A Very Long Title That Wraps Onto a Second Line"
    assert strip_license(make(start, end, title="Title:   Spaced   "))[0] == "Spaced"
    assert strip_license(make(start, end, title="No title line"))[0] == ""


def _section(**over):
    cfg = load_config(REPO_ROOT / "config" / "tiny.yaml")["gutenberg"]
    return {**cfg, **over}


def test_stage_on_the_sample_books(tmp_path):
    out = tmp_path / "books.parquet"
    n = gutenberg.build(_section(), tmp_path / "raw", out, root=REPO_ROOT)
    rows = pq.read_table(out).to_pylist()
    assert n == len(rows) == 4
    assert pq.read_schema(out).names == ["source", "doc_id", "title", "text"]
    assert [r["doc_id"] for r in rows] == ["90001", "90002", "90003", "90004"]
    assert rows[0]["title"] == "The Lighthouse at Gull Point"
    for r in rows:
        assert r["source"] == "gutenberg"
        assert r["text"].startswith("CHAPTER I.")
        assert "PROJECT GUTENBERG" not in r["text"] and "End matter" not in r["text"]
        assert "\r" not in r["text"] and "\ufeff" not in r["text"]


def test_bad_book_stops_the_stage_or_is_skipped(tmp_path, capsys):
    src = tmp_path / "src"
    src.mkdir()
    (src / "1.txt").write_text(make(*VARIANTS["the"]))
    (src / "2.txt").write_text("just some text, no markers\n")
    section = _section(ids=[1, 2], url_template=str(src / "{id}.txt"))
    out = tmp_path / "books.parquet"
    with pytest.raises(UserError, match="gutenberg book 2: no"):
        gutenberg.build(section, tmp_path / "raw", out)
    assert not out.exists()
    gutenberg.build({**section, "skip_bad": True}, tmp_path / "raw", out)
    assert pq.read_table(out).column("doc_id").to_pylist() == ["1"]
    assert "warning: skipping book 2" in capsys.readouterr().err


def test_url_template_needs_an_id_placeholder():
    with pytest.raises(UserError, match=r"gutenberg.url_template' must contain \{id\}"):
        gutenberg.sources({"ids": [1], "url_template": "https://example.org/book.txt"})


def test_cli_error_is_one_line_and_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    params = json.dumps({"gutenberg": {"ids": [1], "url_template": "missing/{id}.txt"}})
    assert cli.main(["gutenberg", "--params", params]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("nanoeuler gutenberg: error: source file") and "missing/1.txt" in err
    assert not (tmp_path / "data" / "gutenberg" / "books.parquet").exists()
