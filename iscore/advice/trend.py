"""A run followed step by step: the per-step table of the mismatch and of each setting, and the
events that say when something changed (docs/runs.md).

The table joins what an analysis already computes per step (`mismatch.by_step` and each
setting's `by_step`), one row per training step; the events are found in it:

- `growth`: the first step of a sustained rise of k3 (over the sequences not called broken)
  above the early steps' band (`iscore.stats.noise.first_rise`, the rise the `drift` flag reports);
- `broken_sequences`: the first step with sequences outside that step's own noise
  (`iscore.stats.noise.outside`, judged per step, so a mismatch that grows is never taken for
  broken sequences);
- `offset`: the first step where the mean ratio <e^d> of the step's other sequences is not 1
  (`iscore.stats.noise.ratio_bias`, the test of the `ratio_mean_bias` flag);
- `setting_degrades`: a setting that met the targets (`iscore.advice.targets.Targets`) on
  every early step and misses them at every step from one on (`degrades_from`);
- `band_inert`: a setting whose mask rate does not rise while k3 does: over the steps that make
  the growth, its token mask rate stays within the noise of its early level (`inert_from`), as
  fixed IcePop bands mask fewer tokens while the gap widens.

>>> trend = analyze("run/", ["verl:decoupled_geo_rs"]).trend  # doctest: +SKIP
>>> [(e.kind, e.step) for e in trend.events]                  # doctest: +SKIP
[('growth', 41)]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import pyarrow as pa

from iscore.frameworks import Spec
from iscore.stats import (
    BROKEN_WORDS,
    SUSTAIN_STEPS,
    Baseline,
    MismatchSummary,
    SettingSummary,
    early_steps,
    first_rise,
    ratio_bias,
    setting_columns,
)

if TYPE_CHECKING:
    from iscore.advice.targets import Targets

MISMATCH_COLUMNS = (
    "tokens",
    "sequences",
    "k3",
    "chi2_token",
    "token_mult_prob_error",
    "abs_diff_p99",
    "tail_share",
    "d_median",
    "d_spread",
    "broken_sequences",
    "healthy_k3",
    "healthy_ratio_mean",
    "healthy_ratio_mean_stderr",
)
"""The mismatch's columns of the per-step table (`mismatch.by_step`'s, docs/analysis.md)."""

SETTING_COLUMNS = (
    "token_masked_fraction",
    "seq_masked_fraction",
    "truncated_fraction",
    "lr_scale",
    "ess",
)
"""Each setting's columns, as suffixes of its column prefix
(`iscore.stats.columns.setting_columns`): its `by_step` values, `truncated_fraction` the sum of
the high and low ones."""

EventKind = Literal["growth", "broken_sequences", "offset", "setting_degrades", "band_inert"]

EVENT_KINDS: dict[str, str] = {
    "growth": "The mismatch began to grow",
    "broken_sequences": "Broken sequences appeared",
    "offset": "The two sides stopped scoring the same distribution",
    "setting_degrades": "A setting stopped meeting the targets",
    "band_inert": "A setting's mask stopped following the mismatch",
}
"""Each event kind's heading, in the order every surface shows them."""


BROKEN_STEPS = 3
"""Steps in a row with broken sequences before `default_alert` fires: a replica or rank that
stays off breaks sequences at every step, where one step's few is what the broken test's false
positives look like on small steps (tuned in docs/why.md#a-warning-before-the-damage)."""


@dataclass(frozen=True, slots=True)
class DefaultAlert:
    """A default alert of `iscore watch` (`default_alert`): what holds, and from which step.

    Attributes:
        what: the condition, in words.
        step: the first step it holds from (the alert is known some steps later: a growth
            event and `BROKEN_STEPS` need the steps after it).
    """

    what: str
    step: int


def default_alert(trend: Trend, broken_steps: int = BROKEN_STEPS) -> DefaultAlert | None:
    """The earliest of `iscore watch`'s default alerts to hold on the trend, or None: the
    growth event (k3 above the early steps' band), or broken sequences on `broken_steps` steps
    in a row. Chosen on the testbed's mid-run regimes, with no alert on its bf16 runs
    (docs/why.md#a-warning-before-the-damage).

    >>> rows = [{"step": s, "broken_sequences": int(s in (3, 6, 7, 8))} for s in range(10)]
    >>> default_alert(Trend(tuple(rows), (), (), None, ()))
    DefaultAlert(what='broken sequences on 3 steps in a row', step=6)
    >>> default_alert(Trend(tuple(rows[:8]), (), (), None, ())) is None
    True
    """
    found = [DefaultAlert("growth of k3", e.step) for e in trend.events if e.kind == "growth"]
    step = broken_run(trend.rows, broken_steps)
    if step is not None:
        found.append(DefaultAlert(f"broken sequences on {broken_steps} steps in a row", step))
    return min(found, key=lambda a: a.step, default=None)


