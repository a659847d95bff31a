"""`iscore.packed.kernels`: the compiled selections give exactly the values of
`iscore.stats.noise`'s numpy reference and of medians written out from sorted values, on fresh
random data and edge cases (ties, zeros of both signs, one value, even and odd counts, empty
segments, bins above the sample size, non-finite values); the histogram bins read from a table of
bits give every value the slot of the float64 formula, at and around every edge; the reference
answers without numba and before `AUTO_TOKENS`; the first compile says so once."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from iscore.bench.base import SETTINGS
from iscore.frameworks.resolve import resolve
from iscore.frameworks.spec import Replay
from iscore.packed import kernels
from iscore.packed.batch import TokenBatch
from iscore.passes.analysis import analyze
from iscore.stats import noise
from iscore.stats.attribution import WINDOW, _window_means
from iscore.stats.histogram import (
    _BINS,
    LOG10_RANGE,
    Histogram2D,
    LogHistogram,
    _log_bin,
    _slot_table,
    bin_chosen,
    bin_values,
)
from iscore.stats.setting import _compiled_sums, _sequence_sums
from iscore.stats.token_terms import compiled_token_sums, token_sums

pytestmark = pytest.mark.skipif(not kernels.available(), reason="numba is not installed")


@pytest.fixture(autouse=True)
def _kernels_from_the_first_token(monkeypatch):
    monkeypatch.setenv(kernels.ENV, "numba")


def _median(x: np.ndarray) -> float:
    """The median from the sorted values, written out."""
    s = np.sort(x)
    n = s.size
    return 0.5 * (s[(n - 1) // 2] + s[n // 2]) + 0.0


def _reference(f, *args):
    """`f(*args)` on the numpy path."""
    os.environ[kernels.ENV] = "reference"
    try:
        return f(*args)
    finally:
        os.environ[kernels.ENV] = "numba"


def _values(rng: np.random.Generator, kind: int, n: int) -> np.ndarray:
    if kind == 0:
        return rng.normal(0.0, 0.05, n)
    if kind == 1:  # many ties
        return rng.normal(0.0, 0.05, n).round(2)
    if kind == 2:  # mostly exact zeros, of both signs
        zeros = np.where(rng.random(n) < 0.5, -0.0, 0.0)
        return np.where(rng.random(n) < 0.7, zeros, rng.normal(0.0, 1.0, n))
    if kind == 3:  # heavy tails and extreme values
        x = rng.standard_cauchy(n) * 1e3
        x[: n // 10] = rng.choice([-3.4e38, 3.4e38, 1e-300, -1e-300], n // 10)
        return rng.permutation(x)
    return rng.integers(-3, 3, n).astype(np.float64)  # a handful of values


SIZES = [1, 2, 3, 4, 5, 16, 17, 1000, 1001, 4095, 4096, 4097, 70_000, 300_001]


@pytest.mark.parametrize(("kind", "n"), list(itertools.product(range(5), SIZES)))
def test_median_mad_equals_the_sorted_values_and_the_reference(kind, n) -> None:
    x = _values(np.random.default_rng(n + kind), kind, n)
    center = _median(x)
    expected = (center, noise.MAD_SD * _median(np.abs(x - center)))
    got = noise.median_mad(x)
    assert got == expected == _reference(noise.median_mad, x)
    assert np.signbit(got[0]) == np.signbit(expected[0])  # +0 for zeros


@pytest.mark.parametrize("seed", range(6))
def test_segment_medians_equal_the_sorted_values_and_the_reference(seed) -> None:
    rng = np.random.default_rng(seed)
    lengths = [0, 1, 2, 3, 0, 17, 4097, 20_000]
    counts = np.concatenate([lengths, rng.integers(0, 700, 300)]).astype(np.int64)
    values = _values(rng, seed % 5, int(counts.sum()))
    starts = np.cumsum(counts) - counts
    expected = [
        _median(values[a : a + k]) if k else 0.0 for a, k in zip(starts, counts, strict=True)
    ]
    got = noise.segment_medians(values, counts)
    np.testing.assert_array_equal(got, expected)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(expected))
    np.testing.assert_array_equal(got, _reference(noise.segment_medians, values, counts))


def test_segment_medians_of_sorted_and_constant_segments() -> None:
    """Inputs that make a naive quickselect quadratic: sorted, reversed, organ-pipe, equal."""
    n = 50_000
    ramp = np.arange(n, dtype=np.float64)
    segments = [ramp, ramp[::-1], np.r_[ramp[: n // 2], ramp[n // 2 :: -1]], np.full(n, 2.5)]
    values = np.concatenate(segments)
    counts = np.array([len(s) for s in segments])
    np.testing.assert_array_equal(
        noise.segment_medians(values, counts), [_median(s) for s in segments]
    )


@pytest.mark.parametrize("seed", range(6))
def test_step_noise_equals_the_medians_and_the_deviations_counted(seed) -> None:
    """Per step, the median and MAD of its tokens written out from sorted values; per
    sequence, the tokens beyond FAR of their bin's noise in its step, as `deviations` gives
    them (itself tested against its definition): bins above BIN_SAMPLE tokens, bins on the
    spread floor, empty bins, float32 and float64 log-probs, one step to many, a step of one
    token, a step without tokens, steps in order and interleaved."""
    rng = np.random.default_rng(seed)
    T = np.concatenate([[0, 1, 2], rng.integers(0, 3000, 150), [0]]).astype(np.int64)
    n = int(T.sum())
    rollout = np.log(rng.uniform(1e-6, 1.0, n))
    rollout[rng.random(n) < 0.6] = -1e-5  # one bin above BIN_SAMPLE tokens
    rollout = rollout.astype(np.float32 if seed % 2 else np.float64)
    d = rng.standard_t(3, n) * 0.1 * (1.0 - np.exp(rollout.astype(np.float64)))
    d[rng.random(n) < 0.3 * (seed % 3)] = 0.0  # a MAD of 0: the spread floor
    steps = np.sort(rng.integers(0, [1, 3, 40][seed % 3], T.size))
    steps[:2] = -1, -2  # a step of no token, then one of one token
    steps[-1] = steps[-2] + 1  # a step of no token
    if seed >= 3:
        order = rng.permutation(T.size)
        steps, T = steps[order], T[order]
    token_step = np.repeat(steps, T)
    deviation = np.zeros(n)
    expected_noise = []
    for step in np.unique(steps):
        at = token_step == step
        deviation[at] = noise.deviations(d[at], rollout[at]) if at.any() else []
        c = _median(d[at]) if at.any() else 0.0
        mad = _median(np.abs(d[at] - c)) if at.any() else 0.0
        expected_noise.append((int(step), noise.Noise(c, noise.MAD_SD * mad, int(at.sum()))))
    expected = noise.segment_counts(deviation > noise.FAR, T)
    assert expected.sum() > 0
    for path in (noise.step_noise, lambda *a: _reference(noise.step_noise, *a)):
        found, far = path(d, rollout, T, steps)
        assert found == expected_noise
        np.testing.assert_array_equal(far, expected)


def test_values_not_finite_are_left_to_the_reference() -> None:
    """NaN and infinities: what numpy's median gives them, whichever path is asked."""
    cases = [
        np.array([1.0, np.nan, 2.0]),
        np.array([np.inf, 1.0, np.inf]),
        np.array([-np.inf, 0.0]),
    ]
    with np.errstate(invalid="ignore"):
        for x in cases:
            assert kernels.median_mad(x) is None
            np.testing.assert_array_equal(noise.median_mad(x), _reference(noise.median_mad, x))
    values, counts = np.array([1.0, np.nan, 2.0, 3.0]), np.array([3, 1])
    assert kernels.segment_medians(values, counts) is None
    np.testing.assert_array_equal(noise.segment_medians(values, counts), [2.0, 3.0])
    rollout, steps, per_step = np.full(4, -0.5), np.array([0, 1]), np.array([1, 1])
    assert (
        kernels.step_noise(values, noise._bins(rollout), counts, per_step, 8, 2.0, 1e-5, 9, 1.5)
        is None
    )
    with np.errstate(invalid="ignore"):
        found = noise.step_noise(values, rollout, counts, steps)
        reference = _reference(noise.step_noise, values, rollout, counts, steps)
    assert str(found) == str(reference)


