"""SkyRL's off-policy correction (`trainer.algorithm.off_policy_correction`) and its two
rollout-anchored policy losses (`policy_loss_type: rollout_is`, `cispo` with
`cispo.cispo_anchor: rollout`).

Replays NovaSky-AI/SkyRL@a9564572 (2026-08-21):
`skyrl/backends/skyrl_train/utils/off_policy_correction_utils.py` (`compute_off_policy_correction`),
the policy losses of `skyrl/backends/skyrl_train/utils/ppo_utils.py`, the config dataclasses of
`skyrl/train/config/config.py` (`OffPolicyCorrectionConfig`, `AlgorithmConfig`, `CISPOConfig`) and
the checks of `validate_cfg` in `skyrl/train/utils/utils.py`.

What SkyRL computes, in its order, inside every policy loss that applies the correction (`regular`,
`dual_clip`, `gspo`, `sapo`, `cispo`, `rollout_is`, `dppo`), after the loss's own per-token term:

0. d = old_log_probs - rollout_logprobs, rho = e^{clamp(d, +-20)}.
1. Outlier sequence mask (`outlier_token_is_threshold_low` / `_high`, either alone enables it): a
   sequence is dropped from the loss mask if any of its loss-mask tokens has rho > high or
   rho < low (bounds inclusive: a token exactly at a bound is in range).
2. Token mask (`token_mask_is_threshold_low` AND `_high`; SkyRL ignores a lone one): a token leaves
   the loss mask unless low <= rho <= high. A pure mask: kept tokens get no ratio weight.
3. TIS (`tis_ratio_type`), detached, multiplying the loss term: token: w_t = min(rho_t,
   `token_tis_ratio_clip_high`); sequence: w = min(e^{clamp(S', +-20)},
   `sequence_tis_ratio_clip_high`), S' the sum of d over the loss mask AS UPDATED by steps 1-2. No
   lower clamp.
4. Sequence mask (`sequence_mask_metric`) over the same updated mask: geometric:
   G' = S' / max(T', 1), keep iff geo_mask_low <= e^{clamp(G', +-20)} <= geo_mask_high (a row
   with no token left has G' = 0, ratio 1, and passes the default bounds); product: keep iff
   product_mask_low <= e^{clamp(S', +-20)} <= product_mask_high.
5. loss = sum(term * w * mask); the denominators (advantage pre-scaling by token counts) come from
   the ORIGINAL mask, so masked tokens simply contribute nothing.

The policy loss's own detached factor, replayed as part of `weight` (it needs `policy_logprob`):

- `rollout_is` (GLM-5 agentic loss): r = e^{clamp(policy - rollout, +-20)},
  w = r * 1[1 - eps_clip_low < r < 1 + eps_clip_high] (STRICT bounds, hard zero, mask unchanged).
- `cispo` with `cispo.cispo_anchor: rollout`: w = clamp(r, 1 - cispo_eps_clip_low,
  1 + cispo_eps_clip_high) ([0, 5] by default). The off-policy masks still apply on top; TIS is
  refused (it would count the mismatch twice).
- every other loss (and `cispo` anchored on `old`) multiplies by a PPO-side ratio against the
  trainer's own log-probs, which is not a mismatch correction: the replayed factor is 1.

`weight` is that factor times the TIS weight; `keep` is the updated loss mask. `raw` is r for
`rollout_is` / rollout-anchored `cispo`, the broadcast sequence ratio e^{clamp(S', +-20)} for
sequence TIS, and rho otherwise. `seq_raw` / `seq_weight` are set when a sequence-level stage runs:
the sequence TIS ratio and its truncated value, or (mask only) the mask statistic and 1; both
times 1[the sequence survives the outlier and sequence masks] for `seq_weight`.

Config keys: `trainer.algorithm.off_policy_correction.*` (all twelve), `trainer.algorithm.
{policy_loss_type, eps_clip_low, eps_clip_high, use_tis, tis_imp_ratio_cap}` and
`trainer.algorithm.cispo.{cispo_anchor, cispo_eps_clip_low, cispo_eps_clip_high}`. The other
`AlgorithmConfig` keys are type-checked and ignored, so a whole `trainer.algorithm` block parses.
Missing keys take the dataclass defaults (SkyRL's YAML and dataclass agree).

Where SkyRL's documentation (docs/corrections.md#skyrl) and its code differ, or the spec is silent,
the code wins:

- Legacy `use_tis: true` (utils.py:400-406) ALWAYS overwrites `tis_ratio_type` with "token" and
  `token_tis_ratio_clip_high` with `tis_imp_ratio_cap`, even when the new keys are set; SkyRL only
  logs a warning. `tis_imp_ratio_cap` defaults to -1.0 and SkyRL never checks it, so
  `use_tis: true` without a cap makes every weight min(rho, -1) = -1; iscore rejects a cap <= 0.
- A lone `token_mask_is_threshold_low` or `_high` is silently ignored by SkyRL
  (off_policy_correction_utils.py:17-20); the parser warns and replays no token mask.
- `clip_cov` / `kl_cov` never call the correction; `validate_cfg` (utils.py:438) rejects them only
  when `tis_ratio_type` or `sequence_mask_metric` is set, so outlier / token masks alone are
  accepted and silently do nothing (replayed as no correction). `cross_entropy` and
  `importance_sampling` likewise never apply it and are not rejected.
- `cispo_anchor: rollout` with `tis_ratio_type` raises only when the loss runs (ppo_utils.py:772);
  here it is a ConfigError at parse time.
- SkyRL never checks that caps are > 0, bounds >= 0, low <= high or eps >= 0; iscore does (a
  negative cap flips the gradient's sign, low > high masks everything).
- SkyRL exponentiates in float32 (`safe_exp_delta` casts to float32) and sums S in the log-probs'
  dtype; the replay works in float64, so a ratio within one float32 ulp of a bound may be decided
  differently (e.g. d = float32(ln 2): float32 gives rho = 2.0 exactly, float64 2.0000000038).
- The docs write the sequence and outlier masks with strict inequalities; the code keeps ratios
  equal to a bound (`>`/`<` reject), as replayed here.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, get_args

import numpy as np
import torch

from iscore.errors import ConfigError, DumpError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import Section, as_float, check_choice, top_level
from iscore.frameworks.base import BatchFields, Framework, Upstream
from iscore.frameworks.canonical import (
    BIG,
    Anchor,
    Canonical,
    Component,
    Translation,
    lost,
    mask_component,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "skyrl"

PolicyLossType = Literal[
    "regular",
    "dual_clip",
    "gspo",
    "sapo",
    "cispo",
    "rollout_is",
    "dppo",
    "clip_cov",
    "kl_cov",
    "cross_entropy",
    "importance_sampling",
]
POLICY_LOSS_TYPES: tuple[str, ...] = get_args(PolicyLossType)
"""SkyRL's built-in `PolicyLossRegistry` entries (custom registered losses cannot be replayed)."""

