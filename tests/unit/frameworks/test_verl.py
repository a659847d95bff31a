"""verl rollout correction: replay vs an independent float64 reference, traps, config parsing."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

import iscore
from iscore import frameworks
from iscore.advice.conversion import snippet, to_file_text
from iscore.errors import ConfigError
from iscore.frameworks import verl
from iscore.frameworks.verl import PRESETS, RSCriterion, VerlSpec, parse
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import binary_kl, edge_batch, make_batch, sequences

# ---------------------------------------------------------------------------------------------
# Reference: verl's rollout_corr_helper written from the formulas, one sequence at a time.


def _rs_stat(option: str, d: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Per-token values of an RS statistic (sequence statistics broadcast)."""
    dc = np.clip(d, -20.0, 20.0)
    est = option[-2:]
    stat = {"k1": -dc, "k2": 0.5 * dc**2, "k3": np.exp(dc) - 1.0 - dc}[est]
    if option.startswith("token"):
        return stat
    if option.startswith("seq_sum"):
        value = stat[m].sum()
    elif option.startswith("seq_mean"):
        value = stat[m].mean() if m.any() else 0.0
    else:
        value = stat[m].max() if m.any() else 0.0
    return np.full(len(d), value)


def reference(
    batch: TokenBatch,
    *,
    level: str | None = None,
    lower: float | None = None,
    upper: float | None = None,
    bn: bool = False,
    rs: tuple[tuple[str, float | None, float], ...] = (),
    bypass: bool = False,
    loss_type: str = "ppo_clip",
):
    """(weight, keep, raw, seq_raw, seq_weight) as numpy float64 / bool."""
    seqs = list(sequences(batch))
    ds = [(p if bypass else t) - r for r, t, p, _ in seqs]
    masks = [m for *_, m in seqs]
    keeps = []
    for (r, t, p, m), d in zip(seqs, ds, strict=True):
        keep = m.copy()
        for option, lo, hi in rs:
            if option == "binary_kl":  # PR #6800: the raw log-probs, not d
                old = p if bypass else t
                keep &= np.maximum(binary_kl(old, r), binary_kl(r, old)) <= hi
                continue
            stat = _rs_stat(option, d, m)
            if option.endswith("k1"):
                keep &= (stat >= math.log(lo)) & (stat <= math.log(hi))
            else:
                keep &= stat <= hi
        keeps.append(keep)
    keep = np.concatenate(keeps)
    if level is None or (bypass and loss_type == "ppo_clip"):
        raw = np.exp(np.clip(np.concatenate(ds), -20, 20))
        return keep.astype(float), keep, raw, None, None

    def bound(x):
        if lower is None:
            return np.minimum(x, upper)
        return np.where((x >= lower) & (x <= upper), x, 0.0)

    if level == "token":
        raws = [np.exp(np.clip(d, -20, 20)) for d in ds]
        ws = [bound(x) for x in raws]
        if bn:
            mean = sum(w[m].sum() for w, m in zip(ws, masks, strict=True)) / sum(
                m.sum() for m in masks
            )
            if mean > 1e-8:
                ws = [w / mean for w in ws]
        seq_raw = seq_w = None
    else:
        seq_raw = np.array(
            [np.exp(np.clip(d[m].sum(), -20, 20)) for d, m in zip(ds, masks, strict=True)]
        )
        seq_w = bound(seq_raw)
        if bn:
            valid = np.array([m.any() for m in masks])
            mean = seq_w[valid].mean() if valid.any() else 0.0
            if mean > 1e-8:
                seq_w = seq_w / mean
        raws = [np.full(len(d), x) for d, x in zip(ds, seq_raw, strict=True)]
        ws = [np.full(len(d), x) for d, x in zip(ds, seq_w, strict=True)]
    weight = np.where(keep, np.concatenate(ws), 0.0)
    return weight, keep, np.concatenate(raws), seq_raw, seq_w


