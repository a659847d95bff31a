"""The numba kernels of `iscore.packed.kernels` (imported only where numba is installed, after the
cache folder is set): module-level functions, so that numba's disk cache finds them again in
the next process (a closure's cache key changes with each process's objects)."""

from __future__ import annotations

import functools
import math

import numba
import numpy as np
from numba import prange

DIGITS = 1 << 16
"""Buckets of one radix pass: 16 bits of the keys at a time."""

_jit = functools.partial(numba.njit, cache=True, nogil=True)
_SIGN, _ONES = np.uint64(1 << 63), np.uint64((1 << 64) - 1)
_TOP, _MASK = np.uint64(48), np.uint64(DIGITS - 1)


@_jit(inline="always")
def _ordered(u, signed):
    """The key of a float64's bits: keys order as the values (-0 just below +0; a
    median adds +0, which makes either +0). Branch-free: a branch on the sign costs 3x
    the whole pass."""
    if not signed:
        return u
    return u ^ ((np.uint64(0) - (u >> np.uint64(63))) | _SIGN)  # negatives: every bit


@_jit
def _value(key, signed):
    if signed:
        key = key ^ _SIGN if key >> np.uint64(63) else key ^ _ONES
    out = np.empty(1, np.uint64)
    out[0] = key
    return out.view(np.float64)[0]


@_jit
def _gather(values, signed, k, hist, keys):
    """Count the top 16 bits of every key; gather the keys that share those of the k-th
    smallest into `keys`: (how many, the k-th's rank among them), (-1, 0) when a value
    is not finite. `hist` is all zeros before and after (each count is reset as the second
    pass reads its key: no pass over the 65,536 counts of a selection)."""
    u = values.view(np.uint64)
    for i in range(u.size):
        if values[i] - values[i] != 0.0:  # NaN or infinite
            hist[:] = 0
            return -1, 0
        hist[_ordered(u[i], signed) >> _TOP] += 1
    below = 0
    digit = 0
    while below + hist[digit] <= k:
        below += hist[digit]
        digit += 1
    m = 0
    chosen = np.uint64(digit)
    for i in range(u.size):
        key = _ordered(u[i], signed)
        top = key >> _TOP
        hist[top] = 0
        if top == chosen:
            keys[m] = key
            m += 1
    return m, k - below


@_jit
def _narrow(keys, m, rank, hist):
    """The rank-th smallest of keys[:m], which share their top 16 bits: the next 16
    bits at a time, keeping those that share the wanted key's (`hist` all zeros before and
    after, as in `_gather`)."""
    shift = np.uint64(32)
    for _ in range(3):
        if m <= 1:
            break
        for i in range(m):
            hist[(keys[i] >> shift) & _MASK] += 1
        below = 0
        digit = 0
        while below + hist[digit] <= rank:
            below += hist[digit]
            digit += 1
        rank -= below
        j = 0
        chosen = np.uint64(digit)
        for i in range(m):
            part = (keys[i] >> shift) & _MASK
            hist[part] = 0
            if part == chosen:
                keys[j] = keys[i]
                j += 1
        m = j
        shift -= np.uint64(16)
    return keys[0]


@_jit
def _lower(values, signed, key, k):
    """The (k-1)-th smallest key, knowing the k-th: the largest below it, or it."""
    u = values.view(np.uint64)
    less = 0
    best = np.uint64(0)
    for i in range(u.size):
        other = _ordered(u[i], signed)
        smaller = other < key
        less += smaller
        best = max(best, other if smaller else np.uint64(0))
    return best if less >= k else key


@_jit
def _middle(values, signed, keys, hist):
    """np.median of finite values (+0 for zeros); NaN when one is not finite."""
    n = values.size
    k = n // 2
    m, rank = _gather(values, signed, k, hist, keys)
    if m < 0:
        return np.nan
    upper = _narrow(keys, m, rank, hist)
    under = _lower(values, signed, upper, k) if n % 2 == 0 else upper
    return 0.5 * (_value(under, signed) + _value(upper, signed)) + 0.0


@_jit
def median_mad(x, keys, hist, dev):
    if x.size >= SMALL:  # else a quickselect: the counts are not read
        hist[:] = 0
    return _median_mad(x, keys, hist, dev)