_WITHOUT_CORRECTION = ("clip_cov", "kl_cov", "cross_entropy", "importance_sampling")
"""Losses that never call `apply_off_policy_correction`."""

_ALGORITHM = "trainer.algorithm"
_OPC = f"{_ALGORITHM}.off_policy_correction"
_CISPO = f"{_ALGORITHM}.cispo"

# Field -> full SkyRL key, for messages.
_KEYS: dict[str, str] = {
    **{
        field: f"{_OPC}.{field}"
        for field in (
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
        )
    },
    "policy_loss_type": f"{_ALGORITHM}.policy_loss_type",
    "eps_clip_low": f"{_ALGORITHM}.eps_clip_low",
    "eps_clip_high": f"{_ALGORITHM}.eps_clip_high",
    "cispo_anchor": f"{_CISPO}.cispo_anchor",
    "cispo_eps_clip_low": f"{_CISPO}.cispo_eps_clip_low",
    "cispo_eps_clip_high": f"{_CISPO}.cispo_eps_clip_high",
}

# (low, high) field pairs that must satisfy low <= high when both are set.
_BOUND_PAIRS = (
    ("geo_mask_low", "geo_mask_high"),
    ("product_mask_low", "product_mask_high"),
    ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high"),
    ("token_mask_is_threshold_low", "token_mask_is_threshold_high"),
)


