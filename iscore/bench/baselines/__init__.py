"""Independent implementations of the default settings' corrections, to check and time iscore by.

- `padded`: float32 tensors padded to [B, max_len], the way the frameworks write them, and the
  key statistics;
- `dataframe`: pandas groupby in float64, and every statistic `analyze` reports;
- `comparison`: both beside iscore on the same tokens, their agreement and their timings.

Neither calls the engine's replay: each restates one framework's formulas for the shape of
its default setting (`iscore.bench.SETTINGS`) and reads every threshold from the spec, so a
setting of that shape with other thresholds (a preset changed, a config) is checked as well.
`implements` says which settings have that shape. Unlike the engine, which asks the framework
registry, the baselines name each framework's spec class: restating a framework is their job.

>>> from dataclasses import replace
>>> from iscore.frameworks.resolve import resolve
>>> spec = resolve("verl:decoupled_geo_rs_token_tis")
>>> implements(spec), implements(replace(spec, is_upper=3.0))
(True, True)
>>> implements(resolve("verl:decoupled_token_is"))  # token TIS without the RS criterion
False
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from iscore.frameworks.areal import ArealCorrection
from iscore.frameworks.fireworks import FireworksTIS
from iscore.frameworks.nemo_rl import NemoRLSpec
from iscore.frameworks.openrlhf import OpenRLHFCorrection
from iscore.frameworks.skyrl import SkyRLSpec
from iscore.frameworks.slime import SlimeCorrection
from iscore.frameworks.trl import TRLCorrection
from iscore.frameworks.verl import VerlSpec


def implements(spec: Any) -> bool:
    """Whether the baselines implement `spec`: a setting of the shape of its framework's
    default one, with any thresholds."""
    shape = _SHAPES.get(type(spec))
    return shape is not None and shape(spec)


def _verl(spec: Any) -> bool:
    # Token TIS (no IcePop band, no batch normalization) and one seq_mean_k1 RS criterion.
    return (
        isinstance(spec, VerlSpec)
        and spec.is_level == "token"
        and spec.is_lower is None
        and not spec.batch_normalize
        and not spec.bypass
        and [c.option for c in spec.rs] == ["seq_mean_k1"]
    )


def _skyrl(spec: Any) -> bool:
    # Token TIS, the geometric sequence mask, both outlier bounds and the token mask.
    return (
        isinstance(spec, SkyRLSpec)
        and spec.corrects
        and not spec.needs_policy
        and spec.tis_ratio_type == "token"
        and spec.sequence_mask_metric == "geometric"
        and spec.outlier_token_is_threshold_low is not None
        and spec.outlier_token_is_threshold_high is not None
        and spec.token_mask_enabled
    )


def _nemo_rl(spec: Any) -> bool:
    # Token-level IcePop, applied.
    return (
        isinstance(spec, NemoRLSpec)
        and spec.use_importance_sampling_correction
        and spec.truncated_importance_sampling_type == "icepop"
        and spec.level == "token"
    )


def _slime(spec: Any) -> bool:
    # mis.py at token level: truncate, RS with a veto, batch normalization.
    mis = spec.mis if isinstance(spec, SlimeCorrection) else None
    return (
        mis is not None
        and spec.use_tis
        and spec.tis_function == "mis"
        and spec.numerator == "train"
        and (mis.tis_level, mis.rs_level, mis.tis_mode) == ("token", "token", "truncate")
        and mis.use_rs
        and mis.rs_veto_threshold is not None
        and mis.tis_batch_normalize
    )


def _areal(spec: Any) -> bool:
    # Decoupled loss; a sequence mask on the geometric-mean ratio.
    rs = spec.rejection_sampling if isinstance(spec, ArealCorrection) else None
    return (
        rs is not None
        and spec.use_decoupled_loss
        and (rs.level, rs.action, rs.metric, rs.agg) == ("sequence", "mask", "ratio", "mean")
    )


def _openrlhf(spec: Any) -> bool:
    # Token-level IcePop with both bounds, applied.
    return (
        isinstance(spec, OpenRLHFCorrection)
        and spec.enable
        and spec.type == "icepop"
        and spec.lower is not None
        and spec.policy_loss_type != "gspo"
    )


def _trl(spec: Any) -> bool:
    # The sequence mask, applied.
    return isinstance(spec, TRLCorrection) and spec.active and spec.mode == "sequence_mask"


def _fireworks(spec: Any) -> bool:
    # Token TIS against the trainer's log-probs, no IcePop.
    return (
        isinstance(spec, FireworksTIS)
        and spec.level == "token"
        and spec.icepop_threshold is None
        and spec.anchor_logp == "old_policy"
    )


_SHAPES: dict[type, Callable[[Any], bool]] = {
    VerlSpec: _verl,
    SkyRLSpec: _skyrl,
    NemoRLSpec: _nemo_rl,
    SlimeCorrection: _slime,
    ArealCorrection: _areal,
    OpenRLHFCorrection: _openrlhf,
    TRLCorrection: _trl,
    FireworksTIS: _fireworks,
}
"""Each framework's spec class, and the shape of it the baselines implement."""
