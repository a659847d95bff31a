"""Config export: round trips per framework, snippets against the frameworks' own keys,
cross-framework conversions, verl's older config generations and the errors."""

from __future__ import annotations

import math
import re
import warnings

import numpy as np
import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from iscore import frameworks
from iscore.advice.conversion import (
    canonical,
    export,
    shortest,
    shown_config,
    snippet,
    to_file_text,
)
from iscore.errors import ConfigError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.frameworks import (
    areal,
    fireworks,
    nemo_rl,
    openrlhf,
    prime_rl,
    roll,
    skyrl,
    slime,
    trl,
    verl,
)
from iscore.frameworks.canonical import Canonical
from iscore.frameworks.resolve import parse_config, presets
from iscore.packed.batch import TokenBatch
from tests.conftest import ACCELERATORS
from tests.unit.frameworks.conftest import edge_batch, make_batch

_RNG = np.random.default_rng(7)
BATCH = make_batch(
    [1, 1, 2, *_RNG.lognormal(3.5, 1.0, 24).astype(int).clip(1, 600).tolist()], seed=3, sigma=0.1
)
EDGES = edge_batch()

PROPERTY = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def identical(a, b, batch=BATCH) -> bool:
    ra, rb = a.replay(batch), b.replay(batch)
    return torch.equal(ra.weight, rb.weight) and torch.equal(ra.keep, rb.keep)


