"""Mismatch diagnostics of a dump: how far apart the rollout and trainer log-probs are.

`MismatchStats` is a streaming accumulator (`update` per chunk, `merge`, `compute`). Token-level
quantities are summed per sequence as chunks arrive, so every overall, per-step and
per-length statistic is computed at the end from per-sequence sums: a dump read in chunks gives
exactly the numbers of the dump read whole.

All statistics are over loss tokens (loss_mask true), with d = train_logprob - rollout_logprob,
S = sum of d over a sequence's loss tokens, T their count and G = S / T. `METRIC_NAMES` says
what each framework calls each number, so the values can be matched with W&B charts.

With a noise floor (`floor_logprob`, the trainer's log-prob from a second recompute), the same
k3 and mean |.| of f = train_logprob - floor_logprob, the trainer against itself, and the
rollout mismatch as a multiple of it (`floor_scalars`, docs/compare.md#the-noise-floor).

>>> import iscore                                           # doctest: +SKIP
>>> stats = MismatchStats(); stats.update(iscore.load("data/fp8.parquet"))  # doctest: +SKIP
>>> stats.compute().k3                                      # doctest: +SKIP
0.0498
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import TokenBatch, kernels, ops
from iscore.stats import noise
from iscore.stats.buckets import (
    BUCKET_FIELDS,
    PROB_EDGES,
    bucket_rows,
    bucket_sums,
    position_sums,
    prob_bucket,
    prob_thresholds,
)
from iscore.stats.distribution import DistributionStats, distribution_scalars
from iscore.stats.histogram import (
    BINS_PER_DECADE,
    LOG10_RANGE,
    Histogram2D,
    LogHistogram,
    bin_chosen,
    bucket_label,
    checked,
    from_keyed_state,
    keyed_state,
    plot_resolution,
)
from iscore.stats.metadata import MetadataStats, MetadataSummary
from iscore.stats.noise import (
    Noise,
    outside,
    outside_by_step,
    outside_parts,
    segment_medians,
    step_noise,
)
from iscore.stats.signatures import SignatureStats, SignatureSummary
from iscore.stats.token_terms import compiled_token_sums, keep_where, seq_max, token_sums
from iscore.stats.worst import TOP_K, worst_sequences, worst_tokens
from iscore.utils import from_ipc, to_ipc

Z90 = 1.2815515655446004
"""The standard normal's 90% quantile: p10/p90 of a normal are mean -+ Z90 * sd."""


# Per-sequence sums collected from each chunk; every statistic is computed from these.
_SEQ_FIELDS = (
    "T",
    "length",
    "S",
    "abs",
    "d2",
    "k3",
    "k3r",
    "chi",
    "mult",
    "js",
    "rho",
    "rho2",
    "train",
    "rollout",
    "max_abs",
    "median",
    "positive",
    "negative",
    "far",
)

RETENTION_BANDS = {"strict": (0.999, 1.002), "1pct": (0.99, 1.01), "5pct": (0.95, 1.05)}
"""MaxText's parity bands on the ratio e^d, limits included: the strict MLPerf band, the
standard RL band (+-1%) and the wide band (+-5%), with the share of loss tokens, and of
sequences by their geometric-mean ratio, inside each ("retention";
[maxtext#5231](https://github.com/AI-Hypercomputer/maxtext/pull/5231))."""

# Per-sequence sums of the noise floor's f = train - floor over the loss tokens, where the
# dump has a floor: k3 and |f|, in this order (`MismatchStats.floor`).
_FLOOR_FIELDS = ("floor_k3", "floor_abs")


