"""AReaL: the behaviour importance weight of decoupled PPO (`actor.rejection_sampling`).

Source read: `inclusionAI/AReaL` @ 4aef98d8 (2026-05-21): `areal/api/cli_args.py`
(`RejectionSamplingConfig`, `PPOActorConfig`, `_migrate_legacy_rejection_sampling`),
`areal/utils/functional/functional.py` (`apply_rejection_sampling`, `ppo_actor_loss_fn`),
`areal/trainer/ppo/actor.py` (which log-probs play prox and behave), `areal/utils/data.py`
(`KLEstimator`); history: 03d71153a (PR #930, `behave_imp_weight_cap` / `_mode`) and its parent
(`behav_imp_weight_cap`).

AReaL names the rollout engine's log-probs `old_logp` / `logprobs` (pi_behave) and the trainer's
recompute `prox_logp` (pi_prox). With `use_decoupled_loss: true`, prox = train and behave =
rollout. Without it, prox IS behave (the rollout log-probs, or the recompute with
`recompute_logprob: true`) and `rejection_sampling` still runs, on d = 0 (AReaL warns that the
filter "will be ignored"; it is, except for bounds that reject a ratio of 1 or a KL of 0).

`ppo_actor_loss_fn` multiplies each token's PPO term by the weight `apply_rejection_sampling`
returns, and sums over the mask it returns divided by the ORIGINAL mask count. Its steps:

1. d = prox - behave, non-finite -> 0 (for the weight and the ratio statistic). The weight is
   e^d with no +-20 clamp.
2. The statistic per token: `ratio` e^d; `kl_k1` +d; `kl_k2` d^2 / 2; `kl_k3` e^{-d} - 1 + d
   (AReaL's `KLEstimator` k3 is the REVERSE of verl's/NeMo's e^d - 1 - d). The KL statistics use
   the RAW d: a non-finite one fails the bounds (k1 = -inf passes an upper-only bound) while the
   token's weight is e^0 = 1.
3. `level: token`: `mask` keeps tokens with lower <= stat <= upper (inclusive; no lower without
   `lower`), weight raw e^d; `clamp` (ratio only): w = clamp(e^d, lower or 0, upper), mask kept.
4. `level: sequence`, over the loss mask (T clamped to >= 1): with `metric: ratio` the weight of
   every token becomes the geometric mean e^G (G = S / T), and the statistic is e^G (`agg: mean`),
   e^S (`sum`) or e^{max d} (`max`); with a KL metric the statistic is the sum / mean / max of the
   per-token KL and the weights stay per token e^{d_t}. `max` of a fully masked sequence is 0
   (its sum and mean are 0 anyway). `mask` drops whole sequences; `clamp` sets the weight of an
   out-of-bounds sequence to clamp(e^G, lower or 0, upper): with `agg: sum` the decision is on
   e^S but the clamp on e^G.
5. Rejected tokens get weight 0 and leave the mask (the denominator does not change).
`rejection_sampling: null` applies no weight at all (weight 1).

Version `pr1218` (the open PR #1218, two-stage rejection, head 3ab740ce in areal-project/AReaL,
2026-06-08; `functional.py` l.348-366 packed, l.412-442 padded) adds
`rejection_sampling.token_action: null | mask | clamp`, which needs `level: sequence`, `metric:
ratio` and `action: mask` (its `__post_init__` refuses anything else). Stage 1 is the sequence
mask above (keep iff L <= e^G / e^S / e^{max d} <= U). Stage 2 replaces the weight e^G by the
token's own ratio rho_t = e^{d_t}: `mask` also drops tokens outside [L, U] (no lower without
`lower`) and weights the rest by the raw rho_t; `clamp` weights every token by clamp(rho_t, L or
0, U). One (L, U) pair serves both stages. The weight is then zeroed wherever the final mask is
0, and the sum still divides by the original count. (The PR's comment says stage 1 has already
zeroed the mask when stage 2 runs; it has not, which changes only `rs_filtered_fraction`: it
counts the stage-1 rejections among the tokens stage 2 kept.)

Config: AReaL's experiment YAML: `actor.{use_decoupled_loss, recompute_logprob,
prox_logp_method, rejection_sampling.{level, action, metric, agg, upper, lower, token_action
(version pr1218 only)}, importance_sampling_level}` and iscore's top-level `version:` (null or
pr1218), parsed strictly, with AReaL's own validation of
`RejectionSamplingConfig` (`clamp` only with `ratio`; `ratio` upper > 1 and lower > 0; k2/k3
upper > 0; lower <= upper; `agg` other than `mean` at token level warns and is ignored). Every
other documented `PPOActorConfig` key (eps_clip, optimizer, mb_spec, ...) and every top-level key
of AReaL's `GRPOConfig` (cluster, rollout, gconfig, ...) is accepted, ignored and listed in the
spec's `ignored_keys`; unknown keys raise.

Legacy keys (AReaL itself raises on them now; iscore maps them with a warning):
`behave_imp_weight_mode` / `behave_imp_weight_cap` (PR #930, defaults `token_mask` / 5.0):
`token_mask` -> {token, mask, ratio, upper: cap}; `token_truncate` -> {token, clamp, ratio,
upper: cap}; `sequence_mask` / `sequence_truncate` -> the same at sequence level with
`agg: mean` (PR #930 used the geometric mean); `disabled` -> null (an explicit non-null cap
with it raises, as in PR #930, which raised on its default cap 5.0 too). The older
`behav_imp_weight_cap: X` -> {token, mask, ratio, upper: X}. A null cap (no filter, raw
weight) -> `upper: .inf`. The old forms zeroed the weight but kept the token in the mask; the
gradient is the same.

Where AReaL's documentation (docs/corrections.md#areal) and its code differ, or the spec is silent
(the code wins):

- `rejection_sampling` is passed to the loss whatever `use_decoupled_loss` says
  (`actor.py` line 353); without decoupling prox and behave are the same tensor, so d = 0.
- For `metric: ratio`, `lower` must be > 0 (`cli_args.py` line 1357), checked BEFORE the clamp's
  missing lower is filled in with 0.0 (line 1377), so `action: clamp, lower: 0.0` is rejected
  while an absent lower means 0; `upper` for k2/k3 must be > 0; k1 bounds are free (it may be
  negative).
- `prox_logp_method: loglinear` approximates prox from per-token policy versions a dump does not
  hold: a ConfigError with `use_decoupled_loss` (without it the method has no effect).
- `m2_threshold` (M2PO) masks tokens by a sort over each PPO minibatch, which a dump does not
  record: a ConfigError when set.
- `use_sapo_loss` with `use_decoupled_loss` raises, as in AReaL.
- AReaL computes d and the statistics in float32; the replay uses the exact float64 d and exact
  KL values (AReaL's float32 e^{-d} - 1 + d loses everything below ~1e-7 to cancellation).

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0]), train=torch.tensor([-2.0, 0.0]),
...                cu_seqlens=torch.tensor([0, 2]))
>>> rs = {"level": "token", "action": "mask", "metric": "ratio", "upper": 2.0}
>>> spec = parse({"framework": "areal",
...               "actor": {"use_decoupled_loss": True, "rejection_sampling": rs}})
>>> [round(w, 4) for w in spec.replay(b).weight.tolist()]  # e^1 > 2 is rejected
[0.3679, 0.0]
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
from iscore.frameworks._config import Section, check_choice, check_number, top_level, version
from iscore.frameworks.base import BatchFields, Framework, Trap, Upstream, Version
from iscore.frameworks.canonical import (
    Anchor,
    Canonical,
    Component,
    Numerator,
    Statistic,
    Translation,
    first_weight,
    identity_at_zero,
    log_or_none,
    lost,
    mask_component,
    note_extras,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.canonical import Level as CanonicalLevel
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "areal"

Level = Literal["token", "sequence"]
Action = Literal["mask", "clamp"]
Metric = Literal["ratio", "kl_k1", "kl_k2", "kl_k3"]
Agg = Literal["sum", "mean", "max"]
ProxLogpMethod = Literal["recompute", "loglinear", "metrics"]

_LEVELS = ("token", "sequence")
_ACTIONS = ("mask", "clamp")
_METRICS = ("ratio", "kl_k1", "kl_k2", "kl_k3")
_AGGS = ("sum", "mean", "max")
_PROX_METHODS = ("recompute", "loglinear", "metrics")
_RS = "actor.rejection_sampling"
_TOKEN_ACTIONS = (None, "mask", "clamp")

PR1218 = Version(
    "pr1218",
    1218,
    "open",
    Upstream("areal-project/AReaL", "3ab740ce4d90b4b2cdf38cf726d4a0c8a12bf64c", "2026-06-08"),
    "rejection_sampling.token_action: a geometric sequence filter, then a token mask or clamp "
    "on the raw ratio",
)
VERSIONS = (PR1218,)

# `PPOActorConfig` fields (with those of its base `TrainEngineConfig`) that do not shape the
# behaviour weight; a pasted actor section carries them.
_ACTOR_OTHER_KEYS = (
    "experiment_name", "trial_name", "path", "attn_impl", "use_kernels", "init_from_scratch",
    "is_critic", "temperature", "mb_spec", "pad_to_maximum", "disable_dropout",
    "gradient_checkpointing", "dtype", "grad_reduce_dtype", "optimizer", "weight_update_mode",
    "fsdp", "archon", "megatron", "offload", "use_lora", "lora_rank", "lora_alpha",
    "target_modules", "peft_type", "enable_tree_training", "scheduling_spec", "backend",
    "_version", "admin_api_key", "log_level", "request_timeout", "setup_timeout",
    "scheduling_strategy", "ppo_n_minibatches", "eps_clip", "eps_clip_higher", "c_clip",
    "reward_norm", "reward_scaling", "reward_bias", "reward_clip", "overlong_reward_penalty",
    "overlong_tokens", "overlong_penalty_factor", "mask_no_eos_with_zero", "discount",
    "gae_lambda", "adv_norm", "kl_ctl", "kl_estimator", "sapo_tau_pos", "sapo_tau_neg",
    "log_agent_stats", "log_agent_stats_keys", "max_new_tokens",
)  # fmt: skip
# Top-level fields of AReaL's `GRPOConfig` / `PPOConfig` other than `actor`.
_TOP_OTHER_KEYS = (
    "experiment_name", "trial_name", "cluster", "allocation_mode", "seed", "enable_offload",
    "total_train_epochs", "total_train_steps", "total_train_n_seqs", "tokenizer_path",
    "train_dataset", "valid_dataset", "saver", "evaluator", "stats_logger", "perf_tracer",
    "memory_profiler", "recover", "sglang", "vllm", "scheduler", "gconfig", "eval_gconfig",
    "rollout", "ref", "critic", "teacher", "dynamic_bs",
)  # fmt: skip
_LEGACY_MODES = ("token_mask", "token_truncate", "sequence_mask", "sequence_truncate", "disabled")


@dataclass(frozen=True, slots=True)
class RejectionSampling:
    """AReaL's `RejectionSamplingConfig`: how the prox/behave mismatch filters and weights.

    Args:
        level: per token, or whole sequences.
        action: mask (drop from the loss mask) or clamp (truncate the weight; ratio only).
        metric: the statistic compared with the bounds.
        agg: sequence statistic: sum, mean or max of the per-token one (ratio: in log space).
        upper: the upper bound (inclusive).
        lower: the lower bound (inclusive); None is unbounded, and 0.0 for clamp (AReaL fills
            in 0.0 after its checks, so an explicit 0.0 with metric ratio is rejected).
        token_action: PR #1218's second stage ("mask" or "clamp" on each token's ratio, with
            the same bounds), None for none; only at level sequence, metric ratio, action mask.
    """

    level: Level = "token"
    action: Action = "mask"
    metric: Metric = "ratio"
    agg: Agg = "mean"
    upper: float = 5.0
    lower: float | None = None
    token_action: Action | None = None

    def __post_init__(self) -> None:
        check_choice(f"{_RS}.level", self.level, _LEVELS)
        check_choice(f"{_RS}.action", self.action, _ACTIONS)
        check_choice(f"{_RS}.metric", self.metric, _METRICS)
        check_choice(f"{_RS}.agg", self.agg, _AGGS)
        check_number(f"{_RS}.upper", self.upper)
        check_number(f"{_RS}.lower", self.lower, nullable=True)
        # AReaL's `RejectionSamplingConfig.__post_init__`, in its order.
        if self.lower is not None and self.lower > self.upper:
            raise ConfigError(
                f"Expected `{_RS}.lower` ({self.lower}) to be <= `{_RS}.upper` ({self.upper})"
            )
        if self.metric == "ratio":
            if self.upper <= 1.0:
                raise ConfigError(
                    f"Expected `{_RS}.upper` to be a float > 1.0 for metric 'ratio' (AReaL "
                    f"rejects it: every token with a non-identical ratio would go), but got "
                    f"{quote(self.upper)}"
                )
            if self.lower is not None and self.lower <= 0:
                raise ConfigError(
                    f"Expected `{_RS}.lower` to be a float > 0 for metric 'ratio', but got "
                    f"{quote(self.lower)}"
                )
        if self.metric in ("kl_k2", "kl_k3") and self.upper <= 0:
            raise ConfigError(
                f"Expected `{_RS}.upper` to be a float > 0 for metric {quote(self.metric)}, but "
                "got "
                f"{quote(self.upper)}"
            )
        if self.action == "clamp" and self.metric != "ratio":
            raise ConfigError(
                f"Expected `{_RS}.metric` to be 'ratio' with action 'clamp' (AReaL clamps only "
                f"the ratio; use action 'mask' for KL filtering), but got {quote(self.metric)}"
            )
        if self.level == "token" and self.agg != "mean":
            warnings.warn(
                f"`{_RS}.agg` {quote(self.agg)} is ignored at level 'token' (AReaL aggregates only "
                "for sequence-level filtering)",
                UserWarning,
                stacklevel=3,
            )
        # PR #1218's checks come after the others.
        check_choice(f"{_RS}.token_action", self.token_action, _TOKEN_ACTIONS)
        if self.token_action is not None:
            for key, wanted in (("level", "sequence"), ("metric", "ratio"), ("action", "mask")):
                if getattr(self, key) != wanted:
                    raise ConfigError(
                        f"Expected `{_RS}.{key}` to be {wanted!r} with `{_RS}.token_action` "
                        f"{quote(self.token_action)} (PR #1218's two stages: a sequence mask on "
                        f"the geometric ratio, then the tokens), but got "
                        f"{quote(getattr(self, key))}"
                    )

    @property
    def clamp_lower(self) -> float:
        """The lower bound of the clamp action."""
        return 0.0 if self.lower is None else self.lower


@dataclass(frozen=True, slots=True)
class ArealCorrection:
    """AReaL's decoupled-PPO behaviour weight, as set by its `actor` section.

    Args:
        use_decoupled_loss: prox = the trainer's recompute, behave = the rollout engine.
        recompute_logprob: without decoupling, whether the PPO anchor is the recompute (prox =
            behave = train) or the rollout (prox = behave = rollout).
        prox_logp_method: "loglinear" cannot be replayed with decoupling (needs policy versions).
        rejection_sampling: the filter / weight; None applies no weight.
        importance_sampling_level: the PPO ratio's level (GSPO); no effect on this weight.
        version: iscore's `version:`; None is the pinned commit, "pr1218" the open PR #1218
            (`rejection_sampling.token_action`).
        ignored_keys: config keys accepted but not affecting the replay.
        name: display name.
    """

    framework: ClassVar[str] = NAME
    use_decoupled_loss: bool = False
    recompute_logprob: bool = False
    prox_logp_method: ProxLogpMethod = "recompute"
    rejection_sampling: RejectionSampling | None = None
    importance_sampling_level: Level = "token"
    version: str | None = None
    ignored_keys: tuple[str, ...] = ()
    name: str = NAME

    def __post_init__(self) -> None:
        for key in ("use_decoupled_loss", "recompute_logprob"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(
                    f"Expected `actor.{key}` to be a bool, but got {quote(getattr(self, key))}"
                )
        check_choice("actor.prox_logp_method", self.prox_logp_method, _PROX_METHODS)
        check_choice("actor.importance_sampling_level", self.importance_sampling_level, _LEVELS)
        if self.rejection_sampling is not None and not isinstance(
            self.rejection_sampling, RejectionSampling
        ):
            raise ConfigError(
                f"Expected `{_RS}` to be null or a RejectionSampling, but got "
                f"{quote(self.rejection_sampling)}"
            )
        check_choice("version", self.version, (None, *(v.name for v in VERSIONS)))
        rs = self.rejection_sampling
        if rs is not None and rs.token_action is not None and self.version != PR1218.name:
            raise ConfigError(
                f"Unknown key `{_RS}.token_action` at AReaL's pinned commit: it is the open PR "
                f"#1218's (head {PR1218.upstream.commit[:8]}); set `version: {PR1218.name}`"
            )
        if self.use_decoupled_loss and self.prox_logp_method == "loglinear":
            raise ConfigError(
                "Expected `actor.prox_logp_method` to be 'recompute' or 'metrics': 'loglinear' "
                "approximates the proximal log-probs from per-token policy versions "
                "(prox = behave + alpha * (current - behave)), which a dump does not record"
            )

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: AReaL's `actor` keys that shape the behaviour
        weight, the inverse of `parse`.

        `ignored_keys` are not written (their values were not kept). `rejection_sampling` is
        written with all six keys (null when off), as AReaL's YAML takes it, and PR #1218's
        `token_action` when set; `version` only when set.

        >>> rs = PRESETS["areal_token_mask"].to_config()["actor"]["rejection_sampling"]
        >>> rs["level"], rs["action"], rs["upper"], rs["lower"]
        ('token', 'mask', 5.0, None)
        """
        rs = self.rejection_sampling
        actor: dict[str, Any] = {
            "use_decoupled_loss": self.use_decoupled_loss,
            "recompute_logprob": self.recompute_logprob,
            "prox_logp_method": self.prox_logp_method,
            "importance_sampling_level": self.importance_sampling_level,
            "rejection_sampling": None
            if rs is None
            else {
                "level": rs.level,
                "action": rs.action,
                "metric": rs.metric,
                "agg": rs.agg,
                "upper": rs.upper,
                "lower": rs.lower,
            }
            | ({} if rs.token_action is None else {"token_action": rs.token_action}),
        }
        config = {"framework": NAME, "name": self.name, "actor": actor}
        return config if self.version is None else config | {"version": self.version}

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weights and mask as `apply_rejection_sampling` returns them."""
        if self.use_decoupled_loss:
            d_raw = ops.log_ratio(batch)  # prox = train, behave = rollout
        else:
            prox = behave = batch.train if self.recompute_logprob else batch.rollout
            d_raw = prox.double() - behave.double()
        d = d_raw if ops.all_finite(d_raw) else torch.where(torch.isfinite(d_raw), d_raw, 0.0)
        rs = self.rejection_sampling
        if rs is not None and rs.level == "sequence" and rs.metric == "ratio":
            return _replay_sequence_ratio(rs, batch, d)
        ratio = ops.exp(d, bound=None)  # no safety clamp
        mask = batch.loss_mask
        if rs is None:
            ones = torch.ones_like(ratio)
            return Replay.build(batch, ones, mask, ratio)
        if rs.metric == "ratio":
            stat = ratio
        elif rs.metric == "kl_k1":
            stat = d_raw
        elif rs.metric == "kl_k2":
            stat = ops.k2(d_raw)
        else:
            stat = ops.k3_reverse(d_raw)
        if rs.level == "token":
            if rs.action == "mask":
                return Replay.build(batch, ratio, mask & ops.band(stat, rs.lower, rs.upper), ratio)
            return Replay.build(batch, ops.truncate(ratio, rs.clamp_lower, rs.upper), mask, ratio)
        # KL metrics at level 'sequence': whole-sequence mask, the weights stay e^{d_t}.
        count = ops.segment_count(batch, mask)
        if rs.agg == "max":
            seq_stat = torch.where(count > 0, ops.segment_max(stat, batch, mask), 0.0)
        else:
            seq_stat = ops.segment_sum(stat, batch, mask)
            if rs.agg == "mean":
                seq_stat = seq_stat / count.clamp(min=1.0)
        in_bounds = ops.band(seq_stat, rs.lower, rs.upper)
        return Replay.build(batch, ratio, mask & ops.broadcast(in_bounds, batch), ratio)


def _replay_sequence_ratio(rs: RejectionSampling, batch: TokenBatch, d: torch.Tensor) -> Replay:
    """`apply_rejection_sampling` at level 'sequence' with metric 'ratio': every token's weight
    is its sequence's e^G, so no per-token ratio is needed."""
    mask = batch.loss_mask
    count = ops.segment_count(batch, mask)
    # The ratio aggregates in log space (the sanitized d).
    total = ops.segment_sum(d, batch, mask)
    seq_raw = torch.exp(total / count.clamp(min=1.0))  # e^G
    if rs.agg == "max":
        seq_stat = torch.exp(torch.where(count > 0, ops.segment_max(d, batch, mask), 0.0))
    else:
        seq_stat = seq_raw if rs.agg == "mean" else torch.exp(total)
    in_bounds = ops.band(seq_stat, rs.lower, rs.upper)
    if rs.token_action is not None:
        return _replay_two_stage(rs, batch, d, in_bounds, seq_raw)
    if rs.action == "mask":
        keep = mask & ops.broadcast(in_bounds, batch)
        seq_weight = torch.where(in_bounds, seq_raw, 0.0)
    else:
        keep = mask
        seq_weight = torch.where(
            in_bounds, seq_raw, ops.truncate(seq_raw, rs.clamp_lower, rs.upper)
        )
    return Replay.build(
        batch,
        per_token(seq_weight, batch),
        keep,
        per_token(seq_raw, batch),
        seq_raw=seq_raw,
        seq_weight=seq_weight,
    )


