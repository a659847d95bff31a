"""What one correction setting does to a dump: weights, masks and the effective learning rate.

`SettingStats` is a streaming accumulator over (batch, replay) pairs. Token-level distributions
are kept as mergeable log-histograms; everything else is summed per sequence as chunks arrive and
computed at the end, so a dump read in chunks gives the numbers of the dump read whole.

Definitions (all over loss tokens, i.e. loss_mask true; w = `Replay.weight`, the factor that
multiplies a token's loss, 0 where a mask drops it; raw = `Replay.raw`):

- `weight_mean`: <w>_tok; `weight_mean_seq`: mean over sequences of each one's <w>.
- `ess`: (sum w)^2 / (n sum w^2), the effective sample size as a fraction of the tokens (verl's
  `rollout_is_eff_sample_size`, except that masked tokens count here with weight 0).
- `truncated_high_fraction` / `truncated_low_fraction`: tokens whose weight truncation lowered /
  raised below / above raw (batch normalization, which rescales all, is not counted; settings
  that apply no weight at all, only masks, truncate nothing).
- `token_masked_fraction`: tokens with w = 0 (dropped by a mask or zeroed by an IcePop-style
  band); `token_rejected_fraction`: those removed from the loss mask (keep false), which also
  leave the denominator where the framework recounts it; `seq_masked_fraction`: sequences all of
  whose loss tokens have w = 0.
- `lr_scale`: the corrected loss gradient's scale relative to the uncorrected one, under the
  framework's loss aggregation (docs/corrections.md#loss-aggregation): token-mean sum(w) / n
  (or / kept tokens where rejection shrinks the denominator); seq-mean-token-mean mean over
  sequences of sum(w) / T; seq-mean-token-sum sum(w) / sum(T). 1 means the setting leaves the
  step size alone.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from iscore import frameworks
from iscore.frameworks import Aggregation, Replay, Spec
from iscore.packed import TokenBatch, kernels, ops
from iscore.stats.histogram import (
    Binned,
    LogHistogram,
    bin_values,
    bucket_label,
    checked,
    plot_resolution,
)

QUANTILES = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999)

TRUNCATION_TOLERANCE = 1e-6
"""Relative: a weight that differs from its raw ratio by less was not truncated (float32)."""


def aggregation_of(spec: Spec) -> Aggregation:
    """The loss aggregation a setting trains with: its framework's default, refined by whatever
    the setting's own config says (NeMo-RL `token_level_loss`, TRL `loss_type`, slime
    `--calculate-per-token-loss`, OpenRLHF's GSPO)."""
    return frameworks.of(spec).aggregation(spec)


# Per-sequence sums collected from each chunk.
_SEQ_FIELDS = ("T", "w", "w2", "kept", "nonzero", "high", "low", "raw_log")


