"""`iscore.stats.noise`: robust centre and spread, the per-sequence medians, which sequences lie
outside the noise, each step judged against its own, against direct computations."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from iscore import load
from iscore.dump import Dump, readers
from iscore.dump.simulate import SimConfig, broken_sequences, write_simulated
from iscore.packed import kernels
from iscore.stats import noise
from iscore.stats.mismatch import MismatchStats
from iscore.stats.mismatch import broken_sequences as broken_of
from iscore.stats.noise import Noise, deviations, outside, segment_medians


@pytest.mark.parametrize("seed", range(4))
def test_segment_medians_match_a_median_per_segment(seed, monkeypatch) -> None:
    """The numpy reference (the compiled kernel: tests/unit/test_kernels.py)."""
    monkeypatch.setenv(kernels.ENV, "reference")
    rng = np.random.default_rng(seed)
    # Empty, one-value, even and odd, and long segments; ties; with small blocks, segments
    # of one width sorted in several blocks, and a segment wider than a block.
    counts = np.concatenate([[0, 1, 2, 3, 0, 4097], rng.integers(0, 300, 500)])
    values = rng.standard_normal(int(counts.sum())).round(1 + seed)
    starts = np.cumsum(counts) - counts
    pairs = zip(starts, counts, strict=True)
    expected = [np.median(values[a : a + n]) if n else 0.0 for a, n in pairs]
    np.testing.assert_array_equal(segment_medians(values, counts), expected)
    monkeypatch.setattr(noise, "MEDIAN_CELLS", 4096)
    np.testing.assert_array_equal(segment_medians(values, counts), expected)
    # Every segment of over 2 values partitioned alone, then every one sorted in blocks.
    for long in (2, 1 << 20):
        monkeypatch.setattr(noise, "LONG_SEGMENT", long)
        np.testing.assert_array_equal(segment_medians(values, counts), expected)


@pytest.mark.parametrize("seed", range(3))
def test_a_stale_replica_is_outside_the_noise_and_noise_is_not(seed) -> None:
    rng = np.random.default_rng(seed)
    T = rng.integers(16, 2000, 300)
    d = rng.standard_t(4, int(T.sum())) * 0.05
    stale = rng.choice(300, 6, replace=False)
    starts = np.cumsum(T) - T
    for i in stale:
        d[starts[i] : starts[i] + T[i]] += 1.0
    positive, negative = (np.add.reduceat(x, starts) for x in (d > 0, d < 0))
    far = noise.segment_counts(deviations(d, np.full(d.size, -1.0)) > noise.FAR, T)
    medians = segment_medians(d, T)
    found = outside(medians, T.astype(float), positive, negative, far, Noise.of(d))
    assert set(np.flatnonzero(found)) == set(stale)


def _signs(d: np.ndarray, T: np.ndarray) -> list[np.ndarray]:
    starts = np.cumsum(T) - T
    return [np.add.reduceat(x, starts) for x in (d > 0, d < 0)]


def _outside(d: np.ndarray, rollout: np.ndarray, T: np.ndarray) -> np.ndarray:
    """`outside` for one step, every statistic computed from the tokens."""
    far = noise.segment_counts(deviations(d, rollout) > noise.FAR, T)
    return outside(segment_medians(d, T), T.astype(float), *_signs(d, T), far, Noise.of(d))


@pytest.mark.parametrize("seed", range(4))
def test_deviations_match_a_direct_computation(seed) -> None:
    """Each token's |d - median| / (1.4826 MAD) among the tokens of its probability bin, in
    float64, written out; a bin whose MAD is 0 uses the floor."""
    rng = np.random.default_rng(seed)
    n = 3000
    rollout = np.log(rng.uniform(1e-6, 1.0, n))
    rollout[:50] = np.log(0.1)  # a token exactly on an edge goes to the bin above it
    rollout[50:700] = -1e-5  # a bin whose MAD is 0: most of its log-ratios are exactly 0
    d = rng.standard_t(3, n) * 0.1 * (1.0 - np.exp(rollout))
    d[50:500] = 0.0
    d[600] = 0.05
    edges = [0.0, 0.01, 0.1, 0.5, 0.9, 0.99, 0.999, 0.9999, np.inf]
    p = np.exp(rollout)
    expected = np.empty(n)
    for low, high in itertools.pairwise(edges):
        inside = (p >= low) & (p < high)
        if inside.any():
            center = np.median(d[inside])
            spread = max(1.4826 * np.median(np.abs(d[inside] - center)), noise.SPREAD_FLOOR)
            expected[inside] = np.abs(d[inside] - center) / spread
    np.testing.assert_allclose(deviations(d, rollout), expected, rtol=1e-12, atol=0)
    # The floor, not a division by 0.
    assert deviations(d[50:700], rollout[50:700])[550] == 0.05 / noise.SPREAD_FLOOR


def test_a_large_bin_estimates_its_noise_on_a_sample() -> None:
    """Above BIN_SAMPLE tokens a bin's centre and spread come from a strided sample: within
    2% (and 0.02) of the exact deviations, far tokens called alike but for a few per mille."""
    rng = np.random.default_rng(0)
    n = 5 * noise.BIN_SAMPLE + 123
    d = rng.standard_t(3, n) * 0.05 + 0.01
    rollout = np.full(n, -1.0)
    center = np.median(d)
    exact = np.abs(d - center) / (1.4826 * np.median(np.abs(d - center)))
    sampled = deviations(d, rollout)
    np.testing.assert_allclose(sampled, exact, rtol=0.02, atol=0.02)
    assert np.mean((sampled > noise.FAR) != (exact > noise.FAR)) < 0.005


def test_float32_log_probs_are_binned_as_their_float64_values() -> None:
    """Float32 log-probs are binned by float32 comparisons: the same bins, so the same
    deviations, as their exact float64 values, also one ulp either side of every edge."""
    rng = np.random.default_rng(0)
    edges = np.log(noise.SCALE_EDGES).astype(np.float32)
    near = np.concatenate([edges, *(np.nextafter(edges, x) for x in (-np.inf, np.inf))])
    rollout = np.concatenate([np.log(rng.uniform(1e-6, 1.0, 5000)).astype(np.float32), near])
    d = rng.normal(0.0, 0.1, rollout.size)
    np.testing.assert_array_equal(deviations(d, rollout), deviations(d, rollout.astype(np.float64)))


@pytest.mark.parametrize("seed", range(3))
def test_a_replica_sampling_another_policy_is_found_in_short_sequences(seed) -> None:
    """A stale replica samples from another policy: its valid log-probs differ from the
    trainer's both ways, by far more than noise (d ~ N(-s^2/2, s), E[e^d] = 1), so its median
    barely moves, and at 16 tokens the sign test can never pass (at most 16 / sqrt(16) = 4
    standard errors). Its spread finds it: every such sequence, and no other (the testbed's
    stale regime, where the geometric mask trained best, had all of its stale sequences
    missed)."""
    rng = np.random.default_rng(seed)
    B, L = 256, 16
    T = np.full(B, L)
    rollout = np.log(rng.uniform(0.02, 1.0, B * L))
    d = rng.normal(0.0, 0.05, B * L)
    stale = rng.choice(B, 32, replace=False)
    tokens = (stale[:, None] * L + np.arange(L)).ravel()
    s = rng.uniform(0.3, 1.0, stale.size).repeat(L)
    d[tokens] = rng.normal(-(s**2) / 2, s)
    found = _outside(d, rollout, T)
    assert set(np.flatnonzero(found)) == set(stale.tolist())
    positive, negative = _signs(d, T)
    assert (np.abs(positive - negative) / np.sqrt(positive + negative) <= noise.Z_SIGNS).all()


@pytest.mark.parametrize("seed", range(3))
def test_uncertain_tokens_are_judged_against_tokens_as_likely(seed) -> None:
    """Noise grows as the rollout's probability falls: a sequence made of uncertain tokens has
    larger log-ratios than most, both ways, and is no broken sequence. Against the noise of
    tokens of its own probability it is ordinary; against that of the whole step (one bin),
    the spread test would call it broken."""
    rng = np.random.default_rng(seed)
    B, L = 200, 16
    T = np.full(B, L)
    uncertain = np.zeros(B * L, dtype=bool)
    uncertain[rng.random(B * L) < 0.2] = True
    chosen = rng.choice(B, 10, replace=False)
    uncertain[(chosen[:, None] * L + np.arange(L)).ravel()] = True  # 10 wholly uncertain
    rollout = np.where(uncertain, np.log(0.05), np.log(0.999))
    d = rng.normal(0.0, np.where(uncertain, 0.3, 0.003))
    assert not _outside(d, rollout, T).any()
    assert set(np.flatnonzero(_outside(d, np.full(d.size, -1.0), T))) >= set(chosen.tolist())


def test_the_spread_test_holds_its_bounds_exactly() -> None:
    """Exactly half of a sequence's tokens far is not broken, one more is; a sequence all of
    whose few tokens are far is broken only from Z_BROKEN binomial standard errors above
    noise's share; a sequence without loss tokens never is."""
    q = noise.FAR_SHARE
    # T far tokens of T lie (T - q T) / sqrt(q (1 - q) T) = sqrt(T (1 - q) / q) standard
    # errors above noise: Z_BROKEN at T = Z_BROKEN^2 q / (1 - q), 2.88 tokens.
    at_z = noise.Z_BROKEN**2 * q / (1.0 - q)
    below, above = at_z * (1 - 1e-9), at_z * (1 + 1e-9)
    T = np.array([100.0, 100.0, below, above, 1.0, 4.0, 0.0])
    far = np.array([50.0, 51.0, below, above, 1.0, 4.0, 0.0])
    zeros = np.zeros(T.size)
    found = outside(zeros, T, zeros, zeros, far, Noise(0.0, 0.05, 100))
    # One far token of one is 4.7 standard errors: not broken; four of four are 9.4.
    assert found.tolist() == [False, True, False, True, False, True, False]