@dataclass(slots=True)
class MismatchStats:
    """Streaming accumulator of the mismatch diagnostics of a dump.

    >>> stats = MismatchStats()
    >>> for chunk in dump.batches(): stats.update(chunk)  # doctest: +SKIP
    >>> result = stats.compute()                           # doctest: +SKIP
    """

    seq: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in _SEQ_FIELDS})
    steps: list[np.ndarray] = field(default_factory=list)
    seq_ids: list[pa.Array] = field(default_factory=list)
    by_prob: np.ndarray = field(
        default_factory=lambda: np.zeros((len(PROB_EDGES) - 1, len(BUCKET_FIELDS)))
    )
    by_pos: np.ndarray = field(default_factory=lambda: np.zeros((32, len(BUCKET_FIELDS))))
    # |d| of the loss tokens with d < 0: with `abs_hist` (all of them), the histogram of signed
    # d; the d > 0 side is the difference (`_signed_hist`).
    neg_hist: LogHistogram = field(default_factory=LogHistogram)
    joint: Histogram2D = field(default_factory=lambda: Histogram2D(-20.0, 0.0, 80))
    regression: np.ndarray = field(default_factory=lambda: np.zeros(6))  # n, x, x2, y, y2, xy
    signs: np.ndarray = field(default_factory=lambda: np.zeros(3, dtype=np.int64))  # <0, 0, >0
    worst_tokens: list[dict[str, Any]] = field(default_factory=list)
    # Per step: the |d| histogram of its loss tokens (together, `abs_hist`), and the noise of
    # each chunk's share of them (`Noise`: step, centre, spread, tokens), which the step's own
    # noise combines.
    step_hists: dict[int, LogHistogram] = field(default_factory=dict)
    noise: list[tuple[int, Noise]] = field(default_factory=list)
    # float64 [2, B] per chunk, `_FLOOR_FIELDS`; None for a dump without a floor.
    floor: list[np.ndarray] | None = None
    # float64 [bands, B] per chunk: the loss tokens with e^d inside each `RETENTION_BANDS`.
    retained: list[np.ndarray] = field(default_factory=list)
    # The top-k columns' statistics; None for a dump without them.
    distribution: DistributionStats | None = None
    # The metadata columns' values and the token-id comparison (`iscore.stats.metadata`).
    metadata: MetadataStats = field(default_factory=MetadataStats)
    # The bug signatures' sums (`iscore.stats.signatures`).
    signatures: SignatureStats = field(default_factory=SignatureStats)

    @property
    def abs_hist(self) -> LogHistogram:
        """The |d| histogram of every loss token: the sum of the steps' (a token is counted
        in its step's alone)."""
        total = LogHistogram()
        for hist in self.step_hists.values():
            total.merge(hist)
        return total

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences."""
        m = batch.loss_mask
        every = ops.mask_is_all(batch, m)
        d = ops.log_ratio(batch)
        n = batch.num_tokens

        def buf(name: str, dtype: torch.dtype = torch.float64) -> torch.Tensor:
            return ops.scratch(f"mismatch.{name}", n, dtype, d.device)

        masked_out = None if every else torch.logical_not(m, out=buf("masked_out", torch.bool))
        dm = d if every else keep_where(m, d, 0.0, buf("dm"))

        absd = torch.abs(dm, out=buf("abs"))
        max_abs = seq_max(absd, batch)
        huge = max_abs.size > 0 and not max_abs.max() <= 700.0  # NaN counts as huge
        # Three transcendental passes: e^d, expm1(d) and the log1p of js; e^2d, e^|d| and
        # expm1(-d) follow from them (to a few ulps).
        rho = ops.exp(dm, bound=None)  # e^d: shared with the settings that use it
        em1 = torch.special.expm1(dm, out=buf("em1"))
        # Loss tokens on either side of 0 (dm is 0 outside the loss): the sign test of
        # `noise.outside`, and the sign balance of the `constant_offset` flag.
        below = ops.compare("lt", dm, 0.0, buf("below", torch.bool))
        logprobs = {"train": batch.train, "rollout": batch.rollout}
        if not every:
            for name, values in logprobs.items():
                logprobs[name] = keep_where(m, values, 0.0, buf(name, torch.float32))
        rl = logprobs["rollout"]
        found = None if huge else compiled_token_sums(batch, dm, rho, em1, rl, max_abs, buf)
        if found is None:
            found = token_sums(batch, dm, absd, rho, em1, rl, below, max_abs, masked_out, buf)
        sums, k3 = found
        # Without float64 copies: float32 sums, in float64, are the same either way.
        sums |= ops.segment_sums_on_host(batch, logprobs)
        sums["T"] = (
            batch.lengths.cpu().numpy().astype(np.float64)
            if every
            else ops.segment_sums_on_host(batch, {"T": m})["T"]
        )
        max_abs[sums["T"] == 0] = -np.inf  # no loss token: as segment_max gives
        loss_d = (d if every else d[m]).cpu().numpy()
        loss_T = sums["T"].astype(np.int64)
        sums["median"] = segment_medians(loss_d, loss_T)
        # Each step's noise, |d| histogram and the deviations of its tokens from the noise
        # of their probability bin (`noise.outside`'s spread test).
        # The tokens with d < 0 go to `neg_hist` too: the same |d| binned once.
        loss_abs, loss_below = (absd, below) if every else (absd[m], below[m])
        loss_rollout = (batch.rollout if every else batch.rollout[m]).cpu().numpy()
        steps = batch.step.cpu().numpy()
        noises, sums["far"] = step_noise(loss_d, loss_rollout, loss_T, steps)
        for (step, _, tokens), (_, part) in zip(
            noise.step_groups(steps, loss_T), noises, strict=True
        ):
            if not part.tokens:
                continue  # a step without loss tokens
            where = tokens if isinstance(tokens, slice) else torch.from_numpy(tokens)
            self._add_abs(
                self.step_hists.setdefault(step, LogHistogram()), loss_abs[where], loss_below[where]
            )
            self.noise.append((step, part))
        for name in _SEQ_FIELDS:
            if name == "length":
                self.seq[name].append(batch.lengths.cpu().numpy().astype(np.float64))
            elif name == "max_abs":
                self.seq[name].append(max_abs)
            else:
                self.seq[name].append(sums[name])
        self._add_floor(batch, None if every else m, buf)
        self._add_distribution(batch)
        self.metadata.update(batch)
        self.signatures.update(batch)
        self.retained.append(_retained(batch, rho, None if every else m, buf))
        self.steps.append(batch.step.cpu().numpy())
        self.seq_ids.append(batch.seq_id)

        # Per-token tables: tokens outside the loss mask go to an extra last bucket.
        fields = (None, absd, k3, dm)
        size = self.by_prob.shape[0]
        by_prob = None
        if batch.device.type == "cpu":
            out = None if masked_out is None else masked_out.numpy()
            values = [f.numpy() for f in fields[1:]]
            by_prob = kernels.bucket_sums(
                batch.rollout.numpy(), prob_thresholds(), out, values, size
            )
        if by_prob is None:
            prob, counts = prob_bucket(batch.rollout, masked_out, buf)
            by_prob = bucket_sums(prob, fields if counts is None else fields[1:], size, counts)
        self.by_prob += by_prob
        self.by_pos += position_sums(batch, masked_out, fields, self.by_pos.shape[0])

        loss = int(sums["T"].sum())
        self.joint.update(
            batch.rollout if every else batch.rollout[m], batch.train if every else batch.train[m]
        )
        # Sums of per-sequence sums, as for every other statistic: the same on any number
        # of threads (a parallel dot product's is not).
        terms = ("rollout", "rollout2", "S", "d2", "rollout_d")  # x, x2, y, y2, xy
        self.regression += np.array([loss, *(sums[k].sum() for k in terms)], dtype=np.float64)
        negative, positive = int(sums["negative"].sum()), int(sums["positive"].sum())
        self.signs += np.array([negative, loss - negative - positive, positive])
        self._keep_worst_tokens(batch, d, absd, max_abs)

    def _add_floor(self, batch: TokenBatch, m: torch.Tensor | None, buf: Any) -> None:
        """Sum the floor's k3 and |f| per sequence, f = train - floor over the loss tokens
        (`m`; None: every token), where the batch has a floor."""
        self._expect_floor(batch.floor is not None)
        if batch.floor is None:
            return
        f = batch.train.to(torch.float64, copy=True).sub_(batch.floor)
        if m is not None:
            f = keep_where(m, f, 0.0, buf("floor"))
        k3 = torch.special.expm1(f, out=buf("floor_k3")).sub_(f)
        sums = ops.segment_sums_on_host(batch, {"k3": k3, "abs": torch.abs(f, out=f)})
        self.floor.append(np.stack([sums["k3"], sums["abs"]]))

    def _expect_floor(self, has: bool) -> None:
        """Start the floor's sums with the first sequences that have one; refuse to mix
        sequences with and without one (a dump's files all have the column or none does)."""
        if self.floor is None and has and not self.steps:
            self.floor = []
        elif (self.floor is not None) != has and (self.steps or self.floor):
            raise ValueError("some sequences have a noise floor (floor_logprob) and others not")

    def _add_distribution(self, batch: TokenBatch) -> None:
        """The top-k columns' statistics, where the batch has them."""
        has = batch.topk_ids is not None
        if self.distribution is None and has and not self.steps:
            self.distribution = DistributionStats()
        elif (self.distribution is not None) != has and self.steps:
            raise ValueError("some sequences have top-k log-probs and others not")
        if has:
            self.distribution.update(batch)

    def _add_abs(self, hist: LogHistogram, absd: torch.Tensor, below: torch.Tensor) -> None:
        """Count a step's |d| in its `hist`, and those where d < 0 (`below`) in `neg_hist`."""
        binned = bin_chosen(absd, below)
        if binned is None:
            hist.update(absd)
            self.neg_hist.update(absd[below])
            return
        hist.add(binned[0])
        if binned[1] is not None:
            self.neg_hist.add(binned[1])

    def _keep_worst_tokens(
        self, batch: TokenBatch, d: torch.Tensor, absd: torch.Tensor, max_abs: np.ndarray
    ) -> None:
        """Keep the TOP_K loss tokens of largest |d| of these and the chunk's."""
        self.worst_tokens += worst_tokens(batch, d, absd, max_abs)
        self.worst_tokens.sort(key=lambda row: -abs(row["d"]))
        del self.worst_tokens[TOP_K:]

    def merge(self, other: MismatchStats) -> None:
        """Add another accumulator's chunks after these (order is kept)."""
        self.retained.extend(other.retained)
        self.metadata.merge(other.metadata)
        self.signatures.merge(other.signatures)
        if other.steps and other.distribution is not None:
            if self.distribution is None and not self.steps:
                self.distribution = DistributionStats()
            if self.distribution is None:
                raise ValueError("some sequences have top-k log-probs and others not")
            self.distribution.merge(other.distribution)
        elif other.steps and self.distribution is not None:
            raise ValueError("some sequences have top-k log-probs and others not")
        if other.steps:
            self._expect_floor(other.floor is not None)
            if other.floor is not None:
                self.floor.extend(other.floor)
        for name in _SEQ_FIELDS:
            self.seq[name].extend(other.seq[name])
        self.steps.extend(other.steps)
        self.seq_ids.extend(other.seq_ids)
        self.by_prob += other.by_prob
        self.by_pos += other.by_pos
        self.neg_hist.merge(other.neg_hist)
        self.joint.merge(other.joint)
        self.regression += other.regression
        self.signs += other.signs
        self.worst_tokens = sorted(
            self.worst_tokens + other.worst_tokens, key=lambda row: -abs(row["d"])
        )[:TOP_K]
        for step, hist in other.step_hists.items():
            self.step_hists.setdefault(step, LogHistogram()).merge(hist)
        self.noise.extend(other.noise)

    def state(self) -> dict[str, np.ndarray]:
        """Everything it holds as a few plain numpy arrays (ids as Arrow IPC bytes), for
        `from_state`: what a results store keeps of a chunk. `seq` is float64 [fields, B],
        the per-sequence sums in the order of `_SEQ_FIELDS`.

        >>> stats = MismatchStats(); stats.update(iscore.load("data/fp8.parquet"))  # doctest: +SKIP
        >>> MismatchStats.from_state(stats.state()).compute() == stats.compute()  # doctest: +SKIP
        True
        """
        s = self.sequences()
        out = {
            "seq": np.stack([s[k] for k in _SEQ_FIELDS]).reshape(len(_SEQ_FIELDS), -1),
            "step": s["step"].astype(np.int64),
            "seq_id": to_ipc(s["seq_id"]),
            "by_prob": self.by_prob,
            "by_pos": self.by_pos,
            "regression": self.regression,
            "signs": self.signs.astype(np.int64),
        }
        for name in ("neg_hist", "joint"):
            out |= {f"{name}.{k}": v for k, v in getattr(self, name).state().items()}
        worst = self.worst_tokens
        out["worst.index"] = np.array([[w["step"], w["pos"]] for w in worst], np.int64).reshape(
            -1, 2
        )
        out["worst.seq_id"] = to_ipc(pa.array([w["seq_id"] for w in worst]))
        out["worst.values"] = np.array(
            [[w["rollout_logprob"], w["train_logprob"], w["d"]] for w in worst], np.float64
        ).reshape(-1, 3)
        out["noise"] = np.array(
            [[step, n.center, n.spread, n.tokens] for step, n in self.noise], np.float64
        ).reshape(-1, 4)
        out |= {f"step_hist.{k}": v for k, v in keyed_state(self.step_hists).items()}
        if self.floor is not None:
            out["floor"] = np.stack([s[k] for k in _FLOOR_FIELDS]).reshape(len(_FLOOR_FIELDS), -1)
        out["retained"] = self._retained_columns()
        if self.distribution is not None:
            out |= {f"dist.{k}": v for k, v in self.distribution.state().items()}
        out |= {f"meta.{k}": v for k, v in self.metadata.state().items()}
        out |= {f"sig.{k}": v for k, v in self.signatures.state().items()}
        return out

    def _retained_columns(self) -> np.ndarray:
        """float64 [bands, B]: each sequence's loss tokens inside each retention band."""
        if not self.retained:
            return np.zeros((len(RETENTION_BANDS), 0))
        return np.concatenate(self.retained, axis=1)

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray]) -> MismatchStats:
        """The accumulator `state` describes (see `state`).

        Raises:
            ValueError: `state` is not one `state()` wrote: an array missing, of another
                type or length, or ids that do not decode.
        """
        stats = cls(neg_hist=LogHistogram.from_state(_prefixed(state, "neg_hist")))
        steps = checked(state, "step", "i", (-1,))
        b = steps.size
        seq = checked(state, "seq", "f", (len(_SEQ_FIELDS), b)).astype(np.float64)
        stats.seq = {name: [seq[i]] for i, name in enumerate(_SEQ_FIELDS)}
        stats.steps = [steps.astype(np.int64)]
        seq_id = from_ipc(checked(state, "seq_id", "u", (-1,)))
        if len(seq_id) != b:
            raise ValueError(f"seq_id: expected {b} ids, found {len(seq_id)}")
        stats.seq_ids = [seq_id]
        stats.by_prob = checked(state, "by_prob", "f", stats.by_prob.shape).astype(np.float64)
        stats.by_pos = checked(state, "by_pos", "f", stats.by_pos.shape).astype(np.float64)
        stats.regression = checked(state, "regression", "f", (6,)).astype(np.float64)
        stats.signs = checked(state, "signs", "i", (3,)).astype(np.int64)
        stats.joint.load_state(_prefixed(state, "joint"))
        index = checked(state, "worst.index", "i", (-1, 2))
        values = checked(state, "worst.values", "f", (index.shape[0], 3))
        ids = from_ipc(checked(state, "worst.seq_id", "u", (-1,))).to_pylist()
        if len(ids) != index.shape[0] or index.shape[0] > TOP_K:
            raise ValueError("worst tokens: their columns differ in length")
        stats.worst_tokens = [
            {
                "step": int(step),
                "seq_id": sid,
                "pos": int(pos),
                "rollout_logprob": float(r),
                "train_logprob": float(t),
                "d": float(d),
            }
            for (step, pos), sid, (r, t, d) in zip(
                index.tolist(), ids, values.tolist(), strict=True
            )
        ]
        stats.noise = [
            (int(step), Noise(center, spread, int(n)))
            for step, center, spread, n in checked(state, "noise", "f", (-1, 4)).tolist()
        ]
        stats.step_hists = from_keyed_state(_prefixed(state, "step_hist"))
        if "floor" in state:
            floor = checked(state, "floor", "f", (len(_FLOOR_FIELDS), b)).astype(np.float64)
            stats.floor = [floor]
        stats.retained = [checked(state, "retained", "f", (len(RETENTION_BANDS), b))]
        if "dist.seq" in state:
            stats.distribution = DistributionStats.from_state(_prefixed(state, "dist"), b)
        stats.metadata = MetadataStats.from_state(_prefixed(state, "meta"), b)
        stats.signatures = SignatureStats.from_state(_prefixed(state, "sig"))
        return stats

    def sequences(self) -> dict[str, np.ndarray]:
        """The per-sequence sums, one array per field, plus `step` and `seq_id`."""
        out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.seq.items()}
        if self.floor is not None:
            floor = np.concatenate(self.floor, axis=1) if self.floor else np.zeros((2, 0))
            out |= dict(zip(_FLOOR_FIELDS, floor, strict=True))
        retained = self._retained_columns()
        out |= {
            f"retained_{band}": row for band, row in zip(RETENTION_BANDS, retained, strict=True)
        }
        if self.distribution is not None:
            out |= self.distribution.sequences()
        out["step"] = np.concatenate(self.steps) if self.steps else np.zeros(0, np.int64)
        out["seq_id"] = pa.concat_arrays(self.seq_ids) if self.seq_ids else pa.array([])
        return out

    def broken(self, sequences: dict[str, np.ndarray] | None = None) -> np.ndarray:
        """bool [B], in the order sequences were added: those outside their step's noise
        (`iscore.stats.noise.outside`, as `by_step` counts them)."""
        s = sequences if sequences is not None else self.sequences()
        return outside_parts(
            s["median"], s["T"], s["positive"], s["negative"], s["far"], s["step"], self.noise
        )

    @np.errstate(over="ignore")  # a finite but extreme d: e^d is inf, written as null
    def compute(
        self, sequences: dict[str, np.ndarray] | None = None, broken: np.ndarray | None = None
    ) -> MismatchSummary:
        """Every statistic: overall, `by_step`, `by_length`, `by_prob`, `by_pos`, the worst
        sequences and tokens, the 2-D histogram and the broken sequences; from `sequences()`
        and `broken()` when at hand."""
        s = sequences if sequences is not None else self.sequences()
        numbers = {k: v for k, v in s.items() if k != "seq_id"}
        numbers["broken"] = (broken if broken is not None else self.broken(s)).astype(np.float64)
        scalars = mismatch_scalars(numbers)
        floor = floor_scalars(numbers)
        by_step = self.by_step(numbers)
        every = self.abs_hist
        levels = (0.5, 0.9, 0.99, 0.999)
        per_decade = plot_resolution(every)
        return MismatchSummary(
            **scalars,
            by_step=by_step,
            by_length=self._by_length(numbers, scalars),
            by_prob=bucket_rows(
                self.by_prob, [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(PROB_EDGES)]
            ),
            # Position bucket b holds pos + 1 in [2^b, 2^(b+1)).
            by_pos=bucket_rows(self.by_pos, [f"{2**b - 1}-{2 ** (b + 1) - 2}" for b in range(32)]),
            abs_diff_quantiles={
                f"p{q * 100:g}": v for q, v in zip(levels, every.quantiles(levels), strict=True)
            },
            abs_diff_hist=every.coarse(per_decade),
            signed_diff_hist=_signed_hist(every, self.neg_hist, per_decade),
            joint_hist={
                "edges": self.joint.edges().tolist(),
                "counts": self.joint.counts.tolist(),
                "x": "rollout_logprob",
                "y": "train_logprob",
            },
            worst_sequences=worst_sequences(s),
            worst_tokens=list(self.worst_tokens),
            **_relations(scalars, by_step, self.regression, self.signs),
            floor={k.removeprefix("floor_"): v for k, v in floor.items()} if floor else None,
            retention=retention(numbers),
            distribution=None if self.distribution is None else self.distribution.compute(numbers),
            metadata=self.metadata.compute(s | {"broken": numbers["broken"]}),
            signatures=self.signatures.compute(),
        )

    def by_step(
        self, sequences: dict[str, np.ndarray] | None = None, steps: Collection[int] | None = None
    ) -> list[dict[str, Any]]:
        """The per-step rows of `compute()["by_step"]`, of `steps` only where given (what a
        followed run recomputes as its steps grow), from `sequences()` when at hand."""
        s = sequences if sequences is not None else self.sequences()
        chosen = None if steps is None else np.isin(s["step"], np.fromiter(steps, np.int64))
        noise: dict[int, list[Noise]] = {}
        for step, part in self.noise:
            noise.setdefault(step, []).append(part)
        numbers = {k: v for k, v in s.items() if k != "seq_id"}
        return [
            {
                "step": int(step),
                **mismatch_scalars(group),
                **_step_noise(group, self.step_hists.get(int(step)), noise.get(int(step))),
                **floor_scalars(group),
                **distribution_step(group),
            }
            for step, group in ops.groups(numbers, s["step"], chosen)
        ]

    @staticmethod
    def _by_length(s: dict[str, np.ndarray], overall: dict[str, Any]) -> list[dict[str, Any]]:
        """Per log2 bucket of T: the measured sequence ratios beside the independent-token
        expectation S ~ N(mu T, var T) at the dump's per-token mean and variance of d."""
        rows = []
        if not overall["tokens"]:
            return rows  # no token in the loss: no mean or variance of d to compare with
        mu, var = overall["d_mean"], overall["d_var"]
        buckets = np.floor(np.log2(np.maximum(s["T"], 1))).astype(int)
        for b, group in ops.groups(s, buckets, s["T"] > 0):
            T, S = group["T"], group["S"]
            t_mid = ops.median(T)
            sd = math.sqrt(var * t_mid) if var > 0 else 0.0
            seq_p10, seq_p90 = ops.quantiles(S, (0.1, 0.9))
            geo_p10, geo_p90 = ops.quantiles(S / T, (0.1, 0.9))
            rows.append(
                {
                    "bucket": bucket_label(int(b)),
                    "length_lo": 2 ** int(b),
                    "length_hi": 2 ** (int(b) + 1) - 1,
                    "length_median": t_mid,
                    "sequences": int(T.size),
                    "tokens": int(T.sum()),
                    "abs_diff_mean": float(group["abs"].sum() / T.sum()),
                    "k3": float(group["k3"].sum() / T.sum()),
                    "seq_ratio_median": float(np.exp(ops.median(S))),
                    "seq_ratio_p10": float(np.exp(seq_p10)),
                    "seq_ratio_p90": float(np.exp(seq_p90)),
                    "geo_ratio_p10": float(np.exp(geo_p10)),
                    "geo_ratio_p90": float(np.exp(geo_p90)),
                    "expected_seq_ratio_median": ops.exp_of(mu * t_mid),
                    "expected_seq_ratio_p10": ops.exp_of(mu * t_mid - Z90 * sd),
                    "expected_seq_ratio_p90": ops.exp_of(mu * t_mid + Z90 * sd),
                    "expected_geo_ratio_p10": ops.exp_of(mu - Z90 * sd / t_mid),
                    "expected_geo_ratio_p90": ops.exp_of(mu + Z90 * sd / t_mid),
                    "expected_ess_fraction": ops.exp_of(-var * t_mid),
                }
            )
        return rows


