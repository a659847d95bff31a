"""The framework-neutral description of a correction setting, and the helpers that map onto it.

A `Canonical` setting is a tuple of `Component`s (weights, masks, batch normalization) in the terms
of docs/corrections.md, with the numerical details that decide whether two frameworks compute the
same thing (the +-20 exponent clamp, float32 comparisons, NeMo-RL's overflow to 0). Each framework
module maps its specs onto it (`to_canonical`) and back (`from_canonical`), using the builders
and note helpers here; `iscore.advice.conversion` converts between frameworks through it.

>>> c = Canonical((weight_component("token", upper=2.0),))
>>> c.describe()
'token TIS: w = min(rho, 2)'
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from iscore.frameworks.names import NAMES
from iscore.frameworks.spec import Spec
from iscore.packed import ops

MethodId = Literal[
    "token-tis", "kl-mask", "batch-normalization", "current-policy-is", "sequence-tis",
    "geometric-tis", "icepop", "token-mask", "sequence-mask", "geometric-mask", "seq-mask-tis",
    "outlier-veto", "trust-region-mask", "binary-kl-mask",
]  # fmt: skip
"""The corrections of docs/corrections.md, by name. Within a role, components sort in this
order, so a target that takes one weight takes the first (token TIS before a current-policy
weight, before sequence-level ones)."""

METHODS: tuple[str, ...] = MethodId.__args__

METHOD_LABELS: dict[str, str] = {
    "token-tis": "token TIS",
    "kl-mask": "KL-estimator mask",
    "batch-normalization": "batch normalization",
    "current-policy-is": "current-policy IS",
    "sequence-tis": "sequence TIS",
    "geometric-tis": "geometric-mean TIS",
    "icepop": "IcePop",
    "token-mask": "token mask",
    "sequence-mask": "sequence mask",
    "geometric-mask": "geometric sequence mask",
    "seq-mask-tis": "raw token weights in a geometric mask",
    "outlier-veto": "outlier veto",
    "trust-region-mask": "probability trust-region mask",
    "binary-kl-mask": "KPop binary-KL token mask",
}
"""Each correction's name for people."""
Role = Literal["weight", "mask", "normalize"]
Level = Literal[
    "token", "sequence", "geometric", "geometric_unmasked", "max", "any_token", "sequence_all",
    "segment",
]  # fmt: skip
Statistic = Literal[
    "ratio", "log_ratio", "k2", "k3", "k3_reverse", "prob_diff", "binary_kl", "mult_error"
]  # fmt: skip
Numerator = Literal["train", "policy", "rollout"]
Numerics = Literal["exact", "clamp", "clamp_each", "float32", "overflow_zero"]
Anchor = Literal["recompute", "rollout", "none"]

E_LOW = math.exp(-ops.SAFETY_BOUND)
E_HIGH = math.exp(ops.SAFETY_BOUND)
# A bound that never binds in frameworks clamping the exponent to +-20 (e^20 = 4.85e8).
BIG = 1e9
TINY = 1e-9
K_STATISTICS = ("k2", "k3", "k3_reverse")
# Numerics that agree with the exact value wherever a bound inside e^+-20 decides the outcome.
_COLLAPSIBLE = ("exact", "clamp", "overflow_zero")


