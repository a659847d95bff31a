"""AReaL's behaviour weight (`apply_rejection_sampling`) against a float64 reference."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from iscore.advice.conversion import snippet
from iscore.errors import ConfigError
from iscore.frameworks import areal
from iscore.frameworks.resolve import parse_config
from iscore.packed.batch import TokenBatch
from iscore.passes.replay import replay
from tests.unit.frameworks.conftest import make_batch, sequences


def cfg(rs: dict | None = None, **actor) -> dict:
    actor = {"use_decoupled_loss": True, **actor}
    if rs is not None:
        actor["rejection_sampling"] = rs
    return {"framework": "areal", "actor": actor}


def batch_of(rollout, train, masks=None, lengths=None) -> TokenBatch:
    rollout = torch.tensor(rollout, dtype=torch.float32)
    lengths = lengths or [len(rollout)]
    return TokenBatch(
        rollout=rollout,
        train=torch.tensor(train, dtype=torch.float32),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
        loss_mask=None if masks is None else torch.tensor(masks),
    )


# ---------------------------------------------------------------- reference (float64 numpy)


def in_bounds(x, lower, upper):
    x = np.asarray(x, dtype=np.float64)
    ok = x <= upper  # NaN compares false: rejected
    return ok & (x >= lower) if lower is not None else ok


def ref_areal(batch: TokenBatch, rs: dict | None, decoupled=True, recompute=False):
    """apply_rejection_sampling from its formulas, one sequence at a time; with `token_action`
    (PR #1218) its second stage on each token's own ratio."""
    rs = None if rs is None else {"level": "token", "action": "mask", "metric": "ratio",
                                  "agg": "mean", "upper": 5.0, "lower": None,
                                  "token_action": None, **rs}  # fmt: skip
    weights, keeps, raws = [], [], []
    for rollout, train, _, mask in sequences(batch):
        if decoupled:
            prox, behave = train, rollout
        else:
            prox = behave = train if recompute else rollout
        with np.errstate(invalid="ignore", over="ignore"):
            d_raw = prox - behave
            d = np.where(np.isfinite(d_raw), d_raw, 0.0)
            ratio = np.exp(d)
            if rs is None:
                weights.append(np.where(mask, 1.0, 0.0))
                keeps.append(mask)
                raws.append(ratio)
                continue
            stat = {
                "ratio": ratio,
                "kl_k1": d_raw,
                "kl_k2": d_raw**2 / 2.0,
                "kl_k3": np.exp(-d_raw) - 1.0 + d_raw,
            }[rs["metric"]]
        lower = rs["lower"] if rs["lower"] is not None or rs["action"] == "mask" else 0.0
        keep, w, raw = mask.copy(), ratio.copy(), ratio.copy()
        if rs["level"] == "token":
            if rs["action"] == "mask":
                keep &= in_bounds(stat, lower, rs["upper"])
            else:
                w = np.clip(ratio, lower, rs["upper"])
        else:
            count = max(int(mask.sum()), 1)
            values = (d if rs["metric"] == "ratio" else stat)[mask]
            with np.errstate(invalid="ignore"):
                agg = {
                    "sum": values.sum(),
                    "mean": values.sum() / count,
                    "max": values.max() if values.size else 0.0,
                }[rs["agg"]]
            seq_stat = math.exp(agg) if rs["metric"] == "ratio" else agg
            ok = bool(in_bounds(seq_stat, lower, rs["upper"]))
            if rs["token_action"] == "mask":  # PR #1218: keep L <= rho_t <= U, raw rho_t
                keep &= in_bounds(ratio, rs["lower"], rs["upper"])
            elif rs["token_action"] == "clamp":  # PR #1218: clamp(rho_t, L or 0, U)
                w = np.clip(ratio, rs["lower"] or 0.0, rs["upper"])
            elif rs["metric"] == "ratio":
                raw = np.full_like(d, math.exp(d[mask].sum() / count))
                w = raw.copy()
                if rs["action"] == "clamp" and not ok:
                    w = np.clip(w, lower, rs["upper"])
            if rs["action"] == "mask" and not ok:
                keep[:] = False
        weights.append(np.where(keep, w, 0.0))
        keeps.append(keep)
        raws.append(raw)
    return np.concatenate(weights), np.concatenate(keeps), np.concatenate(raws)


def reference_of(spec: areal.ArealCorrection, batch: TokenBatch):
    """(weight, keep, raw) of `ref_areal` for `spec`, for the registry's harness."""
    rs = _as_dict(spec.rejection_sampling)
    return ref_areal(batch, rs, spec.use_decoupled_loss, spec.recompute_logprob)


def _as_dict(rs: areal.RejectionSampling | None) -> dict | None:
    if rs is None:
        return None
    keys = ("level", "action", "metric", "agg", "upper", "lower", "token_action")
    return {k: getattr(rs, k) for k in keys}


def check(result, weight, keep, raw):
    np.testing.assert_array_equal(result.keep.numpy(), keep)
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=1e-30)


