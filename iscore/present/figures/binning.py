"""Re-binning the analysis' fine histograms per figure, so that the central share of the data
spans 40 to 80 bins wherever it lies, and the shapes bars and step lines are drawn from."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence


def rebin(
    edges: Sequence[float],
    counts: Sequence[float],
    *,
    central: float = 0.98,
    most: int = 80,
    tails: int | None = 5,
) -> tuple[list[float], list[float]]:
    """A log-spaced histogram merged into fewer, wider bins, for a plot.

    Inside the central `central` share of the counts, bins merge `g` at a time, the smallest
    `g` with which that range spans at most `most` bins (so at least `most / 2` where the
    input resolves that many). Beyond it the tails get at most `tails` bins per decade
    (`None`: the same bins as the centre), so that a few outliers decades away cost few
    points. Bins are anchored at 1 (an edge stays at 1); empty bins at either end are dropped.
    Bins may differ in width: divide by `widths(edges)` for a density.

    >>> edges = [10 ** (k / 200) for k in range(-400, 401)]
    >>> new_edges, new_counts = rebin(edges, [1] * 800)
    >>> len(new_counts), new_edges[0], sum(new_counts)
    (80, 0.01, 800)
    """
    edges, counts = list(edges), list(counts)
    if len(counts) < 2:
        return edges, counts
    per_decade = round(1.0 / math.log10(edges[1] / edges[0]))
    lo, hi = central_bins(counts, central)
    group = max(1, math.ceil((hi - lo + 1) / most))
    wide = group if tails is None else max(group, per_decade // tails // group * group)
    # Fine bin i has lower edge 10^((first + i) / per_decade); the centre is widened to
    # multiples of `wide`, so that both grids line up.
    first = round(math.log10(edges[0]) * per_decade)
    start = math.floor(first / wide) * wide
    end = -math.floor(-(first + len(counts)) / wide) * wide
    c0 = math.floor((first + lo) / wide) * wide
    c1 = -math.floor(-(first + hi + 1) / wide) * wide
    padded = [0.0] * (first - start) + counts + [0.0] * (end - first - len(counts))
    bounds = [
        *range(start, c0, wide),
        *range(c0, c1, group),
        *range(c1, end + 1, wide),
    ]
    grouped = [sum(padded[a - start : b - start]) for a, b in itertools.pairwise(bounds)]
    return _trim([10.0 ** (k / per_decade) for k in bounds], grouped)


def widths(edges: Sequence[float]) -> list[float]:
    """The width in decades of each bin of a log-spaced histogram."""
    return [math.log10(b / a) for a, b in itertools.pairwise(edges)]


def central_bins(counts: Sequence[float], central: float) -> tuple[int, int]:
    """The first and last bin of the central `central` share of the counts."""
    total = sum(counts)
    tail = (1.0 - central) / 2.0 * total
    cumulative = list(itertools.accumulate(counts))
    lo = next(i for i, c in enumerate(cumulative) if c > tail)
    hi = next(i for i, c in enumerate(cumulative) if c >= total - tail)
    return lo, hi


def _trim(edges: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return edges[:1], []
    return edges[used[0] : used[-1] + 2], counts[used[0] : used[-1] + 1]


def bin_data(edges: Sequence[float], shares: Sequence[float]) -> list[list[float]]:
    """Per point of a `step_outline` line: its bin's edges and share (the last point closes
    the line)."""
    bins = [[a, b, share] for (a, b), share in zip(itertools.pairwise(edges), shares, strict=True)]
    return [*bins, [edges[-1], edges[-1], 0.0]]


def step_outline(
    edges: Sequence[float], values: Sequence[float]
) -> tuple[list[float], list[float]]:
    """x and y of a step line (`line.shape = "hv"`) drawing `values` over the bins."""
    return list(edges), [*values, values[-1]]


def regroup(fine_edges: Sequence[float], counts: Sequence[float], edges: Sequence[float]) -> list:
    """`counts` over `fine_edges` summed into the coarser bins `edges` (whose edges are among
    the fine ones, up to rounding); counts outside them are dropped."""
    out = [0.0] * (len(edges) - 1)
    j = 0
    for (a, _), c in zip(itertools.pairwise(fine_edges), counts, strict=True):
        while j < len(out) and a >= edges[j + 1] * (1 - 1e-9):
            j += 1
        if j < len(out) and a >= edges[j] * (1 - 1e-9):
            out[j] += c
    return out


def decade_label(k: int) -> str:
    """10^k as a tick label: plain down to 0.01, a power below."""
    return f"{10.0**k:g}" if k >= -2 else f"10<sup>{k}</sup>".replace("-", "\u2212")