SMALL = 4096
"""Values below which a median is a quickselect: a radix selection reads its 65,536 counts
whatever the values (30 us; a quickselect of 100 values takes 2 us, of 4,000 as long)."""


@_jit
def _median_mad(x, keys, hist, dev):
    """`median_mad` with `hist` all zeros (and left so)."""
    if x.size < SMALL:
        a = dev[: x.size]
        for i in range(x.size):
            if x[i] - x[i] != 0.0:  # NaN or infinite
                return np.nan, np.nan
            a[i] = x[i]
        center = _median_in_place(a)
        for i in range(x.size):
            a[i] = abs(x[i] - center)
        return center, _median_in_place(a)
    center = _middle(x, True, keys, hist)
    if np.isnan(center):
        return np.nan, np.nan
    deviation = dev[: x.size]
    for i in range(x.size):
        deviation[i] = abs(x[i] - center)
    return center, _middle(deviation, False, keys, hist)


@_jit
def _select(a, k):
    """Partition a so that a[k] holds its value in sorted order, every value before it no
    larger: quickselect around a median of three, each round moving the values below the
    pivot to the front and, where k lies beyond them, those equal to it next (so ties end a
    round early). The partitions swap on every value and advance by the comparison, without
    a branch on it: twice as fast as Hoare's on random values, whose comparisons no branch
    predictor guesses. A sort once it takes too many rounds."""
    lo, hi = 0, a.size
    rounds = 0
    while hi - lo > 16:
        rounds += 1
        part = a[lo:hi]  # indexed from 0: see `_pairwise`
        if rounds > 64:
            part.sort()
            return
        p, q, r = part[0], part[part.size // 2], part[part.size - 1]
        pivot = max(min(p, q), min(max(p, q), r))
        below = 0
        for j in range(part.size):
            v = part[j]
            part[j] = part[below]
            part[below] = v
            below += v < pivot
        if k < lo + below:
            hi = lo + below
            continue
        rest = part[below:]
        equal = 0
        for j in range(rest.size):
            v = rest[j]
            rest[j] = rest[equal]
            rest[equal] = v
            equal += v == pivot
        if k < lo + below + equal:
            return
        lo += below + equal
    a[lo:hi].sort()


@_jit
def _median_in_place(a):
    """np.median of a's finite values (+0 for zeros), reordering them: a quickselect."""
    k = a.size // 2
    _select(a, k)
    upper = a[k]
    under = upper
    if a.size % 2 == 0:
        under = a[0]
        for t in range(1, k):
            under = max(under, a[t])
    return 0.5 * (under + upper) + 0.0


@_jit(parallel=True)
def segment_medians(values, starts, counts, work, out):
    finite = np.ones(counts.size, np.bool_)
    for s in prange(counts.size):
        n, start = counts[s], starts[s]
        if n == 0:
            continue
        x, a = values[start : start + n], work[start : start + n]  # slices: see `_pairwise`
        for t in range(n):
            a[t] = x[t]
            if x[t] - x[t] != 0.0:
                finite[s] = False
        out[s] = _median_in_place(a)
    return finite.all()


@_jit(parallel=True)
def step_noise(
    d, bins, at, size, starts, counts, step_of, bin_count, far, floor, sample, mad_sd, picked,
    keys, hist, dev, noise, out,
):  # fmt: skip
    """Per step j (the next `size[j]` tokens from `at[j]`): the median and MAD of its d into
    noise[j], and those of an evenly strided sample (stride n // `sample`) of each of its
    bins (`bins`, uint8 below `bin_count`); then per sequence s (the next `counts[s]` tokens
    from `starts[s]`, of step `step_of[s]`) into out[s], how many of its tokens lie more than
    `far` spreads (`mad_sd` x the bin's MAD, at least `floor`) from their bin's median.

    The steps are sampled in parallel, each into its own tokens' place in `picked`; then
    every step's median and every bin's are selected in parallel, thread p with the counts
    hist[p] (cleared first where a radix selection will read them) and the scratch `keys`
    and `dev` at the same place.
    Returns False where a value is not finite."""
    steps = size.size
    parts = hist.shape[0]
    if size.size and size.max() >= SMALL:  # else every median is a quickselect
        hist[:] = 0
    offsets = np.zeros((steps, bin_count + 1), np.int64)
    for j in prange(steps):
        lo, hi = at[j], at[j] + size[j]
        step_d, step_bins, step_picked = d[lo:hi], bins[lo:hi], picked[lo:hi]  # see `_pairwise`
        sizes = np.zeros(bin_count, np.int64)
        for i in range(step_bins.size):
            sizes[step_bins[i]] += 1
        stride = np.maximum(sizes // sample, 1)
        for b in range(bin_count):
            offsets[j, b + 1] = offsets[j, b] + (sizes[b] + stride[b] - 1) // stride[b]
        # Every stride-th token of each bin, in order.
        due = np.zeros(bin_count, np.int64)
        fill = offsets[j, :-1].copy()
        for i in range(step_bins.size):
            b = step_bins[i]
            if due[b] == 0:
                step_picked[fill[b]] = step_d[i]
                fill[b] += 1
                due[b] = stride[b]
            due[b] -= 1
    finite = np.ones(parts, np.bool_)
    for p in prange(parts):
        for j in range(p, steps, parts):
            lo, hi = at[j], at[j] + size[j]
            if lo == hi:
                continue
            c, mad = _median_mad(d[lo:hi], keys[lo:hi], hist[p], dev[lo:hi])
            noise[j, 0] = c
            noise[j, 1] = mad
            if np.isnan(c) or np.isnan(mad):
                finite[p] = False
    if not finite.all():
        return False
    center = np.zeros((steps, bin_count))
    scale = np.ones((steps, bin_count))
    for p in prange(parts):
        for task in range(p, steps * bin_count, parts):
            j, b = task // bin_count, task % bin_count
            lo, hi = at[j] + offsets[j, b], at[j] + offsets[j, b + 1]
            if lo == hi:
                continue
            c, mad = _median_mad(picked[lo:hi], keys[lo:hi], hist[p], dev[lo:hi])
            center[j, b] = c
            scale[j, b] = max(mad_sd * mad, floor)
    for s in prange(counts.size):
        j = step_of[s]
        lo, hi = starts[s], starts[s] + counts[s]
        seq_d, seq_bins = d[lo:hi], bins[lo:hi]
        total = 0
        for t in range(seq_d.size):
            b = seq_bins[t]
            total += abs(seq_d[t] - center[j, b]) / scale[j, b] > far
        out[s] = total
    return True


@_jit(inline="always")
def _slot(v, bits, first, shift, slots, thresholds):
    cell = min(max((bits >> shift) - first, 0), slots.size - 1)
    return slots[cell] + (v >= thresholds[cell])


@_jit(parallel=True)
def log_bins(x, bits, first, shift, slots, thresholds, chosen, counts, index, stats, parts):
    """Add the slots of finite values >= 0 by the tables of `histogram._slot_table` (cell =
    the bits' top bits from `first` on, clipped to the table; the slot there, one more from
    the cell's threshold on) to counts[0], and those of the values where `chosen` (empty:
    none) to counts[1]; write each value's slot to `index` unless it is empty. stats[j]:
    zeros, min, max and smallest positive value (inf when none) of each. x is cut in `parts`
    ranges, each counted apart (by a thread)."""
    keep = index.size == x.size
    pick = chosen.size == x.size
    local = np.zeros((parts, 2, counts.shape[1]), np.int64)
    found = np.empty((parts, 2, 4))
    for p in prange(parts):
        every, some = local[p, 0], local[p, 1]
        zeros = zeros_chosen = 0
        smallest = smallest_chosen = low = low_chosen = np.inf
        high = high_chosen = -np.inf
        for i in range(x.size * p // parts, x.size * (p + 1) // parts):
            v = x[i]
            slot = _slot(v, bits[i], first, shift, slots, thresholds)
            every[slot] += 1
            if keep:
                index[i] = slot
            zeros += v == 0.0
            positive = v if v > 0.0 else np.inf
            smallest = min(smallest, positive)
            low = min(low, v)
            high = max(high, v)
            if pick:  # without branches on `chosen`: half of d < 0 is a coin toss
                c = chosen[i]
                some[slot] += np.int64(c)
                zeros_chosen += c & (v == 0.0)
                smallest_chosen = min(smallest_chosen, positive if c else np.inf)
                low_chosen = min(low_chosen, v if c else np.inf)
                high_chosen = max(high_chosen, v if c else -np.inf)
        found[p, 0, 0], found[p, 1, 0] = zeros, zeros_chosen
        found[p, 0, 1], found[p, 1, 1] = low, low_chosen
        found[p, 0, 2], found[p, 1, 2] = high, high_chosen
        found[p, 0, 3], found[p, 1, 3] = smallest, smallest_chosen
    stats[:, 0] = 0.0
    stats[:, 1] = stats[:, 3] = np.inf
    stats[:, 2] = -np.inf
    for p in range(parts):
        counts += local[p]
        for j in range(2):
            stats[j, 0] += found[p, j, 0]
            stats[j, 1] = min(stats[j, 1], found[p, j, 1])
            stats[j, 2] = max(stats[j, 2], found[p, j, 2])
            stats[j, 3] = min(stats[j, 3], found[p, j, 3])


@_jit(inline="always")
def _bit_stats(bits, limits, out):
    """`value_stats` of one range (a slice, looped from 0: see `_pairwise`), into `out`."""
    negative_zero, top = limits[0], limits[2]
    zero = top - top
    low, high, smallest = top, negative_zero, top
    negative_zeros = zeros = 0
    for i in range(bits.size):
        u = bits[i]
        signed = u == negative_zero
        v = zero if signed else u  # -0 as +0
        negative_zeros += np.int64(signed)
        zeros += np.int64(v == zero)
        low = min(low, v)
        high = max(high, v)
        smallest = min(smallest, v if v > zero else top)
    out[0], out[1], out[2], out[3], out[4] = negative_zeros, zeros, low, high, smallest


@_jit(parallel=True)
def value_stats(bits, x, like, limits, found, parts):
    """Per range of `parts` (cut as `log_bins` cuts them), from the bits of float values
    (int32 or int64, -0 taken as +0; signed, so negative values come below 0 and NaN above
    infinity), into found[p]: the negative zeros, the zeros, the lowest, highest and
    smallest positive bits (`limits`: the bits of -0, of infinity and the largest integer,
    which stands for none), and how many values of x differ from `like`'s (empty: 0)."""
    compare = like.size == x.size
    for p in prange(parts):
        a, b = x.size * p // parts, x.size * (p + 1) // parts
        _bit_stats(bits[a:b], limits, found[p])
        differ = 0
        if compare:
            xs, ls = x[a:b], like[a:b]
            for i in range(xs.size):
                differ += np.int64(xs[i] != ls[i])
        found[p, 5] = differ


@_jit
def rebin(x, bits, like_slots, changed, first, shift, slots, thresholds, counts):
    """Move each value x[i], i in `changed` (values binned before into `like_slots`, their
    counts in `counts`), from its old slot to its own (`log_bins`)."""
    for i in changed:
        counts[like_slots[i]] -= 1
        counts[_slot(x[i], bits[i], first, shift, slots, thresholds)] += 1


@_jit(parallel=True)
def joint_counts(x, y, lo, scale, bins, counts, parts):
    """Add each pair's cell of a `Histogram2D` (bin floor((v - lo) scale), clipped to
    [0, bins)) to `counts` (flat, row-major), the pairs cut in `parts` ranges, each counted
    apart (by a thread); False (nothing added) where a value is NaN."""
    local = np.zeros((parts, counts.size), np.int64)
    nan = np.zeros(parts, np.bool_)
    for p in prange(parts):
        start, stop = x.size * p // parts, x.size * (p + 1) // parts
        for i in range(start, stop):
            if x[i] != x[i] or y[i] != y[i]:
                nan[p] = True
                break
        if nan[p]:
            continue
        grid = local[p]
        for i in range(start, stop):
            a = min(max(np.floor((np.float64(x[i]) - lo) * scale), 0.0), bins - 1.0)
            b = min(max(np.floor((np.float64(y[i]) - lo) * scale), 0.0), bins - 1.0)
            grid[int(a) * bins + int(b)] += 1
    if nan.any():
        return False
    for p in range(parts):
        counts += local[p]
    return True


@_jit
def bucket_sums(rollout, thresholds, masked_out, fields, out):
    """Add, per bucket of `rollout` (float32 log-probs; the number of `thresholds` at or
    below each), its loss tokens' count and the sums of each array of `fields` (a tuple) to
    `out` [buckets, 1 + arrays], token after token as `np.bincount` adds them; tokens where
    `masked_out` (empty: none) are left out."""
    every = masked_out.size == 0
    for i in range(rollout.size):
        if not every and masked_out[i]:
            continue
        b = 0
        for t in thresholds:
            b += rollout[i] >= t
        out[b, 0] += 1.0
        for j in range(len(fields)):
            out[b, 1 + j] += fields[j][i]


@_jit(inline="always")
def _loss(w, mask, i):
    """w[i] in float64 on a loss token (`mask`; empty: every token), else 0."""
    return np.float64(w[i]) if mask.size == 0 or mask[i] else 0.0


@_jit
def _pairwise(w, mask):
    """(sum, sum of squares) of `_loss` over w, in the order of numpy's pairwise summation
    (`np.add.reduce`): sequential below 8 values, 8 accumulators up to 128, else the halves
    (cut at a multiple of 8) summed apart. The kernels pass each segment as a slice of its
    own: an index from 0 is never negative, so no wraparound test keeps a loop from being
    vectorized (a loop over [start, stop) of the whole array was 7x slower)."""
    n = w.size
    if n < 8:
        s = s2 = 0.0
        for i in range(n):
            v = _loss(w, mask, i)
            s += v
            s2 += v * v
        return s, s2
    if n <= 128:
        r = np.empty(8)
        q = np.empty(8)
        for j in range(8):
            v = _loss(w, mask, j)
            r[j] = v
            q[j] = v * v
        i = 8
        while i < n - n % 8:
            for j in range(8):
                v = _loss(w, mask, i + j)
                r[j] += v
                q[j] += v * v
            i += 8
        s = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]))
        s2 = ((q[0] + q[1]) + (q[2] + q[3])) + ((q[4] + q[5]) + (q[6] + q[7]))
        for t in range(i, n):
            v = _loss(w, mask, t)
            s += v
            s2 += v * v
        return s, s2
    half = n // 2
    half -= half % 8
    a, a2 = _pairwise(w[:half], mask[:half])
    b, b2 = _pairwise(w[half:], mask[half:])
    return a + b, a2 + b2


