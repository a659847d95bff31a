"""Compiled CPU kernels: exact medians by selection, histogram bins from a table, and the
per-sequence sums in numpy's own order.

An analysis takes, per step, the median and MAD of every loss token's log-ratio, those of each
rollout-probability bin, each sequence's median, and each token's distance from its bin's
noise. numpy sorts or partitions for each; these kernels select instead, and give the same
values:

- `median_mad`: a radix selection on the values' bit patterns (their order is the values'):
  one pass counts the top 16 bits, one gathers the few values that share the median's, and
  those are narrowed 16 bits at a time; 6-8x numpy's two `np.median`. Below 4,096 values,
  whose 65,536 counts would cost more than the values, a quickselect.
- `segment_medians`: a quickselect per segment, the segments in parallel.
- `step_noise`: each step's noise (`noise.Noise.of`), and `noise.deviations` compared with
  `noise.FAR` and counted per sequence, without an argsort; the steps, and the medians of
  every step and bin, on every thread.
- `log_bins`: a `LogHistogram`'s slots and counts, each value's slot read from a table of its
  bits (`histogram._slot_table`, exact by construction) instead of a float32 log10 and the
  float64 formula again near the edges; 5x faster. The same pass counts the zeros and finds
  the smallest positive value, and bins a chosen part of the values apart (a step's |d| and
  those of its tokens with d < 0, without gathering them); each thread counts its own range.
- `joint_counts`: the (rollout, train) log-prob grid in one pass instead of two float64
  copies, five passes over them and a bincount.
- `bucket_sums`: the by-probability table's counts and sums in one pass.
- `rebin`: a setting's weights binned like its raw ratios, the changed values moved from their
  slot to their own.
- `value_stats`: what binning needs to know of values before it bins them (clean, zeros, min,
  max, smallest positive, how many differ from the values binned before) in one pass over
  their bits, instead of five torch and numpy passes.
- `setting_sums`: a setting's per-sequence weight sums (and of their squares), loss, kept and
  non-zero tokens, and truncated tokens (`impact._sequence_sums`), in one pass.
- `js_argument`, `token_sums`: the mismatch's twelve per-token terms summed per sequence
  (`stats.token_terms.token_sums`), in two passes around torch's log1p.
- `window_means`: the attribution's largest window mean per sequence.
- `gather_runs`: whole sequences taken in another order (a chunk's steps grouped where they
  interleave), copied run by run instead of gathered by a 2M-value index per column.
- `topk_terms`: the whole distribution's per-token sums over the k ids, the two argmaxes and
  the sampled token's membership (`distribution.token_terms`), in one pass over the k columns
  instead of a dozen torch passes over [N, k].

The sums add as `np.add.reduceat` does (the first value, then numpy's pairwise summation of the
rest), so they too are the same to the last bit.

The numpy and torch functions they replace stay the reference and the fallback: without numba,
under `ISCORE_KERNELS=reference`, off the CPU or float64 input, and for values that are not all
finite (where the reference defines what NaN and infinities give). A median of zeros is +0 on
both paths.

Loading numba and the compiled kernels takes a process about 0.7 s, and the kernels save about
55 ns per loss token: they start once a process has analyzed `AUTO_TOKENS` loss tokens, so
that a small dump never waits for them and a long run gains (`ISCORE_KERNELS=numba` starts
them at once, as the tests and `iscore bench` do).

numba compiles the kernels once per machine into the user's cache directory
(`$XDG_CACHE_HOME/iscore/numba`, else `~/.cache/iscore/numba`; a `NUMBA_CACHE_DIR` of the
user's own wins); the first compile says so on stderr. They run one at a time in a process
(`_TURN`), whichever threads call them.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import os
import sys
import threading
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np

ENV = "ISCORE_KERNELS"
"""`numba`: the kernels from the first token; `reference`: the numpy reference everywhere;
unset (or `auto`): the kernels from `AUTO_TOKENS` on."""

AUTO_TOKENS = 10_000_000
"""Loss tokens a process analyzes on the reference before it loads the kernels: where their
saving (about 55 ns a token) has paid for loading them (about 0.7 s)."""


def available() -> bool:
    """Whether numba is installed (the kernels can run)."""
    return _compiled() is not None


def threading_layer() -> str | None:
    """The threading layer numba's parallel loops run on (`omp`, `tbb` or `workqueue`, see
    `_TURN`), or None before the kernels first ran in this process or without numba."""
    if "numba" not in sys.modules:
        return None
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel loop has run yet
        return None


def _wanted(tokens: int = 0) -> bool:
    """Whether the kernels run now, counting `tokens` more loss tokens analyzed (`ENV`)."""
    mode = os.environ.get(ENV, "auto")
    if mode == "reference":
        return False
    if mode != "numba":
        _analyzed[0] += tokens
        if _analyzed[0] < AUTO_TOKENS:
            return False
    return available()


_analyzed = [0]


def median_mad(x: np.ndarray) -> tuple[float, float] | None:
    """(median of x, median of |x - that median|) of a non-empty float64 array, exactly as
    `np.median` gives them; None where the reference must answer (see the module)."""
    if x.dtype != np.float64 or not _wanted():
        return None
    k = _ready()
    x = np.ascontiguousarray(x)
    n = x.size
    center, mad = k.median_mad(
        x, _buffer("keys", n, np.uint64), _buffer("hist", k.DIGITS, np.int64), _buffer("dev", n)
    )
    return None if np.isnan(center) or np.isnan(mad) else (center, mad)


def segment_medians(values: np.ndarray, counts: np.ndarray) -> np.ndarray | None:
    """float64 [B]: the median of each segment's values (0 for an empty one), segment i the
    next `counts[i]` values; None where the reference must answer."""
    if values.dtype != np.float64 or not _wanted():
        return None
    k = _ready()
    n = counts.astype(np.int64)
    starts = np.cumsum(n) - n
    medians = np.zeros(n.size)
    work = _buffer("work", values.size)
    finite = k.segment_medians(np.ascontiguousarray(values), starts, n, work, medians)
    return medians if finite else None


def step_noise(
    d: np.ndarray,
    bins: np.ndarray,
    counts: np.ndarray,
    per_step: np.ndarray,
    bin_count: int,
    far: float,
    floor: float,
    sample: int,
    mad_sd: float,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(float64 [S, 2], float64 [B]): each step's median and MAD of d, its sequences the next
    `per_step[j]` (int64) and sequence i's tokens the next `counts[i]`; and per sequence, how
    many of its tokens lie more than `far` spreads from the centre of their bin of its step
    (`bins`, uint8 below `bin_count`), each bin's centre and spread the median and `mad_sd` x
    MAD of an evenly strided sample of its tokens (stride n // `sample`), the spread floored at
    `floor`: what `noise.Noise.of` and `noise.deviations` give. None where the reference must
    answer. Counts the tokens towards `AUTO_TOKENS`: it sees each analyzed loss token once."""
    if not _wanted(d.size) or d.dtype != np.float64:
        return None
    k = _ready()
    n = counts.astype(np.int64)
    cu = np.r_[0, np.cumsum(n)]
    first = np.r_[0, np.cumsum(per_step)]
    at = cu[first[:-1]]
    noise = np.zeros((per_step.size, 2))
    out = np.zeros(n.size)
    parts = _parts(d.size)
    finite = k.step_noise(
        np.ascontiguousarray(d),
        np.ascontiguousarray(bins, dtype=np.uint8),
        at,
        cu[first[1:]] - at,
        cu[:-1],
        n,
        np.repeat(np.arange(per_step.size), per_step),
        bin_count,
        far,
        floor,
        sample,
        mad_sd,
        _buffer("sample", d.size),
        _buffer("keys", d.size, np.uint64),
        _buffer("hists", parts * k.DIGITS, np.int64).reshape(parts, k.DIGITS),
        _buffer("dev", d.size),
        noise,
        out,
    )
    return (noise, out) if finite else None