def test_a_selection_leaves_its_counts_at_zero() -> None:
    """The radix counts are reset as they are read (not cleared before each selection):
    after a median of values with ties, of a NaN met midway, of one value, all are 0 again
    (`step_noise` makes many selections with the same counts)."""
    k = kernels._ready()
    rng = np.random.default_rng(3)
    for x in (_values(rng, 1, 5001), np.r_[rng.normal(size=100), np.nan, 1.0], np.ones(1)):
        hist = np.zeros(k.DIGITS, np.int64)
        with np.errstate(invalid="ignore"):
            k._median_mad(x, np.empty(x.size, np.uint64), hist, np.empty(x.size))
        assert not hist.any()


def test_without_numba_the_reference_answers(monkeypatch) -> None:
    x = np.random.default_rng(0).normal(0.0, 0.05, 1001)
    expected = noise.median_mad(x)
    monkeypatch.setattr(kernels, "_compiled", lambda: None)
    assert not kernels.available() and kernels.median_mad(x) is None
    assert noise.median_mad(x) == expected


def test_the_kernels_start_after_auto_tokens(monkeypatch) -> None:
    """Unset, the reference answers until a process has analyzed AUTO_TOKENS loss tokens."""
    monkeypatch.delenv(kernels.ENV)
    monkeypatch.setattr(kernels, "_analyzed", [0])
    monkeypatch.setattr(kernels, "AUTO_TOKENS", 1000)
    x = np.random.default_rng(0).normal(0.0, 0.05, 600)
    rollout, T = np.full(600, -0.5), np.array([600])
    assert kernels.median_mad(x) is None
    args = (x, noise._bins(rollout), T, np.array([1]), 8, noise.FAR, 1e-5, 100, 1.4826)
    assert kernels.step_noise(*args) is None
    assert kernels.step_noise(*args) is not None
    assert kernels.median_mad(x) is not None
    monkeypatch.setenv(kernels.ENV, "reference")
    assert kernels.median_mad(x) is None


