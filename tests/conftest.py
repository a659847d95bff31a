"""Shared fixtures: small hand-built dumps in every layout, written with plain pyarrow."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
# For tests that compare a device's result with the CPU's: on the CPU itself that comparison
# is of a value with itself.
ACCELERATORS = [device for device in DEVICES if device != "cpu"]


@pytest.fixture(autouse=True, scope="session")
def _cache_in_a_temporary_folder(tmp_path_factory):
    """Commands keep their results store in the user's cache (`$XDG_CACHE_HOME/iscore`):
    the tests', and those of the processes they start, go to a temporary folder, never to the
    real home."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("cache")))
        yield


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Skip GPU tests on machines without CUDA (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@dataclass
class Sequences:
    """Ground truth of a hand-built dump: one entry per sequence, in file order."""

    seq_id: list
    step: list[int]
    rollout: list[np.ndarray]
    train: list[np.ndarray]
    loss_mask: list[np.ndarray]

    @property
    def lengths(self) -> list[int]:
        return [len(r) for r in self.rollout]

    def token_table(self, names: dict[str, str] | None = None, pos: bool = True) -> pa.Table:
        names = names or {}
        columns = {
            "step": np.repeat(self.step, self.lengths),
            "seq_id": pa.array(
                [i for i, n in zip(self.seq_id, self.lengths, strict=True) for _ in range(n)]
            ),
            "rollout_logprob": np.concatenate(self.rollout).astype(np.float32),
            "train_logprob": np.concatenate(self.train).astype(np.float32),
            "loss_mask": np.concatenate(self.loss_mask),
        }
        if pos:
            columns["pos"] = np.concatenate([np.arange(n) for n in self.lengths])
        return pa.table({names.get(k, k): v for k, v in columns.items()})

    def sequence_table(self, names: dict[str, str] | None = None) -> pa.Table:
        names = names or {}
        f32 = pa.list_(pa.float32())
        columns = {
            "step": pa.array(self.step, pa.int64()),
            "seq_id": pa.array(self.seq_id),
            "rollout_logprob": pa.array([r.astype(np.float32) for r in self.rollout], f32),
            "train_logprob": pa.array([t.astype(np.float32) for t in self.train], f32),
            "loss_mask": pa.array([m.tolist() for m in self.loss_mask], pa.list_(pa.bool_())),
        }
        return pa.table({names.get(k, k): v for k, v in columns.items()})


def make_sequences(
    lengths: list[int], *, steps: list[int] | None = None, seed: int = 0, ids: list | None = None
) -> Sequences:
    rng = np.random.default_rng(seed)
    rollout = [-rng.exponential(0.5, n) for n in lengths]
    train = [np.minimum(r + rng.normal(0, 0.02, r.size), 0.0) for r in rollout]
    mask = [rng.random(n) > 0.1 for n in lengths]
    return Sequences(
        seq_id=ids if ids is not None else [100 + i for i in range(len(lengths))],
        step=steps if steps is not None else [0] * len(lengths),
        rollout=rollout,
        train=train,
        loss_mask=mask,
    )


def write(table: pa.Table, path: Path, **kwargs) -> Path:
    pq.write_table(table, path, **kwargs)
    return path


@pytest.fixture
def sequences() -> Sequences:
    """Six sequences over two steps, lengths 1..40, string ids (every feature exercised)."""
    return make_sequences(
        [5, 1, 40, 7, 3, 12], steps=[0, 0, 0, 1, 1, 1], ids=["a", "b", "c", "d", "e", "f"]
    )
