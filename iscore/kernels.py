"""Compiled CPU kernels for the robust statistics of `iscore.noise`: exact medians by selection.

An analysis takes, per step, the median and MAD of every loss token's log-ratio, those of each
rollout-probability bin, each sequence's median, and each token's distance from its bin's
noise. numpy sorts or partitions for each; these kernels select instead, and give the same
values:

- `median_mad`: a radix selection on the values' bit patterns (their order is the values'):
  one pass counts the top 16 bits, one gathers the few values that share the median's, and
  those are narrowed 16 bits at a time; 6-8x numpy's two `np.median`.
- `segment_medians`: a quickselect per segment, the segments in parallel.
- `far_counts`: `noise.deviations` compared with `noise.FAR` and counted per sequence, in two
  passes over the tokens and without an argsort.

The numpy functions of `iscore.noise` stay the reference and the fallback: without numba, under
`ISCORE_KERNELS=reference`, off float64 input, and for values that are not all finite (where
the reference defines what NaN and infinities give). A median of zeros is +0 on both paths.

numba compiles the kernels once per machine into the user's cache directory
(`$XDG_CACHE_HOME/iscore/numba`, else `~/.cache/iscore/numba`; a `NUMBA_CACHE_DIR` of the
user's own wins); the first compile says so on stderr.
"""

from __future__ import annotations

import functools
import os
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np

ENV = "ISCORE_KERNELS"
"""`ISCORE_KERNELS=reference` runs the numpy reference everywhere (tests and `iscore bench`
compare the two)."""


def enabled() -> bool:
    """Whether the compiled kernels run (numba installed and not turned off by `ENV`)."""
    return os.environ.get(ENV, "") != "reference" and _compiled() is not None


def median_mad(x: np.ndarray) -> tuple[float, float] | None:
    """(median of x, median of |x - that median|) of a non-empty float64 array, exactly as
    `np.median` gives them; None where the reference must answer (see the module)."""
    if x.dtype != np.float64 or not enabled():
        return None
    k = _ready()
    x = np.ascontiguousarray(x)
    n = x.size
    center, mad = k.median_mad(
        x, _buffer("keys", n, np.uint64), _buffer("hist", _DIGITS, np.int64), _buffer("dev", n)
    )
    return None if np.isnan(center) or np.isnan(mad) else (center, mad)


