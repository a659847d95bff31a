"""verl's "Rollout Correction" (Gen-3 config, `algorithm.rollout_correction`).

Replays `verl/trainer/ppo/rollout_corr_helper.py` at verl-project/verl@1dda039b (2026-08-22):
`compute_rollout_correction_and_rejection_mask`, `compute_rollout_correction_weights`,
`compute_rollout_rejection_mask`, and the bypass loss `compute_policy_loss_bypass_mode` in
`verl/trainer/ppo/core_algos.py`.

What verl computes, in its order (decoupled mode, `bypass_mode: false`):

1. d = old_log_probs - rollout_log_probs (the trainer's recompute over the rollout engine's).
2. IS weights (`rollout_is: token | sequence`), over the ORIGINAL `response_mask`:
   token: raw_t = e^{clamp(d_t, +-20)}; sequence: raw = e^{clamp(S, +-20)} with S the masked sum
   of the UNCLAMPED d, broadcast. `rollout_is_threshold` U (float or numeric string): truncate,
   w = min(raw, U), no lower clamp; `"L_U"` (IcePop): w = raw * 1[L <= raw <= U] (inclusive).
3. `rollout_is_batch_normalize`: after truncation, w /= mean(w), the mean taken over every token of
   the original mask (token level) or over the per-sequence weights of the sequences with at least
   one mask token (sequence level), within each training step. Tokens and sequences that step 4
   rejects still count in the mean. Skipped when the mean is <= 1e-8.
4. RS (`rollout_rs`, comma-separated options, AND-combined), also over the ORIGINAL mask and
   independent of step 2: d~ = clamp(d, +-20), k1 = -d~, k2 = d~^2 / 2, k3 = e^{d~} - 1 - d~;
   `token_kX` per token, `seq_sum_kX` / `seq_mean_kX` / `seq_max_kX` the masked sum / mean / max
   per sequence (0 for a sequence without mask tokens). k1 keeps log L <= stat <= log U, which,
   because the statistic is -d, keeps the ratio in [1/U, 1/L] (not [L, U]: "0.5_1.5" keeps
   [0.667, 2.0]); k2/k3 keep stat <= U. The result multiplies `response_mask`.
5. The loss multiplies each token's term by w (1 when `rollout_is` is null) under the RS mask.

Bypass mode (`bypass_mode: true`) skips the recompute; inside the loss it runs the same steps with
the CURRENT policy's log-probs in place of old_log_probs (e = policy - rollout, needs the
`policy_logprob` column). `loss_type: reinforce` applies the IS weight and the RS mask;
`loss_type: ppo_clip` applies the RS mask and NO IS weight (verl computes it for metrics only), so
the replayed weight is 1 and `raw` is the PPO ratio e^{clamp(e, +-20)} the clip acts on.

Config keys (verl's own nesting): `algorithm.rollout_correction.{rollout_is, rollout_is_threshold,
rollout_is_batch_normalize, rollout_rs, rollout_rs_threshold, bypass_mode, loss_type}`. A config
file is read with the YAML semantics of `verl/trainer/config/algorithm/rollout_correction.yaml`:
a missing key takes the YAML default (`rollout_is: null`, threshold 2.0, no RS, decoupled,
`ppo_clip`), NOT the Python dataclass default (`RolloutCorrectionConfig().rollout_is` is
"sequence"). The other keys of verl's `algorithm` section (gamma, adv_estimator, ...) are accepted
and ignored. iscore's own top-level keys: `framework: verl`, `name:`, `preset:` (one of
`PRESETS`, verl's `RolloutCorrectionConfig` classmethods with their default arguments; keys under
`algorithm.rollout_correction` then override the preset's values) and `version:` (below).

Where verl's documentation (docs/corrections.md#verl) and its code differ, or the spec is silent,
the code
is followed:

- `rollout_rs` must be a string: a YAML list raises in verl (`rollout_corr_helper.py:235`), so it
  is a ConfigError here; `rollout_rs_threshold` likewise only takes a number or a string (:138).
- `rollout_is_threshold: null` disables IS weights even when `rollout_is` is set (:854).
- verl validates a threshold only when it is used (IS threshold when `rollout_is` is set, RS
  thresholds when `rollout_rs` is set); so does this parser. A NaN threshold, which verl's
  `<= 0` checks let through, is rejected here.
- Batch normalization and the RS statistics include every token of the original mask, rejected
  ones included (both helpers receive the original `response_mask`, :854-880).
- verl computes in float32 with `masked_mean = sum / (count + 1e-8)`; in float32 the 1e-8 vanishes
  for count >= 1, so this replay's float64 sum / count matches it, up to float32 rounding of the
  statistics (verl's float32 k3 = e^d - 1 - d cancels badly for |d| < 1e-3; the float64 replay
  uses the exact value).
- verl raises when a batch has no mask token at all (:837); the replay returns zero weights.
- Batch normalization averages over one training step (`batch.step`): in decoupled mode the
  driver normalizes the full batch of a step. In bypass mode the helper runs per micro-batch
  inside the loss (all-reduced over data-parallel ranks); a dump does not record micro-batches,
  so the replay uses the step there too.
- `geo_mean` (GMPO) policy losses turn the token weights into a per-sequence geometric mean; this
  module replays the weights every other policy loss applies.

Version `pr6800` (`"version": "pr6800"`; verl PR #6800, open, head b26dfa5c8 of 2026-06-21, read
in `rollout_corr_helper.py` and `config/algorithm.py` there) adds one `rollout_rs` option,
`binary_kl` (KPop), and changes nothing else:

- a token-level option, AND-ed with the others and multiplying `response_mask` like them:
  keep iff max(B(p||q), B(q||p)) <= phi, B the binary KL `ops.binary_kl` of p = e^{old} and
  q = e^{rollout}, both upcast to float32 and clamped into [1e-6, 1 - 1e-6], from the RAW
  log-probs (not the +-20-clamped d); in bypass mode `old` is the current policy, as for every
  option (core_algos.py passes it as `old_log_prob`). A NaN statistic is rejected.
- its threshold is one float > 0 (an "L_U" entry raises, as for every non-k1 option);
- the preset `decoupled_token_kpop()` (phi = 2.0, no IS weight), iscore's
  `decoupled_token_kpop_pr6800`;
- metrics `rollout_corr/rollout_rs_binary_kl_{mean, max, min, std, fraction_high,
  fraction_low (always 0), seq_mean, seq_std, seq_max, seq_min, seq_max_deviation,
  seq_fraction_high, masked_fraction, seq_masked_fraction}`, the per-sequence ones of the
  per-sequence mean statistic.

Without the version `binary_kl` is refused, as verl's main refuses it. The PR's branch starts
from 86e8123, before main's check that a k1 band has lower <= upper; the version keeps that
check, since a version changes only what its pull request changes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, Literal, get_args

import torch

from iscore.errors import ConfigError, DumpError, quote
from iscore.frameworks import _batch, snippets
from iscore.frameworks._config import as_float, check_choice, check_number, top_level, version
from iscore.frameworks.base import (
    Aggregation,
    BatchFields,
    Citation,
    Framework,
    HealthBand,
    Trap,
    Upstream,
    Version,
)
from iscore.frameworks.canonical import (
    BIG,
    TINY,
    Anchor,
    Canonical,
    Component,
    Level,
    Numerator,
    Translation,
    first_weight,
    lost,
    mask_component,
    normalize_component,
    note_extras,
    note_numerator,
    ratio_bounds,
    ratio_level,
    weight_component,
)
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "verl"

RSOption = Literal[
    "token_k1",
    "token_k2",
    "token_k3",
    "seq_sum_k1",
    "seq_sum_k2",
    "seq_sum_k3",
    "seq_mean_k1",
    "seq_mean_k2",
    "seq_mean_k3",
    "seq_max_k2",
    "seq_max_k3",
]
RS_OPTIONS: tuple[str, ...] = get_args(RSOption)
"""verl's `SUPPORTED_ROLLOUT_RS_OPTIONS`, in its documented order."""