def _replay_two_stage(
    rs: RejectionSampling,
    batch: TokenBatch,
    d: torch.Tensor,
    in_bounds: torch.Tensor,
    seq_raw: torch.Tensor,
) -> Replay:
    """PR #1218's stage 2 after the sequence mask `in_bounds` [B]: each token's own ratio,
    masked or clamped with the same bounds, replaces the sequence's e^G."""
    rho = ops.exp(d, bound=None)
    keep = batch.loss_mask & ops.broadcast(in_bounds, batch)
    if rs.token_action == "mask":
        keep = keep & ops.band(rho, rs.lower, rs.upper)
        weight = rho
    else:
        weight = ops.truncate(rho, rs.clamp_lower, rs.upper)
    return Replay.build(batch, weight, keep, rho, seq_raw=seq_raw, seq_weight=in_bounds.double())


def _parse_rejection_sampling(section: Section, pr: str | None) -> RejectionSampling:
    if "token_action" in section.data and pr is None:
        raise ConfigError(
            f"Unknown key `{section.key('token_action')}` at AReaL's pinned commit: it is the "
            f"open PR #1218's (head {PR1218.upstream.commit[:8]}); set `version: {PR1218.name}`"
        )
    rs = RejectionSampling(
        level=section.choice("level", "token", _LEVELS),
        action=section.choice("action", "mask", _ACTIONS),
        metric=section.choice("metric", "ratio", _METRICS),
        agg=section.choice("agg", "mean", _AGGS),
        upper=section.float("upper", 5.0),
        lower=section.float("lower", None),
        token_action=section.choice("token_action", None, _TOKEN_ACTIONS),
    )
    section.done()
    return rs