_SCALARS = (
    "broken_sequences", "k1", "k2", "k3", "k3_reverse", "chi2_token", "chi2_seq",
    "abs_diff_mean", "abs_diff_max", "token_mult_prob_error", "js", "log_ppl_diff",
    "log_ppl_abs_diff", "log_ppl_diff_max", "log_ppl_diff_min", "ppl_ratio", "training_ppl",
    "rollout_ppl", "ratio_mean", "ratio_mean_stderr", "ess", "d_mean", "d_var",
)  # fmt: skip
"""The overall statistics a dump has only with loss tokens, in the document's order."""

_TABLES = (
    "by_step", "by_length", "by_prob", "by_pos", "abs_diff_quantiles", "abs_diff_hist",
    "signed_diff_hist", "joint_hist", "worst_sequences", "worst_tokens",
)  # fmt: skip

_RELATIONS = ("d_rollout_correlation", "d_rollout_slope", "d_sign_fraction", "k3_growth")
"""How d relates to the rollout log-prob and to 0, and k3's growth, with loss tokens only."""

_NAN = math.nan


@dataclass(frozen=True, slots=True)
class MismatchSummary:
    """The mismatch diagnostics of a dump (`MismatchStats.compute`), every field defined in
    docs/analysis.md#mismatch: the loss tokens and sequences, the overall statistics (NaN
    without a loss token, where the document leaves them out), the tables (`by_step`,
    `by_length`, `by_prob`, `by_pos`: one dict per row), |d|'s quantiles and histograms, the
    2-D histogram of the two log-probs, the worst sequences and tokens, and how d relates to
    the rollout log-prob and to 0.
    """

    tokens: int
    sequences: int
    by_step: list[dict[str, Any]]
    by_length: list[dict[str, Any]]
    by_prob: list[dict[str, Any]]
    by_pos: list[dict[str, Any]]
    abs_diff_quantiles: dict[str, float]
    abs_diff_hist: dict[str, Any]
    signed_diff_hist: dict[str, Any]
    joint_hist: dict[str, Any]
    worst_sequences: list[dict[str, Any]]
    worst_tokens: list[dict[str, Any]]
    broken_sequences: int = 0
    k1: float = _NAN
    k2: float = _NAN
    k3: float = _NAN
    k3_reverse: float = _NAN
    chi2_token: float = _NAN
    chi2_seq: float = _NAN
    abs_diff_mean: float = _NAN
    abs_diff_max: float = _NAN
    token_mult_prob_error: float = _NAN
    js: float = _NAN
    log_ppl_diff: float = _NAN
    log_ppl_abs_diff: float = _NAN
    log_ppl_diff_max: float = _NAN
    log_ppl_diff_min: float = _NAN
    ppl_ratio: float = _NAN
    training_ppl: float = _NAN
    rollout_ppl: float = _NAN
    ratio_mean: float = _NAN
    ratio_mean_stderr: float = _NAN
    ess: float = _NAN
    d_mean: float = _NAN
    d_var: float = _NAN
    d_rollout_correlation: float = _NAN
    d_rollout_slope: float = _NAN
    d_sign_fraction: float = _NAN
    k3_growth: float | None = None
    floor: dict[str, float | None] | None = None
    retention: dict[str, Any] | None = None
    distribution: dict[str, Any] | None = None
    metadata: MetadataSummary | None = None
    # What the bug signatures are judged on (`iscore.advice.signatures`); not in the document.
    signatures: SignatureSummary | None = None

    @property
    def has_floor(self) -> bool:
        """Whether the dump has a noise floor with loss tokens (`floor_scalars`)."""
        return self.floor is not None

    def to_dict(self) -> dict[str, Any]:
        """The document's `mismatch` (without the flags and the catalogue the analysis adds
        beside it), in its order; without a loss token, only the counts and the tables."""
        counts = {"tokens": self.tokens, "sequences": self.sequences}
        scalars = {name: getattr(self, name) for name in _SCALARS} if self.tokens else {}
        tables = {name: getattr(self, name) for name in _TABLES}
        relations = {name: getattr(self, name) for name in _RELATIONS} if self.tokens else {}
        floor = {"floor": self.floor} if self.floor is not None else {}
        kept = {"retention": self.retention} if self.tokens and self.retention else {}
        dist = {"distribution": self.distribution} if self.distribution is not None else {}
        meta = {} if self.metadata is None else self.metadata.to_dict()
        return counts | scalars | tables | relations | floor | kept | dist | meta

    def value(self, statistic: str) -> float | None:
        """The overall statistic named `statistic` (a key of `iscore.stats.catalogue
        .DEFINITIONS`), None without a loss token or where the dump has no such statistic."""
        if not self.tokens or statistic not in _SCALARS:
            return None
        return getattr(self, statistic)


