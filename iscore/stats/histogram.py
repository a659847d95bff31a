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

import functools
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from iscore.packed import kernels, ops

LOG10_RANGE = (-12.0, 8.0)
"""Values between 1e-12 and 1e8 are binned; smaller ones count as underflow, larger overflow."""

BINS_PER_DECADE = 200
"""Bin width 10^(1/200): quantiles read off the histogram are within 1.2% of the exact ones."""


@dataclass(slots=True)
class LogHistogram:
    """Counts of positive values in log-spaced bins, plus exact zeros, tails, min and max.

    A histogram loaded from a state, and one merged only from such, keeps the bins in use
    alone (`_used`, `_used_counts`) until it is updated or its dense `counts` are asked for: a
    results store loads thousands of them (one per setting, per step and file), most of whose
    4,000 bins are empty.

    Attributes:
        counts: int64 [bins], values in [edges[i], edges[i + 1]).
        zeros: values == 0 (weights zeroed by a mask).
        underflow: 0 < value < 10^LOG10_RANGE[0].
        overflow: value >= 10^LOG10_RANGE[1], +inf included.
        nan: NaN values.
        min, max: the exact extremes of the finite values seen (inf/-inf when none).
        min_positive: the smallest positive value seen (what an underflow quantile reports).
    """

    zeros: int = 0
    underflow: int = 0
    overflow: int = 0
    nan: int = 0
    min: float = float("inf")
    max: float = float("-inf")
    min_positive: float = float("inf")
    _dense: np.ndarray | None = field(default=None, repr=False)
    # The bins in use (strictly increasing) and their counts (> 0), while `_dense` is None;
    # never written to in place (a merge may share them).
    _used: np.ndarray = field(default_factory=lambda: _NONE, repr=False)
    _used_counts: np.ndarray = field(default_factory=lambda: _NONE, repr=False)

    @property
    def counts(self) -> np.ndarray:
        """int64 [bins]: the dense counts (made from the bins in use on first access)."""
        if self._dense is None:
            self._dense = np.zeros(_BINS, dtype=np.int64)
            self._dense[self._used] = self._used_counts
            self._used = self._used_counts = _NONE
        return self._dense

    @counts.setter
    def counts(self, value: np.ndarray) -> None:
        self._dense = value

    def bins_used(self) -> tuple[np.ndarray, np.ndarray]:
        """The bins in use, increasing, and their counts (each > 0)."""
        if self._dense is None:
            return self._used, self._used_counts
        used = np.flatnonzero(self._dense)
        return used, self._dense[used]

    @staticmethod
    def edges() -> np.ndarray:
        """float64 [bins + 1] bin edges (values, not logs)."""
        bins = int((LOG10_RANGE[1] - LOG10_RANGE[0]) * BINS_PER_DECADE)
        return 10.0 ** np.linspace(LOG10_RANGE[0], LOG10_RANGE[1], bins + 1)

    @property
    def total(self) -> int:
        """Every value counted, NaN included."""
        binned = int(self.bins_used()[1].sum())
        return binned + self.zeros + self.underflow + self.overflow + self.nan

    def update(self, values: torch.Tensor) -> None:
        """Count `values` (any shape, any device; negative values are not expected)."""
        binned = bin_values(values)
        if binned is None:
            self._update_exact(values.detach().flatten().double())
        else:
            self.add(binned)

    def add(self, binned: Binned) -> None:
        """Count values binned by `bin_values` (for this histogram's bins)."""
        self.min = min(self.min, binned.low)
        self.max = max(self.max, binned.high)
        self.min_positive = min(self.min_positive, binned.min_positive)
        self.zeros += binned.zeros
        self.underflow += int(binned.counts[0]) - binned.zeros
        self.counts += binned.counts[1:-1]
        self.overflow += int(binned.counts[-1])

    def _update_exact(self, x: torch.Tensor) -> None:
        """The float64 definition, for inputs with NaN, infinities or negative values."""
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
        if other._dense is not None:
            self.counts += other._dense
        elif self._dense is None and not self._used.size:
            self._used, self._used_counts = other._used, other._used_counts  # shared, unwritten
        elif other._used.size:
            self.counts[other._used] += other._used_counts
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
        return self.quantiles([q])[0]

    def quantiles(self, qs: Iterable[float]) -> list[float]:
        """`quantile` of each of `qs`, the bins in use found once."""
        n = self.total - self.nan
        if n == 0:
            return [float("nan") for _ in qs]
        cumulative = None
        out = []
        for q in qs:
            rank = max(math.ceil(q * n) - 1, 0)
            if rank < self.zeros:
                out.append(0.0)
                continue
            rank -= self.zeros
            if rank < self.underflow:
                out.append(self.min_positive)
                continue
            rank -= self.underflow
            if cumulative is None:
                used, counts = self.bins_used()
                cumulative = np.cumsum(counts)
            if not cumulative.size or rank >= cumulative[-1]:
                out.append(self.max)
                continue
            i = int(np.searchsorted(cumulative, rank, side="right"))
            before = cumulative[i - 1] if i else 0
            frac = (rank - before + 0.5) / counts[i]
            log_value = LOG10_RANGE[0] + (int(used[i]) + frac) / BINS_PER_DECADE
            out.append(float(min(max(10.0**log_value, self.min), self.max)))  # np.clip's
        return out

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

    def state(self) -> dict[str, np.ndarray]:
        """Everything it holds as two plain arrays, for `from_state`: `bins`, int64 [2, k]
        (each bin in use and its count) and `scalars`, float64 [7] (zeros, underflow,
        overflow, nan, min, max, min_positive).

        >>> h = LogHistogram()
        >>> h.update(torch.tensor([0.0, 0.5, 2.0]))
        >>> LogHistogram.from_state(h.state()) == h
        True
        """
        return {"bins": np.stack(self.bins_used()), "scalars": self._scalars()}

    def _scalars(self) -> np.ndarray:
        names = ("zeros", "underflow", "overflow", "nan", "min", "max", "min_positive")
        return np.array([getattr(self, name) for name in names], np.float64)

    @classmethod
    def from_state(cls, state: Mapping[str, np.ndarray]) -> LogHistogram:
        """The histogram `state` describes.

        Raises:
            ValueError: `state` is not one `state()` wrote (missing arrays, wrong types,
                bins out of range, negative counts).
        """
        hist = cls()
        hist._load(checked(state, "bins", "i", (2, -1)), checked(state, "scalars", "f", (7,)))
        return hist

    def _load(self, bins: np.ndarray, scalars: np.ndarray) -> None:
        index, counts = bins
        # Strictly increasing bins in range, counts >= 0: checked in few numpy calls (a
        # store holds thousands of these).
        if index.size and (index[0] < 0 or index[-1] >= _BINS or (index[1:] <= index[:-1]).any()):
            raise ValueError("histogram bins out of range or out of order")
        if index.size and counts.min() < 0:
            raise ValueError("negative histogram counts")
        zeros, underflow, overflow, nan, low, high, positive = scalars.tolist()
        tallies = (zeros, underflow, overflow, nan)
        if min(tallies) < 0 or any(t != int(t) for t in tallies):
            raise ValueError("negative or fractional histogram counts")
        kept = counts > 0
        self._dense = None
        self._used, self._used_counts = index[kept].astype(np.int64), counts[kept].astype(np.int64)
        self.zeros, self.underflow, self.overflow, self.nan = (int(t) for t in tallies)
        self.min, self.max, self.min_positive = low, high, positive

    def __eq__(self, other: object) -> bool:
        """The same counts and extremes (NaN-free: `min` and `max` are of finite values)."""
        scalars = ("zeros", "underflow", "overflow", "nan", "min", "max", "min_positive")
        return (
            isinstance(other, LogHistogram)
            and all(map(np.array_equal, self.bins_used(), other.bins_used()))
            and all(getattr(self, k) == getattr(other, k) for k in scalars)
        )


