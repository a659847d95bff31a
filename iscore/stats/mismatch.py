"""Mismatch diagnostics of a dump: how far apart the rollout and trainer log-probs are.

`MismatchStats` is a streaming accumulator (`update` per chunk, `merge`, `compute`). Token-level
quantities are summed per sequence as chunks arrive, so every overall, per-step and
per-length statistic is computed at the end from per-sequence sums: a dump read in chunks gives
exactly the numbers of the dump read whole.

All statistics are over loss tokens (loss_mask true), with d = train_logprob - rollout_logprob,
S = sum of d over a sequence's loss tokens, T their count and G = S / T. `METRIC_NAMES` says
what each framework calls each number, so the values can be matched with W&B charts.

>>> import iscore                                           # doctest: +SKIP
>>> stats = MismatchStats(); stats.update(iscore.load("data/fp8.parquet"))  # doctest: +SKIP
>>> stats.compute()["k3"]                                   # doctest: +SKIP
0.0498
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import torch

from iscore import frameworks
from iscore.packed import kernels, ops
from iscore.packed.batch import TokenBatch
from iscore.stats import noise
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
    log2_bucket,
    plot_resolution,
)
from iscore.stats.noise import (
    Band,
    Noise,
    first_rise,
    outside,
    outside_by_step,
    outside_parts,
    ratio_bias,
    segment_medians,
    step_noise,
)

PROB_EDGES = (0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 1.0)
"""Buckets of the rollout probability of the sampled token, exp(rollout_logprob)."""

TOP_K = 20
"""How many worst sequences and tokens are kept."""

Z90 = 1.2815515655446004
"""The standard normal's 90% quantile: p10/p90 of a normal are mean -+ Z90 * sd."""

_STATISTICS = (
    "k1", "k2", "k3", "k3_reverse", "chi2_token", "chi2_seq", "abs_diff_mean", "abs_diff_max",
    "token_mult_prob_error", "js", "log_ppl_diff", "log_ppl_abs_diff", "ppl_ratio",
    "training_ppl", "rollout_ppl", "ratio_mean", "ess",
)  # fmt: skip
_ELSEWHERE = {"k3": ("blogs: vllm-kl",)}  # names used outside the frameworks' own logs

METRIC_NAMES: dict[str, list[str]] = {
    statistic: [
        f"{fw.title} {name}" for fw in frameworks.every() for name in fw.metrics.get(statistic, ())
    ]
    + list(_ELSEWHERE.get(statistic, ()))
    for statistic in _STATISTICS
}
"""For each statistic, the names the frameworks log it under
(docs/corrections.md#mismatch-diagnostics).

Where a framework averages per sequence first (slime's mis_*), its value differs from the
token average iscore reports; the name says so.
"""

BANDS: dict[str, list[str]] = {
    statistic: [
        f"{fw.title} {band.logged_as}: {band.describe()}"
        for fw in frameworks.every()
        for band in fw.bands
        if band.statistic == statistic
    ]
    for statistic in _STATISTICS
}
"""For each statistic, the healthy ranges the frameworks' docs publish (`Framework.bands`, the
bands `iscore.advice.health` judges by), in words."""

