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
from typing import Any

import numpy as np

from iscore import ops
from iscore.batch import TokenBatch
from iscore.errors import ConfigError, quote
from iscore.impact import quick_stats
from iscore.replay import FRAMEWORKS, Spec, parse_config
from iscore.tune import Tuner

FLOAT32_EXP_MAX = math.log(np.finfo(np.float32).max)  # 88.72: e^S overflows float32 above


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


def _verl(rc: dict[str, Any]) -> dict[str, Any]:
    return {"framework": "verl", "algorithm": {"rollout_correction": rc}}


def _skyrl(opc: dict[str, Any]) -> dict[str, Any]:
    return {"framework": "skyrl", "trainer": {"algorithm": {"off_policy_correction": opc}}}


def _nemo(loss_fn: dict[str, Any]) -> dict[str, Any]:
    return {
        "framework": "nemo_rl",
        "loss_fn": {"use_importance_sampling_correction": True, **loss_fn},
    }


def _openrlhf(kind: str, low: float, high: float) -> dict[str, Any]:
    flag = "--algo.advantage.is_correction"
    return {
        "framework": "openrlhf",
        "args": f"{flag}_enable {flag}_type {kind} {flag}_threshold {low:g} {high:g}",
    }


def _verl_geo(t: _Thresholds) -> str:
    # verl's k1 statistic is -d: keeping e^G in [lo, hi] needs the threshold "1/hi_1/lo".
    lo, hi = t.geo
    return f"{1 / hi:.6g}_{1 / lo:.6g}"


