"""Export a correction setting: as its framework's own config, on the canonical catalogue, and
as the closest setting of another framework.

Three things, each the inverse of something `parse` does or a bridge between frameworks:

- `snippet(spec)`: the text a user pastes into the framework's own config (YAML with the
  framework's nesting, or its command-line flags), and `to_file_text(spec)`, the iscore config
  file `iscore replay --config FILE` reads as is. Both come from the spec's `to_config()`, which
  each framework module writes next to its `parse`.
- `canonical(spec)`: the setting on the method catalogue of corrections.md section 1 (C1..C16),
  as a tuple of components (weights, masks, batch normalization) with the numerical details
  that decide whether two frameworks compute the same thing (the +-20 exponent clamp, float32
  comparisons, NeMo-RL's overflow to 0).
- `convert(spec, to)`: the target framework's closest setting. `exact` only when the target
  replays identically: by construction when the canonical forms agree, or, for settings that
  are the same rule computed along a different floating-point path, when a `batch` given shows
  identical weights and masks. Whatever the target cannot express is a note, and with a
  `batch` the difference is measured (`iscore.impact.quick_stats` of both).

>>> from iscore.frameworks import nemo_rl
>>> out = convert(nemo_rl.PRESETS["nemo_icepop"], "openrlhf")
>>> out.exact, canonical(out.spec).method
(True, 'C4')
>>> print(out.text)
--algo.advantage.is_correction_enable \\
--algo.advantage.is_correction_type icepop \\
--algo.advantage.is_correction_threshold 0.5 5.0
"""

from __future__ import annotations

import math
import re
import shlex
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal

import torch
import yaml

from iscore import ops
from iscore.batch import TokenBatch
from iscore.errors import ConfigError, quote
from iscore.frameworks import areal, fireworks, nemo_rl, openrlhf, skyrl, slime, trl, verl
from iscore.impact import aggregation_of, quick_stats
from iscore.replay import FRAMEWORKS, Spec

MethodId = Literal[
    "C1", "C2", "C3", "C4", "C5", "C6", "C7", "C8", "C9", "C10", "C11", "C12", "C13", "C14",
    "C15", "C16",
]  # fmt: skip
Role = Literal["weight", "mask", "normalize"]
Level = Literal[
    "token", "sequence", "geometric", "geometric_unmasked", "max", "any_token", "sequence_all"
]
Statistic = Literal["ratio", "log_ratio", "k2", "k3", "k3_reverse"]
Numerator = Literal["train", "policy", "rollout"]
Numerics = Literal["exact", "clamp", "clamp_each", "float32", "overflow_zero"]
Anchor = Literal["recompute", "rollout", "none"]

_E_LOW = math.exp(-ops.SAFETY_BOUND)
_E_HIGH = math.exp(ops.SAFETY_BOUND)
# A bound that never binds in frameworks clamping the exponent to +-20 (e^20 = 4.85e8).
_BIG = 1e9
_TINY = 1e-9
_K_STATISTICS = ("k2", "k3", "k3_reverse")
# Numerics that agree with the exact value wherever a bound inside e^+-20 decides the outcome.
_COLLAPSIBLE = ("exact", "clamp", "overflow_zero")


@dataclass(frozen=True, slots=True)
class Component:
    """One mechanism of a correction setting, in the terms of corrections.md section 1.

    Args:
        method: the catalogue id (C1 token TIS, C2 sequence TIS, C3 geometric TIS, C4 IcePop,
            C5 token rejection, C6 sequence rejection, C7 geometric rejection, C8 raw token
            weights in a geometric mask, C9 any-token veto / outlier mask, C10 KL-estimator
            rejection, C11 batch normalization, C12 current-policy IS).
        role: "weight" (multiplies the loss term), "mask" (removes tokens from the loss mask)
            or "normalize" (divides the weights by their batch mean).
        level: what the ratio or statistic is taken over: "token"; "sequence" (the product
            e^S, or for a statistic its sum); "geometric" (the mean over loss tokens, e^G);
            "geometric_unmasked" (the mean over every response token, masked ones included);
            "max" (the largest token value); "any_token" (a sequence is dropped when any of
            its loss tokens falls outside the band). Normalization: "token", "sequence" (the
            mean over sequences with a loss token) or "sequence_all" (over every sequence).
        lower: weight: the truncation's lower bound; mask: the band's lower bound; None is
            open. In ratio units for the "ratio" statistic, else in the statistic's units.
        upper: the upper bound, likewise.
        statistic: what a mask compares: "ratio"; "log_ratio" d (verl's k1 = -d is stored
            with negated bounds); "k2" d^2/2; "k3" e^d - 1 - d; "k3_reverse" e^-d - 1 + d.
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

    def describe(self) -> str:
        """One line: the method id and what it does, e.g. "C1 w = min(rho, 2)"."""
        if self.role == "normalize":
            over = {"token": "tokens", "sequence": "sequences", "sequence_all": "all sequences"}
            return f"C11 weights divided by their batch mean over {over[self.level]}"
        ratio = _symbol(self.level, self.statistic, self.numerator)
        if self.role == "mask":
            if self.level == "any_token":
                return f"{self.method} drop sequences unless every token has {_band(self)}"
            what = "tokens" if self.level == "token" else "sequences"
            return f"{self.method} drop {what} unless {_band(self)}"
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
        return f"{self.method} w = {value}"


def _symbol(level: str, statistic: str = "ratio", numerator: str = "train") -> str:
    """How a level's ratio or statistic is written in descriptions."""
    prefix = "current-policy " if numerator == "policy" else ""
    if statistic == "ratio":
        symbol = {"token": "rho", "any_token": "rho", "sequence": "e^S", "max": "e^max(d)"}
        return prefix + symbol.get(level, "e^G")
    name = "d" if statistic == "log_ratio" else statistic
    aggregate = {"sequence": "sum", "geometric": "mean", "geometric_unmasked": "mean"}
    aggregate |= {"max": "max"}
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


def _weight(
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
        return "C12"
    if level == "token":
        return "C1" if zero is None else "C8" if zero.level == "geometric" else "C4"
    if level == "sequence":
        return "C2" if zero is None else "C6"
    return "C3"


def _mask(
    level: Level,
    lower: float | None = None,
    upper: float | None = None,
    *,
    statistic: Statistic = "ratio",
    numerator: Numerator = "train",
    numerics: Numerics = "exact",
    strict: bool = False,
) -> Component:
    """A mask (or zeroing band) component with its catalogue id."""
    if level == "any_token":
        method = "C9"
    elif statistic in _K_STATISTICS or level == "max":
        method = "C10"
    else:
        method = {"token": "C5", "sequence": "C6"}.get(level, "C7")
    return Component(method, "mask", level, lower, upper, statistic, numerator, numerics, strict)


def _normalize(level: Level) -> Component:
    return Component("C11", "normalize", level)


@dataclass(frozen=True, slots=True)
class Canonical:
    """A correction setting on the canonical catalogue: components plus the loss's anchor.

    Components are kept in their effective form (`Component.numerics`) and sorted (weights
    multiply and masks combine by AND, so their order carries no meaning), so two settings
    with equal `Canonical` replay identically: the same weight and keep for every token.

    Args:
        components: the weights, masks and normalization the setting applies.
        anchor: what the loss's PPO ratio is taken against: "recompute" (the trainer's
            recompute, decoupled), "rollout" (bypass, C13) or "none" (a REINFORCE-style loss
            weighted by the current policy over the rollout, C12).
        sequence_over: "kept" when sequence-level ratios run over the tokens an earlier token
            mask kept (SkyRL), "original" when over the loss mask as given.

    >>> from iscore.frameworks import skyrl
    >>> [c.method for c in canonical(skyrl.PRESETS["skyrl_tldr_stack"]).components]
    ['C1', 'C5', 'C7', 'C9']
    """

    components: tuple[Component, ...] = ()
    anchor: Anchor = "recompute"
    sequence_over: Literal["original", "kept"] = "original"

    def __post_init__(self) -> None:
        order = {"weight": 0, "mask": 1, "normalize": 2}
        effective = (_effective(c) for c in self.components)
        # A mask open on both sides removes nothing.
        kept = (c for c in effective if c.role != "mask" or (c.lower, c.upper) != (None, None))
        components = tuple(sorted(kept, key=lambda c: (order[c.role], repr(c))))
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
        """The leading method: the first weight's, else the first mask's; "C13" for a bypass
        PPO without either, "none" for no correction."""
        if self.components:
            return self.components[0].method
        return "C13" if self.anchor == "rollout" else "none"

    def describe(self) -> str:
        """The setting in one line, component by component."""
        parts = [c.describe() for c in self.components]
        if self.anchor == "rollout":
            parts.append("C13 PPO ratio anchored on the rollout (bypass)")
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
        edge_low, edge_high = (_E_LOW, _E_HIGH) if c.statistic == "ratio" else (-20.0, 20.0)
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
        and _E_LOW <= c.lower <= c.upper <= _E_HIGH
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
        and zero.lower > _E_LOW
        and zero.upper < _E_HIGH
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
    summed_k = c.statistic in _K_STATISTICS and c.level == "sequence"
    if c.numerics == "clamp_each" and aggregated and not summed_k:
        return False
    if c.statistic == "ratio":
        inside = (c.lower is None or c.lower > _E_LOW) and (c.upper is None or c.upper < _E_HIGH)
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


def _k_log_band(statistic: str, upper: float) -> tuple[float, float]:
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
            statistic, lower, upper = "log_ratio", _log(lower), _log(upper)
        elif (
            statistic in _K_STATISTICS
            and lower is None
            and upper is not None
            and (level in ("token", "any_token", "max"))
        ):
            # Per token, k <= U is a log-ratio interval; the max of k <= U, all tokens.
            statistic, (lower, upper) = "log_ratio", _k_log_band(statistic, upper)
            level = "any_token" if level == "max" else level
        if statistic == "log_ratio" and level == "max" and lower is None:
            level = "any_token"  # max(d) <= b: every token's d <= b
    # Bounds beyond e^+-20 only decide extreme ratios, which the loose comparison ignores.
    if statistic == "log_ratio" or c.role == "weight":
        low, high = (-ops.SAFETY_BOUND, ops.SAFETY_BOUND)
        if statistic == "ratio":
            low, high = _E_LOW, _E_HIGH
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
    )