def keyed_state(hists: Mapping[int, LogHistogram]) -> dict[str, np.ndarray]:
    """Histograms keyed by an integer (a step) as two plain arrays, for `from_keyed_state`:
    `bins`, int64 [3, k] (key, bin, count of each bin in use) and `scalars`, float64 [n, 8]
    (the key, then `LogHistogram.state`'s scalars)."""
    bins = [
        np.stack([np.full(used.size, key), used, counts])
        for key, hist in hists.items()
        for used, counts in (hist.bins_used(),)
    ]
    scalars = [np.r_[key, hist._scalars()] for key, hist in hists.items()]
    return {
        "bins": np.concatenate(bins, axis=1) if bins else np.zeros((3, 0), np.int64),
        "scalars": np.stack(scalars) if scalars else np.zeros((0, 8)),
    }


def from_keyed_state(state: Mapping[str, np.ndarray]) -> dict[int, LogHistogram]:
    """The histograms `keyed_state` wrote.

    Raises:
        ValueError: `state` is not one `keyed_state` wrote.
    """
    bins = checked(state, "bins", "i", (3, -1))
    scalars = checked(state, "scalars", "f", (-1, 8))
    # Each key's bins found by bisection in the bins sorted by key (a run's merge holds
    # thousands of steps).
    order = np.argsort(bins[0], kind="stable")
    keys, sorted_bins = bins[0, order], bins[1:, order]
    out: dict[int, LogHistogram] = {}
    for row in scalars:
        key = int(row[0])
        if key in out or key != row[0]:
            raise ValueError("histogram keys repeated or not integers")
        out[key] = hist = LogHistogram()
        lo, hi = (int(np.searchsorted(keys, key, side=side)) for side in ("left", "right"))
        hist._load(sorted_bins[:, lo:hi], row[1:])
    if not np.isin(bins[0], list(out)).all():
        raise ValueError("histogram bins of no histogram")
    return out