def _legacy(actor: Section) -> tuple[bool, RejectionSampling | None]:
    """Map the removed behave/behav importance-weight keys, with a warning.

    Returns:
        Whether legacy keys were given, and the rejection-sampling setting they map to.
    """
    old = "behav_imp_weight_cap" in actor.data
    new = [k for k in ("behave_imp_weight_cap", "behave_imp_weight_mode") if k in actor.data]
    if not old and not new:
        return False, None
    if old and new:
        raise ConfigError(
            "Expected either `actor.behav_imp_weight_cap` (AReaL before 2026-03-03) or "
            "`actor.behave_imp_weight_cap` / `actor.behave_imp_weight_mode` (2026-03-03 to "
            "2026-04-20), but got both"
        )
    cap_key = "behav_imp_weight_cap" if old else "behave_imp_weight_cap"
    mode = (
        "token_mask" if old else actor.choice("behave_imp_weight_mode", "token_mask", _LEGACY_MODES)
    )
    if mode == "disabled":
        if actor.float(cap_key, None) is not None:
            raise ConfigError(
                f"Expected `actor.{cap_key}` to be null with behave_imp_weight_mode 'disabled' "
                f"(AReaL raised), but got {quote(actor.data[cap_key])}"
            )
        rs = None
    else:
        # PR #930's default cap was 5.0; a null cap meant the raw weight, unfiltered.
        cap = actor.float(cap_key, None if old else 5.0, nullable=True)
        upper = math.inf if cap is None else cap
        if not upper > 1.0:
            raise ConfigError(
                f"Expected `actor.{cap_key}` to be a float > 1.0, but got {quote(cap)}"
            )
        level, action = mode.split("_")
        rs = RejectionSampling(
            level=level, action="mask" if action == "mask" else "clamp", upper=upper
        )
    if rs is None:
        mapped = "null"
    else:
        agg = "agg: mean, " if rs.level == "sequence" else ""
        mapped = (
            f"{{level: {rs.level}, action: {rs.action}, metric: ratio, {agg}upper: {rs.upper}}}"
        )
    warnings.warn(
        f"`actor.{' / '.join(new) or cap_key}` was removed from AReaL (PR #1088, 2026-04-20), "
        f"which now raises on it; iscore maps it to `actor.rejection_sampling: {mapped}`",
        UserWarning,
        stacklevel=3,
    )
    return True, rs