def quiet_parse(config):
    """parse_config without the warnings some frameworks give on legal but odd settings."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return parse_config(config)


# ------------------------------------------------------------------ random valid settings

ratio_upper = st.sampled_from([1.001, 1.2, 1.5, 2.0, 3.0, 5.0, 10.0]) | st.floats(1.01, 20.0)
ratio_lower = st.sampled_from([0.2, 0.5, 0.8, 0.999]) | st.floats(0.05, 0.99)


@st.composite
def verl_specs(draw) -> verl.VerlSpec:
    fields: dict = {}
    level = draw(st.sampled_from([None, "token", "sequence"]))
    if level is not None:
        fields = {"is_level": level, "is_upper": draw(ratio_upper)}
        if draw(st.booleans()):
            fields["is_lower"] = draw(ratio_lower)
        fields["batch_normalize"] = draw(st.booleans())
    options = draw(st.lists(st.sampled_from(verl.RS_OPTIONS), unique=True, max_size=3))
    rs = []
    for option in options:
        if option.endswith("k1"):
            rs.append(verl.RSCriterion(option, upper=draw(ratio_upper), lower=draw(ratio_lower)))
        else:
            rs.append(verl.RSCriterion(option, upper=draw(st.sampled_from([0.001, 0.01, 2.5]))))
    return verl.VerlSpec(
        rs=tuple(rs),
        bypass=draw(st.booleans()),
        loss_type=draw(st.sampled_from(["ppo_clip", "reinforce"])),
        **fields,
    )


@st.composite
def skyrl_specs(draw) -> skyrl.SkyRLSpec:
    loss = draw(st.sampled_from(["regular", "gspo", "rollout_is", "cispo", "dppo"]))
    anchor = draw(st.sampled_from(["old", "rollout"])) if loss == "cispo" else "old"
    tis = None if anchor == "rollout" else draw(st.sampled_from([None, "token", "sequence"]))
    maybe = lambda s: draw(st.none() | s)  # noqa: E731
    fields = {
        "tis_ratio_type": tis,
        "token_tis_ratio_clip_high": draw(ratio_upper),
        "sequence_tis_ratio_clip_high": draw(ratio_upper),
        "sequence_mask_metric": draw(st.sampled_from([None, "geometric", "product"])),
        "geo_mask_low": draw(st.sampled_from([0.99, 0.999])),
        "geo_mask_high": draw(st.sampled_from([1.01, 1.001])),
        "product_mask_low": draw(ratio_lower),
        "product_mask_high": draw(ratio_upper),
        "outlier_token_is_threshold_low": maybe(st.sampled_from([1e-4, 0.01])),
        "outlier_token_is_threshold_high": maybe(st.sampled_from([100.0, 20.0])),
        "policy_loss_type": loss,
        "eps_clip_low": draw(st.sampled_from([0.2, 0.5, 1.0])),
        "eps_clip_high": draw(st.sampled_from([0.2, 0.28, 4.0])),
        "cispo_anchor": anchor,
        "cispo_eps_clip_low": draw(st.sampled_from([1.0, 0.2])),
        "cispo_eps_clip_high": draw(st.sampled_from([4.0, 1.0])),
    }
    if draw(st.booleans()):
        fields["token_mask_is_threshold_low"] = draw(ratio_lower)
        fields["token_mask_is_threshold_high"] = draw(ratio_upper)
    return skyrl.SkyRLSpec(**fields)


@st.composite
def nemo_specs(draw) -> nemo_rl.NemoRLSpec:
    enabled = draw(st.booleans())
    kind = draw(st.sampled_from([None, "tis", "icepop", "seq-mask-tis"])) if enabled else None
    fields: dict = {"use_importance_sampling_correction": enabled}
    if kind is not None:
        fields["truncated_importance_sampling_type"] = kind
        fields["truncated_importance_sampling_ratio"] = draw(ratio_upper)
        if kind != "tis" or draw(st.booleans()):
            fields["truncated_importance_sampling_ratio_min"] = draw(ratio_lower)
    if kind != "seq-mask-tis":
        fields["is_correction_level"] = draw(st.sampled_from([None, "token", "sequence_mean"]))
        if draw(st.booleans()):
            fields |= {"sequence_level_importance_ratios": True, "token_level_loss": False}
    tau = st.sampled_from([1.0, 1.05, 2.0]) | st.floats(1.0, 3.0)
    fields["seq_logprob_error_threshold"] = draw(st.none() | tau)
    return nemo_rl.NemoRLSpec(**fields)


@st.composite
def mis_configs(draw) -> slime.MisConfig:
    mode = draw(st.sampled_from(["truncate", "clip", "mask"]))
    level = draw(st.sampled_from(["token", "sequence", "geometric"]))
    use_rs = draw(st.booleans())
    return slime.MisConfig(
        use_rs=use_rs,
        tis_level=level,
        rs_level=draw(st.sampled_from(["token", "sequence", "geometric"])),
        tis_mode=mode,
        tis_lower_bound=draw(st.none() | ratio_lower),
        tis_upper_bound=draw(ratio_upper),
        rs_lower_bound=draw(st.none() | ratio_lower),
        rs_upper_bound=draw(st.none() | ratio_upper),
        rs_veto_threshold=draw(st.none() | st.sampled_from([1e-4, 1e-6])),
        tis_batch_normalize=level != "geometric" and draw(st.booleans()),
    )


@st.composite
def slime_specs(draw) -> slime.SlimeCorrection:
    function = draw(st.sampled_from(["vanilla", "icepop", "mis", "off_policy_is"]))
    use_tis = draw(st.booleans())
    metrics = draw(st.booleans())
    called = use_tis or metrics
    return slime.SlimeCorrection(
        use_tis=use_tis,
        get_mismatch_metrics=metrics,
        tis_function=function,
        tis_clip=draw(ratio_upper),
        tis_clip_low=draw(st.sampled_from([0.0, 0.5]) | ratio_lower),
        use_rollout_logprobs=draw(st.booleans()),
        mis=draw(mis_configs()) if function == "mis" and called else None,
        ignored_flags=draw(st.sampled_from([(), ("--calculate-per-token-loss",)])),
    )


@st.composite
def areal_specs(draw) -> areal.ArealCorrection:
    decoupled = draw(st.booleans())
    rs = None
    if draw(st.booleans()):
        level = draw(st.sampled_from(["token", "sequence"]))
        metric = draw(st.sampled_from(["ratio", "kl_k1", "kl_k2", "kl_k3"]))
        action = draw(st.sampled_from(["mask", "clamp"])) if metric == "ratio" else "mask"
        if metric == "ratio":
            upper, lower = draw(ratio_upper), draw(st.none() | ratio_lower)
        elif metric == "kl_k1":
            upper, lower = draw(st.sampled_from([0.01, 0.5])), draw(st.none() | st.just(-0.5))
        else:
            upper, lower = draw(st.sampled_from([0.01, 0.5, 2.0])), None
        agg = draw(st.sampled_from(["sum", "mean", "max"])) if level == "sequence" else "mean"
        two_stage = (level, metric, action) == ("sequence", "ratio", "mask")
        token_action = draw(st.sampled_from([None, "mask", "clamp"])) if two_stage else None
        rs = areal.RejectionSampling(level, action, metric, agg, upper, lower, token_action)
    pr1218 = rs is not None and rs.token_action is not None
    return areal.ArealCorrection(
        use_decoupled_loss=decoupled,
        recompute_logprob=draw(st.booleans()),
        prox_logp_method=draw(st.sampled_from(["recompute", "metrics"])),
        rejection_sampling=rs,
        importance_sampling_level=draw(st.sampled_from(["token", "sequence"])),
        version="pr1218" if pr1218 else draw(st.sampled_from([None, "pr1218"])),
    )


@st.composite
def openrlhf_specs(draw) -> openrlhf.OpenRLHFCorrection:
    kind = draw(st.sampled_from(["tis", "icepop", "seq-mask-tis"]))
    lower = draw(st.sampled_from([0.5, 0.0, 0.999]) | ratio_lower)
    if kind == "tis" and draw(st.booleans()):
        lower = None  # the 2025 single-value threshold
    return openrlhf.OpenRLHFCorrection(
        enable=draw(st.booleans()),
        type=kind,
        lower=lower,
        upper=draw(ratio_upper),
        policy_loss_type=draw(st.sampled_from(["ppo", "gspo"])),
        version=None if lower is None else draw(st.sampled_from([None, "pr1298"])),
    )


@st.composite
def trl_specs(draw) -> trl.TRLCorrection:
    mode = draw(st.sampled_from(["token_truncate", "token_mask", "sequence_truncate",
                                 "sequence_mask"]))  # fmt: skip
    clip_max = draw(st.none() | ratio_upper)
    clip_min = draw(st.none() | ratio_lower)
    if mode.endswith("_truncate") and clip_max is None and clip_min is None:
        clip_max = 2.0
    enabled = draw(st.booleans())
    use_vllm = draw(st.booleans())
    losses = ["dapo", "grpo", "dr_grpo", "bnpo", "cispo"]
    if not (enabled and use_vllm):
        losses.append("vespo")
    return trl.TRLCorrection(
        use_vllm=use_vllm,
        enabled=enabled,
        mode=mode,
        clip_min=clip_min,
        clip_max=clip_max,
        loss_type=draw(st.sampled_from(losses)),
    )


@st.composite
def fireworks_specs(draw) -> fireworks.FireworksTIS | fireworks.FireworksISCorrection:
    if draw(st.booleans()):
        return fireworks.FireworksISCorrection(
            tis_cap=draw(ratio_upper),
            tis_level=draw(st.sampled_from(["token", "sequence"])),
            eps_clip=draw(st.sampled_from([0.2, 0.28])),
            eps_clip_high=draw(st.none() | st.just(0.28)),
        )
    level = draw(st.sampled_from(["token", "sequence"]))
    return fireworks.FireworksTIS(
        cap=draw(ratio_upper),
        level=level,
        icepop_threshold=draw(st.none() | st.sampled_from([2.0, 5.0]))
        if level == "token"
        else None,
        anchor_logp=draw(st.sampled_from(["old_policy", "rollout"])),
    )


@st.composite
def roll_specs(draw) -> roll.RollSpec:
    levels = st.sampled_from(roll.LEVELS)
    is_weight = roll.ISWeight(
        enabled=draw(st.booleans()),
        weight_type=draw(levels),
        upper_bound=draw(st.none() | ratio_upper),
    )
    filters = []
    for _ in range(draw(st.integers(0, 2))):
        diff = draw(st.sampled_from([0.05, 0.1, 0.2, 1.0]))
        filters.append(
            roll.Filter(
                enabled=draw(st.booleans()),
                agg_type=draw(levels),
                ratio_enabled=draw(st.booleans()),
                ratio_low=draw(ratio_lower),
                ratio_high=draw(ratio_upper),
                diff_enabled=draw(st.booleans()),
                diff_low=-diff,
                diff_high=diff,
            )
        )
    return roll.RollSpec(
        is_weight=is_weight,
        filters=tuple(filters),
        loss_agg_mode=draw(st.sampled_from(roll.LOSS_AGG_MODES)),
        recompute=draw(st.booleans()),
    )


@st.composite
def prime_rl_specs(draw) -> prime_rl.PrimeRLLoss:
    # IPO only: the default loss reads each sequence's advantage, which the probes lack.
    return prime_rl.PrimeRLLoss(
        type="ipo",
        ipo_threshold=draw(st.sampled_from([0.1, 0.3, 1.0]) | st.floats(0.01, 1.0)),
        adv_tau=draw(st.sampled_from([1.0, 0.5])),
        kl_tau=draw(st.sampled_from([0.0, 1e-3])),
    )


SPECS = {
    "roll": roll_specs(),
    "verl": verl_specs(),
    "skyrl": skyrl_specs(),
    "nemo_rl": nemo_specs(),
    "slime": slime_specs(),
    "areal": areal_specs(),
    "openrlhf": openrlhf_specs(),
    "trl": trl_specs(),
    "fireworks": fireworks_specs(),
    "prime_rl": prime_rl_specs(),
}


def from_snippet(spec) -> dict:
    """The iscore config a user gets by pasting `snippet(spec)` into the framework's config (at
    the pull request a version names: the snippet names it in a comment, iscore's `version:`
    key comes back with it)."""
    text = snippet(spec)
    config = {"framework": spec.framework, "name": spec.name}
    if getattr(spec, "version", None) is not None:
        config["version"] = spec.version
    if spec.framework not in ("slime", "openrlhf"):
        return config | (yaml.safe_load(text) or {})
    flags, _, custom = text.partition("\n\n")
    # The lines, continuations and all, without the comments (a version's pull request).
    config["args"] = "\n".join(line for line in flags.splitlines() if not line.startswith("#"))
    if yaml.safe_load(custom):  # mis.yaml (comment lines alone are the numbers' meanings)
        config["custom_config"] = yaml.safe_load(custom)
    return config


def numbers(config, out=None) -> list[float]:
    """Every float of a config, also inside strings (flags, verl's "lo_hi")."""
    out = [] if out is None else out
    if isinstance(config, dict):
        for value in config.values():
            numbers(value, out)
    elif isinstance(config, list):  # ROLL's filters
        for value in config:
            numbers(value, out)
    elif isinstance(config, float):
        out.append(config)
    elif isinstance(config, str):
        out += [float(x) for x in re.findall(r"-?\d+\.\d+(?:e[-+]?\d+)?", config)]
    return out


def probe(spec) -> TokenBatch:
    """One-token sequences whose log-ratio d takes every float32 within 40 steps of where each
    bound of `spec` sits: d = v, -v, log v and +-sqrt(2|v|) (a small k1/k3 bound), so that a
    bound moved by one float32 step changes some weight or mask."""
    ds: list[float] = []
    for v in numbers(spec.to_config()):
        for c in (v, -v, math.log(v) if v > 0 else None, math.sqrt(2 * abs(v))):
            for center in (c, None if c is None else -c):
                if center is None or not math.isfinite(center) or abs(center) > 50:
                    continue
                up = down = np.float32(center)
                ds.append(float(up))
                for _ in range(40):
                    up, down = np.nextafter(up, np.float32(np.inf)), np.nextafter(down, -np.inf)
                    ds += [float(up), float(down)]
    d = torch.tensor(ds or [0.0], dtype=torch.float32)
    n = d.numel()
    rollout = torch.full((n,), -1.0)
    return TokenBatch(
        rollout=rollout,
        train=rollout + d,
        policy=rollout + d,
        cu_seqlens=torch.arange(n + 1, dtype=torch.int64),
    )


# ------------------------------------------------------------------ round trip per framework


@pytest.mark.parametrize("framework", FRAMEWORKS)
@PROPERTY
@given(data=st.data())
def test_export_round_trips(framework, data):
    spec = data.draw(SPECS[framework])
    for config in (spec.to_config(), yaml.safe_load(to_file_text(spec))):
        parsed = quiet_parse(config)
        assert parsed == spec
        assert identical(parsed, spec)
    # The snippet shortens bounds to their float32 value: the same weights and masks, also
    # for log-ratios one float32 step either side of every bound.
    parsed = quiet_parse(from_snippet(spec))
    assert identical(parsed, spec)
    assert identical(parsed, spec, probe(spec))
    assert parsed == spec or any(shortest(v) != v for v in numbers(spec.to_config()))


@pytest.mark.parametrize(("upper", "option"), [(2.080078125, "token_k3"), (1.08203125, "token_k2")])
def test_batch_normalized_bounds_keep_their_digits(upper, option):
    """Found by the round trip: divided by their batch mean, verl's capped weights carry the
    cap's last float64 digits (2.080078125 vs its float32-shortest 2.0800781) into every
    weight, on some batches and not others; such bounds are written as they are."""
    rs = (verl.RSCriterion(option, upper=0.001),)
    spec = verl.VerlSpec(name="verl", is_level="token", is_upper=upper, batch_normalize=True, rs=rs)
    assert repr(upper) in snippet(spec)
    parsed = quiet_parse(from_snippet(spec))
    assert parsed == spec
    assert identical(parsed, spec) and identical(parsed, spec, probe(spec))


@pytest.mark.parametrize("metric", [None, "geometric"])
def test_a_cap_times_a_policy_factor_keeps_its_digits(metric):
    """Found by the round trip: under SkyRL's rollout_is loss the sequence TIS weight (float64,
    from float64 sums) multiplies the policy ratio, so 1.32421875 and its float32-shortest
    1.3242188 round some products to different float32 weights; the probe that decides
    whether a bound may be shortened now pairs each log-ratio with a policy off the trainer's,
    in one-token and long sequences."""
    spec = skyrl.SkyRLSpec(
        tis_ratio_type="sequence",
        sequence_tis_ratio_clip_high=1.32421875,
        sequence_mask_metric=metric,
        policy_loss_type="rollout_is",
    )
    parsed = quiet_parse(from_snippet(spec))
    assert identical(parsed, spec) and identical(parsed, spec, probe(spec))


def test_file_text_is_read_by_replay_as_is(tmp_path):
    for module in (verl, skyrl, nemo_rl, slime, areal, openrlhf, trl, fireworks):
        for name, spec in module.PRESETS.items():
            path = tmp_path / f"{name}.yaml"
            path.write_text(to_file_text(spec))
            assert quiet_parse(path) == spec


# ------------------------------------------------------------------ snippets, key by key

# verl/trainer/config/algorithm/rollout_correction.yaml @ 1dda039b (verl-project/verl).
VERL_KEYS = {
    "rollout_is",
    "rollout_is_threshold",
    "rollout_rs",
    "rollout_rs_threshold",
    "bypass_mode",
    "loss_type",
    "rollout_is_batch_normalize",
}
# OffPolicyCorrectionConfig in skyrl/train/config/config.py @ a9564572 (NovaSky-AI/SkyRL).
SKYRL_KEYS = {
    "tis_ratio_type",
    "token_tis_ratio_clip_high",
    "sequence_tis_ratio_clip_high",
    "sequence_mask_metric",
    "geo_mask_high",
    "geo_mask_low",
    "product_mask_high",
    "product_mask_low",
    "outlier_token_is_threshold_low",
    "outlier_token_is_threshold_high",
    "token_mask_is_threshold_low",
    "token_mask_is_threshold_high",
}


def test_verl_snippet_matches_rollout_correction_yaml():
    spec = verl.PRESETS["decoupled_geo_rs_token_tis"]
    # Only what differs from verl's defaults (rollout_is_threshold 2.0, no normalization,
    # decoupled PPO-clip).
    assert snippet(spec) == (
        "# rollout_rs seq_mean_k1 keeps e^G in [0.999001, 1.001]: verl compares k1 = "
        '-log(ratio) with log L and log U, so the threshold "L_U" is 1/1.001_1/0.999001 (the '
        "reciprocals)\n"
        "algorithm:\n"
        "  rollout_correction:\n"
        "    rollout_is: token\n"
        "    rollout_rs: seq_mean_k1\n"
        "    rollout_rs_threshold: '0.999_1.001'\n"
    )
    assert set(spec.to_config()["algorithm"]["rollout_correction"]) == VERL_KEYS


def test_verl_k1_bounds_say_they_are_reciprocals():
    """A geometric band [0.96947, 1.0307] exported to verl read
    '0.9702144173862424_1.0314914334636451' with no word of why (a comment said only
    'to float32 precision', or nothing): the snippet now names the band kept and each
    reciprocal, and `--exact`-free export keeps the notes in what it prints."""
    geo = skyrl.SkyRLSpec(
        sequence_mask_metric="geometric", geo_mask_low=0.96947, geo_mask_high=1.0307
    )
    text = snippet(export(geo, "verl").spec)
    assert "keeps e^G in [0.96947, 1.0307]" in text
    assert "1/1.0307_1/0.96947 (the reciprocals)" in text
    assert "0.9702144173862424 = 1/1.0307, 1.0314914334636451 = 1/0.96947" in text


def test_verl_flags_are_hydra_overrides():
    spec = verl.VerlSpec(
        is_level="token",
        is_upper=5.0,
        is_lower=0.5,
        rs=(verl.RSCriterion("token_k1", 1.6, 0.6), verl.RSCriterion("seq_max_k2", 2.5)),
    )
    comment, overrides = snippet(spec, "flags").split("\n", 1)
    assert comment.startswith("# rollout_rs token_k1 keeps each token's ratio rho in [0.625, ")
    lines = overrides.split(" \\\n")
    assert lines == [
        "algorithm.rollout_correction.rollout_is=token",
        "\"algorithm.rollout_correction.rollout_is_threshold='0.5_5.0'\"",
        "\"algorithm.rollout_correction.rollout_rs='token_k1,seq_max_k2'\"",
        "\"algorithm.rollout_correction.rollout_rs_threshold='0.6_1.6,2.5'\"",
    ]


def test_skyrl_snippet_nesting_and_keys():
    algorithm = skyrl.PRESETS["skyrl_geo_mask"].to_config()["trainer"]["algorithm"]
    assert set(algorithm["off_policy_correction"]) == SKYRL_KEYS
    assert set(algorithm["cispo"]) == {"cispo_anchor", "cispo_eps_clip_low", "cispo_eps_clip_high"}
    # The geometric band 0.99-1.01 is SkyRL's default: the metric alone switches it on.
    assert snippet(skyrl.PRESETS["skyrl_geo_mask"]) == (
        "trainer:\n  algorithm:\n    off_policy_correction:\n"
        "      sequence_mask_metric: geometric\n"
    )
    tight = skyrl.SkyRLSpec(sequence_mask_metric="geometric", geo_mask_low=1 / 1.001)
    flags = snippet(tight, "flags").split(" \\\n")
    # The form of SkyRL's docs (off_policy_correction.mdx): dotted Hydra overrides; 1/1.001 at
    # its float32 value, explained after the flags (a comment would end the continuation).
    assert flags == [
        "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
        "trainer.algorithm.off_policy_correction.geo_mask_low=0.999001\n\n# 0.999001 = 1/1.001",
    ]
    assert snippet(tight).splitlines()[-1] == "      geo_mask_low: 0.999001  # 1/1.001"


def test_nemo_snippet_keys():
    assert snippet(nemo_rl.PRESETS["nemo_seq_mask_tis"]) == (
        "loss_fn:\n"
        "  use_importance_sampling_correction: true\n"
        "  truncated_importance_sampling_type: seq-mask-tis\n"
        "  truncated_importance_sampling_ratio: 1.002\n"
        "  truncated_importance_sampling_ratio_min: 0.999\n"
    )
    assert snippet(nemo_rl.NemoRLSpec()) == ("# nothing to set: NeMo-RL's default (no correction)")


def test_slime_snippet_is_flags_plus_mis_yaml():
    text = snippet(slime.PRESETS["slime_mis_example"])
    flags, _, custom = text.partition("\n\n")
    assert flags == (
        "--use-tis \\\n"
        "--custom-tis-function-path "
        "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp \\\n"
        "--custom-config-path mis.yaml"
    )
    assert custom.startswith("# mis.yaml, the YAML --custom-config-path points to\n")
    # examples/train_infer_mismatch_helper/mis.yaml's keys, plus the use_tis it overrides.
    assert set(yaml.safe_load(custom)) == {
        "use_tis", "use_rs", "tis_level", "rs_level", "tis_mode", "tis_lower_bound",
        "tis_upper_bound", "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold",
        "tis_batch_normalize",
    }  # fmt: skip
    assert snippet(slime.PRESETS["slime_icepop"]) == (
        "--use-tis \\\n"
        "--custom-tis-function-path slime.backends.megatron_utils.loss.icepop_function \\\n"
        "--tis-clip-low 0.5"
    )


def test_slime_tis_with_rollout_logprobs_goes_through_the_yaml():
    # slime rejects --use-tis beside --use-rollout-logprobs on the command line only.
    spec = slime.SlimeCorrection(use_tis=True, use_rollout_logprobs=True)
    config = spec.to_config()
    assert "--use-tis" not in config["args"].split()
    assert config["custom_config"] == {"use_tis": True}
    assert parse_config(config) == spec


def test_areal_snippet_keys():
    text = snippet(areal.PRESETS["areal_token_mask"])
    actor = yaml.safe_load(text)["actor"]
    assert actor["use_decoupled_loss"] is True
    # RejectionSamplingConfig in areal/api/cli_args.py @ 4aef98d8.
    assert actor["rejection_sampling"] == {
        "level": "token", "action": "mask", "metric": "ratio", "agg": "mean", "upper": 5.0,
        "lower": None,
    }  # fmt: skip


def test_openrlhf_flags_current_and_2025_forms():
    assert snippet(openrlhf.PRESETS["openrlhf_tis"]) == (
        "--algo.advantage.is_correction_enable \\\n"
        "--algo.advantage.is_correction_type tis \\\n"
        "--algo.advantage.is_correction_threshold 0.5 5.0"
    )
    old = openrlhf.OpenRLHFCorrection(enable=True, lower=None, upper=2.0)
    assert snippet(old) == "--enable_vllm_is_correction \\\n--vllm_is_truncated_threshold 2.0"
    with pytest.raises(ConfigError, match="is_correction_threshold"):
        openrlhf.OpenRLHFCorrection(type="icepop", lower=None).to_config()


def test_trl_snippet_keys_and_flags():
    spec = trl.PRESETS["trl_token_tis"]
    # GRPOConfig fields in trl/trainer/grpo_config.py @ f2cd5771.
    assert set(spec.to_config()) - {"framework", "name"} == {
        "use_vllm",
        "vllm_importance_sampling_correction",
        "vllm_importance_sampling_mode",
        "vllm_importance_sampling_clip_min",
        "vllm_importance_sampling_clip_max",
        "loss_type",
    }
    # use_vllm is shown although iscore assumes it: GRPOConfig's own default is false.
    assert snippet(spec) == (
        "# GRPOConfig(use_vllm=True, vllm_importance_sampling_mode='token_truncate', "
        "vllm_importance_sampling_clip_max=2.0)\n"
        "use_vllm: true\n"
        "vllm_importance_sampling_mode: token_truncate\n"
        "vllm_importance_sampling_clip_max: 2.0\n"
    )
    assert snippet(spec, "flags").split(" \\\n") == [
        "--use_vllm true",
        "--vllm_importance_sampling_mode token_truncate",
        "--vllm_importance_sampling_clip_max 2.0",
    ]


def test_fireworks_snippet_keys():
    spec = fireworks.PRESETS["fireworks_deepmath"]
    # TISConfig in training/utils/rl/tis.py, Config.anchor_logp in rl_loop.py @ 76821fa1.
    assert spec.to_config()["tis"].keys() == {"cap", "level", "icepop_threshold"}
    assert snippet(spec) == (
        "# training/recipes/rl_loop.py: Config(tis=TISConfig(cap=2.0))\ntis:\n  cap: 2.0\n"
    )
    pr169 = yaml.safe_load(snippet(fireworks.FireworksISCorrection(tis_level="sequence")))
    assert set(pr169["is_correction"]) == {"eps_clip", "eps_clip_high", "tis_cap", "tis_level"}
    assert snippet(fireworks.PRESETS["fireworks_default"]) == (
        "# nothing to set: Fireworks cookbook's default (token TIS: w = min(rho, 5))"
    )


def test_areal_log_space_bounds_keep_their_digits_and_say_what_they_are():
    # AReaL compares float64 log-space bounds: shortening ln 2 would move a mask.
    spec = export(skyrl.PRESETS["skyrl_product_mask"], "areal").spec
    lines = snippet(spec).splitlines()
    assert "    upper: 0.6931471805599453  # ln 2" in lines
    assert "    lower: -0.6931471805599453  # ln 0.5" in lines


@pytest.mark.parametrize("target", FRAMEWORKS)
def test_every_conversion_snippet_is_short_explained_and_never_empty(target):
    """For every preset into every framework: text to paste (or a comment saying there is
    nothing to set), no key at the framework's default unless it must be shown, and every
    number with more than 7 significant digits explained by a comment."""
    defaults = quiet_parse({"framework": target}).to_config()
    keep = frameworks.get(target).snippet_keys
    for name, spec in presets().items():
        out = export(spec, target).spec
        text = snippet(out)
        assert text.strip(), name
        shown = shown_config(out)

        def leaves(config, prefix=""):
            for key, value in config.items():
                if isinstance(value, dict):
                    yield from leaves(value, f"{prefix}{key}.")
                else:
                    yield prefix + key, value

        default = dict(leaves(defaults))
        for key, value in leaves(shown):
            if key not in ("framework", "name") and key not in keep:
                assert default.get(key, object()) != value, (name, key)
        comments = " ".join(line.partition("#")[2] for line in text.splitlines())
        for number in re.findall(
            r"-?\d+\.\d+(?:e[-+]?\d+)?",
            text.split("#")[0] + " ".join(line.partition("#")[0] for line in text.splitlines()),
        ):
            digits = len(number.lstrip("-").split("e")[0].replace(".", "").lstrip("0"))
            assert digits <= 7 or comments, (name, number)


@pytest.mark.parametrize(
    ("spec", "fmt", "match"),
    [
        (slime.PRESETS["slime_tis"], "yaml", "launch flags"),
        (openrlhf.PRESETS["openrlhf_tis"], "yaml", "launch flags"),
        (areal.PRESETS["areal_token_mask"], "flags", "no command-line form"),
        (fireworks.PRESETS["fireworks_default"], "flags", "no command-line form"),
        (trl.TRLCorrection(mode="token_mask", clip_max=None), "flags", "clip_max: null"),
        (verl.PRESETS["disabled"], "toml", "`fmt`"),
    ],
)
def test_snippet_format_errors(spec, fmt, match):
    with pytest.raises(ConfigError, match=match):
        snippet(spec, fmt)


# ------------------------------------------------------------------ canonical


def test_canonical_separates_the_traps():
    # "Sequence-level IS": a product in verl, a geometric mean in AReaL and Fireworks.
    assert canonical(verl.PRESETS["decoupled_seq_is"]).method == "sequence-tis"
    assert canonical(fireworks.FireworksTIS(level="sequence")).method == "geometric-tis"
    clamp = areal.RejectionSampling(level="sequence", action="clamp")
    assert (
        canonical(areal.ArealCorrection(True, rejection_sampling=clamp)).method == "geometric-tis"
    )
    # OpenRLHF's TIS is two-sided; verl's is not.
    assert canonical(openrlhf.PRESETS["openrlhf_tis"]).weights[0].lower == 0.5
    assert canonical(verl.PRESETS["decoupled_token_is"]).weights[0].lower is None
    # SkyRL's token mask has no weight; verl's IcePop zeroes the weight in place.
    assert canonical(skyrl.PRESETS["skyrl_token_mask"]).weights == ()
    assert canonical(verl.PRESETS["decoupled_token_icepop"]).method == "icepop"
    # verl's k1 bounds keep ratios in [1/U, 1/L].
    (mask,) = canonical(verl.VerlSpec(rs=(verl.RSCriterion("token_k1", 1.5, 0.5),))).masks
    assert (math.exp(mask.lower), math.exp(mask.upper)) == pytest.approx((1 / 1.5, 2.0))
    # NeMo-RL's overflow to 0 is part of its numerics.
    assert canonical(nemo_rl.PRESETS["nemo_is"]).weights[0].numerics == "overflow_zero"


def test_canonical_combinations_are_component_tuples():
    c = canonical(skyrl.PRESETS["skyrl_tldr_stack"])
    assert [x.method for x in c.components] == [
        "token-tis",
        "token-mask",
        "geometric-mask",
        "outlier-veto",
    ]
    assert c.sequence_over == "kept"
    c = canonical(verl.PRESETS["decoupled_seq_is_rs"])
    assert [x.method for x in c.components] == ["sequence-tis", "sequence-mask"]
    assert canonical(verl.PRESETS["bypass_ppo_clip"]) == Canonical(anchor="rollout")
    assert canonical(verl.PRESETS["bypass_pg_is"]).weights[0].numerator == "policy"
    with pytest.raises(ConfigError, match="`spec`"):
        canonical(object())


def test_canonical_equal_means_identical_replay():
    # IcePop in five frameworks: the band sits inside e^+-20, so the numerics do not matter.
    icepops = [
        verl.PRESETS["decoupled_token_icepop"],
        nemo_rl.PRESETS["nemo_icepop"],
        openrlhf.PRESETS["openrlhf_icepop"],
        slime.SlimeCorrection(use_tis=True, tis_function="icepop", tis_clip_low=0.5, tis_clip=5),
    ]
    for spec in icepops[1:]:
        assert canonical(spec) == canonical(icepops[0])
        assert identical(spec, icepops[0], EDGES)


# ------------------------------------------------------------------ cross-framework conversions


@pytest.mark.parametrize("source", FRAMEWORKS)
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_conversions_are_exact_only_when_they_replay_identically(source, data):
    spec = data.draw(SPECS[source])
    for to in FRAMEWORKS:
        out = export(spec, to)
        assert out.spec.framework == to
        assert quiet_parse(out.spec.to_config()) == out.spec
        if out.exact:
            assert identical(spec, out.spec) and identical(spec, out.spec, EDGES)
        else:
            assert out.notes

        # Whatever the target does differently is named: without a specific note, the target
        # is the source's rule (up to floating-point paths).
        def generic(note: str) -> bool:
            return note.startswith("The same rule") or bool(
                re.match(r"The .+ setting: ", note) or "a different step size" in note
            )

        if all(generic(note) for note in out.notes):
            assert canonical(out.spec).loosely_equals(canonical(spec))


@pytest.mark.parametrize(
    ("spec", "to"),
    [
        (verl.PRESETS["decoupled_token_is"], "skyrl"),
        (verl.PRESETS["decoupled_token_is"], "slime"),
        (verl.PRESETS["decoupled_token_is"], "fireworks"),
        (verl.PRESETS["decoupled_seq_is"], "skyrl"),
        (nemo_rl.PRESETS["nemo_icepop"], "verl"),
        (nemo_rl.PRESETS["nemo_icepop"], "openrlhf"),
        (openrlhf.PRESETS["openrlhf_tis"], "trl"),
        (openrlhf.PRESETS["openrlhf_tis"], "areal"),
        (skyrl.PRESETS["skyrl_cispo_rollout"], "verl"),
        (verl.PRESETS["bypass_ppo_clip"], "slime"),
        (fireworks.PRESETS["fireworks_deepmath"], "verl"),
    ],
)
def test_exact_conversions(spec, to):
    out = export(spec, to, batch=BATCH)
    assert out.exact
    assert identical(spec, out.spec) and identical(spec, out.spec, EDGES)
    assert out.difference["identical"]
    source, target = out.difference["source"], out.difference["target"]
    # Identical weights; lr_scale still follows each framework's own loss aggregation.
    assert {k: v for k, v in source.items() if k != "lr_scale"} == {
        k: v for k, v in target.items() if k != "lr_scale"
    }


def test_bypass_reinforce_becomes_rollout_anchored_cispo():
    out = export(verl.VerlSpec(is_level="token", is_upper=3.0, bypass=True,
                                loss_type="reinforce"), "skyrl")  # fmt: skip
    assert out.exact
    assert (out.spec.policy_loss_type, out.spec.cispo_anchor) == ("cispo", "rollout")
    assert (out.spec.cispo_eps_clip_low, out.spec.cispo_eps_clip_high) == (1.0, 2.0)


def from_log_ratios(*sequences: list[float]) -> TokenBatch:
    """A batch with the given per-token log-ratios d (train = rollout + d), one list each."""
    d = np.concatenate(sequences)
    rollout = np.full(d.size, -8.0, dtype=np.float32)
    train = (rollout + d).astype(np.float32)
    lengths = [len(x) for x in sequences]
    return TokenBatch(
        rollout=torch.from_numpy(rollout),
        train=torch.from_numpy(train),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)])),
        policy=torch.from_numpy(train + _RNG.normal(0.0, 0.05, d.size).astype(np.float32)),
    )


