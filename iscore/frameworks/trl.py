"""TRL: `GRPOTrainer`'s vLLM importance-sampling correction (`vllm_importance_sampling_*`).

Citation read: `huggingface/trl` @ f2cd5771 (2026-07-24, 1.10.0.dev0), `trl/trainer/grpo_config.py`
(`GRPOConfig`, its `__post_init__`) and `trl/trainer/grpo_trainer.py`
(`_generate_and_score_completions`, `_compute_loss`).

What TRL computes, in its order, when `use_vllm` and `vllm_importance_sampling_correction`:

1. d_t = (train - rollout) * mask, the mask being `completion_mask * tool_mask` (the loss mask).
2. Token modes: rho_t = e^{d_t}; sequence modes: rho = e^{S}, S = sum_t d_t, the **product**
   ratio. No safety clamp: in TRL's float32 e^S overflows to inf for S > 88.72 and underflows
   to 0 for S < -103.97. The replay computes in float64 and casts the ratio to float32 to
   reproduce exactly that, then applies the bounds in float32 as TRL does.
3. `*_truncate`: w = clamp(rho, clip_min, clip_max), None leaving a side open (an overflowed
   sequence gets clip_max). `*_mask`: w = rho * 1[clip_min <= rho <= clip_max] (inclusive,
   None = -inf / +inf; an overflowed sequence is masked to 0, or weighted inf if clip_max is
   None). The weight multiplies the per-token loss; the loss mask and the denominator are
   left alone, so `keep` is the loss mask in every mode.

Config: `GRPOConfig` keys, at the top level or under `grpo_config:`.

| key | default |
|---|---|
| `use_vllm` | TRL: false; **here: true** (below) |
| `vllm_importance_sampling_correction` | true |
| `vllm_importance_sampling_mode` | `sequence_mask`; or `token_truncate`, `token_mask`, |
| | `sequence_truncate` |
| `vllm_importance_sampling_clip_max` | 3.0 (null = no upper bound) |
| `vllm_importance_sampling_clip_min` | null |
| `vllm_importance_sampling_cap` | deprecated: overrides `clip_max` with a FutureWarning |
| `off_policy_mask_threshold` | null (OPSM; needs advantages, not replayable yet) |
| `loss_type` | `dapo`; `vespo` folds the ratio into its gamma weights (not replayable) |

Every other field declared in `grpo_config.py` (and the six that its base `_BaseConfig`
redeclares) is accepted and ignored; anything else (including `TrainingArguments` keys that
`GRPOConfig` only inherits, and `ScriptArguments` / `ModelConfig` keys of a `trl grpo` YAML) is
an unknown-key error, because that set cannot be pinned to one TRL commit.

`use_vllm`: TRL only corrects when generation ran in vLLM, and `GRPOConfig` defaults
`use_vllm` to false. A dump replayed here holds an inference engine's log-probs, so it came from
a `use_vllm: true` run (without vLLM TRL records no sampling log-probs at all). A config that
omits `use_vllm` is therefore read as `use_vllm: true`; an explicit `use_vllm: false` is
honoured as TRL would (no weight), so a complete config dumped from a run replays literally.

Validation follows TRL: clip_min >= clip_max is an error (TRL checks it even with the
correction off, after applying the deprecated cap); a truncate mode needs at least one bound;
`vespo` with a sequence mode is rejected (by TRL, with use_vllm and the correction on). TRL does
not check the bounds' signs; here clip_max (and the deprecated cap) must be > 0 and clip_min
>= 0 (0 bounds nothing, as null does), even where the cap overrides clip_max.

Where TRL's documentation (docs/corrections.md#trl) and its code differ: nowhere in the math. The
docstring of
`GRPOConfig` still calls `token_truncate` the default (grpo_config.py:339) while the field
default is `sequence_mask` (grpo_config.py:925), as the spec notes.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0, -1.0]), train=torch.tensor([0.5, -1.0, -1.5]),
...                cu_seqlens=torch.tensor([0, 1, 3]))
>>> r = parse({"framework": "trl"}).replay(b)  # sequence_mask, clip_max 3: e^1.5 > 3 is masked
>>> [round(w, 4) for w in r.weight.tolist()]
[0.0, 0.6065, 0.6065]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import check_number, top_level
from iscore.frameworks.base import (
    Aggregation,
    BatchFields,
    Citation,
    Framework,
    Measure,
    ReferencePoint,
    Trap,
    Upstream,
)
from iscore.frameworks.canonical import (
    Canonical,
    Level,
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
from iscore.frameworks.spec import Replay
from iscore.packed import TokenBatch, ops

NAME = "trl"

Mode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo"]

_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")

_OTHER_GRPO_KEYS = frozenset(
    """
    learning_rate model_init_kwargs trust_remote_code router_aux_loss_coef disable_dropout
    cast_lm_head_to_fp32 remove_unused_columns num_generations num_generations_eval
    max_completion_length ds3_gather_for_generation shuffle_dataset pad_to_multiple_of
    generation_batch_size steps_per_generation temperature top_p top_k min_p generation_kwargs
    chat_template_kwargs repetition_penalty cache_implementation vllm_mode vllm_model_impl
    vllm_enable_sleep_mode vllm_structured_outputs_regex vllm_server_base_url vllm_server_host
    vllm_server_port vllm_server_timeout vllm_group_port vllm_gpu_memory_utilization
    vllm_max_model_length vllm_tensor_parallel_size beta num_iterations epsilon delta
    epsilon_high sapo_temperature_neg sapo_temperature_pos vespo_k_pos vespo_lambda_pos
    vespo_k_neg vespo_lambda_neg importance_sampling_level reward_weights
    multi_objective_aggregation scale_rewards mask_truncated_completions sync_ref_model
    ref_model_mixup_alpha ref_model_sync_steps top_entropy_quantile entropy_coef
    use_adaptive_entropy entropy_coef_min entropy_coef_max entropy_coef_delta entropy_target
    max_tool_calling_iterations use_bias_correction_kl log_completions log_multimodal
    num_completions_to_print log_unique_prompts log_completions_hub_repo
    use_transformers_continuous_batching transformers_continuous_batching_config
    use_transformers_paged logging_steps gradient_checkpointing bf16 lr_scheduler_kwargs
    use_liger_kernel torch_empty_cache_steps
    """.split()  # noqa: SIM905 (one field name per word reads better than 85 quoted strings)
)
"""The `GRPOConfig` fields (grpo_config.py @ f2cd5771) and `_BaseConfig` fields (base_config.py)
that do not change the IS weight: accepted in a pasted config and ignored."""


@dataclass(frozen=True, slots=True)
class TRLCorrection:
    """TRL's vLLM IS correction, as set by `GRPOConfig`.

    Args:
        use_vllm: `use_vllm`; the correction only acts with vLLM generation.
        enabled: `vllm_importance_sampling_correction`.
        mode: `vllm_importance_sampling_mode`.
        clip_min: `vllm_importance_sampling_clip_min`; None leaves the lower side open.
        clip_max: `vllm_importance_sampling_clip_max` (after the deprecated cap); None is open.
        off_policy_mask_threshold: OPSM delta; must be None (replaying it needs advantages).
        loss_type: `loss_type`; only `vespo` changes how the ratio is used.
        name: display name.
    """

    framework: ClassVar[str] = NAME
    use_vllm: bool = True
    enabled: bool = True
    mode: Mode = "sequence_mask"
    clip_min: float | None = None
    clip_max: float | None = 3.0
    off_policy_mask_threshold: float | None = None
    loss_type: LossType = "dapo"
    name: str = NAME

    def __post_init__(self) -> None:
        for key, value in (
            ("use_vllm", self.use_vllm),
            ("vllm_importance_sampling_correction", self.enabled),
        ):
            if not isinstance(value, bool):
                raise ConfigError(f"Expected `{key}` to be a bool, but got {quote(value)}")
        if self.mode not in _MODES:
            raise ConfigError(
                f"Expected `vllm_importance_sampling_mode` to be one of {', '.join(_MODES)}, "
                f"but got {quote(self.mode)}"
            )
        if self.loss_type not in _LOSS_TYPES:
            raise ConfigError(
                f"Expected `loss_type` to be one of {', '.join(_LOSS_TYPES)}, "
                f"but got {quote(self.loss_type)}"
            )
        check_number("vllm_importance_sampling_clip_min", self.clip_min, ge=0.0, nullable=True)
        check_number("vllm_importance_sampling_clip_max", self.clip_max, gt=0.0, nullable=True)
        both = self.clip_min is not None and self.clip_max is not None
        if both and self.clip_min >= self.clip_max:
            raise ConfigError(
                f"Expected `vllm_importance_sampling_clip_min` ({self.clip_min}) to be less than "
                f"`vllm_importance_sampling_clip_max` ({self.clip_max}), as TRL requires"
            )
        truncate = self.mode.endswith("_truncate")
        if self.enabled and truncate and self.clip_min is None and self.clip_max is None:
            raise ConfigError(
                "Expected `vllm_importance_sampling_clip_min` or "
                f"`vllm_importance_sampling_clip_max` to be set: TRL requires a bound for "
                f"`vllm_importance_sampling_mode: {self.mode}`"
            )
        if self.off_policy_mask_threshold is not None:
            raise ConfigError(
                "`off_policy_mask_threshold` (OPSM) keeps a sequence iff its advantage is >= 0 or "
                "mean_t(rollout - policy) <= delta; replaying it needs per-sequence advantages, "
                "which iscore does not support yet. Set it to null."
            )
        if self.loss_type == "vespo" and self.active:
            if not self.mode.startswith("token_"):
                raise ConfigError(
                    "Expected `vllm_importance_sampling_mode` to be token_truncate or token_mask "
                    f"with `loss_type: vespo` (TRL rejects {quote(self.mode)})"
                )
            raise ConfigError(
                "`loss_type: vespo` folds the vLLM IS ratio into VESPO's gamma weights, which "
                "depend on advantages and the current policy; iscore cannot replay it"
            )

    @property
    def active(self) -> bool:
        """Whether TRL applies a weight at all (vLLM generation and the correction on)."""
        return self.use_vllm and self.enabled

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: its `GRPOConfig` keys at the top level (the form
        of a `trl grpo --config` YAML), the inverse of `parse`.

        `use_vllm: true` is always written: TRL defaults it to false, which turns the correction
        off. `off_policy_mask_threshold` is always null here and not written.

        >>> config = TRLCorrection(mode="token_truncate", clip_max=2.0).to_config()
        >>> config["vllm_importance_sampling_mode"], config["vllm_importance_sampling_clip_max"]
        ('token_truncate', 2.0)
        """
        return {
            "framework": NAME,
            "name": self.name,
            "use_vllm": self.use_vllm,
            "vllm_importance_sampling_correction": self.enabled,
            "vllm_importance_sampling_mode": self.mode,
            "vllm_importance_sampling_clip_min": self.clip_min,
            "vllm_importance_sampling_clip_max": self.clip_max,
            "loss_type": self.loss_type,
        }

    def _constrain(self, rho: torch.Tensor) -> torch.Tensor:
        """Truncate or mask float32 ratios with TRL's bounds (compared in float32, as TRL does)."""
        if self.mode.endswith("_truncate"):
            return ops.truncate(rho, self.clip_min, self.clip_max)
        return torch.where(ops.band(rho, self.clip_min, self.clip_max), rho, 0.0)

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights as `GRPOTrainer` multiplies them into the per-token loss."""
        mask = batch.loss_mask
        if not self.active:
            ones = torch.ones(batch.num_tokens, dtype=torch.float64, device=batch.device)
            return Replay.build(batch, ones, mask, ones)
        # TRL zeroes d outside the mask before summing or exponentiating (with an all-true
        # mask, d is the shared log-ratio, and its exp and sums are shared too).
        d = ops.log_ratio(batch)
        if not ops.mask_is_all(batch, mask):
            d = torch.where(mask, d, 0.0)
        if self.mode.startswith("token_"):
            rho = ops.exp(d, bound=None).float()  # float32 like TRL's; no safety clamp
            return Replay.build(batch, self._constrain(rho), mask, rho)
        # float64 sum, then TRL's float32 e^S: overflow -> inf, underflow -> 0.
        seq_raw = torch.exp(ops.segment_sum(d, batch)).float()
        seq_weight = self._constrain(seq_raw)
        return Replay.build(
            batch,
            ops.broadcast(seq_weight, batch),
            mask,
            ops.broadcast(seq_raw, batch),
            seq_raw=seq_raw,
            seq_weight=seq_weight,
        )


def parse(config: Mapping[str, Any]) -> TRLCorrection:
    """Parse `GRPOConfig` keys (top level or under `grpo_config:`) into a spec.

    Raises:
        ConfigError: an unknown key, a wrong type, or a combination TRL rejects.

    >>> spec = parse({"framework": "trl", "grpo_config": {
    ...     "use_vllm": True, "vllm_importance_sampling_mode": "token_truncate",
    ...     "vllm_importance_sampling_clip_max": 2.0, "learning_rate": 1e-6}})
    >>> spec.mode, spec.clip_min, spec.clip_max
    ('token_truncate', None, 2.0)
    """
    top, name = top_level(config, NAME)
    s = top.section("grpo_config") if "grpo_config" in config else top
    if s is not top:
        top.done()
    clip_max = s.float("vllm_importance_sampling_clip_max", 3.0, gt=0.0, nullable=True)
    cap = s.float("vllm_importance_sampling_cap", None, gt=0.0)
    if cap is not None:
        # TRL warns and lets the deprecated cap override clip_max, even when both are set.
        overridden = (
            f"; it overrides `{s.key('vllm_importance_sampling_clip_max')}` ({clip_max})"
            if "vllm_importance_sampling_clip_max" in s.data
            else ""
        )
        warnings.warn(
            f"`{s.key('vllm_importance_sampling_cap')}` is deprecated in TRL (removed in v2.0.0); "
            f"use `vllm_importance_sampling_clip_max`{overridden}",
            FutureWarning,
            stacklevel=2,
        )
        clip_max = cap
    values = {
        "use_vllm": s.bool("use_vllm", True),
        "enabled": s.bool("vllm_importance_sampling_correction", True),
        "mode": s.choice("vllm_importance_sampling_mode", "sequence_mask", _MODES),
        "clip_min": s.float("vllm_importance_sampling_clip_min", None, ge=0.0),
        "off_policy_mask_threshold": s.float("off_policy_mask_threshold", None),
        "loss_type": s.choice("loss_type", "dapo", _LOSS_TYPES),
    }
    s.done(ignore=_OTHER_GRPO_KEYS)
    return TRLCorrection(**values, clip_max=clip_max, name=name)


PRESETS: dict[str, TRLCorrection] = {
    "trl_default": TRLCorrection(name="trl_default"),
    # The setting of TRL's PR #3867 (2025-09), token TIS at 2.0, now spelled with clip_max.
    "trl_token_tis": TRLCorrection(mode="token_truncate", clip_max=2.0, name="trl_token_tis"),
}
"""TRL's default (sequence product masked above 3) and the original token TIS setting."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: TRLCorrection) -> Canonical:
    if not spec.active:
        return Canonical()
    level: Level = "token" if spec.mode.startswith("token_") else "sequence"
    if spec.mode.endswith("_truncate"):
        weight = weight_component(
            level, lower=spec.clip_min, upper=spec.clip_max, numerics="float32"
        )
    else:
        band = mask_component(level, spec.clip_min, spec.clip_max, numerics="float32")
        weight = weight_component(level, numerics="float32", zero=band)
    return Canonical((weight,))


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    w = first_weight(c, notes, "TRL")
    masks = list(c.masks)
    fields: dict[str, Any] = {}
    level = "token"
    if w is not None:
        note_numerator(notes, w, "train", "TRL")
        level = "sequence" if w.level == "sequence" else "token"
        if w.level not in ("token", "sequence"):
            lost(
                notes,
                w,
                "TRL has no geometric-mean weight (its sequence modes use the "
                "product e^S); written per token",
            )
        zero = w.zero
        if zero is not None:
            masks.insert(0, zero)
            if w.upper is not None or w.lower is not None:
                lost(notes, w, "TRL's mask modes keep the raw ratio; the truncation is dropped")
        elif w.lower is not None or w.upper is not None:
            fields = {"mode": f"{level}_truncate", "clip_min": w.lower, "clip_max": w.upper}
    for m in masks:
        bounds = ratio_bounds(m)
        m_level = ratio_level(m)
        same = m_level == level or (w is None and m_level in ("token", "sequence"))
        # A truncation inside the band never binds, so a band within it replaces it.
        inside = (
            bounds is not None
            and fields.get("clip_min") is None
            and (fields.get("clip_max") is None or (bounds[1] or math.inf) <= fields["clip_max"])
        )
        replaceable = "mode" not in fields or fields["mode"].endswith("_truncate")
        if same and inside and replaceable:
            fields = {
                "mode": f"{m_level}_mask",
                "clip_min": bounds[0],
                "clip_max": bounds[1],
            }
            if w is None:
                notes.append(
                    "TRL's mask modes weight kept tokens by their raw ratio; the source "
                    "applies no weight"
                )
            if w is None or m is not w.zero:
                lost(
                    notes, m, "TRL zeroes those weights instead of removing them from the loss mask"
                )
        else:
            lost(notes, m, "no TRL mode expresses it beside the rest; dropped")
    if w is not None and not fields:
        fields = {
            "mode": f"{level}_mask",
            "clip_min": None,
            "clip_max": None,
        }  # the raw weight
    note_extras(notes, c, "TRL")
    if not fields:
        spec = TRLCorrection(enabled=False, name=name)
    else:
        low, high = fields["clip_min"], fields["clip_max"]
        if low is not None and high is not None and not low < high:
            notes.append("TRL needs clip_min < clip_max; clip_min dropped")
            fields["clip_min"] = None
        spec = TRLCorrection(name=name, **fields)
    return [(spec, tuple(notes))]


