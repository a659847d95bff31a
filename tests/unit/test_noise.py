"""`iscore.noise`: per-step noise and broken sequences, against direct computations."""

from __future__ import annotations

import numpy as np
import pytest

from iscore import load, noise
from iscore.dump import Dump, readers
from iscore.recommendation import broken_sequences as recommend_broken
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
    np.testing.assert_array_equal(noise.segment_medians(values, counts), expected)
    monkeypatch.setattr(noise, "MEDIAN_CELLS", 4096)
    np.testing.assert_array_equal(noise.segment_medians(values, counts), expected)


def test_summaries_are_each_sequence_s_median_and_spread():
    batch = load("data/moe_routing.parquet")
    s = noise.summarize(batch)
    d = (batch.train.double() - batch.rollout.double()).numpy()
    cu = batch.cu_seqlens.numpy()
    for i in range(0, batch.num_sequences, 7):
        x = d[cu[i] : cu[i + 1]]
        assert s.median[i] == np.median(x)
        assert s.spread[i] == pytest.approx(1.4826 * np.median(np.abs(x - np.median(x))))


@pytest.mark.parametrize("seed", range(3))
def test_a_growing_mismatch_is_not_taken_for_broken_sequences(tmp_path, seed):
    """Judged against one noise estimate for all steps, the late steps of a run whose mismatch
    grows 1.5x per step were called broken (a 320-step run: 805 sequences, 7.9%); each step is
    judged against its own noise now."""
    path = tmp_path / "drift.parquet"
    write_simulated(path, SimConfig(regime="drift", sequences=64, steps=10, seed=seed))
    assert not recommend_broken(load(path)).any()


@pytest.mark.parametrize("seed", range(3))
def test_a_stale_replica_is_found_in_a_growing_run(tmp_path, seed):
    path = tmp_path / "broken.parquet"
    config = SimConfig(regime="drift", sequences=64, steps=6, broken_share=0.1, seed=seed)
    write_simulated(path, config)
    batch = load(path)
    truth = np.concatenate([broken_sequences(config, step) for step in range(6)])
    np.testing.assert_array_equal(recommend_broken(batch), truth)


def test_a_step_split_over_files_is_judged_as_the_step_read_whole(tmp_path, monkeypatch):
    """The summaries merge: each rank's file summarized alone gives the same broken
    sequences as the step read whole."""
    monkeypatch.setattr(readers, "READ_TOKENS", 4096)
    path = tmp_path / "broken.parquet"
    write_simulated(path, SimConfig(regime="dense_bf16", sequences=96, broken_share=0.1, seed=5))
    whole = noise.summarize(load(path))
    parts = [noise.summarize(chunk) for chunk in Dump(path).batches(max_tokens=20_000)]
    assert len(parts) > 2
    merged = noise.Summaries(
        *(np.concatenate([getattr(p, f) for p in parts]) for f in ("step", "T", "median", "spread"))
    )
    np.testing.assert_array_equal(noise.broken(merged), noise.broken(whole))
    assert noise.broken(whole).sum() > 0
