"""OpenRLHF: replay vs a float64 reference written from `PolicyLoss.forward`; flag parsing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import iscore
from iscore import frameworks
from iscore.advice.conversion import snippet
from iscore.errors import ConfigError
from iscore.frameworks import openrlhf
from iscore.frameworks.openrlhf import PRESETS, OpenRLHFCorrection, parse
from iscore.packed.batch import TokenBatch
from tests.unit.frameworks.conftest import make_batch, sequences

NEW = "--algo.advantage.is_correction"


def reference(
    batch: TokenBatch, kind: str, lower: float | None, upper: float, version: str | None = None
):
    """Per token (weight, raw) and per sequence (seq_raw, seq_keep), one sequence at a time;
    `version` "pr1298" clamps seq-mask-tis's token weights into [lower, upper] (PR #1298)."""
    weight, raw, seq_raw, seq_keep = [], [], [], []
    lo = -np.inf if lower is None else lower
    for rollout, train, _, mask in sequences(batch):
        d = train - rollout
        rho = np.exp(d)
        if kind == "tis":
            w = np.minimum(np.maximum(rho, lo), upper)
        elif kind == "icepop":
            w = np.where((rho >= lo) & (rho <= upper), rho, 0.0)
        else:
            g = d[mask].mean() if mask.any() else 0.0
            seq_raw.append(np.exp(g))
            seq_keep.append(lo <= np.exp(g) <= upper)
            token = np.minimum(np.maximum(rho, lo), upper) if version == "pr1298" else rho
            # A rejected sequence's weights are 0 (main's inf * 0 is NaN; see below).
            w = np.where(seq_keep[-1], token, 0.0)
        weight.append(np.where(mask, w, 0.0))
        raw.append(rho)
    return np.concatenate(weight), np.concatenate(raw), np.array(seq_raw), np.array(seq_keep)


def reference_of(spec: OpenRLHFCorrection, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness; the correction
    turned off (or GSPO's) is hand-checked below."""
    assert spec.enable and spec.policy_loss_type != "gspo", "not modelled by `reference`"
    weight, raw, _, _ = reference(batch, spec.type, spec.lower, spec.upper, spec.version)
    return weight, batch.loss_mask.numpy(), raw


def check(batch: TokenBatch, spec: OpenRLHFCorrection) -> None:
    result = spec.replay(batch)
    weight, raw, seq_raw, seq_keep = reference(
        batch, spec.type, spec.lower, spec.upper, spec.version
    )
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=0)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=0)
    assert torch.equal(result.keep, batch.loss_mask)
    if spec.type == "seq-mask-tis":
        np.testing.assert_allclose(result.seq_raw.numpy(), seq_raw, rtol=1e-6, atol=0)
        np.testing.assert_array_equal(result.seq_weight.numpy(), seq_keep.astype(np.float32))
    else:
        assert result.seq_raw is None and result.seq_weight is None


SETTINGS = [
    pytest.param(kind, lower, upper, id=f"{kind}-{lower}-{upper}")
    for kind in ("tis", "icepop", "seq-mask-tis")
    for lower, upper in [(0.5, 5.0), (1.0, 2.0), (0.5, 1.0), (0.999, 1.002), (0.0, 2.0), (1.0, 1.0)]
] + [pytest.param("tis", None, 2.0, id="tis-legacy-single-value")]


@pytest.mark.parametrize(("kind", "lower", "upper"), SETTINGS)
def test_replay_matches_reference(random_batch, edges, kind, lower, upper):
    spec = OpenRLHFCorrection(enable=True, type=kind, lower=lower, upper=upper)
    check(random_batch, spec)
    check(edges, spec)


@pytest.mark.parametrize(("kind", "lower", "upper"), SETTINGS[:-1])
def test_pr1298_matches_reference(random_batch, edges, kind, lower, upper):
    """PR #1298 changes seq-mask-tis only; the other types replay as on main."""
    spec = OpenRLHFCorrection(enable=True, type=kind, lower=lower, upper=upper, version="pr1298")
    check(random_batch, spec)
    check(edges, spec)
    main = OpenRLHFCorrection(enable=True, type=kind, lower=lower, upper=upper).replay(edges)
    if kind != "seq-mask-tis":
        assert torch.equal(spec.replay(edges).weight, main.weight)


