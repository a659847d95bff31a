"""Published reference values of the mismatch, and where a dump sits among them.

A user's first question is whether their mismatch is normal. Two kinds of published numbers
answer it: health bands (a framework's docs: "below 1e-3 is acceptable"), which live with the
framework that publishes them (`Framework.bands`) and which `iscore.advice.health` judges by; and
measurements of real runs in a known setting (model, precision, engine), to place a dump
among: measurements published in a framework's own repository live in its module
(`Framework.references`), the others here. Every row cites its source, with a link; a number
whose source could not be checked is left out.

>>> p = place("abs_diff_mean", 0.12)
>>> p.below.setting, p.above.setting
('MXFP8 rollout and training, routing replay on (first step)', 'FP8 rollout')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from iscore import frameworks
from iscore.frameworks import Citation, HealthBand, ReferencePoint

_MILES_FP8 = Citation(
    "miles pull request #1678 (FP8 rollout for GLM-5.2)",
    "https://github.com/radixark/miles/pull/1678",
)
_MILES_MXFP8 = Citation(
    "miles pull request #512 (Blackwell MXFP8 recipe)",
    "https://github.com/radixark/miles/pull/512",
)
_KL_AS_K3 = (
    "the source does not state its KL estimator; iscore compares it with k3, its unbiased "
    "estimate of KL(rollout || train)"
)
_GLM = "GLM-5.2, cut to 5 layers"

NEUTRAL: tuple[ReferencePoint, ...] = (
    ReferencePoint(
        "bf16 rollout",
        _GLM,
        "bf16",
        "abs_diff_mean",
        0.0105,
        "train_rollout_logprob_abs_diff",
        _MILES_FP8,
    ),
    ReferencePoint(
        "bf16 rollout", _GLM, "bf16", "k3", 1.2e-4, "train_rollout_kl", _MILES_FP8, _KL_AS_K3
    ),
    ReferencePoint(
        "FP8 rollout",
        _GLM,
        "FP8 weights",
        "abs_diff_mean",
        0.271,
        "train_rollout_logprob_abs_diff",
        _MILES_FP8,
        "flat over the steps: the weights' quantization, not a drift",
    ),
    ReferencePoint(
        "FP8 rollout", _GLM, "FP8 weights", "k3", 0.060, "train_rollout_kl", _MILES_FP8, _KL_AS_K3
    ),
    ReferencePoint(
        "MXFP8 rollout and training, routing replay on (first step)",
        "Qwen3-30B-A3B (MoE)",
        "MXFP8",
        "abs_diff_mean",
        0.0255,
        "train_rollout_logprob_abs_diff",
        _MILES_MXFP8,
    ),
)
"""Measurements published outside the frameworks' own repositories (forks, other trainers)."""


def points() -> tuple[ReferencePoint, ...]:
    """Every reference point: the neutral ones, then each framework's (`Framework.references`),
    in registry order."""
    return NEUTRAL + tuple(p for fw in frameworks.every() for p in fw.references)


def bands() -> tuple[tuple[str, HealthBand], ...]:
    """Every published health band, with the name of the framework that publishes it, in
    registry order."""
    return tuple((fw.title, band) for fw in frameworks.every() for band in fw.bands)


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a dump's value of a statistic sits among the published points.

    Attributes:
        statistic: the statistic.
        value: the dump's value.
        below: the largest published value at or below it, or None.
        above: the smallest published value above it, or None.
    """

    statistic: str
    value: float
    below: ReferencePoint | None
    above: ReferencePoint | None

    def describe(self) -> str:
        """One sentence: "your k3 (0.05) sits between bf16 rollout of GLM-5.2 ... and ..."."""
        said = f"your {self.statistic} ({_number(self.value)})"
        if self.below is not None and self.above is not None:
            return f"{said} sits between {_named(self.below)} and {_named(self.above)}"
        if self.above is not None:
            return f"{said} is below every published point; the nearest: {_named(self.above)}"
        return f"{said} is above every published point; the nearest: {_named(self.below)}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "statistic": self.statistic,
            "value": self.value,
            "below": None if self.below is None else point_dict(self.below),
            "above": None if self.above is None else point_dict(self.above),
            "text": self.describe(),
        }


def _named(p: ReferencePoint) -> str:
    return f"{p.setting} of {p.model} ({_number(p.value)}, {p.source.name})"


def _number(x: float) -> str:
    """Four significant digits, large values in full: 1.012, 0.0015, 38,565."""
    return f"{x:,.0f}" if abs(x) >= 1e4 else f"{x:.4g}"


def point_dict(p: ReferencePoint) -> dict[str, Any]:
    """A reference point as JSON: its fields, the source as `{name, url}`."""
    return {
        "setting": p.setting,
        "model": p.model,
        "precision": p.precision,
        "statistic": p.statistic,
        "value": p.value,
        "logged_as": p.logged_as,
        "source": {"name": p.source.name, "url": p.source.url},
        "note": p.note,
    }


def place(
    statistic: str, value: float | None, among: tuple[ReferencePoint, ...] | None = None
) -> Placement | None:
    """Where `value` of `statistic` sits among the published points (`points()` by default);
    None without a point for that statistic or without a finite value.

    >>> print(place("abs_diff_mean", 0.5).describe())  # doctest: +ELLIPSIS
    your abs_diff_mean (0.5) is above every published point; the nearest: FP8 rollout of ...
    """
    if value is None or value != value or value in (float("inf"), float("-inf")):
        return None
    rows = sorted(
        (p for p in (points() if among is None else among) if p.statistic == statistic),
        key=lambda p: p.value,
    )
    if not rows:
        return None
    below = [p for p in rows if p.value <= value]
    above = [p for p in rows if p.value > value]
    return Placement(statistic, value, below[-1] if below else None, above[0] if above else None)


def placements(value: Callable[[str], Any]) -> list[Placement]:
    """The placement of each statistic that has published points (`value` of its name: an
    analysis' `MismatchSummary.value`), in the order of the statistics' first point."""
    order = list(dict.fromkeys(p.statistic for p in points()))
    found = (place(s, value(s)) for s in order)
    return [p for p in found if p is not None]
