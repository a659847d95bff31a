"""The whole distribution, not just the sampled token: what the engine's top-k log-probs and the
trainer's at the same ids say (docs/distribution.md).

At a token with the engine's k most likely ids K, its probabilities mu_i = e^(rollout_i) and
the trainer's pi_i = e^(train_i) on them, and the sampled token a:

- `known` = sum_K mu_i (log mu_i - log pi_i): the KL(rollout || train) terms of the k ids;
- `lower` = known + R_mu log(R_mu / R_pi), with R_mu, R_pi the mass each side leaves outside K:
  by the log-sum inequality the rest of the sum is at least that, so `lower` never exceeds the
  full-vocabulary KL (R_pi is taken `MASS_MARGIN` larger than computed, so that the rounding of
  float32 log-probs cannot push the bound above it);
- `estimate` = known + (R_mu - R_pi) + [a not in K] (e^d_a - 1 - d_a), d_a = log pi_a -
  log mu_a: the tail sampled once, so its mean over tokens sampled from the engine is the full
  KL (an importance-sampling estimate of the tail: E_mu[1{a not in K} (e^d_a - 1 - d_a)] =
  R_pi - R_mu + the tail's KL). Its k3 form is the tail's log-ratio plus a control variate of
  known mean, E_mu[1{a not in K} (e^d_a - 1)] = R_pi - R_mu: a second-order term whose variance
  is far below the log-ratio's own;

both equal to the full KL where K covers the support (R_mu = 0, the sample always in K). Also
`top1` (the trainer's largest log-prob among the k at the engine's top-1 id) and the masses
sum_K mu and sum_K pi. An engine that renormalized over a truncated support S (top-p / top-k
sampling, processed log-probs) reports mu = p / P(S): its mass on K exceeds the trainer's by
sum_K mu (1 - P(S)), while the sampled ratio's mean E_mu[e^d] falls to P(S): the two gaps agree
(`iscore.advice.flags`' `support_normalized`).

`DistributionStats` sums these per sequence (the per-step and overall means, and the diff's
resamples, are sums over sequences), a histogram of each step's per-token `lower`, and the
sums by rollout probability and by position.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from iscore.packed import TokenBatch, kernels, ops
from iscore.stats.buckets import (
    PROB_EDGES,
    bucket_sums,
    position_sums,
    prob_bucket,
    prob_thresholds,
)
from iscore.stats.histogram import LogHistogram, checked, from_keyed_state, keyed_state

MASS_MARGIN = 1e-6
"""Added to the trainer's mass outside the k ids in `lower`: float32 keeps a log-prob to about
6e-8 relative, so k probabilities summed can be off by k x 6e-8 (under 1e-6 for k <= 16), and a
larger mass outside only loosens the bound."""

SEQ_FIELDS = ("tokens", "lower", "estimate", "top1", "rollout_mass", "train_mass")
"""Per-sequence sums over the loss tokens: their count, `lower`, `estimate`, top-1 agreements
and the two masses on the k ids."""

POS_BUCKETS = 32
"""Position buckets: bucket b holds pos + 1 in [2^b, 2^(b+1)), as `mismatch.by_pos`."""

_TABLE = ("tokens", "lower", "estimate")
QUANTILES = (0.5, 0.9, 0.99)


def token_terms(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """float64 [N] per token: `lower`, `estimate`, `top1` (0/1), `rollout_mass` and
    `train_mass` (the module's docstring says what each is). The sums over the k ids add in
    the ids' order (`_row_sums`), on both paths: the compiled pass (`kernels.topk_terms`) where
    the kernels run, else torch's operations."""
    r, t = batch.rollout_topk, batch.train_topk
    mu, pi = _scratch("mu", r).copy_(r).exp_(), _scratch("pi", t).copy_(t).exp_()
    found = None
    if r.device.type == "cpu" and r.shape[1]:
        found = kernels.topk_terms(
            r.numpy(),
            t.numpy(),
            mu.numpy(),
            pi.numpy(),
            batch.topk_ids.numpy(),
            None if batch.token_id is None else batch.token_id.numpy(),
            batch.rollout.numpy(),
        )
    if found is not None:
        terms = torch.from_numpy(found)
        known, rollout_mass, train_mass, top1 = (terms[:, i] for i in range(4))
        inside = terms[:, 4] > 0
    else:
        known = _row_sums(_scratch("known", r).copy_(r).sub_(t).mul_(mu))  # in float64
        rollout_mass, train_mass = _row_sums(mu), _row_sums(pi)
        if batch.token_id is not None:
            inside = (batch.topk_ids == batch.token_id[:, None]).any(dim=1)
        else:  # the sampled token's log-prob is its entry: the same number reported twice
            inside = (r == batch.rollout[:, None]).any(dim=1)
        # max's indices: the first largest, as argmax's, in half its time
        top1 = (r.max(dim=1).indices == t.max(dim=1).indices).double()
    rest_mu = torch.clamp(1.0 - rollout_mass, min=0.0)
    rest_pi = torch.clamp(1.0 - train_mass, min=0.0) + MASS_MARGIN
    tail = torch.where(rest_mu > 0, rest_mu * torch.log(rest_mu / rest_pi), torch.zeros_like(known))
    d = batch.train.double() - batch.rollout.double()
    k3 = torch.special.expm1(d) - d
    estimate = known + (train_mass - rollout_mass) + torch.where(inside, torch.zeros_like(k3), k3)
    return {
        "lower": known + tail,
        "estimate": estimate,
        "top1": top1,
        "rollout_mass": rollout_mass,
        "train_mass": train_mass,
    }


def _scratch(name: str, like: torch.Tensor) -> torch.Tensor:
    """A float64 tensor of `like`'s shape from `ops.scratch` (reused while a pass streams:
    [N, k] fresh each step costs its page faults, 5x the exp's own time)."""
    buf = ops.scratch(f"distribution.{name}", like.numel(), torch.float64, like.device)
    return buf.view(like.shape)


def _row_sums(x: torch.Tensor) -> torch.Tensor:
    """[N] of float64 [N, k]: each row's k values added one after the other, in the ids' order
    (`torch.sum` adds in an order of its own, which a compiled pass cannot follow); 0 for
    k = 0."""
    if not x.shape[1]:
        return torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    # A scan: each sum the one before plus the next value.
    return torch.cumsum(x, dim=1, out=_scratch("sums", x))[:, -1].clone()


@dataclass(slots=True)
class DistributionStats:
    """Streaming accumulator of the distribution statistics of a dump with top-k columns."""

    seq: list[np.ndarray] = field(default_factory=list)  # float64 [fields, B] per chunk
    step_hists: dict[int, LogHistogram] = field(default_factory=dict)
    by_prob: np.ndarray = field(default_factory=lambda: np.zeros((len(PROB_EDGES) - 1, 3)))
    by_pos: np.ndarray = field(default_factory=lambda: np.zeros((POS_BUCKETS, 3)))

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences (with top-k columns)."""
        terms = token_terms(batch)
        m = batch.loss_mask
        every = ops.mask_is_all(batch, m)
        loss = dict(terms) if every else {k: torch.where(m, v, 0.0) for k, v in terms.items()}
        loss["tokens"] = m.double()
        sums = ops.segment_sums_on_host(batch, loss)
        self.seq.append(np.stack([sums[name] for name in SEQ_FIELDS]))
        # The per-token KL binned and tabled: `lower` at 0 where rounding took it below.
        lower = loss["lower"].clamp(min=0.0)
        lower_loss = lower if every else lower[m]
        if torch.unique(batch.step).numel() == 1:  # a step's part, as an analysis makes
            if lower_loss.numel():  # a step without loss tokens has no histogram, as below
                self.step_hists.setdefault(int(batch.step[0]), LogHistogram()).update(lower_loss)
        else:
            steps = torch.repeat_interleave(batch.step, batch.lengths)[m]
            for step in torch.unique(steps).tolist():
                hist = self.step_hists.setdefault(int(step), LogHistogram())
                hist.update(lower_loss[steps == step])
        masked_out = None if every else torch.logical_not(m)
        fields = (lower, loss["estimate"])  # 0 outside the loss
        self.by_prob += _by_prob(batch, masked_out, fields, self.by_prob.shape[0])
        self.by_pos += position_sums(batch, masked_out, (None, *fields), POS_BUCKETS)

    def merge(self, other: DistributionStats) -> None:
        """Add another accumulator's chunks after these."""
        self.seq.extend(other.seq)
        for step, hist in other.step_hists.items():
            self.step_hists.setdefault(step, LogHistogram()).merge(hist)
        self.by_prob += other.by_prob
        self.by_pos += other.by_pos

    def sequences(self) -> dict[str, np.ndarray]:
        """The per-sequence sums, one array per field of `SEQ_FIELDS` (prefixed `dist_`)."""
        seq = np.concatenate(self.seq, axis=1) if self.seq else np.zeros((len(SEQ_FIELDS), 0))
        return {f"dist_{name}": row for name, row in zip(SEQ_FIELDS, seq, strict=True)}

    def state(self) -> dict[str, np.ndarray]:
        """Plain arrays, for `from_state` (what a results store keeps)."""
        s = self.sequences()
        out = {
            "seq": np.stack([s[f"dist_{k}"] for k in SEQ_FIELDS]).reshape(len(SEQ_FIELDS), -1),
            "by_prob": self.by_prob,
            "by_pos": self.by_pos,
        }
        return out | {f"step_hist.{k}": v for k, v in keyed_state(self.step_hists).items()}

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray], sequences: int) -> DistributionStats:
        """The accumulator `state` describes, of `sequences` sequences.

        Raises:
            ValueError: `state` is not one `state()` wrote.
        """
        stats = cls()
        stats.seq = [checked(state, "seq", "f", (len(SEQ_FIELDS), sequences)).astype(np.float64)]
        stats.by_prob = checked(state, "by_prob", "f", stats.by_prob.shape).astype(np.float64)
        stats.by_pos = checked(state, "by_pos", "f", stats.by_pos.shape).astype(np.float64)
        prefix = "step_hist."
        hists = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
        stats.step_hists = from_keyed_state(hists)
        return stats

    def compute(self, s: Mapping[str, np.ndarray]) -> dict[str, Any] | None:
        """`mismatch.distribution`: the overall statistics of the sequences of `s`
        (`distribution_scalars`), the per-token KL's quantiles, and the KL by rollout
        probability and by position; None without a loss token."""
        scalars = distribution_scalars(s)
        if not scalars:
            return None
        every = LogHistogram()
        for hist in self.step_hists.values():
            every.merge(hist)
        quantiles = every.quantiles(QUANTILES)
        labels = [f"{lo:g}-{hi:g}" for lo, hi in itertools.pairwise(PROB_EDGES)]
        positions = [f"{2**b - 1}-{2 ** (b + 1) - 2}" for b in range(POS_BUCKETS)]
        return {
            **scalars,
            "kl_quantiles": {f"p{q * 100:g}": v for q, v in zip(QUANTILES, quantiles, strict=True)},
            "by_prob": _rows(self.by_prob, labels),
            "by_pos": _rows(self.by_pos, positions),
        }


