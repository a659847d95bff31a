"""Where does the mismatch come from? What the data supports, with the evidence, and what to do.

Each source leaves its own signature in a dump, read mostly from what `analyze` streams anyway
(`iscore.stats.mismatch`: the flags, the by-probability buckets, the correlation of d with the
rollout's log-prob) and from two small accumulators here:

- **broken replica** (`broken`): sequences far outside their step's noise (`iscore.stats.noise`).
- **nucleus truncation** (`nucleus`): the rollout reports log-probs renormalized over a top-p
  or top-k kept set, the trainer over the full vocabulary: d = log(kept mass) < 0 on every
  token, so E_rollout[e^d], which is 1 whatever the noise, falls to the kept mass.
- **one-sided temperature** (`temperature`): a temperature applied on one side only keeps
  E_rollout[e^d] = 1 (both sides still cover the same tokens) but makes d a linear function of
  the token's log-prob, one-sided by its rank: sharper on the rollout gives d < 0 on likely
  tokens and d > 0 on unlikely ones.
- **numerics** (`numerics`): engine noise (precision, kernels, FP8) is symmetric and grows as
  a token's probability falls: most of the k3 sits on the few low-probability tokens.
- **routing flips** (`routing`): an MoE router that picks other experts on one side for a
  stretch of a sequence gives a span of large |d| among ordinary tokens: the sequence's worst
  window of `WINDOW` tokens averages many times its step's mean |d|. With the expert ids of
  both sides (`rollout_experts`, `train_experts`), the mismatch conditional on routing
  agreement says it directly: the tokens whose experts differ carry many times the k3 of
  those whose experts agree.
- **re-tokenization** (`retokenization`), with a `turn` column: a multi-turn transcript
  re-tokenized for the trainer splits the text at the turns' seams otherwise than the
  rollout did: the first `TURN_TOKENS` loss tokens of each turn after the first carry many
  times the k3 of the rest.
- **staleness** (`staleness`), with `policy_logprob`: the drift from the rollout to the current
  policy splits into the engine's part (rollout to trainer recompute, d) and the policy's lag
  (trainer recompute to current policy); the lag grows with the off-policy lag, the engine
  part does not.
- **drift** (`drift`): the engine's mismatch grows over the steps.
- **one value stands out** (`metadata`), with a metadata column (`replica`, `rank`, `host`,
  `device`, `weight_version`): one value's k3 is many times the others' (`standouts`).

A finding is `{kind, title, evidence, summary, action}`: the numbers that support it, the
same in words, and what to do about it.

>>> from iscore.passes.analysis import analyze
>>> analyze("data/moe_routing.parquet").attribution.kinds
['routing', 'numerics']
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from iscore.advice.flags import Flag, flags_of
from iscore.advice.metadata import standouts
from iscore.errors import clip
from iscore.stats import SPAN_RATIO, TURN_TOKENS, WINDOW, AttributionNumbers, MismatchSummary

SPAN_SHARE = 0.01
"""and such sequences are at least this share of the healthy ones."""


LOW_PROB = 0.1
"""Tokens the rollout gave less than this probability are the low-probability tail, and"""


LOW_PROB_SHARE = 0.5
"""numerics is named when they hold more than this share of the k3 (as `recommend` does)."""


GROWTH = 2.0
"""A part of the mismatch grows when its last step's k3 is this many times its first's."""


CONDITIONAL_RATIO = 2.0
"""Tokens whose routing differs (or at a turn boundary) carry the mismatch when their mean k3
is over this many times the other tokens',"""


CONDITIONAL_Z = 3.0
"""and their mean |d| this many standard errors above the others' (|d|, not k3: k3's tail is
so heavy that a few far-off tokens make its standard error, while |d| keeps the test's
power; a few far-off tokens in one group raise its mean and standard error together),"""