def log_bins(
    x: np.ndarray,
    table: tuple[int, int, np.ndarray, np.ndarray],
    size: int,
    index: np.ndarray | None,
    chosen: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray] | None:
    """The `LogHistogram` slots of x's values (float32 or float64, finite and >= 0) by `table`
    (`histogram._slot_table`: first cell, shift, the slot of each cell and the value from
    which it is one more), written to `index` (int32, x's size) where given: (int64 [2, size]
    the counts of every slot, over all values and over those where `chosen` (bool, x's size;
    None: none); float64 [2, 4] the zeros, min, max and smallest positive value of each: a
    min or max of 0 is the first zero of its range, not necessarily the one torch's
    `aminmax` picks among +0 and -0). None where the reference must answer."""
    if not _wanted():
        return None
    k = _ready()
    first, shift, cells, thresholds = table
    x = np.ascontiguousarray(x)
    bits = x.view(np.int64 if x.dtype == np.float64 else np.int32)
    counts, stats = np.zeros((2, size), np.int64), np.empty((2, 4))
    index = np.empty(0, np.int32) if index is None else index
    chosen = np.empty(0, np.bool_) if chosen is None else chosen
    k.log_bins(
        x, bits, first, shift, cells, thresholds, chosen, counts, index, stats, _parts(x.size)
    )
    return counts, stats


