"""NeMo-RL's off-policy importance-sampling correction (`loss_fn.*`, `ClippedPGLossConfig`).

Replays `ClippedPGLossFn` in `nemo_rl/algorithms/loss/loss_functions.py` at
NVIDIA-NeMo/RL@7ea279ab (2026-08-22), plus the open, unmerged PR #2269 (head c7b1b01d,
`is_correction_level`).

What NeMo-RL computes, in its order, with d = prev_logprobs - generation_logprobs (the trainer's
recompute over the rollout engine's log-probs, both float32):

1. The IS weight, with NO safety clamp, exponentiated in float32 and then
   `nan_to_num(nan=0, posinf=0, neginf=0)`: a weight that overflows float32 (exponent above
   ln(FLT_MAX) = 88.72) becomes 0, not a large number.
   - token level (default): w_t = e^{d_t};
   - `sequence_level_importance_ratios: true` (GSPO; needs `token_level_loss: false`):
     w = e^{S}, S the sum of d over token_mask * sample_mask (a PRODUCT of ratios, although
     GSPO's own PPO ratio uses the geometric mean), broadcast;
   - PR #2269 `is_correction_level` overrides the level of the weight only (the PPO ratio still
     follows `sequence_level_importance_ratios`): `token`, `sequence` (e^{S}) or `sequence_mean`
     (e^{G}, G the mean of d over token_mask).
2. `truncated_importance_sampling_type` with U = `truncated_importance_sampling_ratio` and
   L = `truncated_importance_sampling_ratio_min`:
   - `tis`: w = clamp(w, L or 0, U); an overflowed weight is already 0 here, so it is raised to
     L (or stays 0), never capped to U;
   - `icepop`: w = w * 1[L <= w <= U] (inclusive);
   - `seq-mask-tis` (token level only): w_t = e^{d_t} * 1[L <= e^{G} <= U], G the mean over
     token_mask of the nan-cleaned d: raw, untruncated token weights inside a geometric mask.
3. Only with `use_importance_sampling_correction: true` is w multiplied into the PPO/CISPO term;
   otherwise NeMo computes w for its metrics and the loss uses 1. The loss mask never changes:
   zeroed weights stay in the token / sequence denominators.

Before all of that, in the GRPO step (`compute_and_apply_seq_logprob_error_masking`,
grpo.py:2513-2626, called at :3275, before the advantages at :3294), the sequence filter
`grpo.seq_logprob_error_threshold` tau (default null; PR #1838): with m = token_mask *
sample_mask, each sequence's multiplicative probability error
E_i = sum_t e^{|d_t| m_t} m_t / sum_t m_t (the per-sequence form of `token_mult_prob_error`;
0 for a sequence without loss tokens) is computed always, and with tau set a sequence is kept
iff E_i <= tau: the others get sample_mask 0, so they leave the loss, its token and sequence
denominators (`global_valid_toks`, `global_valid_seqs`) and the mask the advantage estimator
receives. E is sign-blind (e^{|d|}: a token the trainer finds likelier counts as one it finds
less likely) and >= 1 (1 only where every loss token agrees exactly), so tau < 1 drops every
sequence with a loss token. A masked token whose |d| is not finite adds 0 * e^NaN = NaN, which
fails the comparison: its whole sequence goes. NeMo logs `{max,mean,min}_seq_mult_prob_error`
(over sequences with a loss token), the same `_after_mask` over the kept ones,
`num_masked_seqs_by_logprob_error` and `masked_correct_pct` (the share of filtered sequences
with reward 1).

The replay computes in float64 and reproduces the float32 overflow explicitly (a weight whose
float32 cast is infinite is set to 0). `raw` is NeMo's weight before step 2, i.e. after the
overflow-to-0 (what NeMo's `sampling_importance_ratio` metric averages when the correction is
off); `seq_raw` / `seq_weight` are the per-sequence weight before / after step 2 for the sequence
levels, and e^{G} / 1[kept] for `seq-mask-tis`.

Config keys, under `grpo`: `seq_logprob_error_threshold`; the other `GRPOConfig` keys are accepted
and change nothing here (an unknown one is refused). Under `loss_fn`:
`use_importance_sampling_correction`, `truncated_importance_sampling_type`,
`truncated_importance_sampling_ratio`, `truncated_importance_sampling_ratio_min`,
`sequence_level_importance_ratios`, `token_level_loss`, PR #2269's `is_correction_level`; and,
type-checked with NeMo's own assertions but not changing the weight, every other
`ClippedPGLossConfig` key: `disable_ppo_ratio`, `ratio_clip_min`, `ratio_clip_max`, `ratio_clip_c`,
`reference_policy_kl_penalty`, `reference_policy_kl_type`, `kl_input_clamp_value`,
`kl_output_clamp_value`, `use_kl_in_reward`, `use_on_policy_kl_approximation`,
`force_on_policy_ratio`, `use_cispo`, `positive_example_nll_weight`. Values follow pydantic's lax
parsing (bools from "true"/"1"/1, floats from numeric strings).

Where NeMo-RL's documentation (docs/corrections.md#nemo-rl) and its code differ, or the spec is
silent, the code wins:

- `ClippedPGLossConfig` is a pydantic model with `extra="allow"` (loss_functions.py:111): NeMo
  silently ignores unknown keys, and on main that includes `is_correction_level`, which only
  PR #2269 reads. iscore rejects unknown keys and replays `is_correction_level` with the PR's
  semantics; the PR lets `is_correction_level: sequence` run with `token_level_loss: true`.
- A ratio with `type: null` is rejected at the first loss call, not at construction (:596, :668);
  here it is a ConfigError. `truncated_importance_sampling_ratio_min` without a ratio and type is
  silently unused by NeMo; the parser warns and drops it.
- S runs over token_mask * sample_mask (:570) but G (seq-mask-tis, sequence_mean) over token_mask
  alone (:645); iscore's single loss mask stands for both, so they agree on any dump.
- NeMo's masked mean divides by (count + 1e-8); in float32 the 1e-8 vanishes for count >= 1, so the
  replay divides by the count (G = 0 for a sequence without mask tokens).
- `force_on_policy_ratio: true` makes NeMo skip the recompute and use the training forward pass
  as prev_logprobs; with the one update per rollout it requires, that is the dump's trainer
  log-prob, so the replay is unchanged.
- NeMo compares float32 weights with the bounds; the float64 replay may decide a weight within one
  float32 ulp of a bound differently. E likewise: NeMo sums e^{|d|} in float32 (overflowing to
  inf, and dropping the sequence, above |d| = 88.7, as the float64 value above tau does).
- "Applied before advantages" does not make a filtered sequence leave its group's baseline: the
  GRPO and GDPO estimators (advantage_estimator.py:69-98, :117-190) take the baseline and std
  over every sample of the prompt (`torch.ones_like(rewards)`) and use the mask only for the
  shape; Reinforce++ and the raw-reward estimator normalize over the mask, so there a filtered
  sequence leaves the batch statistics. A filtered sequence's own advantage is never used.
- The dump adapter (`read_batch`) writes `sample_mask` as NeMo logs it, after the filter: such
  a dump's loss mask has the filtered sequences out already (replaying tau again changes
  nothing; replaying without it cannot bring them back).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import numpy as np
import torch

from iscore.errors import ConfigError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import Section, as_float, check_choice, check_number, top_level
from iscore.frameworks.base import (
    Aggregation,
    BatchFields,
    Citation,
    Framework,
    HealthBand,
    Measure,
    ReferencePoint,
    Trap,
    Upstream,
)
from iscore.frameworks.canonical import (
    Canonical,
    Component,
    Level,
    Numerics,
    Translation,
    first_weight,
    lost,
    mask_component,
    note_extras,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "nemo_rl"

_LOSS_FN = "loss_fn"
_ENABLED = f"{_LOSS_FN}.use_importance_sampling_correction"
_TYPE = f"{_LOSS_FN}.truncated_importance_sampling_type"
_RATIO = f"{_LOSS_FN}.truncated_importance_sampling_ratio"
_RATIO_MIN = f"{_LOSS_FN}.truncated_importance_sampling_ratio_min"
_SEQ_LEVEL = f"{_LOSS_FN}.sequence_level_importance_ratios"
_TOKEN_LOSS = f"{_LOSS_FN}.token_level_loss"
_IS_LEVEL = f"{_LOSS_FN}.is_correction_level"
_SEQ_ERROR = "grpo.seq_logprob_error_threshold"

# `GRPOConfig` fields (grpo.py:241-355) that do not shape the weight or the keep mask.
_GRPO_OTHER_KEYS = (
    "num_prompts_per_step", "num_generations_per_prompt", "max_num_epochs", "max_num_steps",
    "max_rollout_turns", "normalize_rewards", "advantage_clip_low", "advantage_clip_high",
    "use_leave_one_out_baseline", "val_period", "val_start_at", "val_batch_size", "val_at_start",
    "val_at_end", "max_val_samples", "val_num_generations_per_prompt",
    "stop_at_validation_metric", "stop_at_validation_threshold",
    "skip_reference_policy_logprobs_calculation", "seed", "async_grpo", "overlong_filtering",
    "use_dynamic_sampling", "dynamic_sampling_max_gen_batches", "batch_multiplier",
    "reward_shaping", "reward_scaling", "calculate_advantages_on_gpu",
    "invalid_tool_call_advantage", "malformed_thinking_advantage", "adv_estimator",
    "deduplicate_multimodal_data", "debug_payload_metrics", "consumed_samples", "current_step",
    "current_epoch", "total_steps", "total_valid_tokens", "val_reward", "sampler_name",
    "loaded_state", "num_val_samples_to_print",
)  # fmt: skip

_FLOAT32_MAX = float(np.finfo(np.float32).max)

_TRUNCATION_TYPES = (None, "tis", "icepop", "seq-mask-tis")
_IS_LEVELS = (None, "sequence", "sequence_mean", "token")

# Pydantic's lax bool parsing, which NeMo's config models use.
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


@dataclass(frozen=True, slots=True)
class NemoRLSpec:
    """A validated NeMo-RL IS-correction setting; fields carry NeMo's own `loss_fn` key names.

    Args:
        name: display name.
        use_importance_sampling_correction: whether the weight multiplies the loss.
        truncated_importance_sampling_type: "tis", "icepop", "seq-mask-tis", or None.
        truncated_importance_sampling_ratio: the upper bound U (> 0), with a type only.
        truncated_importance_sampling_ratio_min: the lower bound L (<= U); required for
            icepop and seq-mask-tis, optional for tis (0 when None).
        sequence_level_importance_ratios: GSPO: sequence-level PPO ratio and IS weight e^{S}.
        token_level_loss: token-mean loss (False: mean of per-sequence token means).
        is_correction_level: PR #2269 (not on main): the IS weight's level, overriding
            `sequence_level_importance_ratios` for the weight only; None derives it.
        seq_logprob_error_threshold: `grpo.seq_logprob_error_threshold` tau: keep a sequence
            iff its mean e^{|d|} over loss tokens is <= tau; None keeps every sequence.

    >>> spec = PRESETS["nemo_icepop"]
    >>> spec.level, spec.to_config()["loss_fn"]["truncated_importance_sampling_ratio_min"]
    ('token', 0.5)
    """

    framework: ClassVar[str] = NAME

    name: str = NAME
    use_importance_sampling_correction: bool = False
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = None
    truncated_importance_sampling_ratio: float | None = None
    truncated_importance_sampling_ratio_min: float | None = None
    sequence_level_importance_ratios: bool = False
    token_level_loss: bool = True
    is_correction_level: Literal["sequence", "sequence_mean", "token"] | None = None
    seq_logprob_error_threshold: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"Expected `name` to be a string, but got {quote(self.name)}")
        check_number(_SEQ_ERROR, self.seq_logprob_error_threshold, nullable=True)
        for field, key in (
            ("use_importance_sampling_correction", _ENABLED),
            ("sequence_level_importance_ratios", _SEQ_LEVEL),
            ("token_level_loss", _TOKEN_LOSS),
        ):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"Expected `{key}` to be a bool, but got {quote(getattr(self, field))}"
                )
        check_choice(_TYPE, self.truncated_importance_sampling_type, _TRUNCATION_TYPES)
        check_choice(_IS_LEVEL, self.is_correction_level, _IS_LEVELS)
        if self.sequence_level_importance_ratios and self.token_level_loss:
            raise ConfigError(
                f"Expected `{_SEQ_LEVEL}: true` to come with `{_TOKEN_LOSS}: false` (NeMo makes "
                "sequence-level importance ratios exclusive with the token-level loss)"
            )
        kind = self.truncated_importance_sampling_type
        upper = self.truncated_importance_sampling_ratio
        lower = self.truncated_importance_sampling_ratio_min
        if kind is None:
            if upper is not None:
                raise ConfigError(
                    f"Expected `{_TYPE}` to be one of 'tis', 'icepop', 'seq-mask-tis' when "
                    f"`{_RATIO}` is set ({quote(upper)}), but got None (NeMo raises 'Invalid "
                    "truncated "
                    "importance sampling type: None')"
                )
            if lower is not None:
                raise ConfigError(
                    f"Expected `{_RATIO_MIN}` to be None without `{_TYPE}`, but got {quote(lower)}"
                )
            return
        if not self.use_importance_sampling_correction:
            raise ConfigError(
                f"Expected `{_ENABLED}: true` with `{_TYPE}: {kind}` (NeMo supports truncated "
                "importance sampling only with the correction on), but got false"
            )
        if upper is None:
            raise ConfigError(f"Expected `{_RATIO}` to be a float > 0 with `{_TYPE}: {kind}`")
        upper = as_float(upper, _RATIO, gt=0.0)
        object.__setattr__(self, "truncated_importance_sampling_ratio", upper)
        if lower is None:
            if kind != "tis":
                raise ConfigError(
                    f"Missing `{_RATIO_MIN}`: NeMo requires it with `{_TYPE}: {kind}`"
                )
        else:
            lower = as_float(lower, _RATIO_MIN)
            if not lower <= upper:
                raise ConfigError(
                    f"Expected `{_RATIO_MIN}` <= `{_RATIO}` ({quote(upper)}), but got "
                    f"{quote(lower)}"
                )
            object.__setattr__(self, "truncated_importance_sampling_ratio_min", lower)
        if kind == "seq-mask-tis" and self.level != "token":
            key = _IS_LEVEL if self.is_correction_level is not None else _SEQ_LEVEL
            raise ConfigError(
                f"Expected token-level IS weights with `{_TYPE}: seq-mask-tis` (raw token "
                f"weights inside a sequence mask), but `{key}` makes them {quote(self.level)}"
            )

    @property
    def level(self) -> Literal["token", "sequence", "sequence_mean"]:
        """The IS weight's level: `is_correction_level`, else from the GSPO flag."""
        if self.is_correction_level is not None:
            return self.is_correction_level
        return "sequence" if self.sequence_level_importance_ratios else "token"

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting in NeMo's `loss_fn` keys, the inverse of `parse`
        (`is_correction_level` only when set, as main does not know it), and `grpo` with
        `seq_logprob_error_threshold` when set."""
        loss_fn: dict[str, Any] = {
            "use_importance_sampling_correction": self.use_importance_sampling_correction,
            "truncated_importance_sampling_type": self.truncated_importance_sampling_type,
            "truncated_importance_sampling_ratio": self.truncated_importance_sampling_ratio,
            "truncated_importance_sampling_ratio_min": self.truncated_importance_sampling_ratio_min,
            "sequence_level_importance_ratios": self.sequence_level_importance_ratios,
            "token_level_loss": self.token_level_loss,
        }
        if self.is_correction_level is not None:
            loss_fn["is_correction_level"] = self.is_correction_level
        config: dict[str, Any] = {"framework": NAME, "name": self.name}
        if self.seq_logprob_error_threshold is not None:
            config["grpo"] = {"seq_logprob_error_threshold": self.seq_logprob_error_threshold}
        return config | {"loss_fn": loss_fn}

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weight (and the unchanged keep mask) of this setting over `batch`."""
        d = ops.log_ratio(batch)
        mask = batch.loss_mask
        if self.level == "token":
            seq_raw = None
            raw = _float32_exp(d)
        else:
            if self.level == "sequence":
                exponent = ops.segment_sum(d, batch, mask)
            else:
                exponent = ops.segment_mean(d, batch, mask)
            seq_raw = _float32_exp(exponent)
            raw = per_token(seq_raw, batch)

        if self.truncated_importance_sampling_type == "seq-mask-tis":
            # Token level only: raw token weights, zeroed outside the geometric-mean band.
            cleaned = (
                d if ops.all_finite(d) else torch.nan_to_num(d, nan=0.0, posinf=0.0, neginf=0.0)
            )
            seq_raw = torch.exp(ops.segment_mean(cleaned, batch, mask))
            in_band = ops.band(
                seq_raw,
                self.truncated_importance_sampling_ratio_min,
                self.truncated_importance_sampling_ratio,
            )
            seq_weight = in_band.double()
            # raw is finite and >= 0, so raw * 0/1 is raw or 0: select instead of multiplying.
            weight = torch.where(ops.broadcast(in_band, batch), raw, 0.0)
        elif seq_raw is None:
            seq_weight = None
            weight = self._truncate(raw)
        else:
            seq_weight = self._truncate(seq_raw)
            weight = per_token(seq_weight, batch)

        if not self.use_importance_sampling_correction:
            # NeMo still computes the weights (for its metrics) but multiplies the loss by 1.
            weight = torch.ones_like(raw)
            seq_weight = None if seq_weight is None else torch.ones_like(seq_weight)
        keep = mask
        if self.seq_logprob_error_threshold is not None:
            # The GRPO step's filter: a rejected sequence leaves the loss mask (sample_mask).
            error = seq_mult_prob_error(batch)
            keep = mask & ops.broadcast(
                ops.band(error, upper=self.seq_logprob_error_threshold), batch
            )
        return Replay.build(batch, weight, keep, raw, seq_raw=seq_raw, seq_weight=seq_weight)

    def _truncate(self, w: torch.Tensor) -> torch.Tensor:
        """`tis`: clamp into [L or 0, U]; `icepop`: zero outside [L, U]; else unchanged."""
        upper = self.truncated_importance_sampling_ratio
        lower = self.truncated_importance_sampling_ratio_min
        if self.truncated_importance_sampling_type == "tis":
            return ops.truncate(w, 0.0 if lower is None else lower, upper)
        if self.truncated_importance_sampling_type == "icepop":
            return torch.where(ops.band(w, lower, upper), w, 0.0)
        return w


