"""Ground truth for the importer tests: the response tokens each fixture hides in its layout.

Every test module writes a framework's files around these values, exactly as that framework
lays them out (prompt positions, padding, alignment, holes), and checks that the importer
gives back these values and nothing else.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from iscore.dump.writer import PROVENANCE_KEY


@dataclass
class Seq:
    """One sequence's response tokens, in order, as the canonical table must hold them."""

    seq_id: object
    rollout: np.ndarray  # float32
    train: np.ndarray  # float32
    token_id: np.ndarray  # int64
    loss_mask: np.ndarray  # bool
    entropy: np.ndarray  # float32
    advantage: float
    reward: float
    group: int

    @property
    def n(self) -> int:
        return self.rollout.size


def make_seqs(lengths: list[int], *, seed: int = 0, holes: bool = True) -> list[Seq]:
    """Random sequences; with `holes`, some tokens (tool output) leave the loss mask."""
    rng = np.random.default_rng(seed)
    seqs = []
    for i, n in enumerate(lengths):
        rollout = (-rng.exponential(0.7, n)).astype(np.float32)
        train = np.minimum(rollout + rng.normal(0, 0.05, n), 0).astype(np.float32)
        mask = rng.random(n) > 0.25 if holes else np.ones(n, dtype=bool)
        seqs.append(
            Seq(
                seq_id=i,
                rollout=rollout,
                train=train,
                token_id=rng.integers(100, 50_000, n),
                loss_mask=mask,
                entropy=rng.exponential(1.0, n).astype(np.float32),
                advantage=float(np.float32(rng.normal())),
                reward=i + float(rng.integers(0, 2)) / 2,  # distinct: a mix-up shows
                group=i // 2,
            )
        )
    return seqs


def f32(values: list) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def row(table: pa.Table, i: int, column: str) -> object:
    return table[column][i].as_py()


def assert_rows(table: pa.Table, seqs: list[Seq], step: int, columns: tuple[str, ...]) -> None:
    """The table holds exactly `seqs` (in order), for each listed canonical column."""
    assert table.num_rows == len(seqs)
    for i, s in enumerate(seqs):
        assert row(table, i, "step") == step
        assert row(table, i, "seq_id") == s.seq_id
        np.testing.assert_array_equal(f32(row(table, i, "rollout_logprob")), s.rollout)
        np.testing.assert_array_equal(f32(row(table, i, "train_logprob")), s.train)
        expected = {
            "loss_mask": s.loss_mask,
            "token_id": s.token_id,
            "entropy": s.entropy,
            "advantage_per_token": np.full(s.n, s.advantage, dtype=np.float32),
        }
        for column in columns:
            if column == "reward":
                assert row(table, i, "reward") == s.reward
            elif column == "group_id":
                assert row(table, i, "group_id") == s.group
            elif column == "advantage_per_token":
                np.testing.assert_array_equal(f32(row(table, i, "advantage")), expected[column])
            else:
                np.testing.assert_array_equal(np.asarray(row(table, i, column)), expected[column])


def provenance(schema: pa.Schema) -> dict:
    return json.loads(schema.metadata[PROVENANCE_KEY])
