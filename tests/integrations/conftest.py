"""Tests against the frameworks' own classes and functions, installed by `iscore[integrations]`
plus `pip install --no-deps -r tests/integrations/frameworks.txt` (README, "Set-up").

A framework that is not installed is skipped, saying why; `frameworks.txt` says which
versions ran. Each test builds that framework's real batch object from known values
(`tests.batches.Truth`), writes it through `DumpWriter.add_batch`, reads it back with iscore and
compares every value.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest


def framework(module: str, install: str) -> ModuleType:
    """Import `module`, or skip the test with what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        pytest.skip(f"{module} is not importable ({e}); {install}")
