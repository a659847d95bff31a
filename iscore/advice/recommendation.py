"""Recommend a correction setting for your framework from your own dump (docs/recommend.md).

First, what numerical noise looks like in this dump, robustly (medians and MADs, per step), and
what stands out of it: broken sequences (`iscore.stats.noise.outside`: a stale replica, a bad rank),
a global offset, long-sequence collapse, drift over steps. Thresholds are then placed by the
objective: the loosest token cap within a variance budget, sequence bounds just outside the
healthy sequences (none is dropped) or just inside the nearest broken one beyond them.
Candidates are framework-neutral kinds (token TIS, IcePop, token and geometric masks, k3 masks,
sequence-level weights) kept where the framework expresses them; each is replayed exactly as
the framework would (`iscore.stats.setting.quick_stats`), held to the targets (and, with broken
sequences, to removing them), and ranked: the fewest targets missed, then the objective (the
bias left plus the variance added, in units of one token's gradient), then the setting to
beat, then the fewer components.

>>> rec = recommend(iscore.load("data/long_collapse.parquet"), "verl")  # doctest: +SKIP
>>> rec.best.spec.name, rec.regimes, rec.pick                          # doctest: +SKIP
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from iscore import frameworks
from iscore.dump import Data, load_data
from iscore.errors import ConfigError
from iscore.frameworks.base import Framework
from iscore.frameworks.canonical import Canonical, Component, mask_component, weight_component
from iscore.frameworks.resolve import Setting, resolve
from iscore.frameworks.spec import Replay, Spec
from iscore.packed import ops
from iscore.packed.batch import TokenBatch
from iscore.stats import noise
from iscore.stats.mismatch import broken_sequences
from iscore.stats.noise import ratio_bias
from iscore.stats.setting import SettingStats, quick_stats
from iscore.utils.distributed import Engine


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

    def grade(self, key: str, value: float | None) -> Literal["good", "fair", "bad"] | None:
        """Whether `value` of statistic `key` (a column of the settings table) is good, fair or
        bad for training, against these targets where they say (None for a missing value):

        - `lr_scale`: good within `lr_scale`, fair within half its low and twice its high end;
        - `ess`: good from `min_ess` (at least 0.8), fair from 0.3;
        - `weight_mean`, `weight_mean_seq`: good within [0.9, 1.1], fair within [0.5, 2];
        - `broken_gradient_kept`: good up to `MAX_BROKEN_KEPT` (10%), fair up to 50%;
        - dropped and truncated shares: good up to `max_token_drop` (tokens),
          `max_seq_drop` (sequences) or 0.01 (truncation), fair up to 5 times that.

        >>> Targets().grade("ess", 0.043), Targets().grade("lr_scale", 1.0)
        ('bad', 'good')
        """
        if value is None or value != value:
            return None
        if key == "lr_scale":
            lo, hi = self.lr_scale
            good, fair = lo <= value <= hi, lo / 2 <= value <= hi * 2
        elif key == "ess":
            good, fair = value >= max(self.min_ess, 0.8), value >= 0.3
        elif key in ("weight_mean", "weight_mean_seq"):
            good, fair = 0.9 <= value <= 1.1, 0.5 <= value <= 2
        elif key == "broken_gradient_kept":
            good, fair = value <= MAX_BROKEN_KEPT, value <= 0.5
        else:
            limit = {
                "token_masked_fraction": self.max_token_drop,
                "seq_masked_fraction": self.max_seq_drop,
            }.get(key, 0.01)
            good, fair = value <= limit, value <= 5 * limit
        return "good" if good else "fair" if fair else "bad"

    def violations(self, stats: dict[str, float]) -> list[str]:
        """The targets a candidate's statistics miss, in words."""
        missed = []
        if stats["token_masked_fraction"] > self.max_token_drop:
            missed.append(f"drops {stats['token_masked_fraction']:.1%} of tokens")
        if stats["seq_masked_fraction"] > self.max_seq_drop:
            missed.append(f"drops {stats['seq_masked_fraction']:.1%} of sequences")
        lo, hi = self.lr_scale
        if not lo <= stats["lr_scale"] <= hi:
            missed.append(f"LR scale {stats['lr_scale']:.4g} outside [{lo:g}, {hi:g}]")
        if stats["ess"] < self.min_ess:
            missed.append(f"ESS {stats['ess']:.1%} below {self.min_ess:.0%}")
        return missed


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
        kind: the framework-neutral kind it is (`_KINDS`), or "default" for the setting to
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


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Candidates ranked best first, the regimes found, and warnings about traps.

    Attributes:
        framework: the framework's name.
        targets: the targets the candidates were held to.
        candidates: best first.
        regimes: what was found in the data and why it matters for the pick, one line each.
        warnings: the traps that bite this data.
        pick: why the best beat the runner-up, and what would change the pick.
        thresholds: the bounds placed from the data (token ratio band and cap, e^G band,
            mean-k3 bound), how many sequences were found broken, and the median token
            log-ratio where the healthy tokens break E_rollout[e^d] = 1 (a semantics bug;
            None otherwise).
        default: the setting to beat, replayed beside the candidates and ranked among them
            (kind "default"): the user's own, or the framework's default.
    """

    framework: str
    targets: Targets
    candidates: tuple[Candidate, ...]
    regimes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default_factory=tuple)
    pick: str = ""
    thresholds: dict[str, Any] = field(default_factory=dict)
    default: Candidate | None = None

    @property
    def best(self) -> Candidate:
        return self.candidates[0]

    @property
    def runner_up(self) -> Candidate | None:
        return self.candidates[1] if len(self.candidates) > 1 else None

    def to_dict(self) -> dict[str, Any]:
        """The document `iscore recommend --json` writes: each candidate's `config` is what
        `iscore replay --config` reads (with `framework:`)."""
        return {
            "framework": self.framework,
            "targets": {
                "max_token_drop": self.targets.max_token_drop,
                "max_seq_drop": self.targets.max_seq_drop,
                "lr_scale": list(self.targets.lr_scale),
                "min_ess": self.targets.min_ess,
            },
            "regimes": list(self.regimes),
            "best": self.best.to_dict(),
            "runner_up": None if self.runner_up is None else self.runner_up.to_dict(),
            "default": None if self.default is None else self.default.to_dict(),
            "pick": self.pick,
            "thresholds": self.thresholds,
            "candidates": [c.to_dict() for c in self.candidates],
            "warnings": list(self.warnings),
        }


@dataclass(frozen=True, slots=True)
class _Normal:
    """What numerical noise looks like in this dump, robustly, and what stands out of it.

    The centre and spread come from medians and MADs (1.4826 MAD estimates a normal's standard
    deviation), so a few broken sequences cannot move them; which sequences are broken is
    `iscore.stats.noise`'s decision, each judged against its own step's noise.
    """

    d_center: float  # median per-token log-ratio d over loss tokens
    d_spread: float  # 1.4826 MAD of d
    g_center: float  # median per-sequence G
    g_spread: float  # 1.4826 MAD of G
    broken: np.ndarray  # bool [B]: sequences far outside the noise
    G: np.ndarray  # float64 [B], 0 where a sequence has no loss token
    k3: np.ndarray  # float64 [B]: mean per-token k3
    T: np.ndarray  # float64 [B]: loss tokens
    d: np.ndarray  # float64 [N loss tokens]
    token_broken: np.ndarray  # bool [N loss tokens]: tokens of broken sequences
    rollout: np.ndarray  # float32 [N loss tokens]: the rollout's log-prob of each
    ratio: float  # <e^d> over the healthy tokens
    ratio_z: float | None  # its distance from 1 in standard errors where that breaks the identity
    rho: np.ndarray  # float64 [N loss tokens]: e^clamp(d, +-20)
    # With a current policy (`policy_logprob`), float64 [N loss tokens], else None: its lag
    # behind the recompute e^clamp(policy - train), and its ratio over the rollout
    # e^clamp(policy - rollout), the weight a token's gradient should then carry.
    lag: np.ndarray | None = None
    target: np.ndarray | None = None

    @property
    def offset(self) -> bool:
        """Whether the healthy tokens break E_rollout[e^d] = 1: a semantics bug (the test of
        the mismatch flags, `iscore.stats.noise.ratio_bias`). A noisier engine moves the median d
        below 0 by itself (E[d] = -KL) and is not one."""
        return self.ratio_z is not None

    @classmethod
    def of(cls, batch: TokenBatch) -> _Normal:
        m = batch.loss_mask
        d_all = ops.log_ratio(batch).double()
        T = ops.segment_count(batch, m).double().cpu().numpy()
        S = ops.segment_sum(d_all, batch, m).cpu().numpy()
        k3 = ops.segment_sum(ops.k3(d_all.clamp(-20.0, 20.0)), batch, m).cpu().numpy()
        has = T > 0
        G = np.where(has, S / np.maximum(T, 1.0), 0.0)
        k3 = np.where(has, k3 / np.maximum(T, 1.0), 0.0)
        every = ops.mask_is_all(batch, m)  # then views, not copies (only ever read)
        d = (d_all if every else d_all[m]).cpu().numpy()
        d_center, d_spread = noise.median_mad(d)
        g_center, g_spread = noise.median_mad(G[has])
        broken = broken_sequences(batch)
        token_broken = np.repeat(broken, T.astype(np.int64))
        rollout = (batch.rollout if every else batch.rollout[m]).cpu().numpy()
        rho = np.exp(np.clip(d, -20.0, 20.0))
        healthy = rho[~token_broken] if broken.any() else rho
        ratio = float(healthy.mean()) if healthy.size else 1.0
        stderr = math.sqrt(max(float(healthy @ healthy) / max(healthy.size, 1) - ratio**2, 0.0))
        ratio_z = ratio_bias(ratio, stderr / math.sqrt(max(healthy.size, 1)))
        lag = target = None
        if batch.policy is not None:
            e = ops.log_ratio(batch, "policy")
            e = (e if every else e[m]).cpu().numpy()
            lag = np.exp(np.clip(e - d, -20.0, 20.0))
            target = np.exp(np.clip(e, -20.0, 20.0))
        return cls(
            d_center,
            d_spread,
            g_center,
            g_spread,
            broken,
            G,
            k3,
            T,
            d,
            token_broken,
            rollout,
            ratio,
            ratio_z,
            rho,
            lag,
            target,
        )

    @property
    def broken_share(self) -> float:
        return float(self.broken.sum()) / max(int((self.T > 0).sum()), 1)


_MARGIN = 1.05  # sequence bounds placed this much beyond the healthy sequences
_INSIDE = 0.9  # or this far inside the nearest broken sequence, if that is closer

VARIANCE_WEIGHT = 1.0
"""The objective's weight of the variance a setting's weights add against the gradient they
misweight (docs/recommend.md): 1 counts 1% more variance as much as 1% of the gradient
misweighted."""

VARIANCE_BUDGET = 0.05
"""The most variance a token cap may add (1/ESS - 1 of its weights on the healthy tokens,
0.05: ESS >= 95%): the cap is the loosest of `CAPS` within it."""

PPO_CLIP = 0.2
"""PPO's clip range, the default of every framework replayed (`clip_ratio`, `eps_clip`,
`ratio_clip_min/max`, `epsilon`: 0.2): with a current policy, the objective weighs a PPO
loss's ratio through it."""