def test_pr1298_clamps_kept_tokens_with_the_gate_bounds():
    # The PR's own test: d = [ln 10, -ln 10], G = 0 passes [0.5, 5]; the token weights
    # [10, 0.1] are clamped to [5, 0.5] (main keeps them raw).
    ln10 = float(np.log(10.0))
    batch = TokenBatch(
        rollout=torch.tensor([-0.1 - ln10, -0.1]),
        train=torch.tensor([-0.1, -0.1 - ln10]),
        cu_seqlens=torch.tensor([0, 2]),
    )
    args = f"{NEW}_enable {NEW}_type seq-mask-tis"
    pr = parse({"framework": "openrlhf", "version": "pr1298", "args": args})
    assert pr.replay(batch).weight.tolist() == pytest.approx([5.0, 0.5], rel=1e-6)
    main = parse({"framework": "openrlhf", "args": args})
    assert main.replay(batch).weight.tolist() == pytest.approx([10.0, 0.1], rel=1e-5)


def test_pr1298_overflowing_ratios_stay_finite():
    """A ratio past float32 (d = 100): in a rejected sequence main's inf * 0 is NaN in
    OpenRLHF (iscore writes 0), the PR's clamped weight times 0 is 0; in a kept sequence
    (G = 0) main's weight is inf, the PR's the upper bound."""
    batch = TokenBatch(
        rollout=torch.tensor([-100.0, -100.0, -1.0]),
        train=torch.tensor([0.0, 0.0, -101.0]),
        cu_seqlens=torch.tensor([0, 1, 3]),
    )
    with np.errstate(over="ignore"):
        assert np.isinf(np.exp(np.float32(100.0)))
    spec = OpenRLHFCorrection(enable=True, type="seq-mask-tis", version="pr1298")
    result = spec.replay(batch)
    assert result.seq_weight.tolist() == [0.0, 1.0]
    assert result.weight.tolist() == [0.0, 5.0, 0.5]
    main = OpenRLHFCorrection(enable=True, type="seq-mask-tis").replay(batch)
    assert main.weight[0] == 0.0 and torch.isinf(main.weight[1])


def test_pr1298_version_in_config_and_snippet():
    spec = PRESETS["openrlhf_seq_mask_tis_pr1298"]
    config = spec.to_config()
    assert config["version"] == "pr1298" and parse(config) == spec
    assert "version" not in OpenRLHFCorrection(enable=True).to_config()
    text = snippet(spec)
    assert text.startswith("# needs OpenRLHF PR #1298 (open, head 0d7490c2)")
    assert "version" not in text  # iscore's key, not a flag
    assert openrlhf.FRAMEWORK.upstream_of(spec) == (
        "OpenRLHF/OpenRLHF@0d7490c2 (2026-08-08), open PR #1298"
    )


def test_pr1298_is_the_exact_export_of_a_clamped_gate():
    spec = OpenRLHFCorrection(
        enable=True, type="seq-mask-tis", lower=0.999, upper=1.002, version="pr1298"
    )
    back, notes = openrlhf.FRAMEWORK.closest(openrlhf.to_canonical(spec), "x")
    assert back.version == "pr1298" and (back.lower, back.upper) == (0.999, 1.002)
    assert notes == ("Needs OpenRLHF's open PR #1298 (head 0d7490c2): `version: pr1298`.",)
    main = OpenRLHFCorrection(enable=True, type="seq-mask-tis", lower=0.999, upper=1.002)
    assert openrlhf.FRAMEWORK.closest(openrlhf.to_canonical(main), "x")[0] == main.__class__(
        enable=True, type="seq-mask-tis", lower=0.999, upper=1.002, name="x"
    )


@pytest.mark.parametrize(
    ("config", "message"),
    [
        (
            {"version": "pr1299"},
            "Expected `version` to be null (the pinned release) or one of pr1298",
        ),
        (
            {"version": "pr1298", "args": "--enable_vllm_is_correction"},
            "--enable_vllm_is_correction (OpenRLHF before 2026-04-19) do not exist at version "
            "pr1298",
        ),
    ],
)
def test_pr1298_refusals(config, message):
    with pytest.raises(ConfigError) as info:
        parse({"framework": "openrlhf", **config})
    assert message in str(info.value)
    with pytest.raises(ConfigError, match=r"LOW of .* to be a number at version pr1298"):
        OpenRLHFCorrection(enable=True, lower=None, upper=2.0, version="pr1298")
    with pytest.raises(ConfigError, match="`version`"):
        OpenRLHFCorrection(version="main")