# ---------------------------------------------------------------- replay vs reference

TOKEN_CASES = [
    {"metric": "ratio", "upper": 2.0},
    {"metric": "ratio", "upper": 1.5, "lower": 0.5},
    {"metric": "ratio", "upper": 2.0, "lower": 1.0},  # d = 0 hits the lower bound exactly
    {"metric": "kl_k1", "upper": 0.05, "lower": -0.05},
    {"metric": "kl_k1", "upper": 0.0},  # k1 = +d: keeps d <= 0, d = 0 exactly included
    {"metric": "kl_k2", "upper": 0.001},
    {"metric": "kl_k3", "upper": 0.002},
    {"metric": "kl_k3", "upper": 0.01, "lower": 1e-5},
    {"action": "clamp", "metric": "ratio", "upper": 2.0},
    {"action": "clamp", "metric": "ratio", "upper": 1.2, "lower": 0.9},
]
SEQUENCE_CASES = [
    *(
        {"level": "sequence", "metric": "ratio", "agg": agg, "upper": hi, "lower": lo}
        for agg, lo, hi in (("sum", 0.5, 2.0), ("mean", 0.99, 1.01), ("max", None, 1.5))
    ),
    *(
        {"level": "sequence", "action": "clamp", "metric": "ratio", "agg": agg, "upper": 1.01,
         "lower": 0.99}
        for agg in ("sum", "mean", "max")
    ),
    {"level": "sequence", "action": "clamp", "metric": "ratio", "agg": "sum", "upper": 3.0},
    {"level": "sequence", "metric": "ratio", "agg": "mean", "upper": 1.5, "lower": 1.0},
    {"level": "sequence", "metric": "kl_k1", "agg": "sum", "upper": 0.5, "lower": -0.5},
    {"level": "sequence", "metric": "kl_k1", "agg": "max", "upper": 0.1},
    {"level": "sequence", "metric": "kl_k2", "agg": "mean", "upper": 0.001},
    {"level": "sequence", "metric": "kl_k3", "agg": "sum", "upper": 0.5},
    {"level": "sequence", "metric": "kl_k3", "agg": "max", "upper": 0.02},
]  # fmt: skip


@pytest.mark.parametrize("rs", TOKEN_CASES + SEQUENCE_CASES, ids=str)
def test_rejection_sampling_matches_reference(random_batch, edges, rs):
    for batch in (random_batch, edges):
        result = replay(batch, cfg(rs))
        check(result, *ref_areal(batch, rs))
        if rs.get("level") == "sequence" and rs["metric"] == "ratio":
            np.testing.assert_allclose(
                result.raw.numpy(), np.repeat(result.seq_raw.numpy(), batch.lengths.numpy())
            )
        else:
            assert result.seq_raw is None


# PR #1218's two stages: every agg, bounds that bite at both stages, d = 0 hitting a lower bound
# of 1.0 exactly, no lower bound (the clamp's lower is then 0).
TWO_STAGE_CASES = [
    {"level": "sequence", "metric": "ratio", "agg": agg, "upper": hi, "lower": lo,
     "token_action": action}
    for action in ("mask", "clamp")
    for agg in ("sum", "mean", "max")
    for lo, hi in ((None, 5.0), (0.5, 2.0), (1.0, 1.5), (0.99, 1.01))
]  # fmt: skip