KPOP = "binary_kl"
"""The `rollout_rs` option of version pr6800 (KPop): token level, one upper bound phi."""

PR6800 = Version(
    "pr6800",
    6800,
    "open",
    Upstream("verl-project/verl", "b26dfa5c81b0527d3f189966d11a5afa4578c72d", "2026-06-21"),
    "rollout_rs may hold binary_kl (KPop: keep a token iff its binary KL both ways <= phi)",
)

_KEY = "algorithm.rollout_correction"
_IS_THRESHOLD_KEY = f"{_KEY}.rollout_is_threshold"
_RS_KEY = f"{_KEY}.rollout_rs"
_RS_THRESHOLD_KEY = f"{_KEY}.rollout_rs_threshold"

# verl's `AlgoConfig` fields beside `rollout_correction` (plus Hydra's `_target_`): accepted so a
# real `algorithm:` block parses; none of them changes the correction.
_ALGORITHM_SIBLINGS = (
    "_target_",
    "gamma",
    "lam",
    "adv_estimator",
    "norm_adv_by_std_in_grpo",
    "use_kl_in_reward",
    "kl_penalty",
    "kl_ctrl",
    "use_pf_ppo",
    "pf_ppo",
    "filter_groups",
    "gdpo_reward_keys",
    "gdpo_reward_weights",
)

# Below this batch mean verl leaves the weights unnormalized.
_BATCH_NORM_EPS = 1e-8


def _check_positive(value: Any, key: str) -> float:
    """`value` as a float > 0 (NaN rejected); ints accepted, bools not."""
    check_number(key, value, gt=0.0)
    return float(value)


@dataclass(frozen=True, slots=True)
class RSCriterion:
    """One `rollout_rs` option with its threshold, in the units verl compares against.

    Args:
        option: the verl option, e.g. "seq_mean_k1" (aggregate `token`/`seq_sum`/`seq_mean`/
            `seq_max`, estimator k1/k2/k3), or version pr6800's "binary_kl" (token level).
        upper: k1: the upper RATIO bound U as written in the config (compared as log U against
            the statistic -d, so it bounds the ratio from BELOW at 1/U); k2/k3: the upper bound
            on the statistic; binary_kl: phi.
        lower: k1 only: the lower ratio bound L (`"L_U"`, or 1/U for a single float), which
            bounds the ratio from ABOVE at 1/L; None for k2/k3.

    >>> RSCriterion("token_k1", upper=1.5, lower=0.5).kept_ratio
    (0.6666666666666666, 2.0)
    """

    option: RSOption | Literal["binary_kl"]
    upper: float
    lower: float | None = None

    def __post_init__(self) -> None:
        if self.option not in (*RS_OPTIONS, KPOP):
            raise ConfigError(
                f"Expected `option` to be one of {', '.join(RS_OPTIONS)} (or {KPOP}, of "
                f"version {PR6800.name}), but got {quote(self.option)}"
            )
        object.__setattr__(self, "upper", _check_positive(self.upper, f"{self.option}.upper"))
        if self.estimator == "k1":
            if self.lower is None:
                raise ConfigError(f"Expected `{self.option}.lower` to be a float > 0, but got None")
            lower = _check_positive(self.lower, f"{self.option}.lower")
            if lower > self.upper:
                raise ConfigError(
                    f"Expected `{self.option}.lower` <= `upper` ({quote(self.upper)}), but got "
                    f"{quote(lower)}"
                )
            object.__setattr__(self, "lower", lower)
        elif self.lower is not None:
            raise ConfigError(
                f"Expected `{self.option}.lower` to be None (only k1 options take a lower "
                f"bound), but got {quote(self.lower)}"
            )

    @property
    def aggregate(self) -> Literal["token", "seq_sum", "seq_mean", "seq_max"]:
        """How the per-token statistic is reduced: per token, or per-sequence sum/mean/max."""
        if self.option == KPOP:
            return "token"
        return self.option.rsplit("_", 1)[0]  # type: ignore[return-value]

    @property
    def estimator(self) -> Literal["k1", "k2", "k3", "binary_kl"]:
        """The per-token statistic: k1 = -d, k2 = d^2/2, k3 = e^d - 1 - d, or binary_kl =
        max(B(p||q), B(q||p)) on the probabilities."""
        if self.option == KPOP:
            return KPOP
        return self.option.rsplit("_", 1)[1]  # type: ignore[return-value]

    @property
    def kept_ratio(self) -> tuple[float, float] | None:
        """k1: the ratio (per token, sequence product or geometric mean) interval kept,
        [1/U, 1/L]; None for k2/k3."""
        if self.lower is None:
            return None
        return 1.0 / self.upper, 1.0 / self.lower

    def threshold_entry(self) -> str:
        """This criterion's entry of `rollout_rs_threshold` ("L_U" for k1, "U" otherwise)."""
        if self.lower is None:
            return repr(self.upper)
        return f"{self.lower!r}_{self.upper!r}"

    def keep(self, d: torch.Tensor, batch: TokenBatch, numerator: str = "train") -> torch.Tensor:
        """bool [N], the tokens this criterion keeps, given the log-ratio d (float64 [N]) of
        `numerator`'s log-probs ("train" or "policy") over the rollout's.

        Sequence statistics run over the batch's loss mask, as verl's run over the original
        `response_mask`; they are compared with the bounds per sequence, then broadcast.
        """
        if self.option == KPOP:
            # PR #6800 upcasts the raw log-probs (not d) to float32; NaN is rejected, as
            # torch.maximum propagates it and NaN <= phi is false.
            old, rollout = getattr(batch, numerator).float(), batch.rollout.float()
            stat = torch.maximum(ops.binary_kl(old, rollout), ops.binary_kl(rollout, old))
            return ops.band(stat, upper=self.upper)
        bound = ops.SAFETY_BOUND
        # d~ = clamp(d, +-20): d itself (and its shared sequence sums) when nothing is outside.
        clamped = d if _within(d, bound) else d.clamp(-bound, bound)
        mask = batch.loss_mask
        if self.estimator == "k1" and self.aggregate != "seq_max":
            # k1 = -d~ is compared in log space (the sign trap): log L <= -x <= log U is
            # -log U <= x <= -log L, so neither the tokens nor the sums are negated. (Negating
            # is exact; only the sign of a zero sum could differ, which no bound tells apart.)
            lower, upper = -math.log(self.upper), -math.log(self.lower)
            if self.aggregate == "token":
                return ops.band(clamped, lower, upper)
            if self.aggregate == "seq_sum":
                seq_stat = ops.segment_sum(clamped, batch, mask)
            else:
                seq_stat = ops.segment_mean(clamped, batch, mask)
            return ops.broadcast(ops.band(seq_stat, lower, upper), batch)
        if self.estimator == "k1":
            stat = clamped.neg() if clamped is d else clamped.neg_()
        else:
            stat = {"k2": ops.k2, "k3": ops.k3}[self.estimator](clamped)
        if self.aggregate == "token":
            return self._band(stat)
        if self.aggregate == "seq_sum":
            seq_stat = ops.segment_sum(stat, batch, mask)
        elif self.aggregate == "seq_mean":
            # segment_mean gives 0 for a sequence without mask tokens, as verl's 0 / 1e-8 does.
            seq_stat = ops.segment_mean(stat, batch, mask)
        else:
            seq_stat = ops.segment_max(stat, batch, mask)
            # verl maps the -inf of a sequence without mask tokens to 0.
            seq_stat = torch.where(torch.isneginf(seq_stat), 0.0, seq_stat)
        return ops.broadcast(self._band(seq_stat), batch)

    def _band(self, stat: torch.Tensor) -> torch.Tensor:
        """Whether the statistic (per token or per sequence) is within the bounds."""
        if self.lower is None:
            return ops.band(stat, upper=self.upper)
        # k1 bounds are compared in log space against the statistic -d (the sign trap).
        return ops.band(stat, math.log(self.lower), math.log(self.upper))