def test_default_tis_is_two_sided_and_lifts_small_ratios():
    batch = TokenBatch(
        rollout=torch.tensor([-1.0, -1.0, -1.0, -1.0]),
        train=torch.tensor([-3.0, 1.0, -0.9, -1.0]),
        cu_seqlens=torch.tensor([0, 4]),
    )
    spec = parse({"framework": "openrlhf", "args": f"{NEW}_enable"})
    assert (spec.type, spec.lower, spec.upper) == ("tis", 0.5, 5.0)
    result = spec.replay(batch)
    # e^-2 = 0.135 is lifted to 0.5 (verl / SkyRL would keep 0.135); e^2 = 7.39 is cut to 5.
    expected = [0.5, 5.0, float(np.float32(np.exp(0.1))), 1.0]
    assert result.weight.tolist() == pytest.approx(expected, rel=1e-6)


def test_icepop_keeps_the_raw_ratio_inside_the_band():
    batch = TokenBatch(
        rollout=torch.tensor([-1.0, -1.0, -1.0]),
        train=torch.tensor([-3.0, 1.0, 0.0]),
        cu_seqlens=torch.tensor([0, 3]),
    )
    spec = OpenRLHFCorrection(enable=True, type="icepop")
    assert spec.replay(batch).weight.tolist() == pytest.approx([0.0, 0.0, np.e], rel=1e-6)


def test_seq_mask_tis_default_thresholds_mask_almost_nothing():
    batch = make_batch([50] * 20, seed=7, sigma=0.1)
    d = (batch.train.double() - batch.rollout.double()).numpy()
    rho = np.where(batch.loss_mask.numpy(), np.exp(d), 0.0)
    loose = OpenRLHFCorrection(enable=True, type="seq-mask-tis").replay(batch)
    # [0.5, 5] on a geometric mean: every sequence kept, raw untruncated token weights.
    assert loose.seq_weight.tolist() == [1.0] * 20
    np.testing.assert_allclose(loose.weight.numpy(), rho, rtol=1e-6)
    assert loose.weight.max() > 1.2  # no token-level clamp, despite the code comment
    tight = OpenRLHFCorrection(enable=True, type="seq-mask-tis", lower=0.999, upper=1.002)
    assert tight.replay(batch).seq_weight.sum() < 20


@pytest.mark.parametrize(
    "args",
    [
        "",
        f"{NEW}_type icepop",  # a type without the enable flag does nothing
        f"{NEW}_enable --actor.policy_loss_type gspo",
        "--enable_vllm_is_correction --policy_loss_type gspo",
    ],
)
def test_no_weight_when_disabled_or_gspo(edges, args):
    result = parse({"framework": "openrlhf", "args": args}).replay(edges)
    assert torch.equal(result.keep, edges.loss_mask)
    assert torch.equal(result.weight, edges.loss_mask.float())
    assert torch.equal(result.raw, torch.ones(edges.num_tokens))


LAUNCH = f"""ray job submit --address="http://127.0.0.1:8265" \\
   -- python3 -m openrlhf.cli.train_ppo_ray \\
   --actor.model_name_or_path Qwen/Qwen3-8B \\
   --algo.kl.use_loss \\
   --algo.kl.estimator k2 \\
   {NEW}_enable \\
   {NEW}_threshold 0.999 1.002 \\
   {NEW}_type seq-mask-tis \\
   --actor.policy_loss_type ppo \\
   --train.max_tokens_per_gpu 32768
"""


def test_parse_pasted_launch_command_collects_unrelated_flags():
    spec = parse({"framework": "openrlhf", "name": "prorl", "args": LAUNCH})
    assert spec == OpenRLHFCorrection(
        enable=True,
        type="seq-mask-tis",
        lower=0.999,
        upper=1.002,
        policy_loss_type="ppo",
        ignored_flags=spec.ignored_flags,
        name="prorl",
    )
    assert spec.ignored_flags == (
        "ray",
        "job",
        "submit",
        "--address=http://127.0.0.1:8265",
        "python3",
        "-m",
        "openrlhf.cli.train_ppo_ray",
        "--actor.model_name_or_path",
        "Qwen/Qwen3-8B",
        "--algo.kl.use_loss",
        "--algo.kl.estimator",
        "k2",
        "--train.max_tokens_per_gpu",
        "32768",
    )