CAPS = (1.05, 1.1, 1.2, 1.5, 2.0, 3.0, 5.0)
"""The token caps and bands' upper bounds tried, tightest first; 5 is the loosest the
frameworks' own examples use (IcePop's [0.5, 5])."""


def variance_added(w: np.ndarray) -> float:
    """1/ESS - 1 of weights `w` (Kish's ESS = (sum w)^2 / (N sum w^2)): how much the weights
    inflate the variance of a mean over the tokens, against weighing each alike (0 for equal
    weights, inf where every weight is 0).

    >>> variance_added(np.ones(4)), variance_added(np.array([1.0, 1.0, 2.0, 0.0]))
    (0.0, 0.5)
    """
    total = float(w.sum())
    return w.size * float(w @ w) / (total * total) - 1.0 if total > 0 else math.inf


def _loosest_cap(rho: np.ndarray) -> float:
    """The loosest of `CAPS` whose truncated weights min(rho, cap) add at most
    `VARIANCE_BUDGET` of variance over the healthy tokens' ratios `rho` (the tightest where
    none does). The more the ratios spread, the more variance every cap adds, so the cap never
    loosens as the mismatch grows."""
    for cap in reversed(CAPS):
        if variance_added(np.minimum(rho, cap)) <= VARIANCE_BUDGET:
            return cap
    return CAPS[0]


