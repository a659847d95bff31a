"""`iscore app`: Streamlit run from the checkout, with the dump and Streamlit's own flags."""

from __future__ import annotations

import os
import sys

import pytest

from iscore import cli
from tests.app.conftest import APP, DATA, ROOT


@pytest.fixture
def launched(monkeypatch) -> dict:
    """What `iscore app` would exec, instead of exec'ing it."""
    seen: dict = {}
    monkeypatch.setattr(os, "chdir", lambda path: seen.setdefault("cwd", path))
    monkeypatch.setattr(os, "execv", lambda path, argv: seen.setdefault("argv", argv))
    return seen


def test_dump_and_streamlit_flags(launched: dict, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    cli.main(["app", "data/fp8.parquet", "--server.port", "8600", "--theme.base=dark"])
    assert launched["cwd"] == ROOT
    assert launched["argv"] == [
        sys.executable, "-m", "streamlit", "run", str(APP),
        "--server.port", "8600", "--theme.base=dark",
        "--", "--path", str(DATA / "fp8.parquet"),
    ]  # fmt: skip


def test_no_dump(launched: dict) -> None:
    cli.main(["app", "--server.headless", "true"])
    assert launched["argv"][-2:] == ["--server.headless", "true"]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["app", "nowhere.parquet"], "nowhere.parquet: no such file"),
        (["app", "a.parquet", "b.parquet"], "Expected one dump"),
        (["app", "--steps", "3"], "Expected Streamlit's --section.option flags"),
        (["app", "--server.port"], "Expected a value after --server.port"),
    ],
)
def test_mistakes_are_one_line_errors(launched: dict, capsys, argv: list, message: str) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert "argv" not in launched


def test_help(capsys) -> None:
    assert cli.main(["app", "--help"]) == 0
    assert "usage: iscore app [DUMP]" in capsys.readouterr().out