CONDITIONAL_TOKENS = 100
"""and both groups hold at least this many loss tokens."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One source of the mismatch the data supports.

    Attributes:
        kind: `broken`, `nucleus`, `biased_ratio`, `temperature`, `numerics`, `routing`,
            `retokenization`, `staleness` (the policy's lag outweighs the engine or grows),
            `engine` (with a current policy, the engine's part outweighs the lag), `drift` or
            `metadata` (one value of a metadata column stands out).
        title: the source, in a few words.
        evidence: the numbers that support it (plain JSON values).
        summary: the evidence in words.
        action: what to do about it.
    """

    kind: str
    title: str
    evidence: dict[str, Any]
    summary: str
    action: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "title": self.title,
            "evidence": self.evidence,
            "summary": self.summary,
            "action": self.action,
        }


@dataclass(frozen=True, slots=True)
class Attribution:
    """The findings, and the per-step split they rest on.

    Attributes:
        findings: what the data supports, strongest evidence first (broken sequences and
            semantics bugs, then routing, re-tokenization, staleness, drift, numerics).
        by_step: per step: `step`, `engine_k3` (k3 of d, rollout to trainer), `lag_k3` (k3
            of policy - train: the policy's lag) and `total_k3` (k3 of policy - rollout), null
            without `policy_logprob`; `lag_share` (lag / (lag + engine)); `span_sequences`;
            `routing_differ_share` and `routing_k3_ratio`, `turn_boundary_share` and
            `turn_k3_ratio` (see `conditional`), null without the columns.
        routing: the mismatch conditional on routing agreement (`conditional`, groups
            `differ` and `agree`), None without `rollout_experts` and `train_experts`.
        turns: the mismatch at turn boundaries against the rest (`conditional`, groups
            `boundary` and `rest`), None without a `turn` column.
    """

    findings: tuple[Finding, ...]
    by_step: tuple[dict[str, Any], ...]
    routing: dict[str, Any] | None = None
    turns: dict[str, Any] | None = None

    @property
    def kinds(self) -> list[str]:
        return [f.kind for f in self.findings]

    def to_dict(self) -> dict[str, Any]:
        return {
            "findings": [f.to_dict() for f in self.findings],
            "by_step": list(self.by_step),
            "routing": self.routing,
            "turns": self.turns,
        }


def _carries(stats: dict[str, Any] | None, inside: str, outside: str) -> bool:
    """Whether the group carries the mismatch: enough tokens on both sides, its mean k3
    `CONDITIONAL_RATIO` times the rest's and its mean |d| `CONDITIONAL_Z` standard errors
    above the rest's."""
    return (
        stats is not None
        and min(stats[f"{inside}_tokens"], stats[f"{outside}_tokens"]) >= CONDITIONAL_TOKENS
        and stats["k3_ratio"] is not None
        and stats["k3_ratio"] > CONDITIONAL_RATIO
        and stats["z"] is not None
        and stats["z"] > CONDITIONAL_Z
    )


def _k3_share(mismatch: MismatchSummary) -> tuple[float, float, list[dict[str, Any]]]:
    """(the share of the k3 in tokens the rollout gave < `LOW_PROB`, their share of the tokens,
    the buckets' mean |d|) from `mismatch.by_prob`."""
    buckets = mismatch.by_prob
    total_k3 = sum(b["k3"] * b["tokens"] for b in buckets)
    tokens = sum(b["tokens"] for b in buckets)
    # A bucket's label is "lo-hi" (`mismatch.PROB_EDGES`).
    low = [b for b in buckets if float(b["bucket"].rpartition("-")[2]) <= LOW_PROB]
    k3_share = sum(b["k3"] * b["tokens"] for b in low) / total_k3 if total_k3 > 0 else 0.0
    token_share = sum(b["tokens"] for b in low) / tokens if tokens else 0.0
    table = [{"bucket": b["bucket"], "abs_diff_mean": b["abs_diff_mean"]} for b in buckets]
    return k3_share, token_share, table