@_jit(parallel=True)
def setting_sums(w, pre, raw, keep, mask, starts, counts, lower, upper, out):
    """Per segment (the next `counts[s]` tokens from `starts[s]`), into the rows of `out`:
    the sum of the weights `w` and of their squares over loss tokens (`mask`; empty: every
    token) in float64, summed as `np.add.reduceat` sums (the first value, then the rest
    pairwise); the loss tokens; those `keep` keeps; those of weight > 0; and the kept
    tokens whose weight before normalization `pre` (> 0) lies below `lower` x or above
    `upper` x their raw ratio `raw` (compared in float64). Returns whether some kept token
    has `pre` other than 1."""
    every = mask.size == 0
    weighted = np.zeros(counts.size, np.bool_)
    for s in prange(counts.size):
        n, start = counts[s], starts[s]
        if n == 0:
            continue
        stop = start + n
        ws, ms = w[start:stop], mask[start:stop]  # slices: see `_pairwise`
        first = _loss(ws, ms, 0)
        rest, rest2 = _pairwise(ws[1:], ms[1:])
        out[0, s] = first + rest if n > 1 else first
        out[1, s] = first * first + rest2 if n > 1 else first * first
        ps, rs, ks = pre[start:stop], raw[start:stop], keep[start:stop]
        # Counted without branches (0/1 integers): 1.5x faster than skipping tokens.
        tokens = kept = positive = high = low = changed = 0
        for t in range(n):
            m = np.int64(1) if every else np.int64(ms[t])
            k = np.int64(ks[t]) & m
            p = np.float64(ps[t])
            r = np.float64(rs[t])
            tokens += m
            positive += m & np.int64(ws[t] > 0)
            kept += k
            changed += k & np.int64(p != 1.0)
            active = k & np.int64(p > 0)
            high += active & np.int64(p < r * lower)
            low += active & np.int64(p > r * upper)
        out[2, s] = tokens
        out[3, s] = kept
        out[4, s] = positive
        out[5, s] = high
        out[6, s] = low
        weighted[s] = changed > 0
    return weighted.any()