_K1_RATIO = {"token": "each token's ratio rho", "seq_sum": "e^S", "seq_mean": "e^G"}
"""What each k1 aggregate bounds, in the symbols of `iscore.advice.candidates.RULE_SYMBOLS`."""


def _comments(spec: VerlSpec) -> tuple[str, ...]:
    """The version a setting needs, and the sign trap spelled out beside the numbers it
    concerns: a k1 threshold "L_U" keeps the ratio in [1/U, 1/L], so a band of ratios is
    written as its reciprocals.

    >>> kpop = PRESETS["decoupled_token_kpop_pr6800"]
    >>> print(_comments(kpop)[0])  # doctest: +NORMALIZE_WHITESPACE
    needs verl PR #6800 (open PR, head b26dfa5c): binary_kl is not in verl's main, which
    refuses it

    >>> rs = (RSCriterion("seq_mean_k1", upper=1 / 0.96947, lower=1 / 1.0307),)
    >>> print(_comments(VerlSpec(rs=rs))[0])  # doctest: +NORMALIZE_WHITESPACE
    rollout_rs seq_mean_k1 keeps e^G in [0.96947, 1.0307]: verl compares k1 = -log(ratio)
    with log L and log U, so the threshold "L_U" is 1/1.0307_1/0.96947 (the reciprocals)
    """
    lines = []
    if spec.version == PR6800.name:
        lines.append(
            f"needs verl PR #{PR6800.pr} ({PR6800.status}): {KPOP} is not in verl's main, "
            "which refuses it"
        )
    for criterion in spec.rs:
        kept = criterion.kept_ratio
        if kept is None or criterion.aggregate == "seq_max":
            continue
        lo, hi = (float(f"{x:.6g}") for x in kept)
        lines.append(
            f"rollout_rs {criterion.option} keeps {_K1_RATIO[criterion.aggregate]} in "
            f"[{lo:g}, {hi:g}]: verl compares k1 = -log(ratio) with log L and log U, so "
            f'the threshold "L_U" is 1/{hi:g}_1/{lo:g} (the reciprocals)'
        )
    return tuple(lines)


def _within(x: torch.Tensor, bound: float) -> bool:
    """Whether every value of x is in [-bound, bound] (False if any is NaN)."""
    if x.numel() == 0:
        return True
    low, high = torch.aminmax(x)
    return bool((low >= -bound) & (high <= bound))