def mismatch_scalars(s: dict[str, np.ndarray]) -> dict[str, Any]:
    """The scalar statistics over the sequences of `s` (one array per field, a value each)."""
    n = float(s["T"].sum())
    has = s["T"] > 0
    if n == 0:
        return {"tokens": 0, "sequences": 0}

    def tok(name: str) -> float:
        return float(s[name].sum() / n)

    T = s["T"][has]
    G = s["S"][has] / T
    d_mean = tok("S")
    d_var = max(tok("d2") - d_mean * d_mean, 0.0)
    return {
        "tokens": int(n),
        "sequences": int(has.sum()),
        "broken_sequences": int(s["broken"].sum()) if "broken" in s else 0,
        "k1": -d_mean,
        "k2": 0.5 * tok("d2"),
        "k3": tok("k3"),
        "k3_reverse": tok("k3r"),
        "chi2_token": tok("chi") - 1.0,
        "chi2_seq": float(np.mean(np.exp(2.0 * np.clip(s["S"][has], -20.0, 20.0)))) - 1.0,
        "abs_diff_mean": tok("abs"),
        "abs_diff_max": float(s["max_abs"][has].max()),
        "token_mult_prob_error": tok("mult"),
        "js": tok("js"),
        "log_ppl_diff": float(np.mean(-G)),
        "log_ppl_abs_diff": float(np.mean(np.abs(G))),
        "log_ppl_diff_max": float(np.max(-G)),
        "log_ppl_diff_min": float(np.min(-G)),
        "ppl_ratio": float(np.mean(np.exp(-G))),
        "training_ppl": float(np.mean(np.exp(-s["train"][has] / T))),
        "rollout_ppl": float(np.mean(np.exp(-s["rollout"][has] / T))),
        "ratio_mean": tok("rho"),
        "ratio_mean_stderr": math.sqrt(max(tok("rho2") - tok("rho") ** 2, 0.0) / n),
        "ess": tok("rho") ** 2 / tok("rho2") if tok("rho2") > 0 else 0.0,
        "d_mean": d_mean,
        "d_var": d_var,
    }


