"""`recommend` with a current policy (`policy_logprob`): the bypass, current-policy and
decoupled candidates in one objective (docs/recommend.md#with-a-current-policy), on simulated
dumps with seeds no bundled sample uses."""

from __future__ import annotations

from dataclasses import replace

import pytest

import iscore
from iscore.advice.recommendation import recommend
from iscore.dump.simulate import SimConfig, write_simulated

POLICY_KINDS = {"bypass_ppo", "policy_token_tis", "policy_icepop", "policy_token_tis_ppo"}


def _batch(tmp_path, **config):
    path = tmp_path / "sim.parquet"
    write_simulated(path, SimConfig(**{"sequences": 32, **config}))
    return iscore.load(path)


def _by_kind(rec):
    return {c.kind: c for c in rec.candidates}


@pytest.mark.parametrize(
    ("framework", "kinds"),
    [
        ("verl", {"bypass_ppo", "policy_token_tis", "policy_icepop"}),
        ("skyrl", {"policy_token_tis", "policy_icepop"}),
        ("slime", {"bypass_ppo", "policy_token_tis_ppo"}),
        ("areal", {"bypass_ppo"}),
        ("nemo_rl", set()),
    ],
)
def test_the_third_policy_candidates_are_replayed_where_the_dump_has_a_policy(
    tmp_path, framework, kinds
):
    batch = _batch(tmp_path, seed=81, policy_sigma=0.05)
    with_policy = set(_by_kind(recommend(batch, framework))) & POLICY_KINDS
    assert with_policy == kinds
    without = recommend(replace(batch, policy=None), framework)
    assert not set(_by_kind(without)) & POLICY_KINDS


def test_a_policy_equal_to_the_recompute_changes_no_decoupled_objective(tmp_path):
    """Where the current policy has not moved (one update per rollout), a decoupled setting's
    whole weight is its correction's weight and the ideal is e^d: the objective without a
    policy, exactly."""
    batch = _batch(tmp_path, seed=82)
    on_policy = recommend(replace(batch, policy=batch.train.clone()), "verl")
    plain = recommend(batch, "verl")
    for kind, candidate in _by_kind(plain).items():
        assert _by_kind(on_policy)[kind].stats["objective"] == candidate.stats["objective"]


def test_bypass_ties_an_exact_decoupled_setting_inside_the_clip_and_is_simpler(tmp_path):
    batch = _batch(tmp_path, seed=83)
    # A tenth of bf16's mismatch: every ratio inside PPO's clip.
    train = batch.rollout + 0.1 * (batch.train - batch.rollout)
    rec = recommend(replace(batch, train=train, policy=train.clone()), "verl")
    kinds = _by_kind(rec)
    assert kinds["bypass_ppo"].stats["bias_healthy"] == 0.0
    assert kinds["bypass_ppo"].stats["objective"] == pytest.approx(
        kinds["token_tis"].stats["objective"], abs=1e-6
    )
    ranked = [c.kind for c in rec.candidates]
    assert ranked.index("bypass_ppo") < ranked.index("token_tis")  # no weight: fewer parts


def test_fp8_noise_pushes_bypass_out_of_the_clip_and_a_decoupled_cap_wins(tmp_path):
    batch = _batch(tmp_path, regime="fp8", seed=84)
    kinds = _by_kind(recommend(replace(batch, policy=batch.train.clone()), "verl"))
    bypass, decoupled = kinds["bypass_ppo"], kinds["token_tis"]
    assert bypass.stats["bias_healthy"] > 2 * decoupled.stats["bias_healthy"]
    assert bypass.stats["objective"] > decoupled.stats["objective"]


def test_a_growing_lag_is_named_staleness_and_ppo_keeps_its_trust_region(tmp_path):
    batch = _batch(tmp_path, seed=85, steps=3, policy_sigma=0.1, policy_growth=2.5)
    rec = recommend(batch, "verl")
    (line,) = [r for r in rec.regimes if r.startswith("current policy")]
    assert "staleness" in line
    kinds = _by_kind(rec)
    # REINFORCE weighted by the current policy has no clip: where the policy moved far, it
    # weighs what a PPO step would clip.
    assert kinds["policy_token_tis"].stats["objective"] > kinds["token_tis"].stats["objective"]
    assert rec.best.kind not in {"policy_token_tis", "policy_icepop"}


def test_a_small_lag_names_the_engine(tmp_path):
    batch = _batch(tmp_path, regime="fp8", seed=86, policy_sigma=0.05)
    (line,) = [r for r in recommend(batch, "skyrl").regimes if r.startswith("current policy")]
    assert "the engine's mismatch outweighs" in line