def pr1218(rs: dict, **actor) -> dict:
    return cfg(rs, **actor) | {"version": "pr1218"}


@pytest.mark.parametrize("rs", TWO_STAGE_CASES, ids=str)
def test_pr1218_two_stages_match_reference(random_batch, edges, rs):
    for batch in (random_batch, edges):
        result = replay(batch, pr1218(rs))
        check(result, *ref_areal(batch, rs))


def test_pr1218_stages_by_hand():
    # Two sequences, upper 2: [d = ln 3, -ln 3] has e^G = 1 (kept) and a token ratio 3 > 2;
    # [ln 3, ln 3] has e^G = 3 (rejected whatever its tokens).
    ln3 = math.log(3.0)
    batch = batch_of([-2.0] * 4, [-2.0 + ln3, -2.0 - ln3, -2.0 + ln3, -2.0 + ln3], lengths=[2, 2])
    rs = {"level": "sequence", "metric": "ratio", "upper": 2.0}
    mask = replay(batch, pr1218(rs | {"token_action": "mask"}))
    assert mask.keep.tolist() == [False, True, False, False]
    assert mask.weight.tolist() == pytest.approx([0.0, 1 / 3, 0.0, 0.0], rel=1e-6)  # raw rho_t
    clamp = replay(batch, pr1218(rs | {"token_action": "clamp"}))
    assert clamp.keep.tolist() == [True, True, False, False]
    assert clamp.weight.tolist() == pytest.approx([2.0, 1 / 3, 0.0, 0.0], rel=1e-6)
    assert clamp.seq_weight.tolist() == [1.0, 0.0]  # stage 1's verdict per sequence
    main = replay(batch, cfg(rs))  # the pin: e^G as every kept token's weight
    assert main.weight.tolist() == pytest.approx([1.0, 1.0, 0.0, 0.0], rel=1e-6)


def test_pr1218_overflowing_and_non_finite_ratios():
    # d = 100 overflows AReaL's float32 exp (inf > U: masked; clamped to U); d = -inf is
    # sanitized to 0 (ratio 1); G = (100 - 100 + 0) / 3 = 0 keeps the sequence.
    batch = batch_of([-100.0, -1.0, -float("inf")], [0.0, -101.0, -3.0])
    rs = {"level": "sequence", "metric": "ratio", "upper": 5.0, "lower": 0.5}
    mask = replay(batch, pr1218(rs | {"token_action": "mask"}))
    assert mask.keep.tolist() == [False, False, True]
    assert mask.weight.tolist() == [0.0, 0.0, 1.0]
    clamp = replay(batch, pr1218(rs | {"token_action": "clamp"}))
    assert clamp.keep.tolist() == [True, True, True]
    assert clamp.weight.tolist() == [5.0, 0.5, 1.0]


def test_pr1218_fully_masked_and_one_token_sequences():
    batch = batch_of(
        [-1.0, -1.0, -1.0, -1.0], [-0.5, -1.0, -3.0, -1.0], [True, False, False, True], [1, 2, 1]
    )
    rs = {"level": "sequence", "metric": "ratio", "agg": "max", "upper": 1.5}
    result = replay(batch, pr1218(rs | {"token_action": "mask"}))
    # e^0.5 = 1.65 > 1.5: the one-token sequence goes; the fully masked one keeps nothing.
    assert result.keep.tolist() == [False, False, False, True]
    check(result, *ref_areal(batch, rs | {"token_action": "mask"}))