def checked(
    state: Mapping[str, np.ndarray], name: str, kind: str, shape: tuple[int, ...]
) -> np.ndarray:
    """`state[name]`, checked to be a numpy array of dtype kind `kind` ("i" integers, "f"
    floats, "u" bytes) and of `shape` (-1: any length).

    Raises:
        ValueError: it is missing, or of another kind or shape.
    """
    value = state.get(name)
    if not isinstance(value, np.ndarray) or value.dtype.kind not in _KINDS[kind]:
        raise ValueError(f"{name}: expected a numpy array of kind {kind!r}")
    found = value.shape
    if len(found) != len(shape) or not all(
        e == -1 or e == v for e, v in zip(shape, found, strict=True)
    ):
        raise ValueError(f"{name}: expected shape {shape}, found {found}")
    return value


_KINDS = {"i": "iu", "f": "f", "u": "u"}
"""The numpy dtype kinds each kind of `checked` takes."""


_BINS = int((LOG10_RANGE[1] - LOG10_RANGE[0]) * BINS_PER_DECADE)
_NONE = np.zeros(0, dtype=np.int64)


@dataclass(frozen=True, slots=True, eq=False)
class Binned:
    """Finite, non-negative values counted in `LogHistogram` bins, ready to `add`.

    Attributes:
        values: the flattened values (None where they were not gathered, `bin_chosen`).
        index: int32 per value, its slot in `counts`, or None where not kept.
        counts: int64 [bins + 2]: underflow and zeros, the bins, overflow.
        zeros, low, high, min_positive: the exact count of zeros, min, max and smallest
            positive value (inf when none).
    """

    values: torch.Tensor | None
    index: torch.Tensor | None
    counts: np.ndarray
    zeros: int
    low: float
    high: float
    min_positive: float


def bin_values(
    values: torch.Tensor,
    counts: np.ndarray | None = None,
    *,
    like: Binned | None = None,
    keep_index: bool = True,
) -> Binned | None:
    """Bin `values` for a `LogHistogram`; None when some are NaN, infinite or negative.

    The float32 log10 is exact enough for all but the values within 0.002 bins of an edge,
    which are re-binned with the float64 formula: the counts equal those of binning every
    value in float64. With `like` (values of the same shape binned before, e.g. the raw
    ratios when binning the weights truncated from them) only the values that differ from
    `like.values` are binned; values taking at most two distinct values (pure masks) are
    counted without binning. `keep_index=False` leaves `index` in scratch memory (None in
    the result) when no later call will bin `like` these values. `counts` (int [len(values)])
    says how many times each value occurs (values of whole sequences, counted once each).
    """
    x = values.detach().flatten()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.double()
    if counts is not None:
        return _bin_counted(x, np.asarray(counts, dtype=np.int64))
    n = x.numel()
    if n == 0:
        return None
    similar = like is not None and like.index is not None and like.values.shape == x.shape
    flag = ops.scratch("hist.flag", n, torch.bool, x.device)
    found = _stats(x, like.values if similar else None, flag)
    if not found.clean:
        return None
    zeros, low, high, min_positive = found.zeros, found.low, found.high, found.min_positive
    if not similar:
        compiled = _compiled(x, low, high, keep_index)
        if compiled is not None:
            return compiled[0]
    counts = np.zeros(_BINS + 2, dtype=np.int64)
    if low == high or (zeros and min_positive == high):
        # Constant or two-valued (0 and w): no per-value binning needed.
        if zeros:
            counts[0] += zeros
        if high > 0:
            slot = _slots(torch.tensor([high], dtype=torch.float64), keep=True)
            counts[int(slot[0])] += n - zeros
        return Binned(x, None, counts, zeros, low, high, min_positive)
    if similar and found.differ * 2 < n:
        counts += like.counts
        if found.differ:
            changed = ops.nonzero(ops.compare("ne", x, like.values, flag))
            if not _rebinned(x, like, changed, counts):
                counts -= _bincount(like.index[changed], _BINS + 2)
                counts += _bincount(_slots(x[changed], keep=False), _BINS + 2)
        return Binned(x, None, counts, zeros, low, high, min_positive)
    compiled = _compiled(x, low, high, keep_index)
    if compiled is not None:
        return compiled[0]
    index = _slots(x, keep=keep_index)
    counts += _bincount(index, _BINS + 2)
    return Binned(x, index if keep_index else None, counts, zeros, low, high, min_positive)