def seq_mult_prob_error(batch: TokenBatch) -> torch.Tensor:
    """float64 [B]: NeMo-RL's per-sequence multiplicative probability error E, the mean of
    e^{|d|} over each sequence's loss tokens (0 without any; NaN where a masked token's |d| is
    not finite, as NeMo's e^{|d| * 0} * 0 is there).

    >>> from iscore.packed.batch import TokenBatch
    >>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0, -1.0]),
    ...                train=torch.tensor([-1.5, -0.5, -1.0]), cu_seqlens=torch.tensor([0, 2, 3]))
    >>> [round(e, 4) for e in seq_mult_prob_error(b).tolist()]  # sign-blind, >= 1
    [1.6487, 1.0]
    """
    mask = batch.loss_mask
    error = ops.log_ratio(batch).abs()
    values = torch.where(mask, torch.exp(error), 0.0)
    if not ops.all_finite(error):
        values = torch.where(mask | torch.isfinite(error), values, math.nan)
    count = ops.segment_count(batch, mask)
    return torch.where(count > 0, ops.segment_sum(values, batch) / count.clamp(min=1.0), 0.0)


def _float32_exp(x: torch.Tensor) -> torch.Tensor:
    """e^x as NeMo gets it: float32 exp, where overflow to inf (and NaN) becomes 0.

    Computed in float64; values whose float32 cast is not finite are zeroed, reproducing
    `torch.nan_to_num(torch.exp(x_fp32), nan=0, posinf=0, neginf=0)`. When no value can
    overflow (the maximum, NaN if any value is, is within float32's range) that is e^x itself,
    the shared exp of the batch's log-ratio.
    """
    w = ops.exp(x.double(), bound=None)
    if w.numel() == 0 or bool(w.max() <= _FLOAT32_MAX):
        return w
    return torch.where(torch.isfinite(w.float()), w, 0.0)