def parse(config: Mapping[str, Any]) -> ArealCorrection:
    """Parse `{framework: areal, name?, actor: {...}}` (plus AReaL's other top-level keys).

    Raises:
        ConfigError: an unknown key, a wrong type, or a combination AReaL rejects; the message
            names the key.

    >>> spec = parse({"framework": "areal", "experiment_name": "gsm8k",
    ...               "actor": {"use_decoupled_loss": True, "eps_clip": 0.4,
    ...                         "rejection_sampling": {"metric": "ratio", "upper": 5.0}}})
    >>> spec.rejection_sampling, spec.ignored_keys
    (RejectionSampling(level='token', action='mask', metric='ratio', agg='mean', upper=5.0, \
lower=None, token_action=None), ('experiment_name', 'actor.eps_clip'))
    """
    section, name = top_level(config, NAME)
    pr = version(section, [v.name for v in VERSIONS])
    actor = section.section("actor")
    ignored = [k for k in _TOP_OTHER_KEYS if k in section.data]
    section.done(ignore=_TOP_OTHER_KEYS)

    use_decoupled_loss = actor.bool("use_decoupled_loss", False)
    if actor.bool("use_sapo_loss", False) and use_decoupled_loss:
        raise ConfigError(
            "Expected `actor.use_sapo_loss` to be false with use_decoupled_loss (AReaL: SAPO is "
            "not compatible with the decoupled loss)"
        )
    if actor.float("m2_threshold", None) is not None:
        raise ConfigError(
            "Expected `actor.m2_threshold` to be null: M2PO drops tokens by a sort over each PPO "
            "minibatch, whose composition a dump does not record, so iscore cannot replay it"
        )
    has_legacy, legacy_rs = _legacy(actor)
    raw_rs = actor.raw("rejection_sampling", None)
    if has_legacy and raw_rs is not None:
        raise ConfigError(
            "Expected either `actor.rejection_sampling` or the legacy behave importance-weight "
            "keys it replaced, but got both"
        )
    if raw_rs is None:
        rs = legacy_rs
    else:
        rs = _parse_rejection_sampling(actor.section("rejection_sampling"), pr)
    values = {
        "recompute_logprob": actor.bool("recompute_logprob", False),
        "prox_logp_method": actor.choice("prox_logp_method", "recompute", _PROX_METHODS),
        "importance_sampling_level": actor.choice("importance_sampling_level", "token", _LEVELS),
    }
    actor.done(ignore=_ACTOR_OTHER_KEYS)
    return ArealCorrection(
        use_decoupled_loss=use_decoupled_loss,
        rejection_sampling=rs,
        version=pr,
        ignored_keys=(*ignored, *(f"actor.{k}" for k in _ACTOR_OTHER_KEYS if k in actor.data)),
        name=name,
        **values,
    )


