"""The rooms of the code, checked: no import cycle, counting imports inside functions (those
under TYPE_CHECKING, for annotations, never run); the engine never imports the app
(streamlit and plotly: ruff's banned-api rule, `pyproject.toml`); and no framework is named in
a string outside its own module, the importers, docstrings and help text (the rest asks the
registry).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from iscore import frameworks

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"iscore": ROOT / "iscore", "iscore.app": ROOT / "app"}


def _modules() -> dict[str, Path]:
    """Every module of the engine and the app, by dotted name."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            parts = path.relative_to(folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join((package, *parts))
            if package == "iscore" and name.startswith("iscore.app"):
                continue
            found[name] = path
    return found


MODULES = _modules()


def _type_checking(tree: ast.Module) -> set[int]:
    """The nodes under `if TYPE_CHECKING:`: imports for annotations, which never run."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            inside.update(id(n) for child in node.body for n in ast.walk(child))
    return inside


def _imports(name: str, path: Path) -> set[str]:
    """The iscore modules `name` imports when it runs, wherever the import stands (module
    level or inside a function; not under TYPE_CHECKING, which never runs), resolved to
    modules where they name one."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    annotations_only = _type_checking(tree)
    out = set()
    for node in ast.walk(tree):
        if id(node) in annotations_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _without_parent_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Importing `a.b.c` runs `a` and `a.b` first, whatever they import: a package's
    `__init__` that imports its own submodules is no cycle, and neither is a submodule
    importing a sibling through its package. Edges from a module to a package it lies in are
    dropped; everything else counts."""
    return {
        name: {t for t in targets if not name.startswith(t + ".")}
        for name, targets in graph.items()
    }


def test_the_walk_sees_function_level_and_type_checking_imports():
    """The checker must count what a module-level scan misses, or it proves nothing."""
    assert "iscore.dump.importers" in GRAPH["iscore.dump.files"]  # inside a function
    assert "iscore.packed.batch" in GRAPH["iscore.dump.tensors"]  # inside a function too
    assert (
        "iscore.frameworks.canonical" not in GRAPH["iscore.frameworks.base"]
    )  # for annotations only
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycle():
    cycles = _cycles(_without_parent_packages(GRAPH))
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_the_engine_never_imports_the_app():
    engine = {n: t for n, t in GRAPH.items() if not n.startswith("iscore.app")}
    reached = sorted(
        n for n, targets in engine.items() if any(t.startswith("iscore.app") for t in targets)
    )
    assert not reached


# --------------------------------------------------------------------- framework names

NAMES = {fw.name for fw in frameworks.every()} | {fw.title for fw in frameworks.every()}
"""Every framework's `framework:` value and its name for people."""

HELP_KEYWORDS = {"help", "description", "usage", "epilog", "placeholder", "caption", "label"}
"""Keyword arguments whose value is text for people."""

HELP_CALLS = {
    "caption", "markdown", "info", "warning", "error", "success", "write", "text", "title",
    "header", "subheader", "expander", "text_area", "text_input", "toast",
}  # fmt: skip
"""Streamlit calls whose string arguments are text for people."""

OWNERS = ("iscore.frameworks", "iscore.dump.importers")
"""Where a framework may be named in code: its module and the readers of its own dumps."""


def _mentions(text: str) -> list[str]:
    """The framework names in `text`, as words (`verl`, `verl:preset`, `(verl|slime)`), not
    inside longer names (`skyrl_tldr_stack`)."""
    words = set(re.findall(r"[A-Za-z][A-Za-z0-9_-]*", text))
    return sorted(NAMES & words)


def _code_strings(path: Path) -> list[tuple[int, str]]:
    """The string constants of a module that are neither docstrings nor help text."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for first, second in zip([None, *body], body, strict=False):
                doc = isinstance(second, ast.Expr) and isinstance(second.value, ast.Constant)
                if doc and (first is None or isinstance(first, ast.Assign | ast.AnnAssign)):
                    skip.add(id(second.value))
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            help_args = list(node.args) if called in HELP_CALLS else []
            help_args += [k.value for k in node.keywords if k.arg in HELP_KEYWORDS]
            for arg in help_args:
                skip.update(id(n) for n in ast.walk(arg))
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
    ]


def test_the_checker_finds_a_framework_named_in_code(tmp_path):
    path = tmp_path / "m.py"
    path.write_text(
        '"""verl in a docstring is fine."""\nX = {"verl": 1}\nst.caption("TRL text")\n'
        'Y = "skyrl_tldr_stack"\nZ = r"^(verl|mis)$"\n'
    )
    found = sorted((line, _mentions(s)) for line, s in _code_strings(path))
    assert found == [(2, ["verl"]), (4, []), (5, ["verl"])]


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not n.startswith(OWNERS)))
def test_no_framework_is_named_outside_its_module(name):
    found = [
        f"line {line}: {text[:80]!r} names {', '.join(_mentions(text))}"
        for line, text in _code_strings(MODULES[name])
        if _mentions(text)
    ]
    assert not found, f"{name} names frameworks; ask the registry instead:\n" + "\n".join(found)