@_jit(parallel=True)
def window_means(x, starts, counts, window, sums, out):
    """Per segment (the next `counts[s]` values from `starts[s]`), into `out`: the largest
    mean of `window` consecutive values of x, the segment's own mean when shorter. Each
    window's sum is a difference of running sums over all of x (`sums` [N + 1], summed in
    order as `np.cumsum` sums), as `np.maximum` takes them (NaN wins)."""
    sums[0] = 0.0
    for i in range(x.size):
        sums[i + 1] = sums[i] + x[i]
    for s in prange(counts.size):
        n, start = counts[s], starts[s]
        if n == 0:
            continue
        if n < window:
            out[s] = (sums[start + n] - sums[start]) / n
            continue
        best = -np.inf
        for j in range(start + window, start + n + 1):
            mean = (sums[j] - sums[j - window]) / window
            best = np.nan if mean != mean or best != best else max(best, mean)
        out[s] = best


@_jit(parallel=True)
def js_argument(d, rho, em1, arg, k3):
    """Per token of the log-ratios d (e^d `rho`, e^d - 1 `em1`): into `arg`, the argument of
    log1p in the Jensen-Shannon term (`stats.token_terms._js`: e^-|d| from |d| >= 1, else
    -tanh(d/2)^2), and into `k3`, e^d - 1 - d; each as the reference's torch operations round it."""
    for i in prange(d.size):
        x, r, e = d[i], rho[i], em1[i]
        k3[i] = e - x
        if abs(x) >= 1.0:
            arg[i] = min(r, 1.0 / r)
        else:
            t = e / (r + 1.0)
            arg[i] = -(t * t)


