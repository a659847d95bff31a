"""slime's TIS hooks against an independent float64 reference, plus its config traps."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
import yaml

from iscore.errors import ConfigError
from iscore.frameworks import slime
from iscore.frameworks.resolve import parse_config
from iscore.packed.batch import TokenBatch
from iscore.passes.replay import replay
from tests.unit.frameworks.conftest import make_batch, sequences

ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"
VANILLA = "slime.backends.megatron_utils.loss.vanilla_tis_function"
MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
OFF_POLICY = "slime.utils.ppo_utils.off_policy_is_function"


def cfg(args: str = "", custom: dict | None = None) -> dict:
    out = {"framework": "slime", "args": args}
    if custom is not None:
        out["custom_config"] = custom
    return out


def mis_cfg(**custom) -> dict:
    """A mis.py setting: --use-tis with the YAML given as keyword arguments."""
    full = {"use_rs": False, "tis_batch_normalize": False, **custom}
    return cfg(f"--use-tis --custom-tis-function-path {MIS} --custom-config-path mis.yaml", full)


def token_batch(ds, masks=None, lengths=None, rollout=-1.0) -> TokenBatch:
    """A batch with given log-ratios d (train = rollout + d), in float32."""
    ds = np.asarray(ds, dtype=np.float64)
    lengths = lengths or [len(ds)]
    r = np.full(len(ds), rollout, dtype=np.float32)
    t = (r.astype(np.float64) + ds).astype(np.float32)
    return TokenBatch(
        rollout=torch.from_numpy(r),
        train=torch.from_numpy(t),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
        loss_mask=None if masks is None else torch.tensor(masks),
    )


# ---------------------------------------------------------------- references (float64 numpy)


def ref_simple(batch: TokenBatch, function: str, low: float, high: float, numerator="train"):
    """vanilla / icepop / off_policy_is, one sequence at a time."""
    weights, keeps, raws = [], [], []
    for rollout, train, policy, mask in sequences(batch):
        top = policy if numerator == "policy" else train
        rho = np.exp(top - rollout)
        if function == "icepop":
            w = np.where((rho >= low) & (rho <= high), rho, 0.0)
        else:
            w = np.minimum(np.maximum(rho, low), high)  # torch's clamp order when low > high
        weights.append(np.where(mask, w, 0.0))
        keeps.append(mask)
        raws.append(rho)
    return np.concatenate(weights), np.concatenate(keeps), np.concatenate(raws)


def level_log_ratio(d: np.ndarray, m: np.ndarray, level: str) -> np.ndarray:
    """d per token, or the masked sum (sequence) / mean (geometric) broadcast."""
    if level == "token":
        return d
    total = float(np.sum(d * m))
    if level == "sequence":
        return np.full_like(d, total)
    return np.full_like(d, total / max(m.sum(), 1.0))


def ref_mis(batch: TokenBatch, c: dict):
    """mis.py's compute_mis_weights with use_tis on, from its formulas."""
    upper = c["tis_upper_bound"]
    lower = c.get("tis_lower_bound") if c.get("tis_lower_bound") is not None else 1.0 / upper
    rs_lower = c.get("rs_lower_bound") if c.get("rs_lower_bound") is not None else lower
    rs_upper = c.get("rs_upper_bound") if c.get("rs_upper_bound") is not None else upper
    per_seq = []
    for rollout, train, _, mask in sequences(batch):
        d = train - rollout
        m = mask.astype(np.float64)

        raw = np.exp(np.clip(level_log_ratio(d, m, c["tis_level"]), -20.0, 20.0))
        keep = mask.copy()
        if c["tis_mode"] == "truncate":
            w = np.clip(raw, 0.0, upper)
        elif c["tis_mode"] == "clip":
            w = np.clip(raw, lower, upper)
        else:
            w = raw.copy()
            keep &= (raw >= lower) & (raw <= upper)
        if c.get("use_rs"):
            rs = np.exp(np.clip(level_log_ratio(d, m, c["rs_level"]), -20.0, 20.0))
            keep &= (rs >= rs_lower) & (rs <= rs_upper)
            veto = c.get("rs_veto_threshold")
            if veto is not None and np.any((d < np.log(np.float32(veto))) & mask):
                keep[:] = False
        per_seq.append((w, keep, raw, m))
    if c.get("tis_batch_normalize"):
        if c["tis_level"] == "token":
            mean = sum(np.sum(w * m) for w, _, _, m in per_seq) / max(
                sum(m.sum() for *_, m in per_seq), 1.0
            )
        else:
            means = [np.sum(w * m) / max(m.sum(), 1.0) for w, _, _, m in per_seq]
            mean = sum(means) / len(means)
        if mean > 1e-8:
            per_seq = [(w / mean, k, r, m) for w, k, r, m in per_seq]
    weight = np.concatenate([np.where(k, w, 0.0) for w, k, _, _ in per_seq])
    keep = np.concatenate([k for _, k, _, _ in per_seq])
    raw = np.concatenate([r for _, _, r, _ in per_seq])
    return weight, keep, raw


