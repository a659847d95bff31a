"""`iscore app`: Streamlit run on the checkout's app (an editable install), with the dump and
Streamlit's own flags; tests/unit/test_packaging.py runs it from a wheel."""

from __future__ import annotations

import os
import sys

import pytest

from iscore import cli
from tests.app.conftest import DATA, ROOT

SERVE = ROOT / "app" / "serve.py"


@pytest.fixture
def launched(monkeypatch) -> dict:
    """What `iscore app` would exec, run in the checkout, instead of exec'ing it."""
    monkeypatch.chdir(ROOT)
    seen: dict = {}
    monkeypatch.setattr(os, "chdir", lambda path: seen.setdefault("cwd", path))
    monkeypatch.setattr(os, "execv", lambda path, argv: seen.setdefault("argv", argv))
    return seen


def test_dump_and_streamlit_flags(launched: dict, monkeypatch) -> None:
    monkeypatch.delenv("STREAMLIT_SERVER_ADDRESS", raising=False)
    cli.main(["app", "data/fp8.parquet", "--server.port", "8600", "--theme.base=dark"])
    assert "cwd" not in launched  # relative paths typed in the app start where it was started
    assert launched["argv"] == [
        sys.executable, "-m", "streamlit", "run", str(SERVE),
        "--server.port", "8600", "--theme.base", "dark", "--server.address", "127.0.0.1",
        "--", "--path", str(DATA / "fp8.parquet"),
    ]  # fmt: skip


def test_no_dump(launched: dict, monkeypatch) -> None:
    monkeypatch.delenv("STREAMLIT_SERVER_ADDRESS", raising=False)
    cli.main(["app", "--server.headless", "true"])
    assert launched["argv"][-4:] == [
        "--server.headless", "true", "--server.address", "127.0.0.1",
    ]  # fmt: skip


def test_an_address_given_is_kept(launched: dict, monkeypatch) -> None:
    monkeypatch.delenv("STREAMLIT_SERVER_ADDRESS", raising=False)
    cli.main(["app", "--server.address=0.0.0.0"])
    assert launched["argv"][-2:] == ["--server.address", "0.0.0.0"]
    monkeypatch.setenv("STREAMLIT_SERVER_ADDRESS", "10.0.0.2")
    launched.clear()
    cli.main(["app"])
    assert "--server.address" not in launched["argv"]


def test_iscore_options_go_to_the_script(launched: dict, tmp_path) -> None:
    cli.main(
        [
            "app", str(DATA / "fp8.parquet"), "--data-dir", str(tmp_path),
            "--allowed-host", "iscore.example.org", "--max-upload-tokens=1000",
            "--max-path-tokens", "2000", "--cache-mb", "512",
        ]
    )  # fmt: skip
    argv = launched["argv"]
    hosts = [argv[i + 1] for i, a in enumerate(argv) if a == "--server.allowedHosts"]
    assert hosts == ["localhost", "127.0.0.1", "::1", "iscore.example.org"]
    assert argv[argv.index("--") :] == [
        "--", "--path", str(DATA / "fp8.parquet"), "--data-dir", str(tmp_path),
        "--max-upload-tokens", "1000", "--max-path-tokens", "2000", "--cache-mb", "512",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["app", "nowhere.parquet"], "nowhere.parquet: no such file"),
        (["app", "a.parquet", "b.parquet"], "Expected one dump"),
        (["app", "--steps", "3"], "or Streamlit's --section.option flags"),
        (["app", "--server.port"], "Expected a value after --server.port"),
        (["app", "--data-dir", "nowhere/"], "Expected --data-dir to be a directory"),
        (["app", "--max-upload-tokens", "-5"], "to be a positive integer, but got -5"),
        (["app", "--cache-mb", "lots"], "to be a positive integer, but got lots"),
        (["app", "--max-path-tokens", "0"], "to be a positive integer, but got 0"),
        (["app", "data/fp8.parquet", "--follow"], "Expected a run's folder (a directory) with"),
        (["app", "--follow"], "with --follow, but got none"),
        (["app", "data", "--interval", "5"], "--interval is how often --follow looks"),
        (["app", "data", "--follow", "--interval", "0"], "a positive number, but got 0"),
        (["app", "data", "--follow", "--interval=soon"], "a positive number, but got soon"),
    ],
)
def test_mistakes_are_one_line_errors(launched: dict, capsys, argv: list, message: str) -> None:
    assert cli.main(argv) == 2
    assert message in capsys.readouterr().err
    assert "argv" not in launched


def test_help(capsys) -> None:
    assert cli.main(["app", "--help"]) == 0
    assert "usage: iscore app [DUMP]" in capsys.readouterr().out


def test_follow_a_run_folder_even_an_empty_one(launched: dict, tmp_path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cli.main(["app", str(run), "--follow", "--interval", "2.5"])
    argv = launched["argv"]
    assert argv[argv.index("--") :] == ["--", "--path", str(run), "--follow", "--interval", "2.5"]
    launched.clear()
    cli.main(["app", str(run), "--follow"])
    assert launched["argv"][-2:] == ["--interval", "10"]  # FOLLOW_INTERVAL_S


def test_a_followed_runs_slice_is_checked_against_its_whole_files(
    launched: dict, tmp_path, capsys
) -> None:
    run = tmp_path / "run"
    (run / "step_000000").mkdir(parents=True)
    data = (DATA / "drift.parquet").read_bytes()
    (run / "step_000000" / "rank_0000.parquet").write_bytes(data[:-10])  # being written
    assert cli.main(["app", str(run), "--follow", "--where", "nonsense > 1"]) is None
    assert launched["argv"][-2:] == ["--where", "nonsense > 1"]  # nothing whole to check yet
    launched.clear()
    (run / "step_000000" / "rank_0000.parquet").write_bytes(data)
    assert cli.main(["app", str(run), "--follow", "--where", "nonsense > 1"]) == 2
    assert "nonsense" in capsys.readouterr().err and "argv" not in launched
