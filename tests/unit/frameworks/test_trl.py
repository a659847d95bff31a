"""TRL: replay vs a float64 reference written from `GRPOTrainer`; `GRPOConfig` parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import iscore
from iscore import frameworks
from iscore.errors import ConfigError
from iscore.frameworks import trl
from iscore.frameworks.trl import TRLCorrection, parse
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import sequences

MODES = ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]


def reference(batch: TokenBatch, mode: str, clip_min: float | None, clip_max: float | None):
    """(weight, raw, seq_raw, seq_weight); ratios are float32 like TRL's, so e^S may be inf/0."""
    lo = -np.inf if clip_min is None else clip_min
    hi = np.inf if clip_max is None else clip_max
    weight, raw, seq_raw, seq_weight = [], [], [], []
    for rollout, train, _, mask in sequences(batch):
        d = np.where(mask, train - rollout, 0.0)
        with np.errstate(over="ignore"):
            if mode.startswith("sequence"):
                rho = np.float32(np.exp(d.sum()))
            else:
                rho = np.exp(d).astype(np.float32)
        rho = np.asarray(rho)
        if mode.endswith("truncate"):
            w = np.clip(rho, clip_min, clip_max)
        else:
            w = np.where((rho >= lo) & (rho <= hi), rho, np.float32(0.0))
        if mode.startswith("sequence"):
            seq_raw.append(rho)
            seq_weight.append(w)
        weight.append(np.where(mask, np.broadcast_to(w, mask.shape), 0.0))
        raw.append(np.broadcast_to(rho, mask.shape))
    return np.concatenate(weight), np.concatenate(raw), np.array(seq_raw), np.array(seq_weight)