def test_the_first_compile_says_so_once(tmp_path) -> None:
    code = (
        "import numpy as np; from iscore.stats import noise; x = np.arange(5.0); "
        "noise.median_mad(x); noise.median_mad(x)"
    )
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path), kernels.ENV: "numba"}
    runs = [
        subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
        for _ in range(2)
    ]
    assert [r.returncode for r in runs] == [0, 0]
    assert runs[0].stderr.count("compiling kernels") == 1
    assert "compiling" not in runs[1].stderr


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_log_bins_give_every_value_the_slot_of_the_float64_formula(dtype) -> None:
    """The table of bits gives the slot of `_log_bin` (the float64 definition) to every value
    within 40 ulps of each of the 4,001 edges, to random values over the whole range and
    beyond it, and to zeros and extremes; the histogram's counts and extremes equal the
    reference's."""
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    edges = (10.0 ** np.linspace(*LOG10_RANGE, _BINS + 1)).astype(np_dtype)
    near, below, above = [edges], edges.copy(), edges.copy()
    for _ in range(40):
        below, above = np.nextafter(below, np_dtype(0)), np.nextafter(above, np_dtype(np.inf))
        near += [below, above]
    rng = np.random.default_rng(0)
    spread = (10.0 ** rng.uniform(-14.0, 10.0, 200_000)).astype(np_dtype)
    extremes = np.array([0.0, -0.0, np.finfo(np_dtype).tiny, np.finfo(np_dtype).max, 1.0])
    x = np.concatenate([*near, spread, extremes.astype(np_dtype)])
    expected = (
        _log_bin(torch.from_numpy(x.astype(np.float64)).clamp(min=1e-300), _BINS) + 1
    ).numpy()
    expected[x == 0] = 0
    first, shift, slots, thresholds = _slot_table(dtype)
    bits = x.view(np.int32 if np_dtype == np.float32 else np.int64).astype(np.int64)
    cell = np.clip((bits >> shift) - first, 0, slots.size - 1)
    np.testing.assert_array_equal(slots[cell] + (x >= thresholds[cell]), expected)
    binned = bin_values(torch.from_numpy(x))
    np.testing.assert_array_equal(binned.counts, np.bincount(expected, minlength=_BINS + 2))
    positive = x[x > 0]
    assert (binned.zeros, binned.low, binned.high, binned.min_positive) == (
        2,
        0.0,
        float(x.max()),
        float(positive.min()),
    )
    np.testing.assert_array_equal(binned.index.numpy(), expected)


def test_nan_infinite_and_negative_values_are_counted_as_on_the_reference() -> None:
    for bad in (np.nan, np.inf, -1.0):
        x = torch.tensor([0.5, bad, 2.0, 0.0], dtype=torch.float64)
        hist, expected = LogHistogram(), LogHistogram()
        hist.update(x)
        os.environ[kernels.ENV] = "reference"
        expected.update(x)
        os.environ[kernels.ENV] = "numba"
        _assert_same(hist, expected)


@pytest.mark.parametrize("seed", range(3))
def test_histograms_equal_the_reference(seed) -> None:
    """Raw ratios, weights truncated from them (binned `like` them: only the values that
    differ move), masks of two values, constants, float64: the same histograms on both
    paths, with and without `like`."""
    rng = np.random.default_rng(seed)
    raw = torch.from_numpy(np.exp(rng.normal(0.0, 0.3, 100_000)).astype(np.float32))
    raw[:10] = 0.0
    weights = [
        raw.clamp(max=2.0),
        torch.where(raw > 1.5, 0.0, raw),
        torch.where(raw > 1.5, 0.0, 1.0),
    ]
    for values in [raw, *weights, torch.full((1000,), 0.7), raw.double()]:
        paths = []
        for mode in ("numba", "reference"):
            os.environ[kernels.ENV] = mode
            like = bin_values(raw) if values.shape == raw.shape else None
            for hist in (LogHistogram(), LogHistogram()):
                hist.add(bin_values(values, like=like))
                paths.append(hist)
                like = None
        os.environ[kernels.ENV] = "numba"
        for other in paths[1:]:
            _assert_same(paths[0], other)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("size", [5, 100_000])
def test_values_binned_with_a_choice_are_those_binned_apart(dtype, size) -> None:
    """`bin_chosen`: the histogram of all values and that of the chosen ones, as
    `LogHistogram.update` makes them of each apart on the reference, zeros of both signs,
    extremes, none, every and only zeros chosen; below and above `kernels.SPLIT` values."""
    rng = np.random.default_rng(size)
    x = torch.from_numpy(np.abs(rng.standard_normal(size)) * 10.0 ** rng.uniform(-14, 9, size))
    x = x.to(dtype)
    x[:4] = torch.tensor([0.0, -0.0, torch.finfo(dtype).max, torch.finfo(dtype).tiny], dtype=dtype)
    random = torch.from_numpy(rng.random(size) < 0.3)
    zeros = x == 0
    for chosen in (random, ~random, zeros, ~zeros, torch.zeros(size, dtype=torch.bool)):
        found = bin_chosen(x, chosen)
        assert found is not None
        paths = []
        for binned in found:
            hist = LogHistogram()
            if binned is not None:
                hist.add(binned)
            paths.append(hist)
        os.environ[kernels.ENV] = "reference"
        expected = [LogHistogram(), LogHistogram()]
        expected[0].update(x)
        if chosen.any():
            expected[1].update(x[chosen])
        os.environ[kernels.ENV] = "numba"
        for got, want in zip(paths, expected, strict=True):
            _assert_same(got, want)
            assert math.copysign(1.0, got.min) == math.copysign(1.0, want.min)


