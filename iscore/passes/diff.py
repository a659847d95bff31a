"""`iscore diff`: two dumps (a baseline and a candidate: before and after a fix, bf16 and FP8
rollouts, two engine versions) streamed through the same settings, every metric's ratio with
its interval and a verdict (docs/compare.md).

Each arm is streamed once into its accumulators (`accumulate`, as `analyze` streams a dump);
the intervals come from resampling each arm's sequences within steps (`iscore.stats.bootstrap`),
each resample's statistics from its sums over the sequences it draws (the formulas of
`mismatch_scalars` and `setting_scalars`, tested equal to them). Where both arms hold the same
sequences (the same `(step, seq_id)` and lengths: the same rollouts scored two ways) they are
resampled together and the comparison is paired.

>>> d = diff("data/dense_bf16.parquet", "data/fp8.parquet", ["verl:decoupled_geo_rs"])
>>> d.paired, d.metric("k3").verdict, d.metric("k3").ci[0] > 1
(False, 'worse', True)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch

from iscore.advice import (
    DISTRIBUTION_METRICS,
    METRICS,
    MISMATCH_METRICS,
    SETTING_METRICS,
    Metric,
    Verdict,
    verdict,
)
from iscore.dump import DEFAULT_CHUNK_TOKENS, Data
from iscore.errors import ConfigError
from iscore.frameworks import Setting, resolve_all
from iscore.passes.analysis import Accumulated, accumulate
from iscore.passes.parts import device_for
from iscore.stats import (
    LEVEL,
    RESAMPLES,
    SEED,
    counts,
    mismatch_from_sums,
    mismatch_scalars,
    mismatch_sum_columns,
    percentile_interval,
    resample_rows,
    setting_from_sums,
    setting_scalars,
    setting_sum_columns,
)
from iscore.utils import write_json

SCHEMA = "iscore.diff"
SCHEMA_VERSION = 1
"""The JSON document's name and version (docs/compare.md#the-document)."""

_TOKEN_MEANS = {
    "k3": ("k3", 0.0),
    "abs_diff_mean": ("abs", 0.0),
    "chi2_token": ("chi", -1.0),
    "token_mult_prob_error": ("mult", 0.0),
    "ratio_mean": ("rho", 0.0),
    "far_share": ("far", 0.0),
}
"""The metrics that are a token mean of one per-sequence sum (field, offset): per step, they
are compared per step too (`_Numbers.by_step`)."""


@dataclass(frozen=True, slots=True)
class Arm:
    """One side of a diff.

    Attributes:
        name: its label; source: its files; tokens, sequences: in the loss, with loss
            tokens; steps: the steps it holds.
    """

    name: str
    source: tuple[str, ...]
    tokens: int
    sequences: int
    steps: tuple[int, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "source": list(self.source),
            "tokens": self.tokens,
            "sequences": self.sequences,
            "steps": list(self.steps),
        }


@dataclass(frozen=True, slots=True)
class MetricDiff:
    """One metric on both arms.

    Attributes:
        name: the metric (`iscore.advice.comparison`).
        baseline, candidate: its values.
        ratio: candidate / baseline of its badness (`Metric.badness`; None where the
            baseline's is 0); ci: that ratio's interval (NaN ends where it has none).
        difference: candidate - baseline of the badness; difference_ci: its interval.
        verdict: "better", "worse" or "same" for the candidate.
    """

    name: str
    baseline: float
    candidate: float
    ratio: float | None
    ci: tuple[float, float]
    difference: float
    difference_ci: tuple[float, float]
    verdict: Verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "ratio": self.ratio,
            "ci": list(self.ci),
            "difference": self.difference,
            "difference_ci": list(self.difference_ci),
            "verdict": self.verdict,
        }


@dataclass(frozen=True, slots=True)
class SettingDiff:
    """One setting's metrics on both arms; `setting` is `framework:name`."""

    setting: str
    metrics: tuple[MetricDiff, ...]

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "metrics": [m.to_dict() for m in self.metrics]}


Direction = Literal["rising", "falling", "flat"]

TREND_STEPS = 3
"""The fewest steps with a ratio for a trend: two points always fit a line."""