DEFINITIONS: dict[str, str] = {
    "k1": "<-d>_tok: k1 estimate of KL(rollout || train); can be negative",
    "k2": "<d^2 / 2>_tok",
    "k3": "<e^d - 1 - d>_tok: unbiased, non-negative estimate of KL(rollout || train)",
    "k3_reverse": "<e^-d - 1 + d>_tok: k3 of KL(train || rollout); explodes where the trainer "
    "finds a token much less likely than the sampler",
    "chi2_token": "<e^(2 clamp(d, +-20))>_tok - 1",
    "chi2_seq": "<e^(2 clamp(S, +-20))>_seq - 1",
    "abs_diff_mean": "<|d|>_tok",
    "abs_diff_max": "max |d| over loss tokens",
    "token_mult_prob_error": "<e^|d|>_tok: 1 where the two sides agree on every token",
    "js": "<(e^a - 1 - a)/2 + (e^b - 1 - b)/2>_tok with a = train - log m, b = rollout - log m, "
    "m = (e^train + e^rollout)/2",
    "log_ppl_diff": "<-G>_seq = log-PPL(train) - log-PPL(rollout)",
    "log_ppl_abs_diff": "<|G|>_seq",
    "ppl_ratio": "<e^-G>_seq",
    "training_ppl": "<exp(-mean train_logprob)>_seq",
    "rollout_ppl": "<exp(-mean rollout_logprob)>_seq",
    "ratio_mean": "<e^d>_tok: exactly 1 in expectation when tokens are sampled from the rollout "
    "engine and both log-probs are of the same distribution",
    "ess": "<e^d>_tok^2 / <e^2d>_tok: the effective sample size of the raw ratios, as a fraction "
    "of the loss tokens",
}

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
# Token-level sums kept per probability / position bucket.
_BUCKET_FIELDS = ("tokens", "abs", "k3", "d")


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
        default_factory=lambda: np.zeros((len(PROB_EDGES) - 1, len(_BUCKET_FIELDS)))
    )
    by_pos: np.ndarray = field(default_factory=lambda: np.zeros((32, len(_BUCKET_FIELDS))))
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
        dm = d if every else _where(m, d, 0.0, buf("dm"))

        absd = torch.abs(dm, out=buf("abs"))
        max_abs = _seq_max(absd, batch)
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
                logprobs[name] = _where(m, values, 0.0, buf(name, torch.float32))
        rl = logprobs["rollout"]
        found = None if huge else _compiled_token_sums(batch, dm, rho, em1, rl, max_abs, buf)
        if found is None:
            found = _token_sums(batch, dm, absd, rho, em1, rl, below, max_abs, masked_out, buf)
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
                batch.rollout.numpy(), _prob_thresholds(), out, values, size
            )
        if by_prob is None:
            prob, counts = _prob_bucket(batch.rollout, masked_out, buf)
            by_prob = _bucket_sums(prob, fields if counts is None else fields[1:], size, counts)
        self.by_prob += by_prob
        self.by_pos += _position_sums(batch, masked_out, fields, self.by_pos.shape[0])

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
        """The TOP_K loss tokens of largest |d|, searched only in the sequences that can hold
        them: those whose own max |d| is among the TOP_K largest."""
        has = np.flatnonzero(max_abs != -np.inf)
        if not has.size:
            return
        kth = np.sort(max_abs[has])[-min(TOP_K, has.size)]  # NaN sorts last, as topk ranks it
        seqs = has if np.isnan(kth) else has[~(max_abs[has] < kth)]
        cu = batch.cu_seqlens.cpu().numpy()
        tokens = np.concatenate([np.arange(cu[s], cu[s + 1]) for s in seqs])
        owner = np.repeat(seqs, cu[seqs + 1] - cu[seqs])
        index = torch.from_numpy(tokens).to(absd.device)
        score = torch.where(batch.loss_mask[index], absd[index], -1.0)
        top = torch.topk(score, min(TOP_K, score.numel())).indices.cpu().numpy()
        for i in top.tolist():
            if float(score[i]) < 0:
                continue
            t, s = int(tokens[i]), int(owner[i])
            pos = int(batch.pos[t]) if batch.pos is not None else t - int(cu[s])
            self.worst_tokens.append(
                {
                    "step": int(batch.step[s]),
                    "seq_id": batch.seq_id[s].as_py(),
                    "pos": pos,
                    "rollout_logprob": float(batch.rollout[t]),
                    "train_logprob": float(batch.train[t]),
                    "d": float(d[t]),
                }
            )
        self.worst_tokens.sort(key=lambda row: -abs(row["d"]))
        del self.worst_tokens[TOP_K:]

    def merge(self, other: MismatchStats) -> None:
        """Add another accumulator's chunks after these (order is kept)."""
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
            "seq_id": _ipc(s["seq_id"]),
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
        out["worst.seq_id"] = _ipc(pa.array([w["seq_id"] for w in worst]))
        out["worst.values"] = np.array(
            [[w["rollout_logprob"], w["train_logprob"], w["d"]] for w in worst], np.float64
        ).reshape(-1, 3)
        out["noise"] = np.array(
            [[step, n.center, n.spread, n.tokens] for step, n in self.noise], np.float64
        ).reshape(-1, 4)
        out |= {f"step_hist.{k}": v for k, v in keyed_state(self.step_hists).items()}
        return out

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
        seq_id = _from_ipc(checked(state, "seq_id", "u", (-1,)))
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
        ids = _from_ipc(checked(state, "worst.seq_id", "u", (-1,))).to_pylist()
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
        return stats

    def sequences(self) -> dict[str, np.ndarray]:
        """The per-sequence sums, one array per field, plus `step` and `seq_id`."""
        out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.seq.items()}
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
    def compute(self) -> dict[str, Any]:
        """Every statistic: overall, `by_step`, `by_length`, `by_prob`, `by_pos`, the worst
        sequences and tokens, the 2-D histogram, the broken sequences and the `flags`."""
        s = self.sequences()
        numbers = {k: v for k, v in s.items() if k != "seq_id"}
        numbers["broken"] = self.broken(s).astype(np.float64)
        result = _summarize(numbers)
        result["by_step"] = self.by_step(numbers)
        result["by_length"] = self._by_length(numbers, result)
        result["by_prob"] = _bucket_rows(
            self.by_prob,
            [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(PROB_EDGES)],
        )
        # Position bucket b holds pos + 1 in [2^b, 2^(b+1)).
        result["by_pos"] = _bucket_rows(
            self.by_pos, [f"{2**b - 1}-{2 ** (b + 1) - 2}" for b in range(32)]
        )
        every = self.abs_hist
        levels = (0.5, 0.9, 0.99, 0.999)
        result["abs_diff_quantiles"] = {
            f"p{q * 100:g}": v for q, v in zip(levels, every.quantiles(levels), strict=True)
        }
        per_decade = plot_resolution(every)
        result["abs_diff_hist"] = every.coarse(per_decade)
        result["signed_diff_hist"] = _signed_hist(every, self.neg_hist, per_decade)
        result["joint_hist"] = {
            "edges": self.joint.edges().tolist(),
            "counts": self.joint.counts.tolist(),
            "x": "rollout_logprob",
            "y": "train_logprob",
        }
        result["worst_sequences"] = _worst_sequences(s)
        result["worst_tokens"] = list(self.worst_tokens)
        result["flags"] = _flags(result, numbers, self.regression, self.signs)
        return result

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
                **_summarize(group),
                **_step_noise(group, self.step_hists.get(int(step)), noise.get(int(step))),
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