@dataclass(frozen=True, slots=True)
class _Thresholds:
    """Thresholds placed by the objective (docs/recommend.md).

    A token cap is the loosest of `CAPS` (the least gradient truncated) whose weights add at
    most `VARIANCE_BUDGET` of variance on the healthy tokens; a token band is [1/cap, cap].
    The wider the ratios spread, the tighter both are. A sequence mask's bound sits just
    outside every healthy sequence (none is dropped), or just inside the nearest broken one
    where that is closer (the mask drops them): the least gradient misweighted, since a
    healthy sequence's ideal weight is its ratio and a broken one's is 0.
    """

    token_cap: float
    band: tuple[float, float]  # token ratio band
    geo: tuple[float, float]  # e^G band
    k3: float  # mean per-token k3 upper bound
    normal: _Normal
    # With a current policy: the cap and band placed likewise on its ratios over the rollout.
    policy_cap: float | None = None
    policy_band: tuple[float, float] | None = None

    def describe(self, kind: str) -> str:
        """Where a kind's thresholds come from, in words."""
        band = f"band [{self.band[0]:g}, {self.band[1]:g}] on token ratios"
        geo = f"e^G in [{self.geo[0]:g}, {self.geo[1]:g}]"
        return {
            "token_tis": f"cap {self.token_cap:g}",
            "icepop": band,
            "token_mask": band,
            "token_mask_tis": band,
            "geo_mask": geo,
            "geo_mask_geo_tis": geo,
            "geo_mask_token_tis": f"{geo}, token cap {self.token_cap:g}",
            "seq_mask_tis": geo,
            "k3_mask": f"mean k3 <= {self.k3:.3g}",
            "bypass_ppo": "no weight: the PPO ratio itself is e^(policy - rollout)",
            **self._describe_policy(),
        }.get(kind, "cap 2, the frameworks' usual sequence-level cap")

    def _describe_policy(self) -> dict[str, str]:
        """Where the current-policy kinds' thresholds come from; none without a policy."""
        if self.policy_cap is None or self.policy_band is None:
            return {}
        cap = f"cap {self.policy_cap:g} on current-policy ratios"
        low, high = self.policy_band
        return {
            "policy_token_tis": cap,
            "policy_icepop": f"band [{low:g}, {high:g}] on current-policy ratios",
            "policy_token_tis_ppo": cap,
        }

    @classmethod
    def of(cls, normal: _Normal) -> _Thresholds:
        rho = normal.rho[~normal.token_broken] if normal.token_broken.any() else normal.rho
        has = normal.T > 0
        healthy = has & ~normal.broken
        g_dev = normal.G - normal.g_center
        cap = _loosest_cap(rho)
        # Sequence bounds keep every healthy sequence, pulled in to just inside the nearest
        # broken one beyond them where it lies closer. A broken sequence among the healthy
        # ones on a statistic (spread wider than noise, its mean d no further off) cannot be
        # dropped by a bound on it without dropping them: it stays, and counts against it.
        g_half = _sequence_bound(np.abs(g_dev), healthy, normal.broken, 1e-4)
        k3_cap = _sequence_bound(normal.k3, healthy, normal.broken, 1e-6)
        return cls(
            token_cap=cap,
            band=(_round_down(1.0 / cap), cap),
            geo=(
                _round_down(ops.exp_of(normal.g_center - g_half), 5),
                _round_up(ops.exp_of(normal.g_center + g_half), 5),
            ),
            k3=max(_round_up(k3_cap), 1e-9),  # frameworks take a positive bound
            normal=normal,
            **_policy_thresholds(normal),
        )


