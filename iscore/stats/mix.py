"""The token mix of two training steps and a token-mean metric inside each part of it: for each
factor (the rollout probability of the sampled token, the response length, the position, the
turn, a per-sequence column of the dump), each step's loss tokens in each bin and the sum of
the metric's per-token term over them. A token-mean metric is the share-weighted mean of its
bins' means, which `iscore.advice` splits into composition and within (docs/why.md).

>>> stats = MixStats(steps=(0, 3), metric="k3", factors=("prob", "length"))
>>> for chunk in dump.batches(): stats.update(chunk)  # doctest: +SKIP
>>> [table.factor for table in stats.compute()]      # doctest: +SKIP
['prob', 'length']
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import TokenBatch, ops
from iscore.stats.histogram import bucket_label, log2_bucket


def _k1(d: torch.Tensor) -> torch.Tensor:
    return -d


def _k2(d: torch.Tensor) -> torch.Tensor:
    return d * d * 0.5


def _k3(d: torch.Tensor) -> torch.Tensor:
    return torch.special.expm1(d).sub_(d)


def _k3_reverse(d: torch.Tensor) -> torch.Tensor:
    return torch.special.expm1(-d).add_(d)


def _chi2(d: torch.Tensor) -> torch.Tensor:
    return d.clamp(-ops.SAFETY_BOUND, ops.SAFETY_BOUND).mul_(2.0).exp_().sub_(1.0)


def _abs(d: torch.Tensor) -> torch.Tensor:
    return d.abs()


def _mult(d: torch.Tensor) -> torch.Tensor:
    return d.abs().exp_()


def _ratio(d: torch.Tensor) -> torch.Tensor:
    return d.exp()


def _d(d: torch.Tensor) -> torch.Tensor:
    return d


TERMS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "k1": _k1,
    "k2": _k2,
    "k3": _k3,
    "k3_reverse": _k3_reverse,
    "chi2_token": _chi2,
    "abs_diff_mean": _abs,
    "token_mult_prob_error": _mult,
    "ratio_mean": _ratio,
    "d_mean": _d,
}
"""The token-mean metrics a change can be split for, each by the per-token term of float64
d = train - rollout whose mean over the loss tokens it is (`DEFINITIONS` of the catalogue;
chi2_token's term is e^(2 clamp(d, +-20)) - 1, so that its mean is the metric)."""

SHIFT_METRICS = tuple(TERMS)

PROB_EDGES_FINE = (
    *(10.0 ** (-k / 2) for k in range(16, 0, -1)),
    0.5,
    *(1.0 - 10.0 ** (-k / 2) for k in range(1, 17)),
)
"""The inner edges of the rollout-probability bins: half decades of p from 1e-8 up to 0.316,
0.5, then half decades of 1 - p from 0.684 up to 1 - 1e-8, 34 bins in all (a bin holds
[lower edge, upper edge)): fine at both ends, where the noise of d changes most with p."""

_LOG_PROB_EDGES = tuple(math.log(p) for p in PROB_EDGES_FINE)

LOG2_BUCKETS = 32
"""Bins of the response length and the position: powers of two, the last holding all beyond."""

TURNS = 64
"""Bins of the turn: one a turn, the last holding turn 63 and every later one."""

ORDERED = ("prob", "length", "position", "turn")
"""The factors every dump can be split by (`turn` where it has the column), in their order;
any other factor is a per-sequence column of the dump, binned by value."""


@dataclass(frozen=True, slots=True)
class FactorTable:
    """One factor's bins on the two steps, the bins with no loss token on either left out.

    Attributes:
        factor: its name (`ORDERED`, or a column of the dump).
        ordered: whether its bins are in the order of the factor's values (else one bin a
            value of the column, in the order first met).
        labels: each bin's range or value, for people.
        lower, upper: for an ordered factor, each bin's bounds in the factor's units (the
            probability, loss tokens, position, turn; a bin holds [lower, upper), the last
            bin of the length, position and turn all beyond its lower bound, upper inf);
            () otherwise.
        tokens: int64 [2, bins], the loss tokens of each step in each bin.
        sums: float64 [2, bins], the metric's per-token term summed over them.
    """

    factor: str
    ordered: bool
    labels: tuple[str, ...]
    lower: tuple[float, ...]
    upper: tuple[float, ...]
    tokens: np.ndarray
    sums: np.ndarray


@dataclass(slots=True)
class MixStats:
    """Streaming accumulator of the token mix of two steps and of a metric in each bin.

    Args:
        steps: the two steps (tokens of other steps are left out).
        metric: a key of `TERMS`.
        factors: `ORDERED` names, or per-sequence columns of the batches' `extra` table
            (integers, strings or booleans: one bin a value).
    """

    steps: tuple[int, int]
    metric: str
    factors: tuple[str, ...]
    counts: dict[str, np.ndarray] = field(default_factory=dict)  # factor -> int64 [2, bins]
    sums: dict[str, np.ndarray] = field(default_factory=dict)  # factor -> float64 [2, bins]
    levels: dict[str, dict[Any, int]] = field(default_factory=dict)  # column value -> bin
    sequences: np.ndarray = field(default_factory=lambda: np.zeros(2, dtype=np.int64))

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences."""
        a, b = self.steps
        seq_slot = torch.full_like(batch.step, -1)
        seq_slot[batch.step == a] = 0
        seq_slot[batch.step == b] = 1
        self.sequences += np.array([int((seq_slot == s).sum()) for s in (0, 1)])
        slot = ops.broadcast(seq_slot, batch)
        keep = torch.nonzero(batch.loss_mask & (slot >= 0)).flatten()
        slot = slot[keep]
        term = TERMS[self.metric](ops.log_ratio(batch)[keep])
        for factor in self.factors:
            index, size = self._bins(batch, factor)
            flat = slot * size + index[keep]
            counts = torch.bincount(flat, minlength=2 * size).reshape(2, size).cpu().numpy()
            sums = torch.bincount(flat, weights=term, minlength=2 * size).reshape(2, size)
            self._add(factor, counts, sums.cpu().numpy())

    def _add(self, factor: str, counts: np.ndarray, sums: np.ndarray) -> None:
        """Add a chunk's [2, bins] counts and sums (a column's bins grow as values appear)."""
        have = self.counts.get(factor)
        if have is None or have.shape[1] < counts.shape[1]:
            grown = np.zeros((2, counts.shape[1]), dtype=np.int64)
            grown_sums = np.zeros((2, counts.shape[1]))
            if have is not None:
                grown[:, : have.shape[1]] = have
                grown_sums[:, : have.shape[1]] = self.sums[factor]
            self.counts[factor], self.sums[factor] = grown, grown_sums
        self.counts[factor] += counts
        self.sums[factor] += sums

    def _bins(self, batch: TokenBatch, factor: str) -> tuple[torch.Tensor, int]:
        """(int64 [N], each token's bin of `factor`; the number of bins).

        Raises:
            ValueError: the batch lacks the factor's column.
        """
        if factor == "prob":
            edges = torch.tensor(_LOG_PROB_EDGES, dtype=torch.float64, device=batch.device)
            return torch.bucketize(batch.rollout.double(), edges, right=True), len(edges) + 1
        if factor == "length":
            loss = ops.segment_count(batch, batch.loss_mask)
            bucket = log2_bucket(loss).clamp_(max=LOG2_BUCKETS - 1)
            return ops.broadcast(bucket.to(batch.device), batch), LOG2_BUCKETS
        if factor == "position":
            bucket = log2_bucket(batch.positions() + 1).clamp_(max=LOG2_BUCKETS - 1)
            return bucket, LOG2_BUCKETS
        if factor == "turn":
            if batch.turn is None:
                raise ValueError("the batch has no turn column")
            return batch.turn.clamp(0, TURNS - 1), TURNS
        if batch.extra is None or factor not in batch.extra.column_names:
            raise ValueError(f"the batch has no column {factor!r}")
        levels = self.levels.setdefault(factor, {})
        codes = [levels.setdefault(v, len(levels)) for v in batch.extra[factor].to_pylist()]
        per_seq = torch.tensor(codes, dtype=torch.int64, device=batch.device)
        return ops.broadcast(per_seq, batch), max(len(levels), 1)

    def compute(self) -> tuple[FactorTable, ...]:
        """Each factor's table, in the order of `factors` (none before any update)."""
        out = []
        for factor in self.factors:
            if factor not in self.counts:
                continue
            counts, sums = self.counts[factor], self.sums[factor]
            used = np.flatnonzero(counts.sum(axis=0))
            labels, lower = _describe(factor, counts.shape[1], self.levels.get(factor, {}))
            upper = [*lower[1:], 1.0 if factor == "prob" else math.inf] if lower else []
            out.append(
                FactorTable(
                    factor=factor,
                    ordered=factor in ORDERED,
                    labels=tuple(labels[i] for i in used),
                    lower=tuple(lower[i] for i in used) if lower else (),
                    upper=tuple(upper[i] for i in used) if upper else (),
                    tokens=counts[:, used],
                    sums=sums[:, used],
                )
            )
        return tuple(out)


def _describe(factor: str, size: int, levels: dict[Any, int]) -> tuple[list[str], list[float]]:
    """Each bin's label and, for an ordered factor, its lower bound."""
    if factor == "prob":
        lower = [0.0, *PROB_EDGES_FINE]
        upper = [*PROB_EDGES_FINE, 1.0]
        return [f"p {lo:.3g}-{hi:.3g}" for lo, hi in zip(lower, upper, strict=True)], lower
    if factor in ("length", "position"):
        lower = [float(2**b) for b in range(size)]
        labels = [bucket_label(b) for b in range(size)]
        labels[-1] = f"{2 ** (size - 1)}+"
        if factor == "position":  # pos + 1 was bucketed: position 2^b - 1 up
            lower = [v - 1.0 for v in lower]
            labels = [f"{2**b - 1}-{2 ** (b + 1) - 2}" for b in range(size)]
            labels[-1] = f"{2 ** (size - 1) - 1}+"
        return labels, lower
    if factor == "turn":
        return [f"turn {t}" for t in range(size - 1)] + [f"turn {size - 1}+"], [
            float(t) for t in range(size)
        ]
    by_bin = {index: value for value, index in levels.items()}
    return [_value_label(by_bin.get(i)) for i in range(size)], []


def _value_label(value: Any) -> str:
    """A column's value as a bin's label."""
    return "null" if value is None else str(value)


def bins_by_value(column: pa.DataType) -> bool:
    """Whether a per-sequence column of this type can be a factor: integers, strings,
    booleans (one bin a value; a float column has no natural bins)."""
    return (
        pa.types.is_integer(column)
        or pa.types.is_string(column)
        or pa.types.is_large_string(column)
        or pa.types.is_boolean(column)
        or pa.types.is_dictionary(column)
    )