_TOKEN_TERMS = (
    "S",
    "abs",
    "d2",
    "k3",
    "k3r",
    "js",
    "mult",
    "rho",
    "rho2",
    "chi",
    "rollout2",
    "rollout_d",
)
"""The per-sequence sums of `_token_sums`, in the order of `kernels.token_sums`' rows (then
"negative" and "positive")."""


def _token_sums(
    batch: TokenBatch,
    dm: torch.Tensor,
    absd: torch.Tensor,
    rho: torch.Tensor,
    em1: torch.Tensor,
    rollout: torch.Tensor,
    below: torch.Tensor,
    max_abs: np.ndarray,
    masked_out: torch.Tensor | None,
    buf: Callable[..., torch.Tensor],
) -> tuple[dict[str, np.ndarray], torch.Tensor]:
    """(float64 [B] per sequence: the sums of `_TOKEN_TERMS` and the tokens with d < 0
    ("negative", `below`) and d > 0 ("positive"); k3 [N] of each token). dm: the log-ratios,
    0 outside the loss (`masked_out`); e^|d|, e^d and e^2d count loss tokens only; rho = e^d,
    em1 = e^d - 1; `rollout`: the rollout log-probs, 0 outside the loss (its square and
    product with d, in float64, are the regression's); max_abs: each sequence's largest |d|."""

    def loss_only(values: torch.Tensor) -> torch.Tensor:
        """Zero the non-loss tokens of a scratch tensor, in place."""
        return values if masked_out is None else values.masked_fill_(masked_out, 0.0)

    rho2 = torch.mul(rho, rho, out=buf("rho2"))
    rl = buf("rl").copy_(rollout)
    tail = torch.reciprocal(rho, out=buf("tail"))
    mult = torch.maximum(rho, tail, out=buf("mult"))  # e^|d|
    tail = torch.minimum(rho, tail, out=tail)  # e^-|d|
    k3r = buf("k3r")
    if max_abs.size > 0 and not max_abs.max() <= 700.0:  # NaN counts as huge
        torch.special.expm1(torch.neg(dm, out=k3r), out=k3r)
    else:
        torch.div(em1, rho, out=k3r).neg_()
    token: dict[str, torch.Tensor] = {
        "S": dm,
        "abs": absd,
        "d2": torch.mul(dm, dm, out=buf("d2")),
        "k3": torch.sub(em1, dm, out=buf("k3")),
        "k3r": k3r.add_(dm),
        "js": _js(absd, em1, rho, tail, buf),
        "mult": loss_only(mult),
        "rho": rho if masked_out is None else _where(batch.loss_mask, rho, 0.0, buf("rho")),
        "rho2": loss_only(rho2),
        "rollout2": torch.mul(rl, rl, out=buf("rollout2")),
        "rollout_d": torch.mul(rl, dm, out=buf("rollout_d")),
        "negative": below,
        "positive": ops.compare("gt", dm, 0.0, buf("above", torch.bool)),
    }
    sums = ops.segment_sums_on_host(batch, token)
    # chi = <e^(2 clamp(d, +-20))> (verl squares the clamped ratio): the same values as
    # rho2 unless some |d| > 20.
    bound = ops.SAFETY_BOUND
    if max_abs.size == 0 or max_abs.max() <= bound:
        sums["chi"] = sums["rho2"]
    else:  # e^(2 clamp(d, +-b)) = clamp(e^2d, e^-2b, e^2b)
        chi = torch.clamp(rho2, *_CHI_CLAMP, out=mult)
        sums["chi"] = ops.segment_sums_on_host(batch, {"chi": loss_only(chi)})["chi"]
    return sums, token["k3"]


