"""What the metadata columns say (`iscore.stats.metadata`): one value whose mismatch stands out
among the others (a replica, a rank, a host, a GPU model), and two bug signatures among the
mismatch flags: `token_id_mismatch` (the trainer scored other tokens than the engine sampled:
re-tokenization) and `engine_drift` (the mismatch grows over steps of one policy version: the
engine changes, not the policy). docs/why.md#the-metadata-breakdown.

>>> from iscore.passes.analysis import analyze
>>> analyze("data/fp8.parquet").mismatch.metadata is None  # no metadata column: nothing said
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from iscore.advice.flags import Flag
from iscore.errors import clip
from iscore.stats import MetadataSummary

STANDOUT_RATIO = 3.0
"""A value stands out when its k3 is at least this many times the others' together (engine
instances on one kernel and one GPU model score alike up to sampling noise; a replica that
stopped syncing, another GPU generation or a bad rank is several times off),"""

STANDOUT_Z = 5.0
"""and this many standard errors above it (over sequences, both sides' errors together: k3's
tail is heavy, so a bar well past the usual 3),"""

STANDOUT_SEQUENCES = 8
"""with at least this many sequences with loss tokens on each side (fewer give no standard
error worth the name)."""

DRIFT_STEPS = 3
"""`engine_drift` needs a weight version seen at this many steps (with loss tokens) or more;"""

DRIFT_RATIO = 1.5
"""its k3 at the last of them at least this many times its k3 at the first,"""

DRIFT_Z = 4.0
"""that rise this many standard errors (the two steps' together) beyond the noise,"""

DRIFT_STEP_Z = 1.0
"""and every later step above the first by this many standard errors: a sustained rise, not
one step's spike."""


@dataclass(frozen=True, slots=True)
class Standout:
    """One value of a metadata column whose mismatch stands out among the others.

    Attributes:
        column: the column (`replica`, `rank`, `host`, `device`, `weight_version`).
        value: its value.
        k3: its k3; others: the other values' k3 together; ratio: k3 / others (None where
            the others' k3 is 0); z: the difference in standard errors.
        sequences: its sequences with loss tokens.
    """

    column: str
    value: Any
    k3: float
    others: float
    ratio: float | None
    z: float
    sequences: int

    def sentence(self) -> str:
        """E.g. "replica 3: k3 40x the others (0.04 against 0.001, z = 25, 64 sequences)"."""
        times = "infinitely many times" if self.ratio is None else f"{self.ratio:.3g}x"
        return (
            f"{self.column} {clip(str(self.value), 60)}: k3 {times} the others ({self.k3:.3g} "
            f"against {self.others:.3g}, z = {self.z:.0f}, {self.sequences:,} sequences)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "column": self.column,
            "value": self.value,
            "k3": self.k3,
            "others": self.others,
            "ratio": self.ratio,
            "z": self.z,
            "sequences": self.sequences,
        }


def standouts(summary: MetadataSummary | None) -> list[Standout]:
    """Per column, the value that stands out most (`STANDOUT_RATIO`, `STANDOUT_Z`,
    `STANDOUT_SEQUENCES`), strongest (largest z) first; a column of one value has none."""
    if summary is None:
        return []
    found = []
    for column, sums in summary.sums.items():
        rows = summary.by[column]
        total = np.sum(sums, axis=0)
        best = None
        for row, own in zip(rows, sums, strict=True):
            if row["value"] is None:
                continue  # unknown: nothing to name
            candidate = _compare(column, row["value"], own, total - own)
            if candidate is not None and (best is None or candidate.z > best.z):
                best = candidate
        if best is not None:
            found.append(best)
    return sorted(found, key=lambda s: -s.z)


def _compare(column: str, value: Any, own: np.ndarray, rest: np.ndarray) -> Standout | None:
    """The value against the rest, from their sums (`MetadataSummary.sums`)."""
    if min(own[0], rest[0]) < STANDOUT_SEQUENCES:
        return None
    k3, se = _mean_and_stderr(own)
    others, se_others = _mean_and_stderr(rest)
    spread = math.hypot(se, se_others)
    if spread <= 0 or k3 <= 0:
        return None
    z = (k3 - others) / spread
    ratio = k3 / others if others > 0 else None
    if z < STANDOUT_Z or (ratio is not None and ratio < STANDOUT_RATIO):
        return None
    return Standout(column, value, k3, others, ratio, z, int(own[0]))


def _mean_and_stderr(sums: np.ndarray) -> tuple[float, float]:
    """The token-mean k3 of a group of sequences and its standard error over them, from the
    group's sums (sequences, T, K, K^2, K T, T^2): sum (K_i - k T_i)^2 expanded."""
    _, tokens, k, kk, kt, tt = sums
    mean = k / tokens
    residual = max(kk - 2.0 * mean * kt + mean * mean * tt, 0.0)
    return float(mean), float(math.sqrt(residual) / tokens)


def metadata_flags(summary: MetadataSummary | None) -> list[Flag]:
    """The `token_id_mismatch` and `engine_drift` flags where the dump shows them."""
    if summary is None:
        return []
    return [*_token_id_mismatch(summary), *_engine_drift(summary)]


def _token_id_mismatch(summary: MetadataSummary) -> list[Flag]:
    ids = summary.token_ids
    if ids is None or not ids.differ:
        return []
    first = ids.first
    return [
        Flag.of(
            "token_id_mismatch",
            f"the trainer scored another token than the engine sampled on {ids.differ:,} loss "
            f"tokens ({ids.share:.2%}), the first at position {first['pos']} of sequence "
            f"{clip(str(first['seq_id']), 60)} (step {first['step']}): the trainer's input was "
            "re-tokenized from text (a separator dropped or merged at a turn or tool "
            "boundary). Feed the trainer the engine's token ids instead of re-tokenizing the "
            "decoded text.",
        )
    ]


def _engine_drift(summary: MetadataSummary) -> list[Flag]:
    """A weight version whose k3 rises over `DRIFT_STEPS` or more of its steps (the first
    such version)."""
    for row in summary.by.get("weight_version", ()):
        steps = [s for s in row["by_step"] if s["k3"] is not None and s["sequences"] > 1]
        if row["value"] is None or len(steps) < DRIFT_STEPS:
            continue
        first, last = steps[0], steps[-1]
        spread = math.hypot(first["k3_stderr"], last["k3_stderr"])
        if first["k3"] <= 0 or spread <= 0:
            continue
        rise = last["k3"] - first["k3"]
        sustained = all(
            s["k3"] - first["k3"] >= DRIFT_STEP_Z * math.hypot(first["k3_stderr"], s["k3_stderr"])
            for s in steps[1:]
        )
        ratio = last["k3"] / first["k3"]
        if rise / spread >= DRIFT_Z and ratio >= DRIFT_RATIO and sustained:
            return [
                Flag.of(
                    "engine_drift",
                    f"k3 rises {ratio:.3g}x from step {first['step']} to step {last['step']} "
                    f"(z = {rise / spread:.0f}) over the {len(steps)} steps at which weight "
                    f"version {clip(str(row['value']), 60)} sampled: the policy did not change, "
                    "the engine did "
                    "(a KV cache or prefix cache reused across a weight update, a weight sync "
                    "that stopped, a growing queue of engine state). Check the engine's weight "
                    "reload and cache reset at each sync.",
                )
            ]
    return []