def test_parse_list_of_flags_and_equals_syntax():
    spec = parse(
        {
            "framework": "openrlhf",
            "args": [f"{NEW}_enable", f"{NEW}_type=icepop", f"{NEW}_threshold", "0.2", "5"],
        }
    )
    assert (spec.enable, spec.type, spec.lower, spec.upper) == (True, "icepop", 0.2, 5.0)


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (
            "--enable_vllm_is_correction --vllm_is_truncated_threshold 0.5 2 "
            "--vllm_is_correction_type icepop --policy_loss_type ppo",
            OpenRLHFCorrection(enable=True, type="icepop", lower=0.5, upper=2.0),
        ),
        (
            "--enable_vllm_is_correction --use_icepop",  # 2025-12 .. 2026-02
            OpenRLHFCorrection(enable=True, type="icepop"),
        ),
        (
            "--enable_vllm_is_correction --vllm_is_truncated_threshold 2",  # 2025-08 .. 2025-12
            OpenRLHFCorrection(enable=True, type="tis", lower=None, upper=2.0),
        ),
        ("--enable_vllm_is_correction", OpenRLHFCorrection(enable=True)),
    ],
)
def test_parse_pre_2026_04_flag_names(args, expected):
    assert parse({"framework": "openrlhf", "args": args}) == expected


def test_legacy_single_threshold_has_no_lower_bound():
    batch = TokenBatch(
        rollout=torch.tensor([-1.0, -1.0]),
        train=torch.tensor([-4.0, 1.0]),
        cu_seqlens=torch.tensor([0, 2]),
    )
    spec = parse(
        {
            "framework": "openrlhf",
            "args": "--enable_vllm_is_correction --vllm_is_truncated_threshold 2",
        }
    )
    assert spec.replay(batch).weight.tolist() == pytest.approx([np.exp(-3.0), 2.0], rel=1e-6)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (f"{NEW}_enable --vllm_is_correction_type icepop", "--vllm_is_correction_type"),
        (f"--enable_vllm_is_correction {NEW}_threshold 0.5 2", f"{NEW}_threshold"),
        ("--enable_vllm_is_correction --actor.policy_loss_type gspo", "--actor.policy_loss_type"),
        (f"{NEW}_type mis", f"{NEW}_type"),
        (f"{NEW}_type", f"{NEW}_type"),
        (f"{NEW}_threshold 0.5", f"{NEW}_threshold"),
        (f"{NEW}_threshold 0.5 abc", f"{NEW}_threshold"),
        (f"{NEW}_threshold nan 5", f"{NEW}_threshold"),
        (f"{NEW}_enable=true", f"{NEW}_enable"),
        (f"{NEW}_enabled", f"{NEW}_enabled"),  # a typo must not be silently ignored
        ("--vllm_is_threshold 0.5 5", "--vllm_is_threshold"),
        ("--actor.policy_loss_type reinforce", "--actor.policy_loss_type"),
        ("--use_icepop --vllm_is_correction_type tis", "--use_icepop"),
        (
            "--vllm_is_truncated_threshold 2 --vllm_is_correction_type icepop",
            "--vllm_is_truncated_threshold",
        ),
        ("--vllm_is_truncated_threshold 1 2 3", "--vllm_is_truncated_threshold"),
        ("--vllm_is_truncated_threshold", "--vllm_is_truncated_threshold"),
    ],
)
def test_invalid_flags_raise_naming_the_flag(args, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        parse({"framework": "openrlhf", "args": args})


@pytest.mark.parametrize(
    ("config", "named"),
    [
        ({"framework": "openrlhf", "argz": f"{NEW}_enable"}, "argz"),
        ({"framework": "openrlhf", "args": 3}, "args"),
        ({"framework": "openrlhf", "args": ["--x", 1]}, "args"),
        ({"framework": "openrlhf", "name": 3}, "name"),
    ],
)
def test_invalid_config_raises_naming_the_key(config, named):
    with pytest.raises(ConfigError, match=f"`{named}`"):
        parse(config)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"type": "mis"}, f"{NEW}_type"),
        ({"policy_loss_type": "reinforce"}, "--actor.policy_loss_type"),
        ({"enable": 1}, f"{NEW}_enable"),
        ({"lower": float("nan")}, f"{NEW}_threshold"),
        ({"upper": None}, f"{NEW}_threshold"),
        ({"upper": "5"}, f"{NEW}_threshold"),
    ],
)
def test_spec_validation_names_the_flag(kwargs, named):
    with pytest.raises(ConfigError, match=named.replace(".", r"\.")):
        OpenRLHFCorrection(**kwargs)