def _sequence_bound(
    distance: np.ndarray, healthy: np.ndarray, broken: np.ndarray, floor: float
) -> float:
    """The bound on a sequence statistic (its distance from the healthy centre, >= 0): `_MARGIN`
    beyond every healthy sequence's, or `_INSIDE` the nearest broken one's beyond them all
    where that is closer; at least `floor`.

    >>> d = np.array([0.1, 0.2, 0.3, 1.0, 0.05])
    >>> broken = np.array([False, False, False, True, True])
    >>> round(_sequence_bound(d, ~broken, broken, 1e-4), 3)  # 0.05 lies among the healthy
    0.315
    >>> d[3] = 0.33  # the nearest broken one beyond them: the bound just inside it
    >>> round(_sequence_bound(d, ~broken, broken, 1e-4), 3)
    0.297
    """
    reach = float(distance[healthy].max(initial=0.0))
    bound = max(_MARGIN * reach, floor)
    beyond = broken & (distance > reach)
    if beyond.any():
        bound = min(bound, _INSIDE * float(distance[beyond].min()))
    return bound


def _policy_thresholds(normal: _Normal) -> dict[str, Any]:
    """The cap and band on the current policy's ratios over the rollout, placed as the token
    ones are (`_loosest_cap`), on the healthy tokens; none without a current policy."""
    if normal.target is None:
        return {}
    target = normal.target[~normal.token_broken] if normal.token_broken.any() else normal.target
    cap = _loosest_cap(target)
    return {"policy_cap": cap, "policy_band": (_round_down(1.0 / cap), cap)}


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


def _policy_weight(t: _Thresholds, zero: bool = False) -> Component:
    """A token weight on the current policy's ratio over the rollout: capped, or (`zero`)
    zeroed outside the band."""
    if zero:
        band = mask_component("token", *t.policy_band, numerator="policy", numerics="clamp")
        return weight_component("token", numerator="policy", numerics="clamp", zero=band)
    return weight_component("token", upper=t.policy_cap, numerator="policy", numerics="clamp")


_POLICY_KINDS = (
    _Kind(
        "bypass_ppo",
        "bypass: PPO anchored on the rollout",
        lambda t: Canonical(anchor="rollout"),
    ),
    _Kind(
        "policy_token_tis",
        "current-policy token IS (REINFORCE-style)",
        lambda t: Canonical((_policy_weight(t),), anchor="none"),
    ),
    _Kind(
        "policy_icepop",
        "current-policy IS band (REINFORCE-style)",
        lambda t: Canonical((_policy_weight(t, zero=True),), anchor="none"),
    ),
    _Kind(
        "policy_token_tis_ppo",
        "current-policy token IS inside PPO on the recompute",
        lambda t: Canonical((_policy_weight(t),)),
    ),
)
"""The candidates that score against the current policy, tried where the dump has
`policy_logprob` (docs/recommend.md#with-a-current-policy)."""


def recommend(
    data: Data,
    framework: str,
    targets: Targets | None = None,
    progress: Callable[[int, int], None] | None = None,
    default: Setting | None = None,
    engine: Engine = "local",
) -> Recommendation:
    """Rank the framework's candidate settings on a dump against `targets` (docs/recommend.md).

    Args:
        data: the dump: a loaded batch, an opened `Dump` or its path (read whole).
        framework: one of `iscore.frameworks.NAMES`.
        targets: what a good setting does; defaults to `Targets()`.
        progress: called after each candidate is replayed with (candidates replayed,
            candidates in all).
        default: the setting to beat: the user's own (any form `iscore.frameworks.resolve.resolve`
            takes); None for the framework's default (`Framework.default`). It is replayed
            beside the candidates, and kept where none does better.
        engine: "local" reads the dump here; "ray" in Ray tasks, a file or range of its
            steps each, joined here into the same batch (`Dump.load`); the candidates are
            replayed here either way (each against thresholds from every token).

    >>> import iscore
    >>> rec = recommend(iscore.load("data/fp8.parquet"), "skyrl")
    >>> rec.best.passes, rec.best.stats["token_masked_fraction"] <= 0.01
    (True, True)
    """
    fw = frameworks.get(framework)
    targets = targets or Targets()
    own = default is not None
    default_spec = resolve(default) if own else fw.presets()[fw.default]
    batch = load_data(data, engine)
    with ops.shared(batch):  # d, e^d and the sequence sums, computed once for every candidate
        return _recommend(batch, fw, targets, progress, default_spec, own)