@dataclass(frozen=True, slots=True)
class SkyRLSpec:
    """A validated SkyRL off-policy correction setting; fields carry SkyRL's own key names.

    Args:
        name: display name.
        tis_ratio_type: "token", "sequence", or None (no TIS weight).
        token_tis_ratio_clip_high: token TIS cap.
        sequence_tis_ratio_clip_high: sequence TIS cap.
        sequence_mask_metric: "geometric", "product", or None (no sequence mask).
        geo_mask_low: lower bound on the geometric-mean ratio.
        geo_mask_high: upper bound on the geometric-mean ratio.
        product_mask_low: lower bound on the sequence product ratio.
        product_mask_high: upper bound on the sequence product ratio.
        outlier_token_is_threshold_low: drop a sequence with any token ratio below it; None: off.
        outlier_token_is_threshold_high: drop a sequence with any token ratio above it; None: off.
        token_mask_is_threshold_low: token mask lower bound; applied only with `_high` set.
        token_mask_is_threshold_high: token mask upper bound; applied only with `_low` set.
        policy_loss_type: `trainer.algorithm.policy_loss_type`.
        eps_clip_low: `rollout_is` keeps ratios above 1 - eps_clip_low.
        eps_clip_high: `rollout_is` keeps ratios below 1 + eps_clip_high.
        cispo_anchor: "old" or "rollout": what CISPO's ratio is taken against.
        cispo_eps_clip_low: CISPO clamps its ratio at 1 - cispo_eps_clip_low from below.
        cispo_eps_clip_high: CISPO clamps its ratio at 1 + cispo_eps_clip_high from above.

    >>> spec = SkyRLSpec(sequence_mask_metric="geometric")
    >>> opc = spec.to_config()["trainer"]["algorithm"]["off_policy_correction"]
    >>> spec.corrects, opc["geo_mask_low"], opc["geo_mask_high"]
    (True, 0.99, 1.01)
    """

    framework: ClassVar[str] = NAME

    name: str = NAME
    tis_ratio_type: Literal["token", "sequence"] | None = None
    token_tis_ratio_clip_high: float = 2.0
    sequence_tis_ratio_clip_high: float = 5.0
    sequence_mask_metric: Literal["product", "geometric"] | None = None
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    product_mask_low: float = 0.5
    product_mask_high: float = 2.0
    outlier_token_is_threshold_low: float | None = None
    outlier_token_is_threshold_high: float | None = None
    token_mask_is_threshold_low: float | None = None
    token_mask_is_threshold_high: float | None = None
    policy_loss_type: PolicyLossType = "regular"
    eps_clip_low: float = 0.2
    eps_clip_high: float = 0.2
    cispo_anchor: Literal["old", "rollout"] = "old"
    cispo_eps_clip_low: float = 1.0
    cispo_eps_clip_high: float = 4.0

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"Expected `name` to be a string, but got {quote(self.name)}")
        check_choice(_KEYS["tis_ratio_type"], self.tis_ratio_type, (None, "token", "sequence"))
        check_choice(
            _KEYS["sequence_mask_metric"], self.sequence_mask_metric, (None, "product", "geometric")
        )
        check_choice(_KEYS["policy_loss_type"], self.policy_loss_type, POLICY_LOSS_TYPES)
        check_choice(_KEYS["cispo_anchor"], self.cispo_anchor, ("old", "rollout"))
        for field in ("token_tis_ratio_clip_high", "sequence_tis_ratio_clip_high"):
            _set_float(self, field, gt=0.0)
        for field in ("eps_clip_low", "eps_clip_high", "cispo_eps_clip_low", "cispo_eps_clip_high"):
            _set_float(self, field, ge=0.0)
        for low, high in _BOUND_PAIRS:
            optional = low.startswith(("outlier", "token"))
            for field in (low, high):
                if not optional or getattr(self, field) is not None:
                    _set_float(self, field, ge=0.0)
            lo, hi = getattr(self, low), getattr(self, high)
            if lo is not None and hi is not None and lo > hi:
                raise ConfigError(
                    f"Expected `{_KEYS[low]}` <= `{_KEYS[high]}` ({quote(hi)}), but got "
                    f"{quote(lo)} "
                    "(SkyRL would mask every token)"
                )
        uses_weight_or_seq_mask = (
            self.tis_ratio_type is not None or self.sequence_mask_metric is not None
        )
        if self.policy_loss_type in ("clip_cov", "kl_cov") and uses_weight_or_seq_mask:
            raise ConfigError(
                f"Expected `{_KEYS['policy_loss_type']}` to support off_policy_correction, but got "
                f"{quote(self.policy_loss_type)}: SkyRL rejects `tis_ratio_type` / "
                "`sequence_mask_metric` with clip_cov and kl_cov"
            )
        if self.rollout_anchored_cispo and self.tis_ratio_type is not None:
            raise ConfigError(
                f"Expected `{_KEYS['tis_ratio_type']}` to be null with `{_KEYS['cispo_anchor']}: "
                f"rollout` (the CISPO ratio already corrects the mismatch; TIS would count it "
                f"twice), but got {quote(self.tis_ratio_type)}"
            )

    @property
    def rollout_anchored_cispo(self) -> bool:
        """Whether the loss is CISPO with its ratio taken against the rollout log-probs."""
        return self.policy_loss_type == "cispo" and self.cispo_anchor == "rollout"

    @property
    def needs_policy(self) -> bool:
        """Whether replaying needs the current policy's log-probs (`policy_logprob`)."""
        return self.policy_loss_type == "rollout_is" or self.rollout_anchored_cispo

    @property
    def token_mask_enabled(self) -> bool:
        """SkyRL applies the token mask only when both thresholds are set."""
        return (
            self.token_mask_is_threshold_low is not None
            and self.token_mask_is_threshold_high is not None
        )

    @property
    def outlier_mask_enabled(self) -> bool:
        """Either outlier threshold alone enables the outlier sequence mask."""
        return (
            self.outlier_token_is_threshold_low is not None
            or self.outlier_token_is_threshold_high is not None
        )

    @property
    def corrects(self) -> bool:
        """Whether the off-policy correction runs at all (some stage on, a loss that calls it)."""
        enabled = (
            self.tis_ratio_type is not None
            or self.sequence_mask_metric is not None
            or self.outlier_mask_enabled
            or self.token_mask_enabled
        )
        return enabled and self.policy_loss_type not in _WITHOUT_CORRECTION

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting in SkyRL's nesting, the inverse of `parse`."""
        opc = {field: getattr(self, field) for field in _KEYS if _KEYS[field].startswith(_OPC)}
        return {
            "framework": NAME,
            "name": self.name,
            "trainer": {
                "algorithm": {
                    "policy_loss_type": self.policy_loss_type,
                    "eps_clip_low": self.eps_clip_low,
                    "eps_clip_high": self.eps_clip_high,
                    "off_policy_correction": opc,
                    "cispo": {
                        "cispo_anchor": self.cispo_anchor,
                        "cispo_eps_clip_low": self.cispo_eps_clip_low,
                        "cispo_eps_clip_high": self.cispo_eps_clip_high,
                    },
                }
            },
        }

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weight and keep mask of this setting over `batch`.

        Raises:
            ConfigError: `rollout_is` or rollout-anchored `cispo` on a batch without the
                `policy_logprob` column.
        """
        if self.needs_policy and batch.policy is None:
            setting = f"`{_KEYS['policy_loss_type']}: {self.policy_loss_type}`"
            if self.rollout_anchored_cispo:
                setting += f" with `{_KEYS['cispo_anchor']}: rollout`"
            raise ConfigError(
                f"{setting} weights tokens by the current policy over the rollout and needs the "
                "`policy_logprob` column, which the dump lacks"
            )
        d = ops.log_ratio(batch)
        rho = ops.exp(d)
        loss_factor, raw = self._loss_factor(batch, rho)
        keep = batch.loss_mask
        if not self.corrects:
            return Replay.build(batch, _product(rho, loss_factor), keep, raw)

        # Steps 1-2 shrink the loss mask; steps 3-4 read the shrunk mask.
        seq_keep = torch.ones(batch.num_sequences, dtype=torch.bool, device=batch.device)
        if self.outlier_mask_enabled:
            in_range = ops.band(
                rho, self.outlier_token_is_threshold_low, self.outlier_token_is_threshold_high
            )
            seq_keep = ops.segment_all(in_range | ~keep, batch)
            keep = keep & ops.broadcast(seq_keep, batch)
        if self.token_mask_enabled:
            keep = keep & ops.band(
                rho, self.token_mask_is_threshold_low, self.token_mask_is_threshold_high
            )
        # Steps 3-4 at sequence level sum d over the shrunk mask.
        sequence_level = self.tis_ratio_type == "sequence" or self.sequence_mask_metric is not None
        seq_sum = ops.segment_sum(d, batch, keep) if sequence_level else None

        tis_weight = None
        seq_raw = seq_factor = None
        if self.tis_ratio_type == "token":
            tis_weight = ops.truncate(rho, upper=self.token_tis_ratio_clip_high)
        elif self.tis_ratio_type == "sequence":
            seq_raw = ops.exp(seq_sum)
            seq_factor = ops.truncate(seq_raw, upper=self.sequence_tis_ratio_clip_high)
            tis_weight = ops.broadcast(seq_factor, batch)
            if not self.needs_policy:
                raw = per_token(seq_raw, batch)

        if self.sequence_mask_metric is not None:
            if self.sequence_mask_metric == "geometric":
                # max(T', 1): a row with no token left gets G' = 0, i.e. ratio 1.
                count = ops.segment_count(batch, keep).clamp(min=1.0)
                statistic = ops.exp(seq_sum / count)
                in_bounds = ops.band(statistic, self.geo_mask_low, self.geo_mask_high)
            else:
                statistic = ops.exp(seq_sum)
                in_bounds = ops.band(statistic, self.product_mask_low, self.product_mask_high)
            seq_keep = seq_keep & in_bounds
            keep = keep & ops.broadcast(in_bounds, batch)
            if seq_raw is None:
                seq_raw, seq_factor = statistic, torch.ones_like(statistic)

        seq_weight = None if seq_factor is None else torch.where(seq_keep, seq_factor, 0.0)
        weight = _product(rho, loss_factor, tis_weight)
        return Replay.build(batch, weight, keep, raw, seq_raw=seq_raw, seq_weight=seq_weight)

    def _loss_factor(
        self, batch: TokenBatch, rho: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """The policy loss's own detached factor and the ratio it starts from (else None, for
        no factor, and rho)."""
        if not self.needs_policy:
            return None, rho
        ratio = ops.exp(ops.log_ratio(batch, "policy"))
        if self.policy_loss_type == "rollout_is":
            # Strict bounds: a ratio exactly at 1 +- eps is zeroed.
            inside = ops.compare("gt", ratio, 1.0 - self.eps_clip_low)
            inside &= ops.compare("lt", ratio, 1.0 + self.eps_clip_high)
            return torch.where(inside, ratio, 0.0), ratio
        bounded = ops.truncate(ratio, 1.0 - self.cispo_eps_clip_low, 1.0 + self.cispo_eps_clip_high)
        return bounded, ratio


def _product(like: torch.Tensor, *factors: torch.Tensor | None) -> torch.Tensor:
    """The product of the factors given (None: no factor), each [N]; ones like `like` if none
    is given. A missing factor is not multiplied in as 1, which would change nothing."""
    product = None
    for factor in factors:
        if factor is not None:
            product = factor if product is None else product * factor
    return torch.ones_like(like) if product is None else product


def _set_float(
    spec: SkyRLSpec, field: str, *, gt: float | None = None, ge: float | None = None
) -> None:
    """Validate a float field (ints and numeric strings accepted; NaN fails the bound) and
    store it as a float."""
    object.__setattr__(spec, field, as_float(getattr(spec, field), _KEYS[field], gt=gt, ge=ge))


def _ignored(section: Section, key: str, kind: str) -> None:
    """Type-check an `AlgorithmConfig` key that does not change the correction."""
    if kind == "bool":
        section.bool(key, False)
    elif kind == "float":
        section.float(key, 0.0)
    elif kind == "float?":
        section.float(key, None, nullable=True)
    elif kind == "int":
        section.int(key, 0)
    else:
        value = section.raw(key, None)
        if value is not None and not isinstance(value, str):
            raise ConfigError(
                f"Expected `{section.key(key)}` to be a string, but got {quote(value)}"
            )


# `AlgorithmConfig` keys that do not change the correction, with their types.
_IGNORED_ALGORITHM_KEYS = {
    "advantage_estimator": "str",
    "use_kl_in_reward": "bool",
    "use_kl_loss": "bool",
    "kl_loss_coef": "float",
    "use_entropy_loss": "bool",
    "entropy_loss_coef": "float",
    "temperature": "float?",
    "advantage_batch_normalize": "bool",
    "value_head_prefix": "str",
    "grpo_norm_by_std": "bool",
    "zero_variance_filter": "bool",
    "zero_variance_filter_tol": "float",
    "lambd": "float",
    "gamma": "float",
    "clip_ratio_c": "float",
    "value_clip": "float",
}
_IGNORED_SUBSECTIONS = {
    "kl_ctrl": {"kl_target": "float", "horizon": "int"},
    "sapo": {"tau_pos": "float", "tau_neg": "float"},
    "dynamic_sampling": {"max_sample_batches": "int", "min_replace_ratio": "float"},
    "clip_cov": {"clip_ratio": "float", "clip_cov_lb": "float", "clip_cov_ub": "float"},
    "kl_cov": {"kl_cov_frac": "float", "ppo_kl_coef": "float"},
    "dppo": {"delta_low": "float", "delta_high": "float"},
}
_LOSS_REDUCTIONS = (
    "token_mean",
    "token_mean_legacy",
    "sequence_mean",
    "seq_mean_token_sum_norm",
    "prompt_mean",
)


def _parse_ignored(algorithm: Section) -> None:
    """Type-check the rest of `trainer.algorithm`, with the checks `validate_cfg` makes."""
    for key, kind in _IGNORED_ALGORITHM_KEYS.items():
        _ignored(algorithm, key, kind)
    for name, keys in _IGNORED_SUBSECTIONS.items():
        section = algorithm.section(name)
        for key, kind in keys.items():
            _ignored(section, key, kind)
        if name == "kl_ctrl":
            section.choice("type", "fixed", ("fixed", "adaptive"))
        elif name == "dynamic_sampling":
            section.choice("type", None, (None, "filter", "replace"))
        elif name == "dppo":
            section.choice("dppo_type", "binary_tv", ("binary_tv", "binary_kl"))
        section.done()
    algorithm.choice("kl_estimator_type", "k3", ("k1", "k2", "k3", "abs"))
    reduction = algorithm.choice("loss_reduction", "token_mean", _LOSS_REDUCTIONS)
    max_seq_len = algorithm.int("max_seq_len", None, ge=1)
    if reduction == "seq_mean_token_sum_norm" and max_seq_len is None:
        raise ConfigError(
            f"Missing `{_ALGORITHM}.max_seq_len`: SkyRL requires it with "
            f"`{_ALGORITHM}.loss_reduction: seq_mean_token_sum_norm`"
        )
    if algorithm.data.get("use_kl_in_reward") and algorithm.data.get("use_kl_loss", True):
        raise ConfigError(
            f"Expected `{_ALGORITHM}.use_kl_in_reward` and `{_ALGORITHM}.use_kl_loss` not to be "
            "both true (SkyRL makes them mutually exclusive; `use_kl_loss` defaults to true)"
        )


def parse(config: Mapping[str, Any]) -> SkyRLSpec:
    """Parse a SkyRL config (`trainer.algorithm...`, plus `framework: skyrl` and `name:`).

    >>> opc = {"sequence_mask_metric": "geometric", "tis_ratio_type": "token"}
    >>> algorithm = {"off_policy_correction": opc}
    >>> spec = parse({"framework": "skyrl", "trainer": {"algorithm": algorithm}})
    >>> spec.sequence_mask_metric, spec.tis_ratio_type, spec.token_tis_ratio_clip_high
    ('geometric', 'token', 2.0)

    Raises:
        ConfigError: an unknown key, a wrong type or value, or a combination SkyRL rejects; the
            message names the key.
    """
    top, name = top_level(config, NAME)
    trainer = top.section("trainer")
    top.done()
    algorithm = trainer.section("algorithm")
    trainer.done()

    opc = algorithm.section("off_policy_correction")
    fields: dict[str, Any] = {
        "tis_ratio_type": opc.choice("tis_ratio_type", None, (None, "token", "sequence")),
        "sequence_mask_metric": opc.choice(
            "sequence_mask_metric", None, (None, "product", "geometric")
        ),
    }
    for field in SkyRLSpec.__dataclass_fields__:
        if _KEYS.get(field, "").startswith(_OPC) and field not in fields:
            default = SkyRLSpec.__dataclass_fields__[field].default
            fields[field] = opc.float(field, default, nullable=default is None)
    opc.done()

    cispo = algorithm.section("cispo")
    fields["cispo_anchor"] = cispo.choice("cispo_anchor", "old", ("old", "rollout"))
    fields["cispo_eps_clip_low"] = cispo.float("cispo_eps_clip_low", 1.0)
    fields["cispo_eps_clip_high"] = cispo.float("cispo_eps_clip_high", 4.0)
    cispo.done()

    fields["policy_loss_type"] = algorithm.choice("policy_loss_type", "regular", POLICY_LOSS_TYPES)
    fields["eps_clip_low"] = algorithm.float("eps_clip_low", 0.2)
    fields["eps_clip_high"] = algorithm.float("eps_clip_high", 0.2)
    _apply_legacy_tis(algorithm, fields)
    _parse_ignored(algorithm)
    algorithm.done()

    if (fields["token_mask_is_threshold_low"] is None) != (
        fields["token_mask_is_threshold_high"] is None
    ):
        warnings.warn(
            f"SkyRL applies the token mask only when both `{_OPC}.token_mask_is_threshold_low` "
            "and `_high` are set; the one given is ignored",
            UserWarning,
            stacklevel=2,
        )
    spec = SkyRLSpec(name=name, **fields)
    if spec.policy_loss_type in _WITHOUT_CORRECTION and (
        spec.outlier_mask_enabled or spec.token_mask_enabled
    ):
        warnings.warn(
            f"SkyRL's `{spec.policy_loss_type}` loss never applies `{_OPC}`; "
            "the outlier / token masks configured do nothing",
            UserWarning,
            stacklevel=2,
        )
    return spec


def _apply_legacy_tis(algorithm: Section, fields: dict[str, Any]) -> None:
    """Rewrite deprecated `use_tis` + `tis_imp_ratio_cap` into token TIS, as `validate_cfg` does
    (overriding `tis_ratio_type` and `token_tis_ratio_clip_high` even when they are set)."""
    use_tis = algorithm.bool("use_tis", False)
    cap = algorithm.float("tis_imp_ratio_cap", -1.0)
    if not use_tis:
        return
    if not cap > 0:
        raise ConfigError(
            f"Expected `{_ALGORITHM}.tis_imp_ratio_cap` to be a float > 0 with "
            f"`{_ALGORITHM}.use_tis: true`, but got {quote(cap)} (SkyRL would clamp every TIS "
            "weight "
            "to it)"
        )
    overridden = [
        f"`{_KEYS[field]}: {fields[field]!r}`"
        for field, value in (("tis_ratio_type", "token"), ("token_tis_ratio_clip_high", cap))
        if fields[field] not in (value, SkyRLSpec.__dataclass_fields__[field].default)
    ]
    warnings.warn(
        f"`{_ALGORITHM}.use_tis` is deprecated in SkyRL: it is rewritten to "
        f"`{_OPC}.tis_ratio_type: token` and `{_OPC}.token_tis_ratio_clip_high: {cap!r}`"
        + (f", overriding {' and '.join(overridden)}" if overridden else ""),
        UserWarning,
        stacklevel=3,
    )
    fields["tis_ratio_type"] = "token"
    fields["token_tis_ratio_clip_high"] = cap


def _presets() -> dict[str, SkyRLSpec]:
    """SkyRL's documented settings (docs/content/docs/algorithms/off_policy_correction.mdx)."""
    geo = {"sequence_mask_metric": "geometric"}
    token_tis = {"tis_ratio_type": "token", "token_tis_ratio_clip_high": 2.0}
    token_mask = {"token_mask_is_threshold_low": 0.5, "token_mask_is_threshold_high": 2.0}
    outlier = {"outlier_token_is_threshold_low": 1e-4, "outlier_token_is_threshold_high": 100.0}
    table: dict[str, dict[str, Any]] = {
        # The TL;DR's first recommendation, and the examples' default since 2026-05-13.
        "skyrl_geo_mask": geo,
        "skyrl_token_tis": token_tis,
        "skyrl_sequence_tis": {"tis_ratio_type": "sequence"},
        "skyrl_product_mask": {"sequence_mask_metric": "product"},
        "skyrl_token_mask": token_mask,
        "skyrl_outlier_mask": outlier,
        # Everything the TL;DR lists, stacked.
        "skyrl_tldr_stack": {**geo, **token_tis, **token_mask, **outlier},
        "skyrl_rollout_is": {"policy_loss_type": "rollout_is"},
        "skyrl_cispo_rollout": {"policy_loss_type": "cispo", "cispo_anchor": "rollout"},
    }
    return {name: SkyRLSpec(name=name, **fields) for name, fields in table.items()}