@dataclass(slots=True)
class SettingStats:
    """Streaming accumulator of what one setting does to a dump.

    >>> stats = SettingStats(spec)                        # doctest: +SKIP
    >>> for chunk in dump.batches(whole_steps=True):      # doctest: +SKIP
    ...     stats.update(chunk, spec.replay(chunk))
    >>> stats.compute().lr_scale                          # doctest: +SKIP

    With `histograms=False` only the per-sequence sums are kept (`quick_stats`): `compute`
    then has no quantiles or histograms.
    """

    spec: Spec
    histograms: bool = True
    aggregation: Aggregation = field(init=False)
    raw_hist: LogHistogram = field(default_factory=LogHistogram)
    weight_hist: LogHistogram = field(default_factory=LogHistogram)
    seq: dict[str, list[np.ndarray]] = field(default_factory=lambda: {k: [] for k in _SEQ_FIELDS})
    steps: list[np.ndarray] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.aggregation = aggregation_of(self.spec)

    def update(self, batch: TokenBatch, result: Replay) -> None:
        """Add one chunk and the setting's replay of it."""
        every = ops.mask_is_all(batch, batch.loss_mask)
        raw_binned, raw_clean, raw_log = _raw_statistics(batch, result, every, self.histograms)
        if self.histograms:
            self._histograms(batch, result, every, raw_binned)
        sums = _compiled_sums(batch, result, every)
        if sums is None:
            sums = _sequence_sums(batch, result, every, raw_clean)
        sums["raw_log"] = raw_log
        for name in _SEQ_FIELDS:
            self.seq[name].append(sums[name])
        self.steps.append(batch.step.cpu().numpy())

    def _histograms(
        self, batch: TokenBatch, result: Replay, every: bool, raw_binned: Binned | None
    ) -> None:
        m = batch.loss_mask
        w, raw = result.weight, result.raw
        if raw_binned is None:
            self.raw_hist.update(raw if every else raw[m])
        else:
            self.raw_hist.add(raw_binned)
        constant = _per_sequence(w, batch) if every and result.seq_weight is not None else None
        if constant is None:
            w_binned = bin_values(w if every else w[m], like=raw_binned, keep_index=False)
        else:
            w_binned = bin_values(*constant)
        if w_binned is None:
            self.weight_hist.update(w if every else w[m])
        else:
            self.weight_hist.add(w_binned)

    def merge(self, other: SettingStats) -> None:
        """Add another accumulator's chunks after these."""
        if self.histograms:
            self.raw_hist.merge(other.raw_hist)
            self.weight_hist.merge(other.weight_hist)
        for name in _SEQ_FIELDS:
            self.seq[name].extend(other.seq[name])
        self.steps.extend(other.steps)

    def state(self) -> dict[str, np.ndarray]:
        """Everything it holds as a few plain numpy arrays, for `from_state` (the setting
        itself is not in it): what a results store keeps of a chunk. `seq` is float64
        [fields, B], the per-sequence sums in the order of `_SEQ_FIELDS`."""
        s = self.sequences()
        out = {
            "seq": np.stack([s[k] for k in _SEQ_FIELDS]).reshape(len(_SEQ_FIELDS), -1),
            "step": s["step"].astype(np.int64),
        }
        if self.histograms:
            for name in ("raw_hist", "weight_hist"):
                out |= {f"{name}.{k}": v for k, v in getattr(self, name).state().items()}
        return out

    @classmethod
    def from_state(
        cls, spec: Spec, state: Mapping[str, np.ndarray], histograms: bool = True
    ) -> SettingStats:
        """The accumulator of `spec` that `state` describes (see `state`); without
        `histograms`, the per-sequence sums alone (`quick_stats`' kind).

        Raises:
            ValueError: `state` is not one `state()` wrote (an array missing, of another
                type or length).
        """
        steps = checked(state, "step", "i", (-1,))
        seq = checked(state, "seq", "f", (len(_SEQ_FIELDS), steps.size)).astype(np.float64)
        hists = {}  # passed in, not made empty and replaced: a store loads thousands of them
        if histograms:
            for name in ("raw_hist", "weight_hist"):
                prefix = f"{name}."
                part = {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}
                hists[name] = LogHistogram.from_state(part)
        stats = cls(spec, histograms, **hists)
        stats.steps = [steps.astype(np.int64)]
        stats.seq = {name: [seq[i]] for i, name in enumerate(_SEQ_FIELDS)}
        return stats

    def sequences(self) -> dict[str, np.ndarray]:
        """The per-sequence sums, one array per field, plus `step`."""
        out = {k: np.concatenate(v) if v else np.zeros(0) for k, v in self.seq.items()}
        out["step"] = np.concatenate(self.steps) if self.steps else np.zeros(0, np.int64)
        return out

    def by_step(
        self, sequences: dict[str, np.ndarray] | None = None, steps: Collection[int] | None = None
    ) -> list[dict[str, Any]]:
        """The per-step rows of `compute()["by_step"]`, of `steps` only where given, from
        `sequences()` when at hand."""
        s = sequences if sequences is not None else self.sequences()
        chosen = None if steps is None else np.isin(s["step"], np.fromiter(steps, np.int64))
        return _by_step(s, self.aggregation, chosen)

    def compute(self, broken: np.ndarray | None = None) -> SettingSummary:
        """The setting's statistics: overall, `by_step`, `by_length`, quantiles, histograms;
        with `broken` (bool [B], the sequences in the order they were added, as
        `MismatchStats.broken` gives them), the share of their gradient the setting keeps."""
        s = self.sequences()
        hists: dict[str, Any] = {}
        if self.histograms:
            for label, hist in (("weight", self.weight_hist), ("raw", self.raw_hist)):
                values = hist.quantiles(QUANTILES)
                hists[f"{label}_quantiles"] = {
                    f"p{q * 100:g}": v for q, v in zip(QUANTILES, values, strict=True)
                }
                hists[f"{label}_min"] = hist.min if hist.total else float("nan")
                hists[f"{label}_max"] = hist.max if hist.total else float("nan")
                hists[f"{label}_hist"] = hist.coarse(plot_resolution(hist))
        return SettingSummary(
            name=self.spec.name,
            framework=self.spec.framework,
            upstream=frameworks.of(self.spec).upstream_of(self.spec),
            # With `framework:`, what `iscore replay --config` reads back as this setting.
            config={"framework": self.spec.framework, **self.spec.to_config()},
            aggregation=self.aggregation.mode,
            denominator_shrinks=self.aggregation.shrinks,
            **setting_scalars(s, self.aggregation),
            broken_gradient_kept=None
            if broken is None
            else broken_gradient_kept(s["w"], s["T"], broken),
            **hists,
            by_step=self.by_step(s),
            by_length=_by_length(s, self.aggregation),
        )


