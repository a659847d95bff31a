"""Recommend a correction setting for your framework from your own dump.

Candidates are the framework's own settings (token truncation, IcePop bands, geometric sequence
masks, k3 masks, sequence-level weights) with thresholds **derived from the data**: quantiles of
the token ratios, of the per-sequence geometric means and of the per-sequence k3, chosen so that
about the targeted share of tokens or sequences is affected. Each candidate is replayed exactly as
the framework would (`iscore.impact.quick_stats`), checked against the targets and ranked; each
gets a one-line reason. Warnings name the traps that bite this data.

>>> rec = recommend(iscore.load("data/long_collapse.parquet"), "verl")  # doctest: +SKIP
>>> rec.best.spec.name, rec.best.reason                                # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from iscore import frameworks, ops
from iscore.batch import TokenBatch
from iscore.canonical import Canonical, Component, mask_component, weight_component
from iscore.errors import ConfigError
from iscore.frameworks.base import Framework
from iscore.impact import quick_stats
from iscore.spec import Spec
from iscore.tune import Tuner


@dataclass(frozen=True, slots=True)
class Targets:
    """What a good setting does to this data.

    Attributes:
        max_token_drop: at most this share of loss tokens may lose their gradient (weight 0).
        max_seq_drop: at most this share of sequences may be dropped entirely.
        lr_scale: the effective learning-rate scale must lie in [lo, hi].
        min_ess: the effective sample size (fraction of tokens) must be at least this.
    """

    max_token_drop: float = 0.01
    max_seq_drop: float = 0.05
    lr_scale: tuple[float, float] = (0.8, 1.25)
    min_ess: float = 0.5

    def __post_init__(self) -> None:
        for name in ("max_token_drop", "max_seq_drop", "min_ess"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ConfigError(f"Expected `{name}` to be a fraction in [0, 1], but got {value}")
        lo, hi = self.lr_scale
        if not 0.0 < lo <= 1.0 <= hi:
            raise ConfigError(
                f"Expected `lr_scale` to be a range lo <= 1 <= hi with lo > 0, but got {lo}:{hi}"
            )

    def violations(self, stats: dict[str, float]) -> list[str]:
        """The targets a candidate's statistics miss, in words."""
        missed = []
        if stats["token_masked_fraction"] > self.max_token_drop:
            missed.append(f"drops {stats['token_masked_fraction']:.1%} of tokens")
        if stats["seq_masked_fraction"] > self.max_seq_drop:
            missed.append(f"drops {stats['seq_masked_fraction']:.1%} of sequences")
        lo, hi = self.lr_scale
        if not lo <= stats["lr_scale"] <= hi:
            missed.append(f"LR scale {stats['lr_scale']:.3g} outside [{lo:g}, {hi:g}]")
        if stats["ess"] < self.min_ess:
            missed.append(f"ESS {stats['ess']:.1%} below {self.min_ess:.0%}")
        return missed


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting, replayed on the data."""

    spec: Spec
    kind: str
    stats: dict[str, float]
    missed: tuple[str, ...]
    reason: str

    @property
    def passes(self) -> bool:
        return not self.missed


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Candidates ranked best first, and warnings about traps that bite this data."""

    framework: str
    targets: Targets
    candidates: tuple[Candidate, ...]
    warnings: tuple[str, ...] = field(default_factory=tuple)

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    def to_dict(self) -> dict[str, Any]:
        return {
            "framework": self.framework,
            "targets": {
                "max_token_drop": self.targets.max_token_drop,
                "max_seq_drop": self.targets.max_seq_drop,
                "lr_scale": list(self.targets.lr_scale),
                "min_ess": self.targets.min_ess,
            },
            "candidates": [
                {
                    "name": c.spec.name,
                    "kind": c.kind,
                    "passes": c.passes,
                    "missed": list(c.missed),
                    "reason": c.reason,
                    **c.stats,
                }
                for c in self.candidates
            ],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, slots=True)