def reference_of(spec: TRLCorrection, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness; the correction
    turned off is hand-checked below."""
    assert spec.use_vllm and spec.enabled, "not modelled by `reference`"
    weight, raw, _, _ = reference(batch, spec.mode, spec.clip_min, spec.clip_max)
    return weight, batch.loss_mask.numpy(), raw


def check(batch: TokenBatch, spec: TRLCorrection) -> None:
    result = spec.replay(batch)
    weight, raw, seq_raw, seq_weight = reference(batch, spec.mode, spec.clip_min, spec.clip_max)
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=0)
    assert torch.equal(result.keep, batch.loss_mask)
    if spec.mode.startswith("sequence"):
        np.testing.assert_allclose(result.seq_raw.numpy(), seq_raw, rtol=1e-6, atol=0)
        np.testing.assert_allclose(result.seq_weight.numpy(), seq_weight, rtol=1e-6, atol=0)
    else:
        assert result.seq_raw is None and result.seq_weight is None


BOUNDS = [(None, 3.0), (0.5, 2.0), (1.0, 5.0), (0.5, 1.0), (0.8, None), (None, 1.0)]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("clip_min", "clip_max"), BOUNDS)
def test_replay_matches_reference(random_batch, edges, mode, clip_min, clip_max):
    spec = TRLCorrection(mode=mode, clip_min=clip_min, clip_max=clip_max)
    check(random_batch, spec)
    check(edges, spec)


@pytest.mark.parametrize("mode", ["token_mask", "sequence_mask"])
def test_mask_modes_without_bounds_keep_the_raw_ratio(edges, mode):
    check(edges, TRLCorrection(mode=mode, clip_min=None, clip_max=None))


def test_default_is_sequence_mask_above_three():
    spec = parse({"framework": "trl"})
    assert spec == TRLCorrection(use_vllm=True, enabled=True, mode="sequence_mask")
    assert (spec.clip_min, spec.clip_max) == (None, 3.0)


def test_sequence_product_overflow_on_edges(edges):
    # Sequence 4: 200 tokens of d = 0.5, S = 100 > 88.72: e^S is inf in float32.
    # Sequence 5: 300 tokens of d = -0.5, S = -150: e^S underflows to 0.
    # Sequence 7: S = 0 + ln2 - ln2 + 0.1 - 0.1 ~ 0: ratio ~1.
    masked = parse({"framework": "trl"}).replay(edges)
    assert masked.seq_raw[4] == torch.inf and masked.seq_weight[4] == 0.0
    assert masked.seq_raw[5] == 0.0 and masked.seq_weight[5] == 0.0
    assert masked.seq_weight[7] == pytest.approx(1.0, abs=1e-6)
    start, end = edges.cu_seqlens[4:6].tolist()
    assert torch.equal(masked.weight[start:end], torch.zeros(end - start))
    assert masked.keep[start:end].all()  # masked by weight only: the loss mask is untouched

    truncated = TRLCorrection(mode="sequence_truncate").replay(edges)
    assert truncated.seq_weight[4] == 3.0 and truncated.seq_weight[5] == 0.0
    lifted = TRLCorrection(mode="sequence_truncate", clip_min=0.5).replay(edges)
    assert lifted.seq_weight[5] == 0.5
    # No upper bound: the overflowed sequence keeps its infinite weight, as in TRL.
    open_top = TRLCorrection(mode="sequence_mask", clip_min=0.5, clip_max=None).replay(edges)
    assert open_top.seq_weight[4] == torch.inf and open_top.seq_weight[5] == 0.0


def test_sequence_ratio_ignores_masked_tokens(edges):
    # Sequence 6: d = 0 except a loss-masked token with d = +30; TRL zeroes d outside the mask.
    result = TRLCorrection(mode="sequence_mask").replay(edges)
    assert result.seq_raw[6] == 1.0 and result.seq_weight[6] == 1.0
    token = TRLCorrection(mode="token_truncate").replay(edges)
    start = edges.cu_seqlens[6].item()
    assert token.raw[start + 3] == 1.0  # e^(d * mask) = e^0 at the masked position


@pytest.mark.parametrize(
    "config",
    [
        {"use_vllm": False},
        {"use_vllm": True, "vllm_importance_sampling_correction": False},
        {"grpo_config": {"use_vllm": False, "vllm_importance_sampling_mode": "token_truncate"}},
        # With the correction off, TRL does not apply VESPO's ratio either.
        {"loss_type": "vespo", "vllm_importance_sampling_correction": False},
    ],
)
def test_no_weight_without_vllm_or_correction(edges, config):
    result = parse({"framework": "trl", **config}).replay(edges)
    assert torch.equal(result.keep, edges.loss_mask)
    assert torch.equal(result.weight, edges.loss_mask.float())
    assert torch.equal(result.raw, torch.ones(edges.num_tokens))


GRPO = {
    "use_vllm": True,
    "vllm_mode": "colocate",
    "learning_rate": 1e-6,
    "num_generations": 8,
    "loss_type": "dapo",
    "beta": 0.0,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "token_mask",
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": "5.0",
    "bf16": True,
    "use_liger_kernel": False,
}


def test_parse_top_level_and_nested_layouts_agree():
    expected = TRLCorrection(mode="token_mask", clip_min=0.5, clip_max=5.0, name="mine")
    assert parse({"framework": "trl", "name": "mine", **GRPO}) == expected
    assert parse({"framework": "trl", "name": "mine", "grpo_config": GRPO}) == expected


def test_deprecated_cap_overrides_clip_max_with_a_warning():
    with pytest.warns(FutureWarning, match="vllm_importance_sampling_cap"):
        spec = parse({"framework": "trl", "vllm_importance_sampling_cap": 2.0})
    assert spec.clip_max == 2.0
    both = {"vllm_importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": 4.0}
    with pytest.warns(FutureWarning, match="overrides"):
        assert parse({"framework": "trl", **both}).clip_max == 2.0
    # TRL checks clip_min < clip_max after the cap replaced clip_max.
    with pytest.warns(FutureWarning), pytest.raises(ConfigError, match="clip_min"):
        parse({"framework": "trl", **both, "vllm_importance_sampling_clip_min": 3.0})


def test_explicit_null_clip_max_is_open():
    spec = parse({"framework": "trl", "vllm_importance_sampling_clip_max": None})
    assert spec.clip_max is None


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"output_dir": "runs/x"}, "output_dir"),  # TrainingArguments keys are not enumerable
        ({"grpo_config": {"vllm_importance_sampling_modes": "token_mask"}}, "grpo_config."),
        ({"grpo_config": {}, "use_vllm": True}, "use_vllm"),
        ({"use_vllm": "true"}, "use_vllm"),
        ({"vllm_importance_sampling_correction": 1}, "vllm_importance_sampling_correction"),
        ({"vllm_importance_sampling_mode": "geometric"}, "vllm_importance_sampling_mode"),
        ({"vllm_importance_sampling_clip_max": "abc"}, "vllm_importance_sampling_clip_max"),
        ({"vllm_importance_sampling_clip_min": [0.5]}, "vllm_importance_sampling_clip_min"),
        ({"vllm_importance_sampling_cap": "x"}, "vllm_importance_sampling_cap"),
        (
            {"vllm_importance_sampling_clip_min": 3.0, "vllm_importance_sampling_clip_max": 3.0},
            "vllm_importance_sampling_clip_min",
        ),
        (
            {
                "vllm_importance_sampling_mode": "token_truncate",
                "vllm_importance_sampling_clip_max": None,
            },
            "vllm_importance_sampling_clip_max",
        ),
        ({"off_policy_mask_threshold": 0.5}, "off_policy_mask_threshold"),
        ({"loss_type": "ppo"}, "loss_type"),
        ({"loss_type": "vespo"}, "vllm_importance_sampling_mode"),
        ({"loss_type": "vespo", "vllm_importance_sampling_mode": "token_mask"}, "vespo"),
        ({"grpo_config": [1, 2]}, "grpo_config"),
    ],
)
def test_invalid_config_raises_naming_the_key(config, named):
    with pytest.raises(ConfigError, match=named):
        parse({"framework": "trl", **config})


# TRL checks none of these: a negative or zero upper bound, a negative lower bound.
BAD_BOUNDS = [
    ({"vllm_importance_sampling_clip_max": -3},
     "Expected `vllm_importance_sampling_clip_max` to be a float > 0.0, but got -3"),
    ({"vllm_importance_sampling_clip_max": 0.0},
     "Expected `vllm_importance_sampling_clip_max` to be a float > 0.0, but got 0.0"),
    ({"grpo_config": {"vllm_importance_sampling_clip_min": -0.5}},
     "Expected `grpo_config.vllm_importance_sampling_clip_min` to be a float >= 0.0, but got -0.5"),
    ({"vllm_importance_sampling_cap": -3},
     "Expected `vllm_importance_sampling_cap` to be a float > 0.0, but got -3"),
    # The cap overrides clip_max in TRL, but a negative clip_max is still refused.
    ({"vllm_importance_sampling_cap": 2.0, "vllm_importance_sampling_clip_max": -1.0},
     "Expected `vllm_importance_sampling_clip_max` to be a float > 0.0, but got -1.0"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), BAD_BOUNDS)
def test_senseless_bounds_are_refused_naming_the_key_and_value(config, message):
    with pytest.raises(ConfigError) as info:
        parse({"framework": "trl", **config})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"clip_max": -3.0}, "`vllm_importance_sampling_clip_max` to be a float > 0.0 or null"),
        ({"clip_min": -0.5}, "`vllm_importance_sampling_clip_min` to be a float >= 0.0 or null"),
    ],
)
def test_spec_validation_refuses_senseless_bounds(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        TRLCorrection(**kwargs)


@pytest.mark.parametrize("mode", MODES)
def test_zero_clip_min_is_valid_and_replays(edges, mode):
    bounds = {"vllm_importance_sampling_clip_min": 0, "vllm_importance_sampling_clip_max": 2}
    spec = parse({"framework": "trl", "vllm_importance_sampling_mode": mode, **bounds})
    assert (spec.clip_min, spec.clip_max) == (0.0, 2.0)
    check(edges, spec)


def test_clip_min_ge_clip_max_is_rejected_even_with_the_correction_off():
    with pytest.raises(ConfigError, match="clip_min"):
        TRLCorrection(enabled=False, clip_min=4.0, clip_max=3.0)
    # A truncate mode without bounds is only rejected when the correction is on.
    assert TRLCorrection(enabled=False, mode="token_truncate", clip_max=None).clip_max is None


def test_end_to_end_dispatch(edges):
    config = {"framework": "trl", "grpo_config": {"vllm_importance_sampling_mode": "token_mask"}}
    via_dispatch = iscore.replay(edges, config)
    direct = TRLCorrection(mode="token_mask").replay(edges)
    assert torch.equal(via_dispatch.weight, direct.weight)
    assert frameworks.get("trl") is trl.FRAMEWORK


# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: every mode with a band that bites.
EXTRA_SPECS = {
    f"{mode}-0.8-1.25": TRLCorrection(mode=mode, clip_min=0.8, clip_max=1.25) for mode in MODES
}