_CHI_CLAMP = (math.exp(-2 * ops.SAFETY_BOUND), math.exp(2 * ops.SAFETY_BOUND))


def _compiled_token_sums(
    batch: TokenBatch,
    dm: torch.Tensor,
    rho: torch.Tensor,
    em1: torch.Tensor,
    rollout: torch.Tensor,
    max_abs: np.ndarray,
    buf: Callable[..., torch.Tensor],
) -> tuple[dict[str, np.ndarray], torch.Tensor] | None:
    """`_token_sums` in two compiled passes around torch's log1p (`kernels.js_argument`,
    `kernels.token_sums`): the same values, without its 20 float64 passes and 11
    reductions; None off the CPU or where the kernels do not answer (the caller leaves
    |d| > 700 to `_token_sums`)."""
    if batch.device.type != "cpu" or rho.dtype != torch.float64:
        return None
    arg, k3 = buf("js"), buf("k3")
    if not kernels.js_argument(dm.numpy(), rho.numpy(), em1.numpy(), arg.numpy(), k3.numpy()):
        return None
    lg = arg.log1p_()  # torch's log1p, as the reference's
    mask = None if ops.mask_is_all(batch, batch.loss_mask) else batch.loss_mask.numpy()
    cu = batch.cu_seqlens.numpy()
    out = kernels.token_sums(
        dm.numpy(), rho.numpy(), em1.numpy(), lg.numpy(), rollout.numpy(), mask, cu, _CHI_CLAMP
    )
    if out is None:
        return None
    sums = dict(zip((*_TOKEN_TERMS, "negative", "positive"), out, strict=True))
    if max_abs.size == 0 or max_abs.max() <= ops.SAFETY_BOUND:
        sums["chi"] = sums["rho2"]  # as `_token_sums`: unclamped unless a |d| exceeds it
    return sums, k3


