"""The import order of docs/ARCHITECTURE.md ("Which way imports point"), held to the code: every module's
imports, read with `ast` (those inside functions too), point to its own line of the order or a line above,
and no modules import each other round a loop."""

import ast
import re

import pytest

from nanoeuler.config import REPO_ROOT

PACKAGE = REPO_ROOT / "nanoeuler"

# The order, top first, by the name under nanoeuler/ ("__init__": the package itself, which holds the version).
LAYERS = [
    ("__init__", "errors", "files", "backend", "config"),
    ("data", "tokenizer"),
    ("model",),
    ("optim",),
    ("kernels",),
    ("memory",),
    ("checkpoint",),
    ("train",),
    ("infer", "export"),
    ("eval", "serve"),
    ("checks",),
    ("cli", "__main__"),
]
LINE_OF = {name: i for i, names in enumerate(LAYERS) for name in names}

# The one way down: the model reaches the kernels by name, at run time, for CuPy arrays only.
BY_NAME_DOWNWARD = {"nanoeuler.model.dispatch": {"nanoeuler.kernels.ops", "nanoeuler.kernels.adamw"}}


def module_names() -> dict:
    """{dotted module name: path} of every module of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(name: str, path, modules) -> tuple[set, set]:
    """(modules of the package that `name` imports by statement, those it imports by name through
    importlib.import_module with a literal string). `from a.b import c` is module a.b.c where that is a
    module, else a.b."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found, by_name = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            for a in node.names:
                found.add(f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base)
        elif (
            isinstance(node, ast.Call)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) in ("import_module", "__import__")
            and node.args
            and isinstance(node.args[0], ast.Constant)
        ):
            by_name.add(str(node.args[0].value))
    inside = lambda m: m in modules  # noqa: E731
    return {m for m in found if inside(m)} - {name}, {m for m in by_name if inside(m)}


@pytest.fixture(scope="module")
def graph():
    modules = module_names()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def line_of(module: str) -> int:
    parts = module.split(".")
    top = parts[1] if len(parts) > 1 else "__init__"
    assert top in LINE_OF, f"{module}: nanoeuler/{top} is on no line of ARCHITECTURE.md's import order"
    return LINE_OF[top]


def doc_layers() -> list[tuple]:
    """The order as docs/ARCHITECTURE.md states it: the first column of its code block under the heading."""
    text = (REPO_ROOT / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    section = text.split("## Which way imports point", 1)[1]
    block = section.split("```", 2)[1]
    layers = []
    for line in block.splitlines():
        if line and not line[0].isspace():  # a line of the order; indented lines continue its description
            names = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
            layers.append(tuple(n.strip().rstrip("/") for n in names.split(",")))
    return layers


def test_the_order_here_is_the_documented_one():
    assert doc_layers() == LAYERS


def test_every_module_is_on_a_line():
    for name in module_names():
        line_of(name)


def downward_imports(graph: dict) -> list[str]:
    """Each import statement that points to a line below its module's, as a sentence."""
    return [
        f"{name} (line {line_of(name) + 1}) imports {dep} (line {line_of(dep) + 1})"
        for name, (deps, _) in sorted(graph.items())
        for dep in sorted(deps)
        if line_of(dep) > line_of(name)
    ]


def test_imports_point_to_the_same_line_or_above(graph):
    found = downward_imports(graph)
    assert not found, "\n".join(found)


def test_only_dispatch_reaches_down_and_only_by_name(graph):
    for name, (_, by_name) in sorted(graph.items()):
        down = {dep for dep in by_name if line_of(dep) > line_of(name)}
        assert down <= BY_NAME_DOWNWARD.get(name, set()), (name, down)
    assert graph["nanoeuler.model.dispatch"][1] == BY_NAME_DOWNWARD["nanoeuler.model.dispatch"]


def find_cycle(edges: dict) -> list | None:
    """One import loop as [a, b, ..., a], or None (depth-first search over the modules)."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_no_import_circles(graph):
    cycle = find_cycle({name: deps | by_name for name, (deps, by_name) in graph.items()})
    assert cycle is None, " -> ".join(cycle)


def test_the_checks_find_what_they_look_for():
    """A loop, an import inside a function and one that points down the order are each seen."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    modules = module_names()
    deps, _ = imports_of("nanoeuler.infer.engine", modules["nanoeuler.infer.engine"], modules)
    assert {"nanoeuler.infer.sampling", "nanoeuler.infer.cpu", "nanoeuler.checkpoint"} <= deps  # cpu: in a method
    fake = {
        "nanoeuler.model.transformer": ({"nanoeuler.train.loop", "nanoeuler.backend"}, set()),
        "nanoeuler.train.loop": ({"nanoeuler.model.transformer"}, set()),
    }
    assert downward_imports(fake) == ["nanoeuler.model.transformer (line 3) imports nanoeuler.train.loop (line 8)"]


def test_relative_imports_resolve(tmp_path):
    pkg = tmp_path / "nanoeuler" / "infer"
    pkg.mkdir(parents=True)
    (pkg / "engine.py").write_text("from .sampling import Sampling\nfrom ..train import loop\n")
    modules = {"nanoeuler.infer.sampling": None, "nanoeuler.train.loop": None, "nanoeuler.train": None}
    deps, _ = imports_of("nanoeuler.infer.engine", pkg / "engine.py", modules)
    assert deps == {"nanoeuler.infer.sampling", "nanoeuler.train.loop"}