@dataclass(frozen=True, slots=True)
class Component:
    """One mechanism of a correction setting, in the terms of docs/corrections.md#catalogue.

    Args:
        method: which correction of the catalogue it is (`METHODS`, named for people in
            `METHOD_LABELS`): token / sequence / geometric-mean TIS, IcePop, token / sequence /
            geometric masks, raw token weights in a geometric mask, an outlier veto, a
            KL-estimator mask, a probability trust-region mask, a binary-KL token mask,
            batch normalization or current-policy IS.
        role: "weight" (multiplies the loss term), "mask" (removes tokens from the loss mask)
            or "normalize" (divides the weights by their batch mean).
        level: what the ratio or statistic is taken over: "token"; "sequence" (the product
            e^S, or for a statistic its sum); "geometric" (the mean over loss tokens, e^G);
            "geometric_unmasked" (the mean over every response token, masked ones included);
            "max" (the largest token value); "any_token" (a sequence is dropped when any of
            its loss tokens falls outside the band); "segment" (per run of consecutive loss
            tokens within a sequence, a multi-turn sequence's turns: the mean, as ROLL's
            `segment`). Normalization: "token", "sequence" (the mean over sequences with a loss
            token) or "sequence_all" (over every sequence).
        lower: weight: the truncation's lower bound; mask: the band's lower bound; None is
            open. In ratio units for the "ratio" statistic, else in the statistic's units.
        upper: the upper bound, likewise.
        statistic: what a mask compares: "ratio"; "log_ratio" d (verl's k1 = -d is stored
            with negated bounds); "k2" d^2/2; "k3" e^d - 1 - d; "k3_reverse" e^-d - 1 + d;
            "prob_diff" the probability difference e^{numerator} - e^{rollout} (prime-rl's
            trust region); "binary_kl" max(B(p||q), B(q||p)), the binary KL of the two
            probabilities p = e^{numerator}, q = e^{rollout} both ways, each probability
            clamped into [1e-6, 1 - 1e-6] (KPop, `ops.binary_kl`: verl #6800, prime-rl #3283);
            "mult_error" e^{|d|}, the multiplicative probability error (NeMo-RL's
            `seq_logprob_error_threshold` bounds its sequence mean: sign-blind, >= 1).
        numerator: whose log-probs the ratio's numerator holds: "train" (the trainer's
            recompute), "policy" (the current policy) or "rollout" (d = 0: no correction).
        numerics: how the ratio is computed: "exact" (float64, no clamp); "clamp" (the
            exponent clamped to +-20 after aggregating); "clamp_each" (each token's
            log-ratio clamped before aggregating); "float32" (TRL: float32 ratios compared
            in float32); "overflow_zero" (NeMo-RL: a weight overflowing float32 becomes 0).
            `Canonical` keeps it in its effective form: "exact" wherever the difference
            cannot change the result (bounds strictly inside e^+-20).
        strict: a mask's bounds are exclusive.
        zero: weight only: a band outside which the weight is zeroed while the token stays in
            the loss mask (IcePop-style).
        unless: weight only: the truncation applies only to sequences outside this band
            (AReaL's sequence clamp with `agg` sum or max).
        by_advantage: mask only: the band's side depends on the token's advantage A: tokens
            with A > 0 are held to `upper` alone, the others (A <= 0) to `lower` alone.
    """

    method: MethodId
    role: Role
    level: Level
    lower: float | None = None
    upper: float | None = None
    statistic: Statistic = "ratio"
    numerator: Numerator = "train"
    numerics: Numerics = "exact"
    strict: bool = False
    zero: Component | None = None
    unless: Component | None = None
    by_advantage: bool = False

    def describe(self) -> str:
        """One line: the correction and what it does, e.g. "token TIS: w = min(rho, 2)"."""
        label = METHOD_LABELS[self.method]
        if self.role == "normalize":
            over = {"token": "tokens", "sequence": "sequences", "sequence_all": "all sequences"}
            return f"{label}: weights divided by their batch mean over {over[self.level]}"
        ratio = _symbol(self.level, self.statistic, self.numerator)
        if self.role == "mask":
            if self.level == "any_token":
                return f"{label}: drop sequences unless every token has {_band(self)}"
            what = {"token": "tokens", "segment": "segments"}.get(self.level, "sequences")
            if self.by_advantage:
                high, low = replace(self, lower=None), replace(self, upper=None)
                return (
                    f"{label}: drop tokens with A > 0 unless {_band(high)}, "
                    f"with A <= 0 unless {_band(low)}"
                )
            return f"{label}: drop {what} unless {_band(self)}"
        value = ratio
        if self.lower is not None and self.upper is not None:
            value = f"clamp({ratio}, {self.lower:g}, {self.upper:g})"
        elif self.upper is not None:
            value = f"min({ratio}, {self.upper:g})"
        elif self.lower is not None:
            value = f"max({ratio}, {self.lower:g})"
        if self.unless is not None:
            value += f" where not {_band(self.unless)}"
        if self.zero is not None:
            value += f", zeroed unless {_band(self.zero)}"
        return f"{label}: w = {value}"


