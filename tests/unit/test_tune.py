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


def prime(**loss):
    return {"framework": "prime_rl", "loss": loss}


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
    ("dppo", (0.2, 0.2), {"framework": "prime_rl"}),
    ("dppo", (0.01, 0.03), prime(dppo_mask_low=0.01, dppo_mask_high=0.03)),
    ("ipo", (0.02,), prime(type="ipo", ipo_threshold=0.02)),
    ("ipo", (0.1,), prime(type="ipo")),
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


def _trust_reference(batch, low=None, high=None, threshold=None):
    """(tokens dropped, sum w, sum w^2) over loss tokens, from the formulas in numpy:
    dp = e^l_theta - e^l_r and rho = e^(l_theta - l_r) in float32, bounds as float32."""
    f32 = np.float32
    train, rollout = batch.train.numpy().astype(f32), batch.rollout.numpy().astype(f32)
    dp = np.exp(train) - np.exp(rollout)
    rho = np.exp(train - rollout).astype(np.float64)
    if threshold is not None:
        dropped = np.abs(dp) > f32(threshold)
    else:
        adv = batch.extra["advantage"].to_numpy(zero_copy_only=False).astype(np.float64)
        positive = np.repeat(adv, np.diff(batch.cu_seqlens.numpy())) > 0  # NaN: False
        dropped = np.where(positive, dp > f32(high), dp < -f32(low))
    keep = batch.loss_mask.numpy()
    w = np.where(dropped, 0.0, rho)[keep]
    return int(dropped[keep].sum()), float(w.sum()), float((w * w).sum())


@pytest.mark.parametrize("seed", [2, 3])
def test_trust_regions_equal_the_formulas(seed):
    rng = np.random.default_rng(seed)
    lengths = [1, 2, *rng.lognormal(4.0, 1.0, 40).astype(int).clip(1, 800).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=0.1)
    tuner = Tuner(batch)
    for low, high in ((0.2, 0.2), (0.01, 0.05), (0.0, 0.0), (1.0, 1.0)):
        got = tuner.dppo(low, high)
        dropped, w, w2 = _trust_reference(batch, low, high)
        assert got.token_masked_fraction == dropped / tuner.tokens
        # numpy's float32 exp and torch's may differ in the last place.
        assert got.lr_scale == pytest.approx(w / tuner.tokens, rel=1e-6)
        assert got.ess == pytest.approx(w * w / (tuner.tokens * w2), rel=1e-6)
    for threshold in (0.0, 0.03, 0.1, 1.0):
        dropped, w, _ = _trust_reference(batch, threshold=threshold)
        got = tuner.ipo(threshold)
        assert got.token_masked_fraction == dropped / tuner.tokens
        assert got.lr_scale == pytest.approx(w / tuner.tokens, rel=1e-6)


def test_trust_region_bounds_hit_exactly_and_the_advantage_sides():
    """A token whose dp equals the bound (as float32) is kept, as prime-rl's strict `>`
    keeps it; A = 0 and a NaN advantage take the low side; DPPO needs the advantage."""
    import pyarrow as pa
    import torch

    from iscore.errors import ConfigError
    from iscore.packed.batch import TokenBatch

    rollout = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    train = torch.tensor([-0.5, -1.5, -1.5, -1.5])
    batch = TokenBatch(
        rollout=rollout,
        train=train,
        cu_seqlens=torch.tensor([0, 1, 2, 3, 4]),
        extra=pa.table({"advantage": [1.0, 0.0, float("nan"), -2.0]}),
    )
    dp = (torch.exp(train) - torch.exp(rollout)).tolist()  # float32 values, as Python floats
    tuner = Tuner(batch)
    # |dp| is 0.239 for token 0 and 0.145 for the others.
    assert tuner.ipo(abs(dp[0])).token_masked_fraction == 0  # |dp| = threshold is kept
    below = float(np.nextafter(np.float32(abs(dp[0])), np.float32(0)))
    assert tuner.ipo(below).token_masked_fraction == 0.25
    assert tuner.dppo(0.5, dp[0]).token_masked_fraction == 0  # dp = high is kept
    # The three A <= 0 tokens (0, NaN, -2) share dp < 0: a low bound below |dp| drops them all.
    assert tuner.dppo(-dp[1] * 0.99, 1.0).token_masked_fraction == 0.75
    assert tuner.dppo(-dp[1], 1.0).token_masked_fraction == 0
    spec = resolve(prime(dppo_mask_low=-dp[1] * 0.99, dppo_mask_high=1.0))
    assert spec.replay(batch).weight.tolist()[1:] == [0.0, 0.0, 0.0]
    no_advantage = TokenBatch(rollout=rollout, train=train, cu_seqlens=batch.cu_seqlens)
    with pytest.raises(ConfigError, match="`advantage` column"):
        Tuner(no_advantage).dppo(0.2, 0.2)
    assert Tuner(no_advantage).ipo(0.1).token_masked_fraction == 1