_NUMBERS = (
    "weight_mean", "weight_mean_seq", "ess", "truncated_high_fraction",
    "truncated_low_fraction", "token_masked_fraction", "token_rejected_fraction",
    "seq_masked_fraction", "lr_scale",
)  # fmt: skip
"""A setting's headline numbers, in the document's order: there only with loss tokens."""

_DISTRIBUTIONS = tuple(
    f"{label}_{part}" for label in ("weight", "raw") for part in ("quantiles", "min", "max", "hist")
)
"""The weights' and raw ratios' distributions, in the document's order: there only when the
accumulator kept histograms."""

_NAN = math.nan


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingNumbers:
    """What one setting does to a dump, in its headline numbers (the module docstring defines
    each; NaN without a loss token, where the document leaves them out): what `quick_stats`
    gives, and every row of a setting's `by_step`."""

    tokens: int
    sequences: int
    weight_mean: float = _NAN
    weight_mean_seq: float = _NAN
    ess: float = _NAN
    truncated_high_fraction: float = _NAN
    truncated_low_fraction: float = _NAN
    token_masked_fraction: float = _NAN
    token_rejected_fraction: float = _NAN
    seq_masked_fraction: float = _NAN
    lr_scale: float = _NAN

    def numbers(self) -> dict[str, Any]:
        """The counts and, with loss tokens, the headline numbers, in the document's order."""
        counts = {"tokens": self.tokens, "sequences": self.sequences}
        return counts | ({n: getattr(self, n) for n in _NUMBERS} if self.tokens else {})

    def value(self, statistic: str) -> float | None:
        """The number named `statistic` (a column of the settings table, `SUMMARY_COLUMNS`),
        None where there is none."""
        if statistic in _NUMBERS and not self.tokens:
            return None
        return getattr(self, statistic, None)