# Sequences that every inexact conversion below treats differently from its source: mild ones
# that pass geometric masks, wide ones, and a token at ratio e^6 (above SkyRL's outlier bound).
WILD = from_log_ratios(
    *(_RNG.normal(0.0, 0.004, n) for n in (3, 50, 200)),
    *(_RNG.normal(0.0, 0.6, n) for n in (1, 8, 60)),
    [0.0, 6.0, -0.1],
)


@pytest.mark.parametrize(
    ("spec", "to", "note"),
    [
        # The sequence-IS trap: verl's product becomes AReaL's / Fireworks' geometric mean.
        (verl.PRESETS["decoupled_seq_is"], "areal", "geometric mean e^G"),
        (verl.PRESETS["decoupled_seq_is"], "fireworks", "geometric mean e^G"),
        # OpenRLHF's two-sided TIS has no lower clamp in verl.
        (openrlhf.PRESETS["openrlhf_tis"], "verl", "no lower clamp"),
        # SkyRL's token mask removes tokens; verl's IcePop only zeroes their weight.
        (verl.PRESETS["decoupled_token_icepop"], "skyrl", "removes those from the loss mask"),
        (skyrl.PRESETS["skyrl_geo_mask"], "nemo_rl", "seq-mask-tis"),
        (verl.PRESETS["decoupled_k3_rs"], "skyrl", "No SkyRL mask expresses it"),
        (skyrl.PRESETS["skyrl_outlier_mask"], "verl", "seq_max_k2"),
    ],
)
def test_inexact_conversions_carry_notes_and_the_measured_difference(spec, to, note):
    out = export(spec, to, batch=WILD)
    assert not out.exact
    assert any(note in line for line in out.notes), out.notes
    difference = out.difference
    assert not difference["identical"]
    for side in ("source", "target"):
        assert set(difference[side]) == {
            "weight_mean", "token_masked_fraction", "seq_masked_fraction", "lr_scale",
        }  # fmt: skip
        assert all(math.isfinite(v) for v in difference[side].values())


