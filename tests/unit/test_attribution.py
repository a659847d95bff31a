"""Where the mismatch comes from (`iscore.attribution`): each source alone, simulated with
seeds no bundled sample uses, is named, and no other is."""

from __future__ import annotations

import numpy as np
import pytest

import iscore
from iscore.analysis import analyze
from iscore.attribution import SPAN_RATIO, AttributionStats, _span_ratios
from iscore.simulate import SimConfig, read_truth, write_simulated


def _attribution(tmp_path, **config):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(**{"sequences": 64, **config}))
    return analyze(path).attribution, path


def _kinds(attribution):
    return [f["kind"] for f in attribution["findings"]]


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"regime": "dense_bf16", "seed": 61}, ["numerics"]),
        ({"regime": "fp8", "seed": 62}, ["numerics"]),
        ({"regime": "moe_routing", "seed": 63}, ["routing", "numerics"]),
        ({"regime": "offset_bug", "seed": 64}, ["nucleus"]),
        ({"regime": "temperature_bug", "seed": 65}, ["temperature"]),
        ({"regime": "dense_bf16", "seed": 66, "broken_share": 0.05}, ["broken", "numerics"]),
        ({"regime": "drift", "seed": 67, "steps": 4, "sequences": 32}, ["drift", "numerics"]),
    ],
    ids=["bf16", "fp8", "routing", "top-p", "temperature", "stale-replica", "drift"],
)
def test_each_source_alone_is_named(tmp_path, config, expected):
    attribution, _ = _attribution(tmp_path, **config)
    assert _kinds(attribution) == expected
    for finding in attribution["findings"]:
        assert finding["evidence"] and finding["summary"] and finding["action"]


def test_the_temperature_finding_says_which_side_is_sharper(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="temperature_bug", seed=68, sequences=32)
    (finding,) = attribution["findings"]
    # The rollout samples at 0.7, the trainer at 1: d falls as the rollout's log-prob rises.
    assert finding["evidence"]["correlation"] < -0.3 and finding["evidence"]["slope"] < 0
    assert "sharper" in finding["summary"]


def test_the_nucleus_finding_estimates_the_kept_mass(tmp_path):
    attribution, path = _attribution(tmp_path, regime="offset_bug", seed=69, sequences=32)
    (finding,) = attribution["findings"]
    truth = read_truth(path).expected_ratio  # the trainer's mass on the nucleus
    assert finding["evidence"]["ratio_mean"] == pytest.approx(truth, abs=0.003)


def test_staleness_that_grows_with_the_lag_is_named_and_split_per_step(tmp_path):
    config = {"regime": "dense_bf16", "seed": 70, "steps": 4, "sequences": 32}
    attribution, path = _attribution(tmp_path, policy_sigma=0.1, policy_growth=2.0, **config)
    assert _kinds(attribution)[0] == "staleness"
    truth = read_truth(path)
    rows = attribution["by_step"]
    for row, step in zip(rows, truth.steps, strict=True):
        assert row["lag_k3"] == pytest.approx(step.kl_train_policy, rel=0.25)
        assert row["engine_k3"] == pytest.approx(step.kl_rollout_train, rel=0.5)
    lag = [r["lag_k3"] for r in rows]
    assert lag == sorted(lag) and lag[-1] > 20 * lag[0]
    evidence = attribution["findings"][0]["evidence"]
    assert evidence["lag_growth"] > 20 and evidence["engine_growth"] < 2


def test_a_small_steady_lag_leaves_the_engine_named(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="fp8", seed=71, policy_sigma=0.1)
    assert "engine" in _kinds(attribution) and "staleness" not in _kinds(attribution)
    (row,) = attribution["by_step"]
    assert row["lag_share"] < 0.5


def test_without_a_policy_there_is_no_split(tmp_path):
    attribution, _ = _attribution(tmp_path, regime="dense_bf16", seed=72, sequences=16)
    assert attribution["by_step"][0]["lag_k3"] is None
    assert not {"staleness", "engine"} & set(_kinds(attribution))


def test_a_span_of_large_d_is_found_and_a_lone_outlier_is_not():
    rng = np.random.default_rng(0)
    noise = np.abs(rng.normal(0.0, 0.01, 600))
    span = noise.copy()
    span[200:260] *= 15  # a routing flip over 60 tokens
    lone = noise.copy()
    lone[300] = 20.0  # one far-off token
    T = np.array([600, 600, 600])
    ratios = _span_ratios(np.concatenate([noise, span, lone]), T, np.zeros(3, np.int64))
    assert ratios[0] < SPAN_RATIO < ratios[1] and ratios[2] < SPAN_RATIO


def test_streamed_in_steps_equals_read_whole(tmp_path):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(regime="moe_routing", sequences=24, steps=3, seed=73))
    batch = iscore.load(path)
    steps = [batch.select(batch.step == s) for s in range(3)]
    # Equal up to float64 summation order (a cumulative sum per chunk or over the whole).
    streamed, whole_read = analyze(steps).attribution, analyze(batch).attribution
    assert _kinds(streamed) == _kinds(whole_read) == ["routing", "numerics"]
    assert streamed["by_step"] == whole_read["by_step"]
    merged = AttributionStats()
    for chunk in steps:
        part = AttributionStats()
        part.update(chunk)
        merged.merge(part)
    whole = AttributionStats()
    whole.update(batch)
    np.testing.assert_allclose(np.concatenate(merged.span), np.concatenate(whole.span), rtol=1e-12)