def broken_run(rows: Sequence[dict[str, Any]], steps: int) -> int | None:
    """The first step of the trend's first `steps` steps in a row with broken sequences, or None.

    >>> broken_run([{"step": s, "broken_sequences": int(s > 4)} for s in range(8)], 3)
    5
    """
    broken = [bool(r["broken_sequences"]) for r in rows]
    for t in range(len(broken) - steps + 1):
        if all(broken[t : t + steps]):
            return rows[t]["step"]
    return None


@dataclass(frozen=True, slots=True)
class Event:
    """When something changed in a run.

    Attributes:
        kind: what changed (`EVENT_KINDS`).
        step: the first step it shows at.
        metric: the per-step column it was found in (`k3`, `broken_sequences`,
            `healthy_ratio_mean`, or a setting's column).
        evidence: the numbers, in words.
        setting: the setting's name, for `setting_degrades` and `band_inert`.
    """

    kind: EventKind
    step: int
    metric: str
    evidence: str
    setting: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "step": self.step,
            "metric": self.metric,
            "evidence": self.evidence,
            "setting": self.setting,
        }


@dataclass(frozen=True, slots=True)
class Trend:
    """The per-step table of a run and its events.

    Attributes:
        rows: one dict per step, ascending: `step`, the `MISMATCH_COLUMNS` and, per setting,
            `{prefix}_{column}` for the `SETTING_COLUMNS` (None where a step has no value).
        settings: each setting's column prefix, in the analysis' order.
        names: each setting's name, in the same order.
        band: the early steps' band of `healthy_k3` (`iscore.stats.noise.Baseline`), None with fewer
            than three steps.
        events: what changed and when, by step.
    """

    rows: tuple[dict[str, Any], ...]
    settings: tuple[str, ...]
    names: tuple[str, ...]
    band: Baseline | None
    events: tuple[Event, ...]

    @classmethod
    def of(
        cls,
        mismatch: MismatchSummary,
        settings: Sequence[SettingSummary],
        specs: Sequence[Spec],
        targets: Targets,
    ) -> Trend:
        """The trend of an analysis: its `mismatch` and `settings` (computed for `specs`),
        with the `setting_degrades` events judged against `targets`."""
        run = GrowingTrend(specs, [s.name for s in settings], targets)
        by_step: dict[int, tuple[dict[str, Any] | None, list[dict[str, Any] | None]]] = {}
        for r in mismatch.by_step:
            by_step[r["step"]] = (r, [None] * len(settings))
        for i, setting in enumerate(settings):
            for r in setting.by_step:
                by_step.setdefault(r["step"], (None, [None] * len(settings)))[1][i] = r
        for step, (row, rows) in by_step.items():
            run.set(step, row, rows)
        return run.trend()

    @property
    def columns(self) -> list[str]:
        """The per-step table's columns, in order."""
        return _columns(list(self.settings))

    def table(self) -> pa.Table:
        """The per-step table as Arrow (what `iscore watch --alert` queries as `steps`)."""
        columns = self.columns
        types = {"step": pa.int64(), "tokens": pa.int64(), "sequences": pa.int64()}
        types["broken_sequences"] = pa.int64()
        return pa.table(
            {c: pa.array([r[c] for r in self.rows], types.get(c, pa.float64())) for c in columns}
        )

    def to_dict(self) -> dict[str, Any]:
        """The analysis document's `trend` section (docs/analysis.md#trend)."""
        return {
            "columns": self.columns,
            "settings": [
                {"name": name, "prefix": prefix}
                for name, prefix in zip(self.names, self.settings, strict=True)
            ],
            "steps": [dict(r) for r in self.rows],
            "band": None
            if self.band is None
            else {
                "metric": "k3",
                "steps": self.band.steps,
                "median": self.band.median,
                "upper": self.band.upper,
            },
            "events": [e.to_dict() for e in self.events],
        }