def test_side_effects_are_noted_even_when_the_weights_agree():
    # NeMo-RL's sequence weight needs GSPO's PPO ratio and a sequence-mean loss.
    out = export(verl.PRESETS["decoupled_seq_is"], "nemo_rl")
    assert any("comes with GSPO" in note for note in out.notes)
    assert (out.spec.sequence_level_importance_ratios, out.spec.token_level_loss) == (True, False)
    # Fireworks' weight is always on: only its rollout anchor (a bypass) makes it 1.
    out = export(verl.PRESETS["disabled"], "fireworks", batch=BATCH)
    assert out.difference["identical"] and not out.exact
    assert out.spec.anchor_logp == "rollout"
    assert any("anchor_logp: rollout" in note for note in out.notes)


def test_same_rule_on_another_numerical_path_is_verified_on_the_batch():
    # verl clamps log-ratios to +-20 before e^d; TRL does not: a token at d = -30 differs.
    spec = verl.PRESETS["decoupled_token_is"]
    assert not export(spec, "trl").exact
    on_random = export(spec, "trl", batch=BATCH)
    assert on_random.exact and on_random.difference["identical"]
    on_edges = export(spec, "trl", batch=EDGES)
    assert not on_edges.exact
    assert any("they differ on this dump" in note for note in on_edges.notes)