def _broken(mismatch: MismatchSummary, flags: Sequence[Flag]) -> list[Finding]:
    if not flags_of(flags, "broken"):
        return []
    count = mismatch.broken_sequences
    steps = [row["step"] for row in mismatch.by_step if row.get("broken_sequences")]
    share = count / max(mismatch.sequences, 1)
    return [
        Finding(
            "broken",
            "A broken replica or rank",
            {"sequences": count, "share": share, "steps": steps},
            f"{count:,} sequences ({share:.1%}) in {len(steps)} step(s) lie far outside their "
            "step's noise: their log-probs off, or far more spread than noise, as a replica "
            "with stale weights or a bad rank scores them.",
            "Mask them with a sequence-level mask (`iscore recommend` places its bound between "
            "them and the noise); then find the replica or rank that scored them (a weight "
            "sync that failed or lagged).",
        )
    ]


def _semantics(mismatch: MismatchSummary, flags: Sequence[Flag]) -> list[Finding]:
    codes = {f.code for f in flags_of(flags, "semantics_bug")}
    ratio = mismatch.ratio_mean
    se = mismatch.ratio_mean_stderr or 0.0
    z = (ratio - 1.0) / se if se > 0 else 0.0
    buckets = [{"bucket": b["bucket"], "d_mean": b["d_mean"]} for b in mismatch.by_prob]
    found = []
    if "ratio_mean_bias" in codes and ratio < 1.0:
        found.append(
            Finding(
                "nucleus",
                "Top-p / top-k on one side only",
                {
                    "ratio_mean": ratio,
                    "z": z,
                    "d_sign_fraction": mismatch.d_sign_fraction,
                    "d_mean_by_prob": buckets,
                },
                f"<e^d> = {ratio:.4f} ({z:+.0f} standard errors from the 1 it is for any "
                f"noise) and {mismatch.d_sign_fraction:.0%} of the tokens on one side "
                "of 0: the rollout renormalized its log-probs over a nucleus that kept about "
                f"{ratio:.1%} of the probability, the trainer scored the full vocabulary.",
                "Fix the sampling parameters: have the engine report raw log-probs, or "
                "renormalize the trainer's over the same kept set (a keep-sampling mask); with "
                "top_p 1 and top_k off it vanishes. No IS correction removes it.",
            )
        )
    elif "ratio_mean_bias" in codes:
        found.append(
            Finding(
                "biased_ratio",
                "The two sides score different distributions",
                {"ratio_mean": ratio, "z": z, "d_mean_by_prob": buckets},
                f"<e^d> = {ratio:.4f} ({z:+.0f} standard errors above the 1 it is for any "
                "noise): the trainer puts more mass on the sampled tokens than the rollout.",
                "Check that both sides score the same tokens with the same weights: a token "
                "shift, a stale weight sync, processed against raw log-probs. No IS correction "
                "removes it.",
            )
        )
    if "logprob_dependent_offset" in codes and "ratio_mean_bias" not in codes:
        corr = mismatch.d_rollout_correlation
        slope = mismatch.d_rollout_slope
        side = "sharper" if corr < 0 else "flatter"
        found.append(
            Finding(
                "temperature",
                "A temperature on one side only",
                {"correlation": corr, "slope": slope, "d_mean_by_prob": buckets},
                f"d follows the rollout's log-prob (r = {corr:+.2f}, slope {slope:+.3f} per "
                f"nat) while <e^d> stays 1: the rollout's distribution is {side} than the "
                "trainer's over the same tokens, as a temperature applied on one side gives.",
                "Apply the sampling temperature on both sides: divide the trainer's logits by "
                "the rollout's temperature, and have the engine report log-probs after it "
                "(processed). No IS correction removes it.",
            )
        )
    return found