def _js(
    absd: torch.Tensor,
    em1: torch.Tensor,
    rho: torch.Tensor,
    tail: torch.Tensor,
    buf: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """Per-token Jensen-Shannon term (k3(a) + k3(b)) / 2 of `DEFINITIONS["js"]`.

    With m = (e^t + e^r) / 2, e^a + e^b = 2, so the term is -(a + b) / 2 = log cosh(d / 2):
    a function of d alone. It is evaluated as -log1p(-tanh(d/2)^2) / 2 for |d| < 1 and
    |d| / 2 - log 2 + log1p(e^-|d|) beyond, both accurate to a few ulps (tanh(d/2) =
    expm1(d) / (e^d + 1)), from the exponentials computed anyway (`tail` = e^-|d|).
    """
    large = ops.compare("ge", absd, 1.0, buf("js_large", torch.bool))
    log = torch.add(rho, 1.0, out=buf("js"))
    torch.div(em1, log, out=log)  # tanh(d / 2)
    log.mul_(log).neg_()
    _copy_where(log, tail, large).log1p_()
    beyond = torch.mul(absd, 0.5, out=buf("js_beyond")).sub_(math.log(2.0)).add_(log)
    return _copy_where(log.mul_(-0.5), beyond, large)


def _copy_where(out: torch.Tensor, values: torch.Tensor, where: torch.Tensor) -> torch.Tensor:
    """out[where] = values[where], in place (numpy's masked copy is 5x torch.where's speed)."""
    if out.device.type == "cpu":
        np.copyto(out.numpy(), values.numpy(), where=where.numpy())
        return out
    return torch.where(where, values, out, out=out)


def _where(
    condition: torch.Tensor, x: torch.Tensor, value: float, out: torch.Tensor
) -> torch.Tensor:
    """torch.where(condition, x, value) into `out`."""
    other = torch.tensor(value, dtype=x.dtype, device=x.device)
    return torch.where(condition, x, other, out=out)


def _seq_max(values: torch.Tensor, batch: TokenBatch) -> np.ndarray:
    """float64 [B] per-sequence max (-inf for empty sequences)."""
    if batch.device.type == "cpu":
        return ops.host_segment_max(values.numpy(), batch)
    every = torch.ones_like(values, dtype=torch.bool)
    return ops.segment_max(values, batch, every).cpu().numpy()


def _count(mask: torch.Tensor) -> int:
    if mask.device.type == "cpu":
        return int(np.count_nonzero(mask.numpy()))
    return int(torch.count_nonzero(mask))


@functools.cache
def _prob_thresholds() -> tuple[float, ...]:
    """For each inner edge e of PROB_EDGES, the smallest float32 log-prob v with
    exp(float64(v)) >= e: comparing float32 log-probs with these buckets exactly as
    bucketizing their float64 exponentials would. (Cached whole: two threads analyzing
    steps at once must never see part of it.)"""
    thresholds = []
    for edge in PROB_EDGES[1:-1]:
        lo, hi = np.float32(math.log(edge) - 1e-3), np.float32(math.log(edge) + 1e-3)
        # Bisection over the float32 values between lo and hi (exp is increasing).
        while np.nextafter(lo, hi) != hi:
            grid = np.linspace(lo, hi, 64, dtype=np.float64).astype(np.float32)
            grid = np.unique(np.concatenate([[lo], grid, [hi]]))
            above = torch.exp(torch.from_numpy(grid.astype(np.float64))).numpy() >= edge
            first = int(np.argmax(above))
            lo, hi = grid[first - 1], grid[first]
        thresholds.append(float(hi))
    return tuple(thresholds)


def _prob_bucket(
    rollout: torch.Tensor, masked_out: torch.Tensor | None, buf: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor, np.ndarray | None]:
    """([N] bucket of exp(rollout_logprob) among PROB_EDGES (right-closed, like
    torch.bucketize(right=True)), len(PROB_EDGES) - 1 for tokens outside the loss mask;
    the count per bucket when every token is a loss token, else None)."""
    above_counts = None
    if rollout.dtype == torch.float32:
        bucket = buf("prob", torch.uint8).zero_()
        above = buf("prob_above", torch.bool)
        above_counts = [rollout.numel()]
        for threshold in _prob_thresholds():
            bucket += ops.compare("ge", rollout, threshold, above)
            above_counts.append(_count(above))
    else:
        edges = torch.tensor(PROB_EDGES[1:-1], dtype=torch.float64, device=rollout.device)
        bucket = torch.bucketize(rollout.double().exp(), edges, right=True)
    if masked_out is not None:
        return bucket.masked_fill_(masked_out, len(PROB_EDGES) - 1), None
    if above_counts is None:
        return bucket, None
    # Tokens at or above each threshold, minus those at or above the next.
    return bucket, -np.diff(np.array([*above_counts, 0], dtype=np.float64))


def _bucket_sums(
    index: torch.Tensor,
    fields: tuple[torch.Tensor | None, ...],
    size: int,
    counts: np.ndarray | None = None,
) -> np.ndarray:
    """float64 [size, len(fields)]: per bucket, the count (for None) or sum of each field;
    index == size (the extra bucket) is dropped. Known `counts` come first."""
    columns = [] if counts is None else [counts]
    if index.device.type == "cpu":
        idx = index.numpy().astype(np.intp)
        for f in fields:
            weights = None if f is None else f.numpy()
            columns.append(np.bincount(idx, weights=weights, minlength=size + 1)[:size])
    else:
        index = index.long()
        for f in fields:
            weights = None if f is None else f.double()
            counts = torch.bincount(index, weights=weights, minlength=size + 1)
            columns.append(counts[:size].cpu().numpy())
    return np.stack(columns, axis=1).astype(np.float64)


def _position_sums(
    batch: TokenBatch,
    masked_out: torch.Tensor | None,
    fields: tuple[torch.Tensor | None, ...],
    size: int,
) -> np.ndarray:
    """float64 [size, len(fields)] per log2 bucket of pos + 1 (the last holds all beyond):
    the loss-token count (for None) or the sum of each field (zero outside the loss mask).

    Buckets change only a few times along a sequence, so the fields are summed over runs of
    one bucket (`reduceat`) and the runs then added per bucket.
    """
    if batch.device.type != "cpu":
        index = log2_bucket(batch.positions() + 1).clamp_(max=size - 1)
        if masked_out is not None:
            index = index.masked_fill(masked_out, size)
        return _bucket_sums(index, fields, size)
    cu = batch.cu_seqlens.numpy()
    starts, lengths = cu[:-1], np.diff(cu)
    if batch.pos is None:
        # Positions 0..T-1: bucket b covers pos + 1 in [2^b, 2^(b+1)).
        top = max(int(lengths.max(initial=0)).bit_length(), 1)
        offsets = (1 << np.arange(top, dtype=np.int64)) - 1
        valid = offsets[None, :] < lengths[:, None]
        runs = (starts[:, None] + offsets[None, :])[valid]
        run_bucket = np.broadcast_to(np.arange(top), valid.shape)[valid]
    else:
        bucket = log2_bucket(batch.pos + 1).numpy()
        change = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
        runs = np.union1d(change, starts[lengths > 0])
        run_bucket = bucket[runs]
    run_bucket = np.minimum(run_bucket, size - 1)
    out = np.zeros((size, len(fields)))
    if not runs.size:
        return out
    for j, f in enumerate(fields):
        if f is None:
            values = (
                np.diff(np.append(runs, batch.num_tokens))
                if masked_out is None
                else np.add.reduceat(~masked_out.numpy(), runs, dtype=np.int64)
            )
        else:
            values = np.add.reduceat(f.numpy(), runs)
        out[:, j] = np.bincount(run_bucket, weights=values, minlength=size)[:size]
    return out


def _summarize(s: dict[str, np.ndarray]) -> dict[str, Any]:
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


def _ipc(array: pa.Array) -> np.ndarray:
    """uint8 [bytes]: `array` as an Arrow IPC stream (its type kept; nothing pickled)."""
    sink = pa.BufferOutputStream()
    batch = pa.record_batch([array], names=["x"])
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return np.frombuffer(sink.getvalue(), dtype=np.uint8)


def _from_ipc(data: np.ndarray) -> pa.Array:
    """The array `_ipc` wrote, validated.

    Raises:
        ValueError: the bytes are not one such stream.
    """
    try:
        table = pa.ipc.open_stream(pa.py_buffer(data.tobytes())).read_all()
        table.validate(full=True)
    except (pa.ArrowException, OSError) as e:
        raise ValueError(f"ids: not an Arrow stream: {e}") from e
    if table.num_columns != 1:
        raise ValueError("ids: expected one column")
    return table.column(0).combine_chunks()


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


def _bucket_rows(table: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    rows = []
    for label, (tokens, abs_sum, k3_sum, d_sum) in zip(labels, table, strict=False):
        if tokens:
            rows.append(
                {
                    "bucket": label,
                    "tokens": int(tokens),
                    "abs_diff_mean": abs_sum / tokens,
                    "k3": k3_sum / tokens,
                    "d_mean": d_sum / tokens,
                }
            )
    return rows


def _worst_sequences(s: dict[str, np.ndarray]) -> list[dict[str, Any]]:
    """The sequences that contribute most mismatch: largest k3 sums."""
    order = np.argsort(-s["k3"], kind="stable")[:TOP_K]
    ids = s["seq_id"].take(pa.array(order)).to_pylist() if order.size else []
    return [
        {
            "step": int(s["step"][i]),
            "seq_id": sid,
            "tokens": int(s["T"][i]),
            "abs_diff_mean": float(s["abs"][i] / max(s["T"][i], 1)),
            "abs_diff_max": float(s["max_abs"][i]),
            "k3_sum": float(s["k3"][i]),
            "log_ratio_sum": float(s["S"][i]),
        }
        for i, sid in zip(order.tolist(), ids, strict=True)
        if s["T"][i] > 0
    ]


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
}
"""The kind of each flag code: decided here, read by the app's pages and the report."""


def flags_of(mismatch: dict[str, Any], kind: FlagKind) -> list[dict[str, str]]:
    """The flags of `kind` among an analysis' mismatch `flags`."""
    return [f for f in mismatch.get("flags", []) if f["kind"] == kind]


def _flag(code: str, message: str) -> dict[str, str]:
    return {"code": code, "kind": _FLAG_KIND[code], "message": message}


def _flags(
    result: dict[str, Any], s: dict[str, np.ndarray], regression: np.ndarray, signs: np.ndarray
) -> list[dict]:
    """Signatures of semantics bugs, as opposed to numerical noise; broken sequences; drift
    over the steps; a heavy tail of far-off tokens. The identity E_rollout[e^d] = 1 is tested
    on the sequences that are not broken: a stale replica breaks it in its own sequences, and
    is named as what it is."""
    flags = []
    if not result.get("tokens"):
        return flags
    broken = s["broken"] > 0
    if broken.any():
        steps = np.unique(s["step"][broken])
        where = f"step {steps[0]}" if steps.size == 1 else f"{steps.size} steps, from {steps[0]}"
        flags.append(
            _flag(
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
            _flag(
                "ratio_mean_bias",
                f"<exp(d)> = {ratio:.4f} (z = {z:+.0f}"
                + (", over the sequences that are not broken" if broken.any() else "")
                + "): it must be 1 when tokens are "
                "sampled from the rollout engine and both sides score the same distribution. "
                "Typical causes: processed (top-p/top-k/temperature) log-probs on one side and raw "
                "on the other, a token shift, or stale weights.",
            )
        )
    n, x, x2, y, y2, xy = regression
    cov = xy / n - (x / n) * (y / n)
    var_x, var_y = x2 / n - (x / n) ** 2, y2 / n - (y / n) ** 2
    corr = cov / math.sqrt(var_x * var_y) if var_x > 0 and var_y > 0 else 0.0
    result["d_rollout_correlation"] = corr
    result["d_rollout_slope"] = cov / var_x if var_x > 0 else 0.0
    if abs(corr) > 0.3:
        flags.append(
            _flag(
                "logprob_dependent_offset",
                f"d is correlated with the rollout log-prob (r = {corr:+.2f}): "
                "numerical noise is symmetric at every probability. A temperature applied on "
                "one side only (or different temperatures) makes d grow linearly with the "
                "log-prob.",
            )
        )
    negative, _, positive = signs.astype(float)
    one_sided = max(negative, positive) / max(negative + positive, 1.0)
    result["d_sign_fraction"] = one_sided
    if one_sided > 0.8 and abs(result["d_mean"]) > 3.0 * math.sqrt(result["d_var"] / n):
        side = "below" if negative > positive else "above"
        flags.append(
            _flag(
                "constant_offset",
                f"{one_sided:.0%} of the tokens have d {side} 0 (mean d = "
                f"{result['d_mean']:+.4f}): a one-sided offset is a semantics bug (e.g. raw vs "
                "processed log-probs, renormalization after top-p), not numerical noise.",
            )
        )
    # The steps with tokens in the loss (a step whose tokens are all masked has no k3).
    steps = [step for step in result.get("by_step", []) if step.get("tokens")]
    result["k3_growth"] = None  # fewer than three steps, or no mismatch at the first
    if len(steps) >= 3 and steps[0].get("k3", 0) > 0:
        result["k3_growth"] = steps[-1]["k3"] / steps[0]["k3"]
    k3 = [row["healthy_k3"] for row in steps if row.get("healthy_k3") is not None]
    steps = [row for row in steps if row.get("healthy_k3") is not None]
    rise = first_rise(k3)
    if rise is not None:
        band = Band.of(k3)
        flags.append(
            _flag(
                "drift",
                f"k3 (the token mean over the sequences not called broken) rises from step "
                f"{steps[rise]['step']} on, to "
                f"{k3[-1] / band.median:.1f}x the median of {band.early} by "
                f"step {steps[-1]['step']}: mismatch that drifts during training points to a "
                "divergence between the engines (weight sync, resume, growing off-policyness).",
            )
        )
    largest, tail = result["abs_diff_max"], result["abs_diff_quantiles"].get("p99.9")
    if largest > 2.0 and tail is not None:
        # Noise or not, a few far-off tokens are what token caps and bands are for.
        flags.append(
            _flag(
                "heavy_tail",
                f"the largest |d| is {largest:.3g} nats (a ratio of e^{largest:.3g}), while "
                f"99.9% of the tokens are within {tail:.3g}: a few far-off tokens (fp8 outliers, "
                "routing flips) that a token cap or band acts on.",
            )
        )
    return flags


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