def test_aggregation_difference_is_noted():
    out = export(verl.PRESETS["decoupled_geo_rs"], "skyrl", batch=BATCH)
    assert (
        "verl averages the loss over the batch's tokens (the tokens it rejects leave the "
        "count); SkyRL averages the loss over the batch's tokens: the same weights give a "
        "different step size (compare the LR scale)."
    ) in out.notes
    notes = export(skyrl.PRESETS["skyrl_token_tis"], "slime").notes
    assert any("slime averages each sequence's tokens, then the sequences" in n for n in notes)


def test_difference_is_skipped_without_the_policy_column():
    batch = make_batch([3, 4], policy=False)
    out = export(verl.PRESETS["bypass_pg_is"], "skyrl", batch=batch)
    assert out.difference is None
    assert any("Not measured on the batch" in note for note in out.notes)


def test_convert_errors_name_the_argument():
    spec = verl.PRESETS["decoupled_token_is"]
    with pytest.raises(ConfigError, match=r"Expected `to` to be one of 'verl', .*'megatron'"):
        export(spec, "megatron")
    with pytest.raises(ConfigError, match=r"`generation` to be None for skyrl"):
        export(spec, "skyrl", generation="gen1")
    with pytest.raises(ConfigError, match=r"Expected `generation` to be one of gen0, .*'v0.5'"):
        export(spec, "verl", generation="v0.5")


