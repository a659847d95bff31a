"""AppTest fixtures: the dashboard run headless, one browser session per `AppTest`."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from streamlit.testing.v1 import AppTest

ROOT = Path(__file__).resolve().parents[2]
APP = ROOT / "app" / "main.py"
DATA = ROOT / "data"
TIMEOUT = 60
"""Seconds per script run: the first one imports torch."""


def new_app() -> AppTest:
    """A fresh session of the app, run once (the Data page)."""
    return AppTest.from_file(str(APP), default_timeout=TIMEOUT).run()


@pytest.fixture
def at() -> AppTest:
    """A fresh session of the app on its Data page."""
    return new_app()


def open_path(at: AppTest, path: str | Path) -> AppTest:
    """Open a server-side dump through the Data page's form."""
    at.text_input[0].input(str(path))
    return next(b for b in at.button if b.label == "Open").click().run()


@pytest.fixture
def loaded(at: AppTest) -> AppTest:
    """A session with data/fp8.parquet open (one step, 48 sequences, strong mismatch)."""
    return open_path(at, DATA / "fp8.parquet")


def parquet_bytes(table) -> bytes:
    """A table as Parquet bytes, in memory."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer)
    return buffer.getvalue()


def metric(at: AppTest, label: str) -> str:
    """The value of the metric labelled `label`."""
    return next(m.value for m in at.metric if m.label == label)


def no_exception(at: AppTest) -> None:
    """The run raised nothing (a traceback would be an `st.exception` element)."""
    assert not at.exception, [e.value for e in at.exception]


def plain(markdown: str) -> str:
    """Text as shown: Markdown's backslash escapes removed."""
    return re.sub(r"\\(.)", r"\1", markdown)
