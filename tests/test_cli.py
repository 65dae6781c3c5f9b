"""The CLI lists every stage, and every stage module has the add_arguments/run pair."""

import argparse
import importlib
import subprocess
import sys

import pytest

from nanoeuler.cli import COMMANDS, main


def test_help_lists_every_stage():
    out = subprocess.run([sys.executable, "-m", "nanoeuler", "--help"], capture_output=True, text=True, check=True)
    for name in COMMANDS:
        assert name in out.stdout


@pytest.mark.parametrize("name", list(COMMANDS))
def test_stage_module_has_arguments_and_run(name):
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    assert callable(module.run)
    assert parser.format_help()


def test_unknown_stage_exits_with_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["no-such-stage"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_user_error_is_one_line_and_exit_1(tmp_path):
    missing = tmp_path / "nope.yaml"
    out = subprocess.run(
        [sys.executable, "-m", "nanoeuler", "alpaca", "--config", str(missing), "--out", str(tmp_path / "a.jsonl")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "nope.yaml" in lines[0]
    assert not (tmp_path / "a.jsonl").exists()


def test_version_is_the_packages_one():
    import importlib.metadata

    import nanoeuler
    from nanoeuler.config import REPO_ROOT

    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on
    out = subprocess.run([sys.executable, "-m", "nanoeuler", "--version"], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout == f"nanoeuler {nanoeuler.__version__}\n"
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    assert project["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "nanoeuler.__version__"}
    assert importlib.metadata.version("nanoeuler") == nanoeuler.__version__  # what pip installed says the same