def _lax_bool(section: Section, key: str, default: bool) -> bool:
    """A bool as pydantic's lax mode reads it: bools, 0/1, and "true"/"false"-like strings."""
    value = section.raw(key, default)
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise ConfigError(f"Expected `{section.key(key)}` to be a bool, but got {quote(value)}")


def parse(config: Mapping[str, Any]) -> NemoRLSpec:
    """Parse a NeMo-RL config (its `loss_fn` section, plus `framework: nemo_rl` and `name:`).

    >>> loss_fn = {"use_importance_sampling_correction": True}
    >>> loss_fn |= {"truncated_importance_sampling_type": "seq-mask-tis"}
    >>> loss_fn |= {"truncated_importance_sampling_ratio": 1.002}
    >>> loss_fn |= {"truncated_importance_sampling_ratio_min": 0.999}
    >>> spec = parse({"framework": "nemo_rl", "loss_fn": loss_fn})
    >>> spec.level, spec.truncated_importance_sampling_ratio_min
    ('token', 0.999)

    Raises:
        ConfigError: an unknown key, a wrong type or value, or a combination NeMo-RL rejects;
            the message names the key.
    """
    top, name = top_level(config, NAME)
    grpo = top.section("grpo")
    loss = top.section("loss_fn")
    top.done()
    tau = grpo.float("seq_logprob_error_threshold", None)
    grpo.done(ignore=_GRPO_OTHER_KEYS)
    if tau is not None and tau < 1.0:
        warnings.warn(
            f"`{_SEQ_ERROR}` {tau:g} < 1 drops every sequence with a loss token: the mean of "
            "e^|d| is at least 1",
            UserWarning,
            stacklevel=2,
        )

    enabled = _lax_bool(loss, "use_importance_sampling_correction", False)
    kind = loss.choice("truncated_importance_sampling_type", None, _TRUNCATION_TYPES)
    upper = loss.float("truncated_importance_sampling_ratio", None)
    lower = loss.float("truncated_importance_sampling_ratio_min", None)
    seq_level = _lax_bool(loss, "sequence_level_importance_ratios", False)
    token_level_loss = _lax_bool(loss, "token_level_loss", True)
    is_level = loss.choice("is_correction_level", None, _IS_LEVELS)
    _parse_other_keys(loss, seq_level=seq_level, token_level_loss=token_level_loss)
    loss.done()

    if kind is None and upper is None and lower is not None:
        warnings.warn(
            f"NeMo-RL ignores `{_RATIO_MIN}` without `{_TYPE}` and `{_RATIO}`; it is dropped",
            UserWarning,
            stacklevel=2,
        )
        lower = None
    return NemoRLSpec(
        name=name,
        use_importance_sampling_correction=enabled,
        truncated_importance_sampling_type=kind,
        truncated_importance_sampling_ratio=upper,
        truncated_importance_sampling_ratio_min=lower,
        sequence_level_importance_ratios=seq_level,
        token_level_loss=token_level_loss,
        is_correction_level=is_level,
        seq_logprob_error_threshold=tau,
    )