def distribution_scalars(s: Mapping[str, np.ndarray]) -> dict[str, Any]:
    """The distribution statistics over the sequences of `s` (`DistributionStats.sequences`
    fields): `kl` (`lower`, `estimate`), `top1_agreement`, `rollout_topk_mass` and
    `train_topk_mass`; {} without them or a loss token."""
    if "dist_tokens" not in s:
        return {}
    n = float(s["dist_tokens"].sum())
    if n == 0:
        return {}

    def mean(name: str) -> float:
        return float(s[f"dist_{name}"].sum() / n)

    return {
        "tokens": int(n),
        "kl": {"lower": mean("lower"), "estimate": mean("estimate")},
        "top1_agreement": mean("top1"),
        "rollout_topk_mass": mean("rollout_mass"),
        "train_topk_mass": mean("train_mass"),
    }


def _by_prob(
    batch: TokenBatch, masked_out: torch.Tensor | None, fields: tuple[torch.Tensor, ...], size: int
) -> np.ndarray:
    """[size, 1 + fields] per bucket of the sampled token's rollout probability (`PROB_EDGES`,
    as the mismatch buckets it): its loss tokens and the sum of each field over them; one
    compiled pass where the kernels run."""
    if batch.device.type == "cpu":
        found = kernels.bucket_sums(
            batch.rollout.numpy(),
            prob_thresholds(),
            None if masked_out is None else masked_out.numpy(),
            [f.numpy() for f in fields],
            size,
        )
        if found is not None:
            return found
    n = batch.num_tokens

    def buf(name: str, dtype: torch.dtype) -> torch.Tensor:
        return ops.scratch(f"distribution.{name}", n, dtype, batch.device)

    index, counts = prob_bucket(batch.rollout, masked_out, buf)
    return bucket_sums(index, fields if counts is not None else (None, *fields), size, counts)


def _rows(table: np.ndarray, labels: list[str]) -> list[dict[str, Any]]:
    """A row per bucket with tokens: `bucket`, `tokens`, `kl_lower`, `kl_estimate` (means)."""
    return [
        {
            "bucket": label,
            "tokens": int(tokens),
            "kl_lower": lower / tokens,
            "kl_estimate": estimate / tokens,
        }
        for label, (tokens, lower, estimate) in zip(labels, table.tolist(), strict=True)
        if tokens
    ]
