"""What holds for every page script."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

APP = Path(__file__).parents[2] / "app"
SCRIPTS = [APP / "main.py", *sorted((APP / "pages").glob("*.py"))]


def _shown_by_magic(tree: ast.Module) -> list[int]:
    """Lines of the expressions Streamlit's magic would write to the page: any expression
    statement but a call, a yield, an await or a docstring."""
    docstrings = {
        id(node.body[0])
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    quiet = ast.Call | ast.Yield | ast.YieldFrom | ast.Await
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr)
        and id(node) not in docstrings
        and not isinstance(node.value, quiet)
    ]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_nothing_is_shown_by_streamlit_magic(script: Path) -> None:
    # A string after an assignment (an "attribute docstring") would appear as page text.
    shown = _shown_by_magic(ast.parse(script.read_text()))
    assert not shown, f"{script.name}: expressions Streamlit would display at lines {shown}"