# ------------------------------------------------------------------ verl's older generations


def test_verl_gen0_tis_imp_ratio_cap():
    out = export(fireworks.PRESETS["fireworks_deepmath"], "verl", generation="gen0")
    assert yaml.safe_load(out.text) == {
        "actor_rollout_ref": {
            "actor": {"tis_imp_ratio_cap": 2.0},
            "rollout": {"calculate_log_probs": True},
        }
    }
    # Gen-0 has no +-20 clamp: exact only up to tokens below d = -20, which `notes` names.
    assert not out.exact
    assert any("without the later +-20 clamp" in note for note in out.notes)
    off = verl.to_generation(verl.PRESETS["disabled"], "gen0")
    assert off.config["actor_rollout_ref"]["actor"]["tis_imp_ratio_cap"] == -1 and off.exact


def test_verl_gen1_keys_and_dropped_features():
    out = export(nemo_rl.PRESETS["nemo_icepop"], "verl", generation="v0.6.0")
    assert out.exact
    # algorithm.* of v0.6.0's ppo_trainer.yaml; the veto (default 1e-4) explicitly off.
    assert yaml.safe_load(out.text)["algorithm"] == {
        "rollout_is": True,
        "rollout_is_threshold": 5.0,
        "rollout_is_threshold_lower": 0.5,
        "rollout_is_level": "token",
        "rollout_is_mode": "mask",
        "rollout_is_veto_threshold": None,
    }
    out = export(verl.PRESETS["decoupled_geo_rs_seq_tis"], "verl", generation="gen1")
    assert not out.exact
    assert out.spec == verl.VerlSpec(name="decoupled_geo_rs_seq_tis", is_level="sequence",
                                     is_upper=2.0)  # fmt: skip
    assert any("has no rejection sampling" in note for note in out.notes)
    # Bypass PPO-clip only logs its weight; dropping bypass must not switch the weight on.
    out = verl.to_generation(verl.VerlSpec(is_level="token", is_upper=2.0, bypass=True), "gen1")
    assert out.spec.is_level is None and out.config["algorithm"]["rollout_is"] is False