def _stats(x: torch.Tensor, like: torch.Tensor | None, flag: torch.Tensor) -> kernels.ValueStats:
    """`kernels.value_stats` of flat values, computed here where the kernel does not answer
    (`flag`: bool scratch of x's size); a zero min or max is the zero torch's `aminmax`
    gives, as the histogram reports it."""
    same = like is None or like.dtype == x.dtype
    found = None
    if x.device.type == "cpu" and same:
        found = kernels.value_stats(x.numpy(), None if like is None else like.numpy())
    if found is not None and not (found.negative_zeros and (found.low == 0.0 or found.high == 0.0)):
        return found
    low, high = (float(v) for v in torch.aminmax(x))  # NaN when any value is NaN
    if not (low >= 0.0 and math.isfinite(high)):
        return kernels.ValueStats(clean=False)
    if found is not None:  # a zero min or max: which zero is torch's
        return found._replace(low=low, high=high)
    n = x.numel()
    zeros = _count(ops.compare("eq", x, 0.0, flag))
    min_positive = math.inf if zeros == n else low if zeros == 0 else _min_positive(x)
    differ = 0 if like is None else _count(ops.compare("ne", x, like, flag))
    return kernels.ValueStats(True, zeros, 0, low, high, min_positive, differ)


def bin_chosen(values: torch.Tensor, chosen: torch.Tensor) -> tuple[Binned, Binned | None] | None:
    """`bin_values(values)` and `bin_values(values[chosen])` (`chosen`: bool, values'
    shape; the second None where none is chosen), in one pass over the values and without
    gathering the chosen ones, where the kernels run; else None (for the caller to bin each).
    The second has no `values`."""
    x = values.detach().flatten()
    if x.numel() == 0 or x.dtype not in (torch.float32, torch.float64):
        return None
    low, high = (float(v) for v in torch.aminmax(x))
    if not (low >= 0.0 and math.isfinite(high)):
        return None
    found = _compiled(x, low, high, keep_index=False, chosen=chosen.flatten())
    if found is None:
        return None
    binned, counts, (zeros, low, high, min_positive) = found
    if not counts.any():
        return binned, None
    if low == 0.0 or high == 0.0:  # which of +0 and -0: torch's, as `bin_values` gives
        low, high = (float(v) for v in torch.aminmax(x[chosen.flatten()]))
    return binned, Binned(None, None, counts, int(zeros), low, high, min_positive)


def _compiled(
    x: torch.Tensor,
    low: float,
    high: float,
    keep_index: bool,
    chosen: torch.Tensor | None = None,
) -> tuple[Binned, np.ndarray, np.ndarray] | None:
    """`bin_values` of x (flat, finite, >= 0, of min `low` and max `high`) in one compiled
    pass (`kernels.log_bins`), with the counts and the stats of the values where `chosen`;
    None off the CPU or without the kernels."""
    if x.device.type != "cpu" or (chosen is not None and chosen.device.type != "cpu"):
        return None
    index = torch.empty(x.numel(), dtype=torch.int32) if keep_index else None
    found = kernels.log_bins(
        x.numpy(),
        _slot_table(x.dtype),
        _BINS + 2,
        None if index is None else index.numpy(),
        None if chosen is None else chosen.numpy(),
    )
    if found is None:
        return None
    counts, stats = found
    zeros, min_positive = int(stats[0, 0]), float(stats[0, 3])
    return Binned(x, index, counts[0], zeros, low, high, min_positive), counts[1], stats[1]