# ------------------------------------------------------------------ dump adapter


def read_batch(inputs: Any) -> list[BatchFields]:
    """TRL's GRPO loss inputs -> their dump fields.

    The dict `GRPOTrainer._generate_and_score_completions` returns (trl/trainer/grpo_trainer.py
    at huggingface/trl@f2cd5771, l.2260, built at l.2815-2853), one process's slice of the
    generation batch, which `_compute_loss` later splits into micro-batches. All [B, C]
    tensors are right-padded (l.2387-2413):

    - `sampling_per_token_logps`: the rollout engine's log-probs (l.2398-2407), only when
      generation returned them: vLLM, or a `rollout_func` whose output has `logprobs`
      (l.2160-2167); transformers' generate returns none (l.1877).
    - `old_per_token_logps`: the trainer's recompute, only when vLLM importance sampling is on
      or generation and optimisation steps are misaligned (l.2561-2576); otherwise TRL's loss
      uses the current policy's detached log-probs (l.3036-3037) and there is nothing to dump.
    - `completion_mask` (the tokens; zero rows for truncated completions with
      `mask_truncated_completions`, l.2417-2424), `tool_mask` (0 on tool output, which the
      loss leaves out, l.2426; written as the loss mask), `completion_ids`, and `advantages`,
      one per sequence (l.2738).
    """
    what = "TRL's loss inputs"
    return [
        BatchFields(
            _batch.need(
                inputs,
                "sampling_per_token_logps",
                what,
                "TRL keeps the rollout engine's log-probs only from vLLM (use_vllm=True) or a "
                "rollout_func that returns logprobs",
            ),
            _batch.need(
                inputs,
                "old_per_token_logps",
                what,
                "TRL recomputes them only with vllm_importance_sampling_correction (the "
                "default with vLLM) or when gradient_accumulation_steps is not a multiple of "
                "steps_per_generation x num_iterations (grpo_trainer.py l.2562)",
            ),
            mask=_batch.need(inputs, "completion_mask", what, "pass the dict GRPOTrainer built"),
            loss_mask=_batch.field(inputs, "tool_mask"),
            advantages=_batch.field(inputs, "advantages"),
            token_ids=_batch.field(inputs, "completion_ids"),
        )
    ]


