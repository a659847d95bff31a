"""The noise model shared by the recommendation and the trend: robust centre and spread, the
per-sequence medians, and which sequences lie outside the noise."""

from __future__ import annotations

import numpy as np
import pytest

from iscore import noise
from iscore.noise import Noise, outside, segment_medians


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
