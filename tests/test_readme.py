"""README.md renders as written: every markdown table is one block under its header row."""

import re

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