def test_pr1218_version_in_config_snippet_and_export():
    spec = areal.PRESETS["areal_two_stage_mask_pr1218"]
    config = spec.to_config()
    assert config["version"] == "pr1218" and areal.parse(config) == spec
    assert config["actor"]["rejection_sampling"]["token_action"] == "mask"
    assert "token_action" not in str(areal.PRESETS["areal_token_mask"].to_config())
    text = snippet(spec)
    assert text.startswith("# needs AReaL PR #1218 (open, head 3ab740ce)")
    assert "version" not in text and "token_action: mask" in text
    assert areal.FRAMEWORK.upstream_of(spec) == (
        "areal-project/AReaL@3ab740ce (2026-06-08), open PR #1218"
    )
    for preset in ("areal_two_stage_mask_pr1218", "areal_two_stage_clamp_pr1218"):
        back, notes = areal.FRAMEWORK.closest(areal.to_canonical(areal.PRESETS[preset]), "x")
        assert back.version == "pr1218"
        assert notes == ("Needs AReaL's open PR #1218 (head 3ab740ce): `version: pr1218`.",)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (cfg({"level": "sequence", "token_action": "mask"}), "it is the open PR #1218's"),
        (cfg({"level": "sequence", "token_action": None}), "set `version: pr1218`"),
        (pr1218({"token_action": "mask"}), "`actor.rejection_sampling.level` to be 'sequence'"),
        (
            pr1218({"level": "sequence", "metric": "kl_k2", "upper": 1.0, "token_action": "clamp"}),
            "`actor.rejection_sampling.metric` to be 'ratio'",
        ),
        (
            pr1218({"level": "sequence", "action": "clamp", "token_action": "clamp"}),
            "`actor.rejection_sampling.action` to be 'mask'",
        ),
        (pr1218({"level": "sequence", "token_action": "truncate"}), "token_action"),
        (cfg(None) | {"version": "pr1219"}, "or one of pr1218"),
    ],
)
def test_pr1218_refusals(config, message):
    with pytest.raises(ConfigError) as info:
        areal.parse(config)
    assert message in str(info.value)


def test_pr1218_token_action_needs_the_version_from_python():
    rs = areal.RejectionSampling(level="sequence", token_action="clamp")
    with pytest.raises(ConfigError, match="pr1218"):
        areal.ArealCorrection(use_decoupled_loss=True, rejection_sampling=rs)
    spec = areal.ArealCorrection(use_decoupled_loss=True, rejection_sampling=rs, version="pr1218")
    assert spec.version == "pr1218"


@pytest.mark.parametrize("recompute", [False, True])
@pytest.mark.parametrize(
    "rs",
    [
        None,
        {"metric": "ratio", "upper": 2.0},
        {"metric": "ratio", "upper": 2.0, "lower": 1.5},  # a ratio of 1 is rejected
        {"metric": "kl_k1", "upper": -0.1},  # a k1 of 0 is rejected
        {"action": "clamp", "metric": "ratio", "upper": 3.0, "lower": 1.5},  # weight 1 -> 1.5
        {"level": "sequence", "metric": "kl_k3", "agg": "sum", "upper": 0.5},
    ],
    ids=str,
)
def test_without_decoupling_prox_is_behave(random_batch, edges, rs, recompute):
    for batch in (random_batch, edges):
        config = cfg(rs, use_decoupled_loss=False, recompute_logprob=recompute)
        check(replay(batch, config), *ref_areal(batch, rs, decoupled=False, recompute=recompute))


def test_no_rejection_sampling_applies_no_weight(random_batch):
    result = replay(random_batch, cfg(None))
    assert torch.equal(result.keep, random_batch.loss_mask)
    assert result.weight[result.keep].eq(1.0).all()
    check(result, *ref_areal(random_batch, None))


# ---------------------------------------------------------------- hand-computed traps


def test_kl_k3_is_the_reverse_of_verls():
    # d = +2 and -2. AReaL's k3 = e^{-d} - 1 + d: 1.135 for d = +2, e^2 - 3 = 4.389 for d = -2;
    # verl's e^d - 1 - d gives the opposite pair, so upper 2 keeps the other token there.
    batch = batch_of([-3.0, -1.0], [-1.0, -3.0])
    assert math.exp(-2.0) + 1.0 < 2.0 < math.exp(2.0) - 3.0
    result = replay(batch, cfg({"metric": "kl_k3", "upper": 2.0}))
    assert result.keep.tolist() == [True, False]
    assert result.weight.tolist() == pytest.approx([math.exp(2.0), 0.0], rel=1e-6)
    # k1 is +d here (verl's is -d): the d = -2 token passes an upper bound of 0.
    k1 = replay(batch, cfg({"metric": "kl_k1", "upper": 0.0}))
    assert k1.keep.tolist() == [False, True]


