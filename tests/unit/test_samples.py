"""The bundled sample dumps are what `data/make_samples.sh` writes: the same rows, columns and
metadata (not compared byte for byte: the bytes depend on the Parquet writer's version)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from iscore import Dump, load
from iscore.cli import main
from iscore.errors import ConfigError
from iscore.frameworks.resolve import presets

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


def test_every_preset_replays_on_the_off_policy_sample():
    # With its extra columns: prime-rl's default loss reads each sequence's advantage.
    batch = Dump(DATA / "off_policy.parquet", extras=True).load()
    assert batch.policy is not None and "advantage" in batch.extra.column_names
    for name, spec in presets().items():
        result = spec.replay(batch)
        assert result.weight.shape == batch.rollout.shape, name


def test_the_current_policy_presets_refuse_a_sample_without_policy_logprob():
    """The settings that score against the current policy replay on no other sample."""
    needs_policy = {"verl:bypass_ppo_clip", "skyrl:skyrl_rollout_is", "skyrl:skyrl_cispo_rollout"}
    batch = load(DATA / "fp8.parquet")
    for name in needs_policy:
        with pytest.raises(ConfigError, match="policy_logprob"):
            presets()[name].replay(batch)