@dataclass(frozen=True, slots=True)
class VerlSpec:
    """A validated verl rollout-correction setting.

    Args:
        name: display name.
        is_level: `rollout_is`: "token", "sequence", or None for no IS weight.
        is_upper: the IS threshold U (truncation cap, or IcePop upper bound); None iff
            `is_level` is None.
        is_lower: the IcePop lower bound L; None for truncation (TIS).
        batch_normalize: `rollout_is_batch_normalize` (only with an IS level).
        rs: the `rollout_rs` criteria, AND-combined, distinct options in config order.
        bypass: `bypass_mode`: ratios against the current policy instead of the recompute.
        loss_type: bypass mode's loss, "ppo_clip" (no IS weight) or "reinforce".
        version: None (the pinned release) or "pr6800", which `rs` needs for `binary_kl`.

    >>> spec = VerlSpec(is_level="token", is_upper=5.0, is_lower=0.5)
    >>> spec.is_mode, spec.to_config()["algorithm"]["rollout_correction"]["rollout_is_threshold"]
    ('icepop', '0.5_5.0')
    """

    framework: ClassVar[str] = NAME

    name: str = NAME
    is_level: Literal["token", "sequence"] | None = None
    is_upper: float | None = None
    is_lower: float | None = None
    batch_normalize: bool = False
    rs: tuple[RSCriterion, ...] = ()
    bypass: bool = False
    loss_type: Literal["ppo_clip", "reinforce"] = "ppo_clip"
    version: Literal["pr6800"] | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"Expected `name` to be a string, but got {quote(self.name)}")
        check_choice("version", self.version, (None, PR6800.name))
        if self.is_level not in (None, "token", "sequence"):
            raise ConfigError(
                f"Expected `is_level` to be one of null, 'token', 'sequence', "
                f"but got {quote(self.is_level)}"
            )
        if self.is_level is None:
            for field in ("is_upper", "is_lower"):
                if getattr(self, field) is not None:
                    raise ConfigError(
                        f"Expected `{field}` to be None without an IS level, "
                        f"but got {quote(getattr(self, field))}"
                    )
            if self.batch_normalize:
                raise ConfigError(
                    "Expected `batch_normalize` to be False without an IS level, but got True"
                )
        else:
            upper = _check_positive(self.is_upper, "is_upper")
            object.__setattr__(self, "is_upper", upper)
            if self.is_lower is not None:
                lower = _check_positive(self.is_lower, "is_lower")
                if lower > upper:
                    raise ConfigError(
                        f"Expected `is_lower` <= `is_upper` ({quote(upper)}), but got "
                        f"{quote(lower)}"
                    )
                object.__setattr__(self, "is_lower", lower)
        for field in ("batch_normalize", "bypass"):
            if not isinstance(getattr(self, field), bool):
                raise ConfigError(
                    f"Expected `{field}` to be a bool, but got {quote(getattr(self, field))}"
                )
        if self.loss_type not in ("ppo_clip", "reinforce"):
            raise ConfigError(
                f"Expected `loss_type` to be one of 'ppo_clip', 'reinforce', "
                f"but got {quote(self.loss_type)}"
            )
        rs = tuple(self.rs)
        if not all(isinstance(c, RSCriterion) for c in rs):
            raise ConfigError(
                f"Expected `rs` to be a tuple of RSCriterion, but got {quote(self.rs)}"
            )
        options = [c.option for c in rs]
        if len(set(options)) != len(options):
            raise ConfigError(f"Expected `rs` to name each option once, but got {options}")
        if KPOP in options and self.version != PR6800.name:
            raise _needs_version()
        object.__setattr__(self, "rs", rs)

    @property
    def is_mode(self) -> Literal["truncate", "icepop"]:
        """ "icepop" (zero weights outside [L, U]) when a lower bound is set, else "truncate"."""
        return "truncate" if self.is_lower is None else "icepop"

    @property
    def applies_is_weight(self) -> bool:
        """Whether the loss is multiplied by the IS weight (bypass PPO-clip only logs it)."""
        return self.is_level is not None and not (self.bypass and self.loss_type == "ppo_clip")

    def to_config(self) -> dict[str, Any]:
        """The iscore config of this setting: `framework`, `name` and verl's own
        `algorithm.rollout_correction` mapping (all seven keys), the inverse of `parse`."""
        if self.is_level is None:
            threshold: float | str = 2.0  # the YAML default; unused without an IS level
        elif self.is_lower is None:
            threshold = self.is_upper
        else:
            threshold = f"{self.is_lower!r}_{self.is_upper!r}"
        rs_threshold: float | str | None = None
        if len(self.rs) == 1 and self.rs[0].lower is None:
            rs_threshold = self.rs[0].upper
        elif self.rs:
            rs_threshold = ",".join(c.threshold_entry() for c in self.rs)
        correction = {
            "rollout_is": self.is_level,
            "rollout_is_threshold": threshold,
            "rollout_is_batch_normalize": self.batch_normalize,
            "rollout_rs": ",".join(c.option for c in self.rs) or None,
            "rollout_rs_threshold": rs_threshold,
            "bypass_mode": self.bypass,
            "loss_type": self.loss_type,
        }
        version = {} if self.version is None else {"version": self.version}
        return {
            "framework": NAME,
            "name": self.name,
            **version,
            "algorithm": {"rollout_correction": correction},
        }

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weight and keep mask of this setting over `batch`.

        Without an applied IS weight (no `rollout_is`, or bypass PPO-clip) the weight is 1 and
        `raw` is the per-token ratio e^{clamp(d, +-20)}; `seq_raw` / `seq_weight` are set for
        sequence-level weights only.

        Raises:
            ConfigError: bypass mode on a batch without the `policy_logprob` column.
        """
        if self.bypass and batch.policy is None:
            raise ConfigError(
                "`algorithm.rollout_correction.bypass_mode: true` computes its ratios against the "
                "current policy and needs the `policy_logprob` column, which the dump lacks"
            )
        numerator = "policy" if self.bypass else "train"
        d = ops.log_ratio(batch, numerator)
        keep = batch.loss_mask  # Replay.build ANDs the criteria with it anyway
        for criterion in self.rs:
            keep = keep & criterion.keep(d, batch, numerator)
        if not self.applies_is_weight:
            return Replay.build(batch, torch.ones_like(d), keep, ops.exp(d))
        return self._weighted(batch, d, keep)

    def _weighted(self, batch: TokenBatch, d: torch.Tensor, keep: torch.Tensor) -> Replay:
        """IS weights over the original loss mask, then (optionally) batch normalization."""
        mask = batch.loss_mask
        seq_raw = seq_weight = pre_norm = None
        if self.is_level == "token":
            raw = ops.exp(d)
            weight = self._bound(raw)
            if self.batch_normalize:
                # Every token of the original mask counts, RS-rejected ones included.
                pre_norm = weight
                sums = ops.segment_sum(weight, batch, mask)
                means = _step_mean(sums, ops.segment_count(batch, mask), batch)
                divisor = ops.broadcast(means, batch)  # fresh: `means` is not a shared tensor
                weight = torch.div(weight, divisor, out=divisor)  # the quotient takes its place
        else:
            # S sums the unclamped d; only the sum is clamped before exponentiating.
            seq_raw = ops.exp(ops.segment_sum(d, batch, mask))
            seq_weight = self._bound(seq_raw)
            if self.batch_normalize:
                # One weight per sequence with at least one mask token, RS-rejected ones included.
                pre_norm = per_token(seq_weight, batch)
                valid = (ops.segment_count(batch, mask) > 0).double()
                seq_weight = seq_weight / _step_mean(seq_weight * valid, valid, batch)
            raw = per_token(seq_raw, batch)
            weight = per_token(seq_weight, batch)
        return Replay.build(
            batch, weight, keep, raw, seq_raw=seq_raw, seq_weight=seq_weight, pre_norm=pre_norm
        )

    def _bound(self, raw: torch.Tensor) -> torch.Tensor:
        """Truncate at U (TIS), or zero outside [L, U] keeping the raw ratio (IcePop)."""
        if self.is_lower is None:
            return ops.truncate(raw, upper=self.is_upper)
        return torch.where(ops.band(raw, self.is_lower, self.is_upper), raw, 0.0)


def _step_mean(sums: torch.Tensor, counts: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """[B] per-sequence divisor: sum(sums) / sum(counts) over the sequence's training step.

    verl normalizes over the batch of one training step; a mean <= 1e-8 (or an empty step)
    gives 1, as verl then skips the division.
    """
    _, step = torch.unique(batch.step, return_inverse=True)
    groups = int(step.max()) + 1 if step.numel() else 0
    num = torch.zeros(groups, dtype=torch.float64, device=sums.device).index_add_(0, step, sums)
    den = torch.zeros(groups, dtype=torch.float64, device=sums.device).index_add_(
        0, step, counts.double()
    )
    mean = num / den
    return torch.where(mean > _BATCH_NORM_EPS, mean, 1.0)[step]


def _parse_is_threshold(value: Any) -> tuple[float | None, float]:
    """(lower, upper) from `rollout_is_threshold`: U, a numeric string, or "L_U" (IcePop)."""
    expected = (
        f"Expected `{_IS_THRESHOLD_KEY}` to be a float > 0 or a 'lower_upper' string "
        f"with 0 < lower <= upper, but got {quote(value)}"
    )
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(expected)
    if isinstance(value, str):
        text = value.strip()
        if "_" in text:
            lower_text, upper_text = text.split("_", 1)
            lower = as_float(lower_text, _IS_THRESHOLD_KEY, gt=0.0)
            upper = as_float(upper_text, _IS_THRESHOLD_KEY, gt=0.0)
            if lower > upper:
                raise ConfigError(expected)
            return lower, upper
        if not text:
            raise ConfigError(expected)
    return None, as_float(value, _IS_THRESHOLD_KEY, gt=0.0)


def _needs_version() -> ConfigError:
    return ConfigError(
        f"`{_RS_KEY}` option {KPOP} needs version {PR6800.name} (verl PR #{PR6800.pr}, "
        f"{PR6800.status}; verl's main refuses the option): add `version: {PR6800.name}` to "
        "the config"
    )


def _parse_rs(
    options_value: Any, threshold_value: Any, version: str | None
) -> tuple[RSCriterion, ...]:
    """The criteria of `rollout_rs` and `rollout_rs_threshold`, with verl's validation (at
    PR #6800's head for version pr6800)."""
    if not isinstance(options_value, str):
        raise ConfigError(
            f"Expected `{_RS_KEY}` to be a comma-separated string of options (verl rejects "
            f"lists), but got {quote(options_value)}"
        )
    options: list[str] = []
    for option in (part.strip() for part in options_value.split(",")):
        if not option:
            continue
        if option == KPOP and version != PR6800.name:
            raise _needs_version()
        if option not in (*RS_OPTIONS, KPOP):
            raise ConfigError(
                f"Expected `{_RS_KEY}` options to be among {', '.join(RS_OPTIONS)}, "
                f"but got {quote(option)}"
            )
        if option not in options:  # verl drops repeated options
            options.append(option)
    if not options:
        raise ConfigError(
            f"Expected `{_RS_KEY}` to name at least one option, but got {quote(options_value)}"
        )
    if threshold_value is None:
        raise ConfigError(
            f"Missing `{_RS_THRESHOLD_KEY}`: verl requires it when `{_RS_KEY}` is set"
        )
    if isinstance(threshold_value, bool) or not isinstance(threshold_value, int | float | str):
        raise ConfigError(
            f"Expected `{_RS_THRESHOLD_KEY}` to be a number or a comma-separated string, "
            f"but got {quote(threshold_value)}"
        )
    if isinstance(threshold_value, str):
        entries = [part.strip() for part in threshold_value.split(",") if part.strip()]
    else:
        entries = [str(threshold_value)]
    if len(entries) not in (1, len(options)):
        raise ConfigError(
            f"Expected `{_RS_THRESHOLD_KEY}` to hold 1 entry or {len(options)} (one per distinct "
            f"`rollout_rs` option), but got {len(entries)}: {quote(threshold_value)}"
        )
    if len(entries) == 1:
        entries = entries * len(options)
    return tuple(_parse_rs_entry(o, e) for o, e in zip(options, entries, strict=True))


def _parse_rs_entry(option: str, entry: str) -> RSCriterion:
    """One option's threshold: k1 "L_U" or U (L = 1/U); k2/k3 a single upper bound."""
    key = f"{_RS_THRESHOLD_KEY}` entry for `{option}"
    if option.endswith("k1"):
        if "_" in entry:
            lower_text, upper_text = entry.split("_", 1)
            lower = as_float(lower_text, key, gt=0.0)
            upper = as_float(upper_text, key, gt=0.0)
        else:
            upper = as_float(entry, key, gt=0.0)
            lower = 1.0 / upper
            if not lower > 0:  # U = inf gives L = 0, which verl rejects
                raise ConfigError(
                    f"Expected `{key}` to be a finite float > 0, but got {quote(entry)}"
                )
        if lower > upper:
            raise ConfigError(
                f"Expected `{key}` to be 'lower_upper' with lower <= upper, but got {quote(entry)}"
            )
        return RSCriterion(option, upper=upper, lower=lower)  # type: ignore[arg-type]
    if "_" in entry:
        raise ConfigError(
            f"Expected `{key}` to be a single upper bound (verl accepts 'lower_upper' only for "
            f"k1 options), but got {quote(entry)}"
        )
    return RSCriterion(option, upper=as_float(entry, key, gt=0.0))  # type: ignore[arg-type]