def _log(x: float | None) -> float | None:
    if x is None:
        return None
    return math.log(x) if x > 0 else -math.inf


def _round(x: float | None) -> float | None:
    # Six digits: a float32 threshold (slime's veto) is the same rule as its float64 value.
    return None if x is None or not math.isfinite(x) else float(f"{x:.6g}")


# ------------------------------------------------------------------ canonical(spec)


def canonical(spec: Spec) -> Canonical:
    """Map a framework's setting onto the canonical catalogue.

    >>> from iscore.frameworks import verl
    >>> c = canonical(verl.PRESETS["decoupled_geo_rs_token_tis"])
    >>> [x.describe() for x in c.components]
    ['C1 w = min(rho, 2)', 'C7 drop sequences unless 0.999001 <= e^G <= 1.001']

    Raises:
        ConfigError: `spec` is not a setting of one of iscore's frameworks.
    """
    for kind, mapping in _CANONICAL:
        if isinstance(spec, kind):
            return mapping(spec)
    raise ConfigError(
        f"Expected `spec` to be a setting of one of {', '.join(FRAMEWORKS)}, "
        f"but got {type(spec).__name__}"
    )


def _verl_canonical(spec: verl.VerlSpec) -> Canonical:
    numerator: Numerator = "policy" if spec.bypass else "train"
    components: list[Component] = []
    if spec.applies_is_weight:
        zero = None
        if spec.is_lower is not None:
            zero = _mask(
                spec.is_level, spec.is_lower, spec.is_upper, numerator=numerator, numerics="clamp"
            )
        upper = spec.is_upper if zero is None else None
        components.append(
            _weight(spec.is_level, upper=upper, numerator=numerator, numerics="clamp", zero=zero)
        )
        if spec.batch_normalize:
            components.append(_normalize(spec.is_level))
    levels: dict[str, Level] = {
        "token": "token",
        "seq_sum": "sequence",
        "seq_mean": "geometric",
        "seq_max": "max",
    }
    for criterion in spec.rs:
        level = levels[criterion.aggregate]
        if criterion.estimator == "k1":
            # The statistic is -d: log L <= -d <= log U keeps d in [-log U, -log L].
            lower, upper = -math.log(criterion.upper), -math.log(criterion.lower)
            components.append(
                _mask(
                    level,
                    lower,
                    upper,
                    statistic="log_ratio",
                    numerator=numerator,
                    numerics="clamp_each",
                )
            )
        else:
            components.append(
                _mask(
                    level,
                    None,
                    criterion.upper,
                    statistic=criterion.estimator,
                    numerator=numerator,
                    numerics="clamp_each",
                )
            )
    anchor: Anchor = "recompute"
    if spec.bypass:
        anchor = "none" if spec.loss_type == "reinforce" else "rollout"
    return Canonical(tuple(components), anchor)


def _skyrl_canonical(spec: skyrl.SkyRLSpec) -> Canonical:
    components: list[Component] = []
    if spec.policy_loss_type == "rollout_is":
        band = _mask(
            "token",
            1.0 - spec.eps_clip_low,
            1.0 + spec.eps_clip_high,
            numerator="policy",
            numerics="clamp",
            strict=True,
        )
        components.append(_weight("token", numerator="policy", numerics="clamp", zero=band))
    elif spec.rollout_anchored_cispo:
        components.append(
            _weight(
                "token",
                lower=1.0 - spec.cispo_eps_clip_low,
                upper=1.0 + spec.cispo_eps_clip_high,
                numerator="policy",
                numerics="clamp",
            )
        )
    sequence_stage = False
    if spec.corrects:
        if spec.outlier_mask_enabled:
            components.append(
                _mask(
                    "any_token",
                    spec.outlier_token_is_threshold_low,
                    spec.outlier_token_is_threshold_high,
                    numerics="clamp",
                )
            )
        if spec.token_mask_enabled:
            components.append(
                _mask(
                    "token",
                    spec.token_mask_is_threshold_low,
                    spec.token_mask_is_threshold_high,
                    numerics="clamp",
                )
            )
        if spec.tis_ratio_type == "token":
            components.append(
                _weight("token", upper=spec.token_tis_ratio_clip_high, numerics="clamp")
            )
        elif spec.tis_ratio_type == "sequence":
            sequence_stage = True
            components.append(
                _weight("sequence", upper=spec.sequence_tis_ratio_clip_high, numerics="clamp")
            )
        if spec.sequence_mask_metric == "geometric":
            sequence_stage = True
            components.append(
                _mask("geometric", spec.geo_mask_low, spec.geo_mask_high, numerics="clamp")
            )
        elif spec.sequence_mask_metric == "product":
            sequence_stage = True
            components.append(
                _mask("sequence", spec.product_mask_low, spec.product_mask_high, numerics="clamp")
            )
    anchor: Anchor = "recompute"
    if spec.needs_policy:
        anchor = "none"
    elif spec.policy_loss_type == "dppo":
        anchor = "rollout"
    # The outlier mask drops whole sequences, so only the token mask changes what the sequence
    # stages of the surviving sequences sum over.
    kept = spec.corrects and spec.token_mask_enabled and sequence_stage
    return Canonical(tuple(components), anchor, "kept" if kept else "original")


def _nemo_canonical(spec: nemo_rl.NemoRLSpec) -> Canonical:
    if not spec.use_importance_sampling_correction:
        return Canonical()
    level: Level = {"token": "token", "sequence": "sequence", "sequence_mean": "geometric"}[
        spec.level
    ]
    kind = spec.truncated_importance_sampling_type
    upper = spec.truncated_importance_sampling_ratio
    lower = spec.truncated_importance_sampling_ratio_min
    numerics: Numerics = "overflow_zero"
    if kind == "seq-mask-tis":
        # The geometric mean itself is a plain float64 exp of the (nan-cleaned) mean.
        weight = _weight("token", numerics=numerics, zero=_mask("geometric", lower, upper))
    elif kind == "icepop":
        band = _mask(level, lower, upper, numerics=numerics)
        weight = _weight(level, numerics=numerics, zero=band)
    elif kind == "tis":
        weight = _weight(level, lower=lower, upper=upper, numerics=numerics)
    else:
        weight = _weight(level, numerics=numerics)
    return Canonical((weight,))


def _slime_canonical(spec: slime.SlimeCorrection) -> Canonical:
    anchor: Anchor = "rollout" if spec.use_rollout_logprobs else "recompute"
    if not spec.called or (spec.tis_function == "mis" and not spec.use_tis):
        return Canonical(anchor=anchor)
    numerator: Numerator = "policy" if spec.numerator == "policy" else "train"
    if spec.tis_function == "mis":
        return Canonical(_mis_components(spec.mis, numerator), anchor)
    if spec.tis_function == "icepop":
        band = _mask("token", spec.tis_clip_low, spec.tis_clip, numerator=numerator)
        weight = _weight("token", numerator=numerator, zero=band)
    else:
        weight = _weight("token", lower=spec.tis_clip_low, upper=spec.tis_clip, numerator=numerator)
    return Canonical((weight,), anchor)


def _mis_components(mis: slime.MisConfig, numerator: Numerator) -> tuple[Component, ...]:
    """mis.py: every ratio clamped to +-20 after aggregating."""
    levels: dict[str, Level] = {"token": "token", "sequence": "sequence", "geometric": "geometric"}
    level = levels[mis.tis_level]
    common: dict[str, Any] = {"numerator": numerator, "numerics": "clamp"}
    components: list[Component] = []
    if mis.tis_mode == "truncate":
        components.append(_weight(level, upper=mis.tis_upper_bound, **common))
    elif mis.tis_mode == "clip":
        components.append(_weight(level, lower=mis.tis_lower, upper=mis.tis_upper_bound, **common))
    else:
        components += [
            _weight(level, **common),
            _mask(level, mis.tis_lower, mis.tis_upper_bound, **common),
        ]
    if mis.use_rs:
        components.append(_mask(levels[mis.rs_level], mis.rs_lower, mis.rs_upper, **common))
        if mis.rs_veto_threshold is not None:
            # slime compares d with the float32 log of the threshold; d itself is unclamped.
            log_veto = float(torch.log(torch.tensor(mis.rs_veto_threshold, dtype=torch.float32)))
            components.append(
                _mask("any_token", log_veto, statistic="log_ratio", numerator=numerator)
            )
    if mis.tis_batch_normalize:
        components.append(_normalize("token" if level == "token" else "sequence_all"))
    return tuple(components)