def _parse_other_keys(loss: Section, *, seq_level: bool, token_level_loss: bool) -> None:
    """Type-check the `ClippedPGLossConfig` keys that do not change the IS weight, with the
    assertions NeMo's `ClippedPGLossFn` makes on them."""
    loss.float("ratio_clip_min", 0.2)
    loss.float("ratio_clip_max", 0.2)
    clip_c = loss.float("ratio_clip_c", None)
    if clip_c is not None and not clip_c > 1:
        raise ConfigError(
            f"Expected `{loss.key('ratio_clip_c')}` to be a float > 1 or null, but got "
            f"{quote(clip_c)}"
        )
    loss.float("reference_policy_kl_penalty", 0.01)
    loss.choice("reference_policy_kl_type", "k3", ("k1", "k2", "k3"))
    loss.float("kl_input_clamp_value", 20.0, nullable=True)
    loss.float("kl_output_clamp_value", 10.0, nullable=True)
    loss.float("positive_example_nll_weight", 0.0)
    for key in ("use_kl_in_reward", "use_on_policy_kl_approximation"):
        _lax_bool(loss, key, False)
    disable_ppo_ratio = _lax_bool(loss, "disable_ppo_ratio", False)
    force_on_policy_ratio = _lax_bool(loss, "force_on_policy_ratio", False)
    if not _lax_bool(loss, "use_cispo", False):
        return
    conflicts = {
        "disable_ppo_ratio": disable_ppo_ratio,
        "force_on_policy_ratio": force_on_policy_ratio,
        "sequence_level_importance_ratios": seq_level,
        "ratio_clip_c": clip_c is not None,
        "token_level_loss": not token_level_loss,
    }
    for key, conflict in conflicts.items():
        if conflict:
            wanted = "true" if key == "token_level_loss" else "false or null"
            raise ConfigError(
                f"Expected `{loss.key(key)}` to be {wanted} with `{loss.key('use_cispo')}: true` "
                "(NeMo rejects the combination)"
            )