def test_verl_gen2_keys():
    out = export(verl.PRESETS["decoupled_seq_is_rs"], "verl", generation="v0.7.0")
    correction = yaml.safe_load(out.text)["algorithm"]["rollout_correction"]
    # v0.7.0's rollout_correction.yaml: ratio-space RS, a veto key, loss_type.
    assert correction == {
        "rollout_is": "sequence",
        "rollout_is_threshold": 2.0,
        "rollout_is_batch_normalize": False,
        "rollout_rs": "sequence",
        "rollout_rs_threshold": 2.0,
        "rollout_rs_threshold_lower": 0.5,
        "rollout_token_veto_threshold": None,
        "bypass_mode": False,
        "loss_type": "ppo_clip",
    }
    assert not out.exact  # ratio vs k1 comparisons: named in the notes
    pg = export(verl.PRESETS["bypass_pg_is"], "verl", generation="v0.6.1")
    correction = yaml.safe_load(pg.text)["algorithm"]["rollout_correction"]
    assert correction["use_policy_gradient"] is True and "loss_type" not in correction
    assert pg.exact
    icepop = export(verl.PRESETS["decoupled_token_icepop"], "verl", generation="gen2")
    assert icepop.spec.is_lower is None and not icepop.exact


def test_verl_gen3_before_icepop_strings():
    out = export(verl.PRESETS["decoupled_token_icepop"], "verl", generation="v0.7.1")
    assert (
        yaml.safe_load(out.text)["algorithm"]["rollout_correction"]["rollout_is_threshold"] == 5.0
    )
    assert any("has no IcePop" in note for note in out.notes)
    current = export(verl.PRESETS["decoupled_token_icepop"], "verl", generation="v0.8.0")
    assert current.exact and current.text == snippet(verl.PRESETS["decoupled_token_icepop"])