def retention(s: dict[str, np.ndarray]) -> dict[str, Any] | None:
    """The share of the loss tokens of `s`, and of its sequences with loss tokens by their
    geometric-mean ratio e^(S/T), whose ratio lies inside each `RETENTION_BANDS` band; None
    without a loss token.

    >>> s = {"T": np.array([2.0, 2.0]), "S": np.array([0.0, 1.0]),
    ...      "retained_strict": np.array([2.0, 0.0]), "retained_1pct": np.array([2.0, 1.0]),
    ...      "retained_5pct": np.array([2.0, 1.0])}
    >>> retention(s)["token"], retention(s)["sequence"]["strict"]
    ({'strict': 0.5, '1pct': 0.75, '5pct': 0.75}, 0.5)
    """
    n = float(s["T"].sum())
    if n == 0:
        return None
    has = s["T"] > 0
    geo = np.exp(s["S"][has] / s["T"][has])
    return {
        "bands": {band: list(limits) for band, limits in RETENTION_BANDS.items()},
        "token": {band: float(s[f"retained_{band}"].sum() / n) for band in RETENTION_BANDS},
        "sequence": {
            band: float(np.count_nonzero((geo >= lo) & (geo <= hi)) / geo.size)
            for band, (lo, hi) in RETENTION_BANDS.items()
        },
    }