def _routing(
    span: np.ndarray,
    steps: np.ndarray,
    ids: pa.Array,
    broken: np.ndarray,
    agreement: dict[str, Any] | None,
) -> list[Finding]:
    """Routing flips, from the expert ids where the dump has them (`agreement`), and from the
    spans of large |d| (with the agreement beside them, which may or may not support them)."""
    action = (
        "On an MoE model, replay the rollout's routing in the trainer (routing replay, R3 or "
        "rollout routing replay as the RL frameworks call it: record the experts the engine "
        "chose and force them in the trainer's forward). Until then a token band bounds these "
        "tokens' weights; a sequence mask drops their sequences."
    )
    spans = _spans(span, steps, ids, broken)
    if _carries(agreement, "differ", "agree"):
        a = agreement
        said = (
            f" {spans['sequences']:,} sequences also hold a span of large |d|."
            if spans is not None
            else ""
        )
        share = a["k3_share_differ"] or 0.0
        return [
            Finding(
                "routing",
                "Tokens routed to other experts carry the mismatch",
                {**a, "spans": spans},
                f"{a['differ_share']:.1%} of the loss tokens were routed to other experts by "
                f"the trainer than by the rollout; their k3 is {a['k3_ratio']:.1f}x that of "
                f"the tokens whose routing agrees ({a['k3_differ']:.3g} against "
                f"{a['k3_agree']:.3g} per token; mean |d| {a['abs_diff_mean_differ']:.3g} "
                f"against {a['abs_diff_mean_agree']:.3g}, {a['z']:.0f} standard errors), and "
                f"they carry {share:.0%} of the mismatch.{said}",
                action,
            )
        ]
    if spans is None:
        return []
    summary = (
        f"{spans['sequences']:,} sequences ({spans['share']:.1%}) hold a run of {WINDOW} "
        f"tokens whose mean |d| is over {SPAN_RATIO:g}x their step's (up to "
        f"{spans['largest_window_ratio']:.1f}x), among ordinary tokens: a stretch where the "
        "two sides computed the tokens differently, as a router choosing other experts does."
    )
    if agreement is not None:
        summary += (
            " The dump's expert ids do not tie the mismatch to routing ("
            + _agreement_words(agreement)
            + "): look for another cause of a local divergence too."
        )
    return [
        Finding(
            "routing",
            "Spans of large |d|: MoE routing flips",
            {**spans, "agreement": agreement},
            summary,
            action,
        )
    ]


def _agreement_words(a: dict[str, Any]) -> str:
    """What the expert ids say, where they do not single out routing."""
    if not a["differ_tokens"]:
        return "every token's routing agrees"
    if not a["agree_tokens"]:
        return "no token's routing agrees, so there is nothing to compare with"
    if min(a["differ_tokens"], a["agree_tokens"]) < CONDITIONAL_TOKENS:
        return f"fewer than {CONDITIONAL_TOKENS} tokens on one side to compare"
    ratio = a["k3_ratio"]
    said = "no k3 on either side" if ratio is None else f"{ratio:.2g}x the k3 per token"
    return f"the {a['differ_share']:.1%} of tokens whose routing differs carry {said}"


def _spans(
    span: np.ndarray, steps: np.ndarray, ids: pa.Array, broken: np.ndarray
) -> dict[str, Any] | None:
    """The evidence of spans of large |d|, None where too few healthy sequences hold one."""
    healthy = ~broken
    found = (span > SPAN_RATIO) & healthy
    share = float(found.sum()) / max(int(healthy.sum()), 1)
    if not found.any() or share < SPAN_SHARE:
        return None
    order = np.argsort(-np.where(found, span, -np.inf), kind="stable")[: min(5, found.sum())]
    worst = [
        {"step": int(steps[i]), "seq_id": ids[int(i)].as_py(), "window_ratio": float(span[i])}
        for i in order
    ]
    return {
        "sequences": int(found.sum()),
        "share": share,
        "window": WINDOW,
        "largest_window_ratio": float(span[found].max()),
        "worst": worst,
    }


