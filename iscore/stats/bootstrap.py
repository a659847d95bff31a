"""Percentile intervals (Efron and Tibshirani, An Introduction to the Bootstrap, 1993, ch. 13)
by resampling sequences within steps (docs/compare.md#the-bootstrap): each
resample draws, for every step, as many of its sequences as it has, with replacement; a
statistic is computed on each resample by the same function that computes it on the dump, so
that an interval is of exactly the number reported.

Resamples are seeded (`SEED`), so a rerun gives the same interval. Two arms holding the same
sequences (the same rollouts scored two ways) are resampled together, the same draws for both
(one `resample_rows` for both): their ratio's interval is then the paired one.

>>> step = np.array([1, 0, 1, 0, 1])
>>> rows = list(resample_rows(step, 3, seed=1))
>>> all(sorted(step[r].tolist()) == [0, 0, 1, 1, 1] for r in rows)
True
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

RESAMPLES = 1000
"""Resamples per interval (more narrows the Monte Carlo error of its ends; seeded either way)."""

LEVEL = 0.95
"""The intervals' coverage."""

SEED = 0
"""The resamples' seed: the same dump gives the same interval."""


@dataclass(frozen=True, slots=True)
class Interval:
    """A statistic's value and the percentile interval of its resamples.

    Attributes:
        value: the statistic on the sequences as they are.
        lo, hi: the (1 - LEVEL) / 2 and (1 + LEVEL) / 2 quantiles of its resamples (NaN
            where fewer than half of the resamples give a finite value).
    """

    value: float
    lo: float
    hi: float


def resample_rows(
    step: np.ndarray, resamples: int = RESAMPLES, seed: int = SEED
) -> Iterator[np.ndarray]:
    """For each resample in turn, int64 [B]: the sequences drawn (indices into `step`, the
    sequences' steps), each step's as many as it has, drawn from its own with replacement
    (one resample at a time: a dump's sequences times `resamples` would not fit)."""
    step = np.asarray(step)
    order = np.argsort(step, kind="stable")
    _, first, counts = np.unique(step[order], return_index=True, return_counts=True)
    start = np.repeat(first, counts)
    size = np.repeat(counts, counts)
    rng = np.random.default_rng(seed)
    for _ in range(resamples):
        yield order[start + np.floor(rng.random(step.size) * size).astype(np.int64)]


def percentile_interval(value: float, draws: np.ndarray, level: float = LEVEL) -> Interval:
    """`value` with the percentile interval of its resamples' `draws` (NaN ends where fewer
    than half of them are finite: a statistic undefined on most resamples has no interval).

    >>> found = percentile_interval(1.0, np.arange(101.0) / 50)
    >>> round(found.lo, 6), round(found.hi, 6)
    (0.05, 1.95)
    """
    draws = np.asarray(draws, dtype=np.float64)
    finite = draws[np.isfinite(draws)]
    if finite.size == 0 or finite.size * 2 < draws.size:
        return Interval(value, math.nan, math.nan)
    lo, hi = np.quantile(finite, [(1 - level) / 2, (1 + level) / 2])
    return Interval(value, float(lo), float(hi))