def check(result, expected) -> None:
    weight, keep, raw, seq_raw, seq_weight = expected
    np.testing.assert_array_equal(result.keep.cpu().numpy(), keep)
    np.testing.assert_allclose(result.weight.cpu().numpy(), weight, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(result.raw.cpu().numpy(), raw, rtol=1e-6, atol=1e-30)
    if seq_raw is None:
        assert result.seq_raw is None and result.seq_weight is None
    else:
        np.testing.assert_allclose(result.seq_raw.cpu().numpy(), seq_raw, rtol=1e-6, atol=1e-30)
        np.testing.assert_allclose(result.seq_weight.cpu().numpy(), seq_weight, rtol=1e-6)


def reference_of(spec: VerlSpec, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness."""
    weight, keep, raw, _, _ = reference(
        batch,
        level=spec.is_level,
        lower=spec.is_lower,
        upper=spec.is_upper,
        bn=spec.batch_normalize,
        rs=tuple((c.option, c.lower, c.upper) for c in spec.rs),
        bypass=spec.bypass,
        loss_type=spec.loss_type,
    )
    return weight, keep, raw


def cfg(**rc) -> dict:
    return {"framework": "verl", "algorithm": {"rollout_correction": rc}}


@pytest.fixture(params=["random", "edges"])
def batch(request, random_batch) -> TokenBatch:
    return random_batch if request.param == "random" else edge_batch()


# ---------------------------------------------------------------------------------------------
# Every option against the reference.

IS_CASES = [
    # (rollout_is, rollout_is_threshold, batch_normalize, reference lower, reference upper)
    ("token", 2.0, False, None, 2.0),
    ("sequence", 2.0, False, None, 2.0),
    ("token", "1.0", False, None, 1.0),  # cap hit exactly by d = 0
    ("sequence", 5, False, None, 5.0),
    ("token", "0.5_5.0", False, 0.5, 5.0),
    ("sequence", "0.5_2.0", False, 0.5, 2.0),
    ("token", "1.0_1.0", False, 1.0, 1.0),  # IcePop keeping only ratio 1 exactly
    ("token", 2.0, True, None, 2.0),
    ("sequence", 2.0, True, None, 2.0),
    ("token", "0.5_5.0", True, 0.5, 5.0),
    ("sequence", "0.5_5.0", True, 0.5, 5.0),
]


@pytest.mark.parametrize(("level", "threshold", "bn", "lower", "upper"), IS_CASES)
def test_is_weights(batch, level, threshold, bn, lower, upper):
    spec = parse(
        cfg(rollout_is=level, rollout_is_threshold=threshold, rollout_is_batch_normalize=bn)
    )
    expected = reference(batch, level=level, lower=lower, upper=upper, bn=bn)
    check(spec.replay(batch), expected)


RS_CASES = [
    # (rollout_rs, rollout_rs_threshold, reference criteria as (option, L, U))
    ("token_k1", "0.5_1.5", [("token_k1", 0.5, 1.5)]),
    ("token_k1", 1.0, [("token_k1", 1.0, 1.0)]),  # float U: L = 1/U; keeps d = 0 only
    ("token_k1", "1.05", [("token_k1", 1 / 1.05, 1.05)]),
    ("token_k2", 0.001, [("token_k2", None, 0.001)]),
    ("token_k3", "0.001", [("token_k3", None, 0.001)]),
    ("seq_sum_k1", "0.5_2.0", [("seq_sum_k1", 0.5, 2.0)]),
    ("seq_sum_k1", "1e-9_1e9", [("seq_sum_k1", 1e-9, 1e9)]),  # +-20 clamp decides d = 30
    ("seq_sum_k2", 0.05, [("seq_sum_k2", None, 0.05)]),
    ("seq_sum_k3", 0.05, [("seq_sum_k3", None, 0.05)]),
    ("seq_mean_k1", "0.999_1.001", [("seq_mean_k1", 0.999, 1.001)]),
    ("seq_mean_k1", "0.9_1.02", [("seq_mean_k1", 0.9, 1.02)]),
    ("seq_mean_k2", 0.005, [("seq_mean_k2", None, 0.005)]),
    ("seq_mean_k3", 0.005, [("seq_mean_k3", None, 0.005)]),
    ("seq_max_k2", 0.1, [("seq_max_k2", None, 0.1)]),
    ("seq_max_k3", 0.1, [("seq_max_k3", None, 0.1)]),
    ("token_k1,seq_max_k3", "0.5_1.5,0.1", [("token_k1", 0.5, 1.5), ("seq_max_k3", None, 0.1)]),
    (
        " seq_mean_k1 , token_k2,seq_mean_k1",  # spaces and a repeat: 2 distinct options
        "1.01",
        [("seq_mean_k1", 1 / 1.01, 1.01), ("token_k2", None, 1.01)],
    ),
]


@pytest.mark.parametrize(("options", "threshold", "criteria"), RS_CASES)
def test_rejection(batch, options, threshold, criteria):
    spec = parse(cfg(rollout_rs=options, rollout_rs_threshold=threshold))
    check(spec.replay(batch), reference(batch, rs=tuple(criteria)))


@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("bypass", [False, True])
def test_is_rs_and_batch_normalize_together(random_batch, level, bypass):
    """IS over the original mask; the normalization mean includes RS-rejected tokens."""
    rc = {
        "rollout_is": level,
        "rollout_is_threshold": 1.5,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_mean_k1,token_k2",
        "rollout_rs_threshold": "0.98_1.02,0.002",
        "bypass_mode": bypass,
        "loss_type": "reinforce",
    }
    rs = (("seq_mean_k1", 0.98, 1.02), ("token_k2", None, 0.002))
    expected = reference(
        random_batch, level=level, upper=1.5, bn=True, rs=rs, bypass=bypass, loss_type="reinforce"
    )
    check(parse(cfg(**rc)).replay(random_batch), expected)


@pytest.mark.parametrize("level", [None, "token", "sequence"])
def test_bypass_ppo_clip_applies_rs_but_no_weight(batch, level):
    rc = {
        "rollout_is": level,
        "rollout_rs": "token_k3",
        "rollout_rs_threshold": 0.001,
        "bypass_mode": True,
    }
    expected = reference(
        batch, level=level, upper=2.0, rs=(("token_k3", None, 0.001),), bypass=True
    )
    result = parse(cfg(**rc)).replay(batch)
    check(result, expected)
    assert torch.equal(result.weight, result.keep.float())


@pytest.mark.parametrize(
    ("level", "threshold", "lower", "upper"),
    [("token", 2.0, None, 2.0), ("sequence", 3.0, None, 3.0), ("token", "0.5_5.0", 0.5, 5.0)],
)
def test_bypass_reinforce_uses_policy(batch, level, threshold, lower, upper):
    rc = {
        "rollout_is": level,
        "rollout_is_threshold": threshold,
        "rollout_rs": "seq_max_k2",
        "rollout_rs_threshold": 0.05,
        "bypass_mode": True,
        "loss_type": "reinforce",
    }
    rs = (("seq_max_k2", None, 0.05),)
    expected = reference(
        batch, level=level, lower=lower, upper=upper, rs=rs, bypass=True, loss_type="reinforce"
    )
    check(parse(cfg(**rc)).replay(batch), expected)


# verl's RolloutCorrectionConfig classmethods with their default arguments, as written in
# verl/trainer/config/algorithm.py: (rollout_is, threshold, rollout_rs, rs threshold, bypass,
# loss_type); rows without an IS level carry the dataclass default threshold 2.0.
VERL_PRESETS = {
    "decoupled_token_is": ("token", 2.0, None, None, False, "ppo_clip"),
    "decoupled_seq_is": ("sequence", 2.0, None, None, False, "ppo_clip"),
    "decoupled_token_icepop": ("token", "0.5_5.0", None, None, False, "ppo_clip"),
    "decoupled_seq_is_rs": ("sequence", 2.0, "seq_sum_k1", "0.5_2.0", False, "ppo_clip"),
    "decoupled_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", False, "ppo_clip"),
    "decoupled_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_seq_tis": ("sequence", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "decoupled_k3_rs_token_tis": ("token", 2.0, "seq_mean_k3", 0.01, False, "ppo_clip"),
    "bypass_ppo_clip": (None, 2.0, None, None, True, "ppo_clip"),
    "bypass_ppo_clip_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "ppo_clip"),
    "bypass_ppo_clip_k3_rs": (None, 2.0, "seq_mean_k3", 0.01, True, "ppo_clip"),
    "bypass_pg_is": ("sequence", 2.0, None, None, True, "reinforce"),
    "bypass_pg_token_icepop": ("token", "0.5_5.0", None, None, True, "reinforce"),
    "bypass_pg_geo_rs": (None, 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_seq_tis": ("sequence", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "bypass_pg_geo_rs_token_tis": ("token", 2.0, "seq_mean_k1", "0.999_1.001", True, "reinforce"),
    "disabled": (None, 2.0, None, None, False, "ppo_clip"),
}


def test_preset_names_match_verl():
    pinned = {name for name, spec in PRESETS.items() if spec.version is None}
    assert pinned == set(VERL_PRESETS)
    # PR #6800's classmethod, `decoupled_token_kpop(phi=2.0)`, named for its version.
    assert {name for name in PRESETS if name not in pinned} == {"decoupled_token_kpop_pr6800"}


@pytest.mark.parametrize("name", list(VERL_PRESETS))
def test_preset_equals_verl_classmethod(name):
    level, threshold, rs, rs_threshold, bypass, loss_type = VERL_PRESETS[name]
    rc = {
        "rollout_is": level,
        "rollout_is_threshold": threshold,
        "rollout_rs": rs,
        "rollout_rs_threshold": rs_threshold,
        "bypass_mode": bypass,
        "loss_type": loss_type,
    }
    assert parse({**cfg(**rc), "name": name}) == PRESETS[name]
    assert parse({"framework": "verl", "preset": name}) == PRESETS[name]
    assert PRESETS[name].name == name


@pytest.mark.parametrize(
    "spec",
    [
        VerlSpec(
            name="x",
            is_level="sequence",
            is_upper=3.0,
            is_lower=0.25,
            batch_normalize=True,
            rs=(
                RSCriterion("token_k1", upper=1.5, lower=0.5),
                RSCriterion("seq_max_k2", upper=2.5),
                RSCriterion("seq_sum_k3", upper=1e-3),
            ),
            bypass=True,
            loss_type="reinforce",
        ),
        VerlSpec(is_level="token", is_upper=1.1, rs=(RSCriterion("token_k1", 1.05, 1 / 1.05),)),
        VerlSpec(is_level="token", is_upper=float("inf")),
        VerlSpec(),
    ],
)
def test_round_trip(spec):
    assert parse(spec.to_config()) == spec


# ---------------------------------------------------------------------------------------------
# Hand-computed traps.


def ratio_batch(
    ratios: list[list[float]], policy_ratios: list[list[float]] | None = None
) -> TokenBatch:
    """Sequences whose train / rollout probability ratios are `ratios`."""
    flat = np.concatenate([np.asarray(r, dtype=np.float64) for r in ratios])
    rollout = np.full(len(flat), -1.0, dtype=np.float32)
    train = (rollout + np.log(flat)).astype(np.float32)
    policy = train.copy()
    if policy_ratios is not None:
        policy = (rollout + np.log(np.concatenate(policy_ratios))).astype(np.float32)
    return TokenBatch(
        rollout=torch.from_numpy(rollout),
        train=torch.from_numpy(train),
        cu_seqlens=torch.tensor([0, *np.cumsum([len(r) for r in ratios]).tolist()]),
        policy=torch.from_numpy(policy),
    )


def test_k1_asymmetric_bounds_keep_inverted_interval():
    """verl's k1 statistic is -d: "0.5_1.5" keeps ratios in [1/1.5, 1/0.5] = [0.667, 2.0]."""
    batch = ratio_batch([[0.6, 0.67, 1.0, 1.6, 1.99, 2.1, 0.55]])
    spec = parse(cfg(rollout_rs="token_k1", rollout_rs_threshold="0.5_1.5"))
    assert spec.rs[0].kept_ratio == pytest.approx((2 / 3, 2.0))
    assert spec.replay(batch).keep.tolist() == [False, True, True, True, True, False, False]


def test_k1_geometric_mean_bounds_inverted():
    """seq_mean_k1 "0.5_1.5" keeps a sequence whose geometric-mean ratio is 1.8, rejects 0.6."""
    batch = ratio_batch([[1.8, 1.8], [0.6, 0.6, 0.6], [1.2]])
    spec = parse(cfg(rollout_rs="seq_mean_k1", rollout_rs_threshold="0.5_1.5"))
    assert spec.replay(batch).keep.tolist() == [True, True, False, False, False, True]


def test_k1_float_threshold_is_symmetric():
    batch = ratio_batch([[0.49, 0.51, 1.99, 2.01]])
    spec = parse(cfg(rollout_rs="token_k1", rollout_rs_threshold=2.0))
    assert spec.rs == (RSCriterion("token_k1", upper=2.0, lower=0.5),)
    assert spec.replay(batch).keep.tolist() == [False, True, True, False]


def test_icepop_token_and_sequence():
    batch = ratio_batch([[0.4, 1.0, 6.0, 3.0], [2.0, 2.0], [1.5]])
    token = parse(cfg(rollout_is="token", rollout_is_threshold="0.5_5.0")).replay(batch)
    np.testing.assert_allclose(token.weight, [0, 1, 0, 3, 2, 2, 1.5], rtol=1e-5)
    assert token.keep.all()  # IcePop zeroes weights, never the mask
    seq = parse(cfg(rollout_is="sequence", rollout_is_threshold="0.5_3.5")).replay(batch)
    # products: 0.4 * 1 * 6 * 3 = 7.2 (out), 4.0 (out), 1.5 (in)
    np.testing.assert_allclose(seq.seq_raw, [7.2, 4.0, 1.5], rtol=1e-5)
    np.testing.assert_allclose(seq.weight, [0, 0, 0, 0, 0, 0, 1.5], rtol=1e-5)


def test_sequence_is_clamps_the_sum_and_rs_clamps_tokens():
    """S = 30 gives e^20 (sum clamped); seq_sum_k1 sees -20 (tokens clamped) and keeps it."""
    rollout = torch.tensor([-31.0, -1.0, -1.0], dtype=torch.float32)
    train = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float32)
    batch = TokenBatch(rollout=rollout, train=train, cu_seqlens=torch.tensor([0, 1, 3]))
    rc = {
        "rollout_is": "sequence",
        "rollout_is_threshold": 1e10,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": "1e-9_1e9",  # log 1e-9 = -20.7 <= -20, but > -30
    }
    result = parse(cfg(**rc)).replay(batch)
    np.testing.assert_allclose(result.weight, [math.exp(20), 1.0, 1.0], rtol=1e-6)
    assert result.keep.all()


def test_sequence_is_sums_unclamped_tokens():
    """d = [+30, -15]: S = 15 (the +-20 clamp applies to the sum, not to each token)."""
    rollout = torch.tensor([-31.0, -1.0], dtype=torch.float32)
    train = torch.tensor([-1.0, -16.0], dtype=torch.float32)
    batch = TokenBatch(rollout=rollout, train=train, cu_seqlens=torch.tensor([0, 2]))
    result = parse(cfg(rollout_is="sequence", rollout_is_threshold=1e10)).replay(batch)
    np.testing.assert_allclose(result.seq_raw, [math.exp(15)], rtol=1e-6)


def test_batch_normalize_counts_rejected_tokens():
    """Token level: mean over all three tokens (7/6), although token_k1 rejects the second."""
    batch = ratio_batch([[1.0, 3.0, 0.5]])
    rc = {
        "rollout_is": "token",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "token_k1",
        "rollout_rs_threshold": 2.5,  # keeps ratios in [0.4, 2.5]
    }
    result = parse(cfg(**rc)).replay(batch)
    assert result.keep.tolist() == [True, False, True]
    np.testing.assert_allclose(result.weight, [6 / 7, 0.0, 3 / 7], rtol=1e-5)


def test_batch_normalize_sequence_level_averages_sequences_not_tokens():
    """Sequence weights 1, 2 (ratio 3 capped), 0.5 over 1, 3, 2 tokens: mean 7/6, not 8/6."""
    batch = ratio_batch([[1.0], [3.0, 1.0, 1.0], [0.5, 1.0]])
    rc = {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": True,
        "rollout_rs": "seq_sum_k1",
        "rollout_rs_threshold": 2.5,
    }
    result = parse(cfg(**rc)).replay(batch)
    np.testing.assert_allclose(result.seq_weight, [6 / 7, 12 / 7, 3 / 7], rtol=1e-5)
    np.testing.assert_allclose(result.weight, [6 / 7, 0, 0, 0, 3 / 7, 3 / 7], rtol=1e-5)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_batch_normalize_is_per_training_step(level):
    """verl normalizes the batch of one step: each step's weights average to 1 on their own."""
    two = ratio_batch([[1.0, 1.5], [0.5], [1.2, 1.2, 0.9], [1.6]])
    batch = dataclasses.replace(two, step=torch.tensor([3, 3, 7, 7]), _seq_index=[])
    rc = {"rollout_is": level, "rollout_is_threshold": 5.0, "rollout_is_batch_normalize": True}
    result = parse(cfg(**rc)).replay(batch)
    alone = [
        parse(cfg(**rc)).replay(ratio_batch(part))
        for part in ([[1.0, 1.5], [0.5]], [[1.2, 1.2, 0.9], [1.6]])
    ]
    expected = torch.cat([r.weight for r in alone])
    np.testing.assert_allclose(result.weight, expected, rtol=1e-6)
    np.testing.assert_allclose(result.pre_norm, torch.cat([r.pre_norm for r in alone]), rtol=1e-6)
    for part, step in zip(alone, (3, 7), strict=True):
        denominators = part.weight if level == "token" else part.seq_weight
        assert float(denominators.double().mean()) == pytest.approx(1.0), step


def test_batch_normalize_skipped_when_all_weights_zero():
    batch = ratio_batch([[10.0, 0.1]])
    rc = {
        "rollout_is": "token",
        "rollout_is_threshold": "0.5_5.0",
        "rollout_is_batch_normalize": True,
    }
    result = parse(cfg(**rc)).replay(batch)
    assert result.weight.tolist() == [0.0, 0.0]


def test_bypass_ratio_uses_policy_not_train():
    batch = ratio_batch([[1.0, 1.0, 1.0]], policy_ratios=[[1.5, 3.0, 0.8]])
    rc = {"rollout_is": "token", "rollout_is_threshold": 2.0, "bypass_mode": True}
    reinforce = parse(cfg(**rc, loss_type="reinforce")).replay(batch)
    np.testing.assert_allclose(reinforce.weight, [1.5, 2.0, 0.8], rtol=1e-5)
    decoupled = parse(cfg(rollout_is="token", rollout_is_threshold=2.0)).replay(batch)
    np.testing.assert_allclose(decoupled.weight, [1.0, 1.0, 1.0])
    # ppo_clip: no weight, but the RS mask (on the policy ratio) applies
    rs = {"rollout_rs": "token_k1", "rollout_rs_threshold": 2.0}
    ppo = parse(cfg(**rc, **rs, loss_type="ppo_clip")).replay(batch)
    assert ppo.keep.tolist() == [True, False, True]
    assert ppo.weight.tolist() == [1.0, 0.0, 1.0]
    np.testing.assert_allclose(ppo.raw, [1.5, 3.0, 0.8], rtol=1e-5)


@pytest.mark.parametrize("name", ["bypass_ppo_clip", "bypass_pg_is", "bypass_pg_geo_rs"])
def test_bypass_needs_policy_column(name):
    batch = make_batch([3, 4], policy=False)
    with pytest.raises(ConfigError, match="policy_logprob"):
        PRESETS[name].replay(batch)
    PRESETS["decoupled_seq_is"].replay(batch)  # decoupled mode does not need it


# ---------------------------------------------------------------------------------------------
# Config parsing.

YAML_CONFIG = """
framework: verl
name: my run
algorithm:
  gamma: 1.0
  adv_estimator: grpo
  rollout_correction:
    rollout_is: token
    rollout_is_threshold: 2.0
    rollout_rs: token_k1,seq_max_k2
    rollout_rs_threshold: "0.5_2.0,2.5"
    bypass_mode: true
    loss_type: ppo_clip
    rollout_is_batch_normalize: false
"""


def test_yaml_layout(tmp_path):
    path = tmp_path / "verl.yaml"
    path.write_text(YAML_CONFIG)
    spec = iscore.parse_config(path)
    assert spec == VerlSpec(
        name="my run",
        is_level="token",
        is_upper=2.0,
        rs=(RSCriterion("token_k1", upper=2.0, lower=0.5), RSCriterion("seq_max_k2", upper=2.5)),
        bypass=True,
    )


def test_missing_keys_take_yaml_defaults():
    """YAML default `rollout_is: null` (the Python dataclass default would be "sequence")."""
    for config in ({"framework": "verl"}, cfg(), {"framework": "verl", "algorithm": {}}):
        assert parse(config) == VerlSpec()
    assert parse(cfg(rollout_is="sequence")).is_upper == 2.0
    assert parse({"framework": "verl", "algorithm": {"rollout_correction": None}}) == VerlSpec()


@pytest.mark.parametrize(
    ("threshold", "lower", "upper"),
    [
        (3, None, 3.0),
        ("3.5", None, 3.5),
        (" 0.5_5.0 ", 0.5, 5.0),
        ("2_2", 2.0, 2.0),
        ("inf", None, math.inf),
    ],
)
def test_is_threshold_formats(threshold, lower, upper):
    spec = parse(cfg(rollout_is="token", rollout_is_threshold=threshold))
    assert (spec.is_lower, spec.is_upper) == (lower, upper)
    assert spec.is_mode == ("truncate" if lower is None else "icepop")


def test_null_threshold_or_level_disables_is():
    assert parse(cfg(rollout_is="token", rollout_is_threshold=None)).is_level is None
    # verl never reads the threshold (or the normalize flag) without a level
    spec = parse(cfg(rollout_is=None, rollout_is_threshold="abc", rollout_is_batch_normalize=True))
    assert spec == VerlSpec()
    assert parse(cfg(rollout_rs=None, rollout_rs_threshold="abc")) == VerlSpec()


def test_rs_threshold_formats():
    spec = parse(cfg(rollout_rs="seq_sum_k1,token_k3", rollout_rs_threshold="0.25_4, 0.01"))
    assert spec.rs == (
        RSCriterion("seq_sum_k1", upper=4.0, lower=0.25),
        RSCriterion("token_k3", upper=0.01),
    )
    assert parse(cfg(rollout_rs="token_k1", rollout_rs_threshold=4)).rs == (
        RSCriterion("token_k1", upper=4.0, lower=0.25),
    )


def test_preset_with_overrides_and_name():
    spec = parse(
        {
            "framework": "verl",
            "preset": "decoupled_seq_is_rs",
            "algorithm": {"rollout_correction": {"rollout_is_threshold": 3.0}},
        }
    )
    assert spec.name == "decoupled_seq_is_rs"
    assert spec.is_upper == 3.0 and spec.rs == PRESETS["decoupled_seq_is_rs"].rs
    named = parse({"framework": "verl", "preset": "disabled", "name": "mine"})
    assert named.name == "mine"


RC = "algorithm.rollout_correction"
INVALID = [
    (cfg(rollout_is_level="token"), f"{RC}.rollout_is_level"),
    ({"framework": "verl", "trainer": {}}, "`trainer`"),
    ({"framework": "verl", "algorithm": {"gama": 1.0}}, "algorithm.gama"),
    ({"framework": "verl", "algorithm": {"rollout_correction": [1]}}, RC),
    (cfg(rollout_is="geometric"), f"{RC}.rollout_is"),
    (cfg(rollout_is="token", rollout_is_threshold="abc"), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="token", rollout_is_threshold=""), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="token", rollout_is_threshold="5.0_0.5"), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="token", rollout_is_threshold="0_1"), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="token", rollout_is_threshold="0.5_x"), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="sequence", rollout_is_threshold=-1), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="sequence", rollout_is_threshold=0), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="sequence", rollout_is_threshold=True), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="sequence", rollout_is_threshold="nan"), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_is="sequence", rollout_is_threshold=[0.5, 2]), f"{RC}.rollout_is_threshold"),
    (cfg(rollout_rs=["token_k1"], rollout_rs_threshold=2.0), f"{RC}.rollout_rs"),
    (cfg(rollout_rs="token_k4", rollout_rs_threshold=2.0), f"{RC}.rollout_rs"),
    (cfg(rollout_rs="", rollout_rs_threshold=2.0), f"{RC}.rollout_rs"),
    (cfg(rollout_rs=" , ", rollout_rs_threshold=2.0), f"{RC}.rollout_rs"),
    (cfg(rollout_rs="token_k1"), f"{RC}.rollout_rs_threshold"),
    (
        cfg(rollout_rs="token_k1,token_k2", rollout_rs_threshold="1,2,3"),
        f"{RC}.rollout_rs_threshold",
    ),
    (cfg(rollout_rs="token_k1,token_k1", rollout_rs_threshold="2,2"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k2", rollout_rs_threshold="0.5_2.0"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="seq_max_k3", rollout_rs_threshold="0.5_2.0"), f"{RC}.rollout_rs_threshold"),
    # "1_0" is 10.0 to Python's float(), but verl rejects any "_" in a k2/k3 entry
    (cfg(rollout_rs="token_k2", rollout_rs_threshold="1_0"), f"{RC}.rollout_rs_threshold"),
    (
        cfg(rollout_rs="token_k1,token_k3", rollout_rs_threshold="0.5_2.0"),
        f"{RC}.rollout_rs_threshold",
    ),
    (cfg(rollout_rs="token_k1", rollout_rs_threshold="0"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k1", rollout_rs_threshold="inf"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k1", rollout_rs_threshold="2.0_0.5"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="seq_mean_k1", rollout_rs_threshold="-1_2"), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k3", rollout_rs_threshold=-0.1), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k3", rollout_rs_threshold=True), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k3", rollout_rs_threshold=[0.1]), f"{RC}.rollout_rs_threshold"),
    (cfg(rollout_rs="token_k3", rollout_rs_threshold=""), f"{RC}.rollout_rs_threshold"),
    (cfg(bypass_mode="true"), f"{RC}.bypass_mode"),
    (cfg(loss_type="ppo"), f"{RC}.loss_type"),
    (cfg(rollout_is_batch_normalize=1), f"{RC}.rollout_is_batch_normalize"),
    ({"framework": "verl", "preset": "nope"}, "preset"),
    ({"framework": "verl", "preset": 3}, "preset"),
    ({"framework": "verl", "name": 3}, "name"),
]


@pytest.mark.parametrize(("config", "key"), INVALID)
def test_invalid_config(config, key):
    with pytest.raises(ConfigError) as info:
        parse(config)
    assert key in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"is_level": "token"}, "is_upper"),
        ({"is_level": "token", "is_upper": 1.0, "is_lower": 2.0}, "is_lower"),
        ({"is_upper": 2.0}, "is_upper"),
        ({"batch_normalize": True}, "batch_normalize"),
        ({"is_level": "geometric", "is_upper": 2.0}, "is_level"),
        ({"loss_type": "vanilla"}, "loss_type"),
        ({"bypass": 1}, "bypass"),
        ({"rs": (RSCriterion("token_k2", 1.0), RSCriterion("token_k2", 2.0))}, "rs"),
        ({"rs": ("token_k2",)}, "rs"),
    ],
)
def test_invalid_spec(kwargs, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        VerlSpec(**kwargs)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("token_k4", 1.0), "option"),
        (("token_k2", 1.0, 0.5), "token_k2.lower"),
        (("token_k1", 1.0), "token_k1.lower"),
        (("token_k1", 1.0, 2.0), "token_k1.lower"),
        (("seq_max_k3", 0.0), "seq_max_k3.upper"),
    ],
)
def test_invalid_criterion(args, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        RSCriterion(*args)


# ---------------------------------------------------------------------------------------------
# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: batch normalization over IS and RS together, which
# no preset uses.


def _normalized(name: str) -> VerlSpec:
    preset = PRESETS[name]
    return dataclasses.replace(
        preset,
        name=f"{name}+bn",
        batch_normalize=True,
        rs=(*preset.rs, RSCriterion("seq_max_k2", upper=0.01)),
    )


EXTRA_SPECS = {
    spec.name: spec
    for spec in map(
        _normalized, ["decoupled_seq_is_rs", "decoupled_k3_rs_token_tis", "bypass_pg_is"]
    )
}
# Version pr6800's binary_kl where it bites, beside other options and an IS weight, and in
# bypass mode (the current policy's log-probs as p).
EXTRA_SPECS |= {
    spec.name: spec
    for spec in (
        VerlSpec(
            name="kpop_tight_token_is",
            is_level="token",
            is_upper=2.0,
            rs=(RSCriterion("binary_kl", upper=0.01), RSCriterion("seq_max_k2", upper=0.5)),
            version="pr6800",
        ),
        VerlSpec(
            name="kpop_bypass_reinforce",
            is_level="sequence",
            is_upper=2.0,
            rs=(RSCriterion("binary_kl", upper=0.001),),
            bypass=True,
            loss_type="reinforce",
            version="pr6800",
        ),
    )
}


# ---------------------------------------------------------------------------------------------
# The public entry point.


def test_replay_dispatch(random_batch):
    config = cfg(
        rollout_is="token",
        rollout_is_threshold=2.0,
        rollout_rs="seq_mean_k3",
        rollout_rs_threshold=0.001,
    )
    result = iscore.replay(random_batch, config)
    expected = reference(random_batch, level="token", upper=2.0, rs=(("seq_mean_k3", None, 1e-3),))
    check(result, expected)
    assert frameworks.get("verl") is verl.FRAMEWORK
    assert verl.FRAMEWORK.name == VerlSpec.framework == "verl"


# ---------------------------------------------------------------------------------------------
# Version pr6800 (verl PR #6800 at b26dfa5c): rollout_rs binary_kl, KPop.


def kpop_cfg(**rc) -> dict:
    return {**cfg(**rc), "version": "pr6800"}


@pytest.mark.parametrize("phi", [1e-3, 0.01, 0.1, 2.0])
@pytest.mark.parametrize(
    ("others", "level", "bypass", "loss_type"),
    [
        ((), None, False, "ppo_clip"),
        ((("token_k1", 0.8, 1.25),), "token", False, "ppo_clip"),
        ((("seq_mean_k3", None, 0.01),), "sequence", True, "reinforce"),
        ((), None, True, "ppo_clip"),
    ],
)
def test_binary_kl_matches_the_reference(batch, phi, others, level, bypass, loss_type):
    rs = ",".join(["binary_kl", *(o for o, *_ in others)])
    entries = [repr(phi), *(f"{lo!r}_{hi!r}" if lo else repr(hi) for _, lo, hi in others)]
    config = kpop_cfg(
        rollout_is=level,
        rollout_rs=rs,
        rollout_rs_threshold=",".join(entries),
        bypass_mode=bypass,
        loss_type=loss_type,
    )
    spec = parse(config)
    expected = reference(
        batch,
        level=level,
        upper=2.0,
        rs=(("binary_kl", None, phi), *others),
        bypass=bypass,
        loss_type=loss_type,
    )
    check(spec.replay(batch), expected)


def test_binary_kl_bites_on_fresh_data(random_batch):
    """Some tokens go, some stay, and it is symmetric: the larger of the two directions."""
    spec = VerlSpec(rs=(RSCriterion("binary_kl", upper=0.001),), version="pr6800")
    keep = spec.replay(random_batch).keep
    mask = random_batch.loss_mask
    assert 0 < int((mask & ~keep).sum()) < int(mask.sum())
    swapped = dataclasses.replace(
        random_batch, rollout=random_batch.train, train=random_batch.rollout
    )
    assert torch.equal(spec.replay(swapped).keep, keep)


def _tokens(rollout: list[float], old: list[float]) -> TokenBatch:
    """One-token sequences with these float32 log-probs."""
    n = len(rollout)
    old_t = torch.tensor(old, dtype=torch.float32)
    return TokenBatch(
        rollout=torch.tensor(rollout, dtype=torch.float32),
        train=old_t,
        policy=old_t.clone(),
        cu_seqlens=torch.arange(n + 1, dtype=torch.int64),
    )


def _stat32(old: torch.Tensor, rollout: torch.Tensor) -> torch.Tensor:
    """PR #6800's statistic as it computes it, in torch float32 (for bounds hit exactly)."""

    def b(lp, lq):
        p = torch.exp(lp.float()).clamp(1e-6, 1 - 1e-6)
        q = torch.exp(lq.float()).clamp(1e-6, 1 - 1e-6)
        return p * torch.log(p / q) + (1 - p) * torch.log((1 - p) / (1 - q))

    return torch.maximum(b(old, rollout), b(rollout, old))


def test_binary_kl_threshold_hit_exactly_keeps_the_token():
    batch = _tokens([-1.0, -0.05, -3.0], [-0.3, -0.6, -2.2])
    stat = _stat32(batch.train, batch.rollout)
    for i, value in enumerate(stat.tolist()):
        at = VerlSpec(rs=(RSCriterion("binary_kl", upper=value),), version="pr6800")
        assert bool(at.replay(batch).keep[i]), "keep iff stat <= phi: inclusive"
        below = float(np.nextafter(np.float32(value), np.float32(0.0)))
        under = VerlSpec(rs=(RSCriterion("binary_kl", upper=below),), version="pr6800")
        assert not bool(under.replay(batch).keep[i])


def test_binary_kl_clamps_probabilities_that_round_to_one_and_zero():
    """Log-probs near 0 give p = 1 in float32, clamped to 1 - 1e-6 (the PR's eps); -inf and
    -100 give 0, clamped to 1e-6. The statistic stays finite: no NaN drops a token."""
    batch = _tokens([-1e-9, 0.0, -100.0, -1e-9, float("-inf")], [-0.5, -1e-9, -1e-9, 0.0, -2.0])
    stat = _stat32(batch.train, batch.rollout)
    assert bool(torch.isfinite(stat).all())
    r, t = batch.rollout.double().numpy(), batch.train.double().numpy()
    expected = np.maximum(binary_kl(t, r), binary_kl(r, t))
    np.testing.assert_allclose(stat.double().numpy(), expected, rtol=1e-5)
    assert stat[3] == 0.0, "both round to 1: the same clamped probability"
    # e^-100 and e^-inf both clamp to 1e-6: ~13.8 = log((1 - 1e-6) / 1e-6), the statistic's
    # largest value, which any phi above it never reaches.
    assert 13.8 < float(stat[2]) < 13.82
    keep = VerlSpec(rs=(RSCriterion("binary_kl", upper=13.82),), version="pr6800").replay(batch)
    assert bool(keep.keep.all())


def test_binary_kl_uses_the_raw_log_probs_not_the_clamped_ratio():
    """d = +30 and +40 clamp to the same +-20 for k1..k3; binary_kl sees the log-probs: q =
    e^-31 and e^-41 both clamp to 1e-6, but p = e^-1 and e^-1.5 differ."""
    batch = _tokens([-31.0, -41.5], [-1.0, -1.5])
    stat = _stat32(batch.train, batch.rollout)
    assert float(stat[0]) != float(stat[1])
    phi = float((stat[0] + stat[1]) / 2)
    spec = VerlSpec(rs=(RSCriterion("binary_kl", upper=phi),), version="pr6800")
    assert spec.replay(batch).keep.tolist() == [bool(stat[0] <= phi), bool(stat[1] <= phi)]


def test_binary_kl_on_the_edge_cases():
    edges = edge_batch()
    spec = VerlSpec(rs=(RSCriterion("binary_kl", upper=0.05),), version="pr6800")
    result = spec.replay(edges)
    check(result, reference(edges, rs=(("binary_kl", None, 0.05),)))
    assert not result.keep[3:7].any(), "a fully masked sequence stays out"
    assert result.keep[0], "one token, d = 0: B = 0"
    assert not result.keep[1] and not result.keep[2], "one token, d = +-30"


def test_the_pr6800_preset_is_the_pr_s_classmethod():
    # RolloutCorrectionConfig.decoupled_token_kpop(phi=2.0): rollout_is None, binary_kl at 2.0.
    spec = PRESETS["decoupled_token_kpop_pr6800"]
    rc = {"rollout_is": None, "rollout_rs": "binary_kl", "rollout_rs_threshold": 2.0}
    assert parse({**kpop_cfg(**rc), "name": "decoupled_token_kpop_pr6800"}) == spec
    assert spec == VerlSpec(
        name="decoupled_token_kpop_pr6800", rs=(RSCriterion("binary_kl", 2.0),), version="pr6800"
    )
    # A versioned preset brings its version; an explicit null takes it away.
    assert parse({"framework": "verl", "preset": "decoupled_token_kpop_pr6800"}) == spec
    with pytest.raises(ConfigError, match="binary_kl needs version pr6800"):
        parse({"framework": "verl", "preset": "decoupled_token_kpop_pr6800", "version": None})
    config = spec.to_config()
    assert config["version"] == "pr6800" and parse(config) == spec
    assert "version" not in PRESETS["decoupled_geo_rs"].to_config()


@pytest.mark.parametrize(
    ("config", "match"),
    [
        (cfg(rollout_rs="binary_kl", rollout_rs_threshold=2.0), "binary_kl needs version pr6800"),
        (
            cfg(rollout_rs="token_k3,binary_kl", rollout_rs_threshold="0.1,2.0"),
            "binary_kl needs version pr6800",
        ),
        (kpop_cfg(rollout_rs="binary_kl", rollout_rs_threshold="0.5_2.0"), "single upper bound"),
        (
            kpop_cfg(rollout_rs="token_k1,binary_kl", rollout_rs_threshold="0.5_2.0"),
            "single upper bound",
        ),
        (kpop_cfg(rollout_rs="binary_kl", rollout_rs_threshold=0), "float > 0"),
        (kpop_cfg(rollout_rs="binary_kl", rollout_rs_threshold=-1.0), "float > 0"),
        (kpop_cfg(rollout_rs="binary_kl"), "rollout_rs_threshold"),
        ({**kpop_cfg(), "version": "pr6377"}, "`version`.*pr6800.*'pr6377'"),
        ({**kpop_cfg(), "version": 6800}, "`version`"),
    ],
)
def test_binary_kl_configs_refused(config, match):
    with pytest.raises(ConfigError, match=match):
        parse(config)


def test_binary_kl_spec_needs_the_version():
    with pytest.raises(ConfigError, match="binary_kl needs version pr6800"):
        VerlSpec(rs=(RSCriterion("binary_kl", upper=2.0),))
    with pytest.raises(ConfigError, match="`version`"):
        VerlSpec(version="pr1")
    with pytest.raises(ConfigError, match=r"`binary_kl\.lower`"):
        RSCriterion("binary_kl", upper=2.0, lower=0.5)
    # The version alone changes nothing: a pinned setting under it replays the same.
    batch = make_batch([3, 5, 1], sigma=0.2)
    pinned = PRESETS["decoupled_geo_rs_token_tis"]
    versioned = dataclasses.replace(pinned, version="pr6800")
    assert parse(versioned.to_config()) == versioned
    a, b = pinned.replay(batch), versioned.replay(batch)
    assert torch.equal(a.weight, b.weight) and torch.equal(a.keep, b.keep)


def test_binary_kl_and_k1_thresholds_per_option():
    spec = parse(kpop_cfg(rollout_rs="token_k1,binary_kl", rollout_rs_threshold="0.5_2.0,0.1"))
    assert spec.rs == (RSCriterion("token_k1", 2.0, 0.5), RSCriterion("binary_kl", 0.1))
    shared = parse(kpop_cfg(rollout_rs="token_k3,binary_kl", rollout_rs_threshold=0.1))
    assert [c.upper for c in shared.rs] == [0.1, 0.1]


def test_binary_kl_canonical_form_and_older_generations():
    spec = PRESETS["decoupled_token_kpop_pr6800"]
    (mask,) = verl.to_canonical(spec).components
    assert (mask.method, mask.statistic, mask.level, mask.upper) == (
        "binary-kl-mask",
        "binary_kl",
        "token",
        2.0,
    )
    assert (mask.numerator, mask.numerics, mask.strict) == ("train", "float32", False)
    back, notes = verl.FRAMEWORK.closest(verl.to_canonical(spec), "back")
    assert back.version == "pr6800" and back.rs == spec.rs
    assert any("PR #6800" in note for note in notes)
    older = verl.to_generation(spec, "gen2")
    assert older.spec.rs == () and older.spec.version is None
    assert any("binary_kl" in note for note in older.notes)
    assert verl.to_generation(spec, "current").config == spec.to_config()


def test_binary_kl_snippet_names_the_pr_and_keeps_the_version_out_of_verl_s_keys():
    text = snippet(PRESETS["decoupled_token_kpop_pr6800"])
    assert text.startswith("# needs verl PR #6800 (open PR, head b26dfa5c)")
    assert "version" not in text.split("\n", 1)[1]
    assert "rollout_rs: binary_kl" in text
    header = to_file_text(PRESETS["decoupled_token_kpop_pr6800"]).splitlines()[0]
    assert "verl-project/verl@b26dfa5c (2026-06-21), open PR #6800" in header
    assert verl.FRAMEWORK.upstream_of(PRESETS["decoupled_geo_rs"]).startswith(
        "verl-project/verl@1dda039b"
    )