def _retokenization(turns: dict[str, Any] | None) -> list[Finding]:
    if not _carries(turns, "boundary", "rest"):
        return []
    t = turns
    share = t["k3_share_boundary"] or 0.0
    return [
        Finding(
            "retokenization",
            "Turn boundaries: a re-tokenized transcript",
            {**t, "boundary_width": TURN_TOKENS},
            f"The first {TURN_TOKENS} loss tokens of each turn after the first "
            f"({t['boundary_share']:.1%} of the loss tokens) have {t['k3_ratio']:.1f}x the k3 "
            f"of the rest ({t['k3_boundary']:.3g} against {t['k3_rest']:.3g} per token, "
            f"mean |d| {t['abs_diff_mean_boundary']:.3g} against "
            f"{t['abs_diff_mean_rest']:.3g}, {t['z']:.0f} standard errors) and carry "
            f"{share:.0%} of the mismatch: the trainer scored other tokens at the turns' "
            "seams than the rollout sampled, as re-tokenizing the conversation's text between "
            "turns does.",
            "Keep the token ids across turns: build each turn's input from the rollout's own "
            "token ids (append the new turn's tokens) instead of re-tokenizing the transcript "
            "with a chat template. Until then, mask the first tokens of each turn out of the "
            "loss.",
        )
    ]


def _growth(values: list[float]) -> float | None:
    """The last value over the first, with at least three steps and a first above 0."""
    if len(values) < 3 or not values[0] > 0:
        return None
    return values[-1] / values[0]


def _staleness(by_step: list[dict[str, Any]]) -> list[Finding]:
    rows = [r for r in by_step if r["lag_k3"] is not None]
    if not rows:
        return []
    lag = [r["lag_k3"] for r in rows]
    engine = [r["engine_k3"] for r in rows]
    mean_lag, mean_engine = float(np.mean(lag)), float(np.mean(engine))
    growth, engine_growth = _growth(lag), _growth(engine)
    grows = growth is not None and growth > GROWTH and not (engine_growth or 0) > GROWTH
    evidence = {
        "lag_k3": mean_lag,
        "engine_k3": mean_engine,
        "lag_share": mean_lag / (mean_lag + mean_engine) if mean_lag + mean_engine else 0.0,
        "lag_growth": growth,
        "engine_growth": engine_growth,
    }
    if not (mean_lag > mean_engine or grows):
        return [
            Finding(
                "engine",
                "The engine, not the policy's lag",
                evidence,
                f"From the rollout to the current policy, the engine's mismatch (k3 "
                f"{mean_engine:.3g} per token, averaged over the steps) outweighs the policy's "
                f"lag behind the trainer's recompute (k3 {mean_lag:.3g}), and the lag does not "
                "grow faster than the engine's part.",
                "Correct the engine's part where it is: a decoupled setting (IS from the rollout "
                "to the recompute, with its cap or mask) leaves the lag to the PPO ratio; a "
                "bypass setting saves the recompute only where the engine's part is within "
                "noise. `iscore recommend` replays both on this dump.",
            )
        ]
    trend = (
        f"; the lag grows {growth:.1f}x over the steps while the engine's part "
        f"{'grows ' + format(engine_growth, '.1f') + 'x' if engine_growth else 'stays'}"
        if growth is not None
        else ""
    )
    return [
        Finding(
            "staleness",
            "The policy's lag (staleness), not the engine",
            evidence,
            f"From the rollout to the current policy, the policy's lag behind the trainer's "
            f"recompute (k3 {mean_lag:.3g} per token, averaged over the steps) outweighs the "
            f"engine's mismatch (k3 {mean_engine:.3g}){trend}.",
            "Correct against the current policy: a bypass setting (the PPO ratio anchored on "
            "the rollout) or a decoupled one (IS from the rollout to the recompute, PPO from "
            "there); `iscore recommend` replays both on this dump. Shorten the lag: fewer "
            "mini-batches per rollout, less asynchrony.",
        )
    ]


