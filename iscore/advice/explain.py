"""A recommendation in words: what the data shows (its regimes), why the pick beat the
runner-up and the setting to beat, what each candidate does, and the traps that bite."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from iscore import frameworks
from iscore.advice.candidates import KINDS, Candidate
from iscore.advice.objective import TERMS, broken_kept_words, measure, preference
from iscore.advice.targets import Targets
from iscore.advice.thresholds import VARIANCE_WEIGHT, Normal, Thresholds
from iscore.frameworks import Framework, Spec
from iscore.packed import TokenBatch
from iscore.stats import noise, quick_stats


def _why(a: Candidate, b: Candidate) -> str:
    """The term of the objective that decides between `a` and `b`, with both numbers."""
    weights = {"variance": VARIANCE_WEIGHT}

    def gap(key: str) -> float:
        return abs(weights.get(key, 1.0) * (a.stats[key] - b.stats[key]))

    key, words = max(TERMS, key=lambda term: gap(term[0]))
    x, y = a.stats[key], b.stats[key]
    said = words.format(f"{x:.2%}") + f" against {y:.2%}"
    return f"it {said} (objective {a.stats['objective']:.4f} against {b.stats['objective']:.4f})"


def versus_words(best: Candidate, other: Candidate, name: str) -> str:
    """Why `best` ranks before `other` (called `name`), in one clause."""
    if other.missed and not best.missed:
        return f"{name} misses the targets ({'; '.join(other.missed)})"
    if best.missed:
        return f"{name}: no setting meets every target; this one misses the fewest"
    a, b = preference(best), preference(other)
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


def regime_words(batch: TokenBatch, normal: Normal) -> list[str]:
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


def _policy_regime(normal: Normal) -> str:
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


def _long_weight(normal: Normal) -> tuple[float, float, float] | None:
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


def elsewhere_words(batch: TokenBatch, fw: Framework, normal: Normal, targets: Targets) -> str:
    """Which other framework's setting removes the broken sequences, when this one cannot."""
    thresholds = Thresholds.of(normal)
    for other in frameworks.every():
        if other is fw:
            continue
        for kind in KINDS:
            spec = other.express(kind.setting(thresholds), f"{other.name} {kind.description}")
            if spec is None:
                continue
            anchor = other.to_canonical(spec).anchor
            stats, missed = measure(batch, spec, normal, targets, anchor)
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


def reason_words(description: str, stats: dict[str, float], missed: tuple[str, ...]) -> str:
    effect = (
        f"LR scale {stats['lr_scale']:.4g}, ESS {stats['ess']:.1%}, "
        f"{stats['token_masked_fraction']:.2%} of tokens and {stats['seq_masked_fraction']:.1%} "
        "of sequences dropped"
    )
    if missed:
        return f"{description}: misses the targets ({'; '.join(missed)}); {effect}"
    return f"{description}: meets the targets; {effect}"


def trap_warnings(
    batch: TokenBatch, framework: Framework, normal: Normal, specs: Sequence[Spec]
) -> list[str]:
    """The traps that bite this data: sequence-weight collapse, and the framework's own that
    are about one of `specs` (`Trap.about`: the pick and the setting to beat)."""
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
        if trap.about is not None and not any(trap.about(spec) for spec in specs):
            continue
        warning = trap.warning(batch, lambda spec: quick_stats(batch, spec).numbers())
        if warning is not None:
            warnings.append(warning)
    return warnings