# ------------------------------------------------------------------ the framework


def _aggregation(spec: TRLCorrection) -> Aggregation:
    if spec.loss_type == "grpo":
        return Aggregation("seq-mean-token-mean")
    if spec.loss_type == "dr_grpo":
        return Aggregation("seq-mean-token-sum")
    return Aggregation("token-mean")


def _render(body: Mapping[str, Any], fmt: str | None) -> str:
    """YAML under the `GRPOConfig(...)` call it is, or `--key value` flags."""
    if fmt == "yaml":
        return f"# {snippets.python_call('GRPOConfig', body)}\n" + snippets.yaml_text(body)
    if body.get("vllm_importance_sampling_clip_max", 0) is None:
        raise ConfigError(
            "Expected `fmt` to be 'yaml' for this TRL setting: "
            "`vllm_importance_sampling_clip_max: null` has no command-line form"
        )
    return snippets.option_flags(body)


def _default_mask(batch: TokenBatch, measure: Measure) -> str:
    default = measure(TRLCorrection(name=NAME))
    return (
        "TRL's default vllm_importance_sampling_mode is sequence_mask (product ratio masked "
        f"above 3.0): on this data it drops {default['seq_masked_fraction']:.1%} of sequences "
        f"and scales the LR by {default['lr_scale']:.3g}."
    )