class GrowingTrend:
    """The trend of a run whose steps come (and change) one at a time: `set` rebuilds the
    row of one step, and `trend` judges the events over the rows kept, so that a followed
    run's new step costs its own row, not the run's (`iscore.passes.follow`). `Trend.of` is one
    built whole.

    Args:
        specs: the settings, in the analysis' order.
        names: their names, in the same order.
        targets: what the `setting_degrades` events hold each setting to.
    """

    def __init__(self, specs: Sequence[Spec], names: Sequence[str], targets: Targets):
        self.prefixes = setting_columns(specs, number_repeats=True)
        self.names = tuple(names)
        self.targets = targets
        self._columns = _columns(self.prefixes)
        self._rows: dict[int, dict[str, Any]] = {}
        # Per setting, each step's by_step row that has tokens, and the targets it misses.
        self._judged: list[dict[int, tuple[dict[str, Any], list[str]]]] = [
            {} for _ in self.prefixes
        ]
        self._steps: list[int] | None = []  # sorted steps; None when a step came or went

    def set(
        self,
        step: int,
        mismatch: dict[str, Any] | None,
        settings: Sequence[dict[str, Any] | None],
    ) -> None:
        """Make `step`'s row that of its `mismatch.by_step` row and each setting's
        `by_step` row (None where there is none; all None removes the step)."""
        had = step in self._rows
        for judged in self._judged:
            judged.pop(step, None)
        if mismatch is None and all(r is None for r in settings):
            self._rows.pop(step, None)
            if had:
                self._steps = None
            return
        self._rows[step] = row = dict.fromkeys(self._columns)
        row["step"] = step
        if mismatch is not None:
            for k in MISMATCH_COLUMNS:
                row[k] = mismatch.get(k)
        for prefix, r, judged in zip(self.prefixes, settings, self._judged, strict=True):
            if r is None:
                continue
            values = r | {"truncated_fraction": _truncated(r)}
            for k in SETTING_COLUMNS:
                row[f"{prefix}_{k}"] = values.get(k)
            if r.get("tokens"):
                judged[step] = (r, self.targets.violations(r))
        if not had:
            self._steps = None

    def trend(self) -> Trend:
        """The trend of the rows set so far."""
        if self._steps is None:
            self._steps = sorted(self._rows)
        table = tuple(self._rows[step] for step in self._steps)
        k3 = [r["healthy_k3"] for r in table if r["healthy_k3"] is not None]
        band = Baseline.of(k3) if len(k3) >= 3 else None
        growth = _growth(table, band)
        events = [
            *growth,
            *_broken(table),
            *_offset(table),
            *_degrades(self._judged, self.names, self.prefixes, self.targets),
            *_inert(table, band, growth, self.names, self.prefixes),
        ]
        return Trend(
            table,
            tuple(self.prefixes),
            self.names,
            band,
            tuple(sorted(events, key=lambda e: (e.step, list(EVENT_KINDS).index(e.kind)))),
        )


def degrades_from(misses: Sequence[bool]) -> int | None:
    """The index of the first step from which a setting misses its targets at every step to
    the last (at least two), having met them on every early step (those of the k3 band,
    `iscore.stats.noise.early_steps`); None where there is none. A setting that misses them now and
    then from the start is not one that changed.

    >>> degrades_from([False] * 8 + [False, True, False, True, True])
    11
    >>> degrades_from([True] + [False] * 7 + [True, True, True]) is None  # missed early on
    True
    """
    n = len(misses)
    early = early_steps(n)
    t = n
    while t > early and misses[t - 1]:
        t -= 1
    if n - t < 2 or any(misses[:early]):
        return None
    return t


def _columns(prefixes: Sequence[str]) -> list[str]:
    return [
        "step",
        *MISMATCH_COLUMNS,
        *(f"{p}_{c}" for p in prefixes for c in SETTING_COLUMNS),
    ]


def _truncated(row: dict[str, Any]) -> float | None:
    high, low = row.get("truncated_high_fraction"), row.get("truncated_low_fraction")
    return None if high is None or low is None else high + low


def _growth(rows: Sequence[dict[str, Any]], band: Baseline | None) -> list[Event]:
    measured = [r for r in rows if r["healthy_k3"] is not None]
    rise = first_rise([r["healthy_k3"] for r in measured]) if band is not None else None
    if rise is None:
        return []
    start, last = measured[rise], measured[-1]
    lasting = min(SUSTAIN_STEPS, len(measured) - rise)
    return [
        Event(
            "growth",
            start["step"],
            "healthy_k3",
            f"k3 (over the sequences not called broken) {start['healthy_k3']:.3g} at step "
            f"{start['step']}, above the early band's edge {band.upper:.3g} (median "
            f"{band.median:.3g} of {band.early}) for {lasting} steps in a row; "
            f"{last['healthy_k3'] / band.median:.3g}x that median by step {last['step']}",
        )
    ]


def _broken(rows: Sequence[dict[str, Any]]) -> list[Event]:
    for r in rows:
        if r.get("broken_sequences"):
            return [
                Event(
                    "broken_sequences",
                    r["step"],
                    "broken_sequences",
                    f"{r['broken_sequences']:,} of the step's {r['sequences']:,} sequences "
                    f"{BROKEN_WORDS} (centre {r['d_median']:+.3g}, spread "
                    f"{r['d_spread']:.3g}): a stale replica or a bad rank, not noise",
                )
            ]
    return []


