"""What numerical noise looks like in a dump, robustly, and what stands out of it.

Noise is described by medians and MADs (1.4826 MAD estimates a normal's standard deviation),
so that a few broken sequences cannot move the estimate. A sequence is *broken* when its loss
tokens stand out of the noise in either of two ways (`outside`):

- **shifted**: the median log-ratio d of its tokens lies more than `Z_BROKEN` standard errors
  from the noise's centre, and its tokens lean to one side of 0 (a sign test): a replica whose
  log-probs are all off by ~1 nat is hundreds of errors away, while noise, even with a few
  outlier tokens or a routing-flip span in a sequence, moves a median very little;
- **spread**: over half of its tokens lie far from the centre (`FAR` spreads of the noise at
  their own rollout probability, `deviations`), `Z_BROKEN` standard errors more than noise
  puts there: a replica that samples from another policy (stale weights) moves the tokens
  of a sequence both ways, by far more than numerical noise, while its median barely moves
  and, over 16 tokens, no sign test can reach 4 standard errors. Comparing each token with
  the noise of tokens of its own probability keeps a sequence of uncertain tokens, whose
  log-ratios are larger by nature, from being taken for one.

Where the sequences' medians spread wider than their tokens' noise explains (a bug whose size
varies with the context), the shift test widens by their own spread.

Each step's sequences are judged against that step's own noise (`outside_by_step`), so that a
mismatch growing over the steps is never taken for broken sequences: the one definition the
mismatch flags and per-step table (`iscore.stats.mismatch`), each setting's broken gradient kept
(`iscore.stats.setting`), the recommendation and the run's events (`iscore.advice.trend`) read.

>>> rng = np.random.default_rng(0)
>>> T = np.full(20, 100)
>>> d, rollout = rng.normal(0.0, 0.05, 2000), np.full(2000, -1.0)
>>> d[:100] += 1.0  # the first sequence: every log-prob off by 1 nat
>>> d[100:200] *= 10.0  # the second: ten times the noise, both ways
>>> positive, negative = (np.add.reduceat(x, np.arange(0, 2000, 100)) for x in (d > 0, d < 0))
>>> far = segment_counts(deviations(d, rollout) > FAR, T)
>>> medians = segment_medians(d, T)
>>> np.flatnonzero(outside(medians, T, positive, negative, far, Noise.of(d))).tolist()
[0, 1]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from iscore.packed import kernels

Z_BROKEN = 8.0
"""Standard errors from the noise's centre beyond which a sequence is called broken."""

MAD_SD = 1.4826
"""A normal's standard deviation over its median absolute deviation."""

MEDIAN_STDERR = 1.2533
"""The median of T independent normal values errs by MEDIAN_STDERR sd / sqrt(T)."""

_IID_MEDIAN_Z = 0.6745
"""The median of |z| for standard normal z: what the sequences' z give when they are noise."""

FAR = 3.0 * _IID_MEDIAN_Z
"""A token lies far from the noise's centre beyond this many spreads (`deviations`): 3 times
the median |z| of noise, which puts `FAR_SHARE` of its tokens there. A sequence with over half
of its tokens far has a median |z| 3 times noise's: what a routing-flip span or outlier tokens,
a minority of a sequence's tokens, cannot do."""

FAR_SHARE = 0.0430
"""The share of a normal noise's tokens beyond `FAR`: 2 (1 - Phi(2.0235))."""

BROKEN_WORDS = (
    f"lie outside their step's noise (a median log-ratio more than {Z_BROKEN:g} standard errors "
    "off its centre, or most tokens 3x as far off it as noise at their probability)"
)
"""The test of `outside`, in words, for every message that reports broken sequences."""

SCALE_EDGES = (0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999)
"""The inner edges of the rollout probability bins whose noise each token is compared with
(`deviations`): the buckets of the Mismatch page's `by_prob` table, with the last split by
decades of 1 - p, as a near-certain token's log-ratio shrinks with 1 - p (one bin from 0.99
to 1 put a 43-token sequence of tokens at p ~ 0.99 at 2.3 of the noise of tokens at
p ~ 0.99999, in a run under growing noise)."""

