"""Every module's doctests run: a docstring's worked example is checked like any other test.

A module holds doctests when its source has a `>>>` line; each such module is imported and run with
`doctest.testmod`. Examples that need files or a GPU say so with `# doctest: +SKIP`.
"""

import doctest
import importlib
import importlib.util
import io
from contextlib import redirect_stdout

import pytest

from nanoeuler.config import REPO_ROOT

PACKAGE = REPO_ROOT / "nanoeuler"


def modules_with_doctests() -> list[str]:
    """Dotted names of the modules under nanoeuler/ whose source holds a `>>>` example.

    >>> "nanoeuler.kernels.bf16.plan" in modules_with_doctests()
    True
    """
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name != "__main__.py" and ">>> " in path.read_text(encoding="utf-8"):
            parts = path.relative_to(REPO_ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


def test_the_collection_finds_the_modules_that_hold_examples():
    names = modules_with_doctests()
    assert len(names) >= 30
    assert "nanoeuler.model.layers" in names and "nanoeuler.kernels.bf16" in names
    assert doctest.testmod(importlib.import_module(__name__)).attempted >= 1  # this module's own example


@pytest.mark.parametrize("name", modules_with_doctests())
def test_module_doctests(name):
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        # the GPU modules import CuPy when loaded; without it (CPU-only CI) their examples cannot run
        if exc.name == "cupy" and importlib.util.find_spec("cupy") is None:
            pytest.skip(f"{name} imports CuPy, which is not installed")
        raise
    out = io.StringIO()
    with redirect_stdout(out):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples failed\n{out.getvalue()}"