@dataclass(frozen=True, slots=True, kw_only=True)
class SettingSummary(SettingNumbers):
    """What one setting does to a dump (`SettingStats.compute`), every field defined in
    docs/analysis.md#settings: the setting (its name, framework, upstream commit, replayable
    config and loss aggregation), its headline numbers (`SettingNumbers`), the share of the
    broken sequences' gradient it keeps (None without broken sequences), the distributions of
    its weights and raw ratios (None where the accumulator kept no histograms), and its
    `by_step` and `by_length` tables (one dict per row)."""

    name: str
    framework: str
    upstream: str
    config: dict[str, Any]
    aggregation: str
    denominator_shrinks: bool
    broken_gradient_kept: float | None
    by_step: list[dict[str, Any]]
    by_length: list[dict[str, Any]]
    weight_quantiles: dict[str, float] | None = None
    weight_min: float | None = None
    weight_max: float | None = None
    weight_hist: dict[str, Any] | None = None
    raw_quantiles: dict[str, float] | None = None
    raw_min: float | None = None
    raw_max: float | None = None
    raw_hist: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The document's entry of this setting, in its order."""
        who = {
            "name": self.name,
            "framework": self.framework,
            "upstream": self.upstream,
            "config": self.config,
            "aggregation": self.aggregation,
            "denominator_shrinks": self.denominator_shrinks,
        }
        shapes = (
            {n: getattr(self, n) for n in _DISTRIBUTIONS}
            if self.weight_quantiles is not None
            else {}
        )
        return (
            who
            | self.numbers()
            | {"broken_gradient_kept": self.broken_gradient_kept}
            | shapes
            | {"by_step": self.by_step, "by_length": self.by_length}
        )


BROKEN_KEPT = (
    "the broken sequences' gradient a setting lets through: the mean weight of their loss "
    "tokens, relative to no correction (100%); 0% removes it, over 100% amplifies it "
    "(weights above 1 on their tokens)"
)
"""What `broken_gradient_kept` is, for every surface that shows it."""


def broken_gradient_kept(w: np.ndarray, T: np.ndarray, broken: np.ndarray) -> float | None:
    """The broken sequences' summed weights over their loss tokens (`BROKEN_KEPT`); None
    without broken sequences.

    >>> broken_gradient_kept(np.array([3.0, 0.0, 8.0]), np.array([3.0, 5.0, 4.0]),
    ...                      np.array([False, True, True]))
    0.8888888888888888
    """
    tokens = float(T[broken].sum())
    return float(w[broken].sum()) / tokens if tokens else None


def _raw_statistics(
    batch: TokenBatch, result: Replay, every: bool, histogram: bool = True
) -> tuple[Binned | None, bool, np.ndarray]:
    """(the binned raw ratios over loss tokens, or None where they are not all finite and
    >= 0 or `histogram` is false; whether they are all finite and >= 0; the per-sequence log
    raw weight). Settings whose raw ratios are the same tensor values within one `ops.shared`
    chunk (most token-level methods start from e^d) share them instead of computing them
    again."""
    m = batch.loss_mask
    raw = result.raw
    memo = ops.memo(batch)
    known = None if memo is None else memo.setdefault(("raw", every), [])
    # The same tensor, unchanged since (most settings' raw is the shared e^d), is found
    # without gathering its loss tokens and comparing them.
    version = raw._version
    entry = next((e for e in known or () if e["of"] is raw and e["version"] == version), None)
    if entry is None:
        rawm = raw if every else raw[m]
        for other in known or ():
            values = other["values"]
            if values is rawm or (
                values.dtype == rawm.dtype
                and values.shape == rawm.shape
                and torch.equal(values, rawm)
            ):
                entry = other
                break
    if entry is None:
        entry = {"of": raw, "version": version, "values": rawm}
        entry |= {"binned": None, "clean": None, "log": None}
        if known is not None:
            known.append(entry)
    if histogram and entry["clean"] is not False and entry["binned"] is None:
        constant = _per_sequence(raw, batch) if every and result.seq_raw is not None else None
        values = entry["values"]
        entry["binned"] = bin_values(values) if constant is None else bin_values(*constant)
        entry["clean"] = entry["binned"] is not None
    if entry["clean"] is None:
        values = entry["values"]
        low, high = (float(v) for v in torch.aminmax(values)) if values.numel() else (0.0, 0.0)
        entry["clean"] = low >= 0.0 and math.isfinite(high)  # NaN fails both
    if result.seq_raw is not None:
        raw_log = torch.log(result.seq_raw.double()).cpu().numpy()
    else:
        if entry["log"] is None:
            # The token ratios' geometric mean: the "per-sequence raw weight" for plots.
            logs = ops.scratch("impact.logs", raw.numel(), torch.float64, raw.device)
            logs.copy_(raw).clamp_(min=1e-300).log_()
            entry["log"] = (
                (ops.segment_sum(logs, batch, m) / ops.segment_count(batch, m).clamp(min=1.0))
                .cpu()
                .numpy()
            )
        raw_log = entry["log"]
    return entry["binned"] if histogram else None, entry["clean"], raw_log