_PR_7269 = Citation(
    "TRL pull request #7269 (vLLM's truncated-sampling log-probs)",
    "https://github.com/huggingface/trl/pull/7269",
)
REFERENCES = (
    ReferencePoint(
        "vLLM rollout, top_p 1.0 (control)",
        "Qwen2.5-1.5B-Instruct",
        "bf16",
        "ratio_mean",
        0.995,
        "importance-sampling ratio, mean",
        _PR_7269,
    ),
    ReferencePoint(
        "vLLM rollout at top_p 0.8, its processed log-probs against the trainer's full vocabulary",
        "Qwen2.5-1.5B-Instruct",
        "bf16",
        "ratio_mean",
        0.896,
        "importance-sampling ratio, mean",
        _PR_7269,
        "the mean equals the probability mass the nucleus kept (0.895): a bias, not noise",
    ),
)
"""Measurements published in TRL's pull requests."""


FRAMEWORK = Framework(
    name=NAME,
    title="TRL",
    upstream=Upstream("huggingface/trl", "f2cd57710ae345ea6428ae95363267fcf38a3dc8", "2026-07-24"),
    spec_types=(TRLCorrection,),
    parse=parse,
    presets=lambda: PRESETS,
    default="trl_default",
    snippet_keys=("use_vllm",),  # GRPOConfig's own default is false
    support="has no way yet (#6789): sample without top-p / top-k truncation",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=_render,
    aggregation=_aggregation,
    families=frozenset({"token_tis", "icepop", "seq_tis"}),
    columns={  # GRPOTrainer's generated batch
        "rollout_logprob": ("sampling_per_token_logps",),
        "train_logprob": ("old_per_token_logps",),
        "loss_mask": ("completion_mask",),
    },
    metrics={
        "abs_diff_mean": ("sampling/sampling_logp_difference/mean",),
        "abs_diff_max": ("sampling/sampling_logp_difference/max",),
    },
    references=REFERENCES,
    traps=(
        Trap(
            "default-sequence-mask",
            "TRL's default vllm_importance_sampling_mode is sequence_mask: the product ratio "
            "masked above 3.0, which drops long sequences.",
            _default_mask,
        ),
    ),
    read_batch=read_batch,
)
