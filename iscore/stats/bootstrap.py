"""Percentile intervals (Efron and Tibshirani, An Introduction to the Bootstrap, 1993, ch. 13)
by resampling sequences within steps (docs/compare.md#the-bootstrap): each
resample draws, for every step, as many of its sequences as it has, with replacement. Every
statistic compared is a function of sums over sequences, so a resample is its counts per
sequence (`counts`) and its statistics come from `counts @ columns` (`*_sum_columns`,
`*_from_sums`), the same formulas as `mismatch_scalars` and `setting_scalars` (tested equal).

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
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

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


def counts(rows: Sequence[np.ndarray], size: int) -> np.ndarray:
    """float64 [len(rows), size]: how many times each resample (`resample_rows`) draws each
    of `size` sequences; a statistic that is a sum over sequences is then `counts @ x`."""
    flat = np.concatenate([row + k * size for k, row in enumerate(rows)])
    return np.bincount(flat, minlength=len(rows) * size).reshape(len(rows), size).astype(np.float64)


def mismatch_sum_columns(m: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The per-sequence columns whose sums give the mismatch's compared metrics
    (`mismatch_from_sums`), from its per-sequence numbers (`MismatchStats.sequences`, with
    `broken`)."""
    has = (m["T"] > 0).astype(np.float64)
    out = {
        k: np.asarray(m[k], np.float64)
        for k in ("T", "k3", "abs", "chi", "mult", "rho", "rho2", "far")
    }
    out |= {"has": has, "broken": np.asarray(m["broken"], np.float64) * has}
    if "dist_tokens" in m:  # the top-k columns' (iscore.stats.distribution)
        out |= {
            k: np.asarray(m[k], np.float64) for k in ("dist_tokens", "dist_estimate", "dist_top1")
        }
    return out


def mismatch_from_sums(s: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The compared metrics from sums of `mismatch_sum_columns` (each [R]), as
    `iscore.stats.mismatch.mismatch_scalars` and the diff's shares define them."""
    with np.errstate(divide="ignore", invalid="ignore"):
        n = s["T"]
        rho, rho2 = s["rho"] / n, s["rho2"] / n
        whole = {}
        if "dist_tokens" in s:
            whole = {
                "kl_estimate": s["dist_estimate"] / s["dist_tokens"],
                "top1_agreement": s["dist_top1"] / s["dist_tokens"],
            }
        return whole | {
            "k3": s["k3"] / n,
            "abs_diff_mean": s["abs"] / n,
            "chi2_token": s["chi"] / n - 1.0,
            "token_mult_prob_error": s["mult"] / n,
            "ratio_mean": rho,
            "ess": np.where(rho2 > 0, rho * rho / rho2, 0.0),
            "broken_share": s["broken"] / np.maximum(s["has"], 1.0),
            "far_share": s["far"] / np.maximum(n, 1.0),
        }


def setting_sum_columns(seq: Mapping[str, np.ndarray], agg: Any) -> dict[str, np.ndarray]:
    """The per-sequence columns whose sums give a setting's compared metrics
    (`setting_from_sums`), from its per-sequence sums (`SettingStats.sequences`) and its
    loss aggregation."""
    T = np.asarray(seq["T"], np.float64)
    has = (T > 0).astype(np.float64)
    out = {k: np.asarray(seq[k], np.float64) for k in ("T", "w", "w2", "high", "nonzero", "kept")}
    out |= {"has": has, "masked_seq": has * (out["nonzero"] == 0)}
    if agg.mode == "seq-mean-token-mean":
        den = out["kept"] if agg.shrinks else T
        with np.errstate(divide="ignore", invalid="ignore"):
            out["lr_seq"] = has * np.where(den > 0, out["w"] / np.maximum(den, 1.0), 0.0)
    return out


def setting_from_sums(s: Mapping[str, np.ndarray], agg: Any) -> dict[str, np.ndarray]:
    """A setting's compared metrics from sums of `setting_sum_columns` (each [R]), as
    `iscore.stats.setting.setting_scalars` defines them."""
    n = s["T"]
    with np.errstate(divide="ignore", invalid="ignore"):
        if agg.mode == "seq-mean-token-mean":
            lr = s["lr_seq"] / s["has"]
        else:
            den = s["kept"] if agg.shrinks and agg.mode == "token-mean" else n
            lr = np.where(den > 0, s["w"] / den, 0.0)
        return {
            "token_masked_fraction": 1.0 - s["nonzero"] / n,
            "seq_masked_fraction": s["masked_seq"] / s["has"],
            "token_rejected_fraction": 1.0 - s["kept"] / n,
            "truncated_high_fraction": s["high"] / n,
            "lr_scale": lr,
            "ess": np.where(s["w2"] > 0, s["w"] * s["w"] / (n * s["w2"]), 0.0),
        }
