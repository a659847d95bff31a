"""What the attribution of the mismatch needs beyond the mismatch diagnostics, accumulated in
the same pass: per sequence its worst window's mean |d| over its step's (spans of large |d|,
`WINDOW` tokens), per step the policy lag's k3 (with `policy_logprob`), and the mismatch of
the tokens whose routing differs, or at a turn boundary, against the rest (`conditional`).
`iscore.advice.attribution` reads the findings from these numbers."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import TokenBatch, kernels, ops
from iscore.stats.histogram import checked
from iscore.stats.mismatch import MismatchSummary
from iscore.stats.noise import step_groups

WINDOW = 32
"""Tokens per window in the search for spans of large |d| (routing flips)."""

CLIP = 50.0
"""Each token's |d| counts at most this many times its step's mean |d| in a window: one
far-off token (an outlier the heavy tail reports) cannot make a span."""

SPAN_RATIO = 6.0
"""A sequence has a span of large |d| when its worst window's mean |d| is this many times its
step's mean (under bf16 or FP8-like noise alone, 1,024 simulated sequences stay below 5.2)."""


TURN_TOKENS = 4
"""The first this many loss tokens of each turn after a sequence's first are its boundary."""


_K3_CLAMP = 20.0
"""d is clamped to +-this many nats before its k3 is summed per group."""


@dataclass(slots=True)
class AttributionStats:
    """Streaming accumulator of what the findings need beyond `MismatchStats`, updated with
    the same parts (one step's sequences of a chunk): per sequence (in the order added, as
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
        self, mismatch: MismatchSummary, sequences: dict[str, Any], broken: np.ndarray
    ) -> AttributionNumbers:
        """The numbers the findings read, from the mismatch diagnostics of the same chunks
        (`MismatchStats.compute()`), its sequences (`MismatchStats.sequences()`: their steps
        and ids) and its broken sequences (`MismatchStats.broken()`), in the order added."""
        span = np.concatenate(self.span) if self.span else np.zeros(0)
        steps = np.asarray(sequences["step"], dtype=np.int64)
        ids = sequences["seq_id"]
        if span.size != steps.size:
            raise ValueError(f"expected {steps.size} sequences' spans, found {span.size}")
        by_step = _split(mismatch, self.policy)
        routing = conditional(_total(self.routing), "differ", "agree")
        turns = conditional(_total(self.turns), "boundary", "rest")
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
        return AttributionNumbers(span, steps, ids, broken, tuple(by_step), routing, turns)


@dataclass(frozen=True, slots=True)
class AttributionNumbers:
    """What `AttributionStats.compute` gives the findings.

    Attributes:
        span: float64 [B], each sequence's worst window's mean |d| over its step's mean
            (`_span_ratios`), in the order added; steps: int64 [B], their steps; ids: their
            `seq_id`s; broken: bool [B], those outside their step's noise.
        by_step: per step: `step`, `engine_k3` (k3 of d, rollout to trainer), `lag_k3` (k3
            of policy - train: the policy's lag) and `total_k3` (k3 of policy - rollout), null
            without `policy_logprob`; `lag_share` (lag / (lag + engine)); `span_sequences`
            (the healthy sequences with a window over `SPAN_RATIO`); `routing_differ_share`
            and `routing_k3_ratio`, `turn_boundary_share` and `turn_k3_ratio` (see
            `conditional`), null without the columns.
        routing: the mismatch conditional on routing agreement (`conditional`, groups
            `differ` and `agree`), None without `rollout_experts` and `train_experts`.
        turns: the mismatch at turn boundaries against the rest (`conditional`, groups
            `boundary` and `rest`), None without a `turn` column.
    """

    span: np.ndarray
    steps: np.ndarray
    ids: pa.Array
    broken: np.ndarray
    by_step: tuple[dict[str, Any], ...]
    routing: dict[str, Any] | None
    turns: dict[str, Any] | None


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


def _split(mismatch: MismatchSummary, policy: dict[int, np.ndarray]) -> list[dict[str, Any]]:
    """Per step, the engine's and the policy lag's k3."""
    rows = []
    for row in mismatch.by_step:
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