_LN2 = math.log(2.0)

TERMS = 12
"""The per-token terms `token_sums` adds: d, |d|, d^2, k3, k3 reversed, js, e^|d|, e^d,
e^2d and e^2d clamped (these four 0 outside the loss), then the rollout log-prob (0
outside the loss) squared and times d."""


@_jit(inline="always")
def _terms(d, rho, em1, lg, rl, mask, i, low, high, v):
    """Token i's `TERMS` into v, as `mismatch.MismatchStats.update`'s torch operations
    round them (lg: log1p of `js_argument`)."""
    x, r, e, g, q = d[i], rho[i], em1[i], lg[i], np.float64(rl[i])
    a = abs(x)
    v[10] = q * q
    v[11] = q * x
    v[0] = x
    v[1] = a
    v[2] = x * x
    v[3] = e - x
    v[4] = -(e / r) + x
    v[5] = ((a * 0.5) - _LN2) + g if a >= 1.0 else g * -0.5
    if mask.size == 0 or mask[i]:
        square = r * r
        v[6] = max(r, 1.0 / r)
        v[7] = r
        v[8] = square
        v[9] = min(max(square, low), high)
    else:
        v[6] = v[7] = v[8] = v[9] = 0.0


@_jit
def _pairwise_terms(d, rho, em1, lg, rl, mask, low, high):
    """The sums of `_terms` over the arrays given (a segment's slices: see `_pairwise`), each
    in numpy's pairwise order (`_pairwise`); the 8 accumulators of a block as a vector, the
    terms written out for the compiler to compute 8 tokens at once."""
    n = d.size
    v = np.empty(TERMS)
    if n < 8:
        s = np.zeros(TERMS)
        for i in range(n):
            _terms(d, rho, em1, lg, rl, mask, i, low, high, v)
            for f in range(TERMS):
                s[f] += v[f]
        return s
    if n <= 128:
        every = mask.size == 0
        r = np.empty((TERMS, 8))
        v8 = np.empty((TERMS, 8))
        i = 0
        while i < n - n % 8:
            for j in range(8):
                t = i + j
                x, p, e, g, q = d[t], rho[t], em1[t], lg[t], np.float64(rl[t])
                a = abs(x)
                loss = 1.0 if every else np.float64(mask[t])
                square = p * p
                v8[0, j] = x
                v8[1, j] = a
                v8[2, j] = x * x
                v8[3, j] = e - x
                v8[4, j] = -(e / p) + x
                v8[5, j] = ((a * 0.5) - _LN2) + g if a >= 1.0 else g * -0.5
                v8[6, j] = max(p, 1.0 / p) * loss
                v8[7, j] = p * loss
                v8[8, j] = square * loss
                v8[9, j] = min(max(square, low), high) * loss
                v8[10, j] = q * q
                v8[11, j] = q * x
            if i == 0:  # the accumulators start at the first 8 values (0 + -0 would be +0)
                r[:] = v8
            else:
                r += v8
            i += 8
        s = np.empty(TERMS)
        for f in range(TERMS):
            s[f] = ((r[f, 0] + r[f, 1]) + (r[f, 2] + r[f, 3])) + (
                (r[f, 4] + r[f, 5]) + (r[f, 6] + r[f, 7])
            )
        for t in range(i, n):
            _terms(d, rho, em1, lg, rl, mask, t, low, high, v)
            for f in range(TERMS):
                s[f] += v[f]
        return s
    h = n // 2
    h -= h % 8
    return _pairwise_terms(
        d[:h], rho[:h], em1[:h], lg[:h], rl[:h], mask[:h], low, high
    ) + _pairwise_terms(d[h:], rho[h:], em1[h:], lg[h:], rl[h:], mask[h:], low, high)


