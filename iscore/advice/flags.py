"""The mismatch flags: signatures of semantics bugs (as opposed to numerical noise), broken
sequences, drift over the steps and a heavy tail, each a `code`, a `kind` and a message,
decided here from the mismatch diagnostics and read by every surface."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from iscore.frameworks import every
from iscore.stats import Baseline, MismatchSummary, first_rise, noise, ratio_bias

FlagKind = Literal["semantics_bug", "broken", "drift", "heavy_tail"]
"""What a flag says about the mismatch: a bug in what one side computes (`semantics_bug`: no
IS correction removes it), sequences far outside their step's noise (`broken`: a stale replica
or a bad rank, which a sequence mask removes), a mismatch that changes over training (`drift`),
or a few far-off tokens among noise (`heavy_tail`: what token caps and bands are for)."""


FLAG_KINDS: dict[str, str] = {
    "semantics_bug": "Looks like a bug, not noise",
    "broken": "Broken sequences, not noise",
    "drift": "The mismatch changes over training",
    "heavy_tail": "A heavy tail",
}
"""Each flag kind's heading, in the order every surface shows them."""


NO_SEMANTICS_BUG = (
    "No signature of a semantics bug (an offset, a biased ratio, a one-sided temperature)."
)
"""What every surface says where no flag is of kind `semantics_bug`."""


_FLAG_KIND: dict[str, FlagKind] = {
    "broken_sequences": "broken",
    "ratio_mean_bias": "semantics_bug",
    "logprob_dependent_offset": "semantics_bug",
    "constant_offset": "semantics_bug",
    "drift": "drift",
    "heavy_tail": "heavy_tail",
    "support_normalized": "semantics_bug",
    "shifted_by_one": "semantics_bug",
    "zero_rollout_logprob": "semantics_bug",
    "position_jump": "semantics_bug",
    "token_id_mismatch": "semantics_bug",
    "engine_drift": "drift",
}
"""The kind of each flag code: decided here, read by the app's pages and the report."""


@dataclass(frozen=True, slots=True)
class Flag:
    """One flag of the mismatch.

    Attributes:
        code: what was found (`broken_sequences`, `ratio_mean_bias`, `logprob_dependent_offset`,
            `constant_offset`, `drift`, `heavy_tail`).
        kind: what it says about the mismatch (`FlagKind`), decided with the code.
        message: the evidence in words.
    """

    code: str
    kind: FlagKind
    message: str

    @classmethod
    def of(cls, code: str, message: str) -> Flag:
        return cls(code, _FLAG_KIND[code], message)

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "kind": self.kind, "message": self.message}


def flags_of(flags: Sequence[Flag], kind: FlagKind) -> list[Flag]:
    """The flags of `kind` among `flags`, in order."""
    return [f for f in flags if f.kind == kind]