def test_sequence_ratio_weight_is_the_geometric_mean_over_the_mask():
    # Sequence 0: d = ln 4, 0 -> G = ln 2, weight 2 on both tokens.
    # Sequence 1: d = ln 4 and a masked +5 -> G = ln 4 (the masked token is left out), weight 4.
    ln4 = math.log(4.0)
    batch = batch_of(
        [-2.0, -2.0, -6.0, -6.0],
        [-2.0 + ln4, -2.0, -6.0 + ln4, -1.0],
        masks=[True, True, True, False],
        lengths=[2, 2],
    )
    result = replay(batch, cfg({"level": "sequence", "metric": "ratio", "upper": 5.0}))
    assert result.seq_raw.tolist() == pytest.approx([2.0, 4.0], rel=1e-6)
    assert result.weight.tolist() == pytest.approx([2.0, 2.0, 4.0, 0.0], rel=1e-6)
    # agg sum decides on e^S = 4 and 4 (both <= 5); agg max on e^{max d} = 4 and 4.
    for agg in ("sum", "max"):
        rs = {"level": "sequence", "metric": "ratio", "agg": agg, "upper": 3.0}
        assert replay(batch, cfg(rs)).keep.tolist() == [False, False, False, False]


def test_sequence_clamp_decides_on_the_sum_but_clamps_the_geometric_mean():
    # Sequence 0: four tokens of d = ln 2: e^S = 16 > 5 is out of bounds, but the clamp acts on
    # e^G = 2, which stays 2. Sequence 1: one token of d = ln 8: clamp(8, 0, 5) = 5.
    ln2, ln8 = math.log(2.0), math.log(8.0)
    batch = batch_of([-4.0] * 5, [-4.0 + ln2] * 4 + [-4.0 + ln8], lengths=[4, 1])
    rs = {"level": "sequence", "action": "clamp", "metric": "ratio", "agg": "sum", "upper": 5.0}
    result = replay(batch, cfg(rs))
    assert result.keep.all()
    assert result.weight.tolist() == pytest.approx([2.0] * 4 + [5.0], rel=1e-6)
    assert result.seq_weight.tolist() == pytest.approx([2.0, 5.0], rel=1e-6)


def test_sequence_clamp_leaves_in_bounds_sequences_alone():
    # agg max: e^{max d} = 1.4 lies in [0.9, 1.5], so the sequence keeps its geometric weight
    # sqrt(1.4 * 0.5) = 0.837 although that is below the lower bound the clamp would lift it to.
    batch = batch_of([-1.0, -1.0], [-1.0 + math.log(1.4), -1.0 + math.log(0.5)])
    rs = {"level": "sequence", "action": "clamp", "metric": "ratio", "agg": "max",
          "upper": 1.5, "lower": 0.9}  # fmt: skip
    result = replay(batch, cfg(rs))
    assert result.weight.tolist() == pytest.approx([math.sqrt(0.7)] * 2, rel=1e-6)
    check(result, *ref_areal(batch, rs))


def test_non_finite_log_probs():
    # Token 0: rollout -inf -> d = +inf: weight e^0 = 1, but k1 = +inf and k3 = +inf fail.
    # Token 1: train -inf -> d = -inf: k1 = -inf passes an upper-only bound; k3 = NaN fails.
    batch = batch_of([-math.inf, -1.0, -1.0], [-1.0, -math.inf, -1.0], lengths=[1, 1, 1])
    ratio = replay(batch, cfg({"metric": "ratio", "upper": 2.0}))
    assert ratio.keep.tolist() == [True, True, True]
    assert ratio.weight.tolist() == [1.0, 1.0, 1.0]
    k1 = replay(batch, cfg({"metric": "kl_k1", "upper": 1.0}))
    assert k1.keep.tolist() == [False, True, True]
    assert k1.weight.tolist() == [0.0, 1.0, 1.0]
    k1_two_sided = replay(batch, cfg({"metric": "kl_k1", "upper": 1.0, "lower": -1.0}))
    assert k1_two_sided.keep.tolist() == [False, False, True]
    k3 = replay(batch, cfg({"metric": "kl_k3", "upper": 1.0}))
    assert k3.keep.tolist() == [False, False, True]
    check(k3, *ref_areal(batch, {"metric": "kl_k3", "upper": 1.0}))