PRESETS: dict[str, SkyRLSpec] = _presets()
"""SkyRL's documented recommendations, under descriptive iscore names."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: SkyRLSpec) -> Canonical:
    components: list[Component] = []
    if spec.policy_loss_type == "rollout_is":
        band = mask_component(
            "token",
            1.0 - spec.eps_clip_low,
            1.0 + spec.eps_clip_high,
            numerator="policy",
            numerics="clamp",
            strict=True,
        )
        components.append(
            weight_component("token", numerator="policy", numerics="clamp", zero=band)
        )
    elif spec.rollout_anchored_cispo:
        components.append(
            weight_component(
                "token",
                lower=1.0 - spec.cispo_eps_clip_low,
                upper=1.0 + spec.cispo_eps_clip_high,
                numerator="policy",
                numerics="clamp",
            )
        )
    sequence_stage = False
    if spec.corrects:
        if spec.outlier_mask_enabled:
            components.append(
                mask_component(
                    "any_token",
                    spec.outlier_token_is_threshold_low,
                    spec.outlier_token_is_threshold_high,
                    numerics="clamp",
                )
            )
        if spec.token_mask_enabled:
            components.append(
                mask_component(
                    "token",
                    spec.token_mask_is_threshold_low,
                    spec.token_mask_is_threshold_high,
                    numerics="clamp",
                )
            )
        if spec.tis_ratio_type == "token":
            components.append(
                weight_component("token", upper=spec.token_tis_ratio_clip_high, numerics="clamp")
            )
        elif spec.tis_ratio_type == "sequence":
            sequence_stage = True
            components.append(
                weight_component(
                    "sequence", upper=spec.sequence_tis_ratio_clip_high, numerics="clamp"
                )
            )
        if spec.sequence_mask_metric == "geometric":
            sequence_stage = True
            components.append(
                mask_component("geometric", spec.geo_mask_low, spec.geo_mask_high, numerics="clamp")
            )
        elif spec.sequence_mask_metric == "product":
            sequence_stage = True
            components.append(
                mask_component(
                    "sequence", spec.product_mask_low, spec.product_mask_high, numerics="clamp"
                )
            )
    anchor: Anchor = "recompute"
    if spec.needs_policy:
        anchor = "none"
    elif spec.policy_loss_type == "dppo":
        anchor = "rollout"
    # The outlier mask drops whole sequences, so only the token mask changes what the sequence
    # stages of the surviving sequences sum over.
    kept = spec.corrects and spec.token_mask_enabled and sequence_stage
    return Canonical(tuple(components), anchor, "kept" if kept else "original")


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    fields: dict[str, Any] = {}
    masks = list(c.masks)
    policy = [w for w in c.weights if w.numerator == "policy"]
    others = [w for w in c.weights if w.numerator != "policy"]
    for extra in [*policy[1:], *others[1:]]:
        lost(notes, extra, "SkyRL applies one weight of each kind; dropped")
    if policy:
        fields |= _skyrl_policy_loss(policy[0], notes)
    if others:
        w = others[0]
        if fields.get("policy_loss_type") == "cispo":
            lost(notes, w, "SkyRL refuses TIS beside rollout-anchored CISPO; dropped")
        else:
            masks += _skyrl_weight(w, fields, notes)
    sequence_stage = fields.get("tis_ratio_type") == "sequence"
    for m in masks:
        note_numerator(notes, m, "train", "SkyRL")
        bounds = ratio_bounds(m)
        level = ratio_level(m)
        if bounds is None or level in ("max", "geometric_unmasked"):
            lost(notes, m, "no SkyRL mask expresses it; dropped")
            continue
        if m.strict:
            lost(notes, m, "SkyRL's mask bounds are inclusive")
        lower, upper = bounds
        if level == "any_token":
            keys = ("outlier_token_is_threshold_low", "outlier_token_is_threshold_high")
            values = (lower, upper)
        elif level == "token":
            # SkyRL ignores a token mask with one bound: both are always written.
            keys = ("token_mask_is_threshold_low", "token_mask_is_threshold_high")
            values = (lower or 0.0, upper if upper is not None else BIG)
        else:
            metric = "geometric" if level == "geometric" else "product"
            prefix = "geo_mask" if metric == "geometric" else "product_mask"
            if fields.get("sequence_mask_metric") not in (None, metric):
                lost(notes, m, "SkyRL takes one sequence mask; dropped")
                continue
            fields["sequence_mask_metric"] = metric
            sequence_stage = True
            keys = (f"{prefix}_low", f"{prefix}_high")
            values = (lower or 0.0, upper if upper is not None else BIG)
        if any(fields.get(k) is not None for k in keys):
            lost(notes, m, "SkyRL takes one mask of this kind; dropped")
            continue
        fields |= dict(zip(keys, values, strict=True))
    token_mask = fields.get("token_mask_is_threshold_low") is not None
    if token_mask and sequence_stage and c.sequence_over == "original":
        notes.append(
            "SkyRL computes its sequence ratios over the tokens its token mask kept, not over "
            "the whole loss mask"
        )
    if c.sequence_over == "kept" and not (token_mask and sequence_stage):
        notes.append("the source's sequence ratios ran over the tokens its token mask kept")
    if c.normalize is not None:
        lost(notes, c.normalize, "SkyRL has no batch normalization; dropped")
    return [(SkyRLSpec(name=name, **fields), tuple(notes))]


def _skyrl_policy_loss(w: Component, notes: list[str]) -> dict[str, Any]:
    """SkyRL's rollout-anchored loss closest to a current-policy weight: rollout_is or
    cispo with `cispo_anchor: rollout`, both REINFORCE-style (-sg(w) * A * log pi)."""
    if w.level != "token":
        lost(notes, w, "SkyRL's current-policy weights are per token")
    zero = w.zero
    if zero is not None and w.lower is None and w.upper is None:
        lower, upper = ratio_bounds(zero) or (None, None)
        if not zero.strict:
            lost(notes, zero, "SkyRL's rollout_is loss also zeroes ratios exactly at a bound")
        eps = {
            "eps_clip_low": 1.0 if lower is None else 1.0 - lower,
            "eps_clip_high": BIG if upper is None else upper - 1.0,
        }
        loss = "rollout_is"
    else:
        if zero is not None:
            lost(notes, zero, "SkyRL's CISPO truncates and cannot zero; the band is dropped")
        eps = {
            "cispo_eps_clip_low": 1.0 if w.lower is None else 1.0 - w.lower,
            "cispo_eps_clip_high": BIG if w.upper is None else w.upper - 1.0,
        }
        loss = "cispo"
    for key, value in eps.items():
        if value < 0:
            lost(notes, w, f"SkyRL's bounds lie around 1 (`{key}` >= 0); {key} set to 0")
            eps[key] = 0.0
    extra = {"cispo_anchor": "rollout"} if loss == "cispo" else {}
    return {"policy_loss_type": loss, **extra, **eps}


def _skyrl_weight(w: Component, fields: dict[str, Any], notes: list[str]) -> list[Component]:
    """SkyRL's TIS closest to a weight; returns its zeroing band, which SkyRL can only mask."""
    note_numerator(notes, w, "train", "SkyRL")
    level = "sequence" if w.level == "sequence" else "token"
    if w.level not in ("token", "sequence"):
        lost(notes, w, "SkyRL has no geometric-mean weight; written as token TIS")
    extra = []
    if w.zero is not None:
        extra.append(w.zero)
        lost(notes, w.zero, "SkyRL removes those from the loss mask instead of zeroing the weight")
    if w.lower is not None:
        lost(notes, w, f"SkyRL's TIS has no lower clamp; weights below {w.lower:g} pass")
    if w.upper is None:
        if w.zero is None:
            lost(notes, w, "SkyRL always truncates; a cap of 1e9, above e^20, never binds")
        cap = BIG
    else:
        cap = w.upper
    fields |= {"tis_ratio_type": level, f"{level}_tis_ratio_clip_high": cap}
    return extra


