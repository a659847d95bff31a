"""The objective candidates are ranked by, in units: the gradient a setting misweights per token
(on the healthy and on the broken sequences) plus the variance its weights add, beside the
targets it misses, pooled and on every step."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from iscore.advice.candidates import Candidate
from iscore.advice.targets import MAX_BROKEN_KEPT, Targets
from iscore.advice.thresholds import PPO_CLIP, VARIANCE_WEIGHT, Normal, variance_added
from iscore.frameworks import Replay, Spec
from iscore.packed import TokenBatch, ops
from iscore.stats import SettingStats


def measure(
    batch: TokenBatch, spec: Spec, normal: Normal, targets: Targets, anchor: str = "recompute"
) -> tuple[dict[str, float], list[str]]:
    """What a candidate does, from one replay of it: its statistics (`iscore.stats.setting`,
    pooled), the objective's terms under its loss's `anchor` (`Canonical.anchor`), and the targets
    it misses, pooled and step by step."""
    result = spec.replay(batch)
    accumulator = SettingStats(spec, histograms=False)
    accumulator.update(batch, result)
    summary = accumulator.compute(normal.broken)
    # The summary's numbers as a candidate's (its table's row): the counts of sequences, the
    # headline numbers, the aggregation's flag, the broken gradient kept.
    numbers = {"denominator_shrinks": summary.denominator_shrinks, **summary.numbers()}
    stats = {k: v for k, v in numbers.items() if isinstance(v, float | int) and k != "tokens"}
    stats["broken_gradient_kept"] = summary.broken_gradient_kept or 0.0
    stats |= _terms(batch, result, normal, anchor)
    missed = _violations(targets, normal, stats)
    missed += _step_misses(targets, normal, summary.by_step, result, batch)
    return stats, missed


def _terms(
    batch: TokenBatch, result: Replay, normal: Normal, anchor: str = "recompute"
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
    normal: Normal,
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


MAX_HEALTHY_SEQ_DROP = 0.02
"""and drop at most 2% of the healthy sequences."""


def _violations(targets: Targets, normal: Normal, stats: dict[str, float]) -> list[str]:
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


def preference(c: Candidate) -> tuple[Any, ...]:
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


TERMS = (
    ("bias_healthy", "misweights {} of the healthy gradient (mismatch left, truncated, dropped)"),
    ("bias_broken", "keeps {} of a token's gradient per token from broken sequences"),
    ("variance", "adds {} to the gradient's variance"),
)
"""The objective's terms, each as the "why" words it (VARIANCE_WEIGHT applied to variance)."""


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