_CANDIDATES: dict[str, list[tuple[str, str, _Builder]]] = {
    "verl": [
        (
            "token_tis",
            "token TIS",
            lambda t: _verl({"rollout_is": "token", "rollout_is_threshold": t.token_cap}),
        ),
        (
            "icepop",
            "token IcePop band",
            lambda t: _verl(
                {"rollout_is": "token", "rollout_is_threshold": f"{t.band[0]:g}_{t.band[1]:g}"}
            ),
        ),
        (
            "geo_mask",
            "geometric sequence mask (Geo-RS)",
            lambda t: _verl({"rollout_rs": "seq_mean_k1", "rollout_rs_threshold": _verl_geo(t)}),
        ),
        (
            "geo_mask_token_tis",
            "Geo-RS + token TIS",
            lambda t: _verl(
                {
                    "rollout_is": "token",
                    "rollout_is_threshold": t.token_cap,
                    "rollout_rs": "seq_mean_k1",
                    "rollout_rs_threshold": _verl_geo(t),
                }
            ),
        ),
        (
            "k3_mask",
            "k3 sequence mask (K3-RS)",
            lambda t: _verl({"rollout_rs": "seq_mean_k3", "rollout_rs_threshold": t.k3}),
        ),
        (
            "seq_tis",
            "sequence (product) TIS",
            lambda t: _verl({"rollout_is": "sequence", "rollout_is_threshold": 2.0}),
        ),
    ],
    "skyrl": [
        (
            "token_tis",
            "token TIS",
            lambda t: _skyrl({"tis_ratio_type": "token", "token_tis_ratio_clip_high": t.token_cap}),
        ),
        (
            "geo_mask",
            "geometric sequence mask",
            lambda t: _skyrl(
                {
                    "sequence_mask_metric": "geometric",
                    "geo_mask_low": t.geo[0],
                    "geo_mask_high": t.geo[1],
                }
            ),
        ),
        (
            "geo_mask_token_tis",
            "geometric mask + token TIS",
            lambda t: _skyrl(
                {
                    "tis_ratio_type": "token",
                    "token_tis_ratio_clip_high": t.token_cap,
                    "sequence_mask_metric": "geometric",
                    "geo_mask_low": t.geo[0],
                    "geo_mask_high": t.geo[1],
                }
            ),
        ),
        (
            "token_mask",
            "token mask (no weight)",
            lambda t: _skyrl(
                {
                    "token_mask_is_threshold_low": t.band[0],
                    "token_mask_is_threshold_high": t.band[1],
                }
            ),
        ),
        (
            "seq_tis",
            "sequence (product) TIS",
            lambda t: _skyrl({"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 5.0}),
        ),
    ],
    "nemo_rl": [
        (
            "token_tis",
            "token TIS",
            lambda t: _nemo(
                {
                    "truncated_importance_sampling_type": "tis",
                    "truncated_importance_sampling_ratio": t.token_cap,
                }
            ),
        ),
        (
            "icepop",
            "token IcePop band",
            lambda t: _nemo(
                {
                    "truncated_importance_sampling_type": "icepop",
                    "truncated_importance_sampling_ratio_min": t.band[0],
                    "truncated_importance_sampling_ratio": t.band[1],
                }
            ),
        ),
        (
            "seq_mask_tis",
            "seq-mask-tis (geometric mask, raw token weights)",
            lambda t: _nemo(
                {
                    "truncated_importance_sampling_type": "seq-mask-tis",
                    "truncated_importance_sampling_ratio_min": t.geo[0],
                    "truncated_importance_sampling_ratio": t.geo[1],
                }
            ),
        ),
        (
            "seq_tis",
            "sequence (product, GSPO) TIS",
            lambda t: _nemo(
                {
                    "truncated_importance_sampling_type": "tis",
                    "truncated_importance_sampling_ratio": 2.0,
                    "sequence_level_importance_ratios": True,
                    "token_level_loss": False,
                }
            ),
        ),
    ],
    "slime": [
        (
            "token_tis",
            "token TIS",
            lambda t: {"framework": "slime", "args": f"--use-tis --tis-clip {t.token_cap:g}"},
        ),
        (
            "icepop",
            "token IcePop band",
            lambda t: {
                "framework": "slime",
                "args": "--use-tis --custom-tis-function-path "
                "slime.backends.megatron_utils.loss.icepop_function "
                f"--tis-clip-low {t.band[0]:g} --tis-clip {t.band[1]:g}",
            },
        ),
    ],
    "areal": [
        (
            "token_tis",
            "token clamp",
            lambda t: {
                "framework": "areal",
                "actor": {
                    "use_decoupled_loss": True,
                    "rejection_sampling": {
                        "level": "token",
                        "action": "clamp",
                        "metric": "ratio",
                        "upper": t.token_cap,
                    },
                },
            },
        ),
        (
            "icepop",
            "token mask",
            lambda t: {
                "framework": "areal",
                "actor": {
                    "use_decoupled_loss": True,
                    "rejection_sampling": {
                        "level": "token",
                        "action": "mask",
                        "metric": "ratio",
                        "lower": t.band[0],
                        "upper": t.band[1],
                    },
                },
            },
        ),
        (
            "geo_mask",
            "geometric sequence mask",
            lambda t: {
                "framework": "areal",
                "actor": {
                    "use_decoupled_loss": True,
                    "rejection_sampling": {
                        "level": "sequence",
                        "action": "mask",
                        "metric": "ratio",
                        "agg": "mean",
                        "lower": t.geo[0],
                        "upper": t.geo[1],
                    },
                },
            },
        ),
    ],
    "openrlhf": [
        ("token_tis", "two-sided token TIS", lambda t: _openrlhf("tis", t.band[0], t.token_cap)),
        ("icepop", "token IcePop band", lambda t: _openrlhf("icepop", *t.band)),
        (
            "seq_mask_tis",
            "seq-mask-tis (geometric mask)",
            lambda t: _openrlhf("seq-mask-tis", *t.geo),
        ),
    ],
    "trl": [
        (
            "token_tis",
            "token truncate",
            lambda t: {
                "framework": "trl",
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": t.token_cap,
            },
        ),
        (
            "icepop",
            "token mask",
            lambda t: {
                "framework": "trl",
                "vllm_importance_sampling_mode": "token_mask",
                "vllm_importance_sampling_clip_min": t.band[0],
                "vllm_importance_sampling_clip_max": t.band[1],
            },
        ),
        ("seq_mask", "sequence (product) mask, TRL's default", lambda t: {"framework": "trl"}),
    ],
    "fireworks": [
        (
            "token_tis",
            "token TIS",
            lambda t: {"framework": "fireworks", "tis": {"cap": t.token_cap, "level": "token"}},
        ),
        (
            "geo_tis",
            "sequence (geometric-mean) TIS",
            lambda t: {"framework": "fireworks", "tis": {"cap": 2.0, "level": "sequence"}},
        ),
        (
            "icepop",
            "token TIS with IcePop band",
            lambda t: {
                "framework": "fireworks",
                "tis": {
                    "cap": t.token_cap,
                    "level": "token",
                    "icepop_threshold": max(t.band[1], 1 / t.band[0]),
                },
            },
        ),
    ],
}


def recommend(batch: TokenBatch, framework: str, targets: Targets | None = None) -> Recommendation:
    """Rank the framework's candidate settings on `batch` against `targets`.

    Args:
        batch: the loaded dump.
        framework: one of `iscore.replay.FRAMEWORKS`.
        targets: what a good setting does; defaults to `Targets()`.
    """
    if framework not in FRAMEWORKS:
        raise ConfigError(
            f"Expected `framework` to be one of {', '.join(FRAMEWORKS)}, but got {quote(framework)}"
        )
    targets = targets or Targets()
    tuner = Tuner(batch)
    thresholds = _Thresholds.of(tuner, targets)
    candidates = []
    for kind, description, build in _CANDIDATES[framework]:
        config = build(thresholds)
        config["name"] = f"{framework} {description}"
        spec = parse_config(config)
        stats = quick_stats(batch, spec)
        missed = tuple(targets.violations(stats))
        reason = _reason(f"{description}, {thresholds.describe(kind)}", stats, missed)
        candidates.append(Candidate(spec, kind, stats, missed, reason))
    ranked = sorted(
        candidates,
        key=lambda c: (
            len(c.missed),
            abs(math.log(max(c.stats["lr_scale"], 1e-12))),
            -c.stats["ess"],
            c.stats["token_masked_fraction"],
        ),
    )
    return Recommendation(framework, targets, tuple(ranked), tuple(_warnings(batch, framework)))


def _reason(description: str, stats: dict[str, float], missed: tuple[str, ...]) -> str:
    effect = (
        f"LR scale {stats['lr_scale']:.3g}, ESS {stats['ess']:.0%}, "
        f"{stats['token_masked_fraction']:.2%} of tokens and {stats['seq_masked_fraction']:.1%} "
        "of sequences dropped"
    )
    if missed:
        return f"{description}: misses the targets ({'; '.join(missed)}); {effect}"
    return f"{description}: meets the targets; {effect}"


def _warnings(batch: TokenBatch, framework: str) -> list[str]:
    """The traps that bite this data in this framework (corrections.md section 3)."""
    warnings = []
    m = batch.loss_mask
    d = ops.log_ratio(batch)
    T = ops.segment_count(batch, m)
    S = ops.segment_sum(d, batch, m)
    has = T > 0
    if has.any():
        d_loss = d[m]
        mu = float(d_loss.mean())
        long_t = float(T[has].double().quantile(0.9))
        median_weight = math.exp(mu * long_t)
        if median_weight < 0.5:
            warnings.append(
                f"Product (sequence-level) weights collapse at your lengths: at {long_t:,.0f} "
                f"tokens (your p90 length) the median e^S is {median_weight:.2g} (mean d "
                f"{mu:.2g} per token), so sequence IS cuts the effective LR there; prefer "
                "token-level or geometric-mean weights."
            )
        overflow = int((S[has] > FLOAT32_EXP_MAX).sum())
        if framework == "nemo_rl" and overflow:
            warnings.append(
                f"NeMo-RL's sequence-level weight e^S overflows float32 and becomes 0 (not the "
                f"cap) for {overflow} sequence(s) with S > 88.7: with "
                "sequence_level_importance_ratios those sequences get no gradient."
            )
    if framework == "verl":
        warnings.append(
            "verl's k1 rejection (token_k1/seq_*_k1) keeps ratios in [1/U, 1/L], not [L, U]: "
            'asymmetric bounds such as "0.5_1.5" keep [0.667, 2.0]. The geometric candidates '
            "here already account for it."
        )
    if framework == "areal":
        warnings.append(
            "AReaL: use_decoupled_loss without rejection_sampling applies no behaviour weight at "
            "all (since PR #1088); set rejection_sampling as in the candidates."
        )
    if framework == "openrlhf":
        warnings.append(
            "OpenRLHF's seq-mask-tis shares the TIS threshold pair; the default [0.5, 5] is "
            "effectively no mask for a geometric mean: set thresholds like the candidate's."
        )
    if framework == "trl":
        default = quick_stats(batch, parse_config({"framework": "trl"}))
        warnings.append(
            "TRL's default vllm_importance_sampling_mode is sequence_mask (product ratio masked "
            f"above 3.0): on this data it drops {default['seq_masked_fraction']:.1%} of sequences "
            f"and scales the LR by {default['lr_scale']:.3g}."
        )
    return warnings
