"""SkyRL's off-policy correction against a float64 reference written from its formulas."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch

from iscore.errors import ConfigError
from iscore.frameworks import skyrl
from iscore.packed.batch import TokenBatch
from iscore.passes.replay import replay
from tests.unit.frameworks.conftest import edge_batch, make_batch, sequences

BOUND = 20.0

# Every key SkyRL's dataclasses give the correction, with its default.
DEFAULTS = {
    "tis_ratio_type": None,
    "token_tis_ratio_clip_high": 2.0,
    "sequence_tis_ratio_clip_high": 5.0,
    "sequence_mask_metric": None,
    "geo_mask_low": 0.99,
    "geo_mask_high": 1.01,
    "product_mask_low": 0.5,
    "product_mask_high": 2.0,
    "outlier_token_is_threshold_low": None,
    "outlier_token_is_threshold_high": None,
    "token_mask_is_threshold_low": None,
    "token_mask_is_threshold_high": None,
    "policy_loss_type": "regular",
    "eps_clip_low": 0.2,
    "eps_clip_high": 0.2,
    "cispo_anchor": "old",
    "cispo_eps_clip_low": 1.0,
    "cispo_eps_clip_high": 4.0,
}
ALGORITHM_KEYS = ("policy_loss_type", "eps_clip_low", "eps_clip_high")
CISPO_KEYS = ("cispo_anchor", "cispo_eps_clip_low", "cispo_eps_clip_high")


def config(**options) -> dict:
    """A SkyRL config in its own nesting from flat option names."""
    algorithm = {k: v for k, v in options.items() if k in ALGORITHM_KEYS}
    cispo = {k: v for k, v in options.items() if k in CISPO_KEYS}
    opc = {k: v for k, v in options.items() if k not in ALGORITHM_KEYS + CISPO_KEYS}
    algorithm["off_policy_correction"] = opc
    if cispo:
        algorithm["cispo"] = cispo
    return {"framework": "skyrl", "trainer": {"algorithm": algorithm}}


def reference(batch: TokenBatch, options: dict):
    """Per-token (weight, keep, raw) and per-sequence (seq_raw, seq_weight) in float64."""
    o = {**DEFAULTS, **options}
    token_mask_on = (
        o["token_mask_is_threshold_low"] is not None
        and o["token_mask_is_threshold_high"] is not None
    )
    outlier_on = (
        o["outlier_token_is_threshold_low"] is not None
        or o["outlier_token_is_threshold_high"] is not None
    )
    corrects = (
        o["tis_ratio_type"] is not None
        or o["sequence_mask_metric"] is not None
        or outlier_on
        or token_mask_on
    ) and o["policy_loss_type"] not in (
        "clip_cov",
        "kl_cov",
        "cross_entropy",
        "importance_sampling",
    )
    out = {name: [] for name in ("weight", "keep", "raw", "seq_raw", "seq_weight")}
    for rollout, train, policy, mask in sequences(batch):
        d = train - rollout
        rho = np.exp(np.clip(d, -BOUND, BOUND))
        raw = rho
        loss_weight = np.ones_like(d)
        if o["policy_loss_type"] == "rollout_is" or (
            o["policy_loss_type"] == "cispo" and o["cispo_anchor"] == "rollout"
        ):
            r = np.exp(np.clip(policy - rollout, -BOUND, BOUND))
            raw = r
            if o["policy_loss_type"] == "rollout_is":
                inside = (r > 1 - o["eps_clip_low"]) & (r < 1 + o["eps_clip_high"])
                loss_weight = np.where(inside, r, 0.0)
            else:
                loss_weight = np.clip(r, 1 - o["cispo_eps_clip_low"], 1 + o["cispo_eps_clip_high"])
        keep = mask.copy()
        tis = np.ones_like(d)
        seq_raw = seq_factor = None
        survives = True
        if corrects:
            if outlier_on:
                valid = rho[keep]
                low = o["outlier_token_is_threshold_low"]
                high = o["outlier_token_is_threshold_high"]
                survives = bool(
                    np.all(valid >= (low if low is not None else -np.inf))
                    and np.all(valid <= (high if high is not None else np.inf))
                )
                keep &= survives
            if token_mask_on:
                keep &= (rho >= o["token_mask_is_threshold_low"]) & (
                    rho <= o["token_mask_is_threshold_high"]
                )
            total = d[keep].sum()
            if o["tis_ratio_type"] == "token":
                tis = np.minimum(rho, o["token_tis_ratio_clip_high"])
            elif o["tis_ratio_type"] == "sequence":
                seq_raw = math.exp(np.clip(total, -BOUND, BOUND))
                seq_factor = min(seq_raw, o["sequence_tis_ratio_clip_high"])
                tis = np.full_like(d, seq_factor)
                if raw is rho:
                    raw = np.full_like(d, seq_raw)
            metric = o["sequence_mask_metric"]
            if metric is not None:
                if metric == "geometric":
                    stat = math.exp(np.clip(total / max(keep.sum(), 1), -BOUND, BOUND))
                    ok = o["geo_mask_low"] <= stat <= o["geo_mask_high"]
                else:
                    stat = math.exp(np.clip(total, -BOUND, BOUND))
                    ok = o["product_mask_low"] <= stat <= o["product_mask_high"]
                survives = survives and ok
                keep &= ok
                if seq_raw is None:
                    seq_raw, seq_factor = stat, 1.0
        out["weight"].append(np.where(keep, loss_weight * tis, 0.0))
        out["keep"].append(keep)
        out["raw"].append(raw)
        out["seq_raw"].append(seq_raw)
        out["seq_weight"].append(None if seq_factor is None else seq_factor * survives)
    result = {k: np.concatenate(out[k]) for k in ("weight", "keep", "raw")}
    for k in ("seq_raw", "seq_weight"):
        result[k] = None if out[k][0] is None else np.array(out[k], dtype=np.float64)
    return result


def reference_of(spec: skyrl.SkyRLSpec, batch: TokenBatch):
    """(weight, keep, raw) of `reference` for `spec`, for the registry's harness."""
    expected = reference(batch, {key: getattr(spec, key) for key in DEFAULTS})
    return expected["weight"], expected["keep"], expected["raw"]