def _presets() -> dict[str, NemoRLSpec]:
    """NeMo-RL's documented reference settings (loss_functions.py comments, ProRL guide)."""
    ratio, ratio_min = (
        "truncated_importance_sampling_ratio",
        "truncated_importance_sampling_ratio_min",
    )
    kind = "truncated_importance_sampling_type"
    table: dict[str, dict[str, Any]] = {
        # Raw, untruncated token weights e^d.
        "nemo_is": {},
        "nemo_tis": {kind: "tis", ratio: 2.0},
        "nemo_icepop": {kind: "icepop", ratio: 5.0, ratio_min: 0.5},
        # ProRL v2.1's recommendation for reasoning.
        "nemo_seq_mask_tis": {kind: "seq-mask-tis", ratio: 1.002, ratio_min: 0.999},
        # GSPO's product weight e^S.
        "nemo_gspo_is": {"sequence_level_importance_ratios": True, "token_level_loss": False},
        # The Nemotron-3-Nano recipe (examples/nemo_gym/grpo_nanov3.yaml, explained in
        # docs/guides/nemotron-3-nano.md): raw weights, sequences with E > 2 filtered out.
        "nemo_nanov3_seq_error_filter": {"seq_logprob_error_threshold": 2.0},
    }
    return {
        name: NemoRLSpec(name=name, use_importance_sampling_correction=True, **fields)
        for name, fields in table.items()
    }


