"""`make lint`'s workflow half: Snakemake's lint findings on this workflow are all accepted by design."""

import doctest
import importlib.util
import sys
from pathlib import Path

import pytest

from nanoeuler.config import REPO_ROOT

spec = importlib.util.spec_from_file_location("lint_workflow", REPO_ROOT / "scripts" / "lint_workflow.py")
lint_workflow = importlib.util.module_from_spec(spec)
spec.loader.exec_module(lint_workflow)


def test_examples():
    result = doctest.testmod(lint_workflow)
    assert result.attempted >= 2 and result.failed == 0


def test_the_workflow_has_no_finding_beyond_the_accepted(capsys):
    snakemake = Path(sys.executable).with_name("snakemake")  # the script's default, as under `make lint`
    if not snakemake.exists():
        pytest.skip("snakemake is not installed beside this Python")
    assert lint_workflow.main([str(snakemake)]) == 0
    out = capsys.readouterr().out
    assert "accepted findings, 0 others" in out and not out.startswith("lint_workflow: 0 accepted")
