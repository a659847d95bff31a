"""The rooms of the code, checked: the floors of the package (an import points down or within
its own folder, never up or sideways, each exception written below with its reason), every
other folder reached through a folder's face (its `__init__`), no import cycle (imports inside
functions count; those under TYPE_CHECKING, for annotations, never run), no function over 120
lines, at most six modules at the top of `iscore/`; the engine never imports the app
(streamlit and plotly: ruff's banned-api rule, `pyproject.toml`); and no framework is named in
a string outside its own module, the importers, docstrings and help text (the rest asks the
registry). docs/architecture.md draws the floors.
"""

from __future__ import annotations

import ast
import importlib
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


def _face(tree: ast.Module, package: str) -> set[str]:
    """The submodules a lazy face (`lazy_loader.attach` in a package's `__init__`) hands out:
    what importing a name from the package runs."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "attach":
            for keyword in node.keywords:
                if keyword.arg == "submod_attrs" and isinstance(keyword.value, ast.Dict):
                    found |= {k.value for k in keyword.value.keys if isinstance(k, ast.Constant)}
                elif keyword.arg == "submodules" and isinstance(keyword.value, ast.List):
                    found |= {e.value for e in keyword.value.elts if isinstance(e, ast.Constant)}
    return {f"{package}.{name}" for name in found}


def _imports(name: str, path: Path) -> set[str]:
    """The iscore modules `name` imports when it runs, wherever the import stands (module
    level or inside a function; not under TYPE_CHECKING, which never runs), resolved to
    modules where they name one; a lazy face imports the submodules it hands out."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    annotations_only = _type_checking(tree)
    out = {t for t in _face(tree, name) if t in MODULES} if path.name == "__init__.py" else set()
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
            targets = [f"{base}.{alias.name}" for alias in node.names]
            # `from iscore import frameworks` runs the root's lazy face, which imports nothing.
            if base != "iscore" or not all(t in MODULES for t in targets):
                targets.append(base)
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
    assert "iscore.packed" in GRAPH["iscore.dump.tensors"]  # inside a function too, a face
    assert "iscore.frameworks.canonical" not in GRAPH["iscore.frameworks.base"]  # annotations
    assert "iscore.stats.mismatch" in GRAPH["iscore.stats"]  # a lazy face's submodules
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


# --------------------------------------------------------------------- floors

FLOORS: tuple[tuple[str, ...], ...] = (
    ("errors",),
    ("utils",),
    ("packed",),
    ("frameworks",),
    ("dump", "stats"),
    ("advice",),
    ("passes",),
    ("session", "present"),
    ("api",),
    ("bench",),
    ("cli", "app"),
    ("main",),
)
"""The folders, bottom first: a folder imports its own floor's folder (itself) and those below,
never a sibling on its floor. `api` is the package's root (`iscore.load` and the other public
names, handed out from the faces below it), `main` is `python -m iscore`."""

FLOOR = {folder: i for i, floor in enumerate(FLOORS) for folder in floor}

ALLOWED: dict[tuple[str, str], str] = {}
"""(importing module, imported module) -> why it may point up or sideways. None are needed."""


def _folder(name: str) -> str:
    """The folder a module lies in: `iscore.stats.noise` -> `stats`, `iscore.errors` ->
    `errors`, `iscore` -> `api`, `iscore.__main__` -> `main`, the app's modules -> `app`."""
    if name.startswith("iscore.app"):
        return "app"
    parts = name.split(".")
    if len(parts) == 1:
        return "api"
    return "main" if parts[1] == "__main__" else parts[1]


def test_every_folder_has_a_floor():
    """A new folder is placed on a floor here (and in docs/architecture.md) before it is used."""
    assert {_folder(name) for name in MODULES} <= set(FLOOR)