def parse(config: Mapping[str, Any]) -> VerlSpec:
    """Parse a verl config (plus `framework: verl`, optional `name:`, `preset:` and
    `version:`).

    Missing keys take the YAML defaults of verl's `rollout_correction.yaml` (or, with
    `preset:`, the preset's values and version).

    >>> rc = {"rollout_is": "token", "rollout_rs": "seq_mean_k1"}
    >>> rc["rollout_rs_threshold"] = "0.999_1.001"
    >>> spec = parse({"framework": "verl", "algorithm": {"rollout_correction": rc}})
    >>> spec.is_level, spec.is_upper, spec.rs
    ('token', 2.0, (RSCriterion(option='seq_mean_k1', upper=1.001, lower=0.999),))
    >>> parse({"framework": "verl", "preset": "decoupled_geo_rs"}) == PRESETS["decoupled_geo_rs"]
    True

    Raises:
        ConfigError: an unknown key or preset, a wrong type or value, or a combination verl
            rejects; the message names the key.
    """
    top, name = top_level(config, NAME)
    preset = top.raw("preset", None)
    defaults = _YAML_DEFAULTS
    preset_version = None
    if preset is not None:
        if not isinstance(preset, str) or preset not in PRESETS:
            raise ConfigError(
                f"Expected `preset` to be one of {', '.join(PRESETS)}, but got {quote(preset)}"
            )
        defaults = PRESETS[preset].to_config()["algorithm"]["rollout_correction"]
        preset_version = PRESETS[preset].version
        if config.get("name") is None:
            name = preset
    # A versioned preset brings its version unless the config names one.
    chosen = version(top, (PR6800.name,)) if "version" in config else preset_version
    algorithm = top.section("algorithm")
    correction = algorithm.section("rollout_correction")
    algorithm.done(ignore=_ALGORITHM_SIBLINGS)
    top.done()

    is_level = correction.choice("rollout_is", defaults["rollout_is"], (None, "token", "sequence"))
    threshold = correction.raw("rollout_is_threshold", defaults["rollout_is_threshold"])
    batch_normalize = correction.bool(
        "rollout_is_batch_normalize", defaults["rollout_is_batch_normalize"]
    )
    rs_options = correction.raw("rollout_rs", defaults["rollout_rs"])
    rs_threshold = correction.raw("rollout_rs_threshold", defaults["rollout_rs_threshold"])
    bypass = correction.bool("bypass_mode", defaults["bypass_mode"])
    loss_type = correction.choice("loss_type", defaults["loss_type"], ("ppo_clip", "reinforce"))
    correction.done()

    is_lower = is_upper = None
    if is_level is not None and threshold is not None:
        is_lower, is_upper = _parse_is_threshold(threshold)
    else:
        # verl computes no IS weight unless both `rollout_is` and its threshold are set, and
        # then never reads the threshold or the batch-normalize flag.
        is_level, batch_normalize = None, False
    rs = () if rs_options is None else _parse_rs(rs_options, rs_threshold, chosen)
    return VerlSpec(
        name=name,
        is_level=is_level,
        is_upper=is_upper,
        is_lower=is_lower,
        batch_normalize=batch_normalize,
        rs=rs,
        bypass=bypass,
        loss_type=loss_type,
        version=chosen,
    )


_YAML_DEFAULTS: dict[str, Any] = {
    "rollout_is": None,
    "rollout_is_threshold": 2.0,
    "rollout_is_batch_normalize": False,
    "rollout_rs": None,
    "rollout_rs_threshold": None,
    "bypass_mode": False,
    "loss_type": "ppo_clip",
}
"""`verl/trainer/config/algorithm/rollout_correction.yaml`."""


def _presets() -> dict[str, VerlSpec]:
    """verl's `RolloutCorrectionConfig` classmethods with their default arguments."""
    geo = (RSCriterion("seq_mean_k1", upper=1.001, lower=0.999),)
    k3 = (RSCriterion("seq_mean_k3", upper=0.01),)
    token_tis = {"is_level": "token", "is_upper": 2.0}
    seq_tis = {"is_level": "sequence", "is_upper": 2.0}
    icepop = {"is_level": "token", "is_upper": 5.0, "is_lower": 0.5}
    ppo_clip = {"bypass": True, "loss_type": "ppo_clip"}
    reinforce = {"bypass": True, "loss_type": "reinforce"}
    table: dict[str, dict[str, Any]] = {
        "decoupled_token_is": token_tis,
        "decoupled_seq_is": seq_tis,
        "decoupled_token_icepop": icepop,
        "decoupled_seq_is_rs": {
            **seq_tis,
            "rs": (RSCriterion("seq_sum_k1", upper=2.0, lower=0.5),),
        },
        "decoupled_geo_rs": {"rs": geo},
        "decoupled_geo_rs_seq_tis": {**seq_tis, "rs": geo},
        "decoupled_geo_rs_token_tis": {**token_tis, "rs": geo},
        "decoupled_k3_rs": {"rs": k3},
        "decoupled_k3_rs_seq_tis": {**seq_tis, "rs": k3},
        "decoupled_k3_rs_token_tis": {**token_tis, "rs": k3},
        "bypass_ppo_clip": ppo_clip,
        "bypass_ppo_clip_geo_rs": {**ppo_clip, "rs": geo},
        "bypass_ppo_clip_k3_rs": {**ppo_clip, "rs": k3},
        "bypass_pg_is": {**seq_tis, **reinforce},
        "bypass_pg_token_icepop": {**icepop, **reinforce},
        "bypass_pg_geo_rs": {**reinforce, "rs": geo},
        "bypass_pg_geo_rs_seq_tis": {**seq_tis, **reinforce, "rs": geo},
        "bypass_pg_geo_rs_token_tis": {**token_tis, **reinforce, "rs": geo},
        "disabled": {},
        # PR #6800's classmethod: rollout_is None, so the rejection alone.
        "decoupled_token_kpop_pr6800": {
            "rs": (RSCriterion(KPOP, upper=2.0),),
            "version": PR6800.name,
        },
    }
    return {name: VerlSpec(name=name, **fields) for name, fields in table.items()}


PRESETS: dict[str, VerlSpec] = _presets()
"""verl's named presets (`RolloutCorrectionConfig.<name>()`), selectable with `preset: <name>`;
`decoupled_token_kpop_pr6800` is version pr6800's (the PR's `decoupled_token_kpop()`)."""


# ------------------------------------------------------------------ older config generations


@dataclass(frozen=True, slots=True)
class Generation:
    """One of verl's rollout-correction config generations (docs/corrections.md#verl).

    Args:
        name: "gen0", "gen1", "gen2" or "gen3".
        versions: the verl versions that read this form.
        icepop: whether `rollout_is_threshold` takes "L_U" strings (Gen-3 from v0.8.0).
        loss_key: Gen-2's bypass loss switch: v0.6.1 `use_policy_gradient`, v0.7.0 `loss_type`.
        seq_norm_all: v0.6.1 divides sequence weights by their mean over EVERY sequence,
            fully masked ones counting 0; later versions over sequences with a mask token.
    """

    name: Literal["gen0", "gen1", "gen2", "gen3"]
    versions: str
    icepop: bool = True
    loss_key: Literal["use_policy_gradient", "loss_type"] = "loss_type"
    seq_norm_all: bool = False