def _symbol(level: str, statistic: str = "ratio", numerator: str = "train") -> str:
    """How a level's ratio or statistic is written in descriptions."""
    prefix = "current-policy " if numerator == "policy" else ""
    if statistic == "ratio":
        symbol = {"token": "rho", "any_token": "rho", "sequence": "e^S", "max": "e^max(d)"}
        symbol["segment"] = "e^segment_mean(d)"
        return prefix + symbol.get(level, "e^G")
    names = {
        "log_ratio": "d",
        "prob_diff": "dp",
        "binary_kl": "max(B(p|q), B(q|p))",
        "mult_error": "e^|d|",
    }
    name = names.get(statistic, statistic)
    aggregate = {"sequence": "sum", "geometric": "mean", "geometric_unmasked": "mean"}
    aggregate |= {"max": "max", "segment": "segment_mean"}
    return prefix + (f"{aggregate[level]}({name})" if level in aggregate else name)


def _band(c: Component) -> str:
    """A band as "L <= x <= U"; log-ratio bands are shown as ratio bands."""
    lower, upper, statistic = c.lower, c.upper, c.statistic
    if statistic == "log_ratio":
        lower, upper, statistic = _exp(lower), _exp(upper), "ratio"
    symbol = _symbol(c.level, statistic, c.numerator)
    sign = "<" if c.strict else "<="
    low = "" if lower is None else f"{lower:g} {sign} "
    high = "" if upper is None else f" {sign} {upper:g}"
    return f"{low}{symbol}{high}"


def _exp(x: float | None) -> float | None:
    return None if x is None else math.exp(x)


def weight_component(
    level: Level,
    *,
    lower: float | None = None,
    upper: float | None = None,
    numerator: Numerator = "train",
    numerics: Numerics = "exact",
    zero: Component | None = None,
    unless: Component | None = None,
) -> Component:
    """A weight component with its catalogue id."""
    method = _weight_method(level, numerator, zero)
    return Component(
        method, "weight", level, lower, upper, "ratio", numerator, numerics, zero=zero,
        unless=unless,
    )  # fmt: skip


def _weight_method(level: str, numerator: str, zero: Component | None) -> MethodId:
    if numerator == "policy":
        return "current-policy-is"
    if level == "token":
        if zero is None:
            return "token-tis"
        return "seq-mask-tis" if zero.level == "geometric" else "icepop"
    if level == "sequence":
        return "sequence-tis" if zero is None else "sequence-mask"
    return "geometric-tis"


def mask_component(
    level: Level,
    lower: float | None = None,
    upper: float | None = None,
    *,
    statistic: Statistic = "ratio",
    numerator: Numerator = "train",
    numerics: Numerics = "exact",
    strict: bool = False,
    by_advantage: bool = False,
) -> Component:
    """A mask (or zeroing band) component with its catalogue id."""
    if statistic == "prob_diff":
        method = "trust-region-mask"
    elif statistic == "binary_kl":
        method = "binary-kl-mask"
    elif level == "any_token":
        method = "outlier-veto"
    elif statistic in (*K_STATISTICS, "mult_error") or level == "max":
        method = "kl-mask"
    else:
        method = {"token": "token-mask", "sequence": "sequence-mask"}.get(level, "geometric-mask")
    return Component(
        method, "mask", level, lower, upper, statistic, numerator, numerics, strict,
        by_advantage=by_advantage,
    )  # fmt: skip


def normalize_component(level: Level) -> Component:
    return Component("batch-normalization", "normalize", level)