def _drift(
    mismatch: MismatchSummary, flags: Sequence[Flag], by_step: list[dict[str, Any]]
) -> list[Finding]:
    if not any(f.code == "drift" for f in flags):
        return []
    k3 = [r["engine_k3"] for r in by_step]
    growth = mismatch.k3_growth
    return [
        Finding(
            "drift",
            "The engine's mismatch grows over the steps",
            {"k3_by_step": k3, "growth": growth},
            f"k3 (rollout to trainer) grows {growth:.1f}x from the first step to the last "
            f"({k3[0]:.3g} to {k3[-1]:.3g}): the engines diverge as training goes on.",
            "Check the weight sync (a rollout engine that misses updates), a resume from a "
            "checkpoint, and raw against processed log-probs; re-run `iscore recommend` on the "
            "latest steps (--steps) before trusting a bound.",
        )
    ]


def _numerics(mismatch: MismatchSummary, flags: Sequence[Flag]) -> list[Finding]:
    if flags_of(flags, "semantics_bug"):
        return []  # a bug's own signature also sits on the unlikely tokens
    k3_share, token_share, table = _k3_share(mismatch)
    if not k3_share > LOW_PROB_SHARE:
        return []
    tail = mismatch.abs_diff_quantiles.get("p99.9")
    largest = mismatch.abs_diff_max
    said = (
        f"; the largest |d| is {largest:.3g} nats, 99.9% of tokens within {tail:.3g}"
        if (tail is not None and largest is not None and math.isfinite(largest))
        else ""
    )
    return [
        Finding(
            "numerics",
            "Engine numerics on low-probability tokens",
            {
                "k3_share": k3_share,
                "token_share": token_share,
                "abs_diff_mean_by_prob": table,
                "abs_diff_max": largest,
                "abs_diff_p99.9": tail,
            },
            f"{k3_share:.0%} of the mismatch (k3) sits in the {token_share:.0%} of tokens the "
            f"rollout gave < {LOW_PROB:g} probability, symmetric noise that grows as the "
            f"probability falls{said}: the two sides' arithmetic differs.",
            "Token-level corrections act on exactly these tokens (a token cap or IcePop band); "
            "a sequence mask would drop whole sequences for them. To shrink it: the same "
            "precision and kernels on both sides (a bf16 rather than a quantized rollout, the "
            "LM head in fp32).",
        )
    ]


def _standout(mismatch: MismatchSummary) -> list[Finding]:
    """The value of a metadata column that stands out most (`iscore.advice.metadata`), the
    other columns' standouts in its evidence (one replica on one host is both)."""
    found = standouts(mismatch.metadata)
    if not found:
        return []
    top = found[0]
    where = {"replica": "engine instance", "rank": "trainer rank", "host": "host"}
    where |= {"device": "GPU model", "weight_version": "weight version"}
    also = "; ".join(s.sentence() for s in found[1:])
    return [
        Finding(
            "metadata",
            f"One {where[top.column]} stands out",
            {"standouts": [s.to_dict() for s in found]},
            top.sentence() + (f". Also {also}" if also else "") + ".",
            f"Look at {top.column} {clip(str(top.value), 60)}: its weight sync (the version it "
            "loaded), its engine's version, kernels and precision, and the hardware it runs "
            "on; drop or restart it, or mask its sequences until it scores as the others do.",
        )
    ]


def attribute(
    numbers: AttributionNumbers, mismatch: MismatchSummary, flags: Sequence[Flag]
) -> Attribution:
    """The findings the data supports, from what `AttributionStats.compute` gives and the
    mismatch diagnostics of the same dump and their `flags`, strongest evidence first."""
    by_step = list(numbers.by_step)
    findings = [
        *_broken(mismatch, flags),
        *_semantics(mismatch, flags),
        *_standout(mismatch),
        *_routing(numbers.span, numbers.steps, numbers.ids, numbers.broken, numbers.routing),
        *_retokenization(numbers.turns),
        *_staleness(by_step),
        *_drift(mismatch, flags, by_step),
        *_numerics(mismatch, flags),
    ]
    return Attribution(tuple(findings), numbers.by_step, numbers.routing, numbers.turns)