@pytest.mark.parametrize("device", ACCELERATORS)
def test_difference_on_device_matches_cpu(device):
    spec = verl.PRESETS["decoupled_seq_is"]
    cpu = export(spec, "areal", batch=WILD)
    other = export(spec, "areal", batch=WILD.to(device))
    assert other.exact == cpu.exact
    for side in ("source", "target"):
        assert other.difference[side] == pytest.approx(cpu.difference[side], rel=1e-6)


def test_a_bound_whose_float32_rounding_changes_a_mask_is_kept_whole():
    """Found by the round-trip property: NeMo-RL's icepop compares its ratio in float64 here,
    and e^d of a probe just beyond ln(0.5124621622946423) falls between the bound and its
    float32 value. The snippet keeps the bound whole, with no comment restating it."""
    spec = parse_config(
        {
            "framework": "nemo_rl",
            "loss_fn": {
                "use_importance_sampling_correction": True,
                "truncated_importance_sampling_type": "icepop",
                "truncated_importance_sampling_ratio": 1.001,
                "truncated_importance_sampling_ratio_min": 0.5124621622946423,
            },
        }
    )
    text = snippet(spec)
    assert "truncated_importance_sampling_ratio_min: 0.5124621622946423\n" in text
    assert identical(quiet_parse(from_snippet(spec)), spec, probe(spec))