def segment_medians(values: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """float64 [B]: the median of each segment's values (0 for an empty one), segment i the
    next `counts[i]` values; None where the reference must answer."""
    if values.dtype != np.float64 or not enabled():
        return None
    k = _ready()
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    medians = np.zeros(n.size)
    work = _buffer("work", values.size)
    finite = k.segment_medians(np.ascontiguousarray(values), starts, n, work, medians)
    return medians if finite else None


def far_counts(
    d: np.ndarray,
    bins: np.ndarray,
    counts: np.ndarray,
    bin_count: int,
    far: float,
    floor: float,
    sample: int,
    mad_sd: float,
) -> np.ndarray | None:
    """float64 [B]: per segment (the next `counts[i]` tokens), how many tokens lie more than
    `far` spreads from the centre of their bin (`bins`, uint8 below `bin_count`), each bin's
    centre and spread the median and `mad_sd` x MAD of an evenly strided sample of its tokens
    (stride n // `sample`), the spread floored at `floor`: what `noise.deviations` and
    `noise.segment_counts` give; None where the reference must answer."""
    if d.dtype != np.float64 or not enabled():
        return None
    k = _ready()
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    out = np.zeros(n.size)
    size = min(d.size, 2 * sample + bin_count)
    finite = k.far_counts(
        np.ascontiguousarray(d),
        np.ascontiguousarray(bins, dtype=np.uint8),
        starts,
        n,
        bin_count,
        far,
        floor,
        sample,
        mad_sd,
        _buffer("sample", d.size),
        _buffer("keys", size, np.uint64),
        _buffer("hist", _DIGITS, np.int64),
        _buffer("dev", size),
        out,
    )
    return out if finite else None


_DIGITS = 1 << 16
"""Buckets of one radix pass: 16 bits of the keys at a time."""


def _buffer(name: str, n: int, dtype: type = np.float64) -> np.ndarray:
    """[n] scratch memory (`ops.scratch`, reused inside `ops.reused_buffers()`)."""
    import torch  # here: `iscore.noise`, which imports this module, runs without torch

    from iscore import ops

    item = np.dtype(dtype).itemsize
    raw = ops.scratch(f"kernels.{name}", n * item, torch.uint8, "cpu")
    return raw.numpy().view(dtype)


def _ready() -> SimpleNamespace:
    """The compiled kernels, saying once on stderr when they are compiled for the first time
    on this machine."""
    kernels = _compiled()
    if not _announced:
        _announced.append(True)
        if not _cached_on_disk(kernels.median_mad):
            print("iscore: compiling kernels (once per machine)...", file=sys.stderr, flush=True)
    return kernels


_announced: list[bool] = []


def _cached_on_disk(kernel: Any) -> bool:
    """Whether numba's disk cache holds a compiled version of `kernel` (an index file)."""
    try:
        folder = kernel._cache._cache_path
        return any(name.endswith(".nbi") for name in os.listdir(folder))
    except (AttributeError, OSError):
        return False


@functools.cache
def _compiled() -> SimpleNamespace | None:
    """The kernels (compiled on first call, or loaded from the disk cache), or None without
    numba."""
    try:
        import numba
    except ImportError:
        return None
    if not os.environ.get("NUMBA_CACHE_DIR"):
        from iscore.store import default_folder

        numba.config.CACHE_DIR = str(default_folder() / "numba")
    return _build(numba)


def _build(numba: Any) -> SimpleNamespace:
    jit = functools.partial(numba.njit, cache=True, nogil=True)
    prange = numba.prange
    sign, ones = np.uint64(1 << 63), np.uint64((1 << 64) - 1)
    top, mask = np.uint64(48), np.uint64(_DIGITS - 1)

    @jit(inline="always")
    def ordered(u, signed):
        """The key of a float64's bits: keys order as the values (-0 just below +0; a
        median adds +0, which makes either +0). Branch-free: a branch on the sign costs 3x
        the whole pass."""
        if not signed:
            return u
        return u ^ ((np.uint64(0) - (u >> np.uint64(63))) | sign)  # negatives: every bit

    @jit
    def value(key, signed):
        if signed:
            key = key ^ sign if key >> np.uint64(63) else key ^ ones
        out = np.empty(1, np.uint64)
        out[0] = key
        return out.view(np.float64)[0]

    @jit
    def gather(values, signed, k, hist, keys):
        """Count the top 16 bits of every key; gather the keys that share those of the k-th
        smallest into `keys`: (how many, the k-th's rank among them), (-1, 0) when a value
        is not finite."""
        u = values.view(np.uint64)
        hist[:] = 0
        for i in range(u.size):
            if values[i] - values[i] != 0.0:  # NaN or infinite
                return -1, 0
            hist[ordered(u[i], signed) >> top] += 1
        below = 0
        digit = 0
        while below + hist[digit] <= k:
            below += hist[digit]
            digit += 1
        m = 0
        chosen = np.uint64(digit)
        for i in range(u.size):
            key = ordered(u[i], signed)
            if key >> top == chosen:
                keys[m] = key
                m += 1
        return m, k - below

    @jit
    def narrow(keys, m, rank, hist):
        """The rank-th smallest of keys[:m], which share their top 16 bits: the next 16
        bits at a time, keeping those that share the wanted key's."""
        shift = np.uint64(32)
        for _ in range(3):
            if m <= 1:
                break
            hist[:] = 0
            for i in range(m):
                hist[(keys[i] >> shift) & mask] += 1
            below = 0
            digit = 0
            while below + hist[digit] <= rank:
                below += hist[digit]
                digit += 1
            rank -= below
            j = 0
            chosen = np.uint64(digit)
            for i in range(m):
                if (keys[i] >> shift) & mask == chosen:
                    keys[j] = keys[i]
                    j += 1
            m = j
            shift -= np.uint64(16)
        return keys[0]

    @jit
    def lower(values, signed, key, k):
        """The (k-1)-th smallest key, knowing the k-th: the largest below it, or it."""
        u = values.view(np.uint64)
        less = 0
        best = np.uint64(0)
        for i in range(u.size):
            other = ordered(u[i], signed)
            smaller = other < key
            less += smaller
            best = max(best, other if smaller else np.uint64(0))
        return best if less >= k else key

    @jit
    def middle(values, signed, keys, hist):
        """np.median of finite values (+0 for zeros); NaN when one is not finite."""
        n = values.size
        k = n // 2
        m, rank = gather(values, signed, k, hist, keys)
        if m < 0:
            return np.nan
        upper = narrow(keys, m, rank, hist)
        under = lower(values, signed, upper, k) if n % 2 == 0 else upper
        return 0.5 * (value(under, signed) + value(upper, signed)) + 0.0

    @jit
    def median_mad(x, keys, hist, dev):
        center = middle(x, True, keys, hist)
        if np.isnan(center):
            return np.nan, np.nan
        deviation = dev[: x.size]
        for i in range(x.size):
            deviation[i] = abs(x[i] - center)
        return center, middle(deviation, False, keys, hist)

    @jit
    def select(a, lo, hi, k):
        """Partition a[lo:hi] so that a[k] holds its value in sorted order, every value
        before it no larger (Hoare's quickselect, median-of-three pivots; a sort once it
        takes too many rounds)."""
        rounds = 0
        while hi - lo > 16:
            rounds += 1
            if rounds > 64:
                a[lo:hi].sort()
                return
            mid = lo + (hi - lo) // 2
            p, q, r = a[lo], a[mid], a[hi - 1]
            pivot = max(min(p, q), min(max(p, q), r))
            i, j = lo, hi - 1
            while i <= j:
                while a[i] < pivot:
                    i += 1
                while a[j] > pivot:
                    j -= 1
                if i <= j:
                    a[i], a[j] = a[j], a[i]
                    i += 1
                    j -= 1
            if k <= j:
                hi = j + 1
            elif k >= i:
                lo = i
            else:
                return
        a[lo:hi].sort()

    @jit(parallel=True)
    def segment_medians(values, starts, counts, work, out):
        finite = np.ones(counts.size, np.bool_)
        for s in prange(counts.size):
            n, start = counts[s], starts[s]
            if n == 0:
                continue
            for t in range(start, start + n):
                work[t] = values[t]
                if values[t] - values[t] != 0.0:
                    finite[s] = False
            k = start + n // 2
            select(work, start, start + n, k)
            upper = work[k]
            under = upper
            if n % 2 == 0:
                under = work[start]
                for t in range(start + 1, k):
                    under = max(under, work[t])
            out[s] = 0.5 * (under + upper) + 0.0
        return finite.all()

    @jit(parallel=True)
    def far_counts(
        d, bins, starts, counts, bin_count, far, floor, sample, mad_sd, picked, keys, hist, dev,
        out,
    ):  # fmt: skip
        sizes = np.zeros(bin_count, np.int64)
        for i in range(d.size):
            sizes[bins[i]] += 1
        stride = np.maximum(sizes // sample, 1)
        offsets = np.zeros(bin_count + 1, np.int64)
        for b in range(bin_count):
            offsets[b + 1] = offsets[b] + (sizes[b] + stride[b] - 1) // stride[b]
        # Every stride-th token of each bin, in order.
        due = np.zeros(bin_count, np.int64)
        fill = offsets[:-1].copy()
        for i in range(d.size):
            b = bins[i]
            if due[b] == 0:
                picked[fill[b]] = d[i]
                fill[b] += 1
                due[b] = stride[b]
            due[b] -= 1
        center = np.zeros(bin_count)
        scale = np.ones(bin_count)
        for b in range(bin_count):
            if sizes[b] == 0:
                continue
            c, mad = median_mad(picked[offsets[b] : offsets[b + 1]], keys, hist, dev)
            if np.isnan(c) or np.isnan(mad):
                return False
            center[b] = c
            scale[b] = max(mad_sd * mad, floor)
        for s in prange(counts.size):
            total = 0
            for t in range(starts[s], starts[s] + counts[s]):
                b = bins[t]
                total += abs(d[t] - center[b]) / scale[b] > far
            out[s] = total
        return True

    return SimpleNamespace(
        median_mad=median_mad, segment_medians=segment_medians, far_counts=far_counts
    )
