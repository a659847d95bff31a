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

A finding is `{kind, title, evidence, summary, action}`: the numbers that support it, the
same in words, and what to do about it.

>>> from iscore.passes.analysis import analyze
>>> [f["kind"] for f in analyze("data/moe_routing.parquet").attribution["findings"]]
['routing', 'numerics']
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import kernels, ops
from iscore.packed.batch import TokenBatch
from iscore.stats.histogram import checked
from iscore.stats.mismatch import flags_of
from iscore.stats.noise import step_groups

WINDOW = 32
"""Tokens per window in the search for spans of large |d| (routing flips)."""

CLIP = 50.0
"""Each token's |d| counts at most this many times its step's mean |d| in a window: one
far-off token (an outlier the heavy tail reports) cannot make a span."""

SPAN_RATIO = 6.0
"""A sequence has a span of large |d| when its worst window's mean |d| is this many times its
step's mean (under bf16 or FP8-like noise alone, 1,024 simulated sequences stay below 5.2)."""

SPAN_SHARE = 0.01
"""and such sequences are at least this share of the healthy ones."""

LOW_PROB = 0.1
"""Tokens the rollout gave less than this probability are the low-probability tail, and"""

LOW_PROB_SHARE = 0.5
"""numerics is named when they hold more than this share of the k3 (as `recommend` does)."""

GROWTH = 2.0
"""A part of the mismatch grows when its last step's k3 is this many times its first's."""

TURN_TOKENS = 4
"""The first this many loss tokens of each turn after a sequence's first are its boundary."""

CONDITIONAL_RATIO = 2.0
"""Tokens whose routing differs (or at a turn boundary) carry the mismatch when their mean k3
is over this many times the other tokens',"""

CONDITIONAL_Z = 3.0
"""and their mean |d| this many standard errors above the others' (|d|, not k3: k3's tail is
so heavy that a few far-off tokens make its standard error, while |d| keeps the test's
power; a few far-off tokens in one group raise its mean and standard error together),"""

CONDITIONAL_TOKENS = 100
"""and both groups hold at least this many loss tokens."""

_K3_CLAMP = 20.0
"""d is clamped to +-this many nats before its k3 is summed per group."""