@dataclass(frozen=True, slots=True)
class Canonical:
    """A correction setting on the canonical catalogue: components plus the loss's anchor.

    Components are kept in their effective form (`Component.numerics`) and sorted (weights
    multiply and masks combine by AND, so their order carries no meaning), so two settings
    with equal `Canonical` replay identically: the same weight and keep for every token.

    Args:
        components: the weights, masks and normalization the setting applies.
        anchor: what the loss's PPO ratio is taken against: "recompute" (the trainer's
            recompute, decoupled), "rollout" (bypass: PPO anchored on the rollout) or "none" (a
            REINFORCE-style loss weighted by the current policy over the rollout).
        sequence_over: "kept" when sequence-level ratios run over the tokens an earlier token
            mask kept (SkyRL), "original" when over the loss mask as given.

    >>> from iscore.frameworks import skyrl
    >>> [c.method for c in skyrl.to_canonical(skyrl.PRESETS["skyrl_tldr_stack"]).components]
    ['token-tis', 'token-mask', 'geometric-mask', 'outlier-veto']
    """

    components: tuple[Component, ...] = ()
    anchor: Anchor = "recompute"
    sequence_over: Literal["original", "kept"] = "original"

    def __post_init__(self) -> None:
        order = {"weight": 0, "mask": 1, "normalize": 2}
        effective = (_effective(c) for c in self.components)
        # A mask open on both sides removes nothing.
        kept = (c for c in effective if c.role != "mask" or (c.lower, c.upper) != (None, None))
        components = tuple(
            sorted(kept, key=lambda c: (order[c.role], METHODS.index(c.method), repr(c)))
        )
        object.__setattr__(self, "components", components)

    @property
    def weights(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.role == "weight")

    @property
    def masks(self) -> tuple[Component, ...]:
        return tuple(c for c in self.components if c.role == "mask")

    @property
    def normalize(self) -> Component | None:
        return next((c for c in self.components if c.role == "normalize"), None)

    @property
    def method(self) -> str:
        """The leading method: the first weight's, else the first mask's; "bypass" for a PPO
        anchored on the rollout without either, "none" for no correction."""
        if self.components:
            return self.components[0].method
        return "bypass" if self.anchor == "rollout" else "none"

    def describe(self) -> str:
        """The setting in one line, component by component."""
        parts = [c.describe() for c in self.components]
        if self.anchor == "rollout":
            parts.append("bypass: PPO ratio anchored on the rollout")
        elif self.anchor == "none":
            parts.append("REINFORCE-style loss, no PPO ratio")
        if self.sequence_over == "kept":
            parts.append("sequence ratios over the tokens the token mask kept")
        return "; ".join(parts) or "no correction"

    def loosely_equals(self, other: Canonical) -> bool:
        """Whether both are the same rule computed along different floating-point paths (the
        +-20 clamp, float32 or overflow details, ratio vs log-space comparisons), so that
        they can differ only for extreme log-ratios or at a bound's rounding."""
        return _loose_key(self) == _loose_key(other)


# ------------------------------------------------------------------ effective numerics


def _effective(c: Component) -> Component:
    """`c` with bounds and numerics that cannot change the result normalized away."""
    zero = None if c.zero is None else _effective(c.zero)
    unless = None if c.unless is None else _effective(c.unless)
    lower, upper, numerics = c.lower, c.upper, c.numerics
    if numerics == "clamp_each" and c.level in ("token", "any_token"):
        numerics = "clamp"  # per token, clamping each value or the total is the same
    if c.statistic == "ratio" and c.role != "normalize":
        # Ratios are >= 0, so an inclusive bound at or below 0, or at +inf, decides nothing.
        if lower is not None and (lower < 0 or (lower == 0 and not c.strict)):
            lower = None
        if upper == math.inf and not c.strict:
            upper = None
    if numerics == "clamp" and c.role != "normalize":
        # A clamped exponent never leaves [-20, 20]: bounds at or beyond it never bind.
        edge_low, edge_high = (E_LOW, E_HIGH) if c.statistic == "ratio" else (-20.0, 20.0)
        if c.statistic in ("ratio", "log_ratio"):
            lower = None if lower is not None and lower <= edge_low and not c.strict else lower
            upper = None if upper is not None and upper >= edge_high and not c.strict else upper
    if zero is not None and zero.lower is None and zero.upper is None:
        zero = None  # a band open on both sides zeroes nothing
    c = replace(c, lower=lower, upper=upper, numerics=numerics, zero=zero, unless=unless)
    if c.role == "weight":
        c = replace(c, method=_weight_method(c.level, c.numerator, zero))
        return _effective_weight(c)
    if c.role == "mask" and _band_collapses(c):
        return replace(c, numerics="exact")
    return c