def test_fully_masked_sequence_with_agg_max_is_in_bounds():
    # The statistic of a sequence without mask tokens is e^0 = 1 (ratio) or 0 (KL); AReaL keeps
    # it (its tokens are out of the loss anyway), and its geometric weight is e^0 = 1.
    batch = batch_of([-1.0, -1.0], [-0.5, -1.0], masks=[False, True], lengths=[1, 1])
    rs = {"level": "sequence", "metric": "ratio", "agg": "max", "upper": 1.5}
    result = replay(batch, cfg(rs))
    assert result.seq_raw.tolist() == [1.0, 1.0]
    assert result.seq_weight.tolist() == [1.0, 1.0]


# ---------------------------------------------------------------- legacy keys

LEGACY = [
    ({"behave_imp_weight_mode": "token_mask", "behave_imp_weight_cap": 3.0},
     areal.RejectionSampling(upper=3.0)),
    ({"behave_imp_weight_mode": "token_truncate", "behave_imp_weight_cap": 3.0},
     areal.RejectionSampling(action="clamp", upper=3.0)),
    ({"behave_imp_weight_mode": "sequence_mask"},
     areal.RejectionSampling(level="sequence", upper=5.0)),
    ({"behave_imp_weight_mode": "sequence_truncate", "behave_imp_weight_cap": 2.0},
     areal.RejectionSampling(level="sequence", action="clamp", upper=2.0)),
    ({"behave_imp_weight_mode": "disabled"}, None),
    ({"behave_imp_weight_mode": "disabled", "behave_imp_weight_cap": None}, None),
    ({"behave_imp_weight_cap": 4.0}, areal.RejectionSampling(upper=4.0)),
    ({"behave_imp_weight_mode": "token_mask", "behave_imp_weight_cap": None},
     areal.RejectionSampling(upper=math.inf)),
    ({"behav_imp_weight_cap": 3.0}, areal.RejectionSampling(upper=3.0)),
    ({"behav_imp_weight_cap": None}, areal.RejectionSampling(upper=math.inf)),
]  # fmt: skip


@pytest.mark.parametrize(("legacy", "expected"), LEGACY, ids=str)
def test_legacy_keys_map_with_a_warning(random_batch, legacy, expected):
    with pytest.warns(UserWarning, match="removed from AReaL") as record:
        spec = areal.parse(cfg(None, **legacy))
    assert spec.rejection_sampling == expected
    assert next(iter(legacy)) in str(record[0].message)
    # The mapped spec replays like the new form written out.
    check(spec.replay(random_batch), *ref_areal(random_batch, _as_dict(expected)))


def test_legacy_uncapped_weight_is_the_raw_ratio(random_batch):
    with pytest.warns(UserWarning):
        result = replay(random_batch, cfg(None, behav_imp_weight_cap=None))
    assert torch.equal(result.keep, random_batch.loss_mask)
    torch.testing.assert_close(result.weight[result.keep], result.raw[result.keep])


# ---------------------------------------------------------------- config parsing