def _retained(batch: TokenBatch, rho: torch.Tensor, m: torch.Tensor | None, buf: Any) -> np.ndarray:
    """float64 [bands, B]: each sequence's loss tokens (`m`; None: every token) whose ratio
    `rho` = e^d lies inside each `RETENTION_BANDS` band, limits included."""
    inside = {}
    for band, (lo, hi) in RETENTION_BANDS.items():
        token = ops.compare("ge", rho, lo, buf(f"retained_{band}", torch.bool))
        token &= ops.compare("le", rho, hi, buf("retained_hi", torch.bool))
        if m is not None:
            token &= m
        inside[band] = token
    sums = ops.segment_sums_on_host(batch, inside)
    return np.stack([sums[band] for band in RETENTION_BANDS])


def distribution_step(s: dict[str, np.ndarray]) -> dict[str, float]:
    """A `by_step` row's distribution statistics (flat: `kl_lower`, `kl_estimate`,
    `top1_agreement`, `rollout_topk_mass`, `train_topk_mass`), where the dump has top-k
    columns and the step loss tokens; {} otherwise."""
    found = distribution_scalars(s)
    if not found:
        return {}
    return {
        "kl_lower": found["kl"]["lower"],
        "kl_estimate": found["kl"]["estimate"],
        "top1_agreement": found["top1_agreement"],
        "rollout_topk_mass": found["rollout_topk_mass"],
        "train_topk_mass": found["train_topk_mass"],
    }