@dataclass(frozen=True, slots=True)
class TrendDiff:
    """How one token-mean metric's ratio moves over the steps both arms hold.

    Attributes:
        name: the metric.
        slope: the least-squares slope of log(ratio of badness) on the step number: the
            ratio's change per step is e^slope (1.05: 5% more a step, relative to the
            baseline's). None with fewer than `TREND_STEPS` steps with a ratio.
        ci: its interval, from the same resamples as the per-step ratios.
        direction: "rising" where the interval lies above 0 (the candidate falls further
            behind, or its gain shrinks, step after step), "falling" below 0, else "flat".
        steps: the steps fitted.
    """

    name: str
    slope: float | None
    ci: tuple[float, float]
    direction: Direction
    steps: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "slope": self.slope,
            "ci": list(self.ci),
            "direction": self.direction,
            "steps": self.steps,
        }


@dataclass(frozen=True, slots=True)
class Diff:
    """Two arms compared (`diff`).

    Attributes:
        arms: the baseline and the candidate.
        paired: both hold the same sequences, resampled together.
        resamples, seed, level: the bootstrap's.
        metrics: the mismatch's metrics (`MISMATCH_METRICS`).
        settings: each setting's (`SETTING_METRICS`).
        by_step: per step both arms hold, the token-mean metrics (`step` and `metrics`).
        trend: per token-mean metric, how its ratio moves over those steps (empty with fewer
            than `TREND_STEPS`).
    """

    arms: tuple[Arm, Arm]
    paired: bool
    resamples: int
    seed: int
    level: float
    metrics: tuple[MetricDiff, ...]
    settings: tuple[SettingDiff, ...]
    by_step: tuple[dict[str, Any], ...]
    trend: tuple[TrendDiff, ...] = ()

    def metric(self, name: str) -> MetricDiff:
        """The mismatch's metric `name`."""
        return next(m for m in self.metrics if m.name == name)

    def worse(self) -> list[str]:
        """Where the candidate is worse: `metric` or `setting: metric`, overall only."""
        found = [m.name for m in self.metrics if m.verdict == "worse"]
        for s in self.settings:
            found += [f"{s.setting}: {m.name}" for m in s.metrics if m.verdict == "worse"]
        return found

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "arms": [a.to_dict() for a in self.arms],
            "paired": self.paired,
            "bootstrap": {"resamples": self.resamples, "seed": self.seed, "level": self.level},
            "metrics": [m.to_dict() for m in self.metrics],
            "settings": [s.to_dict() for s in self.settings],
            "by_step": [
                {"step": row["step"], "metrics": [m.to_dict() for m in row["metrics"]]}
                for row in self.by_step
            ],
            "trend": [t.to_dict() for t in self.trend],
        }

    def write_json(self, path: str | Path) -> None:
        """Write `to_dict()` as JSON (non-finite numbers as null)."""
        write_json(self.to_dict(), path)


def diff(
    baseline: Data,
    candidate: Data,
    settings: Setting | Sequence[Setting] = (),
    *,
    names: tuple[str, str] = ("baseline", "candidate"),
    resamples: int = RESAMPLES,
    seed: int = SEED,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    jobs: int | None = None,
    progress: Callable[[int], None] | None = None,
) -> Diff:
    """Compare `candidate` with `baseline` through `settings` (as `analyze` takes them).

    Args:
        baseline, candidate: dumps (paths, globs, URIs, opened dumps or loaded batches).
        names: their labels.
        resamples, seed: the bootstrap's resamples and seed (the same give the same intervals).
        max_tokens, device, jobs, progress: as `analyze` takes them.

    Raises:
        ConfigError: fewer than 2 resamples.
        DumpError: as `analyze` raises it, for either arm.
    """
    if not isinstance(resamples, int) or resamples < 2:
        raise ConfigError(f"Expected argument `resamples` to be an int >= 2, but got {resamples}")
    specs = resolve_all(settings)
    place = device_for(device, "local")
    arms = [
        _Numbers.of(
            accumulate(
                source, specs, max_tokens=max_tokens, device=place, progress=progress, jobs=jobs
            ),
            name,
        )
        for source, name in zip((baseline, candidate), names, strict=True)
    ]
    pairing = _pairing(*arms)
    steps = sorted(set(arms[0].steps.tolist()) & set(arms[1].steps.tolist()))
    draws = _draws(arms, pairing, steps, resamples, seed)
    overall = [arm.values(arm.resampled(None)) for arm in arms]
    stepwise = [arm.by_step(arm.resampled(None), steps) for arm in arms]
    by_step = tuple(
        {
            "step": step,
            "metrics": [
                _compared(METRICS[name], (j, name), stepwise, draws, by_step=True)
                for name in _TOKEN_MEANS
            ],
        }
        for j, step in enumerate(steps)
    )
    return Diff(
        arms=(arms[0].arm, arms[1].arm),
        paired=pairing is not None,
        resamples=resamples,
        seed=seed,
        level=LEVEL,
        metrics=tuple(_compared(m, ("mismatch", m.name), overall, draws) for m in _metrics(arms)),
        settings=tuple(
            SettingDiff(
                f"{spec.framework}:{spec.name}",
                tuple(_compared(m, (i, m.name), overall, draws) for m in SETTING_METRICS),
            )
            for i, spec in enumerate(specs)
        ),
        by_step=by_step,
        trend=tuple(_trend(name, steps, by_step, draws) for name in _TOKEN_MEANS)
        if len(steps) >= TREND_STEPS
        else (),
    )