def _rebinned(x: torch.Tensor, like: Binned, changed: torch.Tensor, counts: np.ndarray) -> bool:
    """Move the values x[changed] in `counts` (`like`'s) from their slots in `like` to their
    own (`kernels.rebin`, one pass over them instead of two gathers and two bincounts);
    False (nothing done) off the CPU or without the kernels."""
    if x.device.type != "cpu" or like.index.device.type != "cpu":
        return False
    table = _slot_table(x.dtype)
    return kernels.rebin(x.numpy(), like.index.numpy(), changed.numpy(), table, counts)


def _bin_counted(x: torch.Tensor, counts: np.ndarray) -> Binned | None:
    """`bin_values` of values x[i] occurring counts[i] times each."""
    present = counts > 0
    x, counts = x[torch.from_numpy(present)], counts[present]
    if x.numel() == 0:
        return None
    low, high = (float(v) for v in torch.aminmax(x))
    if not (low >= 0.0 and math.isfinite(high)):
        return None
    zero = (x == 0).cpu().numpy()
    positive = x[torch.from_numpy(~zero).to(x.device)]
    return Binned(
        values=x,
        index=None,
        counts=np.bincount(_slot_index(x), weights=counts, minlength=_BINS + 2).astype(np.int64),
        zeros=int(counts[zero].sum()),
        low=low,
        high=high,
        min_positive=float(positive.min()) if positive.numel() else math.inf,
    )


def _slot_index(x: torch.Tensor) -> np.ndarray:
    """The slot of each of x's values (flat, finite, >= 0): from the table of bits in one
    compiled pass (`kernels.log_bins`) where the kernels run, else `_slots`."""
    if x.device.type == "cpu" and x.dtype in (torch.float32, torch.float64):
        index = np.empty(x.numel(), np.int32)
        if kernels.log_bins(x.numpy(), _slot_table(x.dtype), _BINS + 2, index) is not None:
            return index
    return _slots(x, keep=True).long().cpu().numpy()


@functools.cache
def _slot_table(dtype: torch.dtype) -> tuple[int, int, np.ndarray, np.ndarray]:
    """The slot of every value of `dtype` (float32 or float64) by its bits, for
    `kernels.log_bins`: (first cell, shift, int32 slot of each cell, the value of `dtype`
    from which a cell's slot is one more, inf where none is).

    A cell is the values sharing their exponent and top `_CELL_BITS` mantissa bits (0.1% of
    a value wide; a bin is 1.2%, so a cell holds at most one edge), from below 1e-12 (cell 0:
    slot 0, and every value below it) to above 1e8 (the last: overflow). Each cell's slot and
    the threshold where the next starts are those of the float64 formula (`_log_bin`) at the
    cell's first value, and at its edge found by bisection over the bit patterns: the
    table gives every value the slot the formula does, by construction.
    """
    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    unsigned = np.uint64 if np_dtype == np.float64 else np.uint32
    shift = np.finfo(np_dtype).nmant - _CELL_BITS
    lowest, highest = (
        2.0 ** (math.floor(e * math.log2(10.0)) + d)
        for e, d in ((LOG10_RANGE[0], -1), (LOG10_RANGE[1], 1))
    )
    first, last = (
        int(np.array([v], np_dtype).view(unsigned)[0]) >> shift for v in (lowest, highest)
    )
    cells = np.arange(first, last + 1, dtype=np.int64)
    starts, ends = cells << shift, ((cells + 1) << shift) - 1  # each cell's first and last bits

    def slot(bits: np.ndarray) -> np.ndarray:
        values = bits.astype(unsigned).view(np_dtype).astype(np.float64)
        return (_log_bin(torch.from_numpy(values), _BINS) + 1).numpy()

    below, above = slot(starts), slot(ends)
    edge = np.flatnonzero(above > below)
    a, b = starts[edge], ends[edge]  # slot(a) is the cell's, slot(b) one more
    while (b - a > 1).any():
        middle = a + (b - a) // 2
        up = slot(middle) > below[edge]
        a, b = np.where(up, a, middle), np.where(up, middle, b)
    thresholds = np.full(cells.size, np.inf, np_dtype)
    thresholds[edge] = b.astype(unsigned).view(np_dtype)
    return first, shift, below.astype(np.int32), thresholds