PRESETS: dict[str, ArealCorrection] = {
    # The setting of docs/en/best_practices/algo_perf.md and AReaL's example YAMLs.
    "areal_token_mask": ArealCorrection(
        use_decoupled_loss=True,
        rejection_sampling=RejectionSampling(upper=5.0),
        name="areal_token_mask",
    ),
    "areal_token_clamp": ArealCorrection(
        use_decoupled_loss=True,
        rejection_sampling=RejectionSampling(action="clamp", upper=5.0),
        name="areal_token_clamp",
    ),
    "areal_sequence_geo_mask": ArealCorrection(
        use_decoupled_loss=True,
        rejection_sampling=RejectionSampling(level="sequence", upper=5.0),
        name="areal_sequence_geo_mask",
    ),
    # PR #1218's two stages at AReaL's default bounds (upper 5, no lower).
    **{
        f"areal_two_stage_{action}_pr1218": ArealCorrection(
            use_decoupled_loss=True,
            rejection_sampling=RejectionSampling(level="sequence", upper=5.0, token_action=action),
            version=PR1218.name,
            name=f"areal_two_stage_{action}_pr1218",
        )
        for action in ("mask", "clamp")
    },
}
"""AReaL's recommended behaviour filter (token mask, upper 5), and its clamp and sequence forms;
open PR #1218's two stages (version pr1218)."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: ArealCorrection) -> Canonical:
    if spec.use_decoupled_loss:
        anchor: Anchor = "recompute"
    else:
        anchor = "recompute" if spec.recompute_logprob else "rollout"
    rs = spec.rejection_sampling
    if rs is None:
        return Canonical(anchor=anchor)
    # Without decoupling prox and behave are one tensor: d = 0.
    numerator: Numerator = "train" if spec.use_decoupled_loss else "rollout"
    statistic: Statistic = {
        "ratio": "ratio",
        "kl_k1": "log_ratio",
        "kl_k2": "k2",
        "kl_k3": "k3_reverse",
    }[rs.metric]  # type: ignore[assignment]
    common: dict[str, Any] = {"numerator": numerator}
    if rs.level == "token":
        if rs.action == "clamp":
            components = (
                weight_component("token", lower=rs.clamp_lower, upper=rs.upper, **common),
            )
        else:
            band = mask_component("token", rs.lower, rs.upper, statistic=statistic, **common)
            components = (weight_component("token", **common), band)
    else:
        level: CanonicalLevel = {"sum": "sequence", "mean": "geometric", "max": "max"}[rs.agg]  # type: ignore[assignment]
        band = mask_component(level, rs.lower, rs.upper, statistic=statistic, **common)
        if rs.metric != "ratio":
            components = (weight_component("token", **common), band)
        elif rs.token_action == "mask":
            token_band = mask_component("token", rs.lower, rs.upper, **common)
            components = (weight_component("token", **common), token_band, band)
        elif rs.token_action == "clamp":
            clamp = weight_component("token", lower=rs.clamp_lower, upper=rs.upper, **common)
            components = (clamp, band)
        elif rs.action == "mask":
            components = (weight_component("geometric", **common), band)
        elif rs.agg == "mean":
            # The decision and the clamp both see e^G: a plain geometric truncation.
            components = (
                weight_component("geometric", lower=rs.clamp_lower, upper=rs.upper, **common),
            )
        else:
            components = (
                weight_component(
                    "geometric", lower=rs.clamp_lower, upper=rs.upper, unless=band, **common
                ),
            )
    if numerator == "rollout":
        components = tuple(c for c in components if not identity_at_zero(c))
    return Canonical(components, anchor)


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    """The setting of the pinned commit closest to `c`; where `c` has a sequence ratio mask
    beside a token weight that is clamped or masked by its own ratio, also PR #1218's two
    stages (version pr1218)."""
    two_stage = _two_stage(c, name)
    return [_from_canonical(c, name), *([two_stage] if two_stage is not None else [])]


_AGGS_OF_LEVEL = {"sequence": "sum", "geometric": "mean", "max": "max"}


def _two_stage(c: Canonical, name: str) -> Translation | None:
    """PR #1218's `token_action` closest to `c`, or None where `c` has no such shape."""
    w = c.weights[0] if c.weights else None
    masks = list(c.masks)
    stage1 = next((m for m in masks if m.statistic == "ratio" and m.level in _AGGS_OF_LEVEL), None)
    if c.anchor == "rollout" or w is None or w.level != "token" or w.zero is not None:
        return None
    if stage1 is None:
        return None
    notes: list[str] = []
    first_weight(c, notes, "AReaL")
    masks.remove(stage1)
    upper = _areal_ratio_upper(stage1.upper, notes, stage1)
    if upper is None:
        return None
    lower = stage1.lower if stage1.lower else None  # AReaL refuses a ratio lower bound <= 0
    same = "AReaL #1218 uses the sequence mask's bounds for the tokens too"
    if (w.lower, w.upper) != (None, None):
        action = "clamp"
        if (w.lower or 0.0, w.upper) != (lower or 0.0, stage1.upper):
            lost(notes, w, same)
    else:
        token = next((m for m in masks if m.statistic == "ratio" and m.level == "token"), None)
        if token is None:
            return None
        action = "mask"
        masks.remove(token)
        if (token.lower or None, token.upper) != (lower, stage1.upper):
            lost(notes, token, same)
        if token.strict:
            lost(notes, token, "AReaL's bounds are inclusive")
    if stage1.strict:
        lost(notes, stage1, "AReaL's bounds are inclusive")
    for x in (w, stage1, *masks):
        note_numerator(notes, x, "train", "AReaL")
    for m in masks:
        lost(notes, m, "AReaL takes one rejection_sampling; dropped")
    note_extras(notes, c, "AReaL")
    notes.append(
        f"Needs AReaL's open PR #1218 (head {PR1218.upstream.commit[:8]}): `version: pr1218`."
    )
    rs = RejectionSampling(
        level="sequence",
        agg=_AGGS_OF_LEVEL[stage1.level],
        upper=upper,
        lower=lower,
        token_action=action,
    )
    spec = ArealCorrection(
        use_decoupled_loss=True,
        recompute_logprob=True,
        rejection_sampling=rs,
        version=PR1218.name,
        name=name,
    )
    return spec, tuple(notes)


