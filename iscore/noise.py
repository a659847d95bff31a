"""What numerical noise looks like in a dump, robustly, and what stands out of it.

Noise is described by medians and MADs (1.4826 MAD estimates a normal's standard deviation),
so that a few broken sequences cannot move the estimate. A sequence is *broken* when the
median log-ratio d of its loss tokens lies more than `Z_BROKEN` standard errors from the
noise's centre: the median of T noisy tokens errs by about 1.2533 spread / sqrt(T), so a stale
replica (every token off by ~1 nat) is hundreds of errors away, while noise, even with a few
outlier tokens or a routing-flip span in a sequence, moves a median very little. Where the
sequences' medians spread wider than their tokens' noise explains (a bug whose size varies
with the context), the test widens by their own spread.

The recommendation judges a dump's sequences this way (`iscore.recommendation`), and the
trend judges each step's sequences against that step's own noise (`iscore.trend`).

>>> rng = np.random.default_rng(0)
>>> T = np.full(20, 100)
>>> d = rng.normal(0.0, 0.05, 2000)
>>> d[:100] += 1.0  # the first sequence: a stale replica's
>>> np.flatnonzero(outside(segment_medians(d, T), T, Noise.of(d))).tolist()
[0]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

Z_BROKEN = 8.0
"""Standard errors from the noise's centre beyond which a sequence is called broken."""

MAD_SD = 1.4826
"""A normal's standard deviation over its median absolute deviation."""

MEDIAN_STDERR = 1.2533
"""The median of T independent normal values errs by MEDIAN_STDERR sd / sqrt(T)."""

_IID_MEDIAN_Z = 0.6745
"""The median of |z| for standard normal z: what the sequences' z give when they are noise."""


def median_mad(x: np.ndarray) -> tuple[float, float]:
    """(median, MAD_SD x the median absolute deviation) of `x`; (0, 0) when empty.

    >>> median_mad(np.array([1.0, 2.0, 4.0]))
    (2.0, 1.4826)
    """
    if not x.size:
        return 0.0, 0.0
    center = float(np.median(x))
    return center, MAD_SD * float(np.median(np.abs(x - center)))


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


def outside(medians: np.ndarray, T: np.ndarray, noise: Noise) -> np.ndarray:
    """bool [B]: the sequences (of T loss tokens, median log-ratio `medians`) that lie more
    than `Z_BROKEN` standard errors from `noise`'s centre: broken, not noise.

    Where the sequences differ by more than their tokens' noise explains (a bug whose size
    varies with the context), their own spread widens the test: |z| of noise has median
    0.6745, and a few broken sequences cannot move the median.
    """
    has = T > 0
    z = noise.z(medians, T)
    widen = max(1.0, float(np.median(z[has])) / _IID_MEDIAN_Z) if has.any() else 1.0
    return has & (z > Z_BROKEN * widen)