@dataclass(frozen=True, slots=True)
class Finding:
    """One source of the mismatch the data supports.

    Attributes:
        kind: `broken`, `nucleus`, `biased_ratio`, `temperature`, `numerics`, `routing`,
            `retokenization`, `staleness` (the policy's lag outweighs the engine or grows),
            `engine` (with a current policy, the engine's part outweighs the lag) or `drift`.
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


@dataclass(slots=True)
class AttributionStats:
    """Streaming accumulator of what the findings need beyond `MismatchStats`, updated with
    the same runs of one step's sequences: per sequence (in the order added, as
    `MismatchStats.sequences` lists them), its worst window's mean |d| over its run's mean;
    per step, with `policy_logprob`, the sums of the policy lag's k3.

    >>> stats = AttributionStats()
    >>> for chunk in dump.batches(whole_steps=True): stats.update(chunk)  # doctest: +SKIP
    """

    span: list[np.ndarray] = field(default_factory=list)
    # step -> [tokens, k3 of policy - train, k3 of policy - rollout, |policy - train|]
    policy: dict[int, np.ndarray] = field(default_factory=dict)
    # step -> `_GROUP` sums of the loss tokens whose routing agrees, then of those it differs
    routing: dict[int, np.ndarray] = field(default_factory=dict)
    # step -> `_GROUP` sums of the loss tokens off turn boundaries, then of those on one
    turns: dict[int, np.ndarray] = field(default_factory=dict)

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole steps."""
        m = batch.loss_mask
        every = ops.mask_is_all(batch, m)
        T = ops.segment_count(batch, m).cpu().numpy().astype(np.int64)
        steps = batch.step.cpu().numpy().astype(np.int64)
        d = ops.log_ratio(batch)
        absd = torch.abs(d if every else d[m]).cpu().numpy()
        token_step = np.repeat(steps, T)
        mask = m.cpu().numpy()
        grouped = batch.routing_agrees is not None or batch.turn is not None
        fields = _fields(d if every else d[m], absd) if grouped else None
        if batch.routing_agrees is not None:
            differ = ~batch.routing_agrees.cpu().numpy()[mask]
            _add(self.routing, _group_sums(fields, differ, token_step))
        spanned = absd
        if batch.turn is not None:
            lengths = batch.lengths.cpu().numpy()
            boundary = turn_boundary(batch.turn.cpu().numpy(), lengths, mask)[mask]
            _add(self.turns, _group_sums(fields, boundary, token_step))
            # The boundaries' mismatch is re-tokenization's: it makes no span of a routing flip.
            spanned = np.where(boundary, 0.0, absd)
        self.span.append(_span_ratios(spanned, T, steps))
        if batch.policy is None:
            return
        lag = ops.log_ratio(batch, "policy") - d  # policy - train, exact in float64
        total = ops.log_ratio(batch, "policy")
        if not every:
            lag, total = lag[m], total[m]
        sums = np.stack(
            [
                np.ones(lag.numel()),
                ops.k3(lag.clamp(-20.0, 20.0)).cpu().numpy(),
                ops.k3(total.clamp(-20.0, 20.0)).cpu().numpy(),
                torch.abs(lag).cpu().numpy(),
            ],
            axis=1,
        )
        _add(
            self.policy, {int(s): sums[token_step == s].sum(axis=0) for s in np.unique(token_step)}
        )

    def merge(self, other: AttributionStats) -> None:
        """Add another accumulator's chunks after these (order is kept)."""
        self.span.extend(other.span)
        _add(self.policy, other.policy)
        _add(self.routing, other.routing)
        _add(self.turns, other.turns)

    def state(self) -> dict[str, np.ndarray]:
        """Everything it holds as plain numpy arrays, for `from_state` (what a results store
        keeps of a part, `iscore.passes.results_store`)."""

        def rows(sums: dict[int, np.ndarray], width: int) -> np.ndarray:
            table = [[step, *row] for step, row in sums.items()]
            return np.array(table, np.float64).reshape(-1, 1 + width)

        return {
            "span": np.concatenate(self.span) if self.span else np.zeros(0),
            "policy": rows(self.policy, 4),
            "routing": rows(self.routing, 2 * len(_GROUP)),
            "turns": rows(self.turns, 2 * len(_GROUP)),
        }

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> AttributionStats:
        """The accumulator `state` describes (see `state`).

        Raises:
            ValueError: `state` is not one `state()` wrote (one written before routing and
                turns were accumulated lacks them: the store computes its part again).
        """
        span = checked(state, "span", "f", (-1,)).astype(np.float64)
        tables = [
            checked(state, name, "f", (-1, 1 + width)).astype(np.float64)
            for name, width in (
                ("policy", 4),
                ("routing", 2 * len(_GROUP)),
                ("turns", 2 * len(_GROUP)),
            )
        ]
        policy, routing, turns = ({int(row[0]): row[1:].copy() for row in t} for t in tables)
        return cls([span], policy, routing, turns)

    def compute(
        self, mismatch: dict[str, Any], sequences: dict[str, Any], broken: np.ndarray
    ) -> Attribution:
        """The findings, from the mismatch diagnostics of the same chunks (`MismatchStats
        .compute()`), its sequences (`MismatchStats.sequences()`: their steps and ids) and
        its broken sequences (`MismatchStats.broken()`), in the order added."""
        span = np.concatenate(self.span) if self.span else np.zeros(0)
        steps = np.asarray(sequences["step"], dtype=np.int64)
        ids = sequences["seq_id"]
        if span.size != steps.size:
            raise ValueError(f"expected {steps.size} sequences' spans, found {span.size}")
        by_step = _split(mismatch, self.policy)
        routing = conditional(_total(self.routing), "differ", "agree")
        turns = conditional(_total(self.turns), "boundary", "rest")
        findings = [
            *_broken(mismatch),
            *_semantics(mismatch),
            *_routing(span, steps, ids, broken, routing),
            *_retokenization(turns),
            *_staleness(by_step),
            *_drift(mismatch, by_step),
            *_numerics(mismatch),
        ]
        spans = (span > SPAN_RATIO) & ~broken
        for row in by_step:
            row["span_sequences"] = int(spans[steps == row["step"]].sum())
            for name, sums, key in (
                ("routing", self.routing, "differ"),
                ("turn", self.turns, "boundary"),
            ):
                stats = conditional(sums.get(int(row["step"])), key, "rest")
                row[f"{name}_{key}_share"] = None if stats is None else stats[f"{key}_share"]
                row[f"{name}_k3_ratio"] = None if stats is None else stats["k3_ratio"]
        return Attribution(tuple(findings), tuple(by_step), routing, turns)


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