def _from_canonical(c: Canonical, name: str) -> Translation:
    notes: list[str] = []
    if c.anchor == "rollout":
        # No recompute: prox = behave, so AReaL has no behaviour weight to apply.
        for x in c.components:
            lost(notes, x, "AReaL without recompute (its bypass) applies no behaviour weight")
        spec = ArealCorrection(use_decoupled_loss=False, recompute_logprob=False, name=name)
        return spec, tuple(notes)
    w = first_weight(c, notes, "AReaL", conditional=True)
    masks = list(c.masks)
    for x in (*c.weights[:1], *masks):
        note_numerator(notes, x, "train", "AReaL")
    rs = None
    if w is not None and w.level != "token":
        rs = _areal_sequence_weight(w, masks, notes)
    elif w is not None:
        rs = _areal_token_weight(w, masks, notes)
    elif masks:
        notes.append("AReaL weights the tokens it keeps by their ratio; the source applies none")
        rs = _areal_mask(masks.pop(0), notes, geometric_weight=False)
    for m in masks:
        lost(notes, m, "AReaL takes one rejection_sampling; dropped")
    note_extras(notes, c, "AReaL")
    spec = ArealCorrection(
        use_decoupled_loss=True, recompute_logprob=True, rejection_sampling=rs, name=name
    )
    return spec, tuple(notes)


