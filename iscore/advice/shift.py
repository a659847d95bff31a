"""A token-mean metric's change between two steps split, factor by factor, into composition
(the token mix moved across the factor's bins while each bin's value stayed) and within (each
bin's value moved: the engine's arithmetic drifted), and the sentence that names the factor
and the bins that moved (docs/why.md).

With w_b the share of a step's loss tokens in bin b and m_b the metric's mean over them, the
metric is sum_b w_b m_b, and the symmetric (midpoint) shift-share splits its change exactly:

    change = sum_b (w1_b - w0_b) (m0_b + m1_b) / 2  +  sum_b (m1_b - m0_b) (w0_b + w1_b) / 2
             composition                                within

A bin with no loss token at one step has no value there; it takes the other step's, so its
within term is 0 and its whole part of the change is composition (the mix moved into it or out
of it: nothing says how its value would have moved).

>>> import numpy as np
>>> from iscore.stats import FactorTable
>>> tokens, sums = np.array([[10, 90], [30, 70]]), np.array([[1.0, 0.9], [3.0, 0.7]])
>>> table = FactorTable("prob", True, ("low", "high"), (0.0, 0.5), (0.5, 1.0), tokens, sums)
>>> shift = shift_share(table)
>>> round(shift.composition, 6), round(shift.within, 6)
(0.018, 0.0)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from iscore.stats import FactorTable

TITLES = {
    "prob": "rollout probability",
    "length": "response length",
    "position": "position",
    "turn": "turn",
}
"""The built-in factors for people; a dump's column is named as it is."""


@dataclass(frozen=True, slots=True)
class BinShift:
    """One bin of a factor on the two steps.

    Attributes:
        label: its range or value.
        tokens: its loss tokens at each step.
        share: w, the share of the step's loss tokens in it.
        value: m, the metric's mean over them (None where it has none).
        composition: (w1 - w0) (m0 + m1) / 2, in the metric's units.
        within: (m1 - m0) (w0 + w1) / 2.
    """

    label: str
    tokens: tuple[int, int]
    share: tuple[float, float]
    value: tuple[float | None, float | None]
    composition: float
    within: float

    def to_dict(self, change: float) -> dict[str, Any]:
        """The document's bin: its terms as fractions of the change."""
        return {
            "bin": self.label,
            "tokens": list(self.tokens),
            "share": list(self.share),
            "value": list(self.value),
            "composition": share_of(self.composition, change),
            "within": share_of(self.within, change),
        }


@dataclass(frozen=True, slots=True)
class Moved:
    """The bins whose change of share explains most of the change (`moved`): one side of a
    cut through an ordered factor's bins, or one value of a column, against the rest.

    Attributes:
        where: the bins in words ("below 10% probability").
        bins: their labels.
        share: their share of the loss tokens at each step.
        value: the metric over them at each step at the same mix (each bin weighted by its
            mean share of the two steps), over the bins with tokens at both; None without.
        composition: the composition term of the two groups, these bins and the rest.
    """

    where: str
    bins: tuple[str, ...]
    share: tuple[float, float]
    value: tuple[float, float] | None
    composition: float

    def to_dict(self, change: float) -> dict[str, Any]:
        return {
            "where": self.where,
            "bins": list(self.bins),
            "share": list(self.share),
            "value": None if self.value is None else list(self.value),
            "composition": share_of(self.composition, change),
        }


@dataclass(frozen=True, slots=True)
class FactorShift:
    """A change split by one factor (`shift_share`).

    Attributes:
        factor: its name; title: in words.
        composition, within: the sums of the bins' terms, in the metric's units; they add
            up to the change.
        same_mix: the metric at each step at the mix of both (each bin weighted by its mean
            share), over the bins with tokens at both; None without such a bin.
        bins: each bin's numbers.
        moved: the bins that moved, where the mix explains some of the change.
    """

    factor: str
    title: str
    composition: float
    within: float
    same_mix: tuple[float, float] | None
    bins: tuple[BinShift, ...]
    moved: Moved | None

    def to_dict(self, change: float) -> dict[str, Any]:
        """The document's entry of `by`: the terms as fractions of the change."""
        return {
            "factor": self.factor,
            "composition": share_of(self.composition, change),
            "within": share_of(self.within, change),
            "moved": None if self.moved is None else self.moved.to_dict(change),
            "bins": [b.to_dict(change) for b in self.bins],
        }