def _recommend(
    batch: TokenBatch,
    fw: Framework,
    targets: Targets,
    progress: Callable[[int, int], None] | None,
    default: Spec,
    own: bool,
) -> Recommendation:
    framework = fw.name
    normal = _Normal.of(batch)
    thresholds = _Thresholds.of(normal)
    kinds = _KINDS + (_POLICY_KINDS if normal.target is not None else ())
    expressed = [
        (kind.key, f"{kind.description}, {thresholds.describe(kind.key)}", spec)
        for kind in kinds
        if (spec := fw.express(kind.setting(thresholds), f"{framework} {kind.description}"))
    ]
    whose = "your setting" if own else f"{fw.title}'s default"
    expressed.append(("default", f"{whose}, {default.name}", default))
    candidates = []
    for key, title, spec in expressed:
        canonical = frameworks.of(spec).to_canonical(spec)
        stats, missed = _measure(batch, spec, normal, targets, canonical.anchor)
        stats["components"] = float(len(canonical.components))  # the simpler, the fewer
        candidates.append(
            Candidate(
                spec,
                key,
                title,
                stats,
                tuple(missed),
                _reason(title, stats, tuple(missed)),
                canonical.describe(),
            )
        )
        if progress is not None:
            progress(len(candidates), len(expressed))
    ranked = tuple(sorted(candidates, key=_preference))
    chosen = next(c for c in ranked if c.kind == "default")
    regimes = _regimes(batch, normal)
    if normal.broken.any() and not any(c.passes for c in ranked):
        regimes.append(_elsewhere(batch, fw, normal, targets))
    found = {
        "token_band": list(thresholds.band),
        "token_cap": thresholds.token_cap,
        "geometric_band": list(thresholds.geo),
        "k3": thresholds.k3,
        "broken_sequences": int(normal.broken.sum()),
        "global_offset": normal.d_center if normal.offset else None,
    }
    warnings = _warnings(batch, fw, normal)
    if normal.offset:
        warnings.insert(
            0,
            f"Fix the semantics bug first: <e^d> is {normal.ratio:.4f}, not 1 "
            "(processed vs raw log-probs, a temperature on one side). No IS correction removes "
            "it; the pick only keeps its damage within the targets meanwhile.",
        )
    return Recommendation(
        framework,
        targets,
        ranked,
        tuple(regimes),
        tuple(warnings),
        _pick(ranked, chosen),
        found,
        chosen,
    )


def _measure(
    batch: TokenBatch, spec: Spec, normal: _Normal, targets: Targets, anchor: str = "recompute"
) -> tuple[dict[str, float], list[str]]:
    """What a candidate does, from one replay of it: its statistics (`iscore.stats.setting`,
    pooled), the objective's terms under its loss's `anchor` (`Canonical.anchor`), and the targets
    it misses, pooled and step by step."""
    result = spec.replay(batch)
    accumulator = SettingStats(spec, histograms=False)
    accumulator.update(batch, result)
    summary = accumulator.compute(normal.broken)
    stats = {k: v for k, v in summary.items() if isinstance(v, float | int) and k != "tokens"}
    stats["broken_gradient_kept"] = summary["broken_gradient_kept"] or 0.0
    stats |= _terms(batch, result, normal, anchor)
    missed = _violations(targets, normal, stats)
    missed += _step_misses(targets, normal, summary["by_step"], result, batch)
    return stats, missed