# ------------------------------------------------------------------ dump adapter


def read_batch(batch: Any) -> list[BatchFields]:
    """SkyRL's `TrainingInputBatch` -> its dump fields.

    SkyRL hands it to every callback's `on_step_end(trainer, callback_input, control)` as
    `callback_input.batch` (skyrl/train/trainer.py at NovaSky-AI/SkyRL@a9564572, l.456;
    `RayPPOTrainer.add_callback`, l.170; `DumpCallback` below), and pickles the same object with
    `trainer.dump_data_batch` (l.441-446). A dict of tensors plus `metadata`
    (skyrl/backends/skyrl_train/training_batch.py, `TensorBatch`), built in
    `convert_to_training_input` (trainer.py l.926-939):

    - [B, R] response tensors, RIGHT-aligned (padding on the left): `rollout_logprobs` (None
      without `generator.sampling_params.logprobs`), `action_log_probs` (the trainer's forward
      before the update, l.1380), `response_mask` (the response tokens), `loss_mask` (0 on
      tool output), `advantages` (per token, l.1194).
    - `sequences` [B, S], prompt + response left-padded: a row's response ends it, so its
      last R columns hold the tokens of the response tensors.
    - `metadata["pad_size"]`: rows appended so that B divides by the data-parallel size
      (l.977-978), copies of row 0 with a zero loss mask; left out here.
      `metadata["policy_prompt_boundaries"]`: (start, end) rows of each prompt (l.954), the
      groups. SkyRL drops the rewards before this point (l.436-438).
    """
    what = "SkyRL's TrainingInputBatch"
    rollout = _batch.need(
        batch,
        "rollout_logprobs",
        what,
        "SkyRL keeps the rollout engine's log-probs with generator.sampling_params.logprobs",
    )
    train = _batch.need(
        batch, "action_log_probs", what, "SkyRL computes them in fwd_logprobs_values_reward"
    )
    metadata = getattr(batch, "metadata", None) or {}
    pad = metadata.get("pad_size") or 0
    rows = len(rollout) - pad
    if not isinstance(pad, int) or rows < 0:
        raise DumpError(f"{what}: metadata pad_size {quote(pad)} is not a row count")
    mask = _batch.field(batch, "response_mask")
    loss_mask = _batch.field(batch, "loss_mask")
    if mask is None:
        mask, loss_mask = _batch.need(batch, "loss_mask", what, "SkyRL sets it in the batch"), None
    sequences = _batch.field(batch, "sequences")
    width = rollout.shape[1]

    def head(value: Any) -> Any:
        return None if value is None else value[:rows]

    return [
        BatchFields(
            rollout[:rows],
            train[:rows],
            mask=mask[:rows],
            loss_mask=head(loss_mask),
            advantages=head(_batch.field(batch, "advantages")),
            token_ids=None if sequences is None else sequences[:rows, sequences.shape[1] - width :],
            group_ids=_prompt_groups(metadata.get("policy_prompt_boundaries"), rows),
        )
    ]