def _sequence_sums(
    batch: TokenBatch, result: Replay, every: bool, raw_clean: bool
) -> dict[str, np.ndarray]:
    """float64 [B] per sequence: "T" (loss tokens), "w" and "w2" (the weights' sum and sum
    of squares over them), "kept", "nonzero" (weight > 0), and "high" / "low" (kept tokens
    that truncation lowered / raised, see `_truncated`)."""
    m = batch.loss_mask
    w, raw = result.weight, result.raw
    pre = w if result.pre_norm is None else result.pre_norm

    def buf(name: str, dtype: torch.dtype = torch.bool) -> torch.Tensor:
        return ops.scratch(f"impact.{name}", batch.num_tokens, dtype, w.device)

    kept = result.keep if every else torch.logical_and(result.keep, m, out=buf("kept"))
    # A setting that applies no IS weight (a pure mask, bypass PPO) reports weight 1 beside
    # the ratio it ignores: that is not truncation.
    weighted = _any_weighted(pre, kept, buf("flag"))
    w64 = buf("w64", torch.float64).copy_(w)
    if not every:
        w64.masked_fill_(torch.logical_not(m, out=buf("flag")), 0.0)
    sums = {"w": _sums(batch, w64)}
    sums["w2"] = _sums(batch, w64.mul_(w64))
    sums["kept"] = _counts(batch, kept)
    nonzero = ops.compare("gt", w, 0.0, buf("flag"))
    sums["nonzero"] = _counts(batch, nonzero if every else nonzero.logical_and_(m))
    sums["T"] = ops.segment_count(batch, m).cpu().numpy()
    sums["high"], sums["low"] = _truncated(batch, pre, raw, kept, weighted, raw_clean, buf)
    return sums


def _compiled_sums(batch: TokenBatch, result: Replay, every: bool) -> dict[str, np.ndarray] | None:
    """`_sequence_sums` in one compiled pass (`kernels.setting_sums`, the same values); None
    off the CPU or where the kernel does not answer."""
    w = result.weight
    pre = w if result.pre_norm is None else result.pre_norm
    tensors = (w, pre, result.raw, result.keep, batch.loss_mask)
    if any(t.device.type != "cpu" for t in tensors):
        return None
    found = kernels.setting_sums(
        w.numpy(),
        pre.numpy(),
        result.raw.numpy(),
        result.keep.numpy(),
        None if every else batch.loss_mask.numpy(),
        batch.cu_seqlens.numpy(),
        TRUNCATION_TOLERANCE,
    )
    if found is None:
        return None
    out, weighted = found
    sums = dict(zip(("w", "w2", "T", "kept", "nonzero", "high", "low"), out, strict=True))
    if not weighted:
        # As in `_sequence_sums`: weight 1 beside an ignored ratio is not truncation.
        sums["high"] = sums["low"] = np.zeros(batch.num_sequences)
    return sums