def share_of(part: float, change: float) -> float | None:
    """`part` as a fraction of `change`; None where the change is 0 (nothing to share)."""
    return part / change if change != 0 and math.isfinite(change) else None


def shift_share(table: FactorTable) -> FactorShift:
    """Split the change of the metric between the two steps of `table` by its factor.

    Raises:
        ValueError: a step without loss tokens (its metric has no value).
    """
    w, m, has, composition, within = _terms(table.tokens, table.sums)
    bins = tuple(
        BinShift(
            label=label,
            tokens=(int(table.tokens[0, i]), int(table.tokens[1, i])),
            share=(float(w[0, i]), float(w[1, i])),
            value=tuple(float(m[s, i]) if has[s, i] else None for s in (0, 1)),
            composition=float(composition[i]),
            within=float(within[i]),
        )
        for i, label in enumerate(table.labels)
    )
    return FactorShift(
        factor=table.factor,
        title=TITLES.get(table.factor, table.factor),
        composition=float(composition.sum()),
        within=float(within.sum()),
        same_mix=_same_mix(w, m, has.all(axis=0)),
        bins=bins,
        moved=_moved(table, w, m, float(composition.sum() + within.sum())),
    )


def _terms(tokens: np.ndarray, sums: np.ndarray) -> tuple[np.ndarray, ...]:
    """(w, m, has, composition, within), each [2, bins] or [bins], of the bins' [2, bins]
    loss tokens and sums of the metric's term.

    Raises:
        ValueError: a step without loss tokens.
    """
    n = tokens.sum(axis=1)
    if not n.all():
        raise ValueError("a step without loss tokens has no value to split")
    w = tokens / n[:, None]
    has = tokens > 0
    m = np.divide(sums, tokens, out=np.zeros_like(sums, dtype=np.float64), where=has)
    m = np.where(has, m, m[::-1])  # an empty side takes the other's value
    composition = (w[1] - w[0]) * (m[0] + m[1]) / 2
    within = (m[1] - m[0]) * (w[0] + w[1]) / 2
    return w, m, has, composition, within


def _same_mix(w: np.ndarray, m: np.ndarray, both: np.ndarray) -> tuple[float, float] | None:
    """The metric at each step over the bins `both`, each weighted by its mean share."""
    weight = (w[0] + w[1])[both] / 2
    if not both.any() or weight.sum() == 0:
        return None
    return tuple(float(weight @ m[s, both] / weight.sum()) for s in (0, 1))


def _moved(table: FactorTable, w: np.ndarray, m: np.ndarray, change: float) -> Moved | None:
    """The group of bins whose share moved the metric most in the change's direction: for an
    ordered factor the side of a cut that grew, for a column one value (the one that grew,
    of two); against the rest,
    the two groups' composition term dW_g (M_g - M_rest), with M a group's mean at each step
    averaged over the two (a group empty at one step taking the other's). None where no
    group moves it that way."""
    size = len(table.labels)
    if table.ordered:
        groups = [np.arange(size) < k for k in range(1, size)]
    else:
        groups = [np.arange(size) == k for k in range(size)] if size > 1 else []
    sign = math.copysign(1.0, change) if change else 0.0
    best, best_term = None, 0.0
    for low in groups:
        term = _two_groups(table, low)
        if sign * term > best_term:
            best, best_term = low, sign * term
    if best is None:
        return None
    if w[1, best].sum() < w[0, best].sum() and (table.ordered or size == 2):
        best = ~best  # name the side that grew, where the other is one group too
    both = (table.tokens > 0).all(axis=0) & best
    return Moved(
        where=_where(table, best),
        bins=tuple(label for label, inside in zip(table.labels, best, strict=True) if inside),
        share=(float(w[0, best].sum()), float(w[1, best].sum())),
        value=_same_mix(w, m, both),
        composition=sign * best_term,
    )


def _two_groups(table: FactorTable, inside: np.ndarray) -> float:
    """The composition term of the bins `inside` and the rest, taken as two bins."""
    tokens = np.stack([table.tokens[:, inside].sum(axis=1), table.tokens[:, ~inside].sum(axis=1)])
    sums = np.stack([table.sums[:, inside].sum(axis=1), table.sums[:, ~inside].sum(axis=1)])
    return float(_terms(tokens.T, sums.T)[3].sum())


