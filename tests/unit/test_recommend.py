"""Recommendations on simulator regimes whose right answer is known."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import numpy as np
import pytest

from iscore import TokenBatch, load, ops
from iscore.errors import ConfigError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.recommendation import (
    RULE_SYMBOLS,
    Targets,
    _preference,
    recommend,
)
from iscore.recommendation import broken_sequences as recommend_broken
from iscore.settings import parse_config
from iscore.simulate import SimConfig, broken_sequences, write_simulated
from tests.unit.frameworks.conftest import edge_batch

PRODUCT_KINDS = {"seq_tis", "seq_mask"}  # product (sequence-sum) weights or masks
DATA = Path(__file__).resolve().parents[2] / "data"


@pytest.fixture(scope="module")
def long_dense(tmp_path_factory):
    """Long sequences (median 4k tokens) with dense-bf16-to-MoE-level per-token mismatch."""
    path = tmp_path_factory.mktemp("rec") / "long.parquet"
    write_simulated(path, SimConfig(regime="long_collapse", sequences=64, seed=3))
    return load(path)


@pytest.fixture(scope="module")
def short_fp8(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "fp8.parquet"
    write_simulated(path, SimConfig(regime="fp8", sequences=96, median_len=300, seed=4))
    return load(path)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_long_sequences_are_not_given_product_weights(long_dense, framework):
    rec = recommend(long_dense, framework)
    assert rec.best.passes, rec.best.reason
    assert rec.best.kind not in PRODUCT_KINDS
    for candidate in rec.candidates:
        if candidate.kind in PRODUCT_KINDS and framework != "trl":
            # e^S collapses: the learning rate is cut far below the target range.
            assert not candidate.passes
            assert candidate.stats["lr_scale"] < 0.5
    assert any("Product (sequence-level) weights collapse" in w for w in rec.warnings)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_data_derived_thresholds_meet_the_budgets(short_fp8, framework):
    targets = Targets(max_token_drop=0.02, max_seq_drop=0.05)
    rec = recommend(short_fp8, framework, targets)
    assert rec.best.passes
    for candidate in rec.candidates:
        if candidate.kind in ("icepop", "token_mask", "geo_mask", "seq_mask_tis", "k3_mask"):
            # thresholds come from the data's quantiles so the drop budgets hold
            assert candidate.stats["token_masked_fraction"] <= 0.02 + 1e-9, candidate.reason
            assert candidate.stats["seq_masked_fraction"] <= 0.05 + 1e-9, candidate.reason
    assert all(c.reason for c in rec.candidates)
    ranks = [len(c.missed) for c in rec.candidates]
    assert ranks == sorted(ranks)  # passing candidates first


def test_traps_are_named():
    batch = edge_batch()
    assert any("overflows float32" in w for w in recommend(batch, "nemo_rl").warnings)
    assert any("[1/U, 1/L]" in w for w in recommend(batch, "verl").warnings)
    assert any("without rejection_sampling" in w for w in recommend(batch, "areal").warnings)
    assert any("effectively no mask" in w for w in recommend(batch, "openrlhf").warnings)
    assert any("sequence_mask" in w for w in recommend(batch, "trl").warnings)


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_token_drop": 1.5}, "max_token_drop"),
        ({"min_ess": -0.1}, "min_ess"),
        ({"lr_scale": (1.2, 2.0)}, "lr_scale"),
    ],
)
def test_invalid_targets(kwargs, key):
    with pytest.raises(ConfigError, match=f"`{key}`"):
        Targets(**kwargs)


def test_unknown_framework():
    with pytest.raises(ConfigError, match="Expected `framework` to be one of"):
        recommend(edge_batch(), "nope")


# ---------------------------------------------------------------- known regimes, fresh seeds


def _simulated(tmp_path_factory, regime: str, seed: int, **config) -> TokenBatch:
    path = tmp_path_factory.mktemp("regime") / f"{regime}.parquet"
    write_simulated(path, SimConfig(regime=regime, seed=seed, **config))
    return load(path)


@pytest.fixture(scope="module", params=[11, 12])
def benign(tmp_path_factory, request):
    return _simulated(tmp_path_factory, "dense_bf16", request.param, sequences=96, median_len=300)


@pytest.fixture(scope="module", params=[21, 22])
def broken_replica(tmp_path_factory, request):
    """A benign dump with 4% of its sequences from a stale replica, and which they are."""
    config = {"sequences": 100, "median_len": 300, "broken_share": 0.04}
    batch = _simulated(tmp_path_factory, "dense_bf16", request.param, **config)
    truth = SimConfig(regime="dense_bf16", seed=request.param, **config)
    return batch, broken_sequences(truth, 0)


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_benign_noise_is_not_masked(benign, framework):
    rec = recommend(benign, framework)
    assert rec.best.passes, rec.best.reason
    assert rec.best.stats["token_masked_fraction"] <= 0.005
    assert rec.best.stats["seq_masked_fraction"] <= 0.01
    assert rec.regimes[0].startswith("numerical noise only")
    # The simulator's noise, like bf16's, sits mostly in low-probability tokens.
    assert any(r.startswith("low-probability-token noise") for r in rec.regimes)


def test_the_token_cap_truncates_only_the_extreme_tail(benign):
    """At the healthy ratios' 99.9th percentile (rounded up to 3 digits): about 0.1% of the
    tokens truncated, not none (a cap beyond every ratio does nothing)."""
    rec = recommend(benign, "verl")
    tis = next(c for c in rec.candidates if c.kind == "token_tis")
    d = (benign.train - benign.rollout).double()[benign.loss_mask]
    center = float(np.median(d.numpy()))  # the noise's centre
    expected = np.exp(center + np.quantile((d - center).numpy(), 0.999))
    cap = rec.thresholds["token_cap"]
    assert expected <= cap <= expected * 1.01
    assert tis.spec.is_upper == cap
    assert 0.0003 <= tis.stats["truncated_high_fraction"] <= 0.0011  # float32 ratios at the cap


def test_token_bands_mask_only_the_extreme_tails(benign):
    """IcePop and token-mask bands sit at the healthy tokens' 0.1st and 99.9th percentiles
    (rounded outwards to 3 digits): about 0.1% of the tokens masked on each side, not none (a
    band beyond every token masks nothing)."""
    rec = recommend(benign, "verl")
    d = (benign.train - benign.rollout).double()[benign.loss_mask].numpy()
    center = float(np.median(d))
    low, high = np.exp(center + np.quantile(d - center, [0.001, 0.999]))
    band = rec.thresholds["token_band"]
    assert low * 0.99 <= band[0] <= low and high <= band[1] <= high * 1.01
    icepop = next(c for c in rec.candidates if c.kind == "icepop")
    assert 0.0008 <= icepop.stats["token_masked_fraction"] <= 0.0022
    assert icepop.stats["seq_masked_fraction"] == 0.0


def test_far_off_tokens_do_not_stretch_a_band_or_win_by_a_rounding(short_fp8):
    """fp8 outliers (|d| up to ~15) are not broken sequences; a band keeping them would reach
    e^15 and weigh them that much. Its upper bound is the token cap's, and a setting with
    unbounded token weights does not beat token TIS by an LR scale 0.2% nearer 1 when its
    ESS is lower (LR scales tie within whole percents)."""
    for framework in ("verl", "nemo_rl"):
        rec = recommend(short_fp8, framework)
        band, cap = rec.thresholds["token_band"], rec.thresholds["token_cap"]
        assert band[1] == pytest.approx(cap, rel=0.01) and cap < 20
        assert rec.best.kind == "token_tis", rec.best.reason


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_broken_sequences_are_masked_where_the_framework_can(broken_replica, framework):
    batch, broken = broken_replica
    rec = recommend(batch, framework)
    assert any(r.startswith("broken sequences") for r in rec.regimes)
    best = rec.best
    if best.passes:
        assert best.stats["broken_gradient_kept"] <= 0.10
        assert best.stats["healthy_seq_dropped"] <= 0.02
        # The ground truth agrees with what the recommender called broken.
        kept = recommend_broken_gradient(batch, best.spec, broken)
        assert kept <= 0.10
    else:  # the framework cannot: it says so, and names one that can if any
        assert any("cannot express a setting that removes the broken" in r for r in rec.regimes)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_context_dependent_offset_is_not_taken_for_broken_sequences(tmp_path_factory, seed):
    """Top-p processed rollout log-probs shift each sequence's median d by its own amount
    (the nucleus mass varies with the context): more than token noise explains, so the
    sequences' own spread widens the test and none is called broken (at 8 token-noise
    standard errors alone, seed 0 had 2 of 256). Stale replicas in a benign dump are still
    found (`test_broken_sequences_are_masked_where_the_framework_can`)."""
    batch = _simulated(tmp_path_factory, "offset_bug", seed, sequences=256)
    assert not recommend_broken(batch).any()


@pytest.fixture(scope="module")
def broken_tenth(tmp_path_factory):
    """A benign dump with 10% of its sequences from a stale replica."""
    return _simulated(tmp_path_factory, "dense_bf16", 3, sequences=64, broken_share=0.1)


def test_broken_sequences_leave_the_token_bounds_outside_the_noise(broken_tenth):
    """A stale replica's likely tokens have d near 0 (both log-probs near 0), so a token bound
    reaching them would cut the healthy noise (a cap of 1.01 truncated 8% of the tokens). Token
    bounds stay at the healthy tokens' 0.1st and 99.9th percentiles; the geometric mask drops
    the broken sequences."""
    rec = recommend(broken_tenth, "verl")
    broken = recommend_broken(broken_tenth)
    assert broken.any()
    lengths = broken_tenth.lengths.numpy()
    healthy = broken_tenth.loss_mask.numpy() & ~np.repeat(broken, lengths)
    d = (broken_tenth.train - broken_tenth.rollout).double().numpy()
    center = float(np.median(d[broken_tenth.loss_mask.numpy()]))
    low, high = np.exp(center + np.quantile(d[healthy] - center, [0.001, 0.999]))
    band, cap = rec.thresholds["token_band"], rec.thresholds["token_cap"]
    assert band[0] <= low and high <= band[1] and high <= cap <= high * 1.01
    assert rec.best.kind == "geo_mask_token_tis", rec.best.reason
    assert rec.best.stats["broken_gradient_kept"] == 0.0
    assert rec.best.stats["truncated_high_fraction"] <= 0.0011  # the healthy top 0.1% alone


@pytest.mark.parametrize("seed", [11, 32])
def test_noise_on_a_tiny_dump_is_no_global_offset(tmp_path_factory, seed):
    """30 fp8 tokens: their median d lies a quarter of their spread from 0 by chance (1 to 3
    standard errors of the median), which is no evidence of a semantics bug."""
    batch = _simulated(tmp_path_factory, "fp8", seed, sequences=1, median_len=30, max_len=30)
    rec = recommend(batch, "verl")
    assert rec.thresholds["global_offset"] is None
    assert not any(r.startswith("global offset") for r in rec.regimes)


def test_the_bundled_offset_bug_is_still_a_global_offset():
    rec = recommend(load(DATA / "offset_bug.parquet"), "verl")
    assert rec.thresholds["global_offset"] < 0
    assert rec.warnings[0].startswith("Fix the semantics bug first")


def test_the_collapse_is_stated_as_the_model_it_is(broken_tenth):
    """The long-sequence line and warning give e^(mean d x p90 length), named as such (it is
    not the median e^S measured on the longest sequences: 1.1e-05 against 1.9e-06 on
    long_collapse), from the healthy tokens in both."""
    batch = load(DATA / "long_collapse.parquet")
    rec = recommend(batch, "verl")
    d = (batch.train - batch.rollout).double()[batch.loss_mask].numpy()
    p90 = np.quantile(ops.segment_count(batch, batch.loss_mask).numpy(), 0.9)
    model = f"e^(mean d x length) is {np.exp(d.mean() * p90):.2g}"
    assert any(r.startswith("long-sequence collapse") and model in r for r in rec.regimes)
    assert any(w.startswith("Product (sequence-level)") and model in w for w in rec.warnings)
    broken = recommend(broken_tenth, "verl")
    line = next(r for r in broken.regimes if r.startswith("long-sequence collapse"))
    value = line.split("e^(mean d x length) is ")[1].split(":")[0]
    assert any(f"is {value} " in w for w in broken.warnings)


def test_lr_scales_rank_in_whole_percents_of_their_log(benign):
    """The LR-scale step buckets |ln LR scale| in whole percents: 0.997 and 0.995 tie (and
    1/0.995 with 0.995), while 0.991 and 0.989 fall either side of 1% and do not."""
    best = recommend(benign, "verl").best

    def bucket(lr_scale: float) -> int:
        return _preference(dataclasses.replace(best, stats=best.stats | {"lr_scale": lr_scale}))[3]

    assert bucket(0.997) == bucket(0.995) == bucket(1 / 0.995) == 0
    assert bucket(0.991) == 0 and bucket(0.989) == 1


def test_the_rule_symbols_define_d():
    assert RULE_SYMBOLS.startswith("d = train - rollout log-prob, ")


def recommend_broken_gradient(batch: TokenBatch, spec, broken: np.ndarray) -> float:
    """The share of the broken sequences' gradient a setting keeps: sum(w) / T over them."""
    result = spec.replay(batch)
    lengths = batch.lengths.numpy()
    seq = np.repeat(np.arange(lengths.size), lengths)
    mask = batch.loss_mask.numpy() & broken[seq]
    return float(result.weight.numpy()[mask].sum() / max(mask.sum(), 1))


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_long_sequences_keep_the_step_size(long_dense, framework):
    rec = recommend(long_dense, framework)
    assert rec.best.passes, rec.best.reason
    assert 0.8 <= rec.best.stats["lr_scale"] <= 1.25
    assert rec.best.stats["ess"] >= 0.5
    assert any(r.startswith("long-sequence collapse") for r in rec.regimes)