def _areal_ratio_upper(upper: float | None, notes: list[str], c: Component) -> float | None:
    """AReaL's ratio `upper`: open is +inf; at or below 1 AReaL refuses it (None)."""
    if upper is None:
        return math.inf
    if upper <= 1.0:
        lost(notes, c, "AReaL needs a ratio upper bound above 1; dropped")
        return None
    return upper


def _areal_token_weight(
    w: Component, masks: list[Component], notes: list[str]
) -> RejectionSampling | None:
    if w.zero is not None:
        if w.lower is not None or w.upper is not None:
            lost(notes, w, "AReaL's mask keeps the raw ratio; the truncation is dropped")
        lost(
            notes,
            w.zero,
            "AReaL removes those from the loss mask instead of zeroing them "
            "(its denominator keeps them)",
        )
        return _areal_mask(w.zero, notes, geometric_weight=False)
    if w.lower is not None or w.upper is not None:
        upper = _areal_ratio_upper(w.upper, notes, w)
        if upper is None:
            return None
        return RejectionSampling(action="clamp", upper=upper, lower=w.lower)
    # A raw token weight leaves AReaL's one rejection free for the first mask it can take.
    for m in masks:
        mask_notes: list[str] = []
        rs = _areal_mask(m, mask_notes, geometric_weight=False)
        if rs is not None:
            masks.remove(m)
            notes += mask_notes
            return rs
    return RejectionSampling(upper=math.inf)  # the raw weight, nothing rejected


def _areal_sequence_weight(
    w: Component, masks: list[Component], notes: list[str]
) -> RejectionSampling | None:
    if w.level == "sequence":
        lost(notes, w, "AReaL's sequence-level weight is the geometric mean e^G, not e^S")
    elif w.level == "geometric_unmasked":
        lost(notes, w, "AReaL's geometric mean runs over loss tokens only")
    if w.zero is not None:
        if w.lower is not None or w.upper is not None:
            lost(notes, w, "AReaL's sequence mask keeps e^G raw; the truncation is dropped")
        lost(
            notes,
            w.zero,
            "AReaL removes those sequences from the loss mask instead of "
            "zeroing them (its denominator keeps them)",
        )
        return _areal_mask(w.zero, notes, geometric_weight=True)
    if w.lower is not None or w.upper is not None:
        agg = "mean"
        if w.unless is not None:
            agg = {"sequence": "sum", "max": "max"}.get(w.unless.level, "mean")
        upper = _areal_ratio_upper(w.upper, notes, w)
        if upper is None:
            return None
        return RejectionSampling(
            level="sequence", action="clamp", agg=agg, upper=upper, lower=w.lower
        )
    for m in masks:
        if m.statistic == "ratio" and m.level in ("sequence", "geometric", "max"):
            masks.remove(m)
            return _areal_mask(m, notes, geometric_weight=True)
    return RejectionSampling(level="sequence", upper=math.inf)


def _areal_mask(
    m: Component, notes: list[str], *, geometric_weight: bool
) -> RejectionSampling | None:
    """AReaL's rejection closest to a mask: metric ratio keeps the weight the geometric mean at
    sequence level, the KL metrics keep per-token weights."""
    if m.statistic == "mult_error":
        lost(notes, m, "AReaL has no band on the multiplicative error e^|d|; dropped")
        return None
    if m.statistic == "prob_diff":
        lost(notes, m, "AReaL has no band on the probability difference; dropped")
        return None
    if m.statistic == "binary_kl":
        lost(
            notes,
            m,
            "AReaL's config validation refuses its own binary_kl metric (whose 1e-8 clamp "
            "without a float32 upcast gives NaN where p rounds to 1); dropped",
        )
        return None
    level = ratio_level(m) if m.statistic == "ratio" else m.level
    aggs = {"sequence": "sum", "geometric": "mean", "max": "max", "any_token": "max"}
    if level == "geometric_unmasked":
        lost(notes, m, "AReaL's sequence mean runs over loss tokens only")
        level = "geometric"
    bounds = ratio_bounds(m)
    if level == "any_token":
        if bounds is None or bounds[1] is None:
            lost(notes, m, "AReaL bounds a sequence's largest token only from above; dropped")
            return None
        if bounds[0] is not None:
            lost(notes, m, "AReaL bounds a sequence's largest token from above; lower dropped")
        bounds = (None, bounds[1])
    if m.strict:
        lost(notes, m, "AReaL's bounds are inclusive")
    if m.statistic == "ratio" and (level == "token" or geometric_weight):
        upper = _areal_ratio_upper(bounds[1], notes, m)
        if upper is None:
            return None
        # AReaL refuses a ratio lower bound <= 0, which bounds nothing anyway.
        lower = bounds[0] if bounds[0] else None
        if level == "token":
            return RejectionSampling(upper=upper, lower=lower)
        return RejectionSampling(level="sequence", agg=aggs[level], upper=upper, lower=lower)
    if m.statistic in ("ratio", "log_ratio"):
        metric = "kl_k1"
        lower = log_or_none(bounds[0]) if m.statistic == "ratio" else m.lower
        upper = log_or_none(bounds[1]) if m.statistic == "ratio" else m.upper
        if level == "any_token":
            lower, upper = None, math.log(bounds[1])
        lower = None if lower == -math.inf else lower
        upper = math.inf if upper is None else upper
    else:
        metric = {"k2": "kl_k2", "k3": "kl_k3", "k3_reverse": "kl_k3"}[m.statistic]
        if m.statistic == "k3":
            lost(notes, m, "AReaL's kl_k3 is e^-d - 1 + d, not e^d - 1 - d; same bound used")
        lower, upper = m.lower, m.upper
    if level == "token":
        return RejectionSampling(metric=metric, upper=upper, lower=lower)
    return RejectionSampling(
        level="sequence", metric=metric, agg=aggs[level], upper=upper, lower=lower
    )


