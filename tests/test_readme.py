"""README.md and the pages beside it render as written: every table is one block under its header row, and
every relative link and anchor resolves."""

import re

import pytest

from nanoeuler.config import REPO_ROOT

SEPARATOR = re.compile(r"^\|(\s*:?-+:?\s*\|)+$")  # |---|:--:|


def table_blocks(text: str) -> list[tuple[int, list[str]]]:
    """(first line number, lines) of each run of lines starting with '|', outside code fences."""
    blocks, current, fenced = [], None, False
    for number, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            fenced = not fenced
        if line.startswith("|") and not fenced:
            if current is None:
                current = (number, [])
                blocks.append(current)
            current[1].append(line.rstrip())
        else:
            current = None
    return blocks


def test_every_readme_table_has_its_header_and_no_blank_line_inside():
    """A blank line cut the subcommand table in two: the rows after it rendered as plain text."""
    blocks = table_blocks((REPO_ROOT / "README.md").read_text(encoding="utf-8"))
    assert len(blocks) >= 5
    for first, lines in blocks:
        assert len(lines) >= 3 and SEPARATOR.match(lines[1]), f"README.md line {first}: a table without its header"
        width = lines[0].count("|")
        assert all(line.count("|") - line.count(r"\|") >= width for line in lines), f"README.md line {first}"


def test_a_table_cut_by_a_blank_line_is_found():
    text = "| a | b |\n|---|---|\n| 1 | 2 |\n\n| 3 | 4 |\n"
    assert [len(lines) for _, lines in table_blocks(text)] == [3, 1]


PAGES = ["README.md", "BENCHMARKS.md", "docs/ARCHITECTURE.md", "docs/benchmarks-log.md"]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens.

    >>> slug("Training step (GPU): bf16 engine vs torch.compile")
    'training-step-gpu-bf16-engine-vs-torchcompile'
    """
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (outside code fences); a repeated heading gets -1, -2, ..."""
    seen, fenced = {}, False
    for line in text.splitlines():
        fenced ^= line.startswith("```")
        if not fenced and re.match(r"#{1,6} ", line):
            base = slug(line.lstrip("#"))
            n = seen.get(base, 0)
            seen[base] = n + 1
            seen.setdefault(f"{base}-{n}" if n else base, 1)
    return set(seen)


@pytest.mark.parametrize("page", PAGES)
def test_every_relative_link_and_anchor_resolves(page):
    """Moving the benchmark history to docs/ must not leave a link pointing at a section that moved."""
    path = REPO_ROOT / page
    for target in LINK.findall(path.read_text(encoding="utf-8")):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        file, _, anchor = target.partition("#")
        linked = (path.parent / file).resolve() if file else path
        assert linked.exists(), f"{page}: link to {target}: no such file"
        if anchor and linked.suffix == ".md":
            assert anchor in anchors(linked.read_text(encoding="utf-8")), f"{page}: link to {target}: no such heading"


def test_benchmarks_page_is_short_and_its_tables_render():
    text = (REPO_ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    assert len(text.splitlines()) <= 320, "BENCHMARKS.md: current figures only; history in docs/benchmarks-log.md"
    assert "docs/benchmarks-log.md" in text
    for first, lines in table_blocks(text):
        assert len(lines) >= 3 and SEPARATOR.match(lines[1]), f"BENCHMARKS.md line {first}: a table without its header"


def test_a_link_to_a_missing_heading_is_found():
    assert "kernel-notes" in anchors("# Log\n\n## Kernel notes\n")
    assert "run-14" not in anchors("# Log\n\n```\n## Run 14\n```\n")