def test_a_real_experiment_config_parses():
    config = {
        "framework": "areal",
        "name": "gsm8k",
        "experiment_name": "gsm8k-grpo",
        "trial_name": "trial0",
        "seed": 1,
        "total_train_epochs": 10,
        "tokenizer_path": "${actor.path}",
        "cluster": {"n_nodes": 1, "n_gpus_per_node": 8},
        "rollout": {"max_concurrent_rollouts": 256, "max_head_offpolicyness": 2},
        "gconfig": {"n_samples": 4, "max_new_tokens": 1024, "temperature": 1.0},
        "actor": {
            "backend": "fsdp:d4p1t1",
            "experiment_name": "${experiment_name}",
            "path": "Qwen/Qwen2.5-1.5B-Instruct",
            "mb_spec": {"max_tokens_per_mb": 10240},
            "optimizer": {"type": "adam", "lr": 1.7e-5, "eps": "1e-8"},
            "eps_clip": 0.4,
            "temperature": "${gconfig.temperature}",
            "kl_ctl": 0.0,
            "ppo_n_minibatches": 1,
            "recompute_logprob": True,
            "use_decoupled_loss": True,
            "rejection_sampling": {"metric": "ratio", "upper": "5.0"},
            "importance_sampling_level": "sequence",
            "prox_logp_method": "metrics",
            "m2_threshold": None,
            "use_sapo_loss": False,
            "scheduling_spec": [{"task_type": "worker", "gpu": 1}],
        },
        "ref": {"path": "${actor.path}"},
        "saver": {"freq_epochs": 1},
    }
    spec = areal.parse(config)
    assert spec == areal.ArealCorrection(
        use_decoupled_loss=True,
        recompute_logprob=True,
        prox_logp_method="metrics",
        rejection_sampling=areal.RejectionSampling(upper=5.0),
        importance_sampling_level="sequence",
        ignored_keys=spec.ignored_keys,
        name="gsm8k",
    )
    assert set(spec.ignored_keys) == {
        "experiment_name", "trial_name", "seed", "total_train_epochs", "tokenizer_path",
        "cluster", "rollout", "gconfig", "ref", "saver", "actor.backend",
        "actor.experiment_name", "actor.path", "actor.mb_spec", "actor.optimizer",
        "actor.eps_clip", "actor.temperature", "actor.kl_ctl", "actor.ppo_n_minibatches",
        "actor.scheduling_spec",
    }  # fmt: skip


def test_defaults_and_empty_rejection_sampling():
    spec = areal.parse({"framework": "areal"})
    assert spec == areal.ArealCorrection() and spec.rejection_sampling is None
    assert areal.parse(cfg({})).rejection_sampling == areal.RejectionSampling()
    # loglinear has no effect without the decoupled loss, so it is accepted there.
    assert areal.parse(cfg(None, use_decoupled_loss=False, prox_logp_method="loglinear"))


def test_token_level_agg_warns_and_is_ignored(random_batch):
    with pytest.warns(UserWarning, match="ignored"):
        spec = areal.parse(cfg({"metric": "ratio", "upper": 2.0, "agg": "max"}))
    check(spec.replay(random_batch), *ref_areal(random_batch, {"metric": "ratio", "upper": 2.0}))


RS = "actor.rejection_sampling"
ERRORS = [
    (cfg({"action": "clamp", "metric": "kl_k2", "upper": 1.0}), f"{RS}.metric"),
    (cfg({"metric": "ratio", "upper": 1.0}), f"{RS}.upper"),
    (cfg({"metric": "ratio", "upper": 2.0, "lower": 0.0}), f"{RS}.lower"),
    (cfg({"metric": "kl_k1", "upper": 0.5, "lower": 1.0}), f"{RS}.lower"),
    (cfg({"metric": "kl_k2", "upper": 0.0}), f"{RS}.upper"),
    (cfg({"metric": "kl_k3", "upper": -1.0}), f"{RS}.upper"),
    (cfg({"level": "geometric"}), f"{RS}.level"),
    (cfg({"action": "truncate"}), f"{RS}.action"),
    (cfg({"metric": "k3"}), f"{RS}.metric"),
    (cfg({"agg": "median", "level": "sequence"}), f"{RS}.agg"),
    (cfg({"upper": "abc"}), f"{RS}.upper"),
    (cfg({"upper": None}), f"{RS}.upper"),
    (cfg({"lower": True}), f"{RS}.lower"),
    (cfg({"cap": 5.0}), f"{RS}.cap"),
    (cfg("token"), RS),
    (cfg(None, prox_logp_method="loglinear"), "actor.prox_logp_method"),
    (cfg(None, prox_logp_method="approx"), "actor.prox_logp_method"),
    (cfg(None, use_sapo_loss=True), "actor.use_sapo_loss"),
    (cfg(None, m2_threshold=0.04), "actor.m2_threshold"),
    (cfg(None, use_tis=True), "actor.use_tis"),
    (cfg(None, use_decoupled_loss="yes"), "actor.use_decoupled_loss"),
    (cfg(None, recompute_logprob=1), "actor.recompute_logprob"),
    (cfg(None, importance_sampling_level="geometric"), "actor.importance_sampling_level"),
    (cfg({"upper": 2.0}, behave_imp_weight_cap=2.0), RS),
    (cfg(None, behav_imp_weight_cap=2.0, behave_imp_weight_mode="token_mask"),
     "actor.behav_imp_weight_cap"),
    (cfg(None, behave_imp_weight_mode="disabled", behave_imp_weight_cap=5.0),
     "actor.behave_imp_weight_cap"),
    (cfg(None, behave_imp_weight_cap=1.0), "actor.behave_imp_weight_cap"),
    (cfg(None, behav_imp_weight_cap=0.5), "actor.behav_imp_weight_cap"),
    (cfg(None, behave_imp_weight_mode="sequence"), "actor.behave_imp_weight_mode"),
    ({"framework": "areal", "actor": [1]}, "actor"),
    ({"framework": "areal", "algorithm": {}}, "algorithm"),
    ({"framework": "areal", "name": 5}, "name"),
]  # fmt: skip