def _where(table: FactorTable, inside: np.ndarray) -> str:
    """The bins `inside` in words: a side of a cut, or a column's value."""
    index = np.flatnonzero(inside)
    if not table.ordered:
        return f"with {table.factor} = {table.labels[index[0]]}"
    below = not inside[-1]
    edge = table.upper[int(index[-1])] if below else table.lower[int(index[0])]
    if table.factor == "prob":
        return f"below {_probability(edge)}" if below else f"at {_probability(edge)} or more"
    if table.factor == "length":
        return (
            f"in responses under {edge:g} loss tokens"
            if below
            else f"in responses of {edge:g} loss tokens or more"
        )
    return f"before {table.factor} {edge:g}" if below else f"at {table.factor} {edge:g} or later"


def _probability(p: float) -> str:
    """A probability in words: a percentage with the digits that tell it from its
    neighbouring edges ("10% probability", "99.90% probability"), or a small number."""
    if p < 1e-4:
        return f"probability {p:.2g}"
    if p <= 0.5:
        return f"{100 * p:.2g}% probability"
    # The decimals that show 1 - p to two figures (1e-9: 1 - 0.9 is 0.09999999999999998).
    digits = max(0, 1 - math.floor(math.log10(100 * (1 - p)) + 1e-9))
    return f"{100 * p:.{digits}f}% probability"


def best_factor(shifts: Sequence[FactorShift], change: float) -> FactorShift | None:
    """The factor whose composition explains the largest share of the change (the best
    single explanation by the token mix); None without a change or a factor."""
    if not shifts or change == 0 or not math.isfinite(change):
        return None
    return max(shifts, key=lambda s: s.composition / change)


def split_sentence(
    metric: str, steps: tuple[int, int], values: tuple[float, float], best: FactorShift | None
) -> str:
    """The split in words: how much of the change the best factor's composition explains,
    and the bins that moved, or how much is within the bins.

    >>> split_sentence("k3", (3, 9), (1e-3, 1e-3), None)
    'k3 is 0.001 at step 3 and at step 9: no change to split'
    """
    (a, b), (before, after) = steps, values
    change = after - before
    if best is None:
        return f"{metric} is {before:.3g} at step {a} and at step {b}: no change to split"
    word = "rise" if change > 0 else "fall"
    head = (
        f"{metric} {'rose' if change > 0 else 'fell'} from {before:.3g} at step {a} "
        f"to {after:.3g} at step {b}"
    )
    share = best.composition / change
    moved = "" if best.moved is None else _moved_text(metric, best.moved)
    if share >= 0.5:
        return f"{head}: {share:.0%} of the {word} is composition by {best.title}{moved}"
    at_same = ""
    if best.same_mix is not None:
        at_same = f" ({metric} {_times(*best.same_mix)} at the same mix of {best.title})"
    return (
        f"{head}: {1 - share:.0%} of the {word} is within the bins{at_same}; the token mix "
        f"explains {share:.0%} at most, by {best.title}{moved}"
    )


def _moved_text(metric: str, moved: Moved) -> str:
    """': 3x more tokens below 10% probability (...); within those bins k3 is x1.02'."""
    before, after = moved.share
    shares = f"({after:.1%} of the loss tokens, from {before:.1%})"
    if before == 0:
        text = f": tokens {moved.where} appear ({after:.1%} of the loss tokens, none before)"
    elif after == 0:
        text = f": no tokens {moved.where} any more (from {before:.1%} of the loss tokens)"
    elif after >= before:
        text = f": {after / before:.3g}x more tokens {moved.where} {shares}"
    else:
        text = f": {before / after:.3g}x fewer tokens {moved.where} {shares}"
    if moved.value is not None:
        text += f"; within those bins {metric} {_times(*moved.value)}"
    return text


def _times(before: float, after: float) -> str:
    """after against before: 'is x1.02' where both are positive, else 'moved -0.011'."""
    if before > 0 and after > 0:
        return f"is x{after / before:.3g}"
    return f"moved {after - before:+.3g}"
