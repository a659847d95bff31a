"""Fireworks cookbook: replay vs a float64 reference written from `tis.py`; config parsing."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import iscore
from iscore import frameworks
from iscore.errors import ConfigError
from iscore.frameworks import fireworks
from iscore.frameworks.fireworks import PRESETS, FireworksISCorrection, FireworksTIS, parse
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import sequences


def reference(
    batch: TokenBatch,
    *,
    cap: float,
    level: str,
    icepop: float | None = None,
    anchor: str = "old_policy",
    masked_mean: bool = True,
):
    """(weight, raw, seq_raw, seq_weight); the geometric mean runs over the loss-mask tokens
    (current cookbook) or over every token (`masked_mean=False`, PR #169)."""
    weight, raw, seq_raw, seq_weight = [], [], [], []
    for rollout, train, _, mask in sequences(batch):
        z = np.clip(train - rollout, -20.0, 20.0) if anchor == "old_policy" else 0.0 * rollout
        if level == "token":
            r = np.exp(z)
        else:
            over = mask if masked_mean else np.ones_like(mask)
            g = z[over].mean() if over.any() else 0.0
            seq_raw.append(np.exp(g))
            seq_weight.append(min(max(np.exp(g), 0.0), cap))
            r = np.full(len(z), np.exp(g))
        w = np.clip(r, 0.0, cap)
        if icepop is not None:
            w = np.where((r >= 1.0 / icepop) & (r <= icepop), w, 0.0)
        weight.append(np.where(mask, w, 0.0))
        raw.append(r)
    return np.concatenate(weight), np.concatenate(raw), np.array(seq_raw), np.array(seq_weight)


def reference_of(spec: FireworksTIS | FireworksISCorrection, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness."""
    if isinstance(spec, FireworksISCorrection):
        weight, raw, _, _ = reference(
            batch, cap=spec.tis_cap, level=spec.tis_level, masked_mean=False
        )
    else:
        weight, raw, _, _ = reference(
            batch,
            cap=spec.cap,
            level=spec.level,
            icepop=spec.icepop_threshold,
            anchor=spec.anchor_logp,
        )
    return weight, batch.loss_mask.numpy(), raw


def check(batch, result, expected, level):
    weight, raw, seq_raw, seq_weight = expected
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=0)
    assert torch.equal(result.keep, batch.loss_mask)
    if level == "sequence":
        np.testing.assert_allclose(result.seq_raw.numpy(), seq_raw, rtol=1e-6, atol=0)
        np.testing.assert_allclose(result.seq_weight.numpy(), seq_weight, rtol=1e-6, atol=0)
    else:
        assert result.seq_raw is None and result.seq_weight is None


HEAD_SETTINGS = [
    pytest.param(cap, level, icepop, anchor, id=f"{cap}-{level}-{icepop}-{anchor}")
    for anchor in ("old_policy", "rollout")
    for cap, level, icepop in [
        (5.0, "token", None),
        (1.0, "token", None),
        (0.5, "token", None),
        (0.0, "token", None),
        (5.0, "token", 2.0),
        (2.0, "token", 5.0),
        (5.0, "token", 1.0),
        (5.0, "sequence", None),
        (1.0, "sequence", None),
    ]
]


@pytest.mark.parametrize(("cap", "level", "icepop", "anchor"), HEAD_SETTINGS)
def test_current_form_matches_reference(random_batch, edges, cap, level, icepop, anchor):
    spec = FireworksTIS(cap=cap, level=level, icepop_threshold=icepop, anchor_logp=anchor)
    for batch in (random_batch, edges):
        expected = reference(batch, cap=cap, level=level, icepop=icepop, anchor=anchor)
        check(batch, spec.replay(batch), expected, level)


@pytest.mark.parametrize("cap", [5.0, 2.0, 0.5])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_pr169_form_matches_reference(random_batch, edges, cap, level):
    spec = FireworksISCorrection(tis_cap=cap, tis_level=level)
    for batch in (random_batch, edges):
        expected = reference(batch, cap=cap, level=level, masked_mean=False)
        check(batch, spec.replay(batch), expected, level)


def test_icepop_keeps_min_of_raw_and_cap():
    d = [math.log(3.0), math.log(6.0), math.log(0.19), math.log(0.25), 0.0]
    batch = TokenBatch(
        rollout=torch.full((5,), -2.0),
        train=torch.tensor(d, dtype=torch.float32) - 2.0,
        cu_seqlens=torch.tensor([0, 5]),
    )
    result = FireworksTIS(cap=2.0, icepop_threshold=5.0).replay(batch)
    # 3 is inside [0.2, 5] and carries min(3, cap) = 2, not the raw 3 (verl/NeMo IcePop would).
    assert result.weight.tolist() == pytest.approx([2.0, 0.0, 0.0, 0.25, 1.0], rel=1e-5)


def test_sequence_level_is_a_geometric_mean_over_active_tokens(edges):
    head = FireworksTIS(level="sequence").replay(edges)
    pr = FireworksISCorrection(tis_level="sequence").replay(edges)
    # Sequence 4: 200 tokens of d = 0.5: e^0.5, not the product e^100.
    assert head.seq_raw[4].item() == pytest.approx(math.exp(0.5), rel=1e-6)
    # Sequence 6: d = 0 except one loss-masked token with d = +30 (clamped to 20).
    assert head.seq_raw[6].item() == 1.0  # HEAD leaves masked tokens out of the mean
    assert pr.seq_raw[6].item() == pytest.approx(math.exp(20.0 / 8), rel=1e-6)
    assert pr.seq_weight[6].item() == 5.0  # PR #169 had no loss mask: capped at 5
    # Sequence 1: one token, d = +30: the +-20 clamp comes before the exponent.
    assert head.seq_raw[1].item() == pytest.approx(math.exp(20.0), rel=1e-6)


@pytest.mark.parametrize(("cap", "expected"), [(5.0, 1.0), (1.0, 1.0), (0.5, 0.5)])
def test_rollout_anchor_gives_min_of_one_and_cap(edges, cap, expected):
    result = parse({"framework": "fireworks", "anchor_logp": "rollout", "tis": {"cap": cap}})
    replay = result.replay(edges)
    assert torch.equal(replay.weight, edges.loss_mask.float() * expected)


def test_defaults():
    assert parse({"framework": "fireworks"}) == FireworksTIS(cap=5.0, level="token")
    assert parse({"framework": "fireworks", "is_correction": None}) == FireworksISCorrection()


def test_parse_both_forms():
    head = parse(
        {
            "framework": "fireworks",
            "name": "fw",
            "tis": {"cap": "2.0", "level": "token", "icepop_threshold": 2},
            "anchor_logp": "old_policy",
        }
    )
    assert head == FireworksTIS(cap=2.0, icepop_threshold=2.0, name="fw")
    pr = parse(
        {
            "framework": "fireworks",
            "is_correction": {
                "eps_clip": 0.2,
                "eps_clip_high": 0.28,
                "tis_cap": 10,
                "tis_level": "sequence",
            },
        }
    )
    assert pr == FireworksISCorrection(tis_cap=10.0, tis_level="sequence", eps_clip_high=0.28)


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"tis": {"cap": -1.0}}, "tis.cap"),
        ({"tis": {"cap": "big"}}, "tis.cap"),
        ({"tis": {"cap": True}}, "tis.cap"),
        ({"tis": {"level": "geometric"}}, "tis.level"),
        ({"tis": {"icepop_threshold": 0.5}}, "tis.icepop_threshold"),
        ({"tis": {"level": "sequence", "icepop_threshold": 2.0}}, "tis.icepop_threshold"),
        ({"tis": {"caps": 2.0}}, "tis.caps"),
        ({"tis": 5.0}, "tis"),
        ({"anchor_logp": "inference"}, "anchor_logp"),
        ({"anchor": "rollout"}, "anchor"),
        ({"is_correction": {"tis_cap": -0.1}}, "is_correction.tis_cap"),
        ({"is_correction": {"tis_level": "geometric"}}, "is_correction.tis_level"),
        ({"is_correction": {"eps_clip": "wide"}}, "is_correction.eps_clip"),
        ({"is_correction": {"eps_clip_high": [0.3]}}, "is_correction.eps_clip_high"),
        ({"is_correction": {"cap": 5.0}}, "is_correction.cap"),
        ({"is_correction": {}, "tis": {"cap": 2.0}}, "tis"),
        ({"is_correction": {}, "anchor_logp": "rollout"}, "anchor_logp"),
        ({"is_correction": {}, "eps_clip": 0.2}, "eps_clip"),
    ],
)
def test_invalid_config_raises_naming_the_key(config, named):
    with pytest.raises(ConfigError, match=f"`{named}"):
        parse({"framework": "fireworks", **config})


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"cap": float("nan")}, "tis.cap"),
        ({"icepop_threshold": 0.99}, "tis.icepop_threshold"),
        ({"anchor_logp": "prox"}, "anchor_logp"),
    ],
)
def test_spec_validation_names_the_key(kwargs, named):
    with pytest.raises(ConfigError, match=named):
        FireworksTIS(**kwargs)


def test_presets_and_end_to_end_dispatch(edges):
    assert PRESETS["fireworks_deepmath"].cap == 2.0
    config = {"framework": "fireworks", "tis": {"cap": 2.0, "icepop_threshold": 2.0}}
    via_dispatch = iscore.replay(edges, config)
    direct = FireworksTIS(cap=2.0, icepop_threshold=2.0).replay(edges)
    assert torch.equal(via_dispatch.weight, direct.weight)
    assert frameworks.get("fireworks") is fireworks.FRAMEWORK


# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: IcePop, and the sequence level of both forms.
EXTRA_SPECS = {
    "token-icepop": FireworksTIS(cap=2.0, icepop_threshold=1.5),
    "sequence": FireworksTIS(level="sequence"),
    "pr169-sequence": FireworksISCorrection(tis_level="sequence"),
}