def floor_scalars(s: dict[str, np.ndarray]) -> dict[str, float | None]:
    """The noise floor over the sequences of `s`, where it has one and loss tokens: the k3
    and mean |f| of f = train - floor (`floor_k3`, `floor_abs_diff_mean`), and the rollout
    mismatch over them (`k3_ratio`, `abs_diff_ratio`; None where the floor is exactly 0, a
    recompute that repeats the trainer bit for bit); {} otherwise.

    >>> s = {"T": np.array([4.0]), "k3": np.array([0.04]), "abs": np.array([0.8]),
    ...      "floor_k3": np.array([0.0004]), "floor_abs": np.array([0.08])}
    >>> {k: round(v, 6) for k, v in floor_scalars(s).items()}
    {'floor_k3': 0.0001, 'floor_abs_diff_mean': 0.02, 'k3_ratio': 100.0, 'abs_diff_ratio': 10.0}
    """
    n = float(s["T"].sum())
    if "floor_k3" not in s or n == 0:
        return {}
    k3, absd = float(s["floor_k3"].sum() / n), float(s["floor_abs"].sum() / n)

    def over(value: float, floor: float) -> float | None:
        return value / floor if floor > 0 else None

    return {
        "floor_k3": k3,
        "floor_abs_diff_mean": absd,
        "k3_ratio": over(float(s["k3"].sum() / n), k3),
        "abs_diff_ratio": over(float(s["abs"].sum() / n), absd),
    }