def _prompt_groups(boundaries: Any, rows: int) -> np.ndarray | None:
    """Each row's prompt from SkyRL's (start, end) prompt boundaries, if they cover every row."""
    if not isinstance(boundaries, list | tuple):
        return None
    groups = np.full(rows, -1, dtype=np.int64)
    for index, (start, end) in enumerate(boundaries):
        groups[int(start) : int(end)] = index
    return groups if (groups >= 0).all() else None


class DumpCallback:
    """A SkyRL training callback that writes each step's batch:
    `trainer.add_callback(DumpCallback(writer))`.

    SkyRL calls every event of a callback by name (`CallbackHandler._dispatch`,
    skyrl/train/utils/callbacks.py); this one writes at `on_step_end` and closes the writer at
    `on_train_end`, and ignores the others, so it needs no SkyRL import.

    Args:
        writer: an `iscore.dump.writer.DumpWriter` with `framework="skyrl"`.
    """

    def __init__(self, writer: Any):
        self.writer = writer

    def on_step_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        self.writer.add_batch(callback_input.batch, step=callback_input.global_step)

    def on_train_end(self, trainer: Any, callback_input: Any, control: Any) -> None:
        self.writer.close()

    def __getattr__(self, name: str) -> Any:
        if name.startswith("on_"):
            return _ignore
        raise AttributeError(name)


def _ignore(*args: Any, **kwargs: Any) -> None:
    """An event `DumpCallback` does not act on."""


# ------------------------------------------------------------------ the framework

FRAMEWORK = Framework(
    name=NAME,
    title="SkyRL",
    upstream=Upstream("NovaSky-AI/SkyRL", "a9564572eb8e91076be43c1bd5e4615e3de17265", "2026-08-21"),
    spec_types=(SkyRLSpec,),
    parse=parse,
    presets=lambda: PRESETS,
    default="skyrl_geo_mask",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=snippets.nested,
    families=frozenset({"token_tis", "seq_tis", "geometric_mask", "product_mask"}),
    support="trainer.algorithm.enable_sample_support_replay scores the recorded support (#2239, "
    "open; the capture, #2237, is merged)",
    columns={"train_logprob": ("action_log_probs",)},  # TrainingInputBatch
    metrics={
        "abs_diff_mean": ("policy/rollout_train_logprobs_abs_diff_mean",),
        "abs_diff_max": ("policy/rollout_train_logprobs_abs_diff_max",),
        "ratio_mean": ("is_ratio_mean",),
    },
    read_batch=read_batch,
)