def _wrong_way(graph: dict[str, set[str]]) -> list[str]:
    """The imports that point up or sideways, not allowed in `ALLOWED`."""
    found = []
    for name, targets in sorted(graph.items()):
        mine = _folder(name)
        for target in sorted(targets):
            theirs = _folder(target)
            if theirs == mine or (name, target) in ALLOWED:
                continue
            if FLOOR[theirs] >= FLOOR[mine]:
                way = "sideways" if FLOOR[theirs] == FLOOR[mine] else "up"
                found.append(f"{name} ({mine}) -> {target} ({theirs}): {way}")
    return found


def test_the_floor_check_fails_on_a_wrong_way_import():
    graph = {
        "iscore.stats.noise": {"iscore.advice.flags", "iscore.packed.ops"},
        "iscore.dump.facade": {"iscore.stats"},
        "iscore.advice.flags": {"iscore.stats.noise"},
    }
    assert _wrong_way(graph) == [
        "iscore.dump.facade (dump) -> iscore.stats (stats): sideways",
        "iscore.stats.noise (stats) -> iscore.advice.flags (advice): up",
    ]


def test_every_import_points_down():
    found = _wrong_way(GRAPH)
    assert not found, "imports that point up or sideways:\n" + "\n".join(found)


FACE_EXCEPTIONS: dict[str, str] = {
    "iscore.bench.baselines": "the independent baselines reimplement each framework's math "
    "and read its spec classes from the framework's own module",
}
"""Modules (and the packages below them) that may import another folder's files directly."""


def _through_the_face(name: str, path: Path) -> list[str]:
    """The imports of `name` that reach into another folder's files (`from iscore.stats.noise
    import ...`) instead of its face (`from iscore.stats import ...`)."""
    if name.startswith(tuple(FACE_EXCEPTIONS)):
        return []
    mine = _folder(name)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "iscore" and len(parts) > 2 and _folder(node.module) != mine:
                found.append(f"line {node.lineno}: from {node.module} import ...")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_other_folders_are_reached_through_their_face(name):
    found = _through_the_face(name, MODULES[name])
    assert not found, f"{name} imports another folder's files:\n" + "\n".join(found)


def test_the_face_check_finds_an_import_into_a_file(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("from iscore.stats.noise import Noise\nfrom iscore.stats import noise\n")
    assert _through_the_face("iscore.advice.x", path) == [
        "line 1: from iscore.stats.noise import ..."
    ]
    assert _through_the_face("iscore.stats.x", path) == []


FACES = sorted(
    name for name, path in MODULES.items() if path.name == "__init__.py" and name.count(".") == 1
)


@pytest.mark.parametrize("name", FACES)
def test_each_folder_states_its_rule_and_its_names_exist(name):
    """A folder's docstring says what belongs in it and what it may import; every name its
    face hands out is there."""
    module = importlib.import_module(name)
    assert "Rule:" in (module.__doc__ or ""), f"{name}'s docstring states no rule"
    missing = [n for n in getattr(module, "__all__", ()) if not hasattr(module, n)]
    assert not missing


MAX_LINES = 120


def _long_functions(path: Path) -> list[str]:
    """The functions of `path` over `MAX_LINES` lines (their decorators and docstring count)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            lines = node.end_lineno - start + 1
            if lines > MAX_LINES:
                found.append(f"{node.name} (line {node.lineno}): {lines} lines")
    return found


def test_no_function_is_over_120_lines():
    found = [f"{name}: {f}" for name, path in MODULES.items() for f in _long_functions(path)]
    assert not found, "split into named steps:\n" + "\n".join(found)


def test_the_length_check_counts_a_long_function(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f():\n" + "    x = 1\n" * MAX_LINES + "\n\ndef g():\n    pass\n")
    assert _long_functions(path) == [f"f (line 1): {MAX_LINES + 1} lines"]


def test_at_most_six_modules_at_the_top():
    """Besides `__init__`, `__main__` and `errors`, a module of its own at the top of the
    package needs a reason: it belongs in a folder."""
    top = {p.stem for p in (ROOT / "iscore").glob("*.py")} - {"__init__", "__main__", "errors"}
    assert len(top) <= 6, sorted(top)


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