def _effective_weight(c: Component) -> Component:
    zero = c.zero
    if zero is not None and zero.level == c.level and zero.statistic == "ratio":
        # Inside a zeroing band on the same ratio, a truncation beyond the band never binds.
        if c.upper is not None and zero.upper is not None and c.upper >= zero.upper:
            c = replace(c, upper=None)
        if c.lower is not None and zero.lower is not None and c.lower <= zero.lower:
            c = replace(c, lower=None)
    numerics = c.numerics
    if numerics == "float32":
        # Rounding to float32 is monotone, so it commutes with clamping: only the comparisons
        # of a zeroing band see float32 (kept on `zero`).
        numerics = "exact"
    bounded = (
        c.lower is not None
        and c.upper is not None
        and E_LOW <= c.lower <= c.upper <= E_HIGH
        and c.unless is None
    )
    if bounded and numerics in ("exact", "clamp"):
        numerics = "exact"  # beyond e^+-20 both sides truncate to the same bound
    if (
        zero is not None
        and zero.statistic == "ratio"
        and zero.level == c.level
        and zero.numerator == c.numerator
        and zero.lower is not None
        and zero.upper is not None
        and zero.lower > E_LOW
        and zero.upper < E_HIGH
        and numerics in _COLLAPSIBLE
        and zero.numerics in _COLLAPSIBLE
    ):
        # Every ratio where the numerics differ lies outside the band and is zeroed.
        numerics = "exact"
        zero = replace(zero, numerics="exact")
    return replace(c, numerics=numerics, zero=zero)


def _band_collapses(c: Component) -> bool:
    """Whether a band decides the same for every numerics path (see `Component.numerics`)."""
    if c.numerics in ("exact", "float32"):
        return False
    aggregated = c.level in ("sequence", "geometric", "geometric_unmasked")
    # Sums of per-token clamped values differ from the unclamped sums, except for a
    # nonnegative statistic whose clamped token alone already exceeds the bound.
    summed_k = c.statistic in K_STATISTICS and c.level == "sequence"
    if c.numerics == "clamp_each" and aggregated and not summed_k:
        return False
    if c.statistic == "ratio":
        inside = (c.lower is None or c.lower > E_LOW) and (c.upper is None or c.upper < E_HIGH)
        if c.numerics == "overflow_zero":
            # An overflowed 0 and the true huge ratio are both kept or both dropped only
            # when the band is closed on both sides or on neither.
            return inside and (c.lower is None) == (c.upper is None)
        return inside
    bound = ops.SAFETY_BOUND
    if c.statistic == "log_ratio":
        return (c.lower is None or c.lower > -bound) and (c.upper is None or c.upper < bound)
    k = _K_FUNCTIONS[c.statistic]
    return c.upper is not None and c.upper < min(k(-bound), k(bound))


_K_FUNCTIONS: dict[str, Callable[[float], float]] = {
    "k2": lambda d: 0.5 * d * d,
    "k3": lambda d: math.expm1(d) - d,
    "k3_reverse": lambda d: math.expm1(-d) + d,
}


