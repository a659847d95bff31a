"""Browser tests: `streamlit run app/serve.py` on 127.0.0.1, driven in Debian's Chromium.

Never `playwright install`: pytest-playwright launches /usr/bin/chromium instead. The tests
are skipped, with the reason, where Chromium or playwright is missing.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

try:
    from playwright.sync_api import expect
except ImportError:  # the tests skip themselves, saying why
    pass
else:
    # A loaded machine (CI beside other jobs) can take more than playwright's default 5 s
    # between an upload and its first metrics; the assertions wait for content, never time it.
    expect.set_options(timeout=30_000)

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = Path("/usr/bin/chromium")
SCREENS = Path("/tmp/iscore-screens")
"""Where screenshots of every page are copied for people to look at."""


@pytest.fixture(scope="session")
def browser_type_launch_args(browser_type_launch_args: dict) -> dict:
    """Debian's Chromium, without the sandbox a container lacks and without network chatter."""
    return {
        **browser_type_launch_args,
        "executable_path": str(CHROMIUM),
        "args": [
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
        ],
    }


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def serving(
    arguments: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[str]:
    """The app served on a free local port by `python -m ARGUMENTS --server.port PORT` (run
    in the checkout), until the block ends: its URL, once it answers."""
    port = _free_port()
    with open(log_path, "wb") as log:
        server = subprocess.Popen(
            [
                sys.executable, "-m", *arguments,
                "--server.address", "127.0.0.1", "--server.port", str(port),
                "--server.headless", "true",
            ],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "STREAMLIT_BROWSER_GATHER_USAGE_STATS": "false", **(env or {})},
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(120):
            if server.poll() is not None:
                pytest.fail(f"streamlit exited with {server.returncode}:\n{log_path.read_text()}")
            try:
                with urllib.request.urlopen(f"{url}/_stcore/health", timeout=2) as reply:
                    if reply.read() == b"ok":
                        break
            except OSError:
                time.sleep(0.5)
        else:
            pytest.fail(f"streamlit did not answer on {url}:\n{log_path.read_text()}")
        yield url
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


@pytest.fixture(scope="session")
def app_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The app served by `streamlit run` on a free local port, until the session ends."""
    log_path = tmp_path_factory.mktemp("streamlit") / "server.log"
    with serving(["streamlit", "run", "app/serve.py"], log_path) as url:
        yield url


@pytest.fixture(scope="session")
def screens(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A folder for screenshots; copied to /tmp/iscore-screens/ at the end."""
    folder = tmp_path_factory.mktemp("screens")
    yield folder
    SCREENS.mkdir(parents=True, exist_ok=True)
    for shot in folder.glob("*.png"):
        shutil.copy(shot, SCREENS / shot.name)
