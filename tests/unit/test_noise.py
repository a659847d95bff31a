"""`iscore.noise`: robust centre and spread, the per-sequence medians, which sequences lie
outside the noise, each step judged against its own, against direct computations."""

from __future__ import annotations

import numpy as np
import pytest

from iscore import load, noise
from iscore.dump import Dump, readers
from iscore.mismatch import MismatchStats
from iscore.mismatch import broken_sequences as broken_of
from iscore.noise import Noise, outside, segment_medians
from iscore.simulate import SimConfig, broken_sequences, write_simulated


@pytest.mark.parametrize("seed", range(4))
def test_segment_medians_match_a_median_per_segment(seed, monkeypatch) -> None:
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
    found = outside(segment_medians(d, T), T.astype(float), positive, negative, Noise.of(d))
    assert set(np.flatnonzero(found)) == set(stale)


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