def test_an_offset_and_a_drift_are_named(tmp_path_factory):
    offset = _simulated(tmp_path_factory, "offset_bug", 31, sequences=64, median_len=300)
    rec = recommend(offset, "verl")
    assert any(r.startswith("global offset") for r in rec.regimes)
    # The pick comes with "fix the bug first", and the offset is in the JSON.
    assert rec.warnings[0].startswith("Fix the semantics bug first")
    assert rec.thresholds["global_offset"] < 0 and rec.to_dict()["thresholds"]["global_offset"]
    drift = _simulated(tmp_path_factory, "drift", 32, sequences=24, steps=6, median_len=200)
    assert any(r.startswith("drift") for r in recommend(drift, "verl").regimes)


def test_no_offset_no_semantics_warning(benign):
    rec = recommend(benign, "verl")
    assert rec.thresholds["global_offset"] is None
    assert not any(w.startswith("Fix the semantics bug") for w in rec.warnings)


def test_the_json_carries_replayable_configs(benign):
    doc = recommend(benign, "skyrl").to_dict()
    assert doc["best"]["config"]["framework"] == "skyrl"
    for candidate in doc["candidates"]:
        assert parse_config(candidate["config"]).name == candidate["name"]
    assert doc["runner_up"] is not None and doc["pick"]