def _areal_canonical(spec: areal.ArealCorrection) -> Canonical:
    if spec.use_decoupled_loss:
        anchor: Anchor = "recompute"
    else:
        anchor = "recompute" if spec.recompute_logprob else "rollout"
    rs = spec.rejection_sampling
    if rs is None:
        return Canonical(anchor=anchor)
    # Without decoupling prox and behave are one tensor: d = 0.
    numerator: Numerator = "train" if spec.use_decoupled_loss else "rollout"
    statistic: Statistic = {
        "ratio": "ratio",
        "kl_k1": "log_ratio",
        "kl_k2": "k2",
        "kl_k3": "k3_reverse",
    }[rs.metric]  # type: ignore[assignment]
    common: dict[str, Any] = {"numerator": numerator}
    if rs.level == "token":
        if rs.action == "clamp":
            components = (_weight("token", lower=rs.clamp_lower, upper=rs.upper, **common),)
        else:
            band = _mask("token", rs.lower, rs.upper, statistic=statistic, **common)
            components = (_weight("token", **common), band)
    else:
        level: Level = {"sum": "sequence", "mean": "geometric", "max": "max"}[rs.agg]  # type: ignore[assignment]
        band = _mask(level, rs.lower, rs.upper, statistic=statistic, **common)
        if rs.metric != "ratio":
            components = (_weight("token", **common), band)
        elif rs.action == "mask":
            components = (_weight("geometric", **common), band)
        elif rs.agg == "mean":
            # The decision and the clamp both see e^G: a plain geometric truncation.
            components = (_weight("geometric", lower=rs.clamp_lower, upper=rs.upper, **common),)
        else:
            components = (
                _weight("geometric", lower=rs.clamp_lower, upper=rs.upper, unless=band, **common),
            )
    if numerator == "rollout":
        components = tuple(c for c in components if not _identity_at_zero(c))
    return Canonical(components, anchor)


def _identity_at_zero(c: Component) -> bool:
    """Whether a component changes nothing when every log-ratio is 0 (ratio 1)."""
    if c.role == "mask":
        value = 1.0 if c.statistic == "ratio" else 0.0
        low_ok = c.lower is None or (value > c.lower if c.strict else value >= c.lower)
        high_ok = c.upper is None or (value < c.upper if c.strict else value <= c.upper)
        return low_ok and high_ok
    untouched = (c.lower is None or c.lower <= 1.0) and (c.upper is None or c.upper >= 1.0)
    if c.unless is not None:
        untouched = untouched or _identity_at_zero(c.unless)
    return untouched and (c.zero is None or _identity_at_zero(c.zero))


def _openrlhf_canonical(spec: openrlhf.OpenRLHFCorrection) -> Canonical:
    if not spec.enable or spec.policy_loss_type == "gspo":
        # GSPO with the correction on anchors its sequence ratio on the rollout instead.
        return Canonical(anchor="rollout" if spec.enable else "recompute")
    if spec.type == "tis":
        weight = _weight("token", lower=spec.lower, upper=spec.upper)
    elif spec.type == "icepop":
        weight = _weight("token", zero=_mask("token", spec.lower, spec.upper))
    else:
        weight = _weight("token", zero=_mask("geometric", spec.lower, spec.upper))
    return Canonical((weight,))


def _trl_canonical(spec: trl.TRLCorrection) -> Canonical:
    if not spec.active:
        return Canonical()
    level: Level = "token" if spec.mode.startswith("token_") else "sequence"
    if spec.mode.endswith("_truncate"):
        weight = _weight(level, lower=spec.clip_min, upper=spec.clip_max, numerics="float32")
    else:
        band = _mask(level, spec.clip_min, spec.clip_max, numerics="float32")
        weight = _weight(level, numerics="float32", zero=band)
    return Canonical((weight,))


def _fireworks_canonical(spec: fireworks.FireworksTIS) -> Canonical:
    # Each token's log-ratio is clamped to +-20 before the sequence mean.
    numerator: Numerator = "rollout" if spec.anchor_logp == "rollout" else "train"
    level: Level = "token" if spec.level == "token" else "geometric"
    zero = None
    if spec.icepop_threshold is not None:
        tau = spec.icepop_threshold
        zero = _mask("token", 1.0 / tau, tau, numerator=numerator, numerics="clamp")
    weight = _weight(level, upper=spec.cap, numerator=numerator, numerics="clamp_each", zero=zero)
    anchor: Anchor = "rollout" if spec.anchor_logp == "rollout" else "recompute"
    components = () if numerator == "rollout" and _identity_at_zero(weight) else (weight,)
    return Canonical(components, anchor)


def _fireworks_pr169_canonical(spec: fireworks.FireworksISCorrection) -> Canonical:
    # PR #169's sequence mean runs over every response token, loss-masked ones included.
    level: Level = "token" if spec.tis_level == "token" else "geometric_unmasked"
    return Canonical((_weight(level, upper=spec.tis_cap, numerics="clamp_each"),))


_CANONICAL: tuple[tuple[type, Callable[[Any], Canonical]], ...] = (
    (verl.VerlSpec, _verl_canonical),
    (skyrl.SkyRLSpec, _skyrl_canonical),
    (nemo_rl.NemoRLSpec, _nemo_canonical),
    (slime.SlimeCorrection, _slime_canonical),
    (areal.ArealCorrection, _areal_canonical),
    (openrlhf.OpenRLHFCorrection, _openrlhf_canonical),
    (trl.TRLCorrection, _trl_canonical),
    (fireworks.FireworksTIS, _fireworks_canonical),
    (fireworks.FireworksISCorrection, _fireworks_pr169_canonical),
)


# ------------------------------------------------------------------ convert: per-target builders

_Candidate = tuple[Spec, tuple[str, ...]]


def _lost(notes: list[str], c: Component, why: str) -> None:
    notes.append(f"{c.describe()}: {why}")


def _ratio_bounds(m: Component) -> tuple[float | None, float | None] | None:
    """A band as ratio bounds at its level (see `_ratio_level`), or None without a ratio form."""
    if m.statistic == "ratio":
        return m.lower, m.upper
    if m.statistic == "log_ratio":
        return _exp(m.lower), _exp(m.upper)
    per_token = m.level in ("token", "any_token", "max")
    if m.statistic in _K_STATISTICS and m.lower is None and m.upper is not None and per_token:
        low, high = _k_log_band(m.statistic, m.upper)
        return math.exp(low), math.exp(high)
    return None


def _ratio_level(m: Component) -> str:
    """The level a ratio band of `m` acts at: a bound on a per-sequence max of per-token values
    (any k statistic; an upper-only ratio or log-ratio) holds for every token."""
    if m.level == "max" and (m.statistic in _K_STATISTICS or m.lower is None):
        return "any_token"
    return m.level


def _first_weight(
    c: Canonical, notes: list[str], framework: str, *, conditional: bool = False
) -> Component | None:
    """The weight a target expresses; the others, and (unless the target can) a truncation
    applied only outside a band (AReaL's), are noted."""
    weights = c.weights
    for extra in weights[1:]:
        _lost(notes, extra, f"{framework} applies one IS weight; dropped")
    w = weights[0] if weights else None
    if w is not None and w.unless is not None and not conditional:
        _lost(notes, w, f"{framework} truncates every sequence, not only those outside the band")
    return w


def _note_numerator(notes: list[str], c: Component, numerator: str, framework: str) -> None:
    if c.numerator != numerator and c.numerator != "rollout":
        where = "the current policy" if numerator == "policy" else "the trainer's recompute"
        _lost(notes, c, f"{framework} takes this ratio against {where}")


def _note_extras(notes: list[str], c: Canonical, framework: str, normalize: bool = False) -> None:
    """Notes for what no builder below expresses unless told otherwise."""
    if c.normalize is not None and not normalize:
        _lost(notes, c.normalize, f"{framework} has no batch normalization; dropped")
    if c.sequence_over == "kept":
        notes.append(
            f"{framework} computes sequence ratios over the original loss mask, not over the "
            "tokens a token mask kept (SkyRL)"
        )


