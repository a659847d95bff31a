"""The candidates a recommendation replays: each framework-neutral kind of setting (a token cap, a
band, a sequence mask, ...) built from the thresholds placed on the data, and a `Candidate`:
one setting replayed, with its statistics and the targets it misses."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from iscore.advice.flags import Flag, flags_of
from iscore.advice.thresholds import Thresholds
from iscore.advice.tuning import trust_region_setting
from iscore.frameworks import Canonical, Component, Spec, mask_component, weight_component

RULE_SYMBOLS = (
    "d = train - rollout log-prob, rho = e^d per token, k3 = rho - 1 - d, S = the sum of d "
    "over a sequence's loss tokens, G = S / their number"
)
"""The symbols of `Candidate.rule`, as the CLI prints them after it."""


@dataclass(frozen=True, slots=True)
class Candidate:
    """One setting, replayed on the data.

    Attributes:
        spec: the framework's setting.
        kind: the framework-neutral kind it is (`KINDS`), or "default" for the setting to
            beat.
        title: what it is and where its thresholds come from, e.g. "token TIS, cap 5.47".
        stats: its statistics (`iscore.stats.setting`), the objective's terms (`bias_healthy`,
            `bias_broken`, `variance`, their sum `objective`) and its drops of healthy data
            (`healthy_token_dropped`, `healthy_seq_dropped`).
        missed: the targets it misses, in words.
        reason: one line: its `title`, whether it meets the targets, what it does.
        rule: the setting's rule as the framework computes it (`Canonical.describe`), in the
            symbols of `RULE_SYMBOLS`.
    """

    spec: Spec
    kind: str
    title: str
    stats: dict[str, float]
    missed: tuple[str, ...]
    reason: str
    rule: str

    @property
    def passes(self) -> bool:
        return not self.missed

    @property
    def misweighted(self) -> float:
        """The gradient it misweights per token, on the healthy and the broken sequences
        together: the objective's first two terms."""
        return self.stats["bias_healthy"] + self.stats["bias_broken"]

    def green_light(self, flags: Sequence[Flag]) -> bool:
        """Whether to use it as it is: it meets the targets, and the mismatch `flags` of the
        same data show no semantics bug (which no correction repairs)."""
        return self.passes and not flags_of(flags, "semantics_bug")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.spec.name,
            "kind": self.kind,
            "title": self.title,
            "config": self.spec.to_config(),
            "passes": self.passes,
            "missed": list(self.missed),
            "reason": self.reason,
            "rule": self.rule,
            **self.stats,
        }


# Per framework: (kind, description, config builder) for each candidate family. Geometric bounds
# (lo, hi) are on e^G; `band` on token ratios.
Builder = Callable[[Thresholds], dict[str, Any]]


@dataclass(frozen=True, slots=True)
class Kind:
    """A framework-neutral kind of candidate: its setting for the data's thresholds."""

    key: str
    description: str
    setting: Callable[[Thresholds], Canonical]


def _token_weight(upper: float | None = None, zero: Component | None = None) -> Component:
    return weight_component("token", upper=upper, numerics="clamp", zero=zero)


def _token_band(t: Thresholds) -> Component:
    return mask_component("token", *t.band, numerics="clamp")


def _sequence_weight(level: Literal["sequence", "geometric"]) -> Component:
    # Sequence-level weights are capped where the frameworks' own examples cap them.
    return weight_component(level, upper=2.0, numerics="clamp")


def _geo_mask(t: Thresholds) -> Component:
    return mask_component("geometric", *t.geo)