def find_flags(
    result: MismatchSummary,
    s: dict[str, np.ndarray],
    broken: np.ndarray,
    regression: np.ndarray,
    signs: np.ndarray,
) -> tuple[Flag, ...]:
    """Signatures of semantics bugs, as opposed to numerical noise; broken sequences; drift
    over the steps; a heavy tail of far-off tokens. The identity E_rollout[e^d] = 1 is tested
    on the sequences that are not broken: a stale replica breaks it in its own sequences, and
    is named as what it is.

    Args:
        result: the mismatch diagnostics (`MismatchStats.compute`).
        s: the per-sequence sums they were computed from (`MismatchStats.sequences`).
        broken: bool [B], the broken sequences among them (`MismatchStats.broken`).
        regression, signs: the accumulator's sums of the regression of d on the rollout
            log-prob, and its counts of d below, at and above 0.
    """
    flags: list[Flag] = []
    if not result.tokens:
        return ()
    if broken.any():
        steps = np.unique(s["step"][broken])
        where = f"step {steps[0]}" if steps.size == 1 else f"{steps.size} steps, from {steps[0]}"
        flags.append(
            Flag.of(
                "broken_sequences",
                f"{int(broken.sum()):,} sequences ({broken.mean():.1%}) "
                f"{noise.BROKEN_WORDS} ({where}): as a stale replica or a bad rank gives, not "
                "numerical noise. A sequence-level mask removes them; token caps only bound "
                "them.",
            )
        )
    healthy = ~broken & (s["T"] > 0)
    tokens = max(float(s["T"][healthy].sum()), 1.0)
    ratio = float(s["rho"][healthy].sum()) / tokens
    variance = max(float(s["rho2"][healthy].sum()) / tokens - ratio * ratio, 0.0)
    z = ratio_bias(ratio, math.sqrt(variance / tokens))
    if z is not None:
        flags.append(
            Flag.of(
                "ratio_mean_bias",
                f"<exp(d)> = {ratio:.4f} (z = {z:+.0f}"
                + (", over the sequences that are not broken" if broken.any() else "")
                + "): it must be 1 when tokens are "
                "sampled from the rollout engine and both sides score the same distribution. "
                "Typical causes: processed (top-p/top-k/temperature) log-probs on one side and raw "
                "on the other, a token shift, or stale weights.",
            )
        )
    corr = result.d_rollout_correlation
    if abs(corr) > 0.3:
        flags.append(
            Flag.of(
                "logprob_dependent_offset",
                f"d is correlated with the rollout log-prob (r = {corr:+.2f}): "
                "numerical noise is symmetric at every probability. A temperature applied on "
                "one side only (or different temperatures) makes d grow linearly with the "
                "log-prob.",
            )
        )
    n = regression[0]  # the loss tokens
    negative, _, positive = signs.astype(float)
    one_sided = result.d_sign_fraction
    if one_sided > 0.8 and abs(result.d_mean) > 3.0 * math.sqrt(result.d_var / n):
        side = "below" if negative > positive else "above"
        flags.append(
            Flag.of(
                "constant_offset",
                f"{one_sided:.0%} of the tokens have d {side} 0 (mean d = "
                f"{result.d_mean:+.4f}): a one-sided offset is a semantics bug (e.g. raw vs "
                "processed log-probs, renormalization after top-p), not numerical noise.",
            )
        )
    # The steps with tokens in the loss (a step whose tokens are all masked has no k3).
    steps = [step for step in result.by_step if step.get("tokens")]
    k3 = [row["healthy_k3"] for row in steps if row.get("healthy_k3") is not None]
    steps = [row for row in steps if row.get("healthy_k3") is not None]
    rise = first_rise(k3)
    if rise is not None:
        band = Baseline.of(k3)
        flags.append(
            Flag.of(
                "drift",
                f"k3 (the token mean over the sequences not called broken) rises from step "
                f"{steps[rise]['step']} on, to "
                f"{k3[-1] / band.median:.1f}x the median of {band.early} by "
                f"step {steps[-1]['step']}: mismatch that drifts during training points to a "
                "divergence between the engines (weight sync, resume, growing off-policyness).",
            )
        )
    flags.extend(_support_normalized(result))
    largest, tail = result.abs_diff_max, result.abs_diff_quantiles.get("p99.9")
    if largest > 2.0 and tail is not None:
        # Noise or not, a few far-off tokens are what token caps and bands are for.
        flags.append(
            Flag.of(
                "heavy_tail",
                f"the largest |d| is {largest:.3g} nats (a ratio of e^{largest:.3g}), while "
                f"99.9% of the tokens are within {tail:.3g}: a few far-off tokens (fp8 outliers, "
                "routing flips) that a token cap or band acts on.",
            )
        )
    return tuple(flags)


def _support_fixes() -> str:
    """What each framework offers against a truncated support (`Framework.support`)."""
    fixes = [f"{fw.title} {fw.support}" for fw in every() if fw.support]
    return "; ".join(fixes) + "." if fixes else ""


SUPPORT_SHARE = 0.5
"""The least share of the sampled ratio's missing mass the top-k mass excess must explain for
`support_normalized`."""


def _support_normalized(result: MismatchSummary) -> list[Flag]:
    """The engine renormalized over a truncated support (top-p / top-k sampling with processed
    log-probs): the mean ratio <e^d> falls below 1 (the `ratio_mean_bias` test: more than
    `noise.RATIO_BIAS_Z` standard errors and `noise.RATIO_BIAS`), and the engine's excess of
    mass on its top-k ids over the trainer's explains at least `SUPPORT_SHARE` of the gap:
    with mu = p / P(S), <e^d> = P(S) and the excess is sum_K mu (1 - P(S)), where a token shift
    or stale weights leave the masses alike."""
    found = result.distribution
    if not found or math.isnan(result.ratio_mean):
        return []
    gap = 1.0 - result.ratio_mean
    z = ratio_bias(result.ratio_mean, result.ratio_mean_stderr)
    excess = found["rollout_topk_mass"] - found["train_topk_mass"]
    if z is None or z > 0 or excess < SUPPORT_SHARE * gap:
        return []
    return [
        Flag.of(
            "support_normalized",
            f"<exp(d)> = {result.ratio_mean:.4f} (z = {z:+.0f}) and the engine puts "
            f"{excess:.3g} more probability than the trainer on its own top-k ids (of a gap of "
            f"{gap:.3g}): the engine's log-probs are renormalized over a truncated support "
            "(top-p / top-k sampling), the trainer's over the whole vocabulary. Score the "
            "trainer over the same kept set, or log the engine's raw log-probs (vLLM "
            "logprobs_mode=raw_logprobs). " + _support_fixes(),
        )
    ]