@_jit(parallel=True)
def token_sums(d, rho, em1, lg, rl, mask, starts, counts, low, high, out):
    """Per segment (the next `counts[s]` tokens from `starts[s]`), into the rows of `out`:
    the sums of the `TERMS` (as `np.add.reduceat` sums them: the first token's, then the
    rest pairwise), then the tokens with d < 0 and with d > 0."""
    for s in prange(counts.size):
        n, start = counts[s], starts[s]
        if n == 0:
            continue
        stop = start + n
        ds, ps, es, gs = d[start:stop], rho[start:stop], em1[start:stop], lg[start:stop]
        qs, ms = rl[start:stop], mask[start:stop]  # slices: see `_pairwise`
        first = np.empty(TERMS)
        _terms(ds, ps, es, gs, qs, ms, 0, low, high, first)
        if n > 1:
            first += _pairwise_terms(ds[1:], ps[1:], es[1:], gs[1:], qs[1:], ms[1:], low, high)
        out[:TERMS, s] = first
        negative = positive = 0
        for t in range(n):
            negative += ds[t] < 0.0
            positive += ds[t] > 0.0
        out[TERMS, s] = negative
        out[TERMS + 1, s] = positive


@_jit(parallel=True)
def topk_terms(r, t, mu, pi, ids, token, rollout, out):
    """Per token (row) of the engine's top-k log-probs `r` and the trainer's `t` (float32 [N, k]),
    their probabilities `mu` and `pi` (float64, torch's exp), the k `ids` and the sampled
    `token` (an empty `token`: the sampled one is found by its `rollout` log-prob instead), into
    the columns of `out` [N, 5]: sum mu (log mu - log pi), sum mu, sum pi (each added in the
    ids' order, as `distribution._row_sums`), whether the two argmaxes (the first largest)
    coincide, and whether the sampled token is among the k. False where a log-prob is not
    finite (the reference answers)."""
    n, k = r.shape
    bad = 0
    by_id = token.size > 0
    for i in prange(n):
        known = mass_mu = mass_pi = 0.0
        best_r = best_t = 0
        inside = 0.0
        for j in range(k):
            a, b = r[i, j], t[i, j]
            if a - a != 0.0 or b - b != 0.0:
                bad += 1
            m = mu[i, j]
            term = m * (np.float64(a) - np.float64(b))
            known = term if j == 0 else known + term
            mass_mu = m if j == 0 else mass_mu + m
            mass_pi = pi[i, j] if j == 0 else mass_pi + pi[i, j]
            if a > r[i, best_r]:
                best_r = j
            if b > t[i, best_t]:
                best_t = j
            if (ids[i, j] == token[i]) if by_id else (a == rollout[i]):
                inside = 1.0
        out[i, 0] = known
        out[i, 1] = mass_mu
        out[i, 2] = mass_pi
        out[i, 3] = 1.0 if best_r == best_t else 0.0
        out[i, 4] = inside
    return bad == 0


@_jit(parallel=True)
def gather_runs(x, starts, lengths, offsets, out):
    """Into `out`, each run of `x` (`lengths[k]` values from `starts[k]`) at `offsets[k]`: a
    take of whole sequences, copied run by run instead of gathered value by value."""
    for k in prange(starts.size):
        a, o = starts[k], offsets[k]
        for j in range(lengths[k]):
            out[o + j] = x[a + j]