KINDS = (
    Kind("token_tis", "token TIS", lambda t: Canonical((_token_weight(t.token_cap),))),
    Kind(
        "icepop",
        "token IcePop band",
        lambda t: Canonical(
            (_token_weight(zero=mask_component("token", *t.band, numerics="clamp")),)
        ),
    ),
    Kind(
        "token_mask",
        "token mask (no weight)",
        lambda t: Canonical((_token_band(t),)),
    ),
    Kind(
        "token_mask_tis",
        "token mask, kept tokens weighted by their ratio",
        lambda t: Canonical((_token_weight(), _token_band(t))),
    ),
    Kind("geo_mask", "geometric sequence mask", lambda t: Canonical((_geo_mask(t),))),
    Kind(
        "geo_mask_geo_tis",
        "geometric sequence mask, kept sequences weighted by e^G",
        lambda t: Canonical((weight_component("geometric", numerics="clamp"), _geo_mask(t))),
    ),
    Kind(
        "geo_mask_token_tis",
        "geometric mask + token TIS",
        lambda t: Canonical((_token_weight(t.token_cap), _geo_mask(t))),
    ),
    Kind(
        "seq_mask_tis",
        "seq-mask-tis (geometric mask, raw token weights)",
        lambda t: Canonical((_token_weight(zero=_geo_mask(t)),)),
    ),
    Kind(
        "k3_mask",
        "k3 sequence mask",
        lambda t: Canonical(
            (mask_component("geometric", upper=t.k3, statistic="k3", numerics="clamp_each"),)
        ),
    ),
    Kind(
        "mult_error_mask",
        "sequence filter on the mean e^|d|",
        lambda t: Canonical(
            (mask_component("geometric", upper=t.mult_error, statistic="mult_error"),)
        ),
    ),
    Kind(
        "geo_tis",
        "sequence (geometric-mean) TIS",
        lambda t: Canonical((_sequence_weight("geometric"),)),
    ),
    Kind(
        "seq_tis",
        "sequence (product) TIS",
        lambda t: Canonical((_sequence_weight("sequence"),)),
    ),
)
"""The candidates, in the order they are tried; each framework gets those it can express."""


def _trust_region(t: Thresholds, by_advantage: bool) -> Canonical:
    """A probability trust region at the token band's reach (`Thresholds.trust_region`):
    DPPO's by the advantage's sign, or IPO's symmetric one at the larger side."""
    low, high = t.trust_region
    if not by_advantage:
        low = high = max(low, high)
    return trust_region_setting(low, high, by_advantage=by_advantage)


TRUST_REGION_KINDS = (
    Kind(
        "dppo_trust_region",
        "probability trust region by the advantage's sign (DPPO)",
        lambda t: _trust_region(t, by_advantage=True),
    ),
    Kind(
        "ipo_trust_region",
        "probability trust region (IPO)",
        lambda t: _trust_region(t, by_advantage=False),
    ),
)
"""The candidates on the probability difference dp = e^l_theta - e^l_r, placed from the token
band (`Thresholds.trust_region`); DPPO's only where the dump has each sequence's advantage."""


def _policy_weight(t: Thresholds, zero: bool = False) -> Component:
    """A token weight on the current policy's ratio over the rollout: capped, or (`zero`)
    zeroed outside the band."""
    if zero:
        band = mask_component("token", *t.policy_band, numerator="policy", numerics="clamp")
        return weight_component("token", numerator="policy", numerics="clamp", zero=band)
    return weight_component("token", upper=t.policy_cap, numerator="policy", numerics="clamp")


POLICY_KINDS = (
    Kind(
        "bypass_ppo",
        "bypass: PPO anchored on the rollout",
        lambda t: Canonical(anchor="rollout"),
    ),
    Kind(
        "policy_token_tis",
        "current-policy token IS (REINFORCE-style)",
        lambda t: Canonical((_policy_weight(t),), anchor="none"),
    ),
    Kind(
        "policy_icepop",
        "current-policy IS band (REINFORCE-style)",
        lambda t: Canonical((_policy_weight(t, zero=True),), anchor="none"),
    ),
    Kind(
        "policy_token_tis_ppo",
        "current-policy token IS inside PPO on the recompute",
        lambda t: Canonical((_policy_weight(t),)),
    ),
)
"""The candidates that score against the current policy, tried where the dump has
`policy_logprob` (docs/recommend.md#with-a-current-policy)."""