_CELL_BITS = 10
"""Mantissa bits of a `_slot_table` cell: 1024 cells per power of two."""


def _slots(x: torch.Tensor, keep: bool) -> torch.Tensor:
    """int32 slot of finite non-negative values: 0 below 1e-12 (zeros too), bin + 1, or
    `bins + 1` from 1e8 up; a fresh tensor if `keep`, else scratch memory.

    u = 200 log10(x) in float32 is the position in bins from 10^0, and the slot is
    floor(u) + 2401. float32 log10 (numpy's SIMD one errs by at most 4 ulps) and the rounding
    of float64 input to float32 put u within 1e-5 + 4e-7 |u| bins of its exact value; values
    within `_ABS_MARGIN + _REL_MARGIN |u|` of an integer are re-binned in float64.
    """
    n = x.numel()

    def buf(name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return ops.scratch(f"hist.{name}", n, dtype, x.device)

    index = (
        torch.empty(n, dtype=torch.int32, device=x.device) if keep else buf("index", torch.int32)
    )
    offset = 1.0 - LOG10_RANGE[0] * BINS_PER_DECADE
    if x.device.type == "cpu":
        u, floor, margin = buf("u").numpy(), buf("floor").numpy(), buf("margin").numpy()
        errors = np.errstate(over="ignore", invalid="ignore")  # beyond float32: inf, inf - inf
        errors.__enter__()
        np.copyto(u, x.numpy(), casting="same_kind")
        # Zeros are raised to a tiny value (still underflow): log10 is slower on zeros.
        np.maximum(u, np.float32(_TINY), out=u)
        np.log10(u, out=u)
        u *= np.float32(BINS_PER_DECADE)
        np.floor(u, out=floor)
        np.abs(u, out=margin)
        margin *= np.float32(_REL_MARGIN)
        margin += np.float32(_ABS_MARGIN - 0.5)
        u -= floor
        u -= np.float32(0.5)
        np.abs(u, out=u)
        u += margin
        near_mask = buf("near", torch.bool)
        np.greater(u, np.float32(0.0), out=near_mask.numpy())
        near = ops.nonzero(near_mask)
        floor += np.float32(offset)
        np.clip(floor, 0, _BINS + 1, out=floor)
        np.copyto(index.numpy(), floor, casting="unsafe")
        errors.__exit__(None, None, None)
    else:
        u = buf("u").copy_(x).clamp_(min=_TINY)
        u.log10_().mul_(BINS_PER_DECADE)
        floor = torch.floor(u, out=buf("floor"))
        margin = torch.abs(u, out=buf("margin")).mul_(_REL_MARGIN).add_(_ABS_MARGIN - 0.5)
        frac = u.sub_(floor).sub_(0.5).abs_()
        near = ops.nonzero(torch.gt(frac.add_(margin), 0.0, out=buf("near", torch.bool)))
        index.copy_(floor.add_(offset).clamp_(0, _BINS + 1))
    if near.numel():
        index[near] = _log_bin(x[near].double(), _BINS).add_(1).to(torch.int32)
    return index


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
        """Count the pairs (x[i], y[i]): bin floor((v - lo) * bins / (hi - lo)), clipped."""
        if x.numel() == 0:
            return
        scale = self.bins / (self.hi - self.lo)
        if x.device.type == "cpu" and kernels.joint_counts(
            x.numpy(), y.numpy(), self.lo, scale, self.counts
        ):
            return
        flat = self._index(x, "hist2d.x").mul_(self.bins).add_(self._index(y, "hist2d.y"))
        self.counts += _bincount(flat, self.bins * self.bins).reshape(self.bins, self.bins)

    def _index(self, v: torch.Tensor, name: str) -> torch.Tensor:
        """int32 bin of each value (in float64: exact for float32 log-probs), in scratch
        memory `name`."""
        scale = self.bins / (self.hi - self.lo)
        t = ops.scratch("hist2d.t", v.numel(), torch.float64, v.device).copy_(v)
        t.sub_(self.lo).mul_(scale).floor_().clamp_(0, self.bins - 1)
        return ops.scratch(name, v.numel(), torch.int32, v.device).copy_(t)

    def merge(self, other: Histogram2D) -> None:
        self.counts += other.counts

    def state(self) -> dict[str, np.ndarray]:
        """The cells in use as one plain array, for `load_state`: `cells`, int64 [2, k] (each
        cell in use, row-major, and its count; the grid is fixed by the caller)."""
        used = np.flatnonzero(self.counts)
        return {"cells": np.stack([used, self.counts.ravel()[used]])}

    def load_state(self, state: Mapping[str, np.ndarray]) -> None:
        """Take the counts `state()` wrote (of a histogram on this grid).

        Raises:
            ValueError: `state` is not one `state()` of this grid wrote.
        """
        cells, counts = checked(state, "cells", "i", (2, -1))
        if cells.size and (cells.min() < 0 or cells.max() >= self.counts.size):
            raise ValueError("histogram cells out of range")
        if (counts < 0).any() or np.unique(cells).size != cells.size:
            raise ValueError("negative or repeated histogram cells")
        self.counts[...] = 0
        self.counts.ravel()[cells] = counts


_ABS_MARGIN = 1e-5
_REL_MARGIN = 4e-6

_TINY = 3e-38
"""Stand-in for zero before a float32 log10: far below 1e-12, and 0.42 bins from an edge."""


def _count(mask: torch.Tensor) -> int:
    """Number of true values of a bool tensor."""
    if mask.device.type == "cpu":
        return int(np.count_nonzero(mask.numpy()))
    return int(torch.count_nonzero(mask))


def _log_bin(x: torch.Tensor, bins: int) -> torch.Tensor:
    """Exact bin of positive float64 values, shifted by one: -1 underflow, `bins` overflow."""
    logs = torch.log10(x)
    lo, hi = LOG10_RANGE
    index = ((logs - lo) * BINS_PER_DECADE).long().clamp_(max=bins - 1)
    index = torch.where(logs < lo, -1, index)
    return torch.where(logs >= hi, bins, index)


def _bincount(index: torch.Tensor, size: int) -> np.ndarray:
    """int64 [size] counts of `index` (values in [0, size))."""
    if index.numel() == 0:
        return np.zeros(size, dtype=np.int64)
    return torch.bincount(index, minlength=size).cpu().numpy()


def _min_positive(x: torch.Tensor) -> float:
    """The smallest positive value of finite, non-negative x with at least one positive."""
    if x.device.type != "cpu":
        return float(torch.where(x > 0, x, torch.inf).min())
    # Positive floats order like their bit patterns; minus one (wrapping) sends +0 and -0
    # above every positive one.
    unsigned = np.uint32 if x.dtype == torch.float32 else np.uint64
    bits = x.numpy().view(unsigned)
    smallest = (bits - unsigned(1)).min() + unsigned(1)
    return float(np.array([smallest], dtype=unsigned).view(x.numpy().dtype)[0])


def log2_bucket(values: torch.Tensor) -> torch.Tensor:
    """int64 bucket index floor(log2(v)) for v >= 1 (bucket b holds [2^b, 2^(b+1)))."""
    return torch.floor(torch.log2(values.double().clamp(min=1.0))).long()


def bucket_label(b: int) -> str:
    """The range of log2 bucket `b`, e.g. '512-1023'."""
    return f"{2**b}-{2 ** (b + 1) - 1}"


PLOT_RESOLUTIONS = (10, 20, 25, 40, 50, 100, 200)
"""Bins per decade a histogram is reported at (divisors of `BINS_PER_DECADE`)."""


def plot_resolution(hist: LogHistogram, central: float = 0.98, bins: int = 80) -> int:
    """The coarsest of `PLOT_RESOLUTIONS` at which the central `central` share of the binned
    values spans at least `bins` bins (the finest when none does): a plot can then choose its
    own coarsening from the data's spread, and a narrow peak near 1 keeps its shape.

    >>> h = LogHistogram()
    >>> h.update(torch.linspace(0.9, 1.1, 1000, dtype=torch.float64))
    >>> plot_resolution(h)
    200
    """
    cumulative = np.cumsum(hist.counts)
    total = cumulative[-1] if cumulative.size else 0
    if not total:
        return PLOT_RESOLUTIONS[0]
    tail = (1.0 - central) / 2.0
    lo = int(np.searchsorted(cumulative, tail * total, side="right"))
    hi = int(np.searchsorted(cumulative, (1.0 - tail) * total, side="left"))
    span = hi - lo + 1  # in bins of 1 / BINS_PER_DECADE decades
    for per_decade in PLOT_RESOLUTIONS:
        if span * per_decade >= bins * BINS_PER_DECADE:
            return per_decade
    return PLOT_RESOLUTIONS[-1]