def _to_verl(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    bypass = c.anchor != "recompute"
    loss_type = "reinforce" if c.anchor == "none" else "ppo_clip"
    numerator = "policy" if bypass else "train"
    fields: dict[str, Any] = {}
    masks = list(c.masks)
    w = _first_weight(c, notes, "verl")
    if w is not None and loss_type == "ppo_clip" and bypass:
        _lost(notes, w, "verl's bypass PPO-clip mode applies no IS weight; dropped")
        w = None
    if w is not None:
        _note_numerator(notes, w, numerator, "verl")
        level = w.level
        if level not in ("token", "sequence"):
            _lost(notes, w, "verl has no geometric-mean weight; written as a token-level weight")
            level = "token"
        fields = {"is_level": level, "is_upper": w.upper, "is_lower": None}
        zero = w.zero
        if zero is not None and _ratio_level(zero) != w.level:
            masks.append(zero)
            _lost(
                notes,
                zero,
                "verl rejects those sequences (removing them from response_mask, "
                "which its token-mean loss renormalizes) instead of zeroing their weights",
            )
        elif zero is not None:
            lower, upper = _ratio_bounds(zero) or (None, None)
            fields |= {"is_lower": lower or _TINY, "is_upper": upper or _BIG}
            if w.upper is not None and w.upper < fields["is_upper"]:
                _lost(
                    notes,
                    w,
                    f"verl's IcePop keeps the raw ratio inside the band; the cap "
                    f"{w.upper:g} is dropped",
                )
            if zero.strict:
                _lost(notes, zero, "verl's IcePop bounds are inclusive")
        if fields["is_lower"] is None:
            if w.lower is not None:
                _lost(notes, w, f"verl has no lower clamp; weights below {w.lower:g} pass")
            if w.upper is None:
                fields["is_upper"] = _BIG
                _lost(
                    notes,
                    w,
                    "verl always truncates; a threshold of 1e9, above verl's "
                    "largest ratio e^20, never binds",
                )
    norm = c.normalize
    if norm is not None:
        if not fields:
            _lost(notes, norm, "no IS weight to normalize; dropped")
        elif (norm.level == "token") != (fields["is_level"] == "token"):
            _lost(notes, norm, "verl normalizes at the IS weight's own level; dropped")
        else:
            fields["batch_normalize"] = True
            if norm.level == "sequence_all":
                _lost(notes, norm, "verl's mean skips sequences without a loss token")
    rs: list[verl.RSCriterion] = []
    for m in masks:
        _note_numerator(notes, m, numerator, "verl")
        criterion = _verl_criterion(m, notes)
        if criterion is None:
            continue
        if any(x.option == criterion.option for x in rs):
            _lost(notes, m, f"verl takes `{criterion.option}` once; dropped")
            continue
        rs.append(criterion)
    _note_extras(notes, c, "verl", normalize=True)
    spec = verl.VerlSpec(name=name, rs=tuple(rs), bypass=bypass, loss_type=loss_type, **fields)
    return [(spec, tuple(notes))]


def _verl_criterion(m: Component, notes: list[str]) -> verl.RSCriterion | None:
    """The `rollout_rs` criterion closest to a mask."""
    aggregate = {
        "token": "token",
        "sequence": "seq_sum",
        "geometric": "seq_mean",
        "geometric_unmasked": "seq_mean",
        "max": "seq_max",
        "any_token": "seq_max",
    }[m.level]
    if m.level == "geometric_unmasked":
        _lost(notes, m, "verl's sequence mean runs over loss tokens only")
    if m.strict:
        _lost(notes, m, "verl's bounds are inclusive")
    if m.statistic in ("k2", "k3") and m.level != "any_token":
        if m.lower is not None:
            _lost(notes, m, "verl bounds k2/k3 from above only; the lower bound is dropped")
        return verl.RSCriterion(f"{aggregate}_{m.statistic}", upper=m.upper)
    if m.statistic == "k3_reverse" and m.level != "any_token":
        _lost(notes, m, "verl's k3 is e^d - 1 - d, not AReaL's e^-d - 1 + d; same bound used")
        return verl.RSCriterion(f"{aggregate}_k3", upper=m.upper)
    bounds = _ratio_bounds(m)
    if bounds is None:
        _lost(notes, m, "no verl criterion expresses it; dropped")
        return None
    lower, upper = bounds
    log_lower = math.log(lower) if lower else None
    log_upper = math.log(upper) if upper is not None else None
    if _ratio_level(m) == "any_token" or m.level == "max":
        # verl has no max-k1; seq_max_k2 bounds every token's |d| (a symmetric band).
        radius = max(abs(x) for x in (log_lower, log_upper) if x is not None)
        _lost(
            notes,
            m,
            f"verl has no per-token k1 over a whole sequence; seq_max_k2 rejects "
            f"sequences with any |log-ratio| > {radius:g}",
        )
        return verl.RSCriterion("seq_max_k2", upper=0.5 * radius * radius)
    # k1 "L'_U'" keeps d in [-log U', -log L']: the sign trap, written the right way round.
    upper_k1 = math.exp(-log_lower) if log_lower is not None else _BIG
    lower_k1 = math.exp(-log_upper) if log_upper is not None else 1.0 / _BIG
    return verl.RSCriterion(f"{aggregate}_k1", upper=upper_k1, lower=lower_k1)


def _to_skyrl(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    fields: dict[str, Any] = {}
    masks = list(c.masks)
    policy = [w for w in c.weights if w.numerator == "policy"]
    others = [w for w in c.weights if w.numerator != "policy"]
    for extra in [*policy[1:], *others[1:]]:
        _lost(notes, extra, "SkyRL applies one weight of each kind; dropped")
    if policy:
        fields |= _skyrl_policy_loss(policy[0], notes)
    if others:
        w = others[0]
        if fields.get("policy_loss_type") == "cispo":
            _lost(notes, w, "SkyRL refuses TIS beside rollout-anchored CISPO; dropped")
        else:
            masks += _skyrl_weight(w, fields, notes)
    sequence_stage = fields.get("tis_ratio_type") == "sequence"
    for m in masks:
        _note_numerator(notes, m, "train", "SkyRL")
        bounds = _ratio_bounds(m)
        level = _ratio_level(m)
        if bounds is None or level in ("max", "geometric_unmasked"):
            _lost(notes, m, "no SkyRL mask expresses it; dropped")
            continue
        if m.strict:
            _lost(notes, m, "SkyRL's mask bounds are inclusive")
        lower, upper = bounds
        if level == "any_token":
            keys = ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high")
            values = (lower, upper)
        elif level == "token":
            # SkyRL ignores a token mask with one bound: both are always written.
            keys = ("token_mask_is_threshold_low", "token_mask_is_threshold_high")
            values = (lower or 0.0, upper if upper is not None else _BIG)
        else:
            metric = "geometric" if level == "geometric" else "product"
            prefix = "geo_mask" if metric == "geometric" else "product_mask"
            if fields.get("sequence_mask_metric") not in (None, metric):
                _lost(notes, m, "SkyRL takes one sequence mask; dropped")
                continue
            fields["sequence_mask_metric"] = metric
            sequence_stage = True
            keys = (f"{prefix}_low", f"{prefix}_high")
            values = (lower or 0.0, upper if upper is not None else _BIG)
        if any(fields.get(k) is not None for k in keys):
            _lost(notes, m, "SkyRL takes one mask of this kind; dropped")
            continue
        fields |= dict(zip(keys, values, strict=True))
    token_mask = fields.get("token_mask_is_threshold_low") is not None
    if token_mask and sequence_stage and c.sequence_over == "original":
        notes.append(
            "SkyRL computes its sequence ratios over the tokens its token mask kept, not over "
            "the whole loss mask"
        )
    if c.sequence_over == "kept" and not (token_mask and sequence_stage):
        notes.append("the source's sequence ratios ran over the tokens its token mask kept")
    if c.normalize is not None:
        _lost(notes, c.normalize, "SkyRL has no batch normalization; dropped")
    return [(skyrl.SkyRLSpec(name=name, **fields), tuple(notes))]


def _skyrl_policy_loss(w: Component, notes: list[str]) -> dict[str, Any]:
    """SkyRL's rollout-anchored loss closest to a current-policy weight (C12): rollout_is or
    cispo with `cispo_anchor: rollout`, both REINFORCE-style (-sg(w) * A * log pi)."""
    if w.level != "token":
        _lost(notes, w, "SkyRL's current-policy weights are per token")
    zero = w.zero
    if zero is not None and w.lower is None and w.upper is None:
        lower, upper = _ratio_bounds(zero) or (None, None)
        if not zero.strict:
            _lost(notes, zero, "SkyRL's rollout_is loss also zeroes ratios exactly at a bound")
        eps = {
            "eps_clip_low": 1.0 if lower is None else 1.0 - lower,
            "eps_clip_high": _BIG if upper is None else upper - 1.0,
        }
        loss = "rollout_is"
    else:
        if zero is not None:
            _lost(notes, zero, "SkyRL's CISPO truncates and cannot zero; the band is dropped")
        eps = {
            "cispo_eps_clip_low": 1.0 if w.lower is None else 1.0 - w.lower,
            "cispo_eps_clip_high": _BIG if w.upper is None else w.upper - 1.0,
        }
        loss = "cispo"
    for key, value in eps.items():
        if value < 0:
            _lost(notes, w, f"SkyRL's bounds lie around 1 (`{key}` >= 0); {key} set to 0")
            eps[key] = 0.0
    extra = {"cispo_anchor": "rollout"} if loss == "cispo" else {}
    return {"policy_loss_type": loss, **extra, **eps}


def _skyrl_weight(w: Component, fields: dict[str, Any], notes: list[str]) -> list[Component]:
    """SkyRL's TIS closest to a weight; returns its zeroing band, which SkyRL can only mask."""
    _note_numerator(notes, w, "train", "SkyRL")
    level = "sequence" if w.level == "sequence" else "token"
    if w.level not in ("token", "sequence"):
        _lost(notes, w, "SkyRL has no geometric-mean weight; written as token TIS")
    extra = []
    if w.zero is not None:
        extra.append(w.zero)
        _lost(notes, w.zero, "SkyRL removes those from the loss mask instead of zeroing the weight")
    if w.lower is not None:
        _lost(notes, w, f"SkyRL's TIS has no lower clamp; weights below {w.lower:g} pass")
    if w.upper is None:
        if w.zero is None:
            _lost(notes, w, "SkyRL always truncates; a cap of 1e9, above e^20, never binds")
        cap = _BIG
    else:
        cap = w.upper
    fields |= {"tis_ratio_type": level, f"{level}_tis_ratio_clip_high": cap}
    return extra


def _to_nemo(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    w = _first_weight(c, notes, "NeMo-RL")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    if w is not None:
        _note_numerator(notes, w, "train", "NeMo-RL")
    zero = None if w is None else w.zero
    bands = [*([zero] if zero is not None else []), *masks]
    geo = next((m for m in bands if m.level == "geometric" and _ratio_bounds(m)), None)
    if geo is not None:
        lower, upper = _ratio_bounds(geo)
        fields = _nemo_type("seq-mask-tis", lower or 0.0, upper)
        if geo is not zero:
            masks.remove(geo)
            _lost(
                notes,
                geo,
                "NeMo-RL zeroes those sequences' weights (seq-mask-tis) instead "
                "of removing them from the loss mask",
            )
        if w is None:
            notes.append(
                "NeMo-RL's seq-mask-tis weights kept tokens by their raw ratio; the "
                "source applies no weight"
            )
        elif w.level != "token" or w.lower is not None or w.upper is not None:
            _lost(notes, w, "NeMo-RL's seq-mask-tis keeps raw, untruncated token weights")
    elif w is not None:
        fields = _nemo_weight(w, notes)
    # A raw token weight (or none) leaves NeMo-RL's one band free for a token mask.
    free = w is None or (w.level == "token" and not fields)
    for m in masks:
        bounds = _ratio_bounds(m)
        if free and bounds is not None and _ratio_level(m) == "token":
            fields = _nemo_type("icepop", bounds[0] or 0.0, bounds[1])
            free = False
            _lost(
                notes,
                m,
                "NeMo-RL zeroes those tokens' weights (IcePop) instead of removing "
                "them; kept tokens carry the raw ratio",
            )
        else:
            _lost(notes, m, "NeMo-RL has no rejection mask; dropped")
    _note_extras(notes, c, "NeMo-RL")
    if w is not None or fields:
        fields["use_importance_sampling_correction"] = True
    return [(nemo_rl.NemoRLSpec(name=name, **fields), tuple(notes))]


def _nemo_type(kind: str, lower: float | None, upper: float | None) -> dict[str, Any]:
    return {
        "truncated_importance_sampling_type": kind,
        "truncated_importance_sampling_ratio": math.inf if upper is None else upper,
        "truncated_importance_sampling_ratio_min": lower,
    }


def _nemo_weight(w: Component, notes: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if w.level == "sequence":
        fields = {"sequence_level_importance_ratios": True, "token_level_loss": False}
        notes.append(
            "NeMo-RL's sequence-level weight comes with GSPO: sequence_level_importance_ratios "
            "also makes the PPO ratio a geometric mean and needs token_level_loss: false (open "
            "PR #2269's is_correction_level: sequence would change the weight only)"
        )
    elif w.level != "token":
        _lost(
            notes,
            w,
            "NeMo-RL main has no geometric-mean weight (open PR #2269's "
            "is_correction_level: sequence_mean); written as a token-level weight",
        )
    if w.zero is not None:
        lower, upper = _ratio_bounds(w.zero) or (None, None)
        if w.upper is not None and (upper is None or w.upper < upper):
            _lost(notes, w, f"NeMo-RL's icepop keeps the raw ratio; the cap {w.upper:g} is dropped")
        if w.zero.strict:
            _lost(notes, w.zero, "NeMo-RL's bounds are inclusive")
        return fields | _nemo_type("icepop", lower or 0.0, upper)
    if w.lower is not None or w.upper is not None:
        return fields | _nemo_type("tis", w.lower, w.upper)
    return fields


def _to_slime(c: Canonical, name: str) -> list[_Candidate]:
    candidates = [_slime_builtin(c, name)]
    policy = any(x.numerator == "policy" for x in c.components)
    if (c.weights or c.masks) and (not policy or c.anchor == "rollout"):
        candidates.append(_slime_mis(c, name))
    return candidates


def _slime_anchor(c: Canonical, fields: dict[str, Any]) -> None:
    """--use-rollout-logprobs for a bypass; with a weight on the recompute, also
    --get-mismatch-metrics (which makes slime recompute anyway)."""
    if c.anchor != "rollout":
        return
    fields["use_rollout_logprobs"] = True
    if any(x.numerator == "train" for x in c.components):
        fields["get_mismatch_metrics"] = True


def _slime_builtin(c: Canonical, name: str) -> _Candidate:
    """slime's own flags: vanilla_tis_function, icepop_function, PR #2084's off_policy_is."""
    notes: list[str] = []
    fields: dict[str, Any] = {"name": name}
    _slime_anchor(c, fields)
    w = _first_weight(c, notes, "slime")
    for m in c.masks:
        _lost(notes, m, "slime's built-in TIS functions have no mask (mis.py's RS has)")
    if w is not None:
        fields["use_tis"] = True
        if w.level != "token":
            _lost(
                notes,
                w,
                "slime's built-in TIS functions weight tokens (mis.py has sequence "
                "levels); written per token",
            )
        policy = w.numerator == "policy" and c.anchor != "rollout"
        if policy:
            fields["tis_function"] = "off_policy_is"
            notes.append("off_policy_is_function is slime PR #2084, open, not on main")
        zero = w.zero
        if zero is not None and _ratio_level(zero) == "token" and not policy:
            lower, upper = _ratio_bounds(zero) or (None, None)
            fields |= {"tis_function": "icepop", "tis_clip_low": lower or 0.0}
            fields["tis_clip"] = math.inf if upper is None else upper
            if w.upper is not None and (upper is None or w.upper < upper):
                _lost(
                    notes, w, f"slime's icepop keeps the raw ratio; the cap {w.upper:g} is dropped"
                )
        else:
            if zero is not None:
                _lost(notes, zero, "slime's built-in functions cannot zero on this band")
            fields["tis_clip_low"] = w.lower or 0.0
            fields["tis_clip"] = math.inf if w.upper is None else w.upper
    if c.normalize is not None:
        _lost(notes, c.normalize, "slime's built-in functions do not normalize (mis.py does)")
    if c.sequence_over == "kept":
        notes.append("slime computes ratios over the original loss mask")
    return slime.SlimeCorrection(**fields), tuple(notes)


def _slime_mis(c: Canonical, name: str) -> _Candidate:
    """slime's mis.py helper (examples/train_infer_mismatch_helper), configured by its YAML."""
    notes: list[str] = []
    fields: dict[str, Any] = {"name": name, "use_tis": True, "tis_function": "mis"}
    _slime_anchor(c, fields)
    w = _first_weight(c, notes, "mis.py")
    masks = list(c.masks)
    levels = {"token": "token", "sequence": "sequence", "geometric": "geometric"}
    mis: dict[str, Any] = {"tis_level": "token", "tis_upper_bound": _BIG}
    if w is None:
        notes.append(
            "mis.py always weights when it runs: tokens carry their ratio (truncated at "
            "1e9, i.e. not at all); the source applies no weight"
        )
    else:
        if w.level == "geometric_unmasked":
            _lost(notes, w, "mis.py's geometric mean runs over loss tokens only")
        mis["tis_level"] = levels.get(w.level, "geometric")
        zero = w.zero
        if zero is not None and zero.level == w.level:
            lower, upper = _ratio_bounds(zero) or (None, None)
            mis |= {"tis_mode": "mask", "tis_lower_bound": lower or _TINY}
            mis["tis_upper_bound"] = _BIG if upper is None else upper
            _lost(notes, zero, "mis.py removes those from the loss mask instead of zeroing them")
            if w.upper is not None and (upper is None or w.upper < upper):
                _lost(notes, w, f"mis.py's mask mode keeps the raw ratio; cap {w.upper:g} dropped")
        else:
            if zero is not None:
                masks.append(zero)
                _lost(notes, zero, "mis.py rejects instead of zeroing")
            if w.upper is not None:
                mis["tis_upper_bound"] = w.upper
            if w.lower is not None:
                mis |= {"tis_mode": "clip", "tis_lower_bound": w.lower}
    for m in masks:
        bounds = _ratio_bounds(m)
        level = _ratio_level(m)
        if level in levels and bounds is not None and not mis.get("use_rs"):
            mis |= {"use_rs": True, "rs_level": levels[level]}
            mis["rs_lower_bound"] = bounds[0] or _TINY
            mis["rs_upper_bound"] = _BIG if bounds[1] is None else bounds[1]
        elif (
            level == "any_token" and bounds and bounds[1] is None and "rs_veto_threshold" not in mis
        ):
            mis["rs_veto_threshold"] = bounds[0]
        else:
            _lost(notes, m, "no mis.py key expresses it (one RS level, a lower-only veto); dropped")
    if "rs_veto_threshold" in mis and not mis.get("use_rs"):
        # The veto runs only with use_rs: a band mis.py's +-20 clamp never reaches.
        mis |= {"use_rs": True, "rs_lower_bound": _TINY, "rs_upper_bound": _BIG}
    norm = c.normalize
    if norm is not None:
        wanted = "token" if mis["tis_level"] == "token" else "sequence_all"
        if mis["tis_level"] == "geometric" or norm.level != wanted:
            _lost(
                notes,
                norm,
                f"mis.py normalizes {mis['tis_level']}-level weights over "
                f"{'tokens' if wanted == 'token' else 'every sequence'} only; dropped",
            )
        else:
            mis["tis_batch_normalize"] = True
    if c.sequence_over == "kept":
        notes.append("mis.py computes ratios over the original loss mask")
    if (
        mis.get("tis_mode") in ("clip", "mask")
        and not mis["tis_lower_bound"] < mis["tis_upper_bound"]
    ):
        notes.append("mis.py needs lower < upper; the lower bound is dropped")
        mis |= {"tis_mode": "truncate", "tis_lower_bound": None}
    if mis.get("use_rs") and not mis["rs_lower_bound"] < mis["rs_upper_bound"]:
        notes.append("mis.py needs an RS band with lower < upper; RS dropped")
        mis |= {"use_rs": False, "rs_lower_bound": None, "rs_upper_bound": None}
    return slime.SlimeCorrection(mis=slime.MisConfig(**mis), **fields), tuple(notes)


def _to_areal(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    if c.anchor == "rollout":
        # No recompute: prox = behave, so AReaL has no behaviour weight to apply.
        for x in c.components:
            _lost(notes, x, "AReaL without recompute (its bypass) applies no behaviour weight")
        spec = areal.ArealCorrection(use_decoupled_loss=False, recompute_logprob=False, name=name)
        return [(spec, tuple(notes))]
    w = _first_weight(c, notes, "AReaL", conditional=True)
    masks = list(c.masks)
    for x in (*c.weights[:1], *masks):
        _note_numerator(notes, x, "train", "AReaL")
    rs = None
    if w is not None and w.level != "token":
        rs = _areal_sequence_weight(w, masks, notes)
    elif w is not None:
        rs = _areal_token_weight(w, masks, notes)
    elif masks:
        notes.append("AReaL weights the tokens it keeps by their ratio; the source applies none")
        rs = _areal_mask(masks.pop(0), notes, geometric_weight=False)
    for m in masks:
        _lost(notes, m, "AReaL takes one rejection_sampling; dropped")
    _note_extras(notes, c, "AReaL")
    spec = areal.ArealCorrection(
        use_decoupled_loss=True, recompute_logprob=True, rejection_sampling=rs, name=name
    )
    return [(spec, tuple(notes))]


def _areal_ratio_upper(upper: float | None, notes: list[str], c: Component) -> float | None:
    """AReaL's ratio `upper`: open is +inf; at or below 1 AReaL refuses it (None)."""
    if upper is None:
        return math.inf
    if upper <= 1.0:
        _lost(notes, c, "AReaL needs a ratio upper bound above 1; dropped")
        return None
    return upper


def _areal_token_weight(
    w: Component, masks: list[Component], notes: list[str]
) -> areal.RejectionSampling | None:
    if w.zero is not None:
        if w.lower is not None or w.upper is not None:
            _lost(notes, w, "AReaL's mask keeps the raw ratio; the truncation is dropped")
        _lost(
            notes,
            w.zero,
            "AReaL removes those from the loss mask instead of zeroing them "
            "(its denominator keeps them)",
        )
        return _areal_mask(w.zero, notes, geometric_weight=False)
    if w.lower is not None or w.upper is not None:
        upper = _areal_ratio_upper(w.upper, notes, w)
        if upper is None:
            return None
        return areal.RejectionSampling(action="clamp", upper=upper, lower=w.lower)
    # A raw token weight leaves AReaL's one rejection free for the first mask it can take.
    for m in masks:
        mask_notes: list[str] = []
        rs = _areal_mask(m, mask_notes, geometric_weight=False)
        if rs is not None:
            masks.remove(m)
            notes += mask_notes
            return rs
    return areal.RejectionSampling(upper=math.inf)  # the raw weight, nothing rejected


def _areal_sequence_weight(
    w: Component, masks: list[Component], notes: list[str]
) -> areal.RejectionSampling | None:
    if w.level == "sequence":
        _lost(notes, w, "AReaL's sequence-level weight is the geometric mean e^G, not e^S")
    elif w.level == "geometric_unmasked":
        _lost(notes, w, "AReaL's geometric mean runs over loss tokens only")
    if w.zero is not None:
        if w.lower is not None or w.upper is not None:
            _lost(notes, w, "AReaL's sequence mask keeps e^G raw; the truncation is dropped")
        _lost(
            notes,
            w.zero,
            "AReaL removes those sequences from the loss mask instead of "
            "zeroing them (its denominator keeps them)",
        )
        return _areal_mask(w.zero, notes, geometric_weight=True)
    if w.lower is not None or w.upper is not None:
        agg = "mean"
        if w.unless is not None:
            agg = {"sequence": "sum", "max": "max"}.get(w.unless.level, "mean")
        upper = _areal_ratio_upper(w.upper, notes, w)
        if upper is None:
            return None
        return areal.RejectionSampling(
            level="sequence", action="clamp", agg=agg, upper=upper, lower=w.lower
        )
    for m in masks:
        if m.statistic == "ratio" and m.level in ("sequence", "geometric", "max"):
            masks.remove(m)
            return _areal_mask(m, notes, geometric_weight=True)
    return areal.RejectionSampling(level="sequence", upper=math.inf)


def _areal_mask(
    m: Component, notes: list[str], *, geometric_weight: bool
) -> areal.RejectionSampling | None:
    """AReaL's rejection closest to a mask: metric ratio keeps the weight the geometric mean at
    sequence level, the KL metrics keep per-token weights."""
    level = _ratio_level(m) if m.statistic == "ratio" else m.level
    aggs = {"sequence": "sum", "geometric": "mean", "max": "max", "any_token": "max"}
    if level == "geometric_unmasked":
        _lost(notes, m, "AReaL's sequence mean runs over loss tokens only")
        level = "geometric"
    bounds = _ratio_bounds(m)
    if level == "any_token":
        if bounds is None or bounds[1] is None:
            _lost(notes, m, "AReaL bounds a sequence's largest token only from above; dropped")
            return None
        if bounds[0] is not None:
            _lost(notes, m, "AReaL bounds a sequence's largest token from above; lower dropped")
        bounds = (None, bounds[1])
    if m.strict:
        _lost(notes, m, "AReaL's bounds are inclusive")
    if m.statistic == "ratio" and (level == "token" or geometric_weight):
        upper = _areal_ratio_upper(bounds[1], notes, m)
        if upper is None:
            return None
        # AReaL refuses a ratio lower bound <= 0, which bounds nothing anyway.
        lower = bounds[0] if bounds[0] else None
        if level == "token":
            return areal.RejectionSampling(upper=upper, lower=lower)
        return areal.RejectionSampling(level="sequence", agg=aggs[level], upper=upper, lower=lower)
    if m.statistic in ("ratio", "log_ratio"):
        metric = "kl_k1"
        lower = _log(bounds[0]) if m.statistic == "ratio" else m.lower
        upper = _log(bounds[1]) if m.statistic == "ratio" else m.upper
        if level == "any_token":
            lower, upper = None, math.log(bounds[1])
        lower = None if lower == -math.inf else lower
        upper = math.inf if upper is None else upper
    else:
        metric = {"k2": "kl_k2", "k3": "kl_k3", "k3_reverse": "kl_k3"}[m.statistic]
        if m.statistic == "k3":
            _lost(notes, m, "AReaL's kl_k3 is e^-d - 1 + d, not e^d - 1 - d; same bound used")
        lower, upper = m.lower, m.upper
    if level == "token":
        return areal.RejectionSampling(metric=metric, upper=upper, lower=lower)
    return areal.RejectionSampling(
        level="sequence", metric=metric, agg=aggs[level], upper=upper, lower=lower
    )


def _to_openrlhf(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    if c.anchor == "rollout":
        for x in c.components:
            _lost(
                notes,
                x,
                "OpenRLHF's rollout anchor (GSPO with the correction on) applies no IS weight",
            )
        notes.append(
            "OpenRLHF anchors on the rollout only in its GSPO loss, whose sequence "
            "ratio is exp(mean(policy - rollout))"
        )
        spec = openrlhf.OpenRLHFCorrection(enable=True, policy_loss_type="gspo", name=name)
        return [(spec, tuple(notes))]
    w = _first_weight(c, notes, "OpenRLHF")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    if w is not None:
        _note_numerator(notes, w, "train", "OpenRLHF")
        if w.level != "token":
            _lost(notes, w, "OpenRLHF weights tokens only; written per token")
        zero = w.zero
        if zero is not None:
            masks.insert(0, zero)
            if w.upper is not None or w.lower is not None:
                _lost(
                    notes,
                    w,
                    "OpenRLHF's icepop / seq-mask-tis keep the raw ratio; the "
                    "truncation is dropped",
                )
        elif w.lower is not None or w.upper is not None:
            fields = {"type": "tis", "lower": w.lower or 0.0}
            fields["upper"] = math.inf if w.upper is None else w.upper
    for m in masks:
        bounds = _ratio_bounds(m)
        level = _ratio_level(m)
        if not fields and bounds is not None and level in ("token", "geometric"):
            kind = "icepop" if level == "token" else "seq-mask-tis"
            fields = {"type": kind, "lower": bounds[0] or 0.0}
            fields["upper"] = math.inf if bounds[1] is None else bounds[1]
            if w is None:
                notes.append(
                    f"OpenRLHF's {kind} weights kept tokens by their raw ratio; the "
                    "source applies no weight"
                )
            if w is None or m is not w.zero:
                _lost(
                    notes,
                    m,
                    "OpenRLHF zeroes those weights instead of removing them from the loss mask",
                )
            if m.strict:
                _lost(notes, m, "OpenRLHF's bounds are inclusive")
        else:
            _lost(notes, m, "no OpenRLHF setting expresses it beside the rest; dropped")
    if w is not None and not fields:
        fields = {"type": "tis", "lower": 0.0, "upper": math.inf}  # the raw weight
    _note_extras(notes, c, "OpenRLHF")
    spec = openrlhf.OpenRLHFCorrection(enable=bool(fields), name=name, **fields)
    return [(spec, tuple(notes))]


def _to_trl(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    w = _first_weight(c, notes, "TRL")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    level = "token"
    if w is not None:
        _note_numerator(notes, w, "train", "TRL")
        level = "sequence" if w.level == "sequence" else "token"
        if w.level not in ("token", "sequence"):
            _lost(
                notes,
                w,
                "TRL has no geometric-mean weight (its sequence modes use the "
                "product e^S); written per token",
            )
        zero = w.zero
        if zero is not None:
            masks.insert(0, zero)
            if w.upper is not None or w.lower is not None:
                _lost(notes, w, "TRL's mask modes keep the raw ratio; the truncation is dropped")
        elif w.lower is not None or w.upper is not None:
            fields = {"mode": f"{level}_truncate", "clip_min": w.lower, "clip_max": w.upper}
    for m in masks:
        bounds = _ratio_bounds(m)
        m_level = _ratio_level(m)
        same = m_level == level or (w is None and m_level in ("token", "sequence"))
        # A truncation inside the band never binds, so a band within it replaces it.
        inside = (
            bounds is not None
            and fields.get("clip_min") is None
            and (fields.get("clip_max") is None or (bounds[1] or math.inf) <= fields["clip_max"])
        )
        replaceable = "mode" not in fields or fields["mode"].endswith("_truncate")
        if same and inside and replaceable:
            fields = {"mode": f"{m_level}_mask", "clip_min": bounds[0], "clip_max": bounds[1]}
            if w is None:
                notes.append(
                    "TRL's mask modes weight kept tokens by their raw ratio; the source "
                    "applies no weight"
                )
            if w is None or m is not w.zero:
                _lost(
                    notes, m, "TRL zeroes those weights instead of removing them from the loss mask"
                )
        else:
            _lost(notes, m, "no TRL mode expresses it beside the rest; dropped")
    if w is not None and not fields:
        fields = {"mode": f"{level}_mask", "clip_min": None, "clip_max": None}  # the raw weight
    _note_extras(notes, c, "TRL")
    if not fields:
        spec = trl.TRLCorrection(enabled=False, name=name)
    else:
        low, high = fields["clip_min"], fields["clip_max"]
        if low is not None and high is not None and not low < high:
            notes.append("TRL needs clip_min < clip_max; clip_min dropped")
            fields["clip_min"] = None
        spec = trl.TRLCorrection(name=name, **fields)
    return [(spec, tuple(notes))]


def _to_fireworks(c: Canonical, name: str) -> list[_Candidate]:
    notes: list[str] = []
    if c.anchor == "rollout":
        for x in c.components:
            _lost(notes, x, "the cookbook's rollout anchor makes every TIS weight 1")
        return [(fireworks.FireworksTIS(anchor_logp="rollout", name=name), tuple(notes))]
    w = _first_weight(c, notes, "the Fireworks cookbook")
    masks = list(c.masks)
    fields: dict[str, Any] = {"cap": _BIG}
    if w is not None:
        _note_numerator(notes, w, "train", "the cookbook")
        if w.level != "token":
            fields["level"] = "sequence"
            if w.level == "sequence":
                _lost(
                    notes,
                    w,
                    "the cookbook's sequence level is the geometric mean e^G, not the product e^S",
                )
            elif w.level == "geometric_unmasked":
                _lost(
                    notes,
                    w,
                    "the current cookbook averages over loss tokens only (PR #169's "
                    "is_correction did over every token)",
                )
        if w.lower is not None:
            _lost(notes, w, f"the cookbook has no lower clamp; weights below {w.lower:g} pass")
        if w.upper is not None:
            fields["cap"] = w.upper
        elif w.zero is None:
            _lost(notes, w, "the cookbook always caps; a cap of 1e9, above e^20, never binds")
        if w.zero is not None:
            masks.insert(0, w.zero)
    for m in masks:
        bounds = _ratio_bounds(m)
        token = fields.get("level", "token") == "token"
        if (
            token
            and bounds is not None
            and _ratio_level(m) == "token"
            and "icepop_threshold" not in fields
        ):
            lower, upper = bounds
            # The cookbook's band is [1/tau, tau]: take the wider side of the source's band.
            tau = max(x for x in (upper, 1.0 / lower if lower else None, 1.0) if x is not None)
            fields["icepop_threshold"] = tau
            if lower != 1.0 / tau or upper != tau:
                _lost(notes, m, f"the cookbook's IcePop band is symmetric: [1/{tau:g}, {tau:g}]")
            if w is None or m is not w.zero:
                _lost(notes, m, "the cookbook zeroes those weights instead of removing them")
            if w is None:
                notes.append(
                    "the cookbook weights kept tokens by their ratio; the source applies no weight"
                )
        else:
            _lost(notes, m, "the cookbook has no rejection mask; dropped")
    _note_extras(notes, c, "the Fireworks cookbook")
    if w is None and "icepop_threshold" not in fields:
        notes.append(
            "the cookbook's TIS weight is always on; anchor_logp: rollout makes it 1, but also "
            "skips the recompute and anchors PPO on the rollout"
        )
        return [(fireworks.FireworksTIS(anchor_logp="rollout", name=name), tuple(notes))]
    return [(fireworks.FireworksTIS(name=name, **fields), tuple(notes))]


_BUILDERS: dict[str, Callable[[Canonical, str], list[_Candidate]]] = {
    "verl": _to_verl,
    "skyrl": _to_skyrl,
    "nemo_rl": _to_nemo,
    "slime": _to_slime,
    "areal": _to_areal,
    "openrlhf": _to_openrlhf,
    "trl": _to_trl,
    "fireworks": _to_fireworks,
}

# What `difference` reports of `iscore.impact.quick_stats`, for the source and the target.
_DIFFERENCE_KEYS = ("weight_mean", "token_masked_fraction", "seq_masked_fraction", "lr_scale")


@dataclass(frozen=True, slots=True)
class Export:
    """A setting converted to (or written for) one framework.

    Attributes:
        spec: the target framework's setting (for an older verl generation, the current-
            generation setting that generation's config expresses).
        text: the snippet to paste into the target's config (`snippet`).
        exact: whether `spec` replays identically to the source (weight and keep).
        notes: one line each: what the target could not express and what was chosen
            instead, numerical fine print, and loss-aggregation differences.
        difference: with a batch, `{"source": {...}, "target": {...}, "identical": bool}`:
            weight_mean, token_masked_fraction, seq_masked_fraction and lr_scale of both
            (`iscore.impact.quick_stats`), and whether weights and masks agree exactly.
    """

    spec: Spec
    text: str
    exact: bool
    notes: tuple[str, ...] = ()
    difference: dict[str, Any] | None = None


def convert(
    spec: Spec,
    to: str,
    *,
    generation: str | None = None,
    batch: TokenBatch | None = None,
) -> Export:
    """The closest setting of framework `to` to `spec`, with its snippet and what differs.

    Args:
        spec: the source setting (any framework's spec).
        to: the target framework, one of `iscore.replay.FRAMEWORKS`.
        generation: verl only: the config generation to write ("gen0", "gen1", "gen2",
            "gen3", or a version such as "v0.6.0"; see `verl.GENERATIONS`); None is current.
        batch: a dump to measure both settings on (`Export.difference`) and to verify
            settings that are the same rule computed along different numerical paths.

    >>> from iscore.frameworks import nemo_rl
    >>> out = convert(nemo_rl.PRESETS["nemo_icepop"], "verl")
    >>> out.exact, out.spec.is_lower, out.spec.is_upper
    (True, 0.5, 5.0)

    Raises:
        ConfigError: an unknown `to` or `generation`, or `generation` for a framework other
            than verl.
    """
    if to not in FRAMEWORKS:
        raise ConfigError(
            f"Expected `to` to be one of {', '.join(FRAMEWORKS)}, but got {quote(to)}"
        )
    if generation is not None and to != "verl":
        raise ConfigError(
            f"Expected `generation` to be None for {to} (only verl has config generations), "
            f"but got {quote(generation)}"
        )
    source = canonical(spec)
    name = spec.name if spec.name != spec.framework else to
    if spec.framework == to:
        candidates: list[_Candidate] = [(spec, ())]
    else:
        candidates = _BUILDERS[to](source, name)
    target, notes = _choose(source, candidates)
    notes = list(notes)
    text = None
    generation_exact = True
    if generation is not None:
        written = verl.to_generation(target, generation)
        target, generation_exact = written.spec, written.exact
        notes += written.notes
        text = _render("verl", written.config, None)
    result = canonical(target)
    if result.anchor != source.anchor:
        notes.append(_ANCHOR_NOTES[source.anchor, result.anchor].format(to=to))
    identical, difference = _measure(spec, target, batch, notes)
    if result == source:
        exact = identical is not False
        if identical is False:
            notes.append("replays differently on the batch although the settings agree")
    elif result.loosely_equals(source):
        exact = identical is True
        notes.append(_loose_note(identical))
    else:
        exact = False
        target_label = to if generation is None else f"{to} {generation}"
        notes.append(
            f"source ({spec.framework}): {source.describe()}; "
            f"target ({target_label}): {result.describe()}"
        )
    exact = exact and generation_exact
    notes += _aggregation_notes(spec, target)
    return Export(target, text or snippet(target), exact, tuple(notes), difference)


_ANCHOR_NOTES = {
    ("rollout", "recompute"): "{to} recomputes the old log-probs and anchors its PPO ratio on "
    "them; the source skips the recompute (bypass, PPO anchored on the rollout)",
    ("none", "recompute"): "{to} keeps a PPO loss anchored on the recompute; the source's loss "
    "is REINFORCE-style, weighted by the current policy over the rollout",
    ("recompute", "rollout"): "{to} skips the recompute and anchors its PPO ratio on the "
    "rollout (bypass); the source anchors on the recompute",
    ("none", "rollout"): "{to} anchors its PPO ratio on the rollout (bypass); the source's "
    "loss is REINFORCE-style, weighted by the current policy",
    ("recompute", "none"): "{to}'s loss is REINFORCE-style (no PPO ratio); the source's is a "
    "PPO loss anchored on the recompute",
    ("rollout", "none"): "{to}'s loss is REINFORCE-style (no PPO ratio); the source's is a PPO "
    "loss anchored on the rollout",
}
"""What changes when the target's loss is anchored elsewhere than the source's."""


def _choose(source: Canonical, candidates: list[_Candidate]) -> _Candidate:
    """The candidate agreeing best with the source: identical canonical forms, then the same
    rule computed differently, then the fewest notes; ties go to the earlier candidate."""

    def rank(candidate: _Candidate) -> tuple[int, int]:
        result = canonical(candidate[0])
        agreement = 2 if result == source else 1 if result.loosely_equals(source) else 0
        return -agreement, len(candidate[1])

    return min(candidates, key=rank)


def _loose_note(identical: bool | None) -> str:
    note = (
        "the same rule computed along another numerical path (the +-20 exponent clamp, float32 "
        "or overflow handling, ratio vs log-space bounds): it can differ only for tokens "
        "with extreme log-ratios or ratios within rounding of a bound"
    )
    if identical is None:
        return note + "; pass a batch to check"
    return note + ("; identical on the batch" if identical else "; differs on the batch")


def _measure(
    source: Spec, target: Spec, batch: TokenBatch | None, notes: list[str]
) -> tuple[bool | None, dict[str, Any] | None]:
    """Replay both on `batch`: (weights and masks identical, the quick_stats difference)."""
    if batch is None:
        return None, None
    try:
        a, b = source.replay(batch), target.replay(batch)
        stats = {"source": quick_stats(batch, source), "target": quick_stats(batch, target)}
    except ConfigError as e:
        notes.append(f"not measured on the batch: {e}")
        return None, None
    identical = bool(torch.equal(a.weight, b.weight) and torch.equal(a.keep, b.keep))
    difference: dict[str, Any] = {
        side: {key: values.get(key) for key in _DIFFERENCE_KEYS} for side, values in stats.items()
    }
    difference["identical"] = identical
    return identical, difference


def _aggregation_notes(source: Spec, target: Spec) -> list[str]:
    """A note when the two frameworks turn the same weights into different step sizes: another
    aggregation mode, or (for settings that remove tokens) another denominator."""
    a, b = aggregation_of(source), aggregation_of(target)
    removes = bool(canonical(source).masks or canonical(target).masks)
    if a.mode == b.mode and (a.shrinks == b.shrinks or not removes):
        return []
    return [
        f"loss aggregation: {source.framework} {a.describe()}, {target.framework} "
        f"{b.describe()}: the same weights scale the step differently (see lr_scale)"
    ]


# ------------------------------------------------------------------ snippets


def snippet(spec: Spec, fmt: Literal["yaml", "flags"] | None = None) -> str:
    """The text to paste into the framework's own config for `spec`.

    Args:
        spec: any framework's setting.
        fmt: "yaml" (verl, SkyRL, NeMo-RL, AReaL, TRL, Fireworks: the config's own nesting),
            "flags" (slime, OpenRLHF: their launch flags, one per line with ` \\`
            continuations; verl, SkyRL, NeMo-RL: Hydra-style `key=value` overrides; TRL:
            `--key value`), or None for the framework's usual form.

    >>> from iscore.frameworks import openrlhf
    >>> print(snippet(openrlhf.PRESETS["openrlhf_icepop"]))
    --algo.advantage.is_correction_enable \\
    --algo.advantage.is_correction_type icepop \\
    --algo.advantage.is_correction_threshold 0.5 5.0

    Raises:
        ConfigError: a format the framework has no form for.
    """
    return _render(spec.framework, spec.to_config(), fmt)


def to_file_text(spec: Spec) -> str:
    """The iscore config file of `spec` (YAML with `framework:`), which
    `iscore replay --config FILE` reads as is.

    >>> from iscore.frameworks import trl
    >>> print(to_file_text(trl.PRESETS["trl_token_tis"]), end="")
    # iscore config for trl; `iscore replay --config FILE` reads it as is
    framework: trl
    name: trl_token_tis
    use_vllm: true
    vllm_importance_sampling_correction: true
    vllm_importance_sampling_mode: token_truncate
    vllm_importance_sampling_clip_min: null
    vllm_importance_sampling_clip_max: 2.0
    loss_type: dapo
    """
    header = f"# iscore config for {spec.framework}; `iscore replay --config FILE` reads it as is\n"
    return header + _yaml(spec.to_config())


_FLAG_FRAMEWORKS = ("slime", "openrlhf")
_OVERRIDE_FRAMEWORKS = ("verl", "skyrl", "nemo_rl")


def _render(framework: str, config: Mapping[str, Any], fmt: str | None) -> str:
    body = {k: v for k, v in config.items() if k not in ("framework", "name")}
    native = "flags" if framework in _FLAG_FRAMEWORKS else "yaml"
    fmt = native if fmt is None else fmt
    if fmt not in ("yaml", "flags"):
        raise ConfigError(f"Expected `fmt` to be 'yaml', 'flags' or None, but got {quote(fmt)}")
    if framework in _FLAG_FRAMEWORKS:
        if fmt == "yaml":
            raise ConfigError(
                f"Expected `fmt` to be 'flags' or None for {framework}, which is configured by "
                "its launch flags, but got 'yaml'"
            )
        return _flag_text(body)
    if fmt == "yaml":
        return _python_comment(framework, body) + _yaml(body)
    if framework in _OVERRIDE_FRAMEWORKS:
        lines = [_override(key, value) for key, value in _flatten(body)]
    elif framework == "trl":
        lines = [_trl_flag(key, value) for key, value in body.items() if value is not None]
        if body.get("vllm_importance_sampling_clip_max", 0) is None:
            raise ConfigError(
                "Expected `fmt` to be 'yaml' for this TRL setting: "
                "`vllm_importance_sampling_clip_max: null` has no command-line form"
            )
    else:
        raise ConfigError(
            f"Expected `fmt` to be 'yaml' or None for {framework}, which has no command-line "
            "form for these keys, but got 'flags'"
        )
    return " \\\n".join(lines)


class _Dumper(yaml.SafeDumper):
    """Quotes strings that start like a number: verl's "0.5_5.0" must not be read back as one
    by a YAML loader with looser number rules than PyYAML's."""


_NUMBER_LIKE = re.compile(r"[-+.]?\d")


def _represent_str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "'" if _NUMBER_LIKE.match(value) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _represent_str)


def _yaml(data: Mapping[str, Any]) -> str:
    return yaml.dump(dict(data), Dumper=_Dumper, sort_keys=False, default_flow_style=False)


def _flag_text(body: Mapping[str, Any]) -> str:
    """One flag (with its values) per line; slime's mis.py YAML under a comment header."""
    groups: list[list[str]] = []
    for token in shlex.split(body["args"]):
        if token.startswith("--") or not groups:
            groups.append([token])
        else:
            groups[-1].append(token)
    # No IS flag at all (the framework's defaults) is an empty snippet.
    text = " \\\n".join(shlex.join(group) for group in groups)
    if "custom_config" in body:
        header = f"# {slime.CUSTOM_CONFIG_PATH}, the YAML --custom-config-path points to"
        text += f"\n\n{header}\n{_yaml(body['custom_config'])}"
    return text


def _python_comment(framework: str, body: Mapping[str, Any]) -> str:
    """The Python form of configs written in Python (TRL's GRPOConfig, the cookbook's Config)."""

    def call(name: str, values: Mapping[str, Any]) -> str:
        return f"{name}({', '.join(f'{k}={v!r}' for k, v in values.items())})"

    if framework == "trl":
        return f"# {call('GRPOConfig', body)}\n"
    if framework == "fireworks" and "tis" in body:
        python = call(
            "Config",
            {"tis": _Raw(call("TISConfig", body["tis"]))} | {"anchor_logp": body["anchor_logp"]},
        )
        return f"# training/recipes/rl_loop.py: {python}\n"
    if framework == "fireworks":
        python = call("Config", {"is_correction": _Raw(call("ISConfig", body["is_correction"]))})
        return f"# cookbook PR #169: {python}\n"
    return ""


class _Raw(str):
    """A string shown without quotes in `_python_comment` (a nested call)."""

    def __repr__(self) -> str:
        return str(self)


def _flatten(data: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in data.items():
        if isinstance(value, Mapping):
            yield from _flatten(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


_PLAIN = re.compile(r"[A-Za-z_][A-Za-z0-9_\-]*")
_SHELL_SAFE = re.compile(r"[A-Za-z0-9_.,:+\-]*")


def _scalar(value: Any) -> str:
    """A value as YAML / Hydra read it back: null, true/false, repr of floats."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _override(key: str, value: Any) -> str:
    """A Hydra override; strings that would read as something else are quoted for Hydra, and
    the whole token for the shell."""
    if isinstance(value, str) and (
        not _PLAIN.fullmatch(value) or value in ("null", "true", "false", "inf", "nan")
    ):
        # Hydra would read "0.5_5.0" as a string anyway, but a list separator or a word like
        # null would not: quote it for Hydra, and the token for the shell.
        quoted = f"{key}='{value}'"
        return f'"{quoted}"' if _SHELL_SAFE.fullmatch(value) else shlex.quote(quoted)
    return f"{key}={_scalar(value)}"


def _trl_flag(key: str, value: Any) -> str:
    return f"--{key} {_scalar(value)}"