_GEN0 = Generation("gen0", "PR #2953, 2025-08-26 to 2025-10-13, untagged")
_GEN1 = Generation("gen1", "v0.6.0")
_GEN2 = Generation("gen2", "v0.7.0")
_GEN3 = Generation("gen3", "v0.8.0 and later (current main)")
GENERATIONS: dict[str, Generation] = {
    "gen0": _GEN0,
    "gen1": _GEN1,
    "v0.6.0": _GEN1,
    "gen2": _GEN2,
    "v0.6.1": Generation("gen2", "v0.6.1", loss_key="use_policy_gradient", seq_norm_all=True),
    "v0.7.0": _GEN2,
    "v0.7.1": Generation("gen3", "v0.7.1", icepop=False),
    "gen3": _GEN3,
    "v0.8.0": _GEN3,
    "v0.9.0": _GEN3,
    "current": _GEN3,
}
"""The generations `to_generation` writes, by name and by the verl version that reads them."""

# The fields of a spec without an IS weight.
_NO_IS: dict[str, Any] = {
    "is_level": None,
    "is_upper": None,
    "is_lower": None,
    "batch_normalize": False,
}
# Every generation before the current one needs rollout log-probs switched on explicitly.
_LOG_PROBS = {"rollout": {"calculate_log_probs": True}}


@dataclass(frozen=True, slots=True)
class GenerationConfig:
    """A setting written in one of verl's config generations.

    Attributes:
        spec: the current-generation setting the config expresses: the input with whatever
            the generation cannot express removed or replaced (see `notes`).
        config: the iscore config (`framework`, `name` and that generation's verl keys).
        notes: one line per thing the generation could not express, and what was done.
        exact: whether the generation computes exactly what `spec` replays (False where it
            only matches up to floating-point details, which `notes` name).
    """

    spec: VerlSpec
    config: dict[str, Any]
    notes: tuple[str, ...]
    exact: bool


def to_generation(spec: VerlSpec, generation: str = "current") -> GenerationConfig:
    """Write `spec` in the keys of an older (or the current) verl config generation.

    Only what the generation can express is written; the rest is dropped or replaced by its
    closest equivalent, one note each.

    >>> out = to_generation(PRESETS["decoupled_token_icepop"], "v0.6.0")
    >>> out.config["algorithm"]["rollout_is_mode"], out.exact
    ('mask', True)
    >>> to_generation(PRESETS["decoupled_geo_rs"], "gen1").notes[0][:40]
    'Gen-1 (v0.6.0) has no rejection sampling'

    Raises:
        ConfigError: an unknown generation.
    """
    gen = GENERATIONS.get(generation)
    if gen is None:
        raise ConfigError(
            f"Expected `generation` to be one of {', '.join(GENERATIONS)}, but got "
            f"{quote(generation)}"
        )
    label = f"Gen-{gen.name[-1]} ({gen.versions})"
    notes: list[str] = []
    exact = True

    def drop(what: str, **changes: Any) -> None:
        nonlocal spec
        notes.append(f"{label} has no {what}; dropped")
        spec = replace(spec, **changes)

    if spec.is_lower is not None and (gen.name in ("gen0", "gen2") or not gen.icepop):
        notes.append(
            f"{label} has no IcePop ('L_U' threshold); written as truncation at the upper "
            f"bound {spec.is_upper!r} (weights below {spec.is_lower!r} are kept, not zeroed)"
        )
        spec = replace(spec, is_lower=None)
    if gen.name in ("gen0", "gen1"):
        if spec.bypass:
            # Bypass PPO-clip only logs its IS weight: decoupled mode would apply it.
            unweighted = {} if spec.applies_is_weight else _NO_IS
            drop(
                "bypass mode (it always recomputes the old log-probs): ratios are taken "
                "against the recompute",
                bypass=False,
                loss_type="ppo_clip",
                **unweighted,
            )
        if spec.rs:
            drop(f"rejection sampling ({_RS_KEY}: {','.join(c.option for c in spec.rs)})", rs=())
        if spec.batch_normalize:
            drop("batch normalization of the IS weights", batch_normalize=False)
    if gen.name == "gen0" and spec.is_level == "sequence":
        notes.append(
            f"{label} weights tokens only: the sequence-level weight becomes a token-level one "
            f"with the same cap {spec.is_upper!r}"
        )
        spec = replace(spec, is_level="token")
    if gen.name == "gen2":
        spec, rs_notes = _gen2_rs(spec, label, gen)
        notes += rs_notes
        exact = not spec.rs  # Gen-2 compares ratios where Gen-3 compares k1 log-ratios
        if gen.seq_norm_all and spec.batch_normalize and spec.is_level == "sequence":
            notes.append(
                f"{label} divides sequence weights by their mean over every sequence of the "
                "batch, fully masked ones counting 0 (later versions skip those)"
            )
            exact = False

    if gen.name != "gen3":
        # Its binary_kl was dropped above: what is left is the pinned release's.
        spec = replace(spec, version=None)
    name = {"framework": NAME, "name": spec.name}
    if gen.name == "gen0":
        cap = spec.is_upper if spec.is_level is not None else -1
        if spec.is_level is not None:
            exact = False
            notes.append(
                f"{label} computes e^d without the later +-20 clamp: a token with log-ratio "
                "below -20 gets e^d, not e^-20; it applies the weight in the vanilla policy "
                "loss only"
            )
        actor = {"actor": {"tis_imp_ratio_cap": cap}, **_LOG_PROBS}
        return GenerationConfig(spec, {**name, "actor_rollout_ref": actor}, tuple(notes), exact)
    if gen.name == "gen1":
        algorithm = {
            "rollout_is": spec.is_level is not None,
            "rollout_is_threshold": spec.is_upper,
            "rollout_is_threshold_lower": spec.is_lower,
            "rollout_is_level": spec.is_level or "token",
            "rollout_is_mode": "truncate" if spec.is_lower is None else "mask",
            # The Gen-1 default (1e-4) zeroes whole sequences; later generations have no veto.
            "rollout_is_veto_threshold": None,
        }
        config = {**name, "algorithm": algorithm, "actor_rollout_ref": _LOG_PROBS}
        return GenerationConfig(spec, config, tuple(notes), exact)
    if gen.name == "gen2":
        return GenerationConfig(spec, _gen2_config(spec, gen, name), tuple(notes), exact)
    return GenerationConfig(spec, spec.to_config(), tuple(notes), exact)


def _gen2_rs(spec: VerlSpec, label: str, gen: Generation) -> tuple[VerlSpec, list[str]]:
    """The one rejection criterion Gen-2 can hold: a k1 band at token / sum / mean level."""
    notes: list[str] = []
    if (
        spec.rs
        and spec.bypass
        and spec.loss_type == "ppo_clip"
        and gen.loss_key == "use_policy_gradient"
    ):
        notes.append(
            f"{label}'s bypass PPO loss does not reject on the current policy; "
            f"{_RS_KEY} dropped (v0.6.1 sets old = rollout and runs the plain PPO loss)"
        )
        return replace(spec, rs=()), notes
    kept = [c for c in spec.rs if c.estimator == "k1" and c.aggregate != "seq_max"][:1]
    for criterion in spec.rs:
        if criterion not in kept:
            notes.append(
                f"{label} takes one ratio-band rejection level (token, sequence, geometric); "
                f"`{criterion.option}` dropped"
            )
    spec = replace(spec, rs=tuple(kept))
    if spec.rs:
        notes.append(
            f"{label} compares the ratio (per token, e^S, e^G, each exponent clamped to +-20 "
            f"after aggregating) where Gen-3's `{spec.rs[0].option}` compares the k1 statistic "
            "of per-token clamped log-ratios: identical unless a token's log-ratio is beyond "
            "+-20 or a ratio falls within rounding of a bound"
        )
    return spec, notes