# ------------------------------------------------------------------ dump adapter


def read_batch(rollout_batch: Any) -> list[BatchFields]:
    """AReaL's `rollout_batch` (a list of trajectory dicts, or one dict) -> its dump fields.

    Where (areal/trainer/rl_trainer.py at inclusionAI/AReaL@4aef98d8): `PPOTrainer.train`
    gets the step's `rollout_batch` from `actor.prepare_batch` (l.573, `group_size` =
    `gconfig.n_samples`, l.578, so each dict holds one prompt's samples) and stores the
    trainer's recompute in each dict as `prox_logp` (l.652-654), when
    `actor.should_compute_prox_logp()`; `compute_advantages` (l.665) works on concatenated
    copies and leaves the dicts as they were.

    Each dict holds [g, S] tensors over prompt + response (areal/workflow/rlvr.py l.165-178):
    `input_ids`, `loss_mask` (1 on generated tokens), `logprobs` (the ROLLOUT engine's, 0 on
    the prompt, at the position of the token they score) and `rewards` [g]; `prox_logp` [g, S]
    scores the NEXT token at each position. AReaL aligns them by rolling the rollout side by -1
    (areal/trainer/ppo/actor.py l.176, l.188); the views `[:, 1:]` here do the same without a
    copy (the column a roll wraps around is a prompt position, never a token).
    Group id: the dict's place in the list.
    """
    if not isinstance(rollout_batch, list | tuple):
        rollout_batch = [rollout_batch]
    what = "AReaL's trajectory dicts"
    parts = []
    for group, traj in enumerate(rollout_batch):
        rollout = _batch.need(
            traj, "logprobs", what, "AReaL's workflows return them (rlvr.py l.173)"
        )
        train = _batch.need(
            traj,
            "prox_logp",
            what,
            "AReaL recomputes them only when actor.should_compute_prox_logp() "
            "(use_decoupled_loss or recompute_logprob); call add_batch after rl_trainer.py l.654",
        )
        tokens = _batch.field(traj, "input_ids")
        parts.append(
            BatchFields(
                rollout[:, 1:],
                train[:, :-1],
                mask=_batch.need(traj, "loss_mask", what, "AReaL's workflows return it")[:, 1:],
                token_ids=None if tokens is None else tokens[:, 1:],
                rewards=_batch.field(traj, "rewards"),
                group_ids=[group] * len(rollout),
            )
        )
    return parts


# ------------------------------------------------------------------ the framework


def _comments(spec: ArealCorrection) -> tuple[str, ...]:
    """What the YAML alone does not say: the PR a version needs (`version:` is iscore's key,
    not AReaL's, so the snippet leaves it out).

    >>> spec = PRESETS["areal_two_stage_clamp_pr1218"]
    >>> print(_comments(spec)[0])  # doctest: +NORMALIZE_WHITESPACE
    needs AReaL PR #1218 (open, head 3ab740ce): token_action clamp reuses upper 5 (and lower)
    of the sequence mask
    """
    if spec.version is None:
        return ()
    line = f"needs AReaL PR #{PR1218.pr} ({PR1218.state}, head {PR1218.upstream.commit[:8]})"
    rs = spec.rejection_sampling
    if rs is not None and rs.token_action is not None:
        line += (
            f": token_action {rs.token_action} reuses upper {rs.upper:g} (and lower) of the "
            "sequence mask"
        )
    return (line,)


FRAMEWORK = Framework(
    name=NAME,
    title="AReaL",
    upstream=Upstream(
        "inclusionAI/AReaL", "4aef98d8d818af55b43621aaadba047ae10f4e77", "2026-05-21"
    ),
    versions=VERSIONS,
    spec_types=(ArealCorrection,),
    parse=parse,
    presets=lambda: PRESETS,
    default="areal_token_mask",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=lambda body, fmt: snippets.yaml_text(body),
    families=frozenset({"token_tis"}),
    # `prox_logp` only: AReaL's `old_logprobs`/`logprobs` hold the ROLLOUT's log-probs, the
    # trainer's elsewhere, so they are no alias of either column (map them explicitly).
    columns={"train_logprob": ("prox_logp",)},
    metrics={
        "k1": ("-behave_approx_kl",),
        "k3_reverse": ("rejection_sampling kl_k3 statistic",),
    },
    traps=(
        Trap(
            "decoupled-loss-without-weight",
            "AReaL: use_decoupled_loss without rejection_sampling applies no behaviour weight at "
            "all (since PR #1088); set rejection_sampling as in the candidates.",
        ),
        Trap(
            "pr1218-one-pair-of-bounds",
            "AReaL PR #1218's token_action reuses the sequence mask's upper (and lower) for the "
            "tokens: with the default upper 5 the geometric mean hardly ever rejects a "
            "sequence, while a tight bound such as 1.01 masks or clamps nearly every token.",
            about=lambda spec: spec.version == PR1218.name,
        ),
    ),
    comments=_comments,
    snippet_formats=("yaml",),
    read_batch=read_batch,
)