# OpenRLHF checks none of these: a negative LOW, a HIGH <= 0, or LOW above HIGH.
BAD_THRESHOLDS = [
    (f"{NEW}_enable {NEW}_threshold -0.5 -2",
     f"Expected LOW of `{NEW}_threshold` to be a float >= 0.0, but got -0.5"),
    (f"{NEW}_enable {NEW}_threshold 0.5 -2",
     f"Expected HIGH of `{NEW}_threshold` to be a float > 0.0, but got -2.0"),
    (f"{NEW}_enable {NEW}_threshold 0 0",
     f"Expected HIGH of `{NEW}_threshold` to be a float > 0.0, but got 0.0"),
    (f"{NEW}_enable {NEW}_threshold 2.0 0.5",
     f"Expected LOW of `{NEW}_threshold` <= HIGH (0.5), but got 2.0"),
    (f"{NEW}_threshold 2.0 0.5", f"Expected LOW of `{NEW}_threshold` <= HIGH"),  # even when off
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold -1",
     "Expected HIGH of `--vllm_is_truncated_threshold` to be a float > 0.0, but got -1.0"),
    ("--enable_vllm_is_correction --vllm_is_truncated_threshold 2 0.5",
     "Expected LOW of `--vllm_is_truncated_threshold` <= HIGH (0.5), but got 2.0"),
]  # fmt: skip


@pytest.mark.parametrize(("args", "message"), BAD_THRESHOLDS)
def test_senseless_thresholds_are_refused_naming_the_flag_given(args, message):
    with pytest.raises(ConfigError) as info:
        parse({"framework": "openrlhf", "args": args})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lower": -0.1}, "LOW of `--algo.advantage.is_correction_threshold` to be a float >= 0.0"),
        ({"upper": 0.0}, "HIGH of `--algo.advantage.is_correction_threshold` to be a float > 0.0"),
        ({"lower": None, "upper": -2.0}, "HIGH of `--algo.advantage.is_correction_threshold`"),
        ({"lower": 2.0, "upper": 1.0}, "LOW of `--algo.advantage.is_correction_threshold` <= HIGH"),
    ],
)
def test_spec_validation_refuses_senseless_thresholds(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        OpenRLHFCorrection(**kwargs)


@pytest.mark.parametrize(("lower", "upper"), [(0.0, 2.0), (1.0, 1.0)])
def test_zero_low_and_equal_thresholds_replay(edges, lower, upper):
    args = f"{NEW}_enable {NEW}_type icepop {NEW}_threshold {lower} {upper}"
    spec = parse({"framework": "openrlhf", "args": args})
    assert (spec.lower, spec.upper) == (lower, upper)
    check(edges, spec)


def test_presets_and_end_to_end_dispatch(edges):
    assert PRESETS["openrlhf_tis"] == OpenRLHFCorrection(enable=True, name="openrlhf_tis")
    config = {"framework": "openrlhf", "args": f"{NEW}_enable {NEW}_type icepop"}
    via_dispatch = iscore.replay(edges, config)
    direct = OpenRLHFCorrection(enable=True, type="icepop").replay(edges)
    assert torch.equal(via_dispatch.weight, direct.weight)
    assert frameworks.get("openrlhf") is openrlhf.FRAMEWORK


# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: every type with a band that bites.
EXTRA_SPECS = {
    f"{kind}-0.9-1.1": OpenRLHFCorrection(enable=True, type=kind, lower=0.9, upper=1.1)
    for kind in ("tis", "icepop", "seq-mask-tis")
} | {
    "seq-mask-tis-0.9-1.1-pr1298": OpenRLHFCorrection(
        enable=True, type="seq-mask-tis", lower=0.9, upper=1.1, version="pr1298"
    )
}