def assert_matches(result, expected) -> None:
    np.testing.assert_array_equal(result.keep.cpu().numpy(), expected["keep"])
    np.testing.assert_allclose(result.weight.cpu().numpy(), expected["weight"], rtol=1e-6)
    np.testing.assert_allclose(result.raw.cpu().numpy(), expected["raw"], rtol=1e-6)
    for k in ("seq_raw", "seq_weight"):
        got = getattr(result, k)
        if expected[k] is None:
            assert got is None, k
        else:
            np.testing.assert_allclose(got.cpu().numpy(), expected[k], rtol=1e-6, err_msg=k)


CASES = {
    "none": {},
    "token_tis": {"tis_ratio_type": "token"},
    "token_tis_1.5": {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 1.5},
    "sequence_tis": {"tis_ratio_type": "sequence"},
    "sequence_tis_1.2": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 1.2},
    "geometric": {"sequence_mask_metric": "geometric"},
    "geometric_wide": {"sequence_mask_metric": "geometric", "geo_mask_low": 0.9},
    "product": {
        "sequence_mask_metric": "product",
        "product_mask_low": 0.8,
        "product_mask_high": 1.25,
    },
    "outlier": {"outlier_token_is_threshold_low": 0.95, "outlier_token_is_threshold_high": 1.05},
    "outlier_low": {"outlier_token_is_threshold_low": 0.97},
    "outlier_high": {"outlier_token_is_threshold_high": 1.03},
    "token_mask": {"token_mask_is_threshold_low": 0.97, "token_mask_is_threshold_high": 1.03},
    "stack_sequence": {
        "outlier_token_is_threshold_low": 0.9,
        "outlier_token_is_threshold_high": 1.1,
        "token_mask_is_threshold_low": 0.97,
        "token_mask_is_threshold_high": 1.03,
        "tis_ratio_type": "sequence",
        "sequence_tis_ratio_clip_high": 2.0,
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 0.97,
        "geo_mask_high": 1.03,
    },
    "geometric_after_token_mask": {
        "token_mask_is_threshold_low": 0.97,
        "token_mask_is_threshold_high": 1.03,
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 0.995,
        "geo_mask_high": 1.005,
    },
    "stack_token": {
        "tis_ratio_type": "token",
        "sequence_mask_metric": "product",
        "product_mask_low": 0.2,
        "product_mask_high": 5.0,
        "token_mask_is_threshold_low": 0.96,
        "token_mask_is_threshold_high": 1.04,
    },
    "rollout_is": {"policy_loss_type": "rollout_is"},
    "rollout_is_stack": {
        "policy_loss_type": "rollout_is",
        "eps_clip_low": 0.1,
        "eps_clip_high": 0.3,
        "tis_ratio_type": "token",
        "sequence_mask_metric": "geometric",
    },
    "cispo_rollout": {"policy_loss_type": "cispo", "cispo_anchor": "rollout"},
    "cispo_rollout_masks": {
        "policy_loss_type": "cispo",
        "cispo_anchor": "rollout",
        "cispo_eps_clip_low": 0.2,
        "cispo_eps_clip_high": 0.2,
        "sequence_mask_metric": "geometric",
        "outlier_token_is_threshold_high": 1.1,
    },
    "cispo_old_token_tis": {"policy_loss_type": "cispo", "tis_ratio_type": "token"},
    "gspo_sequence_tis": {"policy_loss_type": "gspo", "tis_ratio_type": "sequence"},
    "clip_cov_outlier_only": {
        "policy_loss_type": "clip_cov",
        "outlier_token_is_threshold_low": 0.9,
    },
}