_LOG_SCALE_EDGES = np.log(SCALE_EDGES)
# The smallest float32 at or above each log edge: a float32 log-prob v >= it exactly when v >=
# the float64 edge, so float32 log-probs are binned by float32 comparisons (14x faster than a
# search in float64).
_LOG_SCALE_EDGES_32 = np.array(
    [
        np.float32(e) if float(np.float32(e)) >= e else np.nextafter(np.float32(e), np.inf)
        for e in _LOG_SCALE_EDGES
    ],
    dtype=np.float32,
)

SPREAD_FLOOR = 1e-5
"""Nats below which a bin's spread is not trusted (`deviations`): where most tokens of a bin
have d exactly 0 (both sides report log-prob 0), its MAD is 0 and would make any d infinite."""


def median_mad(x: np.ndarray) -> tuple[float, float]:
    """(median, MAD_SD x the median absolute deviation) of `x`; (0, 0) when empty. By
    selection where the compiled kernels run (`iscore.packed.kernels`), the same values.

    >>> median_mad(np.array([1.0, 2.0, 4.0]))
    (2.0, 1.4826)
    """
    if not x.size:
        return 0.0, 0.0
    fast = kernels.median_mad(x)
    if fast is None:
        center = float(np.median(x)) + 0.0  # a median of zeros is +0 on both paths
        return center, MAD_SD * float(np.median(np.abs(x - center)))
    return fast[0], MAD_SD * fast[1]