@dataclass(frozen=True, slots=True)
class _Numbers:
    """An arm's per-sequence numbers, the mismatch's (with `broken`) and each setting's in the
    same order (every accumulator adds a part's sequences in the order read), as the rows of
    one float64 matrix: a resample takes its sequences in one gather."""

    arm: Arm
    table: np.ndarray
    fields: tuple[tuple[Any, str], ...]
    aggregations: tuple[Any, ...]
    seq_id: Any

    @property
    def steps(self) -> np.ndarray:
        return self.table[self.fields.index(("mismatch", "step"))].astype(np.int64)

    @classmethod
    def of(cls, done: Accumulated, name: str) -> _Numbers:
        numbers = done.numbers
        mismatch = {k: v for k, v in numbers.items() if k != "seq_id"}
        mismatch["broken"] = done.total.mismatch.broken(numbers)
        groups: list[tuple[Any, dict[str, np.ndarray]]] = [("mismatch", mismatch)]
        groups += [(i, acc.sequences()) for i, acc in enumerate(done.total.settings)]
        fields = tuple((group, k) for group, values in groups for k in values)
        table = np.stack(
            [np.asarray(values[k], np.float64) for _, values in groups for k in values]
        )
        has = mismatch["T"] > 0
        arm = Arm(
            name,
            tuple(done.plan.files),
            int(mismatch["T"].sum()),
            int(has.sum()),
            tuple(int(s) for s in np.unique(mismatch["step"][has])),
        )
        aggregations = tuple(acc.aggregation for acc in done.total.settings)
        return cls(arm, table, fields, aggregations, numbers["seq_id"])

    def resampled(self, row: np.ndarray | None) -> dict[Any, dict[str, np.ndarray]]:
        """Each group's per-sequence numbers (the mismatch's, each setting's) on the
        sequences `row` (None: as they are), views of one gather."""
        taken = self.table if row is None else self.table[:, row]
        out: dict[Any, dict[str, np.ndarray]] = {}
        for (group, name), values in zip(self.fields, taken, strict=True):
            out.setdefault(group, {})[name] = values
        return out

    def values(self, numbers: Mapping[Any, Mapping[str, np.ndarray]]) -> dict[Any, float]:
        """Every overall metric of `numbers` (`resampled`)."""
        m = numbers["mismatch"]
        scalars = mismatch_scalars(m)
        has = m["T"] > 0
        out: dict[Any, float] = {
            ("mismatch", k): float(scalars[k]) for k in METRICS if k in scalars
        }
        out["mismatch", "broken_share"] = float(m["broken"][has].sum() / max(has.sum(), 1))
        out["mismatch", "far_share"] = float(m["far"].sum() / max(m["T"].sum(), 1.0))
        if "dist_tokens" in m:
            tokens = max(float(m["dist_tokens"].sum()), 1.0)
            out["mismatch", "kl_estimate"] = float(m["dist_estimate"].sum() / tokens)
            out["mismatch", "top1_agreement"] = float(m["dist_top1"].sum() / tokens)
        for i, agg in enumerate(self.aggregations):
            found = setting_scalars(numbers[i], agg)
            out |= {(i, m.name): float(found.get(m.name, np.nan)) for m in SETTING_METRICS}
        return out

    def sum_columns(self, steps: Sequence[int]) -> tuple[list[Any], np.ndarray]:
        """(names, float64 [B, K]): the per-sequence columns whose sums give every compared
        metric, overall and (the token-mean ones) per step of `steps`."""
        numbers = self.resampled(None)
        named: dict[Any, np.ndarray] = {
            ("mismatch", k): v for k, v in mismatch_sum_columns(numbers["mismatch"]).items()
        }
        for i, agg in enumerate(self.aggregations):
            named |= {(i, k): v for k, v in setting_sum_columns(numbers[i], agg).items()}
        step = numbers["mismatch"]["step"]
        for j, value in enumerate(steps):
            inside = (step == value).astype(np.float64)
            for field in ("T", *(f for f, _ in _TOKEN_MEANS.values())):
                named["step", j, field] = inside * numbers["mismatch"][field]
        return list(named), np.stack(list(named.values()), axis=1)

    def from_sums(
        self, sums: Mapping[Any, np.ndarray], steps: Sequence[int]
    ) -> dict[Any, np.ndarray]:
        """Every compared metric of each resample (keyed as `values` keys them; the per-step
        ones as ("step", (j, name))), from its sums of `sum_columns`."""
        m = mismatch_from_sums(_group(sums, "mismatch"))
        out: dict[Any, np.ndarray] = {("mismatch", k): v for k, v in m.items()}
        for i, agg in enumerate(self.aggregations):
            out |= {(i, k): v for k, v in setting_from_sums(_group(sums, i), agg).items()}
        for j in range(len(steps)):
            T = sums["step", j, "T"]
            for name, (field, offset) in _TOKEN_MEANS.items():
                with np.errstate(divide="ignore", invalid="ignore"):
                    means = np.where(T > 0, sums["step", j, field] / T, np.nan)
                out["step", (j, name)] = means + offset
        return out

    @staticmethod
    def by_step(
        numbers: Mapping[Any, Mapping[str, np.ndarray]], steps: Sequence[int]
    ) -> dict[Any, float]:
        """The token-mean metrics of each of `steps` in `numbers` (`resampled`), as sums per
        step."""
        m = numbers["mismatch"]
        codes = np.searchsorted(np.asarray(steps, np.float64), m["step"])
        known = (codes < len(steps)) & np.isin(m["step"], steps)
        T = np.bincount(codes[known], weights=m["T"][known], minlength=len(steps))
        out: dict[Any, float] = {}
        for name, (field, offset) in _TOKEN_MEANS.items():
            sums = np.bincount(codes[known], weights=m[field][known], minlength=len(steps))
            with np.errstate(divide="ignore", invalid="ignore"):
                means = np.where(T > 0, sums / T, np.nan) + offset
            out |= {(j, name): float(v) for j, v in enumerate(means)}
        return out