# Bounds exactly at ratio 1.0, which d = 0 hits exactly.
EDGE_CASES = {
    "product_default": {"sequence_mask_metric": "product"},
    "geometric_at_one": {
        "sequence_mask_metric": "geometric",
        "geo_mask_low": 1.0,
        "geo_mask_high": 1.0,
    },
    "product_at_one": {
        "sequence_mask_metric": "product",
        "product_mask_low": 1.0,
        "product_mask_high": 1.0,
    },
    "token_mask_at_one": {"token_mask_is_threshold_low": 1.0, "token_mask_is_threshold_high": 1.0},
    "outlier_at_one": {
        "outlier_token_is_threshold_low": 1.0,
        "outlier_token_is_threshold_high": 1.0,
    },
    "sequence_tis_at_one": {"tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 1.0},
    "rollout_is_zero_eps": {
        "policy_loss_type": "rollout_is",
        "eps_clip_low": 0.0,
        "eps_clip_high": 0.0,
    },
    "outlier_default": {
        "outlier_token_is_threshold_low": 1e-4,
        "outlier_token_is_threshold_high": 100.0,
    },
}


def parse_quietly(cfg: dict) -> skyrl.SkyRLSpec:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return skyrl.parse(cfg)


@pytest.mark.parametrize("case", CASES)
def test_replay_matches_reference_random(random_batch, case):
    result = parse_quietly(config(**CASES[case])).replay(random_batch)
    assert_matches(result, reference(random_batch, CASES[case]))


@pytest.mark.parametrize("case", {**CASES, **EDGE_CASES})
def test_replay_matches_reference_edges(edges, case):
    options = {**CASES, **EDGE_CASES}[case]
    result = parse_quietly(config(**options)).replay(edges)
    assert_matches(result, reference(edges, options))


def test_random_cases_are_not_vacuous(random_batch):
    """Guard the parametrized comparisons: on every seed each case changes some weight or keep."""
    base = reference(random_batch, {})
    for case in set(CASES) - {"none", "clip_cov_outlier_only"}:
        changed = reference(random_batch, CASES[case])
        assert not (
            np.array_equal(changed["keep"], base["keep"])
            and np.allclose(changed["weight"], base["weight"])
        ), case


def batch_from_d(seqs: list[list[float]], masks: list[list[bool]] | None = None) -> TokenBatch:
    """One sequence per list of log-ratios, rollout log-probs -1 (d exact in float32)."""
    d = np.concatenate([np.asarray(s, dtype=np.float32) for s in seqs])
    rollout = np.full_like(d, -1.0)
    mask = np.concatenate(masks) if masks is not None else np.ones(d.size, bool)
    return TokenBatch(
        rollout=torch.from_numpy(rollout),
        train=torch.from_numpy(rollout + d),
        cu_seqlens=torch.tensor(np.cumsum([0] + [len(s) for s in seqs])),
        loss_mask=torch.from_numpy(mask),
        policy=torch.from_numpy(rollout + d),
    )


def test_masks_run_before_sequence_tis():
    """Steps 1-2 shrink the loss mask, and the sequence TIS product runs over what is left."""
    batch = batch_from_d([[0.25, 0.5, 5.0], [0.25, 0.125]])
    tis = {"tis_ratio_type": "sequence"}
    alone = skyrl.SkyRLSpec(**tis).replay(batch)
    assert alone.seq_raw[0].item() == pytest.approx(math.exp(5.75), rel=1e-6)
    assert alone.seq_weight.tolist() == pytest.approx([5.0, math.exp(0.375)], rel=1e-6)

    # The token mask drops the d = 5 token; the product is over the other two: e^0.75.
    masked = skyrl.SkyRLSpec(
        **tis, token_mask_is_threshold_low=0.5, token_mask_is_threshold_high=2.0
    ).replay(batch)
    assert masked.keep.tolist() == [True, True, False, True, True]
    assert masked.weight[:2].tolist() == pytest.approx([math.exp(0.75)] * 2, rel=1e-6)

    # The outlier mask drops the whole first sequence, leaving an empty product e^0 = 1.
    outlier = skyrl.SkyRLSpec(**tis, outlier_token_is_threshold_high=100.0).replay(batch)
    assert outlier.keep.tolist() == [False, False, False, True, True]
    assert outlier.seq_raw.tolist() == pytest.approx([1.0, math.exp(0.375)], rel=1e-6)
    assert outlier.seq_weight.tolist() == pytest.approx([0.0, math.exp(0.375)], rel=1e-6)
    assert outlier.weight[:3].tolist() == [0.0, 0.0, 0.0]


def test_geometric_mask_keeps_fully_masked_rows(edges):
    """A row without mask tokens has G = 0, ratio 1, inside the default [0.99, 1.01]."""
    result = skyrl.SkyRLSpec(sequence_mask_metric="geometric").replay(edges)
    assert result.seq_raw[3].item() == 1.0 and result.seq_weight[3].item() == 1.0
    # A row emptied by the token mask (d = +30 leaves [0.5, 2]) is also scored at ratio 1.
    batch = batch_from_d([[5.0], [0.5, 0.0]])
    spec = skyrl.SkyRLSpec(
        sequence_mask_metric="geometric",
        token_mask_is_threshold_low=0.5,
        token_mask_is_threshold_high=2.0,
    )
    emptied = spec.replay(batch)
    assert emptied.seq_raw[0].item() == 1.0 and emptied.seq_weight[0].item() == 1.0
    assert emptied.keep[0].item() is False
    # Second row: G = 0.25, e^0.25 > 1.01: masked.
    assert emptied.keep[1:].tolist() == [False, False]
    # Bounds excluding 1 reject the empty rows' sequence mask too.
    shifted = skyrl.SkyRLSpec(sequence_mask_metric="geometric", geo_mask_low=1.001).replay(edges)
    assert shifted.seq_weight[3].item() == 0.0


def test_ratios_clamped_at_20(edges):
    result = skyrl.SkyRLSpec(tis_ratio_type="token", token_tis_ratio_clip_high=1e12).replay(edges)
    # Sequence 1 is one token with d = +30; sequence 2 one with d = -30.
    assert result.raw[1].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert result.weight[1].item() == pytest.approx(math.exp(20.0), rel=1e-6)
    assert result.raw[2].item() == pytest.approx(math.exp(-20.0), rel=1e-6)


def test_rollout_is_bounds_are_strict(edges):
    """Sequence 0's policy ratio is exactly 1.0: zeroed when a bound sits at 1, kept otherwise."""
    strict = skyrl.SkyRLSpec(policy_loss_type="rollout_is", eps_clip_high=0.0).replay(edges)
    assert strict.weight[0].item() == 0.0 and strict.keep[0].item() is True
    loose = skyrl.SkyRLSpec(policy_loss_type="rollout_is").replay(edges)
    assert loose.weight[0].item() == 1.0
    # d = +30: ratio e^20, far outside (0.8, 1.2): hard zero, loss mask unchanged.
    assert loose.weight[1].item() == 0.0 and loose.keep[1].item() is True


def test_cispo_rollout_anchor_clamps_to_0_5(edges):
    result = skyrl.SkyRLSpec(policy_loss_type="cispo", cispo_anchor="rollout").replay(edges)
    assert result.weight[1].item() == 5.0
    assert result.weight[2].item() == pytest.approx(math.exp(-20.0), rel=1e-6)
    # Anchored on `old`, CISPO's ratio is PPO-side: no mismatch weight.
    old = skyrl.SkyRLSpec(policy_loss_type="cispo").replay(edges)
    assert torch.equal(old.weight, edges.loss_mask.float())


@pytest.mark.parametrize(
    "options",
    [{"policy_loss_type": "rollout_is"}, {"policy_loss_type": "cispo", "cispo_anchor": "rollout"}],
)
def test_policy_losses_need_policy_column(options):
    batch = make_batch([3, 4], policy=False)
    with pytest.raises(ConfigError, match="policy_logprob"):
        skyrl.SkyRLSpec(**options).replay(batch)


def test_legacy_use_tis_warns_and_maps():
    cfg = config()
    cfg["trainer"]["algorithm"] |= {"use_tis": True, "tis_imp_ratio_cap": 3.0}
    with pytest.warns(UserWarning, match=r"off_policy_correction\.tis_ratio_type: token"):
        spec = skyrl.parse(cfg)
    assert spec == skyrl.SkyRLSpec(tis_ratio_type="token", token_tis_ratio_clip_high=3.0)


def test_legacy_use_tis_overrides_new_keys():
    cfg = config(tis_ratio_type="sequence", token_tis_ratio_clip_high=1.5)
    cfg["trainer"]["algorithm"] |= {"use_tis": True, "tis_imp_ratio_cap": 3.0}
    with pytest.warns(UserWarning, match="overriding") as record:
        spec = skyrl.parse(cfg)
    assert "tis_ratio_type: 'sequence'" in str(record[0].message)
    assert spec.tis_ratio_type == "token" and spec.token_tis_ratio_clip_high == 3.0


def test_legacy_cap_ignored_without_use_tis():
    cfg = config()
    cfg["trainer"]["algorithm"] |= {"use_tis": False, "tis_imp_ratio_cap": 3.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert skyrl.parse(cfg) == skyrl.SkyRLSpec()


def test_lone_token_mask_threshold_warns_and_is_ignored(edges):
    with pytest.warns(UserWarning, match="both"):
        spec = skyrl.parse(config(token_mask_is_threshold_low=0.5))
    assert not spec.corrects
    assert torch.equal(spec.replay(edges).keep, edges.loss_mask)


def test_real_layouts_parse():
    # The docs' TL;DR, as SkyRL's YAML nesting, with OmegaConf-style numeric strings.
    tldr = config(
        sequence_mask_metric="geometric",
        geo_mask_low=0.99,
        geo_mask_high=1.01,
        tis_ratio_type="token",
        token_tis_ratio_clip_high=2.0,
        token_mask_is_threshold_low=0.5,
        token_mask_is_threshold_high=2.0,
        outlier_token_is_threshold_low="1e-4",
        outlier_token_is_threshold_high=100,
    )
    spec = skyrl.parse(tldr | {"name": "skyrl_tldr_stack"})
    assert spec == skyrl.PRESETS["skyrl_tldr_stack"]
    # A whole `trainer.algorithm` block with every AlgorithmConfig key at its default.
    algorithm = {
        "advantage_estimator": "grpo",
        "kl_ctrl": {"type": "fixed", "kl_target": 0.1, "horizon": 10000},
        "kl_estimator_type": "k3",
        "use_kl_in_reward": False,
        "use_kl_loss": True,
        "kl_loss_coef": 0.001,
        "use_entropy_loss": False,
        "entropy_loss_coef": 0.01,
        "temperature": None,
        "advantage_batch_normalize": False,
        "value_head_prefix": "value_head",
        "policy_loss_type": "regular",
        "loss_reduction": "token_mean",
        "grpo_norm_by_std": True,
        "zero_variance_filter": False,
        "zero_variance_filter_tol": 1e-6,
        "lambd": 1.0,
        "gamma": 1.0,
        "eps_clip_low": 0.2,
        "eps_clip_high": 0.2,
        "clip_ratio_c": 3.0,
        "tis_imp_ratio_cap": -1.0,
        "use_tis": False,
        "off_policy_correction": {k: DEFAULTS[k] for k in list(DEFAULTS)[:12]},
        "sapo": {"tau_pos": 1.0, "tau_neg": 1.05},
        "value_clip": 0.2,
        "dynamic_sampling": {"type": None, "max_sample_batches": 30, "min_replace_ratio": 0.3},
        "clip_cov": {"clip_ratio": 0.0002, "clip_cov_lb": 1.0, "clip_cov_ub": 5.0},
        "kl_cov": {"kl_cov_frac": 0.2, "ppo_kl_coef": 1.0},
        "cispo": {"cispo_eps_clip_low": 1.0, "cispo_eps_clip_high": 4.0, "cispo_anchor": "old"},
        "dppo": {"dppo_type": "binary_tv", "delta_low": 0.2, "delta_high": 0.2},
        "max_seq_len": None,
    }
    assert skyrl.parse({"framework": "skyrl", "trainer": {"algorithm": algorithm}}) == (
        skyrl.SkyRLSpec()
    )


def algorithm_config(**algorithm) -> dict:
    return {"framework": "skyrl", "trainer": {"algorithm": algorithm}}


INVALID = {
    "unknown_opc_key": (config(tis_ratio="token"), "off_policy_correction.tis_ratio`"),
    "unknown_algorithm_key": (algorithm_config(eps_clip=0.2), "trainer.algorithm.eps_clip`"),
    "unknown_trainer_key": ({"framework": "skyrl", "trainer": {"policy": {}}}, "trainer.policy"),
    "unknown_top_key": (config() | {"generator": {}}, "`generator`"),
    "tis_type": (config(tis_ratio_type="geometric"), "off_policy_correction.tis_ratio_type"),
    "mask_metric": (config(sequence_mask_metric="mean"), "sequence_mask_metric"),
    "cap_type": (config(token_tis_ratio_clip_high="abc"), "token_tis_ratio_clip_high"),
    "cap_zero": (config(sequence_tis_ratio_clip_high=0), "sequence_tis_ratio_clip_high"),
    "cap_null": (config(token_tis_ratio_clip_high=None), "token_tis_ratio_clip_high"),
    "negative_bound": (config(geo_mask_low=-0.5), "geo_mask_low"),
    "geo_low_above_high": (config(geo_mask_low=1.02), "geo_mask_low"),
    "product_low_above_high": (config(product_mask_high=0.4), "product_mask_low"),
    "outlier_low_above_high": (
        config(outlier_token_is_threshold_low=2.0, outlier_token_is_threshold_high=1.0),
        "outlier_token_is_threshold_low",
    ),
    "token_mask_low_above_high": (
        config(token_mask_is_threshold_low=2.0, token_mask_is_threshold_high=0.5),
        "token_mask_is_threshold_low",
    ),
    "policy_loss_type": (config(policy_loss_type="my_loss"), "policy_loss_type"),
    "clip_cov_tis": (
        config(policy_loss_type="clip_cov", tis_ratio_type="token"),
        "policy_loss_type",
    ),
    "kl_cov_mask": (
        config(policy_loss_type="kl_cov", sequence_mask_metric="geometric"),
        "policy_loss_type",
    ),
    "cispo_rollout_tis": (
        config(policy_loss_type="cispo", cispo_anchor="rollout", tis_ratio_type="sequence"),
        "off_policy_correction.tis_ratio_type",
    ),
    "cispo_anchor": (config(cispo_anchor="behavior"), "cispo.cispo_anchor"),
    "unknown_cispo_key": (algorithm_config(cispo={"anchor": "old"}), "cispo.anchor"),
    "negative_eps": (config(eps_clip_low=-0.1), "eps_clip_low"),
    "legacy_default_cap": (algorithm_config(use_tis=True), "tis_imp_ratio_cap"),
    "legacy_type": (algorithm_config(use_tis="yes"), "use_tis"),
    "loss_reduction": (algorithm_config(loss_reduction="mean"), "loss_reduction"),
    "max_seq_len": (algorithm_config(loss_reduction="seq_mean_token_sum_norm"), "max_seq_len"),
    "kl_both": (algorithm_config(use_kl_in_reward=True), "use_kl_in_reward"),
    "kl_ctrl_type": (algorithm_config(kl_ctrl={"type": "pid"}), "kl_ctrl.type"),
    "ignored_type": (algorithm_config(gamma="high"), "trainer.algorithm.gamma"),
    "algorithm_not_mapping": (
        {"framework": "skyrl", "trainer": {"algorithm": 3}},
        "trainer.algorithm",
    ),
    "name_type": (config() | {"name": 3}, "name"),
}


@pytest.mark.parametrize("case", INVALID)
def test_invalid_configs_raise_naming_the_key(case):
    cfg, key = INVALID[case]
    with pytest.raises(ConfigError) as excinfo:
        parse_quietly(cfg)
    assert key in str(excinfo.value)


def test_spec_validates_python_construction():
    with pytest.raises(ConfigError, match="token_tis_ratio_clip_high"):
        skyrl.SkyRLSpec(token_tis_ratio_clip_high=-1.0)
    assert skyrl.SkyRLSpec(geo_mask_low="0.9").geo_mask_low == 0.9


# Settings beyond the presets for the registry's harness (test_harness.py), which replays them
# against `reference_of` and on every device: the stacks of masks, TIS and policy losses.
EXTRA_SPECS = {
    case: skyrl.SkyRLSpec(name=case, **CASES[case])
    for case in ("stack_sequence", "stack_token", "rollout_is_stack", "cispo_rollout_masks")
}


def test_replay_dispatches_by_framework():
    batch = edge_batch()
    cfg = config(**CASES["stack_sequence"]) | {"name": "mine"}
    result = replay(batch, cfg)
    assert_matches(result, reference(batch, CASES["stack_sequence"]))
    assert skyrl.parse(cfg).name == "mine"