def test_each_candidate_states_its_rule(benign):
    rec = recommend(benign, "verl")
    rules = {c.kind: c.rule for c in rec.candidates}
    cap, (lo, hi) = rec.thresholds["token_cap"], rec.thresholds["token_band"]
    assert rules["token_tis"] == f"token TIS: w = min(rho, {cap:g})"
    assert rules["token_mask"] == f"token mask: drop tokens unless {lo:g} <= rho <= {hi:g}"
    assert rec.to_dict()["best"]["rule"] == rec.best.rule


def test_ties_go_to_the_simpler_setting(benign):
    """Candidates that tie on every measured term are ordered by their number of weights and
    masks: a geometric mask that drops nothing more does not outrank plain token TIS."""
    ties = 0
    for framework in FRAMEWORKS:
        ranked = recommend(benign, framework).candidates
        for a, b in itertools.pairwise(ranked):
            if _preference(a)[:5] == _preference(b)[:5]:
                ties += 1
                assert a.stats["components"] <= b.stats["components"], (framework, a.kind)
    assert ties  # benign noise: masks drop nothing, so settings tie


@pytest.mark.parametrize(
    ("key", "value", "grade"),
    [
        ("lr_scale", 0.8, "good"),  # bounds exactly hit
        ("lr_scale", 1.25, "good"),
        ("lr_scale", 0.79, "fair"),
        ("lr_scale", 0.4, "fair"),
        ("lr_scale", 0.39, "bad"),
        ("lr_scale", 2.5, "fair"),
        ("lr_scale", 2.51, "bad"),
        ("ess", 0.8, "good"),  # good from 80% even where min_ess is lower
        ("ess", 0.79, "fair"),
        ("ess", 0.3, "fair"),
        ("ess", 0.29, "bad"),
        ("weight_mean", 1.1, "good"),
        ("weight_mean_seq", 0.5, "fair"),
        ("weight_mean", 2.01, "bad"),
        ("token_masked_fraction", 0.01, "good"),
        ("token_masked_fraction", 0.05, "fair"),
        ("token_masked_fraction", 0.051, "bad"),
        ("seq_masked_fraction", 0.05, "good"),
        ("seq_masked_fraction", 0.25, "fair"),
        ("seq_masked_fraction", 0.26, "bad"),
        ("truncated_high_fraction", 0.011, "fair"),
        ("ess", float("nan"), None),
        ("ess", None, None),
    ],
)
def test_grades(key, value, grade):
    assert Targets().grade(key, value) == grade


