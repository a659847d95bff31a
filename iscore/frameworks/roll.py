"""ROLL: the train-inference correction `train_infer_correction` (alibaba/ROLL).

Source read: `alibaba/ROLL` @ 8eb27cc2 (2026-08-19), identical for this correction to v0.3.0
(`7f9d4d38`, 2026-06-18): `roll/utils/train_infer_corrections.py`
(`_compute_all_granularity`, `compute_train_infer_correction`,
`apply_train_infer_correction_to_batch`), its config dataclasses in `roll/configs/base_config.py`
(`TrainInferISWeightConfig` l.425, `TrainInferFilterConfig` l.445, `TrainInferCorrectionConfig`
l.471, `PPOConfig.loss_agg_mode` l.571, `enable_old_logprobs_recompute` l.578), the segment mean
`compute_segment_masked_mean` (`roll/pipeline/agentic/utils.py` l.336), `agg_loss` /
`masked_mean` / `masked_sum` (`roll/utils/functionals.py` l.229-297), the loss functions of
`roll/pipeline/rlvr/actor_worker.py` (and `actor_pg_worker.py`, the agentic twins) and
`get_old_log_probs_with_cache` (`roll/pipeline/base_worker.py` l.173).

What ROLL computes, in its order, with d = old_log_probs - infer_logprobs per token and
dp = e^{old} - e^{infer} (the probability difference), over the response mask m:

1. At four levels (`_compute_all_granularity`): the ratio e^d and dp per token; "geometric"
   e^{G} with G the masked mean of d, and the masked mean of dp; "sequence" e^{S} with S the
   masked SUM of d, and the masked SUM of dp; "segment", per contiguous run of m (a multi-turn
   sequence's turns), e^{mean d over the run} and the mean dp over the run. No clamp anywhere
   (no +-20 on the exponent).
2. `is_weight.enabled`: w = the ratio at `weight_type`, clamped to [0, `upper_bound`] unless
   the bound is null (then raw, possibly inf). Disabled: w = 1 and the loss is not multiplied.
3. Every enabled filter, in order, multiplies a filter mask by 1[`ratio_low` <= ratio <=
   `ratio_high`] (if `ratio_enabled`) and 1[`diff_low` <= dp <= `diff_high`] (if
   `diff_enabled`), both at `agg_type` and inclusive; the result multiplies the response masks.
4. The PPO (or `pg_variant`) loss is multiplied by w and aggregated by `loss_agg_mode`.

Where ROLL's description (/work/shared/reference/upstream.md, the spec) and its code differ, or
the spec is silent, the code is followed (docs/corrections.md#roll):

- Without `enable_old_logprobs_recompute` the correction runs inside the loss, and
  `old_log_probs` is the loss's own first forward, detached (l_old = sg(l_theta)); the denominators
  (`batch_num_tokens`, `global_valid_samples`) were counted before the filters. With it, the
  pipeline filters the masks BEFORE the training step counts them, so rejected tokens (and
  sequences left without one) leave the denominators.
- Without the recompute and with `loss_agg_mode: token-mean`, the filters do not act on the
  policy-gradient term: ROLL's token-mean `agg_loss` sums the loss matrix without applying the
  mask (functionals.py l.254-256), and the log-probs are masked by the unfiltered
  `response_mask`; the filtered mask reaches only the KL term. The replay then keeps every
  loss token (keep = the loss mask), weighted by w.
- `detach` changes nothing: w is built from `old_log_probs` and `infer_logprobs`, which carry
  no gradient on either path.
- ROLL validates none of the bounds (a zero or negative `upper_bound` zeroes every weight, an
  inverted band drops every token): here `upper_bound` must be > 0 or null and, for the bands
  an enabled filter applies, `ratio_low <= ratio_high` and `diff_low <= diff_high`; NaN is
  refused. Ints and numeric strings are read as numbers.
- ROLL computes in float32 (d as a float32 difference, float32 masked sums, `masked_mean` as
  sum / (count + 1e-8), which float32 rounds to sum / count) and compares float32 values with
  the bounds; the replay uses the exact float64 d, dp and sums.
- ROLL reads its config with dacite, which ignores keys its dataclasses lack: so does `parse`,
  with a warning naming them.
- A sequence's segments are the runs of its loss mask among the tokens the dump holds: a dump
  that drops the masked tokens between turns (an environment's observation) joins the turns.

Config: `train_infer_correction: {is_weight: {enabled, weight_type, upper_bound, detach},
filters: [{enabled, agg_type, ratio_enabled, ratio_low, ratio_high, diff_enabled, diff_low,
diff_high}, ...]}` with ROLL's defaults, and two of ROLL's pipeline keys beside it that decide
what the correction does to the loss: `loss_agg_mode` (default "seq-mean-token-mean") and
`enable_old_logprobs_recompute` (default false; ROLL turns it on itself when a step takes several
backward passes per rank or `init_kl_coef` > 0, so give the value the run logged).

Metrics ROLL logs (always, for every level): `actor/train_infer_{ratio,diff}_{level}_mean@sum`
(the sequence mean of token means); with a bound, `actor/is_weight_clipfrac@sum`; per enabled
filter `actor/train_infer_{level}_{ratio,diff}_mask_mean@sum`; with any filter listed,
`actor/train_infer_final_mask_mean`. The clip fraction and the mask rates are token-mean
`agg_loss` values, so they sum over every position of the padded rows (prompt and padding
included, where a per-token ratio is 1 and dp 0 but a sequence-level value is broadcast) over
the loss-token count: they can exceed 1. ROLL writes no dump of both log-probs (its
`dump_rollout_trajectories` writes text columns), so iscore has no reader for one.

>>> import torch
>>> from iscore.packed.batch import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -1.0, -1.0]), train=torch.tensor([-0.5, -1.0, -2.0]),
...                cu_seqlens=torch.tensor([0, 3]))
>>> spec = parse({"framework": "roll", "train_infer_correction": {"is_weight": {"enabled": True}}})
>>> [round(w, 4) for w in spec.replay(b).weight.tolist()]
[1.2, 1.0, 0.3679]
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, ClassVar, Literal

import torch

from iscore.errors import ConfigError, quote
from iscore.frameworks import snippets
from iscore.frameworks._config import Section, check_bool, check_choice, check_number, nearest
from iscore.frameworks._config import top_level as read_top_level
from iscore.frameworks.base import Aggregation, Framework, Trap, Upstream
from iscore.frameworks.canonical import (
    Canonical,
    Component,
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
from iscore.frameworks.canonical import Level as CanonicalLevel
from iscore.frameworks.spec import Replay, per_token
from iscore.packed import TokenBatch, ops

NAME = "roll"

Level = Literal["token", "segment", "geometric", "sequence"]
LEVELS: tuple[str, ...] = ("token", "segment", "geometric", "sequence")
LossAggMode = Literal[
    "token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"
]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

_KEY = "train_infer_correction"
_RECOMPUTE = "enable_old_logprobs_recompute"
# ROLL's levels in the canonical form's terms: the same names, one for one.
_CANONICAL_LEVEL: dict[str, CanonicalLevel] = {
    "token": "token",
    "segment": "segment",
    "geometric": "geometric",
    "sequence": "sequence",
}


@dataclass(frozen=True, slots=True)
class ISWeight:
    """`train_infer_correction.is_weight` (ROLL's `TrainInferISWeightConfig`).

    Args:
        enabled: multiply the loss by the weight.
        weight_type: the ratio's level: token, segment, geometric or sequence.
        upper_bound: w = clamp(ratio, 0, upper_bound); None leaves the ratio unbounded.
        detach: ROLL's flag; w carries no gradient either way.
    """

    enabled: bool = False
    weight_type: Level = "token"
    upper_bound: float | None = 1.2
    detach: bool = True

    def __post_init__(self) -> None:
        key = f"{_KEY}.is_weight.{{}}".format
        check_bool(key("enabled"), self.enabled)
        check_bool(key("detach"), self.detach)
        check_choice(key("weight_type"), self.weight_type, LEVELS)
        check_number(key("upper_bound"), self.upper_bound, gt=0.0, nullable=True)
        if self.upper_bound is not None:
            object.__setattr__(self, "upper_bound", float(self.upper_bound))


@dataclass(frozen=True, slots=True)
class Filter:
    """One entry of `train_infer_correction.filters` (ROLL's `TrainInferFilterConfig`).

    Args:
        enabled: apply this filter.
        agg_type: the level of its ratio and probability difference.
        ratio_enabled: keep tokens with ratio_low <= ratio <= ratio_high.
        ratio_low, ratio_high: the ratio band (inclusive).
        diff_enabled: keep tokens with diff_low <= dp <= diff_high.
        diff_low, diff_high: the band on dp = e^{old} - e^{infer} (per token, the mean for
            geometric and segment, the SUM for sequence).
    """

    enabled: bool = False
    agg_type: Level = "token"
    ratio_enabled: bool = True
    ratio_low: float = 0.8
    ratio_high: float = 1.2
    diff_enabled: bool = False
    diff_low: float = -0.2
    diff_high: float = 0.2

    def __post_init__(self) -> None:
        key = f"{_KEY}.filters[].{{}}".format
        for flag in ("enabled", "ratio_enabled", "diff_enabled"):
            check_bool(key(flag), getattr(self, flag))
        check_choice(key("agg_type"), self.agg_type, LEVELS)
        for bound in ("ratio_low", "ratio_high", "diff_low", "diff_high"):
            check_number(key(bound), getattr(self, bound))
            object.__setattr__(self, bound, float(getattr(self, bound)))
        for band, used in (("ratio", self.ratio_enabled), ("diff", self.diff_enabled)):
            low, high = getattr(self, f"{band}_low"), getattr(self, f"{band}_high")
            if self.enabled and used and low > high:
                raise ConfigError(
                    f"Expected `{key(band + '_low')}` <= `{key(band + '_high')}` "
                    f"({quote(high)}), but got {quote(low)} (ROLL does not check it; the filter "
                    "would drop every token)"
                )

    @property
    def bands(self) -> tuple[tuple[Literal["ratio", "diff"], float, float], ...]:
        """The bands this filter applies: (what, low, high); none when disabled."""
        if not self.enabled:
            return ()
        out: list[tuple[Literal["ratio", "diff"], float, float]] = []
        if self.ratio_enabled:
            out.append(("ratio", self.ratio_low, self.ratio_high))
        if self.diff_enabled:
            out.append(("diff", self.diff_low, self.diff_high))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class RollSpec:
    """A validated ROLL `train_infer_correction` setting.

    Args:
        name: display name.
        is_weight: the IS weight.
        filters: the filters, in config order (disabled ones kept, as ROLL keeps them).
        loss_agg_mode: ROLL's `loss_agg_mode`.
        recompute: `enable_old_logprobs_recompute`: the pipeline filters before the training
            step (denominators shrink); without it the loss does, after counting them.

    >>> spec = RollSpec(is_weight=ISWeight(enabled=True, weight_type="geometric"))
    >>> spec.to_config()["train_infer_correction"]["is_weight"]["weight_type"]
    'geometric'
    """

    framework: ClassVar[str] = NAME

    name: str = NAME
    is_weight: ISWeight = ISWeight()
    filters: tuple[Filter, ...] = ()
    loss_agg_mode: LossAggMode = "seq-mean-token-mean"
    recompute: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str):
            raise ConfigError(f"Expected `name` to be a string, but got {quote(self.name)}")
        if not isinstance(self.is_weight, ISWeight):
            raise ConfigError(
                f"Expected `is_weight` to be an ISWeight, but got {quote(self.is_weight)}"
            )
        filters = tuple(self.filters)
        if not all(isinstance(f, Filter) for f in filters):
            raise ConfigError(
                f"Expected `filters` to be Filter values, but got {quote(self.filters)}"
            )
        object.__setattr__(self, "filters", filters)
        check_choice("loss_agg_mode", self.loss_agg_mode, LOSS_AGG_MODES)
        check_bool(_RECOMPUTE, self.recompute)

    @property
    def filters_apply(self) -> bool:
        """Whether the filters remove tokens from the policy-gradient term: not under
        token-mean without the recompute (ROLL's token-mean sums the unmasked loss there)."""
        return self.recompute or self.loss_agg_mode != "token-mean"

    def to_config(self) -> dict[str, Any]:
        """The iscore config: `framework`, `name`, ROLL's `train_infer_correction` (every
        key) and the two pipeline keys; the inverse of `parse`."""
        return {
            "framework": NAME,
            "name": self.name,
            _KEY: {
                "is_weight": asdict(self.is_weight),
                "filters": [asdict(f) for f in self.filters],
            },
            "loss_agg_mode": self.loss_agg_mode,
            _RECOMPUTE: self.recompute,
        }

    def replay(self, batch: TokenBatch) -> Replay:
        """Per-token weight and keep as ROLL's loss applies them (see the module docstring).

        `raw` is the ratio at the weight's level (per token without a weight); `seq_raw` and
        `seq_weight` are set for geometric and sequence weights.
        """
        stats = _Levels(batch)
        keep = batch.loss_mask
        if self.filters_apply:
            for f in self.filters:
                for what, low, high in f.bands:
                    value = stats.ratio(f.agg_type) if what == "ratio" else stats.diff(f.agg_type)
                    keep = keep & ops.band(value, low, high)
        w = self.is_weight
        if not w.enabled:
            ratio = stats.ratio("token")
            return Replay.build(batch, torch.ones_like(ratio), keep, ratio)
        if w.weight_type in ("token", "segment"):
            raw = stats.ratio(w.weight_type)
            return Replay.build(batch, ops.truncate(raw, 0.0, w.upper_bound), keep, raw)
        seq_raw = stats.seq_ratio(w.weight_type)
        seq_weight = ops.truncate(seq_raw, 0.0, w.upper_bound)
        return Replay.build(
            batch,
            per_token(seq_weight, batch),
            keep,
            per_token(seq_raw, batch),
            seq_raw=seq_raw,
            seq_weight=seq_weight,
        )


class _Levels:
    """d and dp of a batch at ROLL's four levels, each computed once (float64, no clamp)."""

    def __init__(self, batch: TokenBatch):
        self.batch = batch
        self.d = ops.log_ratio(batch, "train")
        self._dp: torch.Tensor | None = None
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    @property
    def dp(self) -> torch.Tensor:
        """float64 [N] e^{train} - e^{rollout}."""
        if self._dp is None:
            b = self.batch
            self._dp = b.train.double().exp() - b.rollout.double().exp()
        return self._dp

    def _reduced(self, what: str, level: str) -> torch.Tensor:
        """float64 [B] (geometric: mean, sequence: sum) or [N] (token, segment)."""
        key = (what, level)
        if key not in self._cache:
            x = self.d if what == "d" else self.dp
            mask = self.batch.loss_mask
            if level == "token":
                value = x
            elif level == "segment":
                value = _segment_mean(x, self.batch)
            elif level == "geometric":
                value = ops.segment_mean(x, self.batch, mask)
            else:
                value = ops.segment_sum(x, self.batch, mask)
            self._cache[key] = value
        return self._cache[key]

    def seq_ratio(self, level: str) -> torch.Tensor:
        """float64 [B] e^G (geometric) or e^S (sequence)."""
        return ops.exp(self._reduced("d", level), bound=None)

    def ratio(self, level: str) -> torch.Tensor:
        """float64 [N] the ratio at `level`, per token."""
        if level in ("geometric", "sequence"):
            return ops.broadcast(self.seq_ratio(level), self.batch)
        return ops.exp(self._reduced("d", level), bound=None)

    def diff(self, level: str) -> torch.Tensor:
        """float64 [N] the probability difference at `level`, per token."""
        value = self._reduced("dp", level)
        return ops.broadcast(value, self.batch) if level in ("geometric", "sequence") else value


def _segment_mean(x: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
    """float64 [N]: at each loss token, the mean of x over its run of consecutive loss tokens
    within its sequence (ROLL's `compute_segment_masked_mean`); 0 at the other tokens."""
    mask = batch.loss_mask
    out = torch.zeros(batch.num_tokens, dtype=torch.float64, device=x.device)
    if not bool(mask.any()):
        return out
    starts = mask.clone()
    starts[1:] &= ~mask[:-1]
    # A sequence's first token opens a run even when the previous sequence ends in one.
    firsts = batch.cu_seqlens[:-1][batch.lengths > 0].to(mask.device)
    starts[firsts] = mask[firsts]
    run = torch.cumsum(starts, 0) - 1
    index = run[mask]
    runs = int(index.max()) + 1
    values = x[mask].double()
    sums = torch.zeros(runs, dtype=torch.float64, device=x.device).index_add_(0, index, values)
    counts = torch.zeros(runs, dtype=torch.float64, device=x.device).index_add_(
        0, index, torch.ones_like(values)
    )
    out[mask] = (sums / counts)[index]
    return out


# ------------------------------------------------------------------ parse


def _warn_ignored(section: Section) -> None:
    """ROLL's dacite ignores keys its dataclasses lack: warn, naming them (and a near key)."""
    unknown = [k for k in section.data if k not in section.read]
    if unknown:
        listed = ", ".join(f"`{section.key(str(k))}`{nearest(k, section.read)}" for k in unknown)
        warnings.warn(
            f"ROLL ignores key{'s' * (len(unknown) > 1)} {listed}, as iscore does (it reads "
            f"{', '.join(sorted(section.read))})",
            UserWarning,
            stacklevel=3,
        )


def _parse_is_weight(section: Section) -> ISWeight:
    d = ISWeight()
    fields = {
        "enabled": section.bool("enabled", d.enabled),
        "weight_type": section.choice("weight_type", d.weight_type, LEVELS),
        "upper_bound": section.float("upper_bound", d.upper_bound, gt=0.0, nullable=True),
        "detach": section.bool("detach", d.detach),
    }
    _warn_ignored(section)
    return ISWeight(**fields)


def _parse_filters(value: Any, path: str) -> tuple[Filter, ...]:
    if not isinstance(value, Sequence) or isinstance(value, str):
        raise ConfigError(
            f"Expected `{path}` to be a list of filter mappings, but got {quote(value)}"
        )
    filters = []
    d = Filter()
    for i, entry in enumerate(value):
        section = Section(entry, f"{path}[{i}]")
        fields: dict[str, Any] = {"agg_type": section.choice("agg_type", d.agg_type, LEVELS)}
        for flag in ("enabled", "ratio_enabled", "diff_enabled"):
            fields[flag] = section.bool(flag, getattr(d, flag))
        for bound in ("ratio_low", "ratio_high", "diff_low", "diff_high"):
            fields[bound] = section.float(bound, getattr(d, bound))
        _warn_ignored(section)
        try:
            filters.append(Filter(**fields))
        except ConfigError as e:
            raise ConfigError(str(e).replace("filters[]", f"filters[{i}]", 1)) from None
    return tuple(filters)


def parse(config: Mapping[str, Any]) -> RollSpec:
    """Parse a ROLL config (plus `framework: roll` and an optional `name:`).

    Missing keys take ROLL's dataclass defaults; keys ROLL does not read are ignored with a
    warning, as ROLL ignores them.

    >>> spec = parse({"framework": "roll", "train_infer_correction": {"filters": [
    ...     {"enabled": True, "agg_type": "segment", "diff_enabled": True}]}})
    >>> spec.filters[0].bands
    (('ratio', 0.8, 1.2), ('diff', -0.2, 0.2))

    Raises:
        ConfigError: a wrong type or value; the message names the key.
    """
    top, name = read_top_level(config, NAME)
    correction = top.section(_KEY)
    is_weight = _parse_is_weight(correction.section("is_weight"))
    filters = _parse_filters(correction.raw("filters", []), correction.key("filters"))
    _warn_ignored(correction)
    loss_agg_mode = top.choice("loss_agg_mode", "seq-mean-token-mean", LOSS_AGG_MODES)
    recompute = top.bool(_RECOMPUTE, False)
    _warn_ignored(top)
    return RollSpec(
        name=name,
        is_weight=is_weight,
        filters=filters,
        loss_agg_mode=loss_agg_mode,
        recompute=recompute,
    )


def _presets() -> dict[str, RollSpec]:
    """ROLL's defaults, the weight at each of its levels and its example's filter."""
    table: dict[str, dict[str, Any]] = {
        # TrainInferCorrectionConfig(): metrics only, nothing applied.
        "roll_disabled": {},
        # is_weight.enabled with the dataclass's other defaults: token, upper_bound 1.2.
        "roll_token_is": {"is_weight": ISWeight(enabled=True)},
        "roll_segment_is": {"is_weight": ISWeight(enabled=True, weight_type="segment")},
        "roll_geometric_is": {"is_weight": ISWeight(enabled=True, weight_type="geometric")},
        "roll_sequence_is": {"is_weight": ISWeight(enabled=True, weight_type="sequence")},
        # One filter with the dataclass's defaults: a token ratio band [0.8, 1.2].
        "roll_token_filter": {"filters": (Filter(enabled=True),)},
        # examples/qwen2.5-0.5B-agentic/agent_val_frozen_lake-pg_var_is_correct.yaml l.66-76.
        "roll_frozen_lake_segment_filter": {
            "filters": (
                Filter(
                    enabled=True,
                    agg_type="segment",
                    ratio_high=1.05,
                    diff_enabled=True,
                    diff_low=-0.1,
                    diff_high=0.1,
                ),
            ),
            "recompute": True,
        },
    }
    return {name: RollSpec(name=name, **fields) for name, fields in table.items()}


PRESETS: dict[str, RollSpec] = _presets()
"""ROLL's settings: its defaults (nothing applied), the IS weight switched on at each of its
four levels with the default bound 1.2, one default filter, and its only shipped example (the
FrozenLake agentic config: a segment filter on ratio and dp, with the recompute)."""


# ------------------------------------------------------------------ canonical form


def to_canonical(spec: RollSpec) -> Canonical:
    components: list[Component] = []
    w = spec.is_weight
    if w.enabled:
        # clamp(min=0) bounds nothing: a ratio is never negative.
        components.append(weight_component(_CANONICAL_LEVEL[w.weight_type], upper=w.upper_bound))
    if spec.filters_apply:
        for f in spec.filters:
            level = _CANONICAL_LEVEL[f.agg_type]
            for what, low, high in f.bands:
                statistic = "ratio" if what == "ratio" else "prob_diff"
                components.append(mask_component(level, low, high, statistic=statistic))
    return Canonical(tuple(components))


def from_canonical(c: Canonical, name: str) -> list[Translation]:
    notes: list[str] = []
    if c.anchor != "recompute":
        notes.append(
            "ROLL's PPO ratio is anchored on old_log_probs (the recompute, or the loss's own "
            "first forward); the source's anchor is not expressible"
        )
    is_weight = ISWeight()
    masks = list(c.masks)
    w = first_weight(c, notes, "ROLL")
    if w is not None:
        note_numerator(notes, w, "train", "ROLL")
        is_weight = ISWeight(enabled=True, weight_type=_roll_level(w, notes), upper_bound=w.upper)
        if w.lower is not None:
            lost(notes, w, f"ROLL clamps weights below at 0 only; weights below {w.lower:g} pass")
        if w.zero is not None:
            masks.append(w.zero)
            lost(
                notes,
                w.zero,
                "ROLL removes those tokens from the loss mask (a filter) instead of zeroing "
                "their weights",
            )
    filters = tuple(f for m in masks if (f := _roll_filter(m, notes)) is not None)
    note_extras(notes, c, "ROLL")
    return [(RollSpec(name=name, is_weight=is_weight, filters=filters), tuple(notes))]


def _roll_level(c: Component, notes: list[str]) -> Level:
    """ROLL's level closest to a component's."""
    level = ratio_level(c) if c.role == "mask" else c.level
    if level in LEVELS:
        return level  # type: ignore[return-value]
    if level == "geometric_unmasked":
        lost(notes, c, "ROLL's geometric mean runs over loss tokens only")
    else:
        lost(notes, c, "ROLL has no such level; written at the geometric level")
    return "geometric"


def _roll_filter(m: Component, notes: list[str]) -> Filter | None:
    """The ROLL filter closest to a mask: a ratio band, or a band on dp."""
    note_numerator(notes, m, "train", "ROLL")
    if m.strict:
        lost(notes, m, "ROLL's bounds are inclusive")
    if m.statistic == "prob_diff":
        if m.by_advantage:  # prime-rl's DPPO band; ROLL's own bands have none
            lost(notes, m, "ROLL's diff band does not depend on the advantage's sign; dropped")
            return None
        low = -math.inf if m.lower is None else m.lower
        high = math.inf if m.upper is None else m.upper
        return Filter(
            enabled=True,
            agg_type=_roll_level(m, notes),
            ratio_enabled=False,
            diff_enabled=True,
            diff_low=low,
            diff_high=high,
        )
    bounds = ratio_bounds(m)
    if bounds is None or ratio_level(m) in ("any_token", "max"):
        lost(notes, m, "no ROLL filter expresses it (a band on a level's ratio or dp); dropped")
        return None
    low, high = bounds
    return Filter(
        enabled=True,
        agg_type=_roll_level(m, notes),
        ratio_low=0.0 if low is None else low,
        ratio_high=math.inf if high is None else high,
    )


# ------------------------------------------------------------------ the framework


def _aggregation(spec: RollSpec) -> Aggregation:
    # seq-mean-token-sum-norm divides by a constant (the padded length): its LR scale is
    # seq-mean-token-sum's. A per-sequence token mean runs over the filtered mask on both
    # paths; a token-mean's count is taken after the filters only with the recompute.
    mode = "seq-mean-token-sum" if spec.loss_agg_mode.endswith("sum-norm") else spec.loss_agg_mode
    shrinks = spec.recompute if mode == "token-mean" else mode == "seq-mean-token-mean"
    return Aggregation(mode, shrinks=shrinks)  # type: ignore[arg-type]


FRAMEWORK = Framework(
    name=NAME,
    title="ROLL",
    upstream=Upstream("alibaba/ROLL", "8eb27cc2dc34c4d1310b169d9b86d339004d811a", "2026-08-19"),
    spec_types=(RollSpec,),
    parse=parse,
    presets=lambda: PRESETS,
    default="roll_frozen_lake_segment_filter",
    to_canonical=to_canonical,
    from_canonical=from_canonical,
    render=lambda body, fmt: snippets.yaml_text(body),
    aggregation=_aggregation,
    families=frozenset({"token_tis", "seq_tis", "geometric_mask", "product_mask"}),
    segments=True,
    columns={  # ROLL's DataProto keys
        "rollout_logprob": ("infer_logprobs",),
    },
    metrics={
        "ratio_mean": ("actor/train_infer_ratio_token_mean@sum (sequence-averaged)",),
    },
    traps=(
        Trap(
            "unknown-keys-ignored",
            "ROLL ignores config keys its dataclasses lack (dacite), so a misspelt key such as "
            "`upper_bond` silently keeps the default; iscore warns about each one.",
        ),
        Trap(
            "no-exponent-clamp",
            "ROLL exponentiates the token, segment, geometric and sequence log-ratios without "
            "any clamp: with `upper_bound: null` a sequence weight e^S overflows to inf.",
        ),
        Trap(
            "segment-is-a-turn",
            'ROLL\'s "segment" level is each contiguous run of the loss mask (a multi-turn '
            "sequence's turns), not the whole sequence; a dump without the masked tokens "
            "between turns joins them.",
        ),
        Trap(
            "sequence-diff-is-a-sum",
            "At the sequence level ROLL's probability-difference filter bounds the SUM of "
            "e^old - e^infer over the sequence (the geometric and segment levels bound its "
            "mean), so a diff band of +-0.2 rejects most long sequences.",
        ),
        Trap(
            "old-is-the-current-policy",
            "Without `enable_old_logprobs_recompute` ROLL takes old_log_probs from the loss's "
            "own first forward (detached), so the ratio compares the training-mode forward with "
            "the rollout; iscore replays the dump's train_logprob.",
        ),
        Trap(
            "token-mean-ignores-filters",
            "Without `enable_old_logprobs_recompute`, `loss_agg_mode: token-mean` sums the "
            "unmasked policy loss, so the filters remove nothing from the policy-gradient "
            "term (only from the KL term).",
        ),
    ),
    snippet_formats=("yaml",),
)
