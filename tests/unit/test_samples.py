"""The bundled sample dumps are what `data/make_samples.sh` writes: the same rows, columns and
metadata (not compared byte for byte: the bytes depend on the Parquet writer's version)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from iscore.cli import main

DATA = Path(__file__).resolve().parents[2] / "data"
COMMANDS = [
    shlex.split(line)[1:]
    for line in (DATA / "make_samples.sh").read_text().splitlines()
    if line.startswith("iscore simulate ")
]


def test_every_bundled_sample_has_a_command():
    assert sorted(args[1] for args in COMMANDS) == sorted(p.name for p in DATA.glob("*.parquet"))


@pytest.mark.parametrize("args", COMMANDS, ids=[args[1] for args in COMMANDS])
def test_the_script_regenerates_the_sample_exactly(args, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(args) == 0
    made, bundled = pq.ParquetFile(tmp_path / args[1]), pq.ParquetFile(DATA / args[1])
    assert made.metadata.metadata == bundled.metadata.metadata
    assert made.read().equals(bundled.read(), check_metadata=True)