def _group(sums: Mapping[Any, np.ndarray], group: Any) -> dict[str, np.ndarray]:
    """The sums of one group's columns (the mismatch's, a setting's), by name."""
    return {key[1]: v for key, v in sums.items() if len(key) == 2 and key[0] == group}


def _pairing(base: _Numbers, cand: _Numbers) -> np.ndarray | None:
    """Where both arms hold the same sequences (each `(step, seq_id, T)` once in each), for
    each of the baseline's sequences the candidate's index of it; else None."""

    def keys(arm: _Numbers) -> list[tuple[int, str, float]]:
        ids = map(str, arm.seq_id.to_pylist())
        lengths = arm.table[arm.fields.index(("mismatch", "T"))].tolist()
        return list(zip(arm.steps.tolist(), ids, lengths, strict=True))

    a, b = keys(base), keys(cand)
    if len(a) != len(b) or len(set(a)) != len(a):
        return None
    where = {key: i for i, key in enumerate(b)}
    if where.keys() != set(a):
        return None
    return np.array([where[key] for key in a], dtype=np.int64)


_BATCH = 100
"""Resamples drawn at once: their counts per sequence are one matrix [100, B]."""


def _draws(
    arms: Sequence[_Numbers],
    pairing: np.ndarray | None,
    steps: Sequence[int],
    resamples: int,
    seed: int,
) -> dict[Any, np.ndarray]:
    """float64 [resamples, 2] per metric key (overall and by step): both arms' values on each
    resample, from the sums over the sequences each draws (`counts @ columns`: every compared
    statistic is a function of sums over sequences, `iscore.stats.bootstrap`); paired arms on
    the same draws."""
    rows = [resample_rows(arms[0].steps, resamples, seed)]
    unpaired = pairing is None
    rows.append(resample_rows(arms[1].steps, resamples, seed + 1) if unpaired else iter(()))
    columns = [arm.sum_columns(steps) for arm in arms]
    draws: dict[Any, np.ndarray] = {}
    for start in range(0, resamples, _BATCH):
        batch = [next(rows[0]) for _ in range(min(_BATCH, resamples - start))]
        others = [next(rows[1]) for _ in batch] if unpaired else [pairing[r] for r in batch]
        for a, (arm, drawn) in enumerate(zip(arms, (batch, others), strict=True)):
            names, matrix = columns[a]
            sums = counts(drawn, matrix.shape[0]) @ matrix
            found = arm.from_sums(dict(zip(names, sums.T, strict=True)), steps)
            for key, values in found.items():
                if key not in draws:
                    draws[key] = np.full((resamples, 2), np.nan)
                draws[key][start : start + len(batch), a] = values
    return draws


