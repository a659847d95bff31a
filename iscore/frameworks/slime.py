"""slime: the TIS hooks of `policy_loss_function` (`slime/backends/megatron_utils/loss.py`).

Source read: `THUDM/slime` @ 624b824a (2026-08-21): `slime/backends/megatron_utils/loss.py`
(`vanilla_tis_function`, `icepop_function`, `policy_loss_function`), `slime/utils/arguments.py`
(flags and their checks), `slime/backends/megatron_utils/actor.py` (when the trainer recomputes
log-probs), `examples/train_infer_mismatch_helper/{mis.py,mis.yaml}`; and PR #2084 head 8e0d556e
(open) for `slime.utils.ppo_utils.off_policy_is_function`.

What slime computes, in its order. With d_t = train - rollout (the recomputed `log_probs` over the
rollout engine's), the loss calls the TIS function iff `--use-tis` or `--get-mismatch-metrics`,
and then multiplies each token's PPO term by the weight it returns and reduces over the mask it
returns (denominators stay the original mask counts):

- no `--custom-tis-function-path`: `vanilla_tis_function`, w_t = clamp(e^{d_t}, tis_clip_low,
  tis_clip) (no +-20 clamp, both sides; the mask is unchanged).
- `...loss.icepop_function`: w_t = e^{d_t} * 1[tis_clip_low <= e^{d_t} <= tis_clip] (inclusive;
  kept tokens carry the raw ratio; the mask is unchanged).
- `...ppo_utils.off_policy_is_function` (PR #2084): vanilla's clamp on e^{policy - rollout}, the
  CURRENT policy over the rollout (needs the `policy_logprob` column).
- `examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp` (mis.py), configured by
  the YAML at `--custom-config-path` (given inline here as `custom_config:`). Unless the YAML's
  `use_tis` is true it returns before weighting: no weight, no mask change. Otherwise, per
  sequence, over the ORIGINAL loss mask:
  1. TIS: the log-ratio at `tis_level` (token: d_t; sequence: S = sum(d * mask); geometric:
     G = S / max(T, 1); broadcast), clamped to +-20, exponentiated; `tis_mode` truncate:
     clamp(w, 0, U); clip: clamp(w, L, U); mask: w stays raw, the mask drops tokens outside
     [L, U] (inclusive). L = `tis_lower_bound`, default 1/U; U = `tis_upper_bound`.
  2. RS (`use_rs`): the same ratio at `rs_level`, +-20 clamp, the mask drops tokens outside
     [`rs_lower_bound`, `rs_upper_bound`] (null: the TIS bounds); then the veto
     (`rs_veto_threshold`): a sequence with any mask token of d_t < log(veto) (unclamped, strict)
     is dropped entirely. Veto and RS only run with `use_tis`; `use_rs` alone does nothing.
  3. `tis_batch_normalize`: w /= mean(w) (skipped if the mean is <= 1e-8), the mean taken over
     the ORIGINAL mask, so tokens that steps 1-2 dropped still count: token level, the mean over
     all mask tokens; sequence level, the mean over ALL sequences (a fully masked one counts as 0)
     of each sequence's masked mean weight; geometric level raises.
- `--get-mismatch-metrics` (which slime lets through only with a custom function path) calls the
  function even without `--use-tis` and applies the pg_loss it returns. So with `icepop_function`
  (or an explicit vanilla path) the weights ARE applied; only mis.py leaves the loss unchanged
  (its `use_tis` is false). `--use-tis` is the switch slime's README documents; the flag's own
  help ("only return mismatch metrics") holds for mis.py alone.
- `--use-rollout-logprobs` (bypass): the PPO ratio is anchored on the rollout log-probs and no
  weight is applied. slime rejects it with `--use-tis`, but it checks that BEFORE merging the
  YAML, so a YAML `use_tis: true` still turns TIS on; then, unless `--get-mismatch-metrics`
  forces the recompute, the TIS numerator is the current policy (the "train" log-probs are the
  loss's own forward), and the replay uses the `policy_logprob` column.

Config: `args:` holds slime's launch flags as one shell string (line continuations and `#`
comments of a pasted script are fine) or a list of argv tokens; `custom_config:` holds the YAML
that `--custom-config-path` points to. The IS flags `--use-tis`, `--get-mismatch-metrics`,
`--tis-clip`, `--tis-clip-low`, `--custom-tis-function-path`, `--use-rollout-logprobs` and
`--custom-config-path` are parsed strictly (types checked by argparse, a stray value is an error);
every other flag (slime has hundreds: `--lr`, `--tensor-model-parallel-size`, ...) is accepted
and its name collected in the spec's `ignored_flags`, with its values dropped. Flags that look
like IS flags but do not exist in slime (`--tis-mode`, `--tis-level`, `--use-rs`, `--rs-*`,
`--use-rollout-correction`: mis.py's README spells its YAML keys as flags) raise. `custom_config`
keys: mis.py's (`use_rs`, `tis_level`, `rs_level`, `tis_mode`, `tis_lower_bound`,
`tis_upper_bound`, `rs_lower_bound`, `rs_upper_bound`, `rs_veto_threshold`,
`tis_batch_normalize`) and the slime arguments it overrides (`use_tis`, `tis_clip`,
`tis_clip_low`, set on `args` after slime's checks); any other key raises. mis.py's keys are read
only when mis.py is the function and is called; otherwise they are listed in `ignored_flags` as
`custom_config.<key>`.

Where slime's documentation (docs/corrections.md#slime) and its code differ, or the spec is silent
(the code wins):

- Order in `mis.py`: TIS (line 220; mask mode drops tokens there), the RS mask (244), the veto
  (259), then batch normalization (273). The masks multiply, so their order does not matter;
  batch normalization averages over the ORIGINAL `loss_masks` (lines 278-286), not the
  TIS/RS/veto-modified masks, so rejected tokens still count in the mean.
- Sequence-level batch normalization averages over every sequence of the batch, fully masked
  ones included as 0 (`sum(seq_weights_means) / len(seq_weights_means)`, line 286).
- `--use-rollout-logprobs` with `--use-tis` is only rejected when both come from the command line
  (`arguments.py` line 1854 runs before the YAML merge at line 2013).
- slime normalizes over the micro-batch its loss function sees; a dump does not record the
  micro-batches, so the replay normalizes over each training step (`batch.step`) of the dump.
- mis.py reads its keys from `args` and crashes (AttributeError) on a missing one. Here the keys
  with a null meaning (`tis_lower_bound`, `rs_lower_bound`, `rs_upper_bound`,
  `rs_veto_threshold`) may be omitted; `tis_upper_bound` is required whenever mis.py runs;
  `tis_level`, `tis_mode`, `use_rs` and `tis_batch_normalize` when `use_tis` is on; `rs_level`
  when `use_rs` is on. The YAML values are validated even when `use_tis` is off (mis.py would
  not reach its asserts then).
- Numeric strings ("1e-4", which `yaml.safe_load` reads as a string; mis.yaml warns about it) are
  accepted as numbers.
- slime checks `--tis-clip` and `--tis-clip-low` only for being floats (argparse), and mis.py
  checks the signs of none of its bounds. A negative ratio bound, a zero upper bound or
  `--tis-clip-low` above `--tis-clip` (torch's clamp then returns `--tis-clip` for every token;
  icepop zeroes every token) is refused here. A zero lower bound (slime's default) means none;
  equal bounds are accepted (a constant weight).
- slime computes in float32 (d as a float32 difference, float32 sums); the replay uses the exact
  float64 d and float64 sums; the veto compares d with the float32 log(veto) slime uses.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([-2.0, 0.0]),
...                cu_seqlens=torch.tensor([0, 2]))
>>> spec = parse({"framework": "slime", "args": "--use-tis --tis-clip 2.0 --lr 1e-6"})
>>> [round(w, 4) for w in spec.replay(b).weight.tolist()], spec.ignored_flags
([0.3679, 2.0], ('--lr',))
"""