def test_far_counts_per_segment_match_a_loop() -> None:
    rng = np.random.default_rng(0)
    T = np.concatenate([[0, 1, 0], rng.integers(0, 50, 200), [0]])
    flags = rng.random(int(T.sum())) < 0.3
    starts = np.cumsum(T) - T
    expected = [flags[a : a + n].sum() for a, n in zip(starts, T, strict=True)]
    np.testing.assert_array_equal(noise.segment_counts(flags, T), expected)


@pytest.mark.parametrize("seed", [0, 1])
def test_steps_in_any_order_are_judged_each_against_its_own_tokens(seed) -> None:
    """Sequences of one step written together (slices) or interleaved with other steps'
    (indices): each sequence's far tokens and broken verdict are the same."""
    rng = np.random.default_rng(seed)
    T = rng.integers(0, 400, 60)
    T[[3, 40]] = 0
    steps = np.repeat([2, 5, 9], 20)
    step_of_token = np.repeat(steps, T)
    d = rng.normal(0.0, 0.05, T.sum()) * np.where(step_of_token == 5, 8.0, 1.0)
    d[: T[0]] += 0.5  # a stale sequence in step 2
    rollout = rng.uniform(-6.0, 0.0, T.sum())
    signs = [noise.segment_counts(x, T) for x in (d > 0, d < 0)]
    noises, far = noise.step_noise(d, rollout, T, steps)
    broken = noise.outside_by_step(d, rollout, T, *signs, steps)
    order = rng.permutation(T.size)
    starts = np.cumsum(T) - T
    tokens = np.concatenate([np.arange(starts[i], starts[i] + T[i]) for i in order])
    shuffled = (d[tokens], rollout[tokens], T[order])
    shuffled_noises, shuffled_far = noise.step_noise(*shuffled, steps[order])
    assert shuffled_noises == noises
    np.testing.assert_array_equal(shuffled_far, far[order])
    shuffled_signs = [s[order] for s in signs]
    got = noise.outside_by_step(*shuffled, *shuffled_signs, steps[order])
    np.testing.assert_array_equal(got, broken[order])
    assert broken[0] and far.sum() > 0