def test_grades_follow_the_targets():
    strict = Targets(max_token_drop=0.001, lr_scale=(0.95, 1.05), min_ess=0.9)
    assert strict.grade("token_masked_fraction", 0.002) == "fair"
    assert strict.grade("lr_scale", 0.9) == "fair"
    assert strict.grade("ess", 0.85) == "fair"


@pytest.mark.parametrize("framework", ["verl", "areal"])
def test_progress_counts_every_candidate(benign, framework):
    calls = []
    rec = recommend(benign, framework, progress=lambda done, total: calls.append((done, total)))
    n = len(rec.candidates)
    assert calls == [(i, n) for i in range(1, n + 1)]


def test_each_candidate_carries_its_title():
    """Pages split the display sentence at ':' to recover a candidate's name; the title is
    data now, in the JSON too."""
    rec = recommend(load("data/fp8.parquet"), "verl")
    for candidate in rec.candidates:
        assert candidate.reason.startswith(candidate.title + ": ")
        assert candidate.to_dict()["title"] == candidate.title
    assert rec.best.title == "token TIS, cap 5.47"


def test_broken_gradient_over_100_percent_says_it_amplifies(tmp_path):
    """'keeps 107% of the broken sequences' gradient' read as a typo: a token TIS cap above 1
    weighs a stale replica's tokens (ratios near e^1) up, so the words say it amplifies."""
    path = tmp_path / "broken.parquet"
    write_simulated(path, SimConfig(regime="dense_bf16", sequences=64, broken_share=0.1, seed=3))
    rec = recommend(load(path), "trl")
    tis = next(c for c in rec.candidates if c.kind == "token_tis")
    assert tis.stats["broken_gradient_kept"] > 1.0
    assert any(m.startswith("amplifies the broken sequences' gradient ") for m in tis.missed)
    assert not any("keeps 1" in m for m in tis.missed)