def test_log_bins_count_the_same_in_any_number_of_ranges() -> None:
    """The compiled counts (histogram bins, the joint grid) do not depend on how many ranges
    (threads) count them, nor the slots written, nor the stats of the chosen values."""
    rng = np.random.default_rng(1)
    x = np.exp(rng.normal(0.0, 3.0, 10_001))
    x[::97] = 0.0
    chosen = rng.random(x.size) < 0.5
    k = kernels._ready()
    first, shift, slots, thresholds = _slot_table(torch.float64)
    found = []
    for parts in (1, 2, 3, 7):
        counts, stats = np.zeros((2, _BINS + 2), np.int64), np.empty((2, 4))
        index = np.empty(x.size, np.int32)
        bits = x.view(np.int64)
        k.log_bins(x, bits, first, shift, slots, thresholds, chosen, counts, index, stats, parts)
        found.append((counts, stats, index))
    for counts, stats, index in found:
        np.testing.assert_array_equal(counts, found[0][0])
        np.testing.assert_array_equal(stats, found[0][1])
        np.testing.assert_array_equal(index, found[0][2])
    counts, stats, index = found[0]
    np.testing.assert_array_equal(counts[0], np.bincount(index, minlength=_BINS + 2))
    np.testing.assert_array_equal(counts[1], np.bincount(index[chosen], minlength=_BINS + 2))
    picked = x[chosen]
    assert stats[0, [0, 3]].tolist() == [np.sum(x == 0), x[x > 0].min()]
    grids = []
    y = rng.permutation(x)
    for parts in (1, 2, 3, 7):
        grid = np.zeros(80 * 80, np.int64)
        assert k.joint_counts(-np.log(x + 1e-9), -y, -20.0, 4.0, 80, grid, parts)
        grids.append(grid)
    for grid in grids:
        np.testing.assert_array_equal(grid, grids[0])
    assert grids[0].sum() == x.size
    late_nan = np.r_[-y[:-1], np.nan]  # met by the last range only: nothing added
    assert not k.joint_counts(-np.log(x + 1e-9), late_nan, -20.0, 4.0, 80, grid, 3)
    np.testing.assert_array_equal(grid, grids[0])
    assert stats[1].tolist() == [np.sum(picked == 0), 0.0, picked.max(), picked[picked > 0].min()]