@pytest.mark.filterwarnings("ignore::UserWarning")
@pytest.mark.parametrize(("config", "key"), ERRORS, ids=lambda x: x if isinstance(x, str) else "")
def test_invalid_configs_name_the_key(config, key):
    with pytest.raises(ConfigError) as info:
        areal.parse(config)
    assert f"`{key}" in str(info.value)


def test_spec_validation_from_python():
    with pytest.raises(ConfigError, match="metric"):
        areal.RejectionSampling(action="clamp", metric="kl_k1")
    with pytest.raises(ConfigError, match="rejection_sampling"):
        areal.ArealCorrection(rejection_sampling={"upper": 2.0})
    # AReaL fills in the clamp's lower bound 0.0 only after checking that a ratio's is > 0.
    with pytest.raises(ConfigError, match="lower"):
        areal.RejectionSampling(action="clamp", lower=0.0)
    assert areal.RejectionSampling(action="clamp").clamp_lower == 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        areal.RejectionSampling(level="sequence", agg="max")


# ---------------------------------------------------------------- the harness and dispatch

# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: a two-sided token mask, a sequence clamp decided
# on the sum, and a sequence KL mask on the max.
EXTRA_SPECS = {
    "token_ratio_band": areal.parse(cfg({"metric": "ratio", "upper": 2.0, "lower": 0.5})),
    "sequence_clamp_sum": areal.parse(
        cfg({"level": "sequence", "action": "clamp", "metric": "ratio", "agg": "sum", "upper": 1.5})
    ),
    "sequence_kl_k3_max": areal.parse(
        cfg({"level": "sequence", "metric": "kl_k3", "agg": "max", "upper": 0.02})
    ),
    **{
        f"two_stage_{action}_sum_pr1218": areal.parse(
            pr1218(
                {
                    "level": "sequence",
                    "agg": "sum",
                    "upper": 1.5,
                    "lower": 0.8,
                    "token_action": action,
                }
            )
        )
        for action in ("mask", "clamp")
    },
}


def test_replay_dispatch_from_a_yaml_file(tmp_path):
    path = tmp_path / "areal.yaml"
    path.write_text(
        "framework: areal\nexperiment_name: x\nactor:\n  use_decoupled_loss: true\n"
        "  eps_clip: 0.2\n  rejection_sampling:\n    level: token\n    action: mask\n"
        "    metric: ratio\n    upper: 5.0\n"
    )
    assert parse_config(path) == areal.PRESETS["areal_token_mask"].__class__(
        use_decoupled_loss=True,
        rejection_sampling=areal.RejectionSampling(),
        ignored_keys=("experiment_name", "actor.eps_clip"),
    )
    batch = make_batch([3, 9, 27], seed=5, sigma=1.0)
    check(replay(batch, path), *ref_areal(batch, {"metric": "ratio", "upper": 5.0}))