class _Thresholds:
    """Thresholds read off the data's distributions for the targets."""

    token_cap: float  # a high quantile of the token ratios
    band: tuple[float, float]  # token ratios outside: about max_token_drop of tokens
    geo: tuple[float, float]  # e^G outside: about max_seq_drop of sequences
    k3: float  # mean k3 above: about max_seq_drop of sequences
    token_p999: float  # the token ratios' 99.9th percentile, for the reasons

    def describe(self, kind: str) -> str:
        """Where a family's thresholds come from, in words."""
        return {
            "token_tis": f"cap {self.token_cap:g} (at least 1.5; your p99.9 token ratio is "
            f"{self.token_p999:.3g})",
            "icepop": f"band [{self.band[0]:g}, {self.band[1]:g}] around your token ratios",
            "token_mask": f"band [{self.band[0]:g}, {self.band[1]:g}] around your token ratios",
            "token_mask_tis": f"band [{self.band[0]:g}, {self.band[1]:g}] around your token ratios",
            "geo_mask_geo_tis": f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}] from your sequences",
            "geo_mask": f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}] from your sequences",
            "geo_mask_token_tis": f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}], token cap "
            f"{self.token_cap:g}",
            "seq_mask_tis": f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}] from your sequences",
            "k3_mask": f"mean k3 <= {self.k3:.3g} from your sequences",
        }.get(kind, "the framework's default bounds")

    @classmethod
    def of(cls, tuner: Tuner, targets: Targets) -> _Thresholds:
        t = targets.max_token_drop
        token = tuner.quantiles("token", (t / 2, 1 - t / 2, 0.999))

        def fits(result) -> bool:
            return (
                result.token_masked_fraction <= t
                and result.seq_masked_fraction <= targets.max_seq_drop
            )

        # Sequence masks drop whole sequences: tighten the dropped share until both the
        # sequence and the token budgets hold.
        for share in targets.max_seq_drop / 2.0 ** np.arange(8):
            q = tuner.quantiles("geometric", (share / 2, 1 - share / 2))
            bounds = (
                min(_round_down(q[share / 2], 4), 0.999),
                max(_round_up(q[1 - share / 2], 4), 1.001),
            )
            geo = bounds  # the last (loosest) one stands if none fits; it then misses targets
            if fits(tuner.geometric_mask(*bounds)):
                break
        for share in targets.max_seq_drop / 2.0 ** np.arange(8):
            k3 = _round_up(tuner.quantiles("k3", (1 - share,))[1 - share])
            if fits(tuner.k3_mask(k3)):
                break
        # Round outward to 3 significant digits (so a config reads well and the band is kept).
        return cls(
            token_p999=token[0.999],
            token_cap=max(_round_up(token[0.999]), 1.5),
            band=(min(_round_down(token[t / 2]), 0.9), max(_round_up(token[1 - t / 2]), 1.1)),
            geo=geo,
            k3=k3,
        )


def _round_up(x: float, digits: int = 3) -> float:
    if not math.isfinite(x) or x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.ceil(x * scale) / scale


def _round_down(x: float, digits: int = 3) -> float:
    if not math.isfinite(x) or x <= 0:
        return x
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale) / scale