def _terms(
    batch: TokenBatch, result: Replay, normal: _Normal, anchor: str = "recompute"
) -> dict[str, float]:
    """The objective's terms (docs/recommend.md), per loss token, in units of one token's
    gradient: the healthy gradient misweighted (|w - rho|: mismatch left, truncated or
    dropped), the broken sequences' gradient kept (|w|, their ideal weight being 0), and the
    variance the weights add (1/ESS - 1); their drops for the targets.

    With a current policy (docs/recommend.md#with-a-current-policy), w is the whole weight a
    token's gradient carries against the REINFORCE gradient: a REINFORCE-style loss carries
    its weight alone; a PPO loss multiplies it by its ratio x (the lag e^(policy - train) on
    the recompute, e^(policy - rollout) anchored on the rollout) through its clip, which
    zeroes the gradient outside [1 - `PPO_CLIP`, 1 + `PPO_CLIP`] for the half of the tokens
    whose advantage points outward: x/2 there, in expectation. The ideal is the gradient of a
    decoupled PPO with exact weights: e^(policy - rollout), through PPO's clip of the lag."""
    m = batch.loss_mask
    every = ops.mask_is_all(batch, m)
    w = (result.weight if every else result.weight[m]).double().cpu().numpy()
    ideal = normal.rho
    if normal.target is not None:
        ideal = normal.target * _clipped(normal.lag)
        ratio = {"recompute": normal.lag, "rollout": normal.target}.get(anchor)
        if ratio is not None:
            w = w * ratio * _clipped(ratio)
    error = np.abs(w - np.where(normal.token_broken, 0.0, ideal))
    n = max(w.size, 1)
    bias_broken = float(error[normal.token_broken].sum()) / n
    bias_healthy = float(error.sum()) / n - bias_broken
    variance = variance_added(w)
    kept_tokens = ops.segment_count(batch, result.keep & (result.weight != 0)).cpu().numpy()
    healthy = (normal.T > 0) & ~normal.broken
    dropped = normal.T - kept_tokens
    return {
        "bias_healthy": bias_healthy,
        "bias_broken": bias_broken,
        "variance": variance,
        "objective": bias_healthy + bias_broken + VARIANCE_WEIGHT * variance,
        "healthy_token_dropped": float(dropped[healthy].sum() / max(normal.T[healthy].sum(), 1)),
        "healthy_seq_dropped": float((kept_tokens[healthy] == 0).sum() / max(healthy.sum(), 1)),
    }


def _clipped(ratio: np.ndarray) -> np.ndarray:
    """The share of a token's gradient PPO's clipped surrogate keeps at `ratio`, in
    expectation over the advantage's sign: all of it within [1 - `PPO_CLIP`, 1 + `PPO_CLIP`],
    half beyond (the half whose advantage points further out is clipped)."""
    return np.where(np.abs(ratio - 1.0) <= PPO_CLIP, 1.0, 0.5)


def _step_misses(
    targets: Targets,
    normal: _Normal,
    by_step: list[dict[str, Any]],
    result: Replay,
    batch: TokenBatch,
) -> list[str]:
    """The targets a candidate misses on some steps of a multi-step dump, in one line: how
    many steps, which, and the first step's miss (a bound that suits the pooled steps can
    drop most tokens of the last ones once the mismatch grows)."""
    if len(by_step) < 2:
        return []
    steps = batch.step.cpu().numpy()
    kept = ops.segment_count(batch, result.keep & (result.weight != 0)).cpu().numpy()
    failing = []
    for row in by_step:
        mine = steps == row["step"]
        healthy = mine & (normal.T > 0) & ~normal.broken
        tokens = max(float(normal.T[healthy].sum()), 1.0)
        step_stats = row | {
            "token_masked_fraction": float((normal.T - kept)[healthy].sum()) / tokens,
            "seq_masked_fraction": float((kept[healthy] == 0).sum()) / max(healthy.sum(), 1),
        }
        missed = targets.violations(step_stats)
        if missed:
            failing.append((row["step"], missed[0]))
    if not failing:
        return []
    first, last = failing[0][0], failing[-1][0]
    span = f"step {first}" if len(failing) == 1 else f"steps {first}..{last}"
    return [
        f"misses the targets on {len(failing)} of {len(by_step)} steps ({span}; at step "
        f"{first} it {failing[0][1]})"
    ]


MAX_BROKEN_KEPT = 0.10
"""With broken sequences found, a setting must remove at least 90% of their gradient."""


def broken_kept_words(kept: float) -> str:
    """`broken_gradient_kept` in words, saying what a value over 100% means.

    >>> print(broken_kept_words(0.03))
    keeps 3% of the broken sequences' gradient
    >>> print(broken_kept_words(2.0))
    amplifies the broken sequences' gradient 2x (weights above 1 on their tokens)
    """
    if kept > 1.005:
        return (
            f"amplifies the broken sequences' gradient {kept:.3g}x (weights above 1 on "
            "their tokens)"
        )
    return f"keeps {kept:.0%} of the broken sequences' gradient"


MAX_HEALTHY_SEQ_DROP = 0.02
"""and drop at most 2% of the healthy sequences."""


def _violations(targets: Targets, normal: _Normal, stats: dict[str, float]) -> list[str]:
    """The targets a candidate misses. With broken sequences found, the drop budgets hold for
    the healthy data (dropping the broken is the point), and the broken must go."""
    if not normal.broken.any():
        return targets.violations(stats)
    healthy = stats | {
        "token_masked_fraction": stats["healthy_token_dropped"],
        "seq_masked_fraction": stats["healthy_seq_dropped"],
    }
    missed = targets.violations(healthy)
    if stats["broken_gradient_kept"] > MAX_BROKEN_KEPT:
        missed.append(broken_kept_words(stats["broken_gradient_kept"]))
    if stats["healthy_seq_dropped"] > MAX_HEALTHY_SEQ_DROP:
        missed.append(f"drops {stats['healthy_seq_dropped']:.1%} of the healthy sequences")
    return missed


OBJECTIVE_STEP = 1e-3
"""Objectives are compared in steps of 0.1% of a token's gradient: closer ones tie."""


