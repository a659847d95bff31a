"""Mergeable histograms: the sufficient statistics of distributions over streamed chunks.

Each histogram has an `update` from tensors of one chunk and a `merge` that adds another's
counts, so statistics over a dump read in chunks equal those of the dump read whole.

>>> import torch
>>> h = LogHistogram()
>>> h.update(torch.tensor([0.0, 0.5, 1.0, 2.0, float("inf")]))
>>> h.zeros, h.overflow, round(h.quantile(0.5), 1)  # within one bin (1.2%)
(1, 1, 1.0)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

LOG10_RANGE = (-12.0, 8.0)
"""Values between 1e-12 and 1e8 are binned; smaller ones count as underflow, larger overflow."""

BINS_PER_DECADE = 200
"""Bin width 10^(1/200): quantiles read off the histogram are within 1.2% of the exact ones."""


@dataclass(slots=True)
class LogHistogram:
    """Counts of positive values in log-spaced bins, plus exact zeros, tails, min and max.

    Attributes:
        counts: int64 [bins], values in [edges[i], edges[i + 1]).
        zeros: values == 0 (weights zeroed by a mask).
        underflow: 0 < value < 10^LOG10_RANGE[0].
        overflow: value >= 10^LOG10_RANGE[1], +inf included.
        nan: NaN values.
        min, max: the exact extremes of the finite values seen (inf/-inf when none).
        min_positive: the smallest positive value seen (what an underflow quantile reports).
    """

    counts: np.ndarray = field(
        default_factory=lambda: np.zeros(
            int((LOG10_RANGE[1] - LOG10_RANGE[0]) * BINS_PER_DECADE), dtype=np.int64
        )
    )
    zeros: int = 0
    underflow: int = 0
    overflow: int = 0
    nan: int = 0
    min: float = float("inf")
    max: float = float("-inf")
    min_positive: float = float("inf")

    @staticmethod
    def edges() -> np.ndarray:
        """float64 [bins + 1] bin edges (values, not logs)."""
        bins = int((LOG10_RANGE[1] - LOG10_RANGE[0]) * BINS_PER_DECADE)
        return 10.0 ** np.linspace(LOG10_RANGE[0], LOG10_RANGE[1], bins + 1)

    @property
    def total(self) -> int:
        """Every value counted, NaN included."""
        return int(self.counts.sum()) + self.zeros + self.underflow + self.overflow + self.nan

    def update(self, values: torch.Tensor) -> None:
        """Count `values` (any shape, any device; negative values are not expected)."""
        x = values.detach().double().flatten()
        if x.numel() == 0:
            return
        nan = torch.isnan(x)
        finite = torch.isfinite(x)
        self.nan += int(nan.sum())
        if finite.any():
            self.min = min(self.min, float(x[finite].min()))
            self.max = max(self.max, float(x[finite].max()))
        self.zeros += int((x == 0).sum())
        positive = x[(x > 0) & ~nan]
        if positive.numel():
            self.min_positive = min(self.min_positive, float(positive.min()))
        logs = torch.log10(positive)
        lo, hi = LOG10_RANGE
        self.underflow += int((logs < lo).sum())
        self.overflow += int((logs >= hi).sum())
        inside = logs[(logs >= lo) & (logs < hi)]
        index = ((inside - lo) * BINS_PER_DECADE).long().clamp_(max=self.counts.size - 1)
        self.counts += torch.bincount(index, minlength=self.counts.size).cpu().numpy()

    def merge(self, other: LogHistogram) -> None:
        """Add `other`'s counts to these."""
        self.counts += other.counts
        self.zeros += other.zeros
        self.underflow += other.underflow
        self.overflow += other.overflow
        self.nan += other.nan
        self.min = min(self.min, other.min)
        self.max = max(self.max, other.max)
        self.min_positive = min(self.min_positive, other.min_positive)

    def quantile(self, q: float) -> float:
        """The q-quantile of the non-NaN values: the smallest value v with P(X <= v) >= q
        (numpy's "inverted_cdf"), located log-linearly inside its bin.

        Exact at 0 (zeros), within one bin (1.2%) elsewhere; the min and max bound it.
        """
        n = self.total - self.nan
        if n == 0:
            return float("nan")
        rank = max(math.ceil(q * n) - 1, 0)
        if rank < self.zeros:
            return 0.0
        rank -= self.zeros
        if rank < self.underflow:
            return self.min_positive
        rank -= self.underflow
        cumulative = np.cumsum(self.counts)
        if rank >= cumulative[-1]:
            return self.max
        i = int(np.searchsorted(cumulative, rank, side="right"))
        before = cumulative[i - 1] if i else 0
        frac = (rank - before + 0.5) / self.counts[i]
        log_value = LOG10_RANGE[0] + (i + frac) / BINS_PER_DECADE
        return float(np.clip(10.0**log_value, self.min, self.max))

    def coarse(self, per_decade: int = 10) -> dict[str, list[float] | int]:
        """The histogram re-binned to `per_decade` bins per decade and trimmed, for plots."""
        factor = BINS_PER_DECADE // per_decade
        counts = self.counts.reshape(-1, factor).sum(axis=1)
        edges = self.edges()[::factor]
        nonzero = np.flatnonzero(counts)
        if nonzero.size:
            counts = counts[nonzero[0] : nonzero[-1] + 1]
            edges = edges[nonzero[0] : nonzero[-1] + 2]
        else:
            counts, edges = counts[:0], edges[:1]
        return {
            "edges": edges.tolist(),
            "counts": counts.tolist(),
            "zeros": self.zeros,
            "underflow": self.underflow,
            "overflow": self.overflow,
        }


@dataclass(slots=True)
class Histogram2D:
    """Counts of (x, y) pairs on a fixed grid; values outside it are clipped to its edges."""

    lo: float
    hi: float
    bins: int
    counts: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.counts = np.zeros((self.bins, self.bins), dtype=np.int64)

    def edges(self) -> np.ndarray:
        return np.linspace(self.lo, self.hi, self.bins + 1)

    def update(self, x: torch.Tensor, y: torch.Tensor) -> None:
        scale = self.bins / (self.hi - self.lo)

        def index(v: torch.Tensor) -> torch.Tensor:
            return ((v.double() - self.lo) * scale).floor().clamp_(0, self.bins - 1).long()

        flat = index(x) * self.bins + index(y)
        self.counts += (
            torch.bincount(flat, minlength=self.bins * self.bins)
            .cpu()
            .numpy()
            .reshape(self.bins, self.bins)
        )

    def merge(self, other: Histogram2D) -> None:
        self.counts += other.counts


def log2_bucket(values: torch.Tensor) -> torch.Tensor:
    """int64 bucket index floor(log2(v)) for v >= 1 (bucket b holds [2^b, 2^(b+1)))."""
    return torch.floor(torch.log2(values.double().clamp(min=1.0))).long()


def bucket_label(b: int) -> str:
    """The range of log2 bucket `b`, e.g. '512-1023'."""
    return f"{2**b}-{2 ** (b + 1) - 1}"