from __future__ import annotations

import argparse
import math
import shlex
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError, DumpError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import (
    Section,
    check_bool,
    check_choice,
    check_number,
    flag_parser,
    nearest,
    parse_flags,
    top_level,
)
from iscore.frameworks.base import (
    Aggregation,
    BatchFields,
    Citation,
    Framework,
    HealthBand,
    Upstream,
)
from iscore.frameworks.canonical import (
    BIG,
    TINY,
    Anchor,
    Canonical,
    Component,
    Numerator,
    Translation,
    first_weight,
    lost,
    mask_component,
    normalize_component,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.canonical import Level as CanonicalLevel
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "slime"

TisFunction = Literal["vanilla", "icepop", "mis", "off_policy_is"]
Level = Literal["token", "sequence", "geometric"]
TisMode = Literal["truncate", "clip", "mask"]

_LEVELS = ("token", "sequence", "geometric")
_MODES = ("truncate", "clip", "mask")

# slime loads the function with `load_function` (module path, then attribute): the function's
# name decides the behaviour, whichever package (slime, the miles fork, a copy) provides it.
_FUNCTIONS: dict[str, TisFunction] = {
    "vanilla_tis_function": "vanilla",
    "icepop_function": "icepop",
    "compute_mis_weights_with_cp": "mis",
    "off_policy_is_function": "off_policy_is",
}
_FUNCTION_PATHS = (
    "slime.backends.megatron_utils.loss.vanilla_tis_function",
    "slime.backends.megatron_utils.loss.icepop_function",
    "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp",
    "slime.utils.ppo_utils.off_policy_is_function",
)

# The flags that decide slime's IS correction, parsed strictly.
_IS_FLAGS = (
    "--use-tis",
    "--get-mismatch-metrics",
    "--tis-clip",
    "--tis-clip-low",
    "--custom-tis-function-path",
    "--use-rollout-logprobs",
    "--custom-config-path",
)
# Flags that look like IS flags but do not exist in slime (mis.py's README spells YAML keys as
# flags); ignoring them would silently change the replayed setting.
_NOT_SLIME_PREFIXES = ("--tis-", "--rs-", "--use-rs", "--mis-")
_NOT_SLIME = ("--use-rollout-correction",)

# Where `to_config` points --custom-config-path: the file the user saves `custom_config` as.
CUSTOM_CONFIG_PATH = "mis.yaml"
# The flag changing slime's loss aggregation (iscore.stats.setting reads it from `ignored_flags`).
_PER_TOKEN_LOSS = "--calculate-per-token-loss"

_MIS_KEYS = (
    "use_rs",
    "tis_level",
    "rs_level",
    "tis_mode",
    "tis_lower_bound",
    "tis_upper_bound",
    "rs_lower_bound",
    "rs_upper_bound",
    "rs_veto_threshold",
    "tis_batch_normalize",
)

# mis.py's +-20 clamp on every log-ratio it exponentiates; vanilla/icepop have none.
_MIS_BOUND = 20.0
# mis.py skips batch normalization when the mean weight is at most this.
_NORMALIZE_EPS = 1e-8


@dataclass(frozen=True, slots=True)
class MisConfig:
    """The YAML keys of slime's `examples/train_infer_mismatch_helper/mis.py`.

    Args:
        use_rs: apply the RS mask (and the veto) after TIS.
        tis_level: the TIS ratio's level: per token, sequence product, geometric mean.
        rs_level: the RS ratio's level.
        tis_mode: truncate (clamp(w, 0, U)), clip (clamp(w, L, U)) or mask (raw w, tokens
            outside [L, U] leave the mask).
        tis_lower_bound: L; None means 1 / `tis_upper_bound`.
        tis_upper_bound: U.
        rs_lower_bound: RS lower bound; None means the TIS lower bound.
        rs_upper_bound: RS upper bound; None means `tis_upper_bound`.
        rs_veto_threshold: drop a sequence with any token ratio below it; None disables.
        tis_batch_normalize: divide the weights by their batch mean (token or sequence level).
    """

    use_rs: bool = False
    tis_level: Level = "token"
    rs_level: Level = "token"
    tis_mode: TisMode = "truncate"
    tis_lower_bound: float | None = None
    tis_upper_bound: float = 2.0
    rs_lower_bound: float | None = None
    rs_upper_bound: float | None = None
    rs_veto_threshold: float | None = None
    tis_batch_normalize: bool = False

    def __post_init__(self) -> None:
        key = "custom_config.{}".format
        check_bool(key("use_rs"), self.use_rs)
        check_bool(key("tis_batch_normalize"), self.tis_batch_normalize)
        check_choice(key("tis_level"), self.tis_level, _LEVELS)
        check_choice(key("rs_level"), self.rs_level, _LEVELS)
        check_choice(key("tis_mode"), self.tis_mode, _MODES)
        check_number(key("tis_upper_bound"), self.tis_upper_bound, gt=0.0)
        for name in ("tis_lower_bound", "rs_lower_bound"):
            check_number(key(name), getattr(self, name), ge=0.0, nullable=True)
        check_number(key("rs_upper_bound"), self.rs_upper_bound, gt=0.0, nullable=True)
        check_number(key("rs_veto_threshold"), self.rs_veto_threshold, gt=0.0, nullable=True)
        # mis.py asserts lower < upper (strictly) in its clip and mask helpers.
        if self.tis_mode != "truncate" and not self.tis_lower < self.tis_upper_bound:
            raise ConfigError(
                f"Expected `{key('tis_lower_bound')}` ({self.tis_lower}) to be < "
                f"`{key('tis_upper_bound')}` ({self.tis_upper_bound}) for tis_mode "
                f"{quote(self.tis_mode)}, as mis.py asserts"
            )
        if self.use_rs and not self.rs_lower < self.rs_upper:
            raise ConfigError(
                f"Expected `{key('rs_lower_bound')}` ({self.rs_lower}) to be < "
                f"`{key('rs_upper_bound')}` ({self.rs_upper}) with use_rs, as mis.py asserts "
                "(null bounds take the TIS bounds)"
            )
        if self.tis_batch_normalize and self.tis_level == "geometric":
            raise ConfigError(
                f"Expected `{key('tis_batch_normalize')}` to be false with tis_level "
                "'geometric': mis.py raises (it normalizes token or sequence weights only)"
            )

    @property
    def tis_lower(self) -> float:
        """The effective TIS lower bound."""
        if self.tis_lower_bound is not None:
            return self.tis_lower_bound
        return 1.0 / self.tis_upper_bound

    @property
    def rs_lower(self) -> float:
        """The effective RS lower bound."""
        return self.rs_lower_bound if self.rs_lower_bound is not None else self.tis_lower

    @property
    def rs_upper(self) -> float:
        """The effective RS upper bound."""
        return self.rs_upper_bound if self.rs_upper_bound is not None else self.tis_upper_bound


@dataclass(frozen=True, slots=True)
class SlimeCorrection:
    """slime's TIS correction, as set by its launch flags and the mis.py YAML.

    Args:
        use_tis: `--use-tis`, or the YAML's `use_tis` where the YAML sets it (slime merges the
            YAML into its args, overwriting the flag).
        get_mismatch_metrics: `--get-mismatch-metrics`; also calls the TIS function.
        tis_function: which TIS function `--custom-tis-function-path` names ("vanilla" when
            the flag is absent).
        tis_clip: `--tis-clip`, the upper bound of vanilla / icepop / off_policy_is.
        tis_clip_low: `--tis-clip-low`, their lower bound.
        use_rollout_logprobs: `--use-rollout-logprobs` (bypass: no recompute).
        mis: mis.py's YAML settings; required iff `tis_function` is "mis" and it is called.
        ignored_flags: flags (and `custom_config.<key>` entries) that do not affect the replay.
        name: display name.
    """

    framework: ClassVar[str] = NAME
    use_tis: bool = False
    get_mismatch_metrics: bool = False
    tis_function: TisFunction = "vanilla"
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    use_rollout_logprobs: bool = False
    mis: MisConfig | None = None
    ignored_flags: tuple[str, ...] = ()
    name: str = NAME

    def __post_init__(self) -> None:
        check_bool("--use-tis", self.use_tis)
        check_bool("--get-mismatch-metrics", self.get_mismatch_metrics)
        check_bool("--use-rollout-logprobs", self.use_rollout_logprobs)
        check_choice("--custom-tis-function-path", self.tis_function, tuple(_FUNCTIONS.values()))
        _check_clip(self.tis_clip, self.tis_clip_low)
        if self.tis_function == "mis" and self.called and not isinstance(self.mis, MisConfig):
            raise ConfigError(
                "Expected `custom_config` (the YAML at --custom-config-path) with mis.py's "
                f"settings, since mis.py is the TIS function, but got {quote(self.mis)}"
            )
        if self.tis_function != "mis" and self.mis is not None:
            raise ConfigError(
                "Expected no mis.py settings (`custom_config`) with "
                f"tis_function={quote(self.tis_function)}: only mis.py reads them"
            )

    @property
    def called(self) -> bool:
        """Whether the loss calls the TIS function at all."""
        return self.use_tis or self.get_mismatch_metrics

    @property
    def numerator(self) -> str:
        """Which log-probs the TIS function's numerator holds: "train" or "policy"."""
        # PR #2084 uses the current policy; otherwise slime passes the recomputed log-probs,
        # which do not exist under --use-rollout-logprobs unless --get-mismatch-metrics forces
        # the recompute (`actor.py`), and then it falls back to the loss's own forward pass.
        if self.tis_function == "off_policy_is" or (
            self.use_rollout_logprobs and not self.get_mismatch_metrics
        ):
            return "policy"
        return "train"

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: slime's launch flags as one `args` string, plus
        the YAML of `--custom-config-path` as `custom_config` where one is needed; the inverse
        of `parse`.

        Only the IS flags (and `--calculate-per-token-loss`, which changes the loss
        aggregation) are written: the other `ignored_flags` lost their values when parsed.
        mis.py settings are written only when mis.py is called (`parse` ignores them otherwise).

        >>> SlimeCorrection(use_tis=True, tis_clip=5.0, tis_clip_low=0.5).to_config()["args"]
        '--use-tis --tis-clip 5.0 --tis-clip-low 0.5'
        """
        flags: list[str] = []
        # slime rejects --use-tis beside --use-rollout-logprobs on the command line, but merges
        # the YAML after that check: a YAML `use_tis` is the only way to express the pair.
        if self.use_tis and not self.use_rollout_logprobs:
            flags.append("--use-tis")
        if self.get_mismatch_metrics:
            flags.append("--get-mismatch-metrics")
        # --get-mismatch-metrics needs an explicit path, even for the default vanilla function.
        if self.tis_function != "vanilla" or self.get_mismatch_metrics:
            path = next(
                p for p in _FUNCTION_PATHS if _FUNCTIONS[p.rpartition(".")[2]] == self.tis_function
            )
            flags += ["--custom-tis-function-path", path]
        if self.tis_clip != 2.0:
            flags += ["--tis-clip", repr(float(self.tis_clip))]
        if self.tis_clip_low != 0.0:
            flags += ["--tis-clip-low", repr(float(self.tis_clip_low))]
        if self.use_rollout_logprobs:
            flags.append("--use-rollout-logprobs")
        if _PER_TOKEN_LOSS in self.ignored_flags:
            flags.append(_PER_TOKEN_LOSS)
        custom: dict[str, Any] = {}
        if self.tis_function == "mis" and self.called:
            custom = {"use_tis": self.use_tis}
            custom |= {f.name: getattr(self.mis, f.name) for f in fields(self.mis)}
        elif self.use_tis and self.use_rollout_logprobs:
            custom = {"use_tis": True}
        if custom:
            flags += ["--custom-config-path", CUSTOM_CONFIG_PATH]
        config: dict[str, Any] = {
            "framework": NAME,
            "name": self.name,
            "args": shlex.join(flags),
        }
        if custom:
            config["custom_config"] = custom
        return config

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights and mask as slime's loss applies them."""
        mask = batch.loss_mask
        applies = self.called and (self.tis_function != "mis" or self.use_tis)
        if not applies:
            # No TIS function, or mis.py returning before weighting (metrics only).
            ones = torch.ones(batch.num_tokens, dtype=torch.float64, device=batch.device)
            return Replay.build(batch, ones, mask, ops.exp(ops.log_ratio(batch), bound=None))
        if self.numerator == "policy" and batch.policy is None:
            raise ConfigError(
                "This slime setting computes its TIS weight from the current policy "
                "(off_policy_is_function, or --use-rollout-logprobs without the recompute), "
                "which needs the `policy_logprob` column; the dump has none"
            )
        d = ops.log_ratio(batch, self.numerator)
        if self.tis_function == "mis":
            return _replay_mis(self.mis, batch, d)
        rho = ops.exp(d, bound=None)  # vanilla / icepop / off_policy_is: no safety clamp
        if self.tis_function == "icepop":
            weight = torch.where(ops.band(rho, self.tis_clip_low, self.tis_clip), rho, 0.0)
        else:
            weight = ops.truncate(rho, self.tis_clip_low, self.tis_clip)
        return Replay.build(batch, weight, mask, rho)


def _check_clip(
    tis_clip: Any,
    tis_clip_low: Any,
    clip_key: str = "--tis-clip",
    low_key: str = "--tis-clip-low",
) -> None:
    """Raise ConfigError naming the key unless 0 <= tis_clip_low <= tis_clip and tis_clip > 0
    (slime itself does not check)."""
    check_number(clip_key, tis_clip, gt=0.0)
    check_number(low_key, tis_clip_low, ge=0.0)
    if tis_clip_low > tis_clip:
        raise ConfigError(
            f"Expected `{low_key}` <= `{clip_key}` ({quote(tis_clip)}), but got "
            f"{quote(tis_clip_low)} (slime does not check it; no ratio would lie within the bounds)"
        )


def _level_log_ratio(d: torch.Tensor, batch: TokenBatch, level: str) -> torch.Tensor:
    """float64 [B] or [N]: d per token, or mis.py's masked sum / mean per sequence."""
    if level == "token":
        return d
    mask = batch.loss_mask
    # mis.py multiplies by the float mask (so a non-finite d at a masked position propagates);
    # an all-true mask changes nothing.
    total = ops.segment_sum(d if ops.mask_is_all(batch, mask) else d * mask, batch)
    if level == "sequence":
        return total
    return total / ops.segment_count(batch, batch.loss_mask).clamp(min=1.0)


def _replay_mis(cfg: MisConfig, batch: TokenBatch, d: torch.Tensor) -> Replay:
    """mis.py's `compute_mis_weights` with `use_tis` on."""
    mask = batch.loss_mask
    per_sequence = cfg.tis_level != "token"
    raw = ops.exp(_level_log_ratio(d, batch, cfg.tis_level), _MIS_BOUND)  # [B] or [N]
    tis_keep = None  # truncate and clip keep every token
    if cfg.tis_mode == "truncate":
        weight = ops.truncate(raw, 0.0, cfg.tis_upper_bound)
    elif cfg.tis_mode == "clip":
        weight = ops.truncate(raw, cfg.tis_lower, cfg.tis_upper_bound)
    else:
        weight = raw
        tis_keep = ops.band(raw, cfg.tis_lower, cfg.tis_upper_bound)
    keep = mask
    if tis_keep is not None:
        keep = mask & (ops.broadcast(tis_keep, batch) if per_sequence else tis_keep)

    if cfg.use_rs:
        rs_ratio = ops.exp(_level_log_ratio(d, batch, cfg.rs_level), _MIS_BOUND)
        rs_keep = ops.band(rs_ratio, cfg.rs_lower, cfg.rs_upper)
        keep = keep & (ops.broadcast(rs_keep, batch) if cfg.rs_level != "token" else rs_keep)
        if cfg.rs_veto_threshold is not None:
            # slime compares its float32 d with the log of a float32 tensor of the threshold.
            log_veto = float(torch.log(torch.tensor(cfg.rs_veto_threshold, dtype=torch.float32)))
            catastrophic = ops.compare("lt", d, log_veto)
            if not ops.mask_is_all(batch, mask):
                catastrophic &= mask
            keep &= ops.broadcast(ops.segment_all(catastrophic.logical_not_(), batch), batch)

    pre_norm = None
    if cfg.tis_batch_normalize:
        pre_norm = weight
        divisor = _batch_mean(weight, batch, per_sequence)
        weight = torch.div(weight, divisor, out=divisor)  # the quotient takes its place

    if not per_sequence:
        return Replay.build(batch, weight, keep, raw, pre_norm=pre_norm)
    return Replay.build(
        batch,
        per_token(weight, batch),
        keep,
        per_token(raw, batch),
        seq_raw=raw,
        seq_weight=weight if tis_keep is None else torch.where(tis_keep, weight, 0.0),
        pre_norm=None if pre_norm is None else per_token(pre_norm, batch),
    )


def _batch_mean(weight: torch.Tensor, batch: TokenBatch, per_sequence: bool) -> torch.Tensor:
    """mis.py's batch-normalization divisor, per training step: [B] or [N] like `weight`, a
    fresh tensor (the caller may overwrite it).

    Token level: the mean weight over every original mask token of the step. Sequence level:
    the mean over the step's sequences (fully masked ones count as 0) of each sequence's masked
    mean weight. A mean <= 1e-8 becomes 1 (mis.py then skips the division).
    """
    mask = batch.loss_mask
    counts = ops.segment_count(batch, mask)
    if per_sequence:
        # Every mask token of a sequence holds the sequence's weight, so its masked mean is
        # the weight itself, or 0 without mask tokens.
        numerators = torch.where(counts > 0, weight, 0.0)
        denominators = torch.ones_like(numerators)
    else:
        numerators = ops.segment_sum(weight, batch, mask)
        denominators = counts
    _, step = torch.unique(batch.step, return_inverse=True)
    groups = int(step.max()) + 1 if step.numel() else 0
    num = torch.zeros(groups, dtype=torch.float64, device=weight.device).index_add_(
        0, step, numerators
    )
    den = torch.zeros(groups, dtype=torch.float64, device=weight.device).index_add_(
        0, step, denominators
    )
    mean = num / den.clamp(min=1.0)
    mean = torch.where(mean > _NORMALIZE_EPS, mean, 1.0)[step]
    return mean if per_sequence else ops.broadcast(mean, batch)


def _parser() -> argparse.ArgumentParser:
    """slime's IS flags with its own defaults (`slime/utils/arguments.py`)."""
    parser = flag_parser(NAME)
    parser.add_argument("--use-tis", action="store_true")
    parser.add_argument("--get-mismatch-metrics", action="store_true")
    parser.add_argument("--tis-clip", type=float, default=2.0)
    parser.add_argument("--tis-clip-low", type=float, default=0.0)
    parser.add_argument("--custom-tis-function-path", type=str, default=None)
    parser.add_argument("--use-rollout-logprobs", action="store_true")
    parser.add_argument("--custom-config-path", type=str, default=None)
    return parser


def _argv(args: Any) -> list[str]:
    """The flags as argv tokens; a pasted script's line continuations and comments removed."""
    if isinstance(args, str):
        return shlex.split(args.replace("\\\n", " "), comments=True)
    if (
        isinstance(args, Sequence)
        and not isinstance(args, bytes)
        and all(isinstance(a, str) for a in args)
    ):
        return list(args)
    raise ConfigError(f"Expected `args` to be a string of CLI flags, but got {quote(args)}")


def _is_flag(token: str) -> bool:
    """Whether an argv token is a flag name rather than a value (negative numbers are values)."""
    if len(token) < 2 or not token.startswith("-"):
        return False
    try:
        float(token)
    except ValueError:
        return True
    return False


def _split_flags(argv: list[str]) -> tuple[list[str], tuple[str, ...]]:
    """The IS flags' tokens (values included) and the names of every other flag."""
    is_tokens: list[str] = []
    ignored: list[str] = []
    owner: list[str] | None = None  # where the values of the current flag go
    for token in argv:
        if not _is_flag(token):
            if owner is None:
                raise ConfigError(f"`args`: expected a flag first, but got {quote(token)}")
            if owner is is_tokens:
                is_tokens.append(token)
            continue
        flag = token.split("=", 1)[0]
        if flag in _IS_FLAGS:
            is_tokens.append(token)
            owner = is_tokens
        elif flag in _NOT_SLIME or flag.startswith(_NOT_SLIME_PREFIXES):
            raise ConfigError(
                f"`args`: slime has no flag {flag}{nearest(flag, _IS_FLAGS)}; mis.py reads its "
                "settings (tis_mode, tis_level, use_rs, rs_*, ...) from the YAML at "
                "--custom-config-path: give that YAML as `custom_config:`; slime's own IS flags "
                "are " + ", ".join(_IS_FLAGS)
            )
        elif hint := nearest(flag, _IS_FLAGS, cutoff=0.9):
            # Other slime flags are ignored, but a typo of an IS flag would silently turn the
            # correction off (`--use-tiss`).
            raise ConfigError(f"`args`: slime has no flag {flag}{hint}")
        else:
            if flag not in ignored:
                ignored.append(flag)
            owner = ignored
    return is_tokens, tuple(ignored)


def _function(path: str | None) -> TisFunction:
    if path is None:
        return "vanilla"
    function = _FUNCTIONS.get(path.rpartition(".")[2])
    if function is None:
        raise ConfigError(
            f"Expected `--custom-tis-function-path` to name one of slime's TIS functions "
            f"({', '.join(_FUNCTION_PATHS)}), but got {quote(path)}"
        )
    return function


def _parse_mis(section: Section, use_tis: bool) -> MisConfig:
    """mis.py's keys; those it reads that have no null meaning are required, as in slime."""
    use_rs = section.bool("use_rs", False)
    required = {
        "tis_upper_bound": "whenever it runs",
        **dict.fromkeys(
            ("tis_level", "tis_mode", "use_rs", "tis_batch_normalize") if use_tis else (),
            "when use_tis is on",
        ),
        **dict.fromkeys(("rs_level",) if use_tis and use_rs else (), "when use_rs is on"),
    }
    for key, when in required.items():
        if key not in section.data:
            raise ConfigError(f"Missing required key `{section.key(key)}`: mis.py reads it {when}")
    return MisConfig(
        use_rs=use_rs,
        tis_level=section.choice("tis_level", "token", _LEVELS),
        rs_level=section.choice("rs_level", "token", _LEVELS),
        tis_mode=section.choice("tis_mode", "truncate", _MODES),
        tis_lower_bound=section.float("tis_lower_bound", None),
        tis_upper_bound=section.float("tis_upper_bound", 2.0, gt=0.0),
        rs_lower_bound=section.float("rs_lower_bound", None),
        rs_upper_bound=section.float("rs_upper_bound", None),
        rs_veto_threshold=section.float("rs_veto_threshold", None, gt=0.0),
        tis_batch_normalize=section.bool("tis_batch_normalize", False),
    )


def parse(config: Mapping[str, Any]) -> SlimeCorrection:
    """Parse `{framework: slime, name?, args: "<launch flags>", custom_config?: {...}}`.

    Raises:
        ConfigError: a malformed IS flag, a flag slime does not have that looks like one, a
            combination slime rejects, or a bad / missing mis.py key; the message names it.

    >>> spec = parse({
    ...     "framework": "slime",
    ...     "args": "--use-tis --custom-tis-function-path "
    ...             "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp "
    ...             "--custom-config-path mis.yaml --tensor-model-parallel-size 2",
    ...     "custom_config": {"use_tis": True, "use_rs": False, "tis_level": "geometric",
    ...                       "tis_mode": "mask", "tis_lower_bound": 0.999,
    ...                       "tis_upper_bound": 1.001, "tis_batch_normalize": False},
    ... })
    >>> spec.tis_function, spec.mis.tis_level, spec.ignored_flags
    ('mis', 'geometric', ('--tensor-model-parallel-size',))
    """
    section, name = top_level(config, NAME)
    is_tokens, ignored = _split_flags(_argv(section.raw("args", "")))
    custom = section.section("custom_config")
    given_custom = section.data.get("custom_config") is not None
    section.done()
    flags = parse_flags(_parser(), is_tokens)

    # slime's checks (arguments.py) run on the command-line values, before the YAML merge.
    if flags.use_rollout_logprobs and flags.use_tis:
        raise ConfigError(
            "`args`: --use-rollout-logprobs and --use-tis cannot be set together (slime asserts)"
        )
    if flags.get_mismatch_metrics and flags.custom_tis_function_path is None:
        raise ConfigError(
            "`args`: --get-mismatch-metrics requires --custom-tis-function-path (slime asserts)"
        )
    function = _function(flags.custom_tis_function_path)

    # The YAML is merged into slime's args, overwriting the flags it names.
    use_tis = custom.bool("use_tis", flags.use_tis)
    tis_clip = custom.float("tis_clip", flags.tis_clip)
    tis_clip_low = custom.float("tis_clip_low", flags.tis_clip_low)
    clip_key, low_key = (
        custom.key(k) if k in custom.data else f"--{k.replace('_', '-')}"
        for k in ("tis_clip", "tis_clip_low")
    )
    _check_clip(tis_clip, tis_clip_low, clip_key, low_key)
    called = use_tis or flags.get_mismatch_metrics
    mis = None
    if function == "mis" and called:
        if flags.custom_config_path is not None and not given_custom:
            raise ConfigError(
                f"Expected `custom_config` with the contents of {flags.custom_config_path} "
                "(the YAML of --custom-config-path, which mis.py reads), but it is missing"
            )
        mis = _parse_mis(custom, use_tis)
    else:
        ignored += tuple(f"custom_config.{k}" for k in _MIS_KEYS if k in custom.data)
        custom.read.update(_MIS_KEYS)
        if flags.custom_config_path is not None and not given_custom:
            warnings.warn(
                f"iscore cannot read {flags.custom_config_path} (--custom-config-path); if it "
                "sets use_tis, tis_clip or tis_clip_low, give its contents as `custom_config`",
                UserWarning,
                stacklevel=2,
            )
    custom.done()
    return SlimeCorrection(
        use_tis=use_tis,
        get_mismatch_metrics=flags.get_mismatch_metrics,
        tis_function=function,
        tis_clip=tis_clip,
        tis_clip_low=tis_clip_low,
        use_rollout_logprobs=flags.use_rollout_logprobs,
        mis=mis,
        ignored_flags=ignored,
        name=name,
    )


PRESETS: dict[str, SlimeCorrection] = {
    "slime_tis": SlimeCorrection(use_tis=True, name="slime_tis"),
    # GLM-5.x scripts and slime's tests: `--tis-clip-low 0.5 --tis-clip 2.0` with icepop.
    "slime_icepop": SlimeCorrection(
        use_tis=True, tis_function="icepop", tis_clip_low=0.5, name="slime_icepop"
    ),
    # examples/train_infer_mismatch_helper/mis.yaml as shipped.
    "slime_mis_example": SlimeCorrection(
        use_tis=True,
        tis_function="mis",
        mis=MisConfig(
            use_rs=True,
            tis_lower_bound=0.5,
            tis_upper_bound=2.0,
            rs_veto_threshold=1e-4,
            tis_batch_normalize=True,
        ),
        name="slime_mis_example",
    ),
}
"""slime's documented settings: `--use-tis` alone, the GLM-5 IcePop bounds, mis.yaml."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: SlimeCorrection) -> Canonical:
    anchor: Anchor = "rollout" if spec.use_rollout_logprobs else "recompute"
    if not spec.called or (spec.tis_function == "mis" and not spec.use_tis):
        return Canonical(anchor=anchor)
    numerator: Numerator = "policy" if spec.numerator == "policy" else "train"
    if spec.tis_function == "mis":
        return Canonical(_mis_components(spec.mis, numerator), anchor)
    if spec.tis_function == "icepop":
        band = mask_component("token", spec.tis_clip_low, spec.tis_clip, numerator=numerator)
        weight = weight_component("token", numerator=numerator, zero=band)
    else:
        weight = weight_component(
            "token", lower=spec.tis_clip_low, upper=spec.tis_clip, numerator=numerator
        )
    return Canonical((weight,), anchor)


def _mis_components(mis: MisConfig, numerator: Numerator) -> tuple[Component, ...]:
    """mis.py: every ratio clamped to +-20 after aggregating."""
    levels: dict[str, CanonicalLevel] = {
        "token": "token",
        "sequence": "sequence",
        "geometric": "geometric",
    }
    level = levels[mis.tis_level]
    common: dict[str, Any] = {"numerator": numerator, "numerics": "clamp"}
    components: list[Component] = []
    if mis.tis_mode == "truncate":
        components.append(weight_component(level, upper=mis.tis_upper_bound, **common))
    elif mis.tis_mode == "clip":
        components.append(
            weight_component(level, lower=mis.tis_lower, upper=mis.tis_upper_bound, **common)
        )
    else:
        components += [
            weight_component(level, **common),
            mask_component(level, mis.tis_lower, mis.tis_upper_bound, **common),
        ]
    if mis.use_rs:
        components.append(
            mask_component(levels[mis.rs_level], mis.rs_lower, mis.rs_upper, **common)
        )
        if mis.rs_veto_threshold is not None:
            # slime compares d with the float32 log of the threshold; d itself is unclamped.
            log_veto = float(torch.log(torch.tensor(mis.rs_veto_threshold, dtype=torch.float32)))
            components.append(
                mask_component("any_token", log_veto, statistic="log_ratio", numerator=numerator)
            )
    if mis.tis_batch_normalize:
        components.append(normalize_component("token" if level == "token" else "sequence_all"))
    return tuple(components)


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    candidates = [_slime_builtin(c, name)]
    policy = any(x.numerator == "policy" for x in c.components)
    if (c.weights or c.masks) and (not policy or c.anchor == "rollout"):
        candidates.append(_slime_mis(c, name))
    return candidates


def _slime_anchor(c: Canonical, fields: dict[str, Any]) -> None:
    """--use-rollout-logprobs for a bypass; with a weight on the recompute, also
    --get-mismatch-metrics (which makes slime recompute anyway)."""
    if c.anchor != "rollout":
        return
    fields["use_rollout_logprobs"] = True
    if any(x.numerator == "train" for x in c.components):
        fields["get_mismatch_metrics"] = True


def _slime_builtin(c: Canonical, name: str) -> Translation:
    """slime's own flags: vanilla_tis_function, icepop_function, PR #2084's off_policy_is."""
    notes: list[str] = []
    fields: dict[str, Any] = {"name": name}
    _slime_anchor(c, fields)
    w = first_weight(c, notes, "slime")
    for m in c.masks:
        lost(notes, m, "slime's built-in TIS functions have no mask (mis.py's RS has)")
    if w is not None:
        fields["use_tis"] = True
        if w.level != "token":
            lost(
                notes,
                w,
                "slime's built-in TIS functions weight tokens (mis.py has sequence "
                "levels); written per token",
            )
        policy = w.numerator == "policy" and c.anchor != "rollout"
        if policy:
            fields["tis_function"] = "off_policy_is"
            notes.append("off_policy_is_function is slime PR #2084, open, not on main")
        zero = w.zero
        if zero is not None and ratio_level(zero) == "token" and not policy:
            lower, upper = ratio_bounds(zero) or (None, None)
            fields |= {"tis_function": "icepop", "tis_clip_low": lower or 0.0}
            fields["tis_clip"] = math.inf if upper is None else upper
            if w.upper is not None and (upper is None or w.upper < upper):
                lost(
                    notes, w, f"slime's icepop keeps the raw ratio; the cap {w.upper:g} is dropped"
                )
        else:
            if zero is not None:
                lost(notes, zero, "slime's built-in functions cannot zero on this band")
            fields["tis_clip_low"] = w.lower or 0.0
            fields["tis_clip"] = math.inf if w.upper is None else w.upper
    if c.normalize is not None:
        lost(notes, c.normalize, "slime's built-in functions do not normalize (mis.py does)")
    if c.sequence_over == "kept":
        notes.append("slime computes ratios over the original loss mask")
    return SlimeCorrection(**fields), tuple(notes)


def _slime_mis(c: Canonical, name: str) -> Translation:
    """slime's mis.py helper (examples/train_infer_mismatch_helper), configured by its YAML."""
    notes: list[str] = []
    fields: dict[str, Any] = {"name": name, "use_tis": True, "tis_function": "mis"}
    _slime_anchor(c, fields)
    w = first_weight(c, notes, "mis.py")
    masks = list(c.masks)
    levels = {"token": "token", "sequence": "sequence", "geometric": "geometric"}
    mis: dict[str, Any] = {"tis_level": "token", "tis_upper_bound": BIG}
    if w is None:
        notes.append(
            "mis.py always weights when it runs: tokens carry their ratio (truncated at "
            "1e9, i.e. not at all); the source applies no weight"
        )
    else:
        if w.level == "geometric_unmasked":
            lost(notes, w, "mis.py's geometric mean runs over loss tokens only")
        mis["tis_level"] = levels.get(w.level, "geometric")
        zero = w.zero
        if zero is not None and zero.level == w.level:
            lower, upper = ratio_bounds(zero) or (None, None)
            mis |= {"tis_mode": "mask", "tis_lower_bound": lower or TINY}
            mis["tis_upper_bound"] = BIG if upper is None else upper
            lost(notes, zero, "mis.py removes those from the loss mask instead of zeroing them")
            if w.upper is not None and (upper is None or w.upper < upper):
                lost(notes, w, f"mis.py's mask mode keeps the raw ratio; cap {w.upper:g} dropped")
        else:
            if zero is not None:
                masks.append(zero)
                lost(notes, zero, "mis.py rejects instead of zeroing")
            if w.upper is not None:
                mis["tis_upper_bound"] = w.upper
            if w.lower is not None:
                mis |= {"tis_mode": "clip", "tis_lower_bound": w.lower}
    for m in masks:
        bounds = ratio_bounds(m)
        level = ratio_level(m)
        if level in levels and bounds is not None and not mis.get("use_rs"):
            mis |= {"use_rs": True, "rs_level": levels[level]}
            mis["rs_lower_bound"] = bounds[0] or TINY
            mis["rs_upper_bound"] = BIG if bounds[1] is None else bounds[1]
        elif (
            level == "any_token" and bounds and bounds[1] is None and "rs_veto_threshold" not in mis
        ):
            mis["rs_veto_threshold"] = bounds[0]
        else:
            lost(notes, m, "no mis.py key expresses it (one RS level, a lower-only veto); dropped")
    if "rs_veto_threshold" in mis and not mis.get("use_rs"):
        # The veto runs only with use_rs: a band mis.py's +-20 clamp never reaches.
        mis |= {"use_rs": True, "rs_lower_bound": TINY, "rs_upper_bound": BIG}
    norm = c.normalize
    if norm is not None:
        wanted = "token" if mis["tis_level"] == "token" else "sequence_all"
        if mis["tis_level"] == "geometric" or norm.level != wanted:
            lost(
                notes,
                norm,
                f"mis.py normalizes {mis['tis_level']}-level weights over "
                f"{'tokens' if wanted == 'token' else 'every sequence'} only; dropped",
            )
        else:
            mis["tis_batch_normalize"] = True
    if c.sequence_over == "kept":
        notes.append("mis.py computes ratios over the original loss mask")
    if (
        mis.get("tis_mode") in ("clip", "mask")
        and not mis["tis_lower_bound"] < mis["tis_upper_bound"]
    ):
        notes.append("mis.py needs lower < upper; the lower bound is dropped")
        mis |= {"tis_mode": "truncate", "tis_lower_bound": None}
    if mis.get("use_rs") and not mis["rs_lower_bound"] < mis["rs_upper_bound"]:
        notes.append("mis.py needs an RS band with lower < upper; RS dropped")
        mis |= {"use_rs": False, "rs_lower_bound": None, "rs_upper_bound": None}
    return SlimeCorrection(mis=MisConfig(**mis), **fields), tuple(notes)


# ------------------------------------------------------------------ dump adapter


def read_batch(rollout_data: Any) -> list[BatchFields]:
    """slime's per-rank `rollout_data` in the Megatron actor's `train_actor` -> dump fields.

    slime calls the function named by `--rollout-data-postprocess-path` as
    `fn(args, rollout_id, rollout_data)` after computing advantages and before training
    (slime/backends/megatron_utils/actor.py at THUDM/slime@624b824a, l.196-199, l.505-506): the
    hook for `add_batch(rollout_data, step=rollout_id)`. slime's own `--save-debug-train-data`
    dump (which `iscore convert` reads) holds the same values.

    Per-sample lists, this data-parallel rank's samples (slime/utils/data.py l.304-330):
    `rollout_log_probs` and `log_probs` (the Megatron recompute, absent with
    `--use-rollout-logprobs`), 1-D of the sample's response length; `loss_masks` (0 on tool
    output), `advantages` (per token, loss.py l.880), `rewards`, `tokens` (prompt + response,
    the response last) and `response_lengths` (loss.py l.729-738); `partition`, each sample's
    place in the whole rollout, written as its sequence id (unique across ranks). With context
    parallelism the per-token fields hold this rank's shard only (actor.py l.284-291): refused.
    """
    what = "slime's rollout_data"
    rollout = _batch.need(
        rollout_data, "rollout_log_probs", what, "slime's rollout engine returns them"
    )
    train = _batch.need(
        rollout_data,
        "log_probs",
        what,
        "slime recomputes them unless --use-rollout-logprobs (actor.py l.481-487)",
    )
    lengths = _batch.field(rollout_data, "response_lengths")
    if lengths is not None and len(rollout) and len(rollout[0]) != int(lengths[0]):
        raise DumpError(
            f"{what} holds {len(rollout[0])} log-probs for a response of {int(lengths[0])} "
            "tokens: context parallelism shards them; dump with --context-parallel-size 1 or "
            "use --save-debug-train-data, which gathers them"
        )
    tokens = _batch.field(rollout_data, "tokens")
    return [
        BatchFields(
            rollout,
            train,
            loss_mask=_batch.field(rollout_data, "loss_masks"),
            advantages=_batch.field(rollout_data, "advantages"),
            token_ids=None
            if tokens is None or lengths is None
            else [t[len(t) - int(n) :] for t, n in zip(tokens, lengths, strict=True)],
            rewards=_batch.field(rollout_data, "rewards"),
            seq_ids=_batch.field(rollout_data, "partition"),
        )
    ]


# ------------------------------------------------------------------ the framework


def _aggregation(spec: SlimeCorrection) -> Aggregation:
    per_token = _PER_TOKEN_LOSS in spec.ignored_flags
    return Aggregation("token-mean" if per_token else "seq-mean-token-mean")


def _render(body: Mapping[str, Any], fmt: str | None) -> str:
    """The launch flags, one per line; mis.py's YAML under a comment header."""
    text = snippets.flag_lines(body.get("args", ""))
    if "custom_config" in body:
        header = f"# {CUSTOM_CONFIG_PATH}, the YAML --custom-config-path points to"
        text += f"\n\n{header}\n{snippets.yaml_text(body['custom_config'])}"
    return text


CI_GATE = HealthBand(
    "abs_diff_mean",
    None,
    0.1,
    "train_rollout_logprob_abs_diff",
    "its CI run (--ci-test) fails above 0.1; slime averages each sample's tokens first, then "
    "the samples, where iscore's abs_diff_mean is a token mean: they differ where long and short "
    "sequences differ",
    Citation("slime PR #1968", "https://github.com/THUDM/slime/pull/1968"),
)
"""The bar slime's CI holds the mismatch to."""

FRAMEWORK = Framework(
    name=NAME,
    title="slime",
    upstream=Upstream("THUDM/slime", "624b824a898ab0ec1fcb4d373004c7f3852bf515", "2026-08-21"),
    spec_types=(SlimeCorrection,),
    parse=parse,
    presets=lambda: PRESETS,
    default="slime_tis",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=_render,
    aggregation=_aggregation,
    families=frozenset({"token_tis", "icepop", "seq_tis"}),
    gates=(CI_GATE,),
    support="replays SGLang's nucleus ids as a logit mask on main with --rollout-top-p (#2102)",
    columns={  # the --save-debug-train-data sample dicts
        "seq_id": ("sample_index",),
        "step": ("rollout_id",),
        "rollout_logprob": ("rollout_log_probs",),
        "train_logprob": ("log_probs",),
        "loss_mask": ("loss_masks",),
        "group_id": ("group_index",),
    },
    metrics={
        "k1": ("mis_kl (sequence-averaged)",),
        "k3": ("mis_k3_kl (sequence-averaged)",),
        "chi2_token": ("mis_chi2_token (sequence-averaged)",),
        "chi2_seq": ("mis_chi2_seq",),
        "abs_diff_mean": ("train/train_rollout_logprob_abs_diff (sequence-averaged)",),
        "log_ppl_diff": ("mis_log_ppl_diff",),
        "log_ppl_abs_diff": ("mis_log_ppl_abs_diff",),
        "ppl_ratio": ("mis_ppl_ratio",),
        "training_ppl": ("mis_training_ppl",),
        "rollout_ppl": ("mis_rollout_ppl",),
        "ratio_mean": ("tis (before clipping)",),
    },
    snippet_formats=("flags",),
    read_batch=read_batch,
)