# Per framework: (kind, description, config builder) for each candidate family. Geometric bounds
# (lo, hi) are on e^G; `band` on token ratios.
_Builder = Callable[[_Thresholds], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class _Kind:
    """A framework-neutral kind of candidate: its setting for the data's thresholds."""

    key: str
    description: str
    setting: Callable[[_Thresholds], Canonical]


def _token_weight(upper: float | None = None, zero: Component | None = None) -> Component:
    return weight_component("token", upper=upper, numerics="clamp", zero=zero)


def _token_band(t: _Thresholds) -> Component:
    return mask_component("token", *t.band, numerics="clamp")


def _sequence_weight(level: Literal["sequence", "geometric"]) -> Component:
    # Sequence-level weights are capped where the frameworks' own examples cap them.
    return weight_component(level, upper=2.0, numerics="clamp")


def _geo_mask(t: _Thresholds) -> Component:
    return mask_component("geometric", *t.geo)


_KINDS = (
    _Kind("token_tis", "token TIS", lambda t: Canonical((_token_weight(t.token_cap),))),
    _Kind(
        "icepop",
        "token IcePop band",
        lambda t: Canonical(
            (_token_weight(zero=mask_component("token", *t.band, numerics="clamp")),)
        ),
    ),
    _Kind(
        "token_mask",
        "token mask (no weight)",
        lambda t: Canonical((_token_band(t),)),
    ),
    _Kind(
        "token_mask_tis",
        "token mask, kept tokens weighted by their ratio",
        lambda t: Canonical((_token_weight(), _token_band(t))),
    ),
    _Kind("geo_mask", "geometric sequence mask", lambda t: Canonical((_geo_mask(t),))),
    _Kind(
        "geo_mask_geo_tis",
        "geometric sequence mask, kept sequences weighted by e^G",
        lambda t: Canonical((weight_component("geometric", numerics="clamp"), _geo_mask(t))),
    ),
    _Kind(
        "geo_mask_token_tis",
        "geometric mask + token TIS",
        lambda t: Canonical((_token_weight(t.token_cap), _geo_mask(t))),
    ),
    _Kind(
        "seq_mask_tis",
        "seq-mask-tis (geometric mask, raw token weights)",
        lambda t: Canonical((_token_weight(zero=_geo_mask(t)),)),
    ),
    _Kind(
        "k3_mask",
        "k3 sequence mask",
        lambda t: Canonical(
            (mask_component("geometric", upper=t.k3, statistic="k3", numerics="clamp_each"),)
        ),
    ),
    _Kind(
        "geo_tis",
        "sequence (geometric-mean) TIS",
        lambda t: Canonical((_sequence_weight("geometric"),)),
    ),
    _Kind(
        "seq_tis",
        "sequence (product) TIS",
        lambda t: Canonical((_sequence_weight("sequence"),)),
    ),
)
"""The candidates, in the order they are tried; each framework gets those it can express."""


def recommend(batch: TokenBatch, framework: str, targets: Targets | None = None) -> Recommendation:
    """Rank the framework's candidate settings on `batch` against `targets`.

    Args:
        batch: the loaded dump.
        framework: one of `iscore.frameworks.NAMES`.
        targets: what a good setting does; defaults to `Targets()`.

    >>> import iscore
    >>> recommend(iscore.load("data/fp8.parquet"), "skyrl").best.kind
    'geo_mask'
    """
    fw = frameworks.get(framework)
    targets = targets or Targets()
    tuner = Tuner(batch)
    thresholds = _Thresholds.of(tuner, targets)
    candidates = []
    for kind in _KINDS:
        spec = fw.express(kind.setting(thresholds), f"{framework} {kind.description}")
        if spec is None:
            continue
        stats = quick_stats(batch, spec)
        missed = tuple(targets.violations(stats))
        reason = _reason(f"{kind.description}, {thresholds.describe(kind.key)}", stats, missed)
        candidates.append(Candidate(spec, kind.key, stats, missed, reason))
    ranked = sorted(
        candidates,
        key=lambda c: (
            len(c.missed),
            abs(math.log(max(c.stats["lr_scale"], 1e-12))),
            -c.stats["ess"],
            c.stats["token_masked_fraction"],
        ),
    )
    return Recommendation(framework, targets, tuple(ranked), tuple(_warnings(batch, fw)))


def _reason(description: str, stats: dict[str, float], missed: tuple[str, ...]) -> str:
    effect = (
        f"LR scale {stats['lr_scale']:.3g}, ESS {stats['ess']:.0%}, "
        f"{stats['token_masked_fraction']:.2%} of tokens and {stats['seq_masked_fraction']:.1%} "
        "of sequences dropped"
    )
    if missed:
        return f"{description}: misses the targets ({'; '.join(missed)}); {effect}"
    return f"{description}: meets the targets; {effect}"


def _warnings(batch: TokenBatch, framework: Framework) -> list[str]:
    """The traps that bite this data: sequence-weight collapse, and the framework's own."""
    warnings = []
    m = batch.loss_mask
    T = ops.segment_count(batch, m)
    has = T > 0
    if has.any():
        mu = float(ops.log_ratio(batch)[m].mean())
        long_t = float(T[has].double().quantile(0.9))
        median_weight = math.exp(mu * long_t)
        if median_weight < 0.5:
            warnings.append(
                f"Product (sequence-level) weights collapse at your lengths: at {long_t:,.0f} "
                f"tokens (your p90 length) the median e^S is {median_weight:.2g} (mean d "
                f"{mu:.2g} per token), so sequence IS cuts the effective LR there; prefer "
                "token-level or geometric-mean weights."
            )
    for trap in framework.traps:
        warning = trap.warning(batch, lambda spec: quick_stats(batch, spec))
        if warning is not None:
            warnings.append(warning)
    return warnings
