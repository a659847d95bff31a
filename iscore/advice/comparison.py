"""What `iscore diff` compares, which way each number is bad for training, and the verdict on
two arms (docs/compare.md#verdicts).

A metric is compared through its badness: the value itself where higher is worse (k3, the
masked fractions), or where lower is worse (the effective sample size), and its distance from
1 where 1 is ideal (the mean ratio e^d, `token_mult_prob_error`, the LR scale). The verdict
reads the interval of candidate / baseline badness: `worse` where it lies wholly on the bad
side of 1, `better` wholly on the good side, `same` where it holds 1. Where the baseline's
badness is 0 on most resamples (no masked token at all), the ratio has no interval and the
difference candidate - baseline decides, against 0.

>>> verdict(METRICS["k3"], (1.2, 1.5), None), verdict(METRICS["ess"], (1.2, 1.5), None)
('worse', 'better')
>>> verdict(METRICS["k3"], (float("nan"),) * 2, (0.0, 0.0))
'same'
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

Verdict = Literal["better", "worse", "same"]

VERDICTS: tuple[Verdict, ...] = ("better", "worse", "same")


@dataclass(frozen=True, slots=True)
class Metric:
    """A number `diff` compares.

    Attributes:
        name: as the analysis document names it (`mismatch.*`, `settings[].*`), or the two the
            diff adds (`broken_share`, `far_share`).
        bad: "higher" (more is worse), "lower" (less is worse) or "away_from_1" (1 is ideal;
            its distance from 1 is compared).
        about: what it is, for docs and hovers.
    """

    name: str
    bad: Literal["higher", "lower", "away_from_1"]
    about: str

    def badness(self, value: float) -> float:
        """The quantity compared: the value, or its distance from 1."""
        return abs(value - 1.0) if self.bad == "away_from_1" else value


MISMATCH_METRICS = (
    Metric("k3", "higher", "<e^d - 1 - d>_tok, the mismatch KL"),
    Metric("abs_diff_mean", "higher", "<|d|>_tok, the mean absolute log-prob difference"),
    Metric("chi2_token", "higher", "<e^2d>_tok - 1"),
    Metric("token_mult_prob_error", "away_from_1", "<e^|d|>_tok; 1 where both sides agree"),
    Metric("ratio_mean", "away_from_1", "<e^d>_tok; 1 in expectation"),
    Metric("ess", "lower", "<e^d>^2 / <e^2d>, the raw ratios' effective sample size"),
    Metric("broken_share", "higher", "the share of sequences outside their step's noise"),
    Metric(
        "far_share",
        "higher",
        "the share of loss tokens far outside their step's noise in their probability bin",
    ),
)
"""The mismatch's metrics, in the order reported."""

DISTRIBUTION_METRICS = (
    Metric(
        "kl_estimate",
        "higher",
        "the full-vocabulary KL(rollout || train), estimated from the top-k log-probs",
    ),
    Metric(
        "top1_agreement",
        "lower",
        "the share of tokens whose trainer top-1 (among the engine's top-k) is the engine's",
    ),
)
"""The metrics of the whole distribution, compared where both dumps have top-k columns
(docs/distribution.md)."""

SETTING_METRICS = (
    Metric("token_masked_fraction", "higher", "loss tokens whose weight is 0"),
    Metric("seq_masked_fraction", "higher", "sequences every token of which has weight 0"),
    Metric("token_rejected_fraction", "higher", "loss tokens a rejection mask drops"),
    Metric("truncated_high_fraction", "higher", "kept tokens whose weight a cap lowered"),
    Metric("lr_scale", "away_from_1", "the corrected over the uncorrected gradient's scale"),
    Metric("ess", "lower", "the weights' effective sample size"),
)
"""Each setting's metrics, in the order reported."""

METRICS = {m.name: m for m in (*MISMATCH_METRICS, *DISTRIBUTION_METRICS)}
"""The mismatch's metrics by name (the distribution's too)."""


def verdict(
    metric: Metric,
    ratio_ci: tuple[float, float],
    difference_ci: tuple[float, float] | None,
) -> Verdict:
    """`metric`'s verdict on the candidate from the interval of its badness ratio (candidate
    / baseline), or where that has none (NaN ends), of the difference (candidate - baseline)."""
    lo, hi, one = *ratio_ci, 1.0
    if math.isnan(lo) or math.isnan(hi):
        if difference_ci is None or any(math.isnan(v) for v in difference_ci):
            return "same"
        (lo, hi), one = difference_ci, 0.0
    higher = metric.bad in ("higher", "away_from_1")
    if lo > one:
        return "worse" if higher else "better"
    if hi < one:
        return "better" if higher else "worse"
    return "same"
