"""Tune queries (binary searches over sorted statistics) equal full replays of the same setting."""

from __future__ import annotations

import numpy as np
import pytest

from iscore.advice.tuning import Tuner
from iscore.frameworks.resolve import resolve
from iscore.stats.setting import SettingStats
from tests.unit.frameworks.conftest import edge_batch, make_batch

VERL = "algorithm"


def verl(**rc):
    return {"framework": "verl", VERL: {"rollout_correction": rc}}


def skyrl(**opc):
    return {"framework": "skyrl", "trainer": {"algorithm": {"off_policy_correction": opc}}}


def replayed(batch, config) -> dict:
    spec = resolve(config)
    stats = SettingStats(spec)
    stats.update(batch, spec.replay(batch))
    return stats.compute().to_dict()


CASES = [
    ("token_tis", (2.0,), verl(rollout_is="token", rollout_is_threshold=2.0)),
    ("token_tis", (1.2,), verl(rollout_is="token", rollout_is_threshold=1.2)),
    (
        "token_tis",
        (5.0, 0.5),
        {"framework": "openrlhf", "args": "--algo.advantage.is_correction_enable"},
    ),
    ("icepop", (0.5, 2.0), verl(rollout_is="token", rollout_is_threshold="0.5_2.0")),
    ("icepop", (0.9, 1.1), verl(rollout_is="token", rollout_is_threshold="0.9_1.1")),
    ("seq_tis", (2.0,), verl(rollout_is="sequence", rollout_is_threshold=2.0)),
    ("geometric_mask", (0.99, 1.01), skyrl(sequence_mask_metric="geometric")),
    (
        "geometric_mask",
        (0.999, 1.001),
        skyrl(sequence_mask_metric="geometric", geo_mask_low=0.999, geo_mask_high=1.001),
    ),
    ("product_mask", (0.5, 2.0), skyrl(sequence_mask_metric="product")),
    ("k3_mask", (0.002,), verl(rollout_rs="seq_mean_k3", rollout_rs_threshold=0.002)),
]


@pytest.mark.parametrize(("family", "args", "config"), CASES)
@pytest.mark.parametrize("seed", [0, 1])
def test_query_equals_replay(family, args, config, seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, *rng.lognormal(4.5, 1.0, 60).astype(int).clip(1, 2000).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=[0.03, 0.15][seed])
    got = getattr(Tuner(batch), family)(*args)
    expected = replayed(batch, config)
    # Replays hand out float32 weights; the tuner sums float64 ratios.
    assert got.weight_mean == pytest.approx(expected["weight_mean"], rel=1e-6)
    assert got.ess == pytest.approx(expected["ess"], rel=1e-6)
    assert got.token_masked_fraction == pytest.approx(expected["token_masked_fraction"], abs=1e-12)
    if got.seq_masked_fraction is not None:
        assert got.seq_masked_fraction == pytest.approx(expected["seq_masked_fraction"], abs=1e-12)
    if family in ("token_tis", "seq_tis"):
        truncated = expected["truncated_high_fraction"] + expected["truncated_low_fraction"]
        assert got.truncated_fraction == pytest.approx(truncated, abs=1e-12)


def test_edges_overflow_and_bounds_hit_exactly():
    batch = edge_batch()
    tuner = Tuner(batch)
    # d = 0 exactly: ratio 1 sits on both bounds of [1, 1] and is kept (inclusive).
    kept = tuner.icepop(1.0, 1.0)
    ones = int((batch.train.double() - batch.rollout.double())[batch.loss_mask].eq(0).sum())
    assert kept.token_masked_fraction == pytest.approx(1 - ones / tuner.tokens)
    expected = replayed(batch, verl(rollout_is="sequence", rollout_is_threshold=3.0))
    assert tuner.seq_tis(3.0).weight_mean == pytest.approx(expected["weight_mean"], rel=1e-6)


def test_quantiles_are_nearest_ranks_of_the_statistic():
    batch = make_batch([100] * 30, seed=5, sigma=0.1)
    tuner = Tuner(batch)
    d = (batch.train.double() - batch.rollout.double()).numpy()
    keep = batch.loss_mask.numpy()
    rho = np.sort(np.exp(np.clip(d[keep], -20, 20)))
    seg = np.repeat(np.arange(30), 100)[keep]
    geo = np.sort(np.exp(np.bincount(seg, d[keep]) / np.bincount(seg)))
    qs = (0.0, 0.001, 0.5, 0.999, 1.0)
    for table, statistic in ((rho, "token"), (geo, "geometric")):
        got = tuner.quantiles(statistic, qs)
        expected = [table[round(q * (table.size - 1))] for q in qs]
        assert list(got.values()) == pytest.approx(expected, rel=1e-5)