def _preference(c: Candidate) -> tuple[Any, ...]:
    """The order among candidates (docs/recommend.md): the fewest targets missed, then the
    objective (in steps of `OBJECTIVE_STEP`: a fixed key keeps the order transitive, at the
    price of its edges), then the setting to beat where it ties (keep what works), then the
    fewer components (weights and masks)."""
    objective = c.stats["objective"]  # infinite where every weight is 0
    return (
        len(c.missed),
        math.floor(objective / OBJECTIVE_STEP) if math.isfinite(objective) else math.inf,
        c.kind != "default",
        c.stats["components"],
    )


_TERMS = (
    ("bias_healthy", "misweights {} of the healthy gradient (mismatch left, truncated, dropped)"),
    ("bias_broken", "keeps {} of a token's gradient per token from broken sequences"),
    ("variance", "adds {} to the gradient's variance"),
)
"""The objective's terms, each as the "why" words it (VARIANCE_WEIGHT applied to variance)."""


def _why(a: Candidate, b: Candidate) -> str:
    """The term of the objective that decides between `a` and `b`, with both numbers."""
    weights = {"variance": VARIANCE_WEIGHT}

    def gap(key: str) -> float:
        return abs(weights.get(key, 1.0) * (a.stats[key] - b.stats[key]))

    key, words = max(_TERMS, key=lambda term: gap(term[0]))
    x, y = a.stats[key], b.stats[key]
    said = words.format(f"{x:.2%}") + f" against {y:.2%}"
    return f"it {said} (objective {a.stats['objective']:.4f} against {b.stats['objective']:.4f})"


def _pick(ranked: tuple[Candidate, ...], default: Candidate) -> str:
    """Why the best beat the runner-up and the setting to beat, with the deciding term's
    numbers; "keep your default" where that setting is as good."""
    best = ranked[0]
    if len(ranked) < 2:
        return "the only setting this framework expresses"
    second = next(c for c in ranked[1:] if c is not best)
    if best is default:
        return f"keep {default.title}: over {_versus(best, second, 'the best candidate')}"
    text = f"{best.title} over the runner-up, {_versus(best, second, second.title)}"
    if second is not default:
        text += f"; over {_versus(best, default, default.title)}"
    return text


def _versus(best: Candidate, other: Candidate, name: str) -> str:
    """Why `best` ranks before `other` (called `name`), in one clause."""
    if other.missed and not best.missed:
        return f"{name} misses the targets ({'; '.join(other.missed)})"
    if best.missed:
        return f"{name}: no setting meets every target; this one misses the fewest"
    a, b = _preference(best), _preference(other)
    if a[1] != b[1]:
        return f"{name}: {_why(best, other)}"
    if best.kind == "default" or other.kind == "default":
        return (
            f"{name}: they score the same (objective {best.stats['objective']:.4f} against "
            f"{other.stats['objective']:.4f}), so keep what you have"
        )
    if a[3] != b[3]:
        return (
            f"{name}: they score the same, and it is simpler: {best.stats['components']:.0f} "
            f"weight or mask against {other.stats['components']:.0f}"
        )
    return f"{name}: they score the same, and it comes first in the candidates' order"


def _regimes(batch: TokenBatch, normal: _Normal) -> list[str]:
    """The signatures found, and why each matters for the pick."""
    found = []
    if normal.broken.any():
        found.append(
            f"broken sequences: {int(normal.broken.sum())} ({normal.broken_share:.1%}) "
            f"{noise.BROKEN_WORDS}: a stale replica or a bad rank, not noise: the pick must "
            "mask them"
        )
    if normal.offset:
        found.append(
            f"semantics bug: <e^d> is {normal.ratio:.4f} over the healthy tokens "
            f"({normal.ratio_z:+.0f} standard errors from the 1 it must be; the median d is "
            f"{normal.d_center:+.3g}): processed vs raw log-probs or a temperature on one side, "
            "which no IS correction removes; the bands are centred on the median d"
        )
    long = _long_weight(normal)
    if long is not None and not 0.5 <= long[2] <= 2.0:
        found.append(
            f"long-sequence collapse: at {long[0]:,.0f} tokens (your p90 length) "
            f"e^(mean d x length) is {long[2]:.2g}: product weights would scale the LR there, "
            "geometric or token-level settings do not"
        )
    has = normal.T > 0
    steps = batch.step.cpu().numpy()
    if np.unique(steps).size > 2:
        by_step = [float(normal.k3[(steps == s) & has].mean()) for s in np.unique(steps)]
        if by_step[0] > 0 and by_step[-1] > 2.0 * by_step[0]:
            found.append(
                f"drift: the sequences' mean k3 grows {by_step[-1] / by_step[0]:.1f}x over the "
                f"steps ({by_step[0]:.3g} to {by_step[-1]:.3g}, averaged per sequence): re-run "
                "this on the latest steps (--steps) before trusting a bound"
            )
    if normal.lag is not None:
        found.append(_policy_regime(normal))
    if not found:
        found.append("numerical noise only: nothing stands out, so no sequence should be dropped")
    broken = normal.token_broken.any()  # without, no copies of the token arrays
    d = normal.d[~normal.token_broken] if broken else normal.d
    k3 = np.clip(d, -20.0, 20.0)
    np.expm1(k3, out=k3)
    k3 -= d
    unlikely = (normal.rollout[~normal.token_broken] if broken else normal.rollout) < math.log(0.1)
    if k3.sum() > 0 and unlikely.any():
        share = float(k3[unlikely].sum() / k3.sum())
        if share > 0.5:
            found.append(
                f"low-probability-token noise: {share:.0%} of the mismatch (k3) sits in the "
                f"{unlikely.mean():.0%} of tokens the rollout gave < 10% probability: token-level "
                "settings act on those tokens alone, where a sequence mask drops whole sequences"
            )
    return found