def k_log_band(statistic: str, upper: float) -> tuple[float, float]:
    """The log-ratio interval [a, b] where a per-token KL statistic stays <= `upper`."""
    if statistic == "k2":
        radius = math.sqrt(2.0 * upper)
        return -radius, radius
    k3 = _K_FUNCTIONS["k3"]
    # k3 falls on (-inf, 0] and rises on [0, inf); bisect each side for k3 = upper.
    low = _bisect(k3, upper, -upper - 2.0, 0.0)
    high = _bisect(k3, upper, math.log(upper + 2.0) + 2.0, 0.0)
    return (-high, -low) if statistic == "k3_reverse" else (low, high)


def _bisect(f: Callable[[float], float], target: float, outside: float, inside: float) -> float:
    """The point between `inside` (f <= target) and `outside` (f > target) where f = target."""
    for _ in range(200):
        middle = 0.5 * (outside + inside)
        if f(middle) > target:
            outside = middle
        else:
            inside = middle
    return inside


def _loose_key(c: Canonical) -> tuple[Any, ...]:
    keys = sorted((_loose_component(x) for x in c.components), key=repr)
    return (tuple(keys), c.anchor, c.sequence_over)


def _loose_component(c: Component | None) -> tuple[Any, ...] | None:
    """A component without numerics, its bands in log space, rounded to 6 digits."""
    if c is None:
        return None
    level, statistic, lower, upper = c.level, c.statistic, c.lower, c.upper
    if c.role == "mask":
        if statistic == "ratio":
            statistic, lower, upper = "log_ratio", log_or_none(lower), log_or_none(upper)
        elif (
            statistic in K_STATISTICS
            and lower is None
            and upper is not None
            and (level in ("token", "any_token", "max"))
        ):
            # Per token, k <= U is a log-ratio interval; the max of k <= U, all tokens.
            statistic, (lower, upper) = "log_ratio", k_log_band(statistic, upper)
            level = "any_token" if level == "max" else level
        if statistic == "log_ratio" and level == "max" and lower is None:
            level = "any_token"  # max(d) <= b: every token's d <= b
    # Bounds beyond e^+-20 only decide extreme ratios, which the loose comparison ignores.
    if statistic == "log_ratio" or c.role == "weight":
        low, high = (-ops.SAFETY_BOUND, ops.SAFETY_BOUND)
        if statistic == "ratio":
            low, high = E_LOW, E_HIGH
        lower = None if lower is not None and lower <= low else lower
        upper = None if upper is not None and upper >= high else upper
    return (
        c.role,
        level,
        statistic,
        c.numerator,
        _round(lower),
        _round(upper),
        _loose_component(c.zero),
        _loose_component(c.unless),
        c.by_advantage,
    )


def log_or_none(x: float | None) -> float | None:
    if x is None:
        return None
    return math.log(x) if x > 0 else -math.inf


def _round(x: float | None) -> float | None:
    # Six digits: a float32 threshold (slime's veto) is the same rule as its float64 value.
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


# ------------------------------------------------------------------ canonical(spec)


def identity_at_zero(c: Component) -> bool:
    """Whether a component changes nothing when every log-ratio is 0 (ratio 1)."""
    if c.role == "mask":
        value = 1.0 if c.statistic in ("ratio", "mult_error") else 0.0
        low_ok = c.lower is None or (value > c.lower if c.strict else value >= c.lower)
        high_ok = c.upper is None or (value < c.upper if c.strict else value <= c.upper)
        return low_ok and high_ok
    untouched = (c.lower is None or c.lower <= 1.0) and (c.upper is None or c.upper >= 1.0)
    if c.unless is not None:
        untouched = untouched or identity_at_zero(c.unless)
    return untouched and (c.zero is None or identity_at_zero(c.zero))


Translation = tuple[Spec, tuple[str, ...]]


def lost(notes: list[str], c: Component, why: str) -> None:
    """Note what a target does not express of `c` as sentences: `why` ending in "; dropped"
    says the component is left out, otherwise how the target's differs."""
    what, _, rule = c.describe().partition(": ")
    subject = f"the {what} ({rule})" if rule else f"the {what}"
    reason = why.removesuffix("; dropped")
    verdict = "Left out" if reason != why else "Changed"
    notes.append(f"{verdict}: {subject}. {sentence(reason)}")