def _relations(
    result: dict[str, Any],
    by_step: list[dict[str, Any]],
    regression: np.ndarray,
    signs: np.ndarray,
) -> dict[str, Any]:
    """How d relates to the rollout log-prob and to 0, and how k3 moved over the steps: the
    correlation and regression slope of d on the rollout log-prob (from the regression's
    sums), the share of the loss tokens on the more common side of 0, and the last step's k3
    over the first's (None with fewer than three steps, or no mismatch at the first)."""
    if not result.get("tokens"):
        return {}
    n, x, x2, y, y2, xy = regression
    cov = xy / n - (x / n) * (y / n)
    var_x, var_y = x2 / n - (x / n) ** 2, y2 / n - (y / n) ** 2
    negative, _, positive = signs.astype(float)
    # The steps with tokens in the loss (a step whose tokens are all masked has no k3).
    steps = [step for step in by_step if step.get("tokens")]
    growth = None
    if len(steps) >= 3 and steps[0].get("k3", 0) > 0:
        growth = steps[-1]["k3"] / steps[0]["k3"]
    return {
        "d_rollout_correlation": cov / math.sqrt(var_x * var_y) if var_x > 0 and var_y > 0 else 0.0,
        "d_rollout_slope": cov / var_x if var_x > 0 else 0.0,
        "d_sign_fraction": max(negative, positive) / max(negative + positive, 1.0),
        "k3_growth": growth,
    }


def _prefixed(state: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The entries of `state` under `prefix.`, without it."""
    start = prefix + "."
    return {k[len(start) :]: v for k, v in state.items() if k.startswith(start)}


TAIL_NATS = 1.0
"""`tail_share` counts the loss tokens with |d| at least this (a ratio beyond e^+-1)."""

_TAIL_BIN = round((math.log10(TAIL_NATS) - LOG10_RANGE[0]) * BINS_PER_DECADE)


def _step_noise(
    group: dict[str, np.ndarray], hist: LogHistogram | None, parts: list[Noise] | None
) -> dict[str, Any]:
    """A step's tail and noise: |d|'s p99 and the share of tokens with |d| >= TAIL_NATS; the
    centre and spread of d (`Noise.combine` of its chunks' noise: its files', one per rank);
    the sequences outside that noise (`noise.outside`, judged against the step's own noise, so
    that a mismatch growing over the steps is never taken for broken sequences); and over the
    others, k3 (what a rise is judged on, so that broken sequences are not taken for growth)
    and the mean ratio with its standard error (the offset test, `ratio_bias`)."""
    T = group["T"]
    if hist is None or parts is None or not T.sum():
        return {}
    noise = Noise.combine(parts)
    broken = outside(group["median"], T, group["positive"], group["negative"], group["far"], noise)
    n = float(T[~broken].sum())
    k3 = float(group["k3"][~broken].sum()) / n if n else math.nan
    ratio = float(group["rho"][~broken].sum()) / n if n else math.nan
    spread = float(group["rho2"][~broken].sum()) / n - ratio * ratio if n else math.nan
    binned = hist.total - hist.nan
    used, counts = hist.bins_used()
    return {
        "abs_diff_p99": hist.quantile(0.99),
        "tail_share": (int(counts[used >= _TAIL_BIN].sum()) + hist.overflow) / binned,
        "d_median": noise.center,
        "d_spread": noise.spread,
        "broken_sequences": int(broken.sum()),
        "healthy_k3": k3,
        "healthy_ratio_mean": ratio,
        "healthy_ratio_mean_stderr": math.sqrt(max(spread, 0.0) / n) if n else math.nan,
    }


def _signed_hist(every: LogHistogram, negative: LogHistogram, per_decade: int) -> dict[str, Any]:
    """The histogram of signed d over loss tokens, from that of |d| (`every`) and that of the
    |d| of the tokens with d < 0: both sides binned on |d| (`per_decade` bins per decade),
    trimmed to the bins either side uses; `zeros` counts d == 0 (NaN is on neither side)."""
    factor = BINS_PER_DECADE // per_decade
    edges = every.edges()[::factor]
    below = negative.counts.reshape(-1, factor).sum(axis=1)
    above = every.counts.reshape(-1, factor).sum(axis=1) - below
    used = np.flatnonzero(below + above)
    lo, hi = (int(used[0]), int(used[-1]) + 1) if used.size else (0, 0)
    return {
        "edges": edges[lo : hi + 1].tolist() if used.size else [],
        "negative": {
            "counts": below[lo:hi].tolist(),
            "underflow": negative.underflow,
            "overflow": negative.overflow,
        },
        "positive": {
            "counts": above[lo:hi].tolist(),
            "underflow": every.underflow - negative.underflow,
            "overflow": every.overflow - negative.overflow,
        },
        "zeros": every.zeros,
    }


def broken_sequences(batch: TokenBatch) -> np.ndarray:
    """bool [B]: the sequences of `batch` outside their own step's noise (`outside_by_step`
    on its loss tokens): what the mismatch flags, the settings' broken gradient kept and the
    recommendation call broken."""
    m = batch.loss_mask
    d = ops.log_ratio(batch).double()
    T = ops.segment_count(batch, m).double().cpu().numpy()
    positive, negative = (
        ops.segment_count(batch, m & side).double().cpu().numpy() for side in (d > 0, d < 0)
    )
    every = ops.mask_is_all(batch, m)
    loss = (d if every else d[m]).cpu().numpy()
    rollout = (batch.rollout if every else batch.rollout[m]).double().cpu().numpy()
    return outside_by_step(loss, rollout, T, positive, negative, batch.step.cpu().numpy())