def _policy_regime(normal: _Normal) -> str:
    """With a current policy: its lag against the engine's mismatch, and which kind of
    setting that favours (docs/recommend.md#with-a-current-policy)."""
    healthy = ~normal.token_broken
    lag = np.log(normal.lag[healthy])
    d = normal.d[healthy]
    lag_k3 = float(np.mean(np.expm1(lag) - lag)) if lag.size else 0.0
    engine_k3 = float(np.mean(np.expm1(np.clip(d, -20.0, 20.0)) - d)) if d.size else 0.0
    which = (
        "staleness: the current policy's lag outweighs the engine"
        if lag_k3 > engine_k3
        else "the engine's mismatch outweighs the current policy's lag"
    )
    return (
        f"current policy: {which} (k3 {lag_k3:.3g} from the recompute to the policy, "
        f"{engine_k3:.3g} from the rollout to the recompute); settings anchored on the "
        "rollout (bypass) or weighted by the current policy are replayed beside the decoupled "
        "ones, all judged against a decoupled PPO with exact weights: a bypass setting ties "
        "it where the engine's mismatch stays inside PPO's clip (and saves the recompute), "
        "decoupled settings win where the engine's mismatch or the policy's lag is larger"
    )


def _long_weight(normal: _Normal) -> tuple[float, float, float] | None:
    """(the p90 length L, the healthy tokens' mean d, e^(mean d x L)): the e^S product weights
    give a sequence of length L whose tokens are independent. A model: steadier than the median
    e^S of the few sequences that long, which spread over orders of magnitude (None without
    healthy tokens)."""
    has = normal.T > 0
    d = normal.d[~normal.token_broken] if normal.token_broken.any() else normal.d  # no copy
    if not has.any() or not d.size:
        return None
    long_t = float(np.quantile(normal.T[has], 0.9))
    mu = float(np.mean(d))
    return long_t, mu, math.exp(min(mu * long_t, 700.0))


def _elsewhere(batch: TokenBatch, fw: Framework, normal: _Normal, targets: Targets) -> str:
    """Which other framework's setting removes the broken sequences, when this one cannot."""
    thresholds = _Thresholds.of(normal)
    for other in frameworks.every():
        if other is fw:
            continue
        for kind in _KINDS:
            spec = other.express(kind.setting(thresholds), f"{other.name} {kind.description}")
            if spec is None:
                continue
            anchor = other.to_canonical(spec).anchor
            stats, missed = _measure(batch, spec, normal, targets, anchor)
            if not missed:
                return (
                    f"{fw.name} cannot express a setting that removes the broken sequences "
                    f"within the targets; {other.name}'s {kind.description} does (it "
                    f"{broken_kept_words(stats['broken_gradient_kept'])}, drops "
                    f"{stats['healthy_seq_dropped']:.1%} of the healthy sequences)"
                )
    return (
        f"{fw.name} cannot express a setting that removes the broken sequences within the targets"
    )


def _reason(description: str, stats: dict[str, float], missed: tuple[str, ...]) -> str:
    effect = (
        f"LR scale {stats['lr_scale']:.4g}, ESS {stats['ess']:.1%}, "
        f"{stats['token_masked_fraction']:.2%} of tokens and {stats['seq_masked_fraction']:.1%} "
        "of sequences dropped"
    )
    if missed:
        return f"{description}: misses the targets ({'; '.join(missed)}); {effect}"
    return f"{description}: meets the targets; {effect}"


def _warnings(batch: TokenBatch, framework: Framework, normal: _Normal) -> list[str]:
    """The traps that bite this data: sequence-weight collapse, and the framework's own."""
    warnings = []
    long = _long_weight(normal)
    if long is not None and long[2] < 0.5:
        warnings.append(
            f"Product (sequence-level) weights collapse at your lengths: at {long[0]:,.0f} "
            f"tokens (your p90 length) e^(mean d x length) is {long[2]:.2g} (mean d "
            f"{long[1]:.2g} per token), so sequence IS cuts the effective LR there; prefer "
            "token-level or geometric-mean weights."
        )
    for trap in framework.traps:
        warning = trap.warning(batch, lambda spec: quick_stats(batch, spec))
        if warning is not None:
            warnings.append(warning)
    return warnings