class ValueStats(NamedTuple):
    """What `value_stats` finds of float values."""

    clean: bool
    """Every value is finite and >= 0 (-0 too); the rest is of clean values only."""
    zeros: int = 0
    negative_zeros: int = 0
    low: float = 0.0
    """The min; a zero min is +0 (which zero torch's `aminmax` gives is its own)."""
    high: float = 0.0
    """The max; a zero max is +0."""
    min_positive: float = math.inf
    """The smallest positive value, inf when none."""
    differ: int = 0
    """How many values differ from `like`'s."""


def value_stats(x: np.ndarray, like: np.ndarray | None = None) -> ValueStats | None:
    """The `ValueStats` of float32 or float64 values, in one pass (`like`: x's size and
    dtype; None: nothing to compare); None where the reference must answer."""
    if x.dtype not in (np.float32, np.float64) or not _wanted():
        return None
    x = np.ascontiguousarray(x)
    signed = np.int64 if x.dtype == np.float64 else np.int32
    bits = x.view(signed)
    info = np.iinfo(signed)
    infinity = np.array([np.inf], x.dtype).view(signed)[0]
    limits = np.array([info.min, infinity, info.max], signed)  # info.min: the bits of -0
    like = np.empty(0, x.dtype) if like is None else np.ascontiguousarray(like)
    parts = _parts(x.size)
    found = np.zeros((parts, 6), np.int64)
    _ready().value_stats(bits, x, like, limits, found, parts)
    negative_zeros, zeros, differ = (int(v) for v in found[:, [0, 1, 5]].sum(axis=0))
    low, high, smallest = found[:, 2].min(), found[:, 3].max(), found[:, 4].min()
    if low < 0 or high >= infinity:  # negative, or infinite or NaN
        return ValueStats(clean=False)
    low, high, positive = np.array([low, high, smallest]).astype(signed).view(x.dtype)
    min_positive = math.inf if smallest == info.max else float(positive)
    return ValueStats(True, zeros, negative_zeros, float(low), float(high), min_positive, differ)


def rebin(
    x: np.ndarray,
    like_slots: np.ndarray,
    changed: np.ndarray,
    table: tuple[int, int, np.ndarray, np.ndarray],
    counts: np.ndarray,
) -> bool:
    """Move each value x[i], i in `changed` (float32 or float64, finite and >= 0; binned
    before into `like_slots`, their slot counts in `counts`, int64), from that slot to its
    own by `table` (as `log_bins`); False (nothing done) where the reference must answer."""
    if not _wanted():
        return False
    x = np.ascontiguousarray(x)
    bits = x.view(np.int64 if x.dtype == np.float64 else np.int32)
    first, shift, cells, thresholds = table
    _ready().rebin(x, bits, like_slots, changed, first, shift, cells, thresholds, counts)
    return True


def joint_counts(x: np.ndarray, y: np.ndarray, lo: float, scale: float, counts: np.ndarray) -> bool:
    """Add the (x, y) pairs' cells of a `histogram.Histogram2D` (`counts`, int64 [bins, bins];
    bin floor((v - lo) scale) in float64, clipped) to `counts`; False (nothing added) where
    the reference must answer."""
    if not _wanted():
        return False
    flat = counts.reshape(-1)
    x, y = np.ascontiguousarray(x), np.ascontiguousarray(y)
    return bool(_ready().joint_counts(x, y, lo, scale, counts.shape[0], flat, _parts(x.size)))


def bucket_sums(
    rollout: np.ndarray,
    thresholds: list[float],
    masked_out: np.ndarray | None,
    fields: list[np.ndarray],
    buckets: int,
) -> np.ndarray | None:
    """float64 [buckets, 1 + len(fields)]: per bucket of the float32 `rollout` log-probs (the
    number of `thresholds` at or below each), the count of its tokens and the sum of each
    field (float64) over them, outside `masked_out`, summed in token order as
    `np.bincount` sums; None where the reference must answer."""
    if rollout.dtype != np.float32 or not _wanted():
        return None
    out = np.zeros((buckets, 1 + len(fields)))
    none = np.empty(0, np.bool_)
    _ready().bucket_sums(
        rollout,
        np.array(thresholds, np.float32),
        none if masked_out is None else masked_out,
        tuple(np.ascontiguousarray(f, np.float64) for f in fields),  # not stacked: a copy
        out,
    )
    return out