def _metrics(arms: Sequence[_Numbers]) -> tuple[Metric, ...]:
    """The mismatch's metrics both arms have: the distribution's where both have top-k
    columns."""
    whole = all(("mismatch", "dist_tokens") in arm.fields for arm in arms)
    return MISMATCH_METRICS + (DISTRIBUTION_METRICS if whole else ())


def _trend(
    name: str,
    steps: Sequence[int],
    by_step: Sequence[Mapping[str, Any]],
    draws: Mapping[Any, np.ndarray],
) -> TrendDiff:
    """The slope of log(ratio) on the step for metric `name`, on the values and on each
    resample (the steps without a ratio there left out of its fit), and its interval."""
    metric = METRICS[name]
    x = np.asarray(steps, np.float64)
    ratios = np.array(
        [next(m.ratio for m in row["metrics"] if m.name == name) or np.nan for row in by_step]
    )
    drawn = np.stack([draws["step", (j, name)] for j in range(len(steps))], axis=1)
    bad = np.abs(drawn - 1.0) if metric.bad == "away_from_1" else drawn  # [R, steps, 2]
    with np.errstate(divide="ignore", invalid="ignore"):
        resampled = np.log(np.where(bad[..., 0] > 0, bad[..., 1] / bad[..., 0], np.nan))
        logs = np.log(ratios)
    slope = _slopes(x, logs[None, :])[0]
    fitted = int(np.count_nonzero(np.isfinite(logs)))
    if fitted < TREND_STEPS:
        return TrendDiff(name, None, (math.nan, math.nan), "flat", fitted)
    interval = percentile_interval(slope, _slopes(x, resampled))
    direction: Direction = "rising" if interval.lo > 0 else "falling" if interval.hi < 0 else "flat"
    return TrendDiff(name, float(slope), (interval.lo, interval.hi), direction, fitted)


def _slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """float64 [R]: the least-squares slope of each row of `y` [R, n] on `x` [n], over its
    finite entries (NaN where fewer than `TREND_STEPS`)."""
    finite = np.isfinite(y)
    w = finite.astype(np.float64)
    n = w.sum(axis=1)
    y0 = np.where(finite, y, 0.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        mx = (w * x).sum(axis=1) / n
        my = y0.sum(axis=1) / n
        dx = np.where(finite, x - mx[:, None], 0.0)
        slope = (dx * (y0 - my[:, None])).sum(axis=1) / (dx * dx).sum(axis=1)
    return np.where(n >= TREND_STEPS, slope, np.nan)


def _compared(
    metric: Metric,
    key: Any,
    values: Sequence[Mapping[Any, float]],
    draws: Mapping[Any, np.ndarray],
    *,
    by_step: bool = False,
) -> MetricDiff:
    """`metric` on both arms (`values`, keyed by `key`), its ratio and difference with their
    intervals from `draws`, and the verdict."""
    drawn = draws[("step", key) if by_step else key]
    base, cand = (float(v[key]) for v in values)
    bad_b, bad_c = metric.badness(base), metric.badness(cand)
    bad = np.abs(drawn - 1.0) if metric.bad == "away_from_1" else drawn
    with np.errstate(divide="ignore", invalid="ignore"):
        ratios = np.where(bad[:, 0] > 0, bad[:, 1] / bad[:, 0], np.nan)
    ratio = bad_c / bad_b if bad_b > 0 else None
    ratio_ci = percentile_interval(np.nan if ratio is None else ratio, ratios)
    difference_ci = percentile_interval(bad_c - bad_b, bad[:, 1] - bad[:, 0])
    ci = (ratio_ci.lo, ratio_ci.hi)
    return MetricDiff(
        metric.name,
        base,
        cand,
        ratio,
        ci,
        bad_c - bad_b,
        (difference_ci.lo, difference_ci.hi),
        verdict(metric, ci, (difference_ci.lo, difference_ci.hi)),
    )