PRESETS: dict[str, NemoRLSpec] = _presets()
"""NeMo-RL's reference settings, under descriptive iscore names (all with the correction on)."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: NemoRLSpec) -> Canonical:
    tau = spec.seq_logprob_error_threshold
    extra = () if tau is None else (mask_component("geometric", upper=tau, statistic="mult_error"),)
    if not spec.use_importance_sampling_correction:
        return Canonical(extra)
    level: Level = {"token": "token", "sequence": "sequence", "sequence_mean": "geometric"}[
        spec.level
    ]
    kind = spec.truncated_importance_sampling_type
    upper = spec.truncated_importance_sampling_ratio
    lower = spec.truncated_importance_sampling_ratio_min
    numerics: Numerics = "overflow_zero"
    if kind == "seq-mask-tis":
        # The geometric mean itself is a plain float64 exp of the (nan-cleaned) mean.
        weight = weight_component(
            "token", numerics=numerics, zero=mask_component("geometric", lower, upper)
        )
    elif kind == "icepop":
        band = mask_component(level, lower, upper, numerics=numerics)
        weight = weight_component(level, numerics=numerics, zero=band)
    elif kind == "tis":
        weight = weight_component(level, lower=lower, upper=upper, numerics=numerics)
    else:
        weight = weight_component(level, numerics=numerics)
    return Canonical((weight, *extra))


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    w = first_weight(c, notes, "NeMo-RL")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    error = next((m for m in masks if m.statistic == "mult_error"), None)
    if error is not None:
        masks.remove(error)
    if w is not None:
        note_numerator(notes, w, "train", "NeMo-RL")
    zero = None if w is None else w.zero
    bands = [*([zero] if zero is not None else []), *masks]
    geo = next((m for m in bands if m.level == "geometric" and ratio_bounds(m)), None)
    if geo is not None:
        lower, upper = ratio_bounds(geo)
        fields = _nemo_type("seq-mask-tis", lower or 0.0, upper)
        if geo is not zero:
            masks.remove(geo)
            lost(
                notes,
                geo,
                "NeMo-RL zeroes those sequences' weights (seq-mask-tis) instead "
                "of removing them from the loss mask",
            )
        if w is None:
            notes.append(
                "NeMo-RL's seq-mask-tis weights kept tokens by their raw ratio; the "
                "source applies no weight"
            )
        elif w.level != "token" or w.lower is not None or w.upper is not None:
            lost(notes, w, "NeMo-RL's seq-mask-tis keeps raw, untruncated token weights")
    elif w is not None:
        fields = _nemo_weight(w, notes)
    # A raw token weight (or none) leaves NeMo-RL's one band free for a token mask.
    free = w is None or (w.level == "token" and not fields)
    for m in masks:
        bounds = ratio_bounds(m)
        if free and bounds is not None and ratio_level(m) == "token":
            fields = _nemo_type("icepop", bounds[0] or 0.0, bounds[1])
            free = False
            lost(
                notes,
                m,
                "NeMo-RL zeroes those tokens' weights (IcePop) instead of removing "
                "them; kept tokens carry the raw ratio",
            )
        else:
            lost(notes, m, "NeMo-RL has no rejection mask; dropped")
    note_extras(notes, c, "NeMo-RL")
    if w is not None or fields:
        fields["use_importance_sampling_correction"] = True
    if error is not None:
        fields["seq_logprob_error_threshold"] = _seq_error_threshold(error, notes)
    return [(NemoRLSpec(name=name, **fields), tuple(notes))]


def _seq_error_threshold(m: Component, notes: list[str]) -> float:
    """`seq_logprob_error_threshold` for a band on e^{|d|}: NeMo's is the sequence mean's
    inclusive upper bound (a lower bound at or below 1 decides nothing: the mean is >= 1)."""
    if m.level != "geometric":
        lost(notes, m, "NeMo-RL bounds the mean of e^|d| over the loss tokens")
    if m.lower is not None and m.lower > 1.0:
        lost(notes, m, "NeMo-RL bounds the mean of e^|d| from above only")
    if m.strict:
        lost(notes, m, "NeMo-RL's bound is inclusive")
    return math.inf if m.upper is None else m.upper


def _nemo_type(kind: str, lower: float | None, upper: float | None) -> dict[str, Any]:
    return {
        "truncated_importance_sampling_type": kind,
        "truncated_importance_sampling_ratio": math.inf if upper is None else upper,
        "truncated_importance_sampling_ratio_min": lower,
    }


def _nemo_weight(w: Component, notes: list[str]) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if w.level == "sequence":
        fields = {"sequence_level_importance_ratios": True, "token_level_loss": False}
        notes.append(
            "NeMo-RL's sequence-level weight comes with GSPO: sequence_level_importance_ratios "
            "also makes the PPO ratio a geometric mean and needs token_level_loss: false (open "
            "PR #2269's is_correction_level: sequence would change the weight only)"
        )
    elif w.level != "token":
        lost(
            notes,
            w,
            "NeMo-RL main has no geometric-mean weight (open PR #2269's "
            "is_correction_level: sequence_mean); written as a token-level weight",
        )
    if w.zero is not None:
        lower, upper = ratio_bounds(w.zero) or (None, None)
        if w.upper is not None and (upper is None or w.upper < upper):
            lost(notes, w, f"NeMo-RL's icepop keeps the raw ratio; the cap {w.upper:g} is dropped")
        if w.zero.strict:
            lost(notes, w.zero, "NeMo-RL's bounds are inclusive")
        return fields | _nemo_type("icepop", lower or 0.0, upper)
    if w.lower is not None or w.upper is not None:
        return fields | _nemo_type("tis", w.lower, w.upper)
    return fields


# ------------------------------------------------------------------ dump adapter


def read_batch(train_data: Any) -> list[BatchFields]:
    """NeMo-RL's GRPO `train_data` (a `BatchedDataDict`) -> its dump fields.

    NeMo-RL already writes both log-probs every step (`train_data_step{N}.jsonl`, which
    `iscore convert` reads); this writes the same values as Parquet directly. Where
    (nemo_rl/algorithms/grpo.py at NVIDIA-NeMo/RL@7ea279ab, `grpo_train`): `train_data` is built
    at l.3165-3173, gets `prev_logprobs` at l.3239 and `advantages` at l.3294-3322, and is
    logged at l.3633-3655, where a call beside NeMo-RL's own `log_batched_dict_as_jsonl` sees
    everything.

    [B, S] tensors over prompt + response, the value at index i belonging to token i (0 on the
    prompt): `generation_logprobs` (vLLM/SGLang), `prev_logprobs` (the recompute; zeros with
    `force_on_policy_ratio`, l.3247), `token_mask` (the generated tokens), `input_ids`,
    `advantages` (per token); `sample_mask` [B] (0 for a sequence left out of the loss),
    written as the loss mask.
    """
    what = "NeMo-RL's train_data"
    return [
        BatchFields(
            _batch.need(
                train_data, "generation_logprobs", what, "NeMo-RL builds it at grpo.py l.3169"
            ),
            _batch.need(
                train_data,
                "prev_logprobs",
                what,
                "call add_batch after NeMo-RL's recompute (grpo.py l.3239)",
            ),
            mask=_batch.need(train_data, "token_mask", what, "NeMo-RL builds it at grpo.py l.3170"),
            loss_mask=_batch.field(train_data, "sample_mask"),
            advantages=_batch.field(train_data, "advantages"),
            token_ids=_batch.field(train_data, "input_ids"),
        )
    ]


# ------------------------------------------------------------------ the framework


def _aggregation(spec: NemoRLSpec) -> Aggregation:
    # A filtered sequence leaves global_valid_toks and global_valid_seqs (its sample_mask is 0).
    return Aggregation(
        "token-mean" if spec.token_level_loss else "seq-mean-token-mean",
        shrinks=spec.seq_logprob_error_threshold is not None,
    )


_FLOAT32_EXP_MAX = math.log(_FLOAT32_MAX)  # 88.72


def _overflow(batch: TokenBatch, measure: Measure) -> str | None:
    m = batch.loss_mask
    S = ops.segment_sum(ops.log_ratio(batch), batch, m)
    overflow = int((S[ops.segment_count(batch, m) > 0] > _FLOAT32_EXP_MAX).sum())
    if not overflow:
        return None
    return (
        f"NeMo-RL's sequence-level weight e^S overflows float32 and becomes 0 (not the "
        f"cap) for {overflow} sequence(s) with S > 88.7: with "
        "sequence_level_importance_ratios those sequences get no gradient."
    )


_TP_ACCURACY = Citation(
    "NeMo-RL docs, DTensor Tensor Parallel Accuracy Issue",
    "https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/dtensor-tp-accuracy.md",
)
_KL_ERROR = Citation(
    "NeMo-RL docs, GRPO guide: KL Divergence Error",
    "https://github.com/NVIDIA-NeMo/RL/blob/main/docs/guides/grpo.md#kl-divergence-error",
)
_KL_MEANING = "above 1e-3: investigate (the guide calls values below 1e-3 acceptable)"
BANDS = (
    HealthBand(
        "token_mult_prob_error",
        None,
        1.05,
        "token_mult_prob_error",
        "above 1.05: a potential framework issue; isolated spikes that return to about 1.0 "
        "are acceptable, an upward trend is not",
        _TP_ACCURACY,
    ),
    HealthBand("k3", None, 1e-3, "gen_kl_error", _KL_MEANING, _KL_ERROR),
    HealthBand("js", None, 1e-3, "js_divergence_error", _KL_MEANING, _KL_ERROR),
)
"""The bands NeMo-RL's docs publish: token_mult_prob_error near 1.0, a framework issue above
1.05 (the DTensor accuracy guide); gen_kl_error and js_divergence_error below 1e-3 (the GRPO
guide). The guide holds policy_kl_error to the same 1e-3, but shows it driven to 22,015 by a
single token the trainer finds much less likely than the sampler: as a verdict it would judge
one token (a bf16 dump of 60k tokens crosses it with one), which the mismatch flags report as
a heavy tail instead."""

_ISSUE_1801 = Citation(
    "NeMo-RL issue #1801 (a bisect of a Megatron crash)",
    "https://github.com/NVIDIA-NeMo/RL/issues/1801",
)
REFERENCES = (
    ReferencePoint(
        "DTensor trainer, GRPO, 109 steps (median over steps)",
        "DeepSeek-R1-Distill-Qwen-1.5B",
        "bf16",
        "token_mult_prob_error",
        1.0121,
        "token_mult_prob_error",
        _ISSUE_1801,
    ),
    ReferencePoint(
        "Megatron trainer with its default fused kernels, a crashing run (median over steps)",
        "DeepSeek-R1-Distill-Qwen-1.5B",
        "bf16",
        "token_mult_prob_error",
        38565.0,
        "token_mult_prob_error",
        _ISSUE_1801,
        "rope and bias-activation fusions keep bf16 intermediates that the rollout engine "
        "computes in fp32; with both off the median is 1.0116",
    ),
)
"""Measurements published in NeMo-RL's issues."""


