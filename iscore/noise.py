"""What numerical noise looks like in a dump, step by step, and which sequences stand out of it.

The one definition of a *broken* sequence (a stale replica, a bad rank: every token off, not
noise), read by the mismatch flags, each setting's statistics, the recommendation and a run's
events. Each sequence is summarized by the median `m` of its loss tokens' log-ratios d and
their spread `s` (1.4826 MAD, which estimates a normal's standard deviation). A training step's
noise is the token-weighted median of its sequences' medians (the centre) and of their spreads,
so a few broken sequences cannot move it, and a mismatch that grows from step to step is
judged against each step's own noise (drift is never taken for broken sequences).

A sequence is broken when its median lies more than `Z_BROKEN` standard errors from its step's
centre (the median of T noisy tokens errs by about 1.2533 s / sqrt(T)): a stale replica, every
token off by ~1 nat, is hundreds of errors away; noise, even with a few outlier tokens or a
routing-flip span, moves a median very little. Where a step's sequences spread wider than their
tokens' noise explains (a bug whose size varies with the context, such as top-p processed
log-probs), the test widens by their own spread: the median of |z| over the step's sequences,
over 0.6745 (its value for pure noise), when above 1.

The summaries are per sequence, so they merge: a step spread over several files (one per rank)
or chunks gives the same answer as the step read whole.

>>> import torch
>>> from iscore.batch import TokenBatch
>>> rollout = torch.full((40,), -1.0)
>>> train = rollout + 0.01 * torch.randn(40, generator=torch.Generator().manual_seed(0))
>>> train[30:] += 1.0  # the last sequence: every token 1 nat off
>>> cu = torch.tensor([0, 10, 20, 30, 40])
>>> s = summarize(TokenBatch(rollout=rollout, train=train, cu_seqlens=cu))
>>> broken(s).tolist()
[False, False, False, True]
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from iscore import ops
from iscore.batch import TokenBatch

Z_BROKEN = 8.0
"""Standard errors from its step's centre beyond which a sequence is called broken."""

STDERR = 1.2533
"""The standard error of a median of T normal values is about 1.2533 sd / sqrt(T)."""


@dataclass(frozen=True, slots=True)
class Summaries:
    """Per sequence [B]: its step, its loss tokens T, and the median and spread (1.4826 MAD)
    of their log-ratios d (0 without loss tokens)."""

    step: np.ndarray
    T: np.ndarray
    median: np.ndarray
    spread: np.ndarray


def summarize(batch: TokenBatch) -> Summaries:
    """The noise summaries of every sequence of `batch` (whole sequences)."""
    m = batch.loss_mask
    d = ops.log_ratio(batch).double()
    T = ops.segment_count(batch, m).double().cpu().numpy()
    d = (d if ops.mask_is_all(batch, m) else d[m]).cpu().numpy()
    median = segment_medians(d, T)
    deviation = np.abs(d - np.repeat(median, T.astype(np.int64)))
    spread = 1.4826 * segment_medians(deviation, T)
    return Summaries(batch.step.cpu().numpy().astype(np.int64), T, median, spread)


def broken(s: Summaries) -> np.ndarray:
    """bool [B]: the sequences far outside their step's noise (see the module's docstring)."""
    out = np.zeros(s.T.size, dtype=bool)
    has = s.T > 0
    for step in np.unique(s.step[has]):
        rows = np.flatnonzero(has & (s.step == step))
        T = s.T[rows]
        center = weighted_median(s.median[rows], T)
        spread = max(weighted_median(s.spread[rows], T), 1e-12)
        z = np.abs(s.median[rows] - center) / (STDERR * spread / np.sqrt(T))
        widen = max(1.0, float(np.median(z)) / 0.6745)
        out[rows] = z > Z_BROKEN * widen
    return out


Z_IDENTITY = 6.0
"""Standard errors from 1 beyond which <e^d> breaks the identity E_rollout[e^d] = 1,"""

MIN_BIAS = 0.005
"""and by more than this: a tiny bias on a huge dump is no semantics bug worth a warning."""


@dataclass(frozen=True, slots=True)
class Identity:
    """The test of E_rollout[e^d] = 1, which holds whatever the noise when tokens are sampled
    from the rollout engine and both sides score the same distribution (a noisier engine makes
    the median d negative, E[d] = -KL, without breaking it); a semantics bug (processed vs raw
    log-probs, a temperature on one side, a token shift) breaks it.

    Attributes:
        ratio: <e^d> over the loss tokens tested.
        z: its distance from 1 in standard errors.
    """

    ratio: float
    z: float

    @property
    def broken(self) -> bool:
        return abs(self.z) > Z_IDENTITY and abs(self.ratio - 1.0) > MIN_BIAS

    @classmethod
    def of(cls, rho_sum: float, rho2_sum: float, tokens: float) -> Identity:
        """From the sums of e^d and e^2d over `tokens` loss tokens.

        >>> Identity.of(970.0, 950.0, 1000.0).broken, Identity.of(1000.5, 1010.0, 1000.0).broken
        (True, False)
        """
        n = max(tokens, 1.0)
        ratio = rho_sum / n
        se = math.sqrt(max(rho2_sum / n - ratio * ratio, 0.0) / n)
        return cls(ratio, (ratio - 1.0) / se if se > 0 else 0.0)


def weighted_median(values: np.ndarray, weights: np.ndarray) -> float:
    """The value below which half the weight lies (the lower one at an exact half).

    >>> weighted_median(np.array([1.0, 2.0, 10.0]), np.array([1.0, 1.0, 1.0]))
    2.0
    >>> weighted_median(np.array([1.0, 2.0, 10.0]), np.array([1.0, 1.0, 5.0]))
    10.0
    """
    if not values.size:
        return 0.0
    order = np.argsort(values, kind="stable")
    cumulative = np.cumsum(weights[order])
    return float(values[order][np.searchsorted(cumulative, 0.5 * cumulative[-1])])


def segment_medians(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float64 [B]: the median of each segment's values (0 for an empty one); segment i holds
    the next `counts[i]` values.

    Segments of similar length are sorted together as the rows of a block, each row padded
    with +inf to the next power of two (so never more than twice the values, and at most
    `MEDIAN_CELLS` at a time): 15x faster than one lexsort of (segment, value).

    >>> segment_medians(np.array([3.0, 1.0, 2.0, 5.0, 4.0, 7.0]), np.array([3, 0, 2, 1]))
    array([2. , 0. , 4.5, 7. ])
    """
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    medians = np.zeros(n.size)
    width = np.left_shift(1, np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
    for w in np.unique(width[n > 0]):
        rows = np.flatnonzero((n > 0) & (width == w))
        columns = np.arange(w)
        for part in np.array_split(rows, -(-rows.size * int(w) // MEDIAN_CELLS)):
            k = n[part]
            block = np.full((part.size, w), np.inf)
            valid = columns < k[:, None]
            block[valid] = values[(starts[part][:, None] + columns)[valid]]
            block.sort(axis=1)
            r = np.arange(part.size)
            medians[part] = 0.5 * (block[r, (k - 1) // 2] + block[r, k // 2])
    return medians


MEDIAN_CELLS = 1 << 20
"""Values (padding included) sorted per block by `segment_medians`: 8 MB."""