def _per_sequence(x: torch.Tensor, batch: TokenBatch) -> tuple[torch.Tensor, np.ndarray] | None:
    """(one value per non-empty sequence, its token count) when x [N] is constant within
    each sequence (sequence-level weights), else None: binning B values with their counts
    replaces binning N."""
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return None
    cu = batch.cu_seqlens.numpy()
    lengths = np.diff(cu)
    nonempty = lengths > 0
    values = x.numpy()
    first = values[cu[:-1][nonempty]]
    if np.isnan(first).any():  # NaN equals nothing: never "constant"
        return None
    # Constant within each sequence: the value changes only where a sequence starts (at
    # most once per sequence, so a token-level tensor is rejected before `isin` sorts).
    differs = values[1:] != values[:-1]
    if np.count_nonzero(differs) >= lengths.size:
        return None
    if not np.isin(np.flatnonzero(differs) + 1, cu[1:-1]).all():
        return None
    return torch.from_numpy(first), lengths[nonempty]


def _sums(batch: TokenBatch, values: torch.Tensor) -> np.ndarray:
    return ops.segment_sums_on_host(batch, {"x": values})["x"]


def _counts(batch: TokenBatch, mask: torch.Tensor) -> np.ndarray:
    if mask.device.type == "cpu":
        return ops.segment_counts(mask.numpy(), batch)
    return _sums(batch, mask)


def _any_weighted(pre: torch.Tensor, kept: torch.Tensor, flag: torch.Tensor) -> bool:
    """Whether some kept token has a weight other than 1 (a prefix usually tells)."""
    head = min(pre.numel(), 4096)
    if bool(((pre[:head] != 1.0) & kept[:head]).any()):
        return True
    return bool(ops.compare("ne", pre, 1.0, flag).logical_and_(kept).any())


def _truncated(
    batch: TokenBatch,
    pre: torch.Tensor,
    raw: torch.Tensor,
    kept: torch.Tensor,
    weighted: bool,
    raw_clean: bool,
    buf: Callable[..., torch.Tensor],
) -> tuple[np.ndarray, np.ndarray]:
    """float64 [B] per sequence: kept tokens whose weight truncation lowered (high) or raised
    (low) below / above raw, by more than the relative tolerance (compared in float64)."""
    b = batch.num_sequences
    if not weighted:
        return np.zeros(b), np.zeros(b)
    if not raw_clean:
        # Raw has NaN, infinities or negative values: compare every token.
        active = kept & (pre > 0)
        p64, r64 = pre.double(), raw.double()
        high = active & (p64 < r64 * (1 - TRUNCATION_TOLERANCE))
        low = active & (p64 > r64 * (1 + TRUNCATION_TOLERANCE))
        sums = ops.segment_sums_on_host(batch, {"high": high, "low": low})
        return sums["high"], sums["low"]
    # With raw finite and >= 0, a token whose weight equals its raw ratio is neither: only
    # the (few) tokens where they differ need the float64 comparison.
    index = ops.nonzero(ops.compare("ne", pre, raw, buf("flag")).logical_and_(kept))
    p64, r64 = pre[index].double(), raw[index].double()
    high = (p64 > 0) & (p64 < r64 * (1 - TRUNCATION_TOLERANCE))
    low = (p64 > 0) & (p64 > r64 * (1 + TRUNCATION_TOLERANCE))
    cu = batch.cu_seqlens.to(index.device)
    seq = torch.searchsorted(cu, index, right=True) - 1
    return (
        torch.bincount(seq[high], minlength=b).double().cpu().numpy(),
        torch.bincount(seq[low], minlength=b).double().cpu().numpy(),
    )


def setting_scalars(s: dict[str, np.ndarray], agg: Aggregation) -> dict[str, Any]:
    """Scalar statistics over the sequences of `s` (one array per field, a value each)."""
    T = s["T"]
    has = T > 0
    n = float(T.sum())
    if n == 0:
        return {"tokens": 0, "sequences": 0}
    w, w2 = float(s["w"].sum()), float(s["w2"].sum())
    per_seq = s["w"][has] / T[has]
    return {
        "tokens": int(n),
        "sequences": int(has.sum()),
        "weight_mean": w / n,
        "weight_mean_seq": float(per_seq.mean()),
        "ess": w * w / (n * w2) if w2 > 0 else 0.0,
        "truncated_high_fraction": float(s["high"].sum()) / n,
        "truncated_low_fraction": float(s["low"].sum()) / n,
        "token_masked_fraction": 1.0 - float(s["nonzero"].sum()) / n,
        "token_rejected_fraction": 1.0 - float(s["kept"].sum()) / n,
        "seq_masked_fraction": float((s["nonzero"][has] == 0).mean()),
        "lr_scale": _lr_scale(T[has], s["w"][has], s["kept"][has], agg),
    }