FRAMEWORK = Framework(
    name=NAME,
    title="NeMo-RL",
    upstream=Upstream("NVIDIA-NeMo/RL", "7ea279abfbeb698b092856d0dab61e7cf39bc909", "2026-08-22"),
    spec_types=(NemoRLSpec,),
    parse=parse,
    presets=lambda: PRESETS,
    default="nemo_is",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=snippets.nested,
    aggregation=_aggregation,
    # Not seq_tis: NeMo-RL's e^S overflows float32 to a weight of 0 above S = 88.7, where the
    # family caps it (and the setting also makes the PPO ratio GSPO's).
    families=frozenset({"token_tis", "icepop"}),
    columns={  # train_data_step*.jsonl and the loss function's inputs
        "rollout_logprob": ("generation_logprobs",),
        "train_logprob": ("prev_logprobs",),
        "policy_logprob": ("curr_logprobs",),
        "loss_mask": ("token_loss_mask",),
    },
    metrics={
        "k1": ("gen_kl_error (kl_type k1)",),
        "k2": ("gen_kl_error (kl_type k2)",),
        "k3": ("gen_kl_error (default k3)",),
        "k3_reverse": ("policy_kl_error",),
        "token_mult_prob_error": ("token_mult_prob_error",),
        "js": ("js_divergence_error",),
    },
    bands=BANDS,
    gates=BANDS[:1],  # token_mult_prob_error <= 1.05, the rule its docs give
    support="applies the sampling's top-k / top-p to the trainer's logits on main (#2053)",
    references=REFERENCES,
    traps=(
        Trap(
            "float32-overflow-to-zero",
            "NeMo-RL's sequence-level weight e^S overflows float32 above S = 88.7 and becomes 0 "
            "(not the cap): those sequences get no gradient.",
            _overflow,
        ),
        Trap(
            "seq-logprob-error-sign-blind",
            "NeMo-RL's grpo.seq_logprob_error_threshold filters on the sequence mean of e^|d|, "
            "which is sign-blind (a token the trainer finds likelier counts as much as one it "
            "finds less likely) and at least 1: a threshold below 1 drops every sequence.",
            about=lambda spec: spec.seq_logprob_error_threshold is not None,
        ),
        Trap(
            "seq-logprob-error-leaves-everything",
            "NeMo-RL's seq_logprob_error_threshold takes a filtered sequence out of the loss, "
            "both denominators and the advantage estimator's mask (before the advantages are "
            "computed), yet GRPO's default estimator still counts it in its group's baseline "
            "and std.",
            about=lambda spec: spec.seq_logprob_error_threshold is not None,
        ),
    ),
    read_batch=read_batch,
)