def sentence(text: str) -> str:
    """`text` as a sentence: a capital first letter (unless it starts with a name written in
    lower case: a framework's `framework:` value, slime's `mis` module, a config key) and a
    full stop.

    >>> sentence("the cookbook has no rejection mask"), sentence("slime's TIS")
    ('The cookbook has no rejection mask.', "slime's TIS.")
    """
    text = text.strip()
    first = re.split(r"[\s']", text, maxsplit=1)[0]
    if first.islower() and not (re.search(r"[_.`(]", first) or first in (*NAMES, "mis")):
        text = text[0].upper() + text[1:]
    return text if text.endswith((".", "!", "?")) else text + "."


def ratio_bounds(m: Component) -> tuple[float | None, float | None] | None:
    """A band as ratio bounds at its level (see `ratio_level`), or None without a ratio form."""
    if m.statistic == "ratio":
        return m.lower, m.upper
    if m.statistic == "log_ratio":
        return _exp(m.lower), _exp(m.upper)
    per_token = m.level in ("token", "any_token", "max")
    if m.statistic in K_STATISTICS and m.lower is None and m.upper is not None and per_token:
        low, high = k_log_band(m.statistic, m.upper)
        return math.exp(low), math.exp(high)
    return None


def ratio_level(m: Component) -> str:
    """The level a ratio band of `m` acts at: a bound on a per-sequence max of per-token values
    (any k statistic; an upper-only ratio or log-ratio) holds for every token."""
    if m.level == "max" and (m.statistic in K_STATISTICS or m.lower is None):
        return "any_token"
    return m.level


def first_weight(
    c: Canonical, notes: list[str], framework: str, *, conditional: bool = False
) -> Component | None:
    """The weight a target expresses; the others, and (unless the target can) a truncation
    applied only outside a band (AReaL's), are noted."""
    weights = c.weights
    for extra in weights[1:]:
        lost(notes, extra, f"{framework} applies one IS weight; dropped")
    w = weights[0] if weights else None
    if w is not None and w.unless is not None and not conditional:
        lost(notes, w, f"{framework} truncates every sequence, not only those outside the band")
    return w


def note_numerator(notes: list[str], c: Component, numerator: str, framework: str) -> None:
    if c.numerator != numerator and c.numerator != "rollout":
        where = "the current policy" if numerator == "policy" else "the trainer's recompute"
        lost(notes, c, f"{framework} takes this ratio against {where}")


def note_extras(notes: list[str], c: Canonical, framework: str, normalize: bool = False) -> None:
    """Notes for what no builder below expresses unless told otherwise."""
    if c.normalize is not None and not normalize:
        lost(notes, c.normalize, f"{framework} has no batch normalization; dropped")
    if c.sequence_over == "kept":
        notes.append(
            f"{framework} computes sequence ratios over the original loss mask, not over the "
            "tokens a token mask kept (as the source does)"
        )


def without_segments(c: Canonical, framework: str) -> tuple[Canonical, tuple[str, ...]]:
    """`c` for a framework without the "segment" level (`Framework.segments`): each
    segment-level component at the geometric level, which is the same wherever a sequence's
    loss tokens form one run; a note for each.

    >>> seg = Canonical((weight_component("segment", upper=1.2),))
    >>> whole, notes = without_segments(seg, "verl")
    >>> whole.components[0].level, notes[0][:40]
    ('geometric', 'Changed: the geometric-mean TIS (w = min')
    """
    notes: list[str] = []

    def whole(x: Component | None) -> Component | None:
        if x is None:
            return None
        if x.level == "segment":
            lost(
                notes,
                x,
                f"{framework} has no per-segment level (each run of consecutive loss tokens); "
                "written over the sequence's loss tokens, the same where they form one run",
            )
            x = replace(x, level="geometric")
        return replace(x, zero=whole(x.zero), unless=whole(x.unless))

    components = tuple(whole(x) for x in c.components)
    return (replace(c, components=components) if notes else c), tuple(notes)