def _lr_scale(T: np.ndarray, w: np.ndarray, kept: np.ndarray, agg: Aggregation) -> float:
    """Corrected over uncorrected gradient scale under `agg` (see the module docstring), from
    the per-sequence loss tokens, weight sums and kept tokens of sequences with T > 0."""
    if agg.mode == "seq-mean-token-mean":
        denominator = kept if agg.shrinks else T
        return float(np.mean(np.where(denominator > 0, w / np.maximum(denominator, 1), 0.0)))
    denominator = kept.sum() if agg.shrinks and agg.mode == "token-mean" else T.sum()
    return float(w.sum() / denominator) if denominator > 0 else 0.0


def _by_step(
    s: dict[str, np.ndarray], agg: Aggregation, chosen: np.ndarray | None = None
) -> list[dict[str, Any]]:
    """The scalar statistics per training step (of the `chosen` sequences), ascending."""
    return [
        {"step": int(step), **setting_scalars(group, agg)}
        for step, group in ops.groups(s, s["step"], chosen)
    ]


def _by_length(s: dict[str, np.ndarray], agg: Aggregation) -> list[dict[str, Any]]:
    """Per log2 bucket of loss tokens: the per-sequence weight's spread and the mask rate."""
    rows = []
    buckets = np.floor(np.log2(np.maximum(s["T"], 1))).astype(int)
    for b, group in ops.groups(s, buckets, s["T"] > 0):
        seq_weight = group["w"] / group["T"]
        p10, p90 = ops.quantiles(seq_weight, (0.1, 0.9))
        rows.append(
            {
                "bucket": bucket_label(int(b)),
                "length_lo": 2 ** int(b),
                "length_hi": 2 ** (int(b) + 1) - 1,
                "length_median": ops.median(group["T"]),
                **setting_scalars(group, agg),
                "seq_weight_mean": float(seq_weight.mean()),
                "seq_weight_median": ops.median(seq_weight),
                "seq_weight_p10": float(p10),
                "seq_weight_p90": float(p90),
                "seq_raw_median": float(np.exp(ops.median(group["raw_log"]))),
            }
        )
    return rows


def quick_stats(batch: TokenBatch, spec: Spec, result: Replay | None = None) -> SettingNumbers:
    """The headline numbers of one setting on an in-memory batch (weight_mean, ess,
    token/seq masked fractions, lr_scale, ...), without histograms or breakdowns; `result`:
    the setting's replay of `batch`, when already at hand."""
    stats = SettingStats(spec, histograms=False)
    stats.update(batch, spec.replay(batch) if result is None else result)
    return SettingNumbers(**setting_scalars(stats.sequences(), stats.aggregation))


def quick_stats_by_step(
    batch: TokenBatch, spec: Spec, result: Replay | None = None
) -> list[dict[str, Any]]:
    """`quick_stats` per training step of `batch`, ascending: one dict per step with its
    `step` and the headline numbers of the setting on that step alone (the numbers an
    analysis reports in `settings[].by_step`).

    >>> import iscore
    >>> from iscore.frameworks.resolve import resolve
    >>> batch = iscore.load("data/drift.parquet")
    >>> rows = quick_stats_by_step(batch, resolve("verl:decoupled_geo_rs"))
    >>> [row["step"] for row in rows], 0.9 < rows[0]["lr_scale"] <= 1.0
    ([0, 1, 2, 3], True)
    """
    stats = SettingStats(spec, histograms=False)
    stats.update(batch, spec.replay(batch) if result is None else result)
    return _by_step(stats.sequences(), stats.aggregation)