def segment_medians(values: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """float64 [B]: the median of each segment's values (0 for an empty one); segment i holds
    the next `counts[i]` values.

    A segment of more than `LONG_SEGMENT` values is partitioned alone around its middle
    (linear time). Shorter segments of similar length are sorted together as the rows of a
    block, each row padded with +inf to the next power of two (so never more than twice the
    values, and at most `MEDIAN_CELLS` at a time): 15x faster than one lexsort of (segment,
    value), and twice as fast again with the long ones partitioned.

    Where the compiled kernels run (`iscore.packed.kernels`), each segment is partitioned around its
    middle instead, in parallel: the same values.

    >>> segment_medians(np.array([3.0, 1.0, 2.0, 5.0, 4.0, 7.0]), np.array([3, 0, 2, 1]))
    array([2. , 0. , 4.5, 7. ])
    """
    fast = kernels.segment_medians(values, counts)
    if fast is not None:
        return fast
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    medians = np.zeros(n.size)
    long = n > LONG_SEGMENT
    width = np.left_shift(1, np.ceil(np.log2(np.maximum(n, 1))).astype(np.int64))
    for w in np.unique(width[(n > 0) & ~long]):
        rows = np.flatnonzero((n > 0) & ~long & (width == w))
        columns = np.arange(w)
        for part in np.array_split(rows, -(-rows.size * int(w) // MEDIAN_CELLS)):
            k = n[part]
            block = np.full((part.size, w), np.inf)
            valid = columns < k[:, None]
            block[valid] = values[(starts[part][:, None] + columns)[valid]]
            block.sort(axis=1)
            r = np.arange(part.size)
            medians[part] = 0.5 * (block[r, (k - 1) // 2] + block[r, k // 2]) + 0.0
    for i in np.flatnonzero(long).tolist():
        start, k = int(starts[i]), int(n[i])
        middle = [(k - 1) // 2, k // 2]
        segment = np.partition(values[start : start + k], middle)
        medians[i] = 0.5 * (segment[middle[0]] + segment[middle[1]]) + 0.0
    return medians


LONG_SEGMENT = 512
"""Values above which `segment_medians` partitions a segment alone rather than sorting it in a
block (one call costs about what sorting 512 values in a block does)."""


MEDIAN_CELLS = 1 << 20
"""Values (padding included) sorted per block by `segment_medians`: 8 MB."""


@dataclass(frozen=True, slots=True)
class Noise:
    """The noise of a set of tokens' log-ratios d: centre and spread, robustly.

    Attributes:
        center: the median of d.
        spread: MAD_SD x the median absolute deviation of d.
        tokens: how many tokens it was estimated from.
    """

    center: float
    spread: float
    tokens: int

    @classmethod
    def of(cls, d: np.ndarray) -> Noise:
        """The noise of the log-ratios `d` (loss tokens only)."""
        center, spread = median_mad(d)
        return cls(center, spread, int(d.size))

    @classmethod
    def combine(cls, parts: Sequence[Noise]) -> Noise:
        """One step's noise from that of its parts (the files, one per rank, it was written
        in): the median of their centres and of their spreads, so that one bad rank cannot
        move it; a step in one file is that file's own.

        >>> Noise.combine([Noise(0.0, 0.1, 10), Noise(0.01, 0.2, 10), Noise(1.0, 0.1, 10)])
        Noise(center=0.01, spread=0.1, tokens=30)
        """
        if len(parts) == 1:
            return parts[0]
        return cls(
            float(np.median([p.center for p in parts])),
            float(np.median([p.spread for p in parts])),
            sum(p.tokens for p in parts),
        )

    def z(self, medians: np.ndarray, T: np.ndarray) -> np.ndarray:
        """float64 [B]: how many standard errors each sequence's median d lies from the
        centre, for sequences of T loss tokens."""
        stderr = MEDIAN_STDERR * max(self.spread, 1e-12) / np.sqrt(np.maximum(T, 1.0))
        return np.abs(medians - self.center) / stderr


def deviations(d: np.ndarray, rollout: np.ndarray, bins: np.ndarray | None = None) -> np.ndarray:
    """float64 [N]: each token's |d - centre| / spread, the centre and spread (`median_mad`,
    floored at `SPREAD_FLOOR`) those of the tokens given in the same bin of rollout
    probability (`SCALE_EDGES`): how far it lies from the noise of tokens as likely as it.
    Pass one step's loss tokens (or one part of a step), with their rollout log-probs (and
    their bins, `_bins(rollout)`, when at hand). A bin
    of more than `BIN_SAMPLE` tokens takes its centre and spread from an evenly strided
    sample of `BIN_SAMPLE` to twice that many (their standard errors: under 0.5% of the
    spread).

    A log-ratio of 0.5 on a token of probability 0.05, among others of its probability, is
    ordinary; on a token of probability 0.999, among near-zero log-ratios, it is not:

    >>> d = np.array([0.001, -0.001, 0.002, 0.5, -0.4, 0.3, 0.5])
    >>> rollout = np.array([-0.001, -0.001, -0.001, -3.0, -3.0, -3.0, -0.001])
    >>> deviations(d, rollout).round(2).tolist()
    [0.22, 1.12, 0.22, 0.67, 2.36, 0.0, 224.16]
    """
    bins = _bins(rollout) if bins is None else bins
    # The tokens bin after bin, by one stable (radix) sort: a selection per bin would cost
    # bins x tokens.
    order = np.argsort(bins, kind="stable")
    values = d[order]
    z = np.empty(d.size)
    start = 0
    for n in np.bincount(bins, minlength=_LOG_SCALE_EDGES.size + 1).tolist():
        if n:
            part = values[start : start + n]
            center, spread = median_mad(part[:: max(1, n // BIN_SAMPLE)])
            deviation = np.abs(part - center, out=z[start : start + n])
            deviation /= max(spread, SPREAD_FLOOR)
            start += n
    out = np.empty(d.size)
    out[order] = z
    return out


def segment_counts(flags: np.ndarray, T: np.ndarray) -> np.ndarray:
    """float64 [B]: how many of each segment's `flags` are true; segment i holds the next
    `T[i]` of them.

    >>> segment_counts(np.array([True, False, True, True]), np.array([2, 0, 2])).tolist()
    [1.0, 0.0, 2.0]
    """
    T = np.asarray(T).astype(np.int64)
    counts = np.zeros(T.size)
    has = T > 0
    if flags.size:
        counts[has] = np.add.reduceat(flags, (np.cumsum(T) - T)[has])
    return counts


def step_noise(
    d: np.ndarray, rollout: np.ndarray, T: np.ndarray, steps: np.ndarray
) -> tuple[list[tuple[int, Noise]], np.ndarray]:
    """Each step's noise (`Noise.of` its tokens), ascending by step, and float64 [B] how many
    of each sequence's tokens lie beyond `FAR` (`deviations`), each against its step's tokens.
    The loss tokens' `d` and `rollout` run sequence after sequence, `T[i]` of them for sequence
    i, of step `steps[i]`.

    >>> d = np.array([0.01, -0.01, 0.02, 0.0, 3.0, -3.0, 0.01, -0.02])
    >>> noises, far = step_noise(d, np.full(8, -0.5), np.array([4, 4]), np.array([7, 7]))
    >>> noises, far.tolist()
    ([(7, Noise(center=0.005, spread=0.022239, tokens=8))], [0.0, 2.0])
    """
    T = np.asarray(T).astype(np.int64)
    groups = step_groups(steps, T)
    if groups and not isinstance(groups[0][1], slice):
        # Interleaved steps: each step's sequences together, in their order, and back.
        order = np.argsort(steps, kind="stable")
        tokens = np.concatenate([t for _, _, t in groups])
        noises, far = step_noise(d[tokens], rollout[tokens], T[order], steps[order])
        out = np.empty_like(far)
        out[order] = far
        return noises, out
    bins = _bins(rollout)
    per_step = np.array([q.stop - q.start for _, q, _ in groups], dtype=np.int64)
    fast = kernels.step_noise(
        d, bins, T, per_step, _LOG_SCALE_EDGES.size + 1, FAR, SPREAD_FLOOR, BIN_SAMPLE, MAD_SD
    )
    if fast is not None:
        noise, far = fast
        noises = [
            (step, Noise(float(c), MAD_SD * float(mad), tokens.stop - tokens.start))
            for (step, _, tokens), (c, mad) in zip(groups, noise.tolist(), strict=True)
        ]
        return noises, far
    far = np.zeros(T.size)
    for _, chosen, tokens in groups:
        step_d = d[tokens]
        deviation = deviations(step_d, rollout[tokens], bins[tokens])
        far[chosen] = segment_counts(deviation > FAR, T[chosen])
    return [(step, Noise.of(d[tokens])) for step, _, tokens in groups], far


def step_groups(
    steps: np.ndarray, T: np.ndarray
) -> list[tuple[int, slice | np.ndarray, slice | np.ndarray]]:
    """(step, its sequences, its tokens) for each distinct step of `steps` [B], ascending,
    the tokens of sequence i the next `T[i]`: slices where each step's sequences are
    contiguous (a dump written step after step: views, no copies), else indices in order.

    >>> step_groups(np.array([3, 3, 5]), np.array([2, 1, 4]))
    [(3, slice(0, 2, None), slice(0, 3, None)), (5, slice(2, 3, None), slice(3, 7, None))]
    >>> [(s, q.tolist(), t.tolist()) for s, q, t in step_groups(np.array([5, 3, 5]), [2, 1, 1])]
    [(3, [1], [2]), (5, [0, 2], [0, 1, 3])]
    """
    T = np.asarray(T).astype(np.int64)
    if not steps.size:
        return []
    if (steps[1:] >= steps[:-1]).all():
        cu = np.r_[0, np.cumsum(T)]
        firsts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
        lasts = np.r_[firsts[1:], steps.size]
        return [
            (int(steps[a]), slice(a, b), slice(int(cu[a]), int(cu[b])))
            for a, b in zip(firsts.tolist(), lasts.tolist(), strict=True)
        ]
    token_step = np.repeat(steps, T)
    return [
        (int(step), np.flatnonzero(steps == step), np.flatnonzero(token_step == step))
        for step in np.unique(steps)
    ]


BIN_SAMPLE = 1 << 16
"""Tokens of a probability bin above which its noise is estimated on a strided sample
(`deviations`): two exact medians of every token cost a tenth of an analysis."""


def _bins(rollout: np.ndarray) -> np.ndarray:
    """uint8 [N]: each log-prob's bin, the number of `SCALE_EDGES` at or below its probability.

    >>> _bins(np.log(np.array([0.005, 0.05, 0.7, 0.99995]))).tolist()
    [0, 1, 3, 7]
    >>> _bins(np.log(np.array([0.005, 0.05, 0.7, 0.99995], dtype=np.float32))).tolist()
    [0, 1, 3, 7]
    """
    if rollout.dtype != np.float32:
        return np.searchsorted(_LOG_SCALE_EDGES, rollout, side="right").astype(np.uint8)
    bins = np.zeros(rollout.size, dtype=np.uint8)
    for edge in _LOG_SCALE_EDGES_32:
        bins += rollout >= edge
    return bins


def outside(
    medians: np.ndarray,
    T: np.ndarray,
    positive: np.ndarray,
    negative: np.ndarray,
    far: np.ndarray,
    noise: Noise,
) -> np.ndarray:
    """bool [B]: the sequences (of T loss tokens, median log-ratio `medians`, `positive` and
    `negative` of them with d > 0 and d < 0, `far` of them farther than `FAR` from the noise
    of their probability, `deviations`) outside `noise`: broken, not noise. Either test
    suffices (module docstring).

    Shifted: the median lies more than `Z_BROKEN` standard errors from the noise's centre
    (where the sequences differ by more than their tokens' noise explains, a bug whose size
    varies with the context, their own spread widens the test: |z| of noise has median
    0.6745, and a few broken sequences cannot move the median), and the tokens lean to one
    side of 0 by more than `Z_SIGNS` standard errors of a fair coin (the sign test): a short
    sequence of uncertain tokens, whose median sits among the larger log-ratios of such
    tokens, is as balanced as any.

    Spread: over half of the tokens are far, and `Z_BROKEN` binomial standard errors more than
    the `FAR_SHARE` of noise (which keeps a sequence of a few tokens from being called broken
    by chance: one far token of one is 4.7 standard errors).
    """
    has = T > 0
    z = noise.z(medians, T)
    widen = max(1.0, float(np.median(z[has])) / _IID_MEDIAN_Z) if has.any() else 1.0
    signed = positive + negative
    lean = np.abs(positive - negative) / np.sqrt(np.maximum(signed, 1.0))
    shifted = (z > Z_BROKEN * widen) & (lean > Z_SIGNS)
    expected = FAR_SHARE * T
    excess = (far - expected) / np.sqrt(np.maximum(expected * (1.0 - FAR_SHARE), 1e-12))
    spread = (far > 0.5 * T) & (excess > Z_BROKEN)
    return has & (shifted | spread)


def outside_parts(
    medians: np.ndarray,
    T: np.ndarray,
    positive: np.ndarray,
    negative: np.ndarray,
    far: np.ndarray,
    steps: np.ndarray,
    parts: Sequence[tuple[int, Noise]],
) -> np.ndarray:
    """bool [B]: `outside`, each step's sequences judged against the noise of that step's
    `parts` ((step, noise) of each chunk or file it was read in, `Noise.combine`d): what an
    accumulator that never holds a whole step's tokens at once calls broken. Its `far` tokens
    were judged against the bins of the part each sequence was read in (`deviations`)."""
    by_step: dict[int, list[Noise]] = {}
    for step, part in parts:
        by_step.setdefault(step, []).append(part)
    out = np.zeros(T.size, dtype=bool)
    if not out.size:
        return out
    # Each step's sequences, in their order, by one stable sort: a selection per step would
    # cost steps x sequences.
    order = np.argsort(steps, kind="stable")
    ordered = steps[order]
    starts = np.flatnonzero(np.r_[True, ordered[1:] != ordered[:-1]])
    for a, b in zip(starts.tolist(), [*starts[1:].tolist(), order.size], strict=True):
        rows = by_step.get(int(ordered[a]))
        if rows is None:
            continue
        chosen = order[a:b]
        out[chosen] = outside(
            medians[chosen],
            T[chosen],
            positive[chosen],
            negative[chosen],
            far[chosen],
            Noise.combine(rows),
        )
    return out


Z_SIGNS = 4.0
"""Standard errors of the sign test beyond which a sequence's tokens lean to one side of 0."""


def outside_by_step(
    d: np.ndarray,
    rollout: np.ndarray,
    T: np.ndarray,
    positive: np.ndarray,
    negative: np.ndarray,
    steps: np.ndarray,
) -> np.ndarray:
    """bool [B]: `outside`, each step's sequences judged against that step's own noise
    (`Noise.of` its tokens, `deviations` against its bins), so that a mismatch growing over
    the steps is never taken for broken sequences. What an analysis reports per step
    (`by_step[].broken_sequences`).

    Args:
        d: float [N]: the loss tokens' log-ratios, sequence after sequence.
        rollout: float [N]: their rollout log-probs.
        T: [B] loss tokens of each sequence; `positive`, `negative`: [B] of them with d > 0,
            d < 0; steps: [B] each sequence's step.

    >>> rng = np.random.default_rng(0)
    >>> T, steps = np.full(40, 100), np.repeat([0, 1], 20)
    >>> d = rng.normal(0.0, 0.05, 4000) * np.repeat([1.0, 10.0], 2000)  # step 1: 10x noise
    >>> d[2000:2100] += 1.0  # and one stale replica's sequence there
    >>> signs = [np.add.reduceat(x, np.arange(0, 4000, 100)) for x in (d > 0, d < 0)]
    >>> np.flatnonzero(outside_by_step(d, np.full(4000, -1.0), T, *signs, steps)).tolist()
    [20]
    """
    T = np.asarray(T)
    medians = segment_medians(d, T)
    noises, far = step_noise(d, rollout, T, steps)
    broken = np.zeros(T.size, dtype=bool)
    for (_, chosen, _), (_, noise) in zip(step_groups(steps, T), noises, strict=True):
        broken[chosen] = outside(
            medians[chosen], T[chosen], positive[chosen], negative[chosen], far[chosen], noise
        )
    return broken


EARLY_STEPS = 8
"""The steps whose values make the early band: the first 8, or a third of the run if fewer."""

SUSTAIN_STEPS = 3
"""A rise lasts this many steps above the band (or every step to the last, at least two)."""

RISE_FACTOR = 3.0
"""A rise is at least this factor above the early steps' median."""

Z_RISE = 3.0
"""and at least this many robust standard deviations of their logarithms above it."""


@dataclass(frozen=True, slots=True)
class Baseline:
    """What the early steps of a run show of a positive statistic (k3), on the log scale.

    Attributes:
        steps: how many early steps it is made of.
        median: their median value.
        upper: the band's upper edge: a later step above it stands out of the early steps'
            noise (the median times max(RISE_FACTOR, e^(Z_RISE x robust sd of the logs))).
    """

    steps: int
    median: float
    upper: float

    @property
    def early(self) -> str:
        """Which steps it is made of, in words: "the first 8 steps"."""
        return "the first step" if self.steps == 1 else f"the first {self.steps} steps"

    @classmethod
    def of(cls, values: Sequence[float]) -> Baseline:
        """The band of the first `EARLY_STEPS` of `values` (a third of them if fewer);
        values are floored at 1e-12 (a k3 below is no mismatch)."""
        early = early_steps(len(values))
        logs = np.log(np.maximum(np.asarray(values[:early], dtype=float), 1e-12))
        center, spread = median_mad(logs)
        return cls(early, math.exp(center), math.exp(center + max(Z_RISE * spread, _LOG_RISE)))


_LOG_RISE = math.log(RISE_FACTOR)


def early_steps(n: int) -> int:
    """How many of a run's `n` steps are its early ones: `EARLY_STEPS`, or a third of them
    if fewer (at least one).

    >>> early_steps(100), early_steps(12), early_steps(2)
    (8, 4, 1)
    """
    return max(1, min(EARLY_STEPS, n // 3))


def first_rise(values: Sequence[float]) -> int | None:
    """The index of the first step of a sustained rise above the early steps' band (`Baseline`):
    from it, `SUSTAIN_STEPS` steps in a row above the band's upper edge, or every step to the
    last when fewer are left (at least two); None where there is none, or fewer than three
    steps. One spike is not a rise, and neither is a run that stays where it started.

    >>> first_rise([1.0, 1.1, 0.9, 1.2, 1.0, 0.8, 5.0, 1.0, 4.0, 6.0, 9.0, 12.0])
    8
    >>> first_rise([1.0, 1.2, 0.9, 1.1, 0.8, 1.0]) is None
    True
    """
    n = len(values)
    if n < 3:
        return None
    band = Baseline.of(values)
    above = np.asarray(values, dtype=float) > band.upper
    for t in range(band.steps, n):
        run = above[t : t + SUSTAIN_STEPS]
        if run.all() and (run.size == SUSTAIN_STEPS or run.size >= 2):
            return t
    return None


RATIO_BIAS_Z = 6.0
"""Standard errors from 1 beyond which <e^d> is called biased (and by at least RATIO_BIAS)."""

RATIO_BIAS = 0.005


def ratio_bias(ratio: float, stderr: float) -> float | None:
    """The z of the mean ratio <e^d> against 1 where it is biased (more than RATIO_BIAS_Z
    standard errors and RATIO_BIAS away: the two sides do not score the same distribution),
    else None. The test of the `ratio_mean_bias` flag and of the trend's `offset` events.

    >>> round(ratio_bias(0.97, 0.001)), ratio_bias(0.999, 0.0001)
    (-30, None)
    """
    z = (ratio - 1.0) / stderr if stderr > 0 else 0.0
    if abs(z) > RATIO_BIAS_Z and abs(ratio - 1.0) > RATIO_BIAS:
        return z
    return None