def _gen2_config(spec: VerlSpec, gen: Generation, name: dict[str, str]) -> dict[str, Any]:
    """Gen-2's `algorithm.rollout_correction` keys for a spec `_gen2_rs` reduced."""
    rs_level = rs_upper = rs_lower = None
    if spec.rs:
        criterion = spec.rs[0]
        rs_level = {"token": "token", "seq_sum": "sequence", "seq_mean": "geometric"}[
            criterion.aggregate
        ]
        # Gen-3 k1 (L, U) keeps ratios in [1/U, 1/L]; Gen-2 writes that band directly.
        rs_lower, rs_upper = criterion.kept_ratio
    correction: dict[str, Any] = {
        "rollout_is": spec.is_level,
        "rollout_is_threshold": spec.is_upper if spec.is_level is not None else 2.0,
        "rollout_is_batch_normalize": spec.batch_normalize,
        "rollout_rs": rs_level,
        "rollout_rs_threshold": rs_upper,
        "rollout_rs_threshold_lower": rs_lower,
        "rollout_token_veto_threshold": None,
        "bypass_mode": spec.bypass,
    }
    if gen.loss_key == "use_policy_gradient":
        correction["use_policy_gradient"] = spec.bypass and spec.loss_type == "reinforce"
    else:
        correction["loss_type"] = spec.loss_type
    return {
        **name,
        "algorithm": {"rollout_correction": correction},
        "actor_rollout_ref": _LOG_PROBS,
    }


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: VerlSpec) -> Canonical:
    numerator: Numerator = "policy" if spec.bypass else "train"
    components: list[Component] = []
    if spec.applies_is_weight:
        zero = None
        if spec.is_lower is not None:
            zero = mask_component(
                spec.is_level, spec.is_lower, spec.is_upper, numerator=numerator, numerics="clamp"
            )
        upper = spec.is_upper if zero is None else None
        components.append(
            weight_component(
                spec.is_level, upper=upper, numerator=numerator, numerics="clamp", zero=zero
            )
        )
        if spec.batch_normalize:
            components.append(normalize_component(spec.is_level))
    levels: dict[str, Level] = {
        "token": "token",
        "seq_sum": "sequence",
        "seq_mean": "geometric",
        "seq_max": "max",
    }
    for criterion in spec.rs:
        level = levels[criterion.aggregate]
        if criterion.estimator == KPOP:
            components.append(
                mask_component(
                    level,
                    None,
                    criterion.upper,
                    statistic=KPOP,
                    numerator=numerator,
                    numerics="float32",
                )
            )
        elif criterion.estimator == "k1":
            # The statistic is -d: log L <= -d <= log U keeps d in [-log U, -log L].
            lower, upper = -math.log(criterion.upper), -math.log(criterion.lower)
            components.append(
                mask_component(
                    level,
                    lower,
                    upper,
                    statistic="log_ratio",
                    numerator=numerator,
                    numerics="clamp_each",
                )
            )
        else:
            components.append(
                mask_component(
                    level,
                    None,
                    criterion.upper,
                    statistic=criterion.estimator,
                    numerator=numerator,
                    numerics="clamp_each",
                )
            )
    anchor: Anchor = "recompute"
    if spec.bypass:
        anchor = "none" if spec.loss_type == "reinforce" else "rollout"
    return Canonical(tuple(components), anchor)


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    bypass = c.anchor != "recompute"
    loss_type = "reinforce" if c.anchor == "none" else "ppo_clip"
    numerator = "policy" if bypass else "train"
    fields: dict[str, Any] = {}
    masks = list(c.masks)
    w = first_weight(c, notes, "verl")
    if w is not None and loss_type == "ppo_clip" and bypass:
        lost(notes, w, "verl's bypass PPO-clip mode applies no IS weight; dropped")
        w = None
    if w is not None:
        note_numerator(notes, w, numerator, "verl")
        level = w.level
        if level not in ("token", "sequence"):
            lost(notes, w, "verl has no geometric-mean weight; written as a token-level weight")
            level = "token"
        fields = {"is_level": level, "is_upper": w.upper, "is_lower": None}
        zero = w.zero
        if zero is not None and ratio_level(zero) != w.level:
            masks.append(zero)
            lost(
                notes,
                zero,
                "verl rejects those sequences (removing them from response_mask, "
                "which its token-mean loss renormalizes) instead of zeroing their weights",
            )
        elif zero is not None:
            lower, upper = ratio_bounds(zero) or (None, None)
            fields |= {"is_lower": lower or TINY, "is_upper": upper or BIG}
            if w.upper is not None and w.upper < fields["is_upper"]:
                lost(
                    notes,
                    w,
                    f"verl's IcePop keeps the raw ratio inside the band; the cap "
                    f"{w.upper:g} is dropped",
                )
            if zero.strict:
                lost(notes, zero, "verl's IcePop bounds are inclusive")
        if fields["is_lower"] is None:
            if w.lower is not None:
                lost(notes, w, f"verl has no lower clamp; weights below {w.lower:g} pass")
            if w.upper is None:
                fields["is_upper"] = BIG
                lost(
                    notes,
                    w,
                    "verl always truncates; a threshold of 1e9, above verl's "
                    "largest ratio e^20, never binds",
                )
    norm = c.normalize
    if norm is not None:
        if not fields:
            lost(notes, norm, "no IS weight to normalize; dropped")
        elif (norm.level == "token") != (fields["is_level"] == "token"):
            lost(notes, norm, "verl normalizes at the IS weight's own level; dropped")
        else:
            fields["batch_normalize"] = True
            if norm.level == "sequence_all":
                lost(notes, norm, "verl's mean skips sequences without a loss token")
    rs: list[RSCriterion] = []
    for m in masks:
        note_numerator(notes, m, numerator, "verl")
        criterion = _verl_criterion(m, notes)
        if criterion is None:
            continue
        if any(x.option == criterion.option for x in rs):
            lost(notes, m, f"verl takes `{criterion.option}` once; dropped")
            continue
        rs.append(criterion)
    note_extras(notes, c, "verl", normalize=True)
    version = None
    if any(x.option == KPOP for x in rs):
        version = PR6800.name
        notes.append(
            f"{KPOP} is verl PR #{PR6800.pr}'s ({PR6800.status}), not in verl's main, which "
            f"refuses it: written for `version: {PR6800.name}`"
        )
    spec = VerlSpec(
        name=name, rs=tuple(rs), bypass=bypass, loss_type=loss_type, version=version, **fields
    )
    return [(spec, tuple(notes))]


def _verl_criterion(m: Component, notes: list[str]) -> RSCriterion | None:
    """The `rollout_rs` criterion closest to a mask."""
    aggregate = {
        "token": "token",
        "sequence": "seq_sum",
        "geometric": "seq_mean",
        "geometric_unmasked": "seq_mean",
        "max": "seq_max",
        "any_token": "seq_max",
    }[m.level]
    if m.level == "geometric_unmasked":
        lost(notes, m, "verl's sequence mean runs over loss tokens only")
    if m.strict:
        lost(notes, m, "verl's bounds are inclusive")
    if m.statistic == KPOP:
        return _kpop_criterion(m, notes)
    if m.statistic in ("k2", "k3") and m.level != "any_token":
        if m.lower is not None:
            lost(notes, m, "verl bounds k2/k3 from above only; the lower bound is dropped")
        return RSCriterion(f"{aggregate}_{m.statistic}", upper=m.upper)
    if m.statistic == "k3_reverse" and m.level != "any_token":
        lost(notes, m, "verl's k3 is e^d - 1 - d, not AReaL's e^-d - 1 + d; same bound used")
        return RSCriterion(f"{aggregate}_k3", upper=m.upper)
    bounds = ratio_bounds(m)
    if bounds is None:
        lost(notes, m, "no verl criterion expresses it; dropped")
        return None
    lower, upper = bounds
    log_lower = math.log(lower) if lower else None
    log_upper = math.log(upper) if upper is not None else None
    if ratio_level(m) == "any_token" or m.level == "max":
        # verl has no max-k1; seq_max_k2 bounds every token's |d| (a symmetric band).
        radius = max(abs(x) for x in (log_lower, log_upper) if x is not None)
        lost(
            notes,
            m,
            f"verl has no per-token k1 over a whole sequence; seq_max_k2 rejects "
            f"sequences with any |log-ratio| > {radius:g}",
        )
        return RSCriterion("seq_max_k2", upper=0.5 * radius * radius)
    # k1 "L'_U'" keeps d in [-log U', -log L']: the sign trap, written the right way round.
    upper_k1 = math.exp(-log_lower) if log_lower is not None else BIG
    lower_k1 = math.exp(-log_upper) if log_upper is not None else 1.0 / BIG
    return RSCriterion(f"{aggregate}_k1", upper=upper_k1, lower=lower_k1)