def reference_of(spec: slime.SlimeCorrection, batch: TokenBatch):
    """(weight, keep, raw) of `ref_simple` or `ref_mis` for `spec`, for the registry's harness.

    Only settings whose TIS function weights the loss from the recomputed log-probs (or, for
    off_policy_is, the current policy's); the metrics-only and bypass paths are hand-checked
    below.
    """
    assert spec.use_tis and not spec.use_rollout_logprobs, "not modelled by ref_simple/ref_mis"
    if spec.tis_function == "mis":
        return ref_mis(batch, dataclasses.asdict(spec.mis))
    function = "icepop" if spec.tis_function == "icepop" else "vanilla"
    numerator = "policy" if spec.tis_function == "off_policy_is" else "train"
    return ref_simple(batch, function, spec.tis_clip_low, spec.tis_clip, numerator)


def check(result, weight, keep, raw):
    np.testing.assert_array_equal(result.keep.numpy(), keep)
    np.testing.assert_allclose(result.weight.numpy(), weight, rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(result.raw.numpy(), raw, rtol=1e-6, atol=1e-30)


# ---------------------------------------------------------------- replay vs reference

SIMPLE_CASES = [
    ("--use-tis", "vanilla", 0.0, 2.0),
    ("--use-tis --tis-clip-low 0.5 --tis-clip 3", "vanilla", 0.5, 3.0),
    (f"--use-tis --custom-tis-function-path {ICEPOP} --tis-clip-low 0.5", "icepop", 0.5, 2.0),
    # d = 0 gives a ratio of exactly 1.0: the inclusive lower bound keeps it.
    (f"--use-tis --custom-tis-function-path {ICEPOP} --tis-clip-low 1", "icepop", 1.0, 2.0),
    # Equal bounds are accepted: a constant weight.
    ("--use-tis --tis-clip-low 1.5 --tis-clip 1.5", "vanilla", 1.5, 1.5),
    (f"--use-tis --custom-tis-function-path {ICEPOP} --tis-clip 1", "icepop", 0.0, 1.0),
    (f"--get-mismatch-metrics --custom-tis-function-path {VANILLA}", "vanilla", 0.0, 2.0),
]


@pytest.mark.parametrize(("args", "function", "low", "high"), SIMPLE_CASES)
def test_simple_functions_match_reference(random_batch, edges, args, function, low, high):
    for batch in (random_batch, edges):
        check(replay(batch, cfg(args)), *ref_simple(batch, function, low, high))


def test_off_policy_is_uses_the_current_policy(random_batch, edges):
    for batch in (random_batch, edges):
        result = replay(batch, cfg(f"--use-tis --custom-tis-function-path {OFF_POLICY}"))
        check(result, *ref_simple(batch, "vanilla", 0.0, 2.0, numerator="policy"))


MIS_CASES = [
    *(
        {"tis_level": level, "tis_mode": mode, "tis_lower_bound": lo, "tis_upper_bound": hi}
        for level, lo, hi in (
            ("token", 0.5, 2.0),
            ("sequence", None, 5.0),
            ("geometric", 0.98, 1.02),
        )
        for mode in ("truncate", "clip", "mask")
    ),
    # Bounds of exactly 1.0 are hit by d = 0.
    {"tis_level": "token", "tis_mode": "mask", "tis_lower_bound": 1.0, "tis_upper_bound": 2.0},
    {"tis_level": "geometric", "tis_mode": "clip", "tis_lower_bound": 1.0, "tis_upper_bound": 1.5},
    *(
        {
            "tis_level": "token",
            "tis_mode": "truncate",
            "tis_upper_bound": 2.0,
            "use_rs": True,
            "rs_level": rs_level,
            "rs_lower_bound": rs_lo,
            "rs_upper_bound": rs_hi,
            "rs_veto_threshold": veto,
        }
        for rs_level, rs_lo, rs_hi in (
            ("token", None, None),
            ("sequence", 0.2, 5.0),
            ("geometric", 0.99, 1.01),
        )
        for veto in (None, 1e-4)
    ),
    {"tis_level": "sequence", "tis_mode": "mask", "tis_upper_bound": 3.0, "use_rs": True,
     "rs_level": "geometric", "rs_lower_bound": 0.98, "rs_upper_bound": 1.02,
     "rs_veto_threshold": 0.5},
    *(
        {"tis_level": level, "tis_mode": mode, "tis_lower_bound": 0.5, "tis_upper_bound": 2.0,
         "tis_batch_normalize": True}
        for level in ("token", "sequence")
        for mode in ("truncate", "clip", "mask")
    ),
    {"tis_level": "token", "tis_mode": "mask", "tis_upper_bound": 1.5, "use_rs": True,
     "rs_level": "token", "rs_veto_threshold": 1e-4, "tis_batch_normalize": True},
]  # fmt: skip


@pytest.mark.parametrize("custom", MIS_CASES, ids=lambda c: "-".join(map(str, c.values())))
def test_mis_matches_reference(random_batch, edges, custom):
    for batch in (random_batch, edges):
        result = replay(batch, mis_cfg(**custom))
        check(result, *ref_mis(batch, {"use_rs": False, **custom}))
        if custom["tis_level"] == "token":
            assert result.seq_raw is None and result.seq_weight is None
        else:
            # The sequence ratio broadcast to every token, and the applied sequence weight.
            starts = batch.cu_seqlens[:-1]
            nonempty = batch.lengths > 0
            np.testing.assert_array_equal(
                result.seq_raw[nonempty].numpy(), result.raw[starts[nonempty]].numpy()
            )
            assert result.seq_weight.shape == (batch.num_sequences,)


# ---------------------------------------------------------------- hand-computed traps


def test_get_mismatch_metrics_applies_icepop_and_vanilla_without_use_tis():
    # d = ln 3, 0.1, ln 0.25: icepop [0.5, 2] zeroes the first and last tokens.
    batch = token_batch([math.log(3.0), 0.1, math.log(0.25)])
    args = f"--get-mismatch-metrics --custom-tis-function-path {ICEPOP} --tis-clip-low 0.5"
    weight = replay(batch, cfg(args)).weight.tolist()
    assert weight == pytest.approx([0.0, math.exp(0.1), 0.0], rel=1e-6)
    args = f"--get-mismatch-metrics --custom-tis-function-path {VANILLA}"
    weight = replay(batch, cfg(args)).weight.tolist()
    assert weight == pytest.approx([2.0, math.exp(0.1), 0.25], rel=1e-6)
    # Neither flag: the TIS function is never called.
    assert replay(batch, cfg("--tis-clip 1.5")).weight.tolist() == [1.0, 1.0, 1.0]


def test_get_mismatch_metrics_with_mis_leaves_the_loss_alone():
    batch = token_batch([math.log(3.0), 0.1, math.log(0.25)])
    args = f"--get-mismatch-metrics --custom-tis-function-path {MIS} --custom-config-path m.yaml"
    custom = {"use_tis": False, "use_rs": True, "tis_upper_bound": 2.0}
    result = replay(batch, cfg(args, custom))
    assert result.weight.tolist() == [1.0, 1.0, 1.0]
    assert result.keep.tolist() == [True, True, True]
    # The same YAML with use_tis on weights the loss (truncate at 2, RS drops rho outside [0.5, 2]).
    custom.update(use_tis=True, tis_level="token", tis_mode="truncate", rs_level="token",
                  tis_batch_normalize=False)  # fmt: skip
    result = replay(batch, cfg(args, custom))
    assert result.keep.tolist() == [False, True, False]
    assert result.weight.tolist() == pytest.approx([0.0, math.exp(0.1), 0.0], rel=1e-6)


def test_yaml_use_tis_overrides_the_flag():
    batch = token_batch([1.0, -1.0])
    off = replay(batch, cfg("--use-tis --custom-config-path c.yaml", {"use_tis": False}))
    assert off.weight.tolist() == [1.0, 1.0]
    on = replay(batch, cfg("--custom-config-path c.yaml", {"use_tis": True, "tis_clip": 1.5}))
    assert on.weight.tolist() == pytest.approx([1.5, math.exp(-1.0)], rel=1e-6)


def test_vanilla_has_no_safety_clamp_but_mis_does():
    batch = token_batch([30.0], rollout=-31.0)
    vanilla = replay(batch, cfg("--use-tis --tis-clip 1e20")).weight.item()
    assert vanilla == pytest.approx(math.exp(30.0), rel=1e-6)
    mis = replay(batch, mis_cfg(tis_level="token", tis_mode="truncate", tis_upper_bound=1e20))
    assert mis.weight.item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_sequence_level_is_the_product_and_geometric_the_mean():
    batch = token_batch([math.log(2.0), math.log(2.0), 0.0])
    seq = replay(batch, mis_cfg(tis_level="sequence", tis_mode="truncate", tis_upper_bound=10.0))
    assert seq.seq_raw.item() == pytest.approx(4.0, rel=1e-6)
    geo = replay(batch, mis_cfg(tis_level="geometric", tis_mode="truncate", tis_upper_bound=10.0))
    assert geo.weight.tolist() == pytest.approx([4.0 ** (1 / 3)] * 3, rel=1e-6)


def test_veto_drops_the_whole_sequence_only_with_use_rs():
    # Sequence 0 has a token with ratio 1e-5 < 1e-4; sequence 1 hides one behind the mask.
    d = [0.0, math.log(1e-5), 0.1, 0.0, math.log(1e-5)]
    batch = token_batch(d, masks=[True, True, True, True, False], lengths=[3, 2])
    wide = {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 2.0,
            "rs_level": "token", "rs_lower_bound": 1e-9, "rs_upper_bound": 1e9}  # fmt: skip
    vetoed = replay(batch, mis_cfg(**wide, use_rs=True, rs_veto_threshold=1e-4))
    assert vetoed.keep.tolist() == [False, False, False, True, False]
    no_rs = replay(batch, mis_cfg(**wide, use_rs=False, rs_veto_threshold=1e-4))
    assert no_rs.keep.tolist() == [True, True, True, True, False]
    # A numeric string, as yaml.safe_load reads "1e-4", works like the number.
    as_string = replay(batch, mis_cfg(**wide, use_rs=True, rs_veto_threshold="1e-4"))
    assert as_string.keep.tolist() == vetoed.keep.tolist()


def test_token_batch_normalization_counts_rejected_tokens():
    # mask mode, [0.4, 2]: raw 4 is rejected but still enters the mean (4 + 1 + 0.5) / 3.
    batch = token_batch([math.log(4.0), 0.0, math.log(0.5)])
    c = {"tis_level": "token", "tis_mode": "mask", "tis_lower_bound": 0.4,
         "tis_upper_bound": 2.0, "tis_batch_normalize": True}  # fmt: skip
    result = replay(batch, mis_cfg(**c))
    mean = (4.0 + 1.0 + 0.5) / 3
    assert result.keep.tolist() == [False, True, True]
    assert result.weight.tolist() == pytest.approx([0.0, 1.0 / mean, 0.5 / mean], rel=1e-6)


def test_sequence_batch_normalization_counts_fully_masked_sequences_as_zero():
    # Sequence 0: S = ln 2, weight 2; sequence 1 fully masked: its mean weight 0 still counts,
    # so the batch mean is (2 + 0) / 2 = 1 and the weight stays 2.
    batch = token_batch([math.log(2.0), 0.3], masks=[True, False], lengths=[1, 1])
    c = {"tis_level": "sequence", "tis_mode": "truncate", "tis_upper_bound": 5.0,
         "tis_batch_normalize": True}  # fmt: skip
    result = replay(batch, mis_cfg(**c))
    assert result.weight.tolist() == pytest.approx([2.0, 0.0], rel=1e-6)
    assert result.seq_weight.tolist() == pytest.approx([2.0, math.exp(0.0)], rel=1e-6)


def test_batch_normalization_is_per_step():
    batch = token_batch([math.log(2.0), 0.0, math.log(0.5)], lengths=[1, 1, 1])
    batch = TokenBatch(
        rollout=batch.rollout,
        train=batch.train,
        cu_seqlens=batch.cu_seqlens,
        step=torch.tensor([0, 0, 1]),
    )
    c = {"tis_level": "token", "tis_mode": "truncate", "tis_upper_bound": 5.0,
         "tis_batch_normalize": True}  # fmt: skip
    result = replay(batch, mis_cfg(**c))
    assert result.weight.tolist() == pytest.approx([2.0 / 1.5, 1.0 / 1.5, 1.0], rel=1e-6)


def test_bypass_with_yaml_use_tis_weights_by_the_current_policy():
    batch = make_batch([5, 7], seed=3)
    args = "--use-rollout-logprobs --custom-config-path c.yaml"
    spec = slime.parse(cfg(args, {"use_tis": True}))
    assert spec.use_tis and spec.numerator == "policy"
    check(spec.replay(batch), *ref_simple(batch, "vanilla", 0.0, 2.0, numerator="policy"))
    # --get-mismatch-metrics forces the recompute, so the numerator is the trainer's again.
    args += f" --get-mismatch-metrics --custom-tis-function-path {VANILLA}"
    assert slime.parse(cfg(args, {"use_tis": True})).numerator == "train"


def test_bypass_alone_applies_no_weight():
    batch = make_batch([4, 6], seed=1, policy=False)
    result = replay(batch, cfg("--use-rollout-logprobs"))
    assert torch.equal(result.keep, batch.loss_mask)
    assert result.weight[batch.loss_mask].eq(1.0).all()


def test_current_policy_settings_need_the_policy_column():
    batch = make_batch([4, 6], seed=1, policy=False)
    with pytest.raises(ConfigError, match="policy_logprob"):
        replay(batch, cfg(f"--use-tis --custom-tis-function-path {OFF_POLICY}"))


# ---------------------------------------------------------------- config parsing

SCRIPT = r"""
   --hf-checkpoint /root/Qwen3-4B \
   --tensor-model-parallel-size 2 --sequence-parallel \
   # --load /root/Qwen3-4B_slime/
   --eval-prompt-data aime /root/aime-2024/aime-2024.jsonl \
   --advantage-estimator grpo --use-kl-loss --kl-loss-coef 0.00 --eps-clip 0.2 \
   --use-tis \
   --lr 1e-6 --adam-beta2 0.98 --kl-coef -0.1 \
   --custom-config-path examples/train_infer_mismatch_helper/mis.yaml \
   --custom-tis-function-path examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp
"""
MIS_YAML = """
use_tis: true
use_rs: true
tis_level: "token"
rs_level: "token"
tis_mode: "truncate"
tis_lower_bound: 0.5
tis_upper_bound: 2.0
rs_lower_bound: null
rs_upper_bound: null
rs_veto_threshold: 1.0e-4
tis_batch_normalize: true
"""


def test_a_pasted_launch_script_with_the_mis_yaml():
    spec = slime.parse(cfg(SCRIPT, yaml.safe_load(MIS_YAML)))
    assert spec.use_tis and spec.tis_function == "mis"
    assert spec.mis == slime.MisConfig(
        use_rs=True,
        tis_lower_bound=0.5,
        tis_upper_bound=2.0,
        rs_veto_threshold=1e-4,
        tis_batch_normalize=True,
    )
    assert spec.mis == slime.PRESETS["slime_mis_example"].mis
    assert spec.ignored_flags == (
        "--hf-checkpoint",
        "--tensor-model-parallel-size",
        "--sequence-parallel",
        "--eval-prompt-data",
        "--advantage-estimator",
        "--use-kl-loss",
        "--kl-loss-coef",
        "--eps-clip",
        "--lr",
        "--adam-beta2",
        "--kl-coef",
    )


def test_flags_as_a_list_and_defaults():
    spec = slime.parse(cfg(["--use-tis", "--tis-clip=3.5", "--micro-batch-size", "1"]))
    assert (spec.use_tis, spec.tis_clip, spec.tis_clip_low, spec.tis_function) == (
        True,
        3.5,
        0.0,
        "vanilla",
    )
    assert spec.ignored_flags == ("--micro-batch-size",)
    default = slime.parse({"framework": "slime"})
    assert not default.called and default.name == "slime"


def test_mis_keys_are_ignored_when_mis_is_not_the_function():
    spec = slime.parse(cfg("--use-tis --custom-config-path c.yaml", {"tis_mode": "bogus"}))
    assert spec.mis is None and spec.ignored_flags == ("custom_config.tis_mode",)


def test_an_unreadable_custom_config_path_warns():
    with pytest.warns(UserWarning, match="cannot read"):
        slime.parse(cfg("--use-tis --custom-config-path /somewhere/c.yaml"))


def test_yaml_use_tis_passes_slimes_bypass_check():
    spec = slime.parse(cfg("--use-rollout-logprobs --custom-config-path c.yaml", {"use_tis": True}))
    assert spec.use_tis and spec.use_rollout_logprobs


def mis_error(**custom):
    base = {"use_tis": True, "use_rs": False, "tis_level": "token", "tis_mode": "truncate",
            "tis_upper_bound": 2.0, "tis_batch_normalize": False}  # fmt: skip
    base.update(custom)
    return cfg(f"--custom-tis-function-path {MIS}", {k: v for k, v in base.items() if v != "DROP"})


ERRORS = [
    (cfg("--tis-mode mask"), "--tis-mode"),
    (cfg("--use-rs"), "--use-rs"),
    (cfg("--rs-veto-threshold 1e-4"), "--rs-veto-threshold"),
    (cfg("--use-rollout-correction"), "--use-rollout-correction"),
    (cfg("--tis-clip abc"), "--tis-clip"),
    (cfg("--use-tis true"), "true"),
    (cfg("--use-tis=1"), "--use-tis"),
    (cfg("--use-tis --use-rollout-logprobs"), "--use-rollout-logprobs"),
    (cfg("--get-mismatch-metrics"), "--custom-tis-function-path"),
    (cfg("--use-tis --custom-tis-function-path my.module.fn"), "--custom-tis-function-path"),
    (cfg("train.py --use-tis"), "train.py"),
    ({"framework": "slime", "args": 5}, "args"),
    ({"framework": "slime", "args": "", "flags": "--use-tis"}, "flags"),
    ({"framework": "slime", "name": 3}, "name"),
    (cfg("--use-tis", {"tis_clip": "x"}), "custom_config.tis_clip"),
    (cfg("--use-tis", {"use_tis": "yes"}), "custom_config.use_tis"),
    (cfg("--use-tis", {"use_rollout_logprobs": True}), "custom_config.use_rollout_logprobs"),
    ({"framework": "slime", "args": "--use-tis", "custom_config": [1]}, "custom_config"),
    (
        cfg(f"--use-tis --custom-tis-function-path {MIS} --custom-config-path m.yaml"),
        "custom_config",
    ),
    (mis_error(tis_levle="token"), "custom_config.tis_levle"),
    (mis_error(tis_level="DROP"), "custom_config.tis_level"),
    (mis_error(tis_mode="DROP"), "custom_config.tis_mode"),
    (mis_error(use_rs="DROP"), "custom_config.use_rs"),
    (mis_error(tis_batch_normalize="DROP"), "custom_config.tis_batch_normalize"),
    (mis_error(tis_upper_bound="DROP"), "custom_config.tis_upper_bound"),
    (mis_error(use_rs=True), "custom_config.rs_level"),
    (mis_error(tis_level="seq"), "custom_config.tis_level"),
    (mis_error(tis_mode="cap"), "custom_config.tis_mode"),
    (mis_error(tis_upper_bound="abc"), "custom_config.tis_upper_bound"),
    (mis_error(tis_upper_bound=0.0), "custom_config.tis_upper_bound"),
    (mis_error(tis_mode="clip", tis_lower_bound=2.0), "custom_config.tis_lower_bound"),
    (mis_error(tis_mode="mask", tis_upper_bound=0.5, tis_lower_bound=None),
     "custom_config.tis_lower_bound"),
    (mis_error(use_rs=True, rs_level="token", rs_lower_bound=3.0), "custom_config.rs_lower_bound"),
    (mis_error(tis_level="geometric", tis_batch_normalize=True),
     "custom_config.tis_batch_normalize"),
    (mis_error(use_rs=True, rs_level="token", rs_veto_threshold=0.0),
     "custom_config.rs_veto_threshold"),
    (mis_error(use_rs=None), "custom_config.use_rs"),
]  # fmt: skip

# slime checks none of these (argparse's type=float only): a negative or zero upper bound, a
# negative lower bound, or a lower bound above the upper one.
BAD_BOUNDS = [
    (cfg("--use-tis --tis-clip -2.0 --tis-clip-low 0.5"),
     "Expected `--tis-clip` to be a float > 0.0, but got -2.0"),
    (cfg("--use-tis --tis-clip 0"), "Expected `--tis-clip` to be a float > 0.0, but got 0.0"),
    (cfg("--use-tis --tis-clip-low -0.1"),
     "Expected `--tis-clip-low` to be a float >= 0.0, but got -0.1"),
    (cfg("--use-tis --tis-clip 0.5 --tis-clip-low 2.0"),
     "Expected `--tis-clip-low` <= `--tis-clip` (0.5), but got 2.0"),
    (cfg(f"--use-tis --custom-tis-function-path {ICEPOP} --tis-clip-low 3"),
     "Expected `--tis-clip-low` <= `--tis-clip` (2.0), but got 3.0"),
    (cfg("--use-tis", {"tis_clip": -1}),
     "Expected `custom_config.tis_clip` to be a float > 0.0, but got -1"),
    (cfg("--use-tis --tis-clip 5", {"tis_clip_low": 6}),
     "Expected `custom_config.tis_clip_low` <= `--tis-clip` (5.0), but got 6.0"),
    (mis_error(tis_mode="clip", tis_lower_bound=-0.5),
     "Expected `custom_config.tis_lower_bound` to be a float >= 0.0 or null, but got -0.5"),
    (mis_error(use_rs=True, rs_level="token", rs_lower_bound=-1.0),
     "Expected `custom_config.rs_lower_bound` to be a float >= 0.0 or null, but got -1.0"),
    (mis_error(use_rs=True, rs_level="token", rs_upper_bound=0.0),
     "Expected `custom_config.rs_upper_bound` to be a float > 0.0 or null, but got 0.0"),
]  # fmt: skip


@pytest.mark.parametrize(("config", "message"), BAD_BOUNDS)
def test_senseless_bounds_are_refused_naming_the_key_and_value(config, message):
    with pytest.raises(ConfigError) as info:
        slime.parse(config)
    assert message in str(info.value)


def test_zero_lower_bounds_are_valid_and_replay(edges):
    config = cfg(f"--use-tis --custom-tis-function-path {ICEPOP} --tis-clip-low 0")
    assert slime.parse(config).tis_clip_low == 0.0
    check(replay(edges, config), *ref_simple(edges, "icepop", 0.0, 2.0))
    config = mis_cfg(tis_level="token", tis_mode="clip", tis_upper_bound=2.0, tis_lower_bound=0)
    spec = slime.parse(config)
    assert spec.mis.tis_lower == 0.0
    check(replay(edges, config), *ref_mis(edges, dataclasses.asdict(spec.mis)))


@pytest.mark.parametrize(("config", "key"), ERRORS)
def test_invalid_configs_name_the_key(config, key):
    with pytest.raises(ConfigError) as info:
        slime.parse(config)
    assert key in str(info.value)


def test_mis_without_use_tis_needs_only_the_upper_bound():
    spec = slime.parse(
        cfg(f"--get-mismatch-metrics --custom-tis-function-path {MIS}", {"tis_upper_bound": 2.0})
    )
    assert spec.mis == slime.MisConfig(tis_upper_bound=2.0) and not spec.use_tis


def test_spec_validation_from_python():
    with pytest.raises(ConfigError, match="custom_config"):
        slime.SlimeCorrection(use_tis=True, tis_function="mis")
    with pytest.raises(ConfigError, match="custom_config"):
        slime.SlimeCorrection(use_tis=True, mis=slime.MisConfig())
    with pytest.raises(ConfigError, match="--custom-tis-function-path"):
        slime.SlimeCorrection(tis_function="tis")
    with pytest.raises(ConfigError, match="--tis-clip"):
        slime.SlimeCorrection(tis_clip="2")
    with pytest.raises(ConfigError, match="`--tis-clip-low` <= `--tis-clip`"):
        slime.SlimeCorrection(tis_clip=1.0, tis_clip_low=2.0)
    with pytest.raises(ConfigError, match=r"`--tis-clip-low` to be a float >= 0\.0"):
        slime.SlimeCorrection(tis_clip_low=-1.0)
    with pytest.raises(ConfigError, match=r"custom_config\.tis_mode"):
        slime.MisConfig(tis_mode="bogus")
    # Not called: mis.py settings are not needed.
    batch = make_batch([3], masked_fraction=0.0)
    assert slime.SlimeCorrection(tis_function="mis").replay(batch).weight.eq(1).all()


# ---------------------------------------------------------------- the harness and dispatch

# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: mis.py at sequence level with RS, veto and batch
# normalization, and its clip mode normalized per token.
EXTRA_SPECS = {
    "mis_sequence_mask_rs_normalized": slime.parse(
        mis_cfg(tis_level="sequence", tis_mode="mask", tis_upper_bound=5.0, use_rs=True,
                rs_level="geometric", rs_lower_bound=0.9, rs_upper_bound=1.1,
                rs_veto_threshold=1e-4, tis_batch_normalize=True)
    ),
    "mis_token_clip_normalized": slime.parse(
        mis_cfg(tis_level="token", tis_mode="clip", tis_upper_bound=2.0, tis_batch_normalize=True)
    ),
}  # fmt: skip


def test_replay_dispatch_from_a_yaml_file(tmp_path, edges):
    path = tmp_path / "slime.yaml"
    path.write_text(
        "framework: slime\nname: glm5\n"
        f"args: --use-tis --custom-tis-function-path {ICEPOP} --tis-clip-low 0.5 --lr 1e-6\n"
    )
    spec = parse_config(path)
    assert isinstance(spec, slime.SlimeCorrection) and spec.name == "glm5"
    check(replay(edges, path), *ref_simple(edges, "icepop", 0.5, 2.0))


@pytest.mark.parametrize(
    ("args", "suggestion"),
    [("--use-tiss", "--use-tis"), ("--use-tis --tis-clipp 2", "--tis-clip")],
)
def test_a_typo_of_an_is_flag_is_an_error_with_the_nearest_flag(args, suggestion):
    # Unknown slime flags are ignored, but a misspelt IS flag must not turn the correction off.
    with pytest.raises(ConfigError, match=f"did you mean '{suggestion}'"):
        slime.parse({"framework": "slime", "args": args})