def setting_sums(
    w: np.ndarray,
    pre: np.ndarray,
    raw: np.ndarray,
    keep: np.ndarray,
    mask: np.ndarray | None,
    cu_seqlens: np.ndarray,
    tolerance: float,
) -> tuple[np.ndarray, bool] | None:
    """(float64 [7, B], weighted): per sequence (`cu_seqlens` its offsets) the sum of the
    weights `w` over its loss tokens (`mask`, None: every token), the sum of their squares
    (both as `np.add.reduceat` sums them, in float64), its loss tokens, those `keep` keeps,
    those of weight > 0, and the kept ones whose `pre` (> 0) lies more than `tolerance`
    below / above their `raw` ratio; and whether some kept token has `pre` other than 1.
    None where the reference must answer (weights not float32 or float64)."""
    floats = (np.float32, np.float64)
    if w.dtype not in floats or pre.dtype not in floats or raw.dtype not in floats:
        return None
    if keep.dtype != np.bool_ or not _wanted():
        return None
    cu = cu_seqlens.astype(np.int64)
    out = np.zeros((7, cu.size - 1))
    weighted = _ready().setting_sums(
        w,
        pre,
        raw,
        keep,
        np.empty(0, np.bool_) if mask is None else mask,
        cu[:-1],
        np.diff(cu),
        1 - tolerance,
        1 + tolerance,
        out,
    )
    return out, bool(weighted)


def window_means(x: np.ndarray, T: np.ndarray, window: int) -> np.ndarray | None:
    """float64 [B]: per segment of float64 `x` (segment i the next `T[i]` values) the
    largest mean of `window` consecutive values (its own mean when shorter, 0 when empty),
    each window's sum the difference of x's running sums (`np.cumsum`); None where the
    reference must answer."""
    if x.dtype != np.float64 or not _wanted():
        return None
    n = np.asarray(T).astype(np.int64)
    out = np.zeros(n.size)
    _ready().window_means(
        np.ascontiguousarray(x), np.cumsum(n) - n, n, window, _buffer("sums", x.size + 1), out
    )
    return out


def js_argument(
    d: np.ndarray, rho: np.ndarray, em1: np.ndarray, arg: np.ndarray, k3: np.ndarray
) -> bool:
    """Per token of the float64 log-ratios d (e^d `rho`, e^d - 1 `em1`), into `arg` the
    argument of log1p in the Jensen-Shannon term (e^-|d| from |d| >= 1, else
    -tanh(d/2)^2) and into `k3` e^d - 1 - d, as `mismatch.MismatchStats.update`'s torch
    operations give them; False (nothing written) where the reference must answer."""
    if not _wanted():
        return False
    _ready().js_argument(d, rho, em1, arg, k3)
    return True


def token_sums(
    d: np.ndarray,
    rho: np.ndarray,
    em1: np.ndarray,
    lg: np.ndarray,
    rollout: np.ndarray,
    mask: np.ndarray | None,
    cu_seqlens: np.ndarray,
    clamp: tuple[float, float],
) -> np.ndarray | None:
    """float64 [14, B]: per sequence (`cu_seqlens` its offsets) the sums of its tokens'
    d, |d|, d^2, k3, k3 reversed, js (`lg`: log1p of `js_argument`), and over its loss
    tokens (`mask`, None: every token) of e^|d|, e^d, e^2d and e^2d clamped to `clamp`; of
    the rollout log-prob squared and times d (`rollout`, 0 outside the loss, in float64); all
    as `np.add.reduceat` sums them; then its tokens with d < 0 and with d > 0. d is float64,
    0 outside the loss; `rho` = e^d and `em1` = e^d - 1 from torch. None where the
    reference must answer."""
    if not _wanted():
        return None
    k = _ready()
    cu = cu_seqlens.astype(np.int64)
    out = np.zeros((k.TERMS + 2, cu.size - 1))
    mask = np.empty(0, np.bool_) if mask is None else mask
    k.token_sums(d, rho, em1, lg, rollout, mask, cu[:-1], np.diff(cu), *clamp, out)
    return out