def test_a_step_spread_over_ranks_takes_the_median_of_their_noise() -> None:
    """One bad rank (every token of its file off by 1 nat) cannot move the step's noise."""
    parts = [Noise(0.001 * i, 0.05, 1000) for i in range(7)] + [Noise(1.0, 0.05, 1000)]
    step = Noise.combine(parts)
    assert step.center == pytest.approx(0.0035) and step.spread == 0.05
    assert step.tokens == 8000
    assert Noise.combine(parts[:1]) is parts[0]


@pytest.mark.parametrize("seed", range(3))
def test_a_growing_mismatch_is_not_taken_for_broken_sequences(tmp_path, seed) -> None:
    """Judged against one noise estimate for all steps, the late steps of a run whose mismatch
    grows 1.5x per step were called broken (a 320-step run: 805 sequences, 7.9%); each step is
    judged against its own noise."""
    path = tmp_path / "drift.parquet"
    write_simulated(path, SimConfig(regime="drift", sequences=64, steps=10, seed=seed))
    assert not broken_of(load(path)).any()


@pytest.mark.parametrize("seed", range(3))
def test_a_stale_replica_is_found_in_a_growing_run(tmp_path, seed) -> None:
    path = tmp_path / "broken.parquet"
    config = SimConfig(regime="drift", sequences=64, steps=6, broken_share=0.1, seed=seed)
    write_simulated(path, config)
    truth = np.concatenate([broken_sequences(config, step) for step in range(6)])
    np.testing.assert_array_equal(broken_of(load(path)), truth)


def test_the_analysis_and_the_recommendation_call_the_same_sequences_broken(
    tmp_path, monkeypatch
) -> None:
    """Read in chunks, a step's noise is the median of its chunks' (`Noise.combine`); read
    whole, that of all its tokens: the broken sequences are the same."""
    monkeypatch.setattr(readers, "READ_TOKENS", 4096)
    path = tmp_path / "broken.parquet"
    config = SimConfig(regime="dense_bf16", sequences=96, broken_share=0.1, seed=5)
    write_simulated(path, config)
    stats = MismatchStats()
    chunks = list(Dump(path).batches(max_tokens=20_000))
    assert len(chunks) > 2
    for chunk in chunks:
        stats.update(chunk)
    whole = broken_of(load(path))
    np.testing.assert_array_equal(stats.broken(), whole)
    np.testing.assert_array_equal(whole, broken_sequences(config, 0))
    assert whole.sum() > 0