def _offset(rows: Sequence[dict[str, Any]]) -> list[Event]:
    for r in rows:
        ratio, stderr = r.get("healthy_ratio_mean"), r.get("healthy_ratio_mean_stderr")
        if ratio is None or stderr is None or math.isnan(ratio):
            continue
        z = ratio_bias(ratio, stderr)
        if z is not None:
            return [
                Event(
                    "offset",
                    r["step"],
                    "healthy_ratio_mean",
                    f"<e^d> = {ratio:.4f} over the step's sequences not called broken (z = "
                    f"{z:+.0f}): it must be 1 when both sides score the same distribution "
                    "(processed vs raw log-probs, top-p/top-k, a temperature, a token shift)",
                )
            ]
    return []


_TARGETED = ("token_masked_fraction", "seq_masked_fraction", "lr_scale", "ess")
_MET = {"token_masked_fraction": 0.0, "seq_masked_fraction": 0.0, "lr_scale": 1.0, "ess": 1.0}
"""Values that meet any targets: with one statistic of a step in place of its value there,
`Targets.violations` says whether that statistic alone misses them."""


def _missing(row: dict[str, Any], targets: Targets) -> list[str]:
    """The statistics of a step's row that miss the targets, each judged alone."""
    return [k for k in _TARGETED if targets.violations(_MET | {k: row[k]})]


def _degrades(
    judged: Sequence[dict[int, tuple[dict[str, Any], list[str]]]],
    names: Sequence[str],
    prefixes: Sequence[str],
    targets: Targets,
) -> list[Event]:
    events = []
    for by_step, name, prefix in zip(judged, names, prefixes, strict=True):
        steps = [by_step[step] for step in sorted(by_step)]
        t = degrades_from([bool(misses) for _, misses in steps])
        if t is None:
            continue
        (row, misses), before, last = steps[t], steps[t - 1][0], steps[-1][0]
        events.append(
            Event(
                "setting_degrades",
                row["step"],
                ", ".join(f"{prefix}_{k}" for k in _missing(row, targets)),
                f"{name} met the targets until step {before['step']} and misses "
                f"them at every step from {row['step']} to {last['step']} (at step "
                f"{row['step']}: {'; '.join(misses)})",
                name,
            )
        )
    return events


INERT_Z = 2.0
"""Binomial standard errors above its early level within which a mask rate has not risen."""


def inert_from(masked: Sequence[float], tokens: Sequence[int], rise: int) -> bool:
    """Whether a setting's token mask rate stayed at its early level while k3 rose: at the
    latest `SUSTAIN_STEPS` steps of the rise (from index `rise` on), the median rate is at most
    the early steps' median plus `INERT_Z` binomial standard errors of a step's tokens. A
    setting that masks nothing at any step has no band to go inert.

    >>> inert_from([0.01] * 8 + [0.05, 0.008, 0.012, 0.01], [1000] * 12, 8)
    True
    >>> inert_from([0.01] * 8 + [0.01, 0.05, 0.06, 0.07], [1000] * 12, 8)
    False
    """
    if not any(masked):
        return False
    early = sorted(masked[: early_steps(len(masked))])
    level = early[len(early) // 2]
    latest = slice(max(rise, len(masked) - SUSTAIN_STEPS), len(masked))
    after = sorted(masked[latest])
    n = min(tokens[latest])
    noise = math.sqrt(max(level, 1 / n) * (1 - level) / n)
    return after[len(after) // 2] <= level + INERT_Z * noise


def _inert(
    rows: Sequence[dict[str, Any]],
    band: Baseline | None,
    growth: Sequence[Event],
    names: Sequence[str],
    prefixes: Sequence[str],
) -> list[Event]:
    """`band_inert` for each setting whose mask rate is at its early level at the latest steps,
    where k3 is still above the early band: the event's step is the growth's."""
    if not growth or band is None:
        return []
    step = growth[0].step
    events = []
    for name, prefix in zip(names, prefixes, strict=True):
        column = f"{prefix}_token_masked_fraction"
        measured = [
            r for r in rows if r[column] is not None and r["tokens"] and r["healthy_k3"] is not None
        ]
        rise = next((i for i, r in enumerate(measured) if r["step"] >= step), None)
        if rise is None or rise < early_steps(len(measured)):
            continue
        at = measured[max(rise, len(measured) - SUSTAIN_STEPS) :]
        k3 = sorted(r["healthy_k3"] for r in at)[len(at) // 2]
        masked = [r[column] for r in measured]
        if k3 <= band.upper or not inert_from(masked, [r["tokens"] for r in measured], rise):
            continue
        early = sorted(masked[: early_steps(len(masked))])
        events.append(
            Event(
                "band_inert",
                step,
                column,
                f"{name} masks {', '.join(f'{r[column]:.2%}' for r in at)} of the tokens at "
                f"steps {at[0]['step']}-{at[-1]['step']}, where k3 is {k3 / band.median:.3g}x "
                f"the early median (median of those steps); it masked "
                f"{early[len(early) // 2]:.2%} at {band.early}: its band does not follow the "
                "mismatch",
                name,
            )
        )
    return events
