"""The wheel as a new user gets it: built from this tree, installed in a fresh virtual
environment, and run from a folder that is not a checkout (`iscore validate`, the app's pages,
`iscore app`'s health endpoint)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.error
import urllib.request
import zipfile
from importlib.metadata import version
from pathlib import Path

import pytest

from tests.packaging.conftest import ROOT, SOURCES

START_SECONDS = 120
"""How long the app may take to answer its health endpoint (a cold start in a fresh venv)."""

PAGES = """
from pathlib import Path
import iscore
from streamlit.testing.v1 import AppTest

main = Path(iscore.__file__).parent / "app" / "main.py"
at = AppTest.from_file(str(main), default_timeout=120).run()
assert not at.exception, at.exception
print(main)
print(*next(s for s in at.selectbox if s.label == "Sample").options)
"""
"""Run in the fresh venv: the Data page of the installed app, with its sample picker."""


def _packages(folder: Path, name: str) -> set[str]:
    """`name` for `folder`, and a subpackage for each folder under it that holds Python files."""
    return {
        ".".join([name, *path.relative_to(folder).parts])
        for path in [folder, *folder.rglob("*")]
        if path.is_dir() and any(path.glob("*.py"))
    }


def test_every_package_is_listed() -> None:
    """pyproject.toml lists the packages by name (the app and the samples are mapped in, which
    rules out setuptools' discovery): a new engine package missing there would be left out of
    the wheel."""
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    expected = _packages(ROOT / "iscore", "iscore") | _packages(ROOT / "app", "iscore.app")
    assert set(listed["packages"]) == expected | {"iscore.data"}


def _run(*command: str | Path, cwd: Path | None = None, env: dict | None = None) -> str:
    """Run a command to completion; its output, or a failure that shows it."""
    done = subprocess.run(
        [str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, f"{command} exited {done.returncode}:\n{done.stdout}{done.stderr}"
    return done.stdout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(server: subprocess.Popen, url: str, log: Path) -> None:
    """Poll `url` until it answers 200; fail, with the server's log, if it exits or stays mute."""
    deadline = time.monotonic() + START_SECONDS
    while time.monotonic() < deadline:
        if server.poll() is not None:
            pytest.fail(f"iscore app exited {server.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"iscore app did not answer {url} in {START_SECONDS} s:\n{log.read_text()}")


@pytest.mark.wheel
def test_the_wheel_runs_with_no_checkout() -> None:
    # Not pytest's tmp_path: pytest keeps the last few, and this one holds a 1.5 GB venv.
    with tempfile.TemporaryDirectory(prefix="iscore-wheel-") as tmp:
        tmp = Path(tmp)
        src, dist, venv, user = tmp / "src", tmp / "dist", tmp / "venv", tmp / "user"
        # Built from a copy, so that setuptools' build/ folder, whose stale files would end up
        # in later wheels, never lands in the checkout.
        src.mkdir()
        for name in SOURCES:
            if (ROOT / name).is_dir():
                ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
                shutil.copytree(ROOT / name, src / name, ignore=ignore)
            else:
                shutil.copy(ROOT / name, src / name)
        _run(sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", dist, src)
        (wheel,) = dist.glob("iscore-*.whl")

        # The engine, the app (its static files and Streamlit config too) and the samples.
        shipped = set(zipfile.ZipFile(wheel).namelist())
        expected = {f"iscore/{p.relative_to(src / 'iscore')}" for p in src.glob("iscore/**/*.py")}
        expected |= {f"iscore/{p.relative_to(src)}" for p in src.glob("app/**/*") if p.is_file()}
        expected |= {
            f"iscore/data/{p.name}" for p in [*src.glob("data/*.parquet"), src / "data/README.md"]
        }
        assert not expected - shipped, f"missing from the wheel: {sorted(expected - shipped)}"

        # The README's order: the torch this environment runs (the CPU build) first, so that
        # the wheel's `torch>=2.4` never pulls another.
        _run(sys.executable, "-m", "venv", venv)
        _run(venv / "bin" / "pip", "install", "-q", f"torch=={version('torch')}")
        _run(venv / "bin" / "pip", "install", "-q", wheel)

        user.mkdir()
        shutil.copy(ROOT / "data" / "fp8.parquet", user / "run.parquet")
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith("STREAMLIT_") and k not in ("PYTHONPATH", "VIRTUAL_ENV")
        }
        validated = _run(venv / "bin" / "iscore", "validate", "run.parquet", cwd=user, env=env)
        assert "run.parquet: OK" in validated

        main, samples = _run(venv / "bin" / "python", "-c", PAGES, cwd=user, env=env).splitlines()
        assert Path(main).is_relative_to(venv), main
        assert samples.split() == sorted(p.stem for p in (ROOT / "data").glob("*.parquet"))

        port = _free_port()
        log = tmp / "app.log"
        with log.open("w") as out:
            server = subprocess.Popen(
                [venv / "bin" / "iscore", "app", "run.parquet", "--server.port", str(port)],
                cwd=user,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_healthy(server, f"http://127.0.0.1:{port}/_stcore/health", log)
            # Printed only when browser.serverAddress is set: the app's own config was read.
            assert f"URL: http://localhost:{port}" in log.read_text()
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