def _kpop_criterion(m: Component, notes: list[str]) -> RSCriterion | None:
    """Version pr6800's binary_kl, token level with one bound phi > 0."""
    if m.lower is not None:
        lost(notes, m, "verl's binary_kl bounds the statistic from above only")
    if m.upper is None:
        lost(notes, m, "verl's binary_kl takes an upper bound; dropped")
        return None
    upper = m.upper
    if not upper > 0:
        lost(notes, m, f"verl's binary_kl threshold must be > 0; written as {TINY:g}")
        upper = TINY
    return RSCriterion(KPOP, upper=upper)


# ------------------------------------------------------------------ dump adapter


def read_batch(data: Any) -> list[BatchFields]:
    """verl's `DataProto` in `RayPPOTrainer.fit`, once both log-probs exist -> its dump fields.

    Where (verl/trainer/ppo/ray_trainer.py at verl-project/verl@1dda039b): after
    `batch = batch.union(old_log_prob)` (l.1610), best just before the rollout-correction call
    (l.1655-1658): `compute_rollout_correction_and_add_to_batch` multiplies the rejection mask
    INTO `response_mask` (rollout_corr_helper.py l.1061), so a dump taken after it has lost the
    tokens the correction rejected. `token_level_scores` is set at l.1633.

    Read from `data.batch` (a TensorDict of [B, R] tensors, left-aligned, right-padded):
    `rollout_log_probs` (the rollout engine's, agent_loop.py l.124; present with
    `actor_rollout_ref.rollout.calculate_log_probs`), `old_log_probs` (the trainer's recompute,
    ray_trainer.py l.1318), `response_mask` (l.1543-1544), `responses` (token ids, agent_loop.py
    l.119), `advantages` when computed (l.1667), and `token_level_scores` summed per sequence
    as the reward (verl's own `score`, l.527); from `data.non_tensor_batch`: `uid`, the prompt
    group (l.1482). In bypass mode verl recomputes nothing and sets `old_log_probs` to
    `rollout_log_probs` (rollout_corr_helper.py l.1138): refused, there is no mismatch to dump.
    """
    what = "verl's DataProto.batch tensors"
    tensors = _batch.need(data, "batch", "verl's DataProto", "pass the DataProto itself")
    rollout = _batch.need(
        tensors,
        "rollout_log_probs",
        what,
        "verl keeps the rollout engine's log-probs with "
        "actor_rollout_ref.rollout.calculate_log_probs=True",
    )
    train = _batch.need(
        tensors,
        "old_log_probs",
        what,
        "call add_batch after the old-log-prob recompute (ray_trainer.py l.1610)",
    )
    if _batch.same_tensor(train, rollout):
        raise DumpError(
            "verl's old_log_probs are its rollout_log_probs (bypass_mode: verl recomputes no "
            "trainer log-probs), so there is no mismatch to dump; dump with bypass_mode: false"
        )
    scores = _batch.field(tensors, "token_level_scores")
    groups = _batch.field(_batch.field(data, "non_tensor_batch") or {}, "uid")
    return [
        BatchFields(
            rollout,
            train,
            mask=_batch.need(
                tensors, "response_mask", what, "verl sets it at ray_trainer.py l.1544"
            ),
            advantages=_batch.field(tensors, "advantages"),
            token_ids=_batch.field(tensors, "responses"),
            rewards=None if scores is None else scores.sum(-1),
            group_ids=groups,
        )
    ]


# ------------------------------------------------------------------ the framework


def _aggregation(spec: VerlSpec) -> Aggregation:
    # token-mean; decoupled rejection sampling rewrites response_mask before the token count.
    return Aggregation("token-mean", shrinks=not spec.bypass)


_HEALTH = Citation(
    "verl docs, Rollout Correction: check_rollout_correction_health",
    "https://github.com/verl-project/verl/blob/main/docs/algo/rollout_corr.md",
)
BANDS = (
    HealthBand(
        "ratio_mean",
        0.5,
        2.0,
        "rollout_corr/rollout_is_mean",
        "far from 1.0: a significant off-policy gap (verl measures it on its capped weights; "
        "iscore on the raw ratios)",
        _HEALTH,
    ),
    HealthBand(
        "ess",
        0.3,
        None,
        "rollout_corr/rollout_is_eff_sample_size",
        "too low: the weight is concentrated on few tokens (verl measures it on its capped "
        "weights; iscore on the raw ratios)",
        _HEALTH,
    ),
    HealthBand(
        "k1",
        -0.1,
        0.1,
        "rollout_corr/kl",
        "|kl| above 0.1: a significant off-policy gap",
        _HEALTH,
    ),
    HealthBand(
        "chi2_token",
        None,
        1.0,
        "rollout_corr/chi2_token",
        "above 1: a severe distribution shift",
        _HEALTH,
    ),
)
"""The health checks of verl's Rollout Correction guide (its example
`check_rollout_correction_health`): mean IS weight in [0.5, 2], ESS >= 0.3, |kl| <= 0.1,
chi2_token <= 1. The guide's IS-weight std <= 1 is left out: with a mean of 1 it is
sqrt(chi2_token), the same check."""


FRAMEWORK = Framework(
    name=NAME,
    title="verl",
    upstream=Upstream(
        "verl-project/verl", "1dda039b9c6311889a9c9a26040677e1254814f9", "2026-08-22"
    ),
    spec_types=(VerlSpec,),
    parse=parse,
    presets=lambda: PRESETS,
    default="decoupled_token_is",
    versions=(PR6800,),
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=snippets.nested,
    aggregation=_aggregation,
    families=frozenset(
        {"token_tis", "icepop", "seq_tis", "geometric_mask", "product_mask", "k3_mask"}
    ),
    columns={  # DataProto keys (ray_trainer.py); uid names a prompt's group of responses
        "rollout_logprob": ("rollout_log_probs",),
        "train_logprob": ("old_log_probs",),
        "loss_mask": ("response_mask",),
        "group_id": ("uid",),
    },
    metrics={
        "k1": ("rollout_corr/kl",),
        "k3": ("rollout_corr/k3_kl",),
        "chi2_token": ("rollout_corr/chi2_token",),
        "chi2_seq": ("rollout_corr/chi2_seq",),
        "log_ppl_diff": ("rollout_corr/log_ppl_diff",),
        "log_ppl_abs_diff": ("rollout_corr/log_ppl_abs_diff",),
        "ppl_ratio": ("rollout_corr/ppl_ratio",),
        "training_ppl": ("rollout_corr/training_ppl",),
        "rollout_ppl": ("rollout_corr/rollout_ppl",),
        "ratio_mean": ("rollout_corr/rollout_is_mean (of its capped weights)",),
        "ess": ("rollout_corr/rollout_is_eff_sample_size (of its capped weights)",),
    },
    bands=BANDS,
    traps=(
        Trap(
            "k1-reciprocal-bounds",
            "verl's k1 rejection (token_k1/seq_*_k1) keeps ratios in [1/U, 1/L], not [L, U]: "
            'asymmetric bounds such as "0.5_1.5" keep [0.667, 2.0]. The geometric candidates '
            "here already account for it.",
        ),
    ),
    comments=_comments,
    generations=tuple(GENERATIONS),
    to_generation=to_generation,
    read_batch=read_batch,
)
