"""ROLL's `train_infer_correction` against an independent float64 reference.

The reference is written from the formulas of roll/utils/train_infer_corrections.py at
alibaba/ROLL@8eb27cc2, in numpy, one sequence at a time: d = train - rollout, dp = e^train -
e^rollout; a level's value is the token's own, the masked mean (geometric), the masked SUM
(sequence) or the mean over the token's run of consecutive loss tokens (segment); the weight is
clamp(e^{level d}, 0, upper_bound), the keep is the loss mask times every enabled band.
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from iscore import frameworks
from iscore.advice.conversion import export
from iscore.errors import ConfigError
from iscore.frameworks import roll
from iscore.frameworks.roll import Filter, ISWeight, RollSpec
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import edge_batch, make_batch, random_batch_of, sequences


def assert_matches_reference(result, expected) -> None:
    """The harness's comparison (test_harness.py, which imports this module)."""
    weight, keep, raw = expected
    np.testing.assert_array_equal(result.keep.numpy(), keep, err_msg="keep")
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=1e-37)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=1e-37)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of consecutive true values."""
    runs, start = [], None
    for i, m in enumerate(mask):
        if m and start is None:
            start = i
        if not m and start is not None:
            runs.append((start, i))
            start = None
    if start is not None:
        runs.append((start, len(mask)))
    return runs


def _at(x: np.ndarray, mask: np.ndarray, level: str) -> np.ndarray:
    """x at `level`, per token (the values outside the mask do not matter)."""
    if level == "token":
        return x
    if level == "geometric":
        return np.full(len(x), x[mask].mean() if mask.any() else 0.0)
    if level == "sequence":
        return np.full(len(x), x[mask].sum())
    out = np.zeros(len(x))
    for a, b in _runs(mask):
        out[a:b] = x[a:b].mean()
    return out


def reference_of(spec: RollSpec, batch: TokenBatch):
    weights, keeps, raws = [], [], []
    for rollout, train, _, mask in sequences(batch):
        d = train - rollout
        dp = np.exp(train) - np.exp(rollout)
        keep = mask.copy()
        applies = spec.recompute or spec.loss_agg_mode != "token-mean"
        with np.errstate(over="ignore"):
            for f in spec.filters:
                if not (f.enabled and applies):
                    continue
                if f.ratio_enabled:
                    r = np.exp(_at(d, mask, f.agg_type))
                    keep &= (r >= f.ratio_low) & (r <= f.ratio_high)
                if f.diff_enabled:
                    v = _at(dp, mask, f.agg_type)
                    keep &= (v >= f.diff_low) & (v <= f.diff_high)
            w = spec.is_weight
            if w.enabled:
                raw = np.exp(_at(d, mask, w.weight_type))
                # ROLL's float32 exp: beyond float32's range the ratio is inf.
                raw = np.where(raw > np.finfo(np.float32).max, np.inf, raw)
                weight = raw if w.upper_bound is None else np.clip(raw, 0.0, w.upper_bound)
            else:
                raw, weight = np.exp(d), np.ones(len(d))
        weights.append(np.where(keep, weight, 0.0))
        keeps.append(keep)
        raws.append(raw)
    return np.concatenate(weights), np.concatenate(keeps), np.concatenate(raws)


def _weighted(level: str, upper: float | None = 1.2, **kw) -> RollSpec:
    return RollSpec(
        name=f"{level}_{upper}",
        is_weight=ISWeight(enabled=True, weight_type=level, upper_bound=upper),
        **kw,
    )


_DIFF = {"ratio_enabled": False, "diff_enabled": True}


def _diff_band(level: str, low: float, high: float) -> RollSpec:
    return RollSpec(filters=(Filter(True, level, diff_low=low, diff_high=high, **_DIFF),))


_BOTH = {"diff_enabled": True, "diff_low": -0.1, "diff_high": 0.1}
EXTRA_SPECS = {
    **{f"{lv}_unbounded": _weighted(lv, None) for lv in roll.LEVELS},
    **{f"{lv}_cap_2": _weighted(lv, 2.0) for lv in roll.LEVELS},
    **{
        f"{lv}_ratio_band": RollSpec(filters=(Filter(True, lv, ratio_low=0.9, ratio_high=1.1),))
        for lv in roll.LEVELS
    },
    **{
        f"{lv}_diff_band": _diff_band(lv, -0.05, 0.02)
        for lv in roll.LEVELS
    },
    "sequence_diff_sum": _diff_band("sequence", -1.0, 1.0),
    "geometric_weight_segment_both_sequence_ratio": _weighted(
        "geometric",
        filters=(
            Filter(True, "segment", ratio_low=0.95, ratio_high=1.05, **_BOTH),
            Filter(False, "token", ratio_low=5.0, ratio_high=6.0),  # disabled: changes nothing
            Filter(True, "sequence", ratio_low=0.2, ratio_high=5.0),
        ),
    ),
    "segment_weight_token_filter": _weighted("segment", 1.5, filters=(Filter(True),)),
    # Bounds exactly hit: d = 0 gives ratio 1 and dp 0 exactly, which these keep.
    "bounds_hit_ratio": RollSpec(filters=(Filter(True, ratio_low=1.0, ratio_high=1.0),)),
    "bounds_hit_diff": RollSpec(filters=(Filter(True, diff_low=0.0, diff_high=0.0, **_DIFF),)),
    "weight_at_one": _weighted("token", 1.0),
    # token-mean without the recompute: the filters leave the policy-gradient term alone.
    "token_mean_no_recompute": _weighted(
        "token", filters=(Filter(True),), loss_agg_mode="token-mean"
    ),
    "token_mean_recompute": _weighted(
        "token", filters=(Filter(True),), loss_agg_mode="token-mean", recompute=True
    ),
}  # fmt: skip


def _multi_turn(seed: int = 0) -> TokenBatch:
    """Sequences whose loss masks have several runs each (turns), one-token runs included."""
    batch = make_batch([1, 7, 40, 120, 3, 300], seed=seed, sigma=0.2, masked_fraction=0.0)
    mask = batch.loss_mask.clone()
    for position in (1, 4, 5, 10, 30, 31, 32, 60, 100, 101, 200, 215, 300, 301, 302, 470):
        mask[position] = False
    mask[batch.cu_seqlens[4] : batch.cu_seqlens[5]] = False  # a fully masked sequence
    return TokenBatch(batch.rollout, batch.train, batch.cu_seqlens, loss_mask=mask)


@pytest.mark.parametrize("name", [*roll.PRESETS, *EXTRA_SPECS])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_turn_batches_match_the_reference(name: str, seed: int) -> None:
    spec = {**roll.PRESETS, **EXTRA_SPECS}[name]
    batch = _multi_turn(seed)
    assert_matches_reference(spec.replay(batch), reference_of(spec, batch))


def test_segment_mean_by_hand() -> None:
    # One sequence: runs [0, 2) and [3, 4) (position 2 masked); a second with one run.
    d = torch.tensor([0.2, 0.4, 9.0, -0.3, 0.1, 0.1], dtype=torch.float64)
    rollout = torch.full((6,), -1.0)
    batch = TokenBatch(
        rollout,
        (rollout.double() + d).float(),
        torch.tensor([0, 4, 6]),
        loss_mask=torch.tensor([True, True, False, True, True, True]),
    )
    weight = _weighted("segment", None).replay(batch).weight.double()
    d32 = (batch.train.double() - batch.rollout.double()).numpy()
    want = np.exp([d32[:2].mean()] * 2 + [0.0] + [d32[3]] + [d32[4:].mean()] * 2)
    want[2] = 0.0  # masked
    np.testing.assert_allclose(weight.numpy(), want, rtol=1e-6)


def test_extreme_ratios_and_null_bound() -> None:
    batch = edge_batch()
    result = _weighted("sequence", None).replay(batch)
    # 200 tokens of d = 0.5: e^100 overflows float32 to inf, as ROLL's float32 e^S does.
    assert bool(torch.isinf(result.weight).any())
    capped = _weighted("sequence", 1.2).replay(batch)
    assert bool(torch.isfinite(capped.weight).all()) and float(
        capped.weight.max()
    ) == pytest.approx(1.2)
    token = _weighted("token", None).replay(batch)  # e^30, no +-20 clamp
    assert float(token.weight[1]) == pytest.approx(math.exp(30.0), rel=1e-6)


def test_the_sequence_diff_is_a_sum() -> None:
    # 300 tokens with the same small dp: the mean passes a 0.2 band, the sum does not.
    rollout = torch.full((300,), -1.0)
    batch = TokenBatch(rollout, rollout + 0.01, torch.tensor([0, 300]))
    band = {"diff_low": -0.2, "diff_high": 0.2, **_DIFF}
    geometric = RollSpec(filters=(Filter(True, "geometric", **band),)).replay(batch)
    sequence = RollSpec(filters=(Filter(True, "sequence", **band),)).replay(batch)
    assert bool(geometric.keep.all()) and not bool(sequence.keep.any())


# ------------------------------------------------------------------ parse and config


def test_defaults_are_roll_s_dataclasses() -> None:
    spec = roll.parse({"framework": "roll"})
    assert spec == roll.PRESETS["roll_disabled"].__class__(name="roll")
    assert spec.is_weight == ISWeight(
        enabled=False, weight_type="token", upper_bound=1.2, detach=True
    )
    f = roll.parse({"framework": "roll", "train_infer_correction": {"filters": [{}]}}).filters[0]
    assert (f.enabled, f.agg_type, f.ratio_enabled, f.ratio_low, f.ratio_high) == (
        False,
        "token",
        True,
        0.8,
        1.2,
    )
    assert (f.diff_enabled, f.diff_low, f.diff_high) == (False, -0.2, 0.2)
    assert spec.loss_agg_mode == "seq-mean-token-mean" and not spec.recompute


def test_the_shipped_example_parses_to_its_preset() -> None:
    # examples/qwen2.5-0.5B-agentic/agent_val_frozen_lake-pg_var_is_correct.yaml l.66-76.
    config = {
        "framework": "roll",
        "name": "roll_frozen_lake_segment_filter",
        "enable_old_logprobs_recompute": True,
        "train_infer_correction": {
            "filters": [
                {
                    "enabled": True,
                    "agg_type": "segment",
                    "ratio_enabled": True,
                    "diff_enabled": True,
                    "ratio_low": 0.8,
                    "ratio_high": 1.05,
                    "diff_low": -0.1,
                    "diff_high": 0.1,
                }
            ]
        },
    }
    assert roll.parse(config) == roll.PRESETS["roll_frozen_lake_segment_filter"]


def test_unknown_keys_warn_as_roll_ignores_them() -> None:
    config = {
        "framework": "roll",
        "pretrain": "Qwen/Qwen2.5-0.5B-Instruct",
        "train_infer_correction": {"is_weight": {"enabled": True, "upper_bond": 2.0}},
    }
    with pytest.warns(UserWarning, match=r"upper_bond.*did you mean 'upper_bound'"):
        spec = roll.parse(config)
    assert spec.is_weight.upper_bound == 1.2  # the misspelt key changed nothing, as in ROLL


@pytest.mark.parametrize(
    ("correction", "match"),
    [
        ({"is_weight": {"weight_type": "seq"}}, r"is_weight.weight_type.*'sequence'"),
        ({"is_weight": {"upper_bound": 0}}, r"is_weight.upper_bound` to be a float > 0"),
        ({"is_weight": {"enabled": "yes"}}, r"is_weight.enabled` to be a bool"),
        ({"filters": {"enabled": True}}, r"filters` to be a list"),
        ({"filters": [{}, {"enabled": True, "ratio_low": 2.0}]}, r"filters\[1\].ratio_low` <="),
        ({"filters": [{"agg_type": "turn"}]}, r"filters\[0\].agg_type"),
        ({"filters": [{"diff_high": "nan"}]}, r"filters\[0\].diff_high` to be a float"),
    ],
)
def test_errors_name_the_key(correction, match) -> None:
    with pytest.raises(ConfigError, match=match), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        roll.parse({"framework": "roll", "train_infer_correction": correction})


def test_a_disabled_filter_is_not_checked() -> None:
    spec = roll.parse(
        {"framework": "roll", "train_infer_correction": {"filters": [{"ratio_low": 3.0}]}}
    )
    assert spec.filters[0].bands == ()


@pytest.mark.parametrize(
    ("mode", "recompute", "expected"),
    [
        ("seq-mean-token-mean", False, ("seq-mean-token-mean", True)),
        ("token-mean", False, ("token-mean", False)),
        ("token-mean", True, ("token-mean", True)),
        ("seq-mean-token-sum", False, ("seq-mean-token-sum", False)),
        ("seq-mean-token-sum-norm", True, ("seq-mean-token-sum", False)),
    ],
)
def test_loss_aggregation(mode, recompute, expected) -> None:
    agg = frameworks.get("roll").aggregation(RollSpec(loss_agg_mode=mode, recompute=recompute))
    assert (agg.mode, agg.shrinks) == expected


# ------------------------------------------------------------------ canonical form and export


def test_token_mean_without_recompute_has_no_mask_in_its_canonical_form() -> None:
    c = roll.to_canonical(EXTRA_SPECS["token_mean_no_recompute"])
    assert [x.role for x in c.components] == ["weight"]
    assert [x.role for x in roll.to_canonical(EXTRA_SPECS["token_mean_recompute"]).components] == [
        "weight",
        "mask",
    ]


@pytest.mark.parametrize("name", list(EXTRA_SPECS))
def test_canonical_form_maps_back(name: str) -> None:
    spec = EXTRA_SPECS[name]
    fw = frameworks.get("roll")
    back, notes = fw.closest(fw.to_canonical(spec), name)
    assert fw.to_canonical(back) == fw.to_canonical(spec)
    assert not notes


def test_segments_exported_elsewhere_say_what_changes() -> None:
    for spec in (roll.PRESETS["roll_segment_is"], roll.PRESETS["roll_frozen_lake_segment_filter"]):
        for to in frameworks.NAMES:
            if to == "roll":
                continue
            out = export(spec, to)
            assert not out.exact and out.notes, to
            if spec.is_weight.enabled:
                assert any("per-segment" in note for note in out.notes), to


def test_a_geometric_mask_comes_in_exactly() -> None:
    out = export(
        frameworks.get("verl").presets()["decoupled_geo_rs"], "roll", batch=random_batch_of(0)
    )
    # verl's k1 "0.999_1.001" keeps e^G in [1/1.001, 1/0.999] (its reciprocal trap).
    assert out.exact
    assert out.spec.filters[0].agg_type == "geometric"
    assert out.spec.filters[0].ratio_low == pytest.approx(1 / 1.001)