def topk_terms(
    rollout_topk: np.ndarray,
    train_topk: np.ndarray,
    mu: np.ndarray,
    pi: np.ndarray,
    ids: np.ndarray,
    token: np.ndarray | None,
    rollout: np.ndarray,
) -> np.ndarray | None:
    """float64 [N, 5] per token of the top-k log-probs (float32 [N, k], k >= 1; `mu`, `pi`
    their exp in float64, from torch): sum mu (log mu - log pi), sum mu and sum pi (each in the
    ids' order), whether the engine's and the trainer's first largest log-probs share an id, and
    whether the sampled `token` (None: the token whose `rollout` log-prob is an entry) is among
    the `ids`, as `distribution.token_terms`' reference gives them; None where it must answer
    (a log-prob not finite, another dtype)."""
    if rollout_topk.dtype != np.float32 or train_topk.dtype != np.float32 or not _wanted():
        return None
    out = np.empty((rollout_topk.shape[0], 5))
    empty = np.empty(0, ids.dtype)
    found = _ready().topk_terms(
        rollout_topk, train_topk, mu, pi, ids, empty if token is None else token, rollout, out
    )
    return out if found else None


def gather_runs(x: np.ndarray, starts: np.ndarray, lengths: np.ndarray, out: np.ndarray) -> bool:
    """Into `out` (1-d), the runs of the 1-d `x` (`lengths[k]` values from `starts[k]`, int64)
    one after the other, as a gather of their values' indices gives them; False (nothing
    written) where the reference must answer."""
    if not _wanted():
        return False
    offsets = np.cumsum(lengths) - lengths
    _ready().gather_runs(x, starts, lengths, offsets, out)
    return True


SPLIT = 1 << 16
"""Values from which a kernel that counts into bins splits them between its threads, each
counting its own range (a few thousand bins each, added up after)."""


def _parts(n: int) -> int:
    """The ranges a counting kernel cuts n values into (`SPLIT`)."""
    import numba  # loaded with the kernels

    return numba.get_num_threads() if n >= SPLIT else 1


def _buffer(name: str, n: int, dtype: type = np.float64) -> np.ndarray:
    """[n] scratch memory (`ops.scratch`, reused inside `ops.reused_buffers()`)."""
    import torch  # here: `iscore.stats.noise`, which imports this module, runs without torch

    from iscore.packed import ops

    item = np.dtype(dtype).itemsize
    raw = ops.scratch(f"kernels.{name}", n * item, torch.uint8, "cpu")
    return raw.numpy().view(dtype)


def _ready() -> _OneAtATime:
    """The compiled kernels, saying once on stderr when they are compiled for the first time
    on this machine."""
    with _TURN:
        kernels = _compiled()
        if not _announced:
            _announced.append(True)
            if not _cached_on_disk(kernels.median_mad):
                print("iscore: compiling kernels (once per machine)...", file=sys.stderr)
    return _OneAtATime(kernels)


_TURN = threading.Lock()
"""Held while a compiled kernel runs. numba's parallel loops run on its threading layer, and
the one every platform has, `workqueue` (numba's own, where neither OpenMP nor TBB loads: a
slim container, macOS), ends the process when two Python threads launch parallel loops at
once; two sessions of the app analyzing at the same time are two such threads. Each kernel
spreads over every core, so taking turns costs little."""


class _OneAtATime:
    """The kernels' module, each of its functions called under `_TURN`."""

    def __init__(self, module: ModuleType):
        self._module = module

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._module, name)
        if not callable(value):
            return value

        def call(*args: Any) -> Any:
            with _TURN:
                return value(*args)

        return call


_announced: list[bool] = []


def _cached_on_disk(kernel: Any) -> bool:
    """Whether numba's disk cache holds a compiled version of `kernel` (an index file)."""
    try:
        folder = kernel._cache._cache_path
        return any(name.endswith(".nbi") for name in os.listdir(folder))
    except (AttributeError, OSError):
        return False


@functools.cache
def _compiled() -> ModuleType | None:
    """The kernels (compiled on first call, or loaded from the disk cache), or None without
    numba."""
    if importlib.util.find_spec("numba") is None:
        return None
    if not os.environ.get("NUMBA_NUM_THREADS"):
        # As many threads as torch takes (its OMP_NUM_THREADS, one in a Ray task of one
        # CPU): numba's OpenMP threads take every core and spin after each parallel loop,
        # and two one-CPU Ray tasks on two cores ran 2x slower.
        import torch

        os.environ["NUMBA_NUM_THREADS"] = str(torch.get_num_threads())
    import numba

    if not os.environ.get("NUMBA_CACHE_DIR"):
        from iscore.utils import default_folder

        numba.config.CACHE_DIR = str(default_folder() / "numba")
    from iscore.packed import numba_kernels

    return numba_kernels