def _span_ratios(absd: np.ndarray, T: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """float64 [B]: each sequence's largest mean of `WINDOW` consecutive loss tokens' |d| (the
    whole sequence when shorter), each |d| clipped at `CLIP` times its step's mean, over that
    mean (0 without loss tokens or mismatch)."""
    out = np.zeros(T.size)
    if not absd.size:
        return out
    mean = np.zeros(T.size)
    clipped = absd.copy()
    for _, chosen, tokens in step_groups(steps, T):
        mine = absd[tokens]
        if not mine.size:
            continue
        m = float(mine.mean())
        clipped[tokens] = np.minimum(mine, CLIP * m)
        mean[chosen] = m
    best = kernels.window_means(clipped, T, WINDOW)
    if best is None:
        best = _window_means(clipped, T)
    nonempty = T > 0
    has = nonempty & (mean > 0)
    out[has] = best[has] / mean[has]
    return out


def _window_means(x: np.ndarray, T: np.ndarray) -> np.ndarray:
    """float64 [B]: each sequence's largest mean of `WINDOW` consecutive values of x (its
    own mean when shorter, 0 when empty), from the running sums of x (`kernels.window_means`
    gives the same)."""
    starts = np.cumsum(T) - T
    cs = np.concatenate([[0.0], np.cumsum(x)])
    best = np.zeros(T.size)
    # A sequence shorter than a window: its own mean.
    short = (T > 0) & (T < WINDOW)
    best[short] = (cs[starts[short] + T[short]] - cs[starts[short]]) / T[short]
    # Longer ones: every window's mean, by the window's last token, and the largest of those
    # that end at or after the sequence's WINDOW-th token (the others cross its start).
    long = np.flatnonzero(T >= WINDOW)
    if long.size:
        windows = np.empty(x.size + 1)  # one more: reduceat's indices stay below its size
        windows[: WINDOW - 1] = -np.inf
        windows[WINDOW - 1 : -1] = (cs[WINDOW:] - cs[:-WINDOW]) / WINDOW
        windows[-1] = -np.inf
        bounds = np.stack([starts[long] + WINDOW - 1, starts[long] + T[long]], axis=1).ravel()
        best[long] = np.maximum.reduceat(windows, bounds)[::2]
    return best


_GROUP = ("tokens", "k3", "abs_diff", "d_squared")
"""The sums kept of each group of loss tokens: count, k3, |d| and d^2 (for the standard error
of the mean |d|)."""


def _fields(d: torch.Tensor, absd: np.ndarray) -> np.ndarray:
    """float64 [n, 4]: each loss token's `_GROUP` terms, from its d and |d|."""
    k3 = ops.k3(d.clamp(-_K3_CLAMP, _K3_CLAMP)).cpu().numpy()
    return np.stack([np.ones_like(k3), k3, absd, absd * absd], axis=1)


def _group_sums(fields: np.ndarray, inside: np.ndarray, token_step: np.ndarray) -> dict:
    """Per step, the `_GROUP` sums of the tokens outside the group, then of those inside."""
    out = {}
    for step in np.unique(token_step):
        mine = token_step == step
        out[int(step)] = np.concatenate(
            [fields[mine & ~inside].sum(axis=0), fields[mine & inside].sum(axis=0)]
        )
    return out


def _add(into: dict[int, np.ndarray], sums: dict[int, np.ndarray]) -> None:
    for step, row in sums.items():
        into[step] = into.get(step, 0.0) + row


def _total(sums: dict[int, np.ndarray]) -> np.ndarray | None:
    return sum(sums.values()) if sums else None


def turn_boundary(turn: np.ndarray, lengths: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """bool [N]: the first `TURN_TOKENS` loss tokens of each turn after its sequence's first.

    A turn is a run of tokens of one `turn` value within a sequence; a sequence's first run is
    no boundary, whatever its value.

    >>> turn_boundary(np.array([0, 0, 1, 1, 1, 1, 1, 1, 0]), np.array([8, 1]),
    ...               np.array([1, 1, 0, 1, 1, 1, 1, 1, 1], bool)).astype(int).tolist()
    [0, 0, 0, 1, 1, 1, 1, 0, 0]
    """
    n = turn.size
    if not n:
        return np.zeros(0, dtype=bool)
    first = np.zeros(n, dtype=bool)
    starts = np.cumsum(lengths) - lengths
    first[starts[lengths > 0]] = True
    run_start = first.copy()
    run_start[1:] |= turn[1:] != turn[:-1]
    runs = np.flatnonzero(run_start)
    run = np.cumsum(run_start) - 1
    later = ~first[runs][run]
    loss = np.cumsum(mask)
    before = (loss - mask)[runs]  # loss tokens before each run
    return mask & later & (loss - before[run] <= TURN_TOKENS)


def conditional(sums: np.ndarray | None, inside: str, outside: str) -> dict[str, Any] | None:
    """The mismatch of a group of loss tokens against the rest, from their `_GROUP` sums
    (the rest's, then the group's); None without sums or tokens.

    Returns:
        `tokens`; `{inside}_share` (of the tokens); `k3_{inside}`, `k3_{outside}` and
        `abs_diff_mean_{inside}`, `abs_diff_mean_{outside}` (per token; None for an empty
        group); `k3_ratio` (the group's mean k3 over the rest's); `k3_share_{inside}` (the
        group's share of the k3); `z` (the group's mean |d| less the rest's, over its
        standard error), None where undefined; `{inside}_tokens` and `{outside}_tokens`.

    >>> rest, group = [100, 1.0, 5.0, 0.5], [10, 1.0, 2.0, 0.5]  # _GROUP sums
    >>> c = conditional(np.array(rest + group), "differ", "agree")
    >>> c["differ_share"], c["k3_ratio"], c["k3_share_differ"]
    (0.09090909090909091, 10.0, 0.5)
    """
    if sums is None or not sums[0] + sums[len(_GROUP)] > 0:
        return None
    rest, group = sums[: len(_GROUP)], sums[len(_GROUP) :]
    n = rest[0] + group[0]

    def mean(part: np.ndarray, i: int) -> float | None:
        return float(part[i] / part[0]) if part[0] > 0 else None

    k3_in, k3_out = mean(group, 1), mean(rest, 1)
    ratio = k3_in / k3_out if k3_in is not None and k3_out else None
    k3_total = group[1] + rest[1]
    se = None
    if group[0] > 1 and rest[0] > 1:
        var = [max(p[3] / p[0] - (p[2] / p[0]) ** 2, 0.0) / p[0] for p in (group, rest)]
        se = math.sqrt(sum(var))
    return {
        "tokens": int(n),
        f"{inside}_share": float(group[0] / n),
        "k3_ratio": ratio,
        f"k3_{inside}": k3_in,
        f"k3_{outside}": k3_out,
        f"abs_diff_mean_{inside}": mean(group, 2),
        f"abs_diff_mean_{outside}": mean(rest, 2),
        f"k3_share_{inside}": float(group[1] / k3_total) if k3_total > 0 else None,
        "z": (group[2] / group[0] - rest[2] / rest[0]) / se if se else None,
        f"{inside}_tokens": int(group[0]),
        f"{outside}_tokens": int(rest[0]),
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


def _k3_share(mismatch: dict[str, Any]) -> tuple[float, float, list[dict[str, Any]]]:
    """(the share of the k3 in tokens the rollout gave < `LOW_PROB`, their share of the tokens,
    the buckets' mean |d|) from `mismatch.by_prob`."""
    buckets = mismatch.get("by_prob", [])
    total_k3 = sum(b["k3"] * b["tokens"] for b in buckets)
    tokens = sum(b["tokens"] for b in buckets)
    # A bucket's label is "lo-hi" (`mismatch.PROB_EDGES`).
    low = [b for b in buckets if float(b["bucket"].rpartition("-")[2]) <= LOW_PROB]
    k3_share = sum(b["k3"] * b["tokens"] for b in low) / total_k3 if total_k3 > 0 else 0.0
    token_share = sum(b["tokens"] for b in low) / tokens if tokens else 0.0
    table = [{"bucket": b["bucket"], "abs_diff_mean": b["abs_diff_mean"]} for b in buckets]
    return k3_share, token_share, table


def _broken(mismatch: dict[str, Any]) -> list[Finding]:
    if not flags_of(mismatch, "broken"):
        return []
    count = mismatch.get("broken_sequences", 0)
    steps = [row["step"] for row in mismatch["by_step"] if row.get("broken_sequences")]
    share = count / max(mismatch["sequences"], 1)
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


def _semantics(mismatch: dict[str, Any]) -> list[Finding]:
    codes = {f["code"] for f in flags_of(mismatch, "semantics_bug")}
    ratio = mismatch.get("ratio_mean", 1.0)
    se = mismatch.get("ratio_mean_stderr") or 0.0
    z = (ratio - 1.0) / se if se > 0 else 0.0
    buckets = [{"bucket": b["bucket"], "d_mean": b["d_mean"]} for b in mismatch.get("by_prob", [])]
    found = []
    if "ratio_mean_bias" in codes and ratio < 1.0:
        found.append(
            Finding(
                "nucleus",
                "Top-p / top-k on one side only",
                {
                    "ratio_mean": ratio,
                    "z": z,
                    "d_sign_fraction": mismatch.get("d_sign_fraction"),
                    "d_mean_by_prob": buckets,
                },
                f"<e^d> = {ratio:.4f} ({z:+.0f} standard errors from the 1 it is for any "
                f"noise) and {mismatch.get('d_sign_fraction', 0):.0%} of the tokens on one side "
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
        corr = mismatch.get("d_rollout_correlation", 0.0)
        slope = mismatch.get("d_rollout_slope", 0.0)
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


def _split(mismatch: dict[str, Any], policy: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    """Per step, the engine's and the policy lag's k3."""
    rows = []
    for row in mismatch.get("by_step", []):
        step, engine = row["step"], row.get("k3")
        sums = policy.get(int(step))
        lag = total = share = None
        if sums is not None and sums[0] > 0:
            lag, total = float(sums[1] / sums[0]), float(sums[2] / sums[0])
            share = lag / (lag + engine) if engine is not None and lag + engine > 0 else None
        rows.append(
            {
                "step": step,
                "engine_k3": engine,
                "lag_k3": lag,
                "total_k3": total,
                "lag_share": share,
            }
        )
    return rows


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


def _drift(mismatch: dict[str, Any], by_step: list[dict[str, Any]]) -> list[Finding]:
    if not any(f["code"] == "drift" for f in mismatch.get("flags", [])):
        return []
    k3 = [r["engine_k3"] for r in by_step]
    growth = mismatch.get("k3_growth")
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


def _numerics(mismatch: dict[str, Any]) -> list[Finding]:
    if flags_of(mismatch, "semantics_bug"):
        return []  # a bug's own signature also sits on the unlikely tokens
    k3_share, token_share, table = _k3_share(mismatch)
    if not k3_share > LOW_PROB_SHARE:
        return []
    tail = mismatch.get("abs_diff_quantiles", {}).get("p99.9")
    largest = mismatch.get("abs_diff_max")
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