def _value_stats(x: np.ndarray, like: np.ndarray | None) -> kernels.ValueStats:
    """`kernels.value_stats` written out from its definitions, in float64 numpy."""
    if not (np.isfinite(x).all() and (x >= 0).all()):
        return kernels.ValueStats(clean=False)
    zero = x == 0
    positive = x[x > 0]
    return kernels.ValueStats(
        True,
        int(zero.sum()),
        int((zero & np.signbit(x)).sum()),
        float(x.min()),
        float(x.max()),
        float(positive.min()) if positive.size else math.inf,
        0 if like is None else int((x != like).sum()),
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("size", [1, 2, 7, 100_000])
def test_value_stats_equal_their_definitions(dtype, size) -> None:
    """Zeros of both signs, every value zero (of either sign), the extremes of the type,
    subnormals, values compared with others or with themselves; NaN (of either sign),
    infinities and negative values anywhere make them unclean. The same in any number of
    ranges (threads)."""
    rng = np.random.default_rng(size)
    info = np.finfo(dtype)
    x = (np.abs(rng.standard_normal(size)) * 10.0 ** rng.uniform(-30, 30, size)).astype(dtype)
    extremes = np.array([0.0, -0.0, info.max, info.smallest_subnormal, info.tiny], dtype)
    x[: min(size, 5)] = extremes[: min(size, 5)]
    x = rng.permutation(x)
    other = np.where(rng.random(size) < 0.1, x / dtype(2), x)
    cases = [
        (x, None),
        (x, other),
        (x, x.copy()),
        (np.zeros(size, dtype), None),
        (np.full(size, -0.0, dtype), np.zeros(size, dtype)),
    ]
    for bad in (np.nan, -np.nan, np.inf, -np.inf, -info.smallest_subnormal, -1.0):
        for at in {0, size // 2, size - 1}:
            y = x.copy()
            y[at] = bad
            cases.append((y, None))
    for values, like in cases:
        want = _value_stats(values, like)
        got = kernels.value_stats(values, like)
        assert got == want
        if got.clean and got.low == 0.0:
            assert math.copysign(1.0, got.low) == 1.0  # a zero min is +0
    k = kernels._ready()
    bits = x.view(np.int32 if dtype == np.float32 else np.int64)
    info_int = np.iinfo(bits.dtype)
    infinity = np.array([np.inf], dtype).view(bits.dtype)[0]
    limits = np.array([info_int.min, infinity, info_int.max], bits.dtype)
    found = []
    for parts in (1, 2, 3, 7):
        out = np.zeros((parts, 6), np.int64)
        k.value_stats(bits, x, other, limits, out, parts)
        found.append([out[:, 0].sum(), out[:, 1].sum(), out[:, 2].min(), out[:, 3].max()])
        found[-1] += [out[:, 4].min(), out[:, 5].sum()]
    assert all(f == found[0] for f in found)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_values_with_negative_zeros_bin_as_on_the_reference(dtype) -> None:
    """Weights zeroed as -0 (alone, beside +0, everywhere), binned afresh and like their raw
    ratios: the counts and the zero torch's `aminmax` reports as the min or max."""
    raw = torch.exp(torch.randn(100_000, dtype=torch.float64) * 0.3).to(dtype)
    raw[:5] = 0.0
    signs = torch.where(torch.arange(raw.numel()) % 2 == 0, -0.0, 0.0).to(dtype)
    weights = [
        torch.where(raw > 1.5, -0.0, raw),
        torch.where(raw > 1.5, signs, raw),
        torch.full_like(raw, -0.0),
        torch.where(raw > 1.5, -0.0, 1.0).to(dtype),
    ]
    for values in weights:
        found = []
        for mode in ("numba", "reference"):
            os.environ[kernels.ENV] = mode
            for like in (None, bin_values(raw)):
                hist = LogHistogram()
                hist.add(bin_values(values, like=like))
                found.append(hist)
        os.environ[kernels.ENV] = "numba"
        for hist in found[1:]:
            _assert_same(hist, found[0])
            for a, b in ((hist.min, found[0].min), (hist.max, found[0].max)):
                assert math.copysign(1.0, a) == math.copysign(1.0, b)


def _assert_same(a: LogHistogram, b: LogHistogram) -> None:
    np.testing.assert_array_equal(a.counts, b.counts)
    scalars = ("zeros", "underflow", "overflow", "nan", "min", "max", "min_positive")
    assert [getattr(a, k) for k in scalars] == [getattr(b, k) for k in scalars]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_joint_counts_equal_the_reference(dtype) -> None:
    """The (rollout, train) grid: random log-probs, values on every grid line and one ulp
    either side, beyond both ends; the same cells as the float64 reference."""
    rng = np.random.default_rng(0)
    lines = np.linspace(-20.0, 0.0, 81)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    on = lines.astype(np_dtype)
    edges = np.concatenate(
        [on, np.nextafter(on, np_dtype(-np.inf)), np.nextafter(on, np_dtype(np.inf))]
    )
    x = np.concatenate([-rng.exponential(3.0, 90_000), edges, [-1e30, -25.0, 0.5, 3e30]]).astype(
        np_dtype
    )
    y = rng.permutation(x)
    grids = []
    for mode in ("numba", "reference"):
        os.environ[kernels.ENV] = mode
        grid = Histogram2D(-20.0, 0.0, 80)
        grid.update(torch.from_numpy(x), torch.from_numpy(y))
        grids.append(grid.counts)
    os.environ[kernels.ENV] = "numba"
    np.testing.assert_array_equal(grids[0], grids[1])
    assert grids[0].sum() == x.size
    counts = np.zeros((80, 80), np.int64)
    assert not kernels.joint_counts(np.array([np.nan]), np.array([-1.0]), -20.0, 4.0, counts)
    assert not counts.any()


@pytest.mark.parametrize("sample", sorted(Path("data").glob("*.parquet")), ids=lambda p: p.stem)
def test_an_analysis_is_the_same_on_both_paths(sample) -> None:
    """Every number of an analysis with every framework's default setting, byte for byte:
    the medians, far counts, histograms, grid and by-probability table of the kernels are
    the reference's (the samples hold prompt tokens outside the loss, and one step or many)."""
    specs = [resolve(s) for s in SETTINGS]
    documents = []
    for mode in ("numba", "reference"):
        os.environ[kernels.ENV] = mode
        documents.append(json.dumps(analyze(str(sample), specs).to_dict(), sort_keys=True))
    os.environ[kernels.ENV] = "numba"
    assert documents[0] == documents[1]


@pytest.mark.parametrize("mode", ["numba", "reference"])
def test_an_analysis_does_not_depend_on_the_thread_count(mode) -> None:
    """Every number of an analysis, byte for byte, on one thread and on three (torch's and
    the kernels'): every float sum adds per sequence, then over the sequences, in an order no
    thread count changes (the d-on-rollout regression's sums were torch's parallel dot
    products, whose order is)."""
    code = (
        "import json, sys, torch; torch.set_num_threads(int(sys.argv[1])); "
        "from iscore.passes.analysis import analyze; from iscore.bench.base import SETTINGS; "
        "from iscore.frameworks.resolve import resolve; "
        "a = analyze('data/long_collapse.parquet', [resolve(s) for s in SETTINGS]); "
        "print(json.dumps(a.to_dict(), sort_keys=True))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_NUM_THREADS", "OMP_NUM_THREADS")}
    env[kernels.ENV] = mode
    runs = [
        subprocess.run(
            [sys.executable, "-c", code, threads], env=env, capture_output=True, text=True
        )
        for threads in ("1", "3")
    ]
    assert [r.returncode for r in runs] == [0, 0], runs[0].stderr + runs[1].stderr
    assert runs[0].stdout == runs[1].stdout


# Lengths at numpy's pairwise-summation boundaries (8 accumulators, blocks of 128) and an
# empty sequence.
PAIRWISE_LENGTHS = [1, 2, 7, 8, 9, 0, 16, 17, 127, 128, 129, 130, 136, 137, 255, 256, 257, 1000]


def _sums_batch(rng: np.random.Generator, lengths: list[int], masked: bool) -> TokenBatch:
    n = sum(lengths)
    rollout = rng.uniform(-8.0, 0.0, n).astype(np.float32)
    train = (rollout + rng.normal(0.0, 0.3, n)).astype(np.float32)
    mask = rng.random(n) < 0.8 if masked else np.ones(n, bool)
    if masked and n > 2:
        mask[: lengths[0]] = False  # a fully masked sequence
    return TokenBatch(
        rollout=torch.from_numpy(rollout),
        train=torch.from_numpy(train),
        cu_seqlens=torch.tensor(np.r_[0, np.cumsum(lengths)], dtype=torch.int64),
        loss_mask=torch.from_numpy(mask),
    )


def _replay(rng: np.random.Generator, batch: TokenBatch, kind: str) -> Replay:
    n = batch.num_tokens
    raw = torch.from_numpy(np.exp(rng.normal(0.0, 1.0, n)).astype(np.float32))
    keep = torch.from_numpy(rng.random(n) < 0.9) & batch.loss_mask
    if kind == "mask only":  # weight 1 beside the ratio: no truncation
        weight = keep.float()
        return Replay(weight=weight, keep=keep, raw=raw)
    if kind == "extremes":  # overflowing ratios, NaN, infinities, zeros, negatives
        special = np.array([np.nan, np.inf, -1.0, 0.0, 3.4e38, 1e-45], np.float32)
        chosen = rng.random(n) < 0.1
        raw.numpy()[chosen] = rng.choice(special, int(chosen.sum()))
    if kind == "float64":
        raw = raw.double()
    weight = raw.clamp(max=2.0)
    # Ties and bounds: weights equal to raw, and at raw x (1 -+ the tolerance) as float64
    # computes them (exactly the bound in float64, next to it in float32).
    for factor in (1.0, 1 - 1e-6, 1 + 1e-6):
        hit = torch.from_numpy(rng.random(n) < 0.05)
        weight[hit] = (raw[hit].double() * factor).to(weight.dtype)
    weight = weight * keep
    pre = weight.clone() if kind == "normalized" else None
    if pre is not None:
        weight = weight / weight.sum().clamp(min=1e-30) * keep.sum()
    return Replay(weight=weight, keep=keep, raw=raw, pre_norm=pre)


@pytest.mark.parametrize("kind", ["token", "mask only", "extremes", "normalized", "float64"])
@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_setting_sums_equal_the_reference_and_the_definitions(kind, masked, seed) -> None:
    """The compiled per-sequence sums are the reference path's byte for byte (the weight sums
    in numpy's pairwise order) and the definitions written out in float64."""
    rng = np.random.default_rng(seed)
    lengths = [*PAIRWISE_LENGTHS, *rng.integers(1, 3000, 10).tolist()]
    batch = _sums_batch(rng, rng.permutation(lengths).tolist(), masked)
    result = _replay(rng, batch, kind)
    every = not masked
    compiled = _compiled_sums(batch, result, every)
    raw_clean = bool(torch.isfinite(result.raw).all() and (result.raw >= 0).all())
    reference = _sequence_sums(batch, result, every, raw_clean)
    assert compiled is not None and compiled.keys() == reference.keys()
    for name in reference:
        assert compiled[name].tobytes() == reference[name].tobytes(), name
    # The definitions, sequence by sequence.
    m, keep = batch.loss_mask.numpy(), result.keep.numpy()
    w = result.weight.numpy().astype(np.float64)
    pre = w if result.pre_norm is None else result.pre_norm.numpy().astype(np.float64)
    raw = result.raw.numpy().astype(np.float64)
    weighted = bool((pre[keep & m] != 1.0).any())
    assert weighted == (kind != "mask only")
    cu = batch.cu_seqlens.tolist()
    for s, (a, b) in enumerate(itertools.pairwise(cu)):
        sel = m[a:b]
        ws, kept, p, r = w[a:b][sel], keep[a:b][sel], pre[a:b][sel], raw[a:b][sel]
        assert compiled["w"][s] == pytest.approx(math.fsum(ws), rel=1e-12, abs=1e-300, nan_ok=True)
        assert compiled["w2"][s] == pytest.approx(
            math.fsum(ws * ws), rel=1e-12, abs=1e-300, nan_ok=True
        )
        assert compiled["T"][s] == sel.sum()
        assert compiled["kept"][s] == kept.sum()
        assert compiled["nonzero"][s] == (ws > 0).sum()
        with np.errstate(invalid="ignore", over="ignore"):
            active = kept & (p > 0) & weighted
            assert compiled["high"][s] == (active & (p < r * (1 - 1e-6))).sum()
            assert compiled["low"][s] == (active & (p > r * (1 + 1e-6))).sum()


def test_setting_sums_leave_other_dtypes_to_the_reference() -> None:
    rng = np.random.default_rng(0)
    batch = _sums_batch(rng, [3, 5], masked=False)
    result = _replay(rng, batch, "token")
    half = Replay(weight=result.weight.half(), keep=result.keep, raw=result.raw)
    assert _compiled_sums(batch, half, True) is None


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_means_equal_the_reference_and_a_loop(seed) -> None:
    """Each sequence's largest mean of WINDOW consecutive values, byte for byte as the
    running-sum reference, and as a loop over the windows (within rounding); a NaN wins (in
    its sequence, and through the running sums in those after it, as on the reference)."""
    rng = np.random.default_rng(seed)
    lengths = [0, 1, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW, 0, *rng.integers(1, 500, 40)]
    T = rng.permutation(np.array(lengths, np.int64))
    x = np.abs(rng.standard_cauchy(T.sum())) * 0.01
    if seed == 2:
        x[rng.integers(0, x.size, 3)] = np.nan
    got = kernels.window_means(x, T, WINDOW)
    assert got.tobytes() == _window_means(x, T).tobytes()
    starts = np.cumsum(T) - T
    for s, (a, n) in enumerate(zip(starts, T, strict=True)):
        seg = x[a : a + n]
        if n == 0:
            assert got[s] == 0.0
            continue
        windows = [seg[i : i + WINDOW] for i in range(n - WINDOW + 1)] if n >= WINDOW else [seg]
        means = [w.mean() for w in windows]
        if np.isnan(means).any():
            assert np.isnan(got[s])
        elif not np.isnan(x).any():
            assert got[s] == pytest.approx(max(means), rel=1e-9)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_sums_equal_the_reference(masked, seed) -> None:
    """The mismatch's per-sequence sums of d, |d|, d^2, k3, k3 reversed, js, e^|d|, e^d, e^2d,
    chi, the rollout log-prob squared and times d, and its k3 per token, byte for byte as the
    torch reference: at the pairwise
    boundaries, with zeros of both signs, |d| from 1e-8 to 300 (chi clamped past 20),
    outside the loss and in fully masked sequences."""
    rng = np.random.default_rng(seed)
    lengths = rng.permutation([*PAIRWISE_LENGTHS, *rng.integers(1, 3000, 10).tolist()])
    batch = _sums_batch(rng, lengths.tolist(), masked)
    n = batch.num_tokens
    scale = [0.05, 3.0, 100.0][seed]
    d = rng.normal(0.0, scale, n) * np.exp(rng.uniform(-18.0, 0.0, n) * (rng.random(n) < 0.2))
    d[rng.random(n) < 0.05] = rng.choice([0.0, -0.0, 1.0, -1.0, 20.0, -20.0], 1)
    m = batch.loss_mask
    dm = torch.where(m, torch.from_numpy(d), 0.0)
    absd, rho, em1 = dm.abs(), torch.exp(dm), torch.special.expm1(dm)
    below = dm < 0
    max_abs = np.array(
        [
            float(absd[a:b].max()) if b > a else -np.inf
            for a, b in itertools.pairwise(batch.cu_seqlens.tolist())
        ]
    )

    def buf(name, dtype=torch.float64):
        return torch.empty(n, dtype=dtype)

    masked_out = None if not masked else ~m
    rollout = torch.where(m, batch.rollout, 0.0)
    args = (batch, dm, absd, rho, em1, rollout, below, max_abs, masked_out, buf)
    reference, k3 = token_sums(*args)
    compiled = compiled_token_sums(batch, dm, rho, em1, rollout, max_abs, buf)
    assert compiled is not None
    assert compiled[0].keys() == reference.keys()
    for name in reference:
        assert compiled[0][name].tobytes() == reference[name].tobytes(), name
    assert compiled[1].numpy().tobytes() == k3.numpy().tobytes()
    assert (seed == 2) == (max_abs.max() > 20.0)  # the clamp of chi is exercised
    x, y = rollout.double().numpy(), dm.numpy()
    for s, (a, b) in enumerate(itertools.pairwise(batch.cu_seqlens.tolist())):
        for name, terms in (("rollout2", x[a:b] * x[a:b]), ("rollout_d", x[a:b] * y[a:b])):
            assert reference[name][s] == pytest.approx(math.fsum(terms), rel=1e-12, abs=1e-300)


def test_two_threads_take_turns_on_any_threading_layer() -> None:
    """Two threads calling parallel kernels at once (as two sessions of the app do) get the
    values one thread gets, on numba's `workqueue` layer too, which ends the process when two
    threads launch parallel loops together (where neither OpenMP nor TBB loads)."""
    code = """
import threading
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from iscore.packed import kernels

rng = np.random.default_rng(0)
x = np.abs(rng.normal(size=100_000))
counts = rng.integers(0, 1_000, 100)
values = rng.normal(size=int(counts.sum()))
alone = (kernels.value_stats(x), kernels.segment_medians(values, counts).tolist())
found = []

def work():
    for _ in range(100):
        found.append((kernels.value_stats(x), kernels.segment_medians(values, counts).tolist()))

threads = [threading.Thread(target=work) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(kernels.threading_layer(), len(found), all(f == alone for f in found))
"""
    env = {**os.environ, "NUMBA_THREADING_LAYER": "workqueue", kernels.ENV: "numba"}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.split() == ["workqueue", "200", "True"]


def _topk_batch(rng: np.random.Generator, n: int, k: int, token_id: bool) -> TokenBatch:
    """n one-token sequences with top-k columns: log-probs from -30 to 0 with ties (a row's
    largest entry repeated), rows whose engine's and trainer's orders differ, sampled ids
    inside and outside the k."""
    rollout = np.sort(-rng.exponential(2.0, (n, k)), axis=1)[:, ::-1].astype(np.float32)
    rollout[rng.random(n) < 0.1] = np.float32(-1.5)  # every entry tied
    train = (rollout + rng.normal(0, 0.3, (n, k))).astype(np.float32)
    train = np.minimum(train, 0.0).astype(np.float32)
    ties = rng.random(n) < 0.2
    train[ties, -1] = train[ties].max(axis=1)  # the trainer's largest twice
    ids = np.argsort(rng.random((n, k + 4)), axis=1)[:, :k].astype(np.int32)
    token = np.where(rng.random(n) < 0.7, ids[:, 0], k + 3).astype(np.int64)
    sampled = np.where(token == ids[:, 0], rollout[:, 0], np.float32(-40.0))
    return TokenBatch(
        rollout=torch.from_numpy(sampled.astype(np.float32)),
        train=torch.from_numpy((sampled + rng.normal(0, 0.1, n)).astype(np.float32)),
        cu_seqlens=torch.arange(n + 1),
        token_id=torch.from_numpy(token) if token_id else None,
        topk_ids=torch.from_numpy(ids),
        rollout_topk=torch.from_numpy(np.ascontiguousarray(rollout)),
        train_topk=torch.from_numpy(train),
    )


@pytest.mark.parametrize("token_id", [True, False])
@pytest.mark.parametrize("k", [1, 2, 20])
def test_topk_terms_equal_the_reference_and_the_definitions(token_id, k) -> None:
    """The whole distribution's per-token terms, byte for byte as the torch reference (sums in
    the ids' order, the first largest of ties), and each as its definition in float64 numpy."""
    from iscore.stats.distribution import token_terms

    rng = np.random.default_rng(k)
    batch = _topk_batch(rng, 5000, k, token_id)
    compiled, reference = token_terms(batch), _reference(token_terms, batch)
    assert compiled.keys() == reference.keys()
    for name in compiled:
        assert compiled[name].numpy().tobytes() == reference[name].numpy().tobytes(), name
    r, t = batch.rollout_topk.double().numpy(), batch.train_topk.double().numpy()
    mu, pi = np.exp(r), np.exp(t)
    assert np.allclose(compiled["rollout_mass"].numpy(), mu.sum(axis=1), rtol=1e-14)
    assert np.allclose(compiled["train_mass"].numpy(), pi.sum(axis=1), rtol=1e-14)
    top1 = np.argmax(r, axis=1) == np.argmax(t, axis=1)
    assert np.array_equal(compiled["top1"].numpy(), top1.astype(np.float64))
    assert k == 1 or 0 < top1.mean() < 1
    if token_id:
        inside = (batch.topk_ids.numpy() == batch.token_id.numpy()[:, None]).any(axis=1)
    else:
        inside = (batch.rollout_topk.numpy() == batch.rollout.numpy()[:, None]).any(axis=1)
    assert 0 < inside.mean() < 1
    d = batch.train.double().numpy() - batch.rollout.double().numpy()
    known = (mu * (r - t)).sum(axis=1)
    tail = np.where(inside, 0.0, np.expm1(d) - d)
    estimate = known + pi.sum(axis=1) - mu.sum(axis=1) + tail
    assert np.allclose(compiled["estimate"].numpy(), estimate, rtol=1e-12, atol=1e-15)


def test_topk_terms_with_a_value_not_finite_are_left_to_the_reference() -> None:
    rng = np.random.default_rng(0)
    batch = _topk_batch(rng, 10, 3, True)
    r, t = batch.rollout_topk.numpy(), batch.train_topk.numpy()
    ids, token, rollout = batch.topk_ids.numpy(), batch.token_id.numpy(), batch.rollout.numpy()
    mu, pi = np.exp(r.astype(np.float64)), np.exp(t.astype(np.float64))
    assert kernels.topk_terms(r, t, mu, pi, ids, token, rollout) is not None
    for bad in (np.nan, -np.inf):
        r2 = r.copy()
        r2[4, 1] = bad
        assert kernels.topk_terms(r2, t, mu, pi, ids, token, rollout) is None
    assert kernels.topk_terms(r.astype(np.float64), t, mu, pi, ids, token, rollout) is None


def test_an_analysis_with_top_k_columns_is_the_same_on_both_paths(tmp_path) -> None:
    """Every number of the distribution (per-sequence sums, each step's KL histogram, the
    tables by probability and by position) and of the rest of the analysis, byte for byte on
    both paths, with prompt tokens outside the loss."""
    from iscore.dump import SimConfig, write_simulated

    path = tmp_path / "topk.parquet"
    write_simulated(path, SimConfig(sequences=48, median_len=300, steps=3, vocab=24, topk=8))
    table = pq.read_table(path)
    masks = [np.asarray(m) for m in table["loss_mask"].to_pylist()]
    for m in masks:
        m[: len(m) // 5] = False
    column = pa.array(masks, pa.list_(pa.bool_()))
    pq.write_table(
        table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", column), path
    )
    documents = []
    for mode in ("numba", "reference"):
        os.environ[kernels.ENV] = mode
        documents.append(json.dumps(analyze(str(path), store=None).to_dict(), sort_keys=True))
    os.environ[kernels.ENV] = "numba"
    assert '"distribution"' in documents[0]
    assert documents[0] == documents[1]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_take_by_runs_equals_the_gather(seed) -> None:
    """Sequences taken in another order, copied run by run (`kernels.gather_runs`): every
    tensor the same as the gather's, the top-k rows and the masks too, with empty sequences,
    a sequence taken twice and none."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(0, 50, 40)
    lengths[[3, 17]] = 0
    n = int(lengths.sum())
    k = 5
    batch = TokenBatch(
        rollout=torch.from_numpy(rng.normal(size=n).astype(np.float32)),
        train=torch.from_numpy(rng.normal(size=n).astype(np.float32)),
        cu_seqlens=torch.from_numpy(np.r_[0, np.cumsum(lengths)]),
        loss_mask=torch.from_numpy(rng.random(n) < 0.7),
        step=torch.from_numpy(rng.integers(0, 3, 40)),
        token_id=torch.from_numpy(rng.integers(0, 99, n)),
        topk_ids=torch.from_numpy(rng.integers(0, 99, (n, k)).astype(np.int32)),
        rollout_topk=torch.from_numpy(rng.normal(size=(n, k)).astype(np.float32)),
        train_topk=torch.from_numpy(rng.normal(size=(n, k)).astype(np.float32)),
    )
    for order in (rng.permutation(40), np.array([5, 5, 3, 0]), np.array([], np.int64)):
        index = torch.from_numpy(order.astype(np.int64))
        copied, gathered = batch.take(index, kernels.gather_runs), batch.take(index)
        for name in ("rollout", "train", "loss_mask", "token_id", "topk_ids", "train_topk"):
            a, b = getattr(copied, name), getattr(gathered, name)
            assert a.dtype == b.dtype and torch.equal(a, b), name
        assert torch.equal(copied.cu_seqlens, gathered.cu_seqlens)
        assert copied.seq_id.equals(gathered.seq_id)
    assert not _reference(kernels.gather_runs, *(np.zeros(1),) * 4)
