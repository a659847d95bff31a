"""A warning before the damage: when `iscore watch`'s default alerts fire on a run whose mismatch
starts mid-run, against when the uncorrected run's reward falls behind (docs/why.md).

For each regime and seed, an uncorrected run ("off") and a corrected one (verl's default, token
TIS at cap 2) train side by side on the same draws, with an IcePop band (0.5-5) beside them so
that its mask rate is measured too. The uncorrected run's batches are written as step files
(`DumpWriter`, one folder per step) and landed one step at a time in a folder a
`iscore.passes.follow.Follower` polls, as `iscore watch` does; the **alert** is the step that had
just landed when `iscore.advice.trend.default_alert` first held.

The **damage** is the first step from which the corrected run's exact expected reward is ahead
of the uncorrected one's by more than `Z` standard errors of their seed-by-seed difference, at
that step and each of the `SUSTAIN` after it: a one-sided paired test over the seeds, held so
that one lucky step is not damage. The **lead time** is the damage step minus each seed's alert
step. The **first statistic to move** is, per seed, the earliest of the trend's columns to rise
above its early steps' band (`iscore.stats.first_rise`, the rule of the growth event).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from iscore import frameworks
from iscore.advice.trend import BROKEN_STEPS, Trend, broken_run, default_alert
from iscore.dump import DumpWriter
from iscore.packed.batch import TokenBatch
from iscore.passes.follow import Follower
from iscore.stats import first_rise
from testbed.engine import Regime
from testbed.sweep import CLASSIC, _off
from testbed.table import mean_se, paired
from testbed.task import Task
from testbed.training import Training, train

Z = 2.0
"""Standard errors of the paired reward gap beyond which the uncorrected run is behind."""

SUSTAIN = 5
"""Steps after the damage step at which the gap must still be beyond `Z` standard errors."""

TUNE_SEEDS = tuple(range(8))
"""The seeds the default alerts were chosen on (the table of docs/why.md)."""

TEST_SEEDS = tuple(range(100, 104))
"""The held-out seeds the tests check the default alerts on."""

STEPS = 200
"""Updates per run: the change begins at step 60, and the damage shows by step ~150."""

STATISTICS = {
    "k3": "healthy_k3",
    "tail share": "tail_share",
    "broken sequences": "broken_sequences",
    "1 - ESS (TIS 2)": "tis_ess",
    "mask rate (IcePop)": "icepop_token_masked_fraction",
}
"""The trend's columns whose first rise is compared: label -> column (`1 - ESS` of the TIS
setting, where the ESS falls)."""


RULES = {
    "growth of k3": lambda trend: next((e.step for e in trend.events if e.kind == "growth"), None),
    **{
        ("broken sequences on a step" if k == 1 else f"broken sequences on {k} steps in a row"): (
            lambda trend, k=k: broken_run(trend.rows, k)
        )
        for k in (1, 2, BROKEN_STEPS, 5)
    },
}
"""The alert rules the defaults were chosen from: label -> the step a trend shows it from, or
None. The default (`default_alert`) is the growth event or broken sequences on `BROKEN_STEPS`
steps in a row."""


@dataclass(frozen=True, slots=True)
class Seeded:
    """One seed's run as watch saw it.

    Attributes:
        alert: the step that had landed when a default alert first fired, or None.
        kind: that alert's condition, in words.
        rules: for each of `RULES`, the step that had landed when it first held, or None.
        first: the statistics that rose first (ties together), and the step they did.
        events: every (kind, step) of the run's trend at its end.
        broken: how many of its steps had broken sequences.
        steps: how many steps it had.
        tokens: the tokens of a step.
    """

    alert: int | None
    kind: str | None
    rules: dict[str, int | None]
    first: tuple[tuple[str, ...], int | None]
    events: tuple[tuple[str, int], ...]
    broken: int
    steps: int
    tokens: int


@dataclass(frozen=True, slots=True)
class LeadTime:
    """A regime's line of the table.

    Attributes:
        regime: the regime.
        seeds: the seeds.
        damage: the damage step, or None where the uncorrected run never falls behind.
        runs: each seed's `Seeded`, in seed order.
        gap: the corrected run's expected reward minus the uncorrected one's at the last
            step, and its standard error over the seeds.
    """

    regime: Regime
    seeds: tuple[int, ...]
    damage: int | None
    runs: tuple[Seeded, ...]
    gap: tuple[float, float]

    @property
    def leads(self) -> list[int | None]:
        """Each seed's damage step minus its alert step (None without either)."""
        return [
            None if self.damage is None or r.alert is None else self.damage - r.alert
            for r in self.runs
        ]


def damage_step(off: np.ndarray, corrected: np.ndarray, start: int) -> int | None:
    """The first step from `start` (the change's) from which `corrected` leads `off` by more
    than `Z` standard errors of their paired difference for `SUSTAIN` + 1 steps in a row; None
    where it never does. Before the change the regime is bf16's, where the two tie
    (docs/recommend.md), though a tiny paired gap of the first steps can be beyond `Z`.

    Args:
        off, corrected: float [seeds, steps], the runs' expected rewards.
        start: the step the regime's change begins at.

    >>> steps = np.arange(30.0)
    >>> off = np.stack([steps * 0, steps * 0 + 0.01])
    >>> damage_step(off, off + np.where(steps >= 20, [[0.1], [0.12]], 0), 10)
    20
    """
    gap = corrected - off
    mean = gap.mean(0)
    se = gap.std(0, ddof=1) / np.sqrt(gap.shape[0])
    behind = mean > Z * se
    for t in range(start, len(behind) - SUSTAIN):
        if behind[t : t + SUSTAIN + 1].all():
            return t
    return None


def first_moved(trend: Trend) -> tuple[tuple[str, ...], int | None]:
    """The statistics of `STATISTICS` that rose above their early band first (broken sequences
    count from the first of `BROKEN_STEPS` steps in a row with them), and that step."""
    found = {}
    for label, column in STATISTICS.items():
        values = [r[column] for r in trend.rows]
        if column == "tis_ess":
            values = [None if v is None else 1 - v for v in values]
        if column == "broken_sequences":
            step = broken_run(trend.rows, BROKEN_STEPS)
        else:
            rise = first_rise([v or 0.0 for v in values])
            step = None if rise is None else trend.rows[rise]["step"]
        if step is not None:
            found[label] = step
    if not found:
        return (), None
    step = min(found.values())
    return tuple(label for label, s in found.items() if s == step), step


def settings() -> list:
    """What watch follows: the IcePop band of `CLASSIC` and verl's default (token TIS 2)."""
    fw = frameworks.get("verl")
    icepop = next(setting for label, _, setting in CLASSIC if label == "icepop 0.5-5")
    return [fw.express(icepop, "icepop"), replace(fw.presets()[fw.default], name="tis")]


def watch_run(recorded: Sequence[TokenBatch], seeds: int, index: int, folder: Path) -> Seeded:
    """Write seed `index`'s batches of `recorded` (those of `seeds` seeds, seed by seed) as step
    files, land them a step at a time in a folder and poll it as `iscore watch` does."""
    source, run = folder / "source", folder / "run"
    # Every step waits for the writer's thread: a dropped step would be a hole in the run.
    with DumpWriter(source, rank=0, max_pending=len(recorded) + 1) as writer:
        for part in recorded:
            length = int(part.lengths[0])
            rollout, trainer = (
                x.view(seeds, -1, length)[index] for x in (part.rollout, part.train)
            )
            writer.add(
                step=int(part.step[0]), rollout_logprobs=list(rollout), train_logprobs=list(trainer)
            )
    follower = Follower(run, settings())
    alert = kind = None
    rules: dict[str, int | None] = dict.fromkeys(RULES)
    for step_dir in sorted(source.iterdir()):
        target = run / step_dir.name
        target.mkdir(parents=True)
        for file in step_dir.iterdir():
            os.link(file, target / file.name)
        follower.poll()
        trend, landed = follower.trend, int(step_dir.name.removeprefix("step_"))
        hit = default_alert(trend) if alert is None else None
        if hit is not None:
            alert, kind = landed, hit.what
        for label, rule in RULES.items():
            if rules[label] is None and rule(trend) is not None:
                rules[label] = landed
    events = tuple((e.kind, e.step) for e in follower.trend.events)
    rows = follower.trend.rows
    broken = sum(bool(r["broken_sequences"]) for r in rows)
    first = first_moved(follower.trend)
    return Seeded(alert, kind, rules, first, events, broken, len(rows), rows[0]["tokens"])


def measure(
    regime: Regime, seeds: Sequence[int], training: Training | None = None, task: Task | None = None
) -> LeadTime:
    """Train the regime's uncorrected and corrected runs over `seeds`, watch each uncorrected
    run, and find the damage step."""
    training = training or Training(steps=STEPS, curve_every=1)
    specs = [_off("verl"), settings()[1]]
    trained = train(task or Task(), regime, training, specs, seeds, record=range(training.steps))
    off, corrected = (
        np.array([[value for _, value in run.curve] for run in runs]) for runs in trained.runs
    )
    runs = []
    for i in range(len(seeds)):
        with tempfile.TemporaryDirectory(prefix="leadtime-") as folder:
            runs.append(watch_run(trained.recorded, len(seeds), i, Path(folder)))
    start = change_step(regime)
    damage = None if start is None else damage_step(off, corrected, start)
    gap = paired(corrected[:, -1].tolist(), off[:, -1].tolist())
    return LeadTime(regime, tuple(seeds), damage, tuple(runs), gap)


def change_step(regime: Regime) -> int | None:
    """The step a mid-run regime's change begins at; None for a regime without one."""
    return regime.stale_from if regime.stale_from is not None else regime.grow_from


def markdown(lines: Sequence[LeadTime], made: str = "") -> str:
    """The lead-time table (a row per regime), then the rules the default alerts were chosen
    from (a row per rule of `RULES`: on a regime without a change, each alert is a false one)."""
    out = [made, ""] if made else []
    out += [
        "| regime | change from | seeds | default alert (step it fired at, condition) | damage "
        "step | lead time (steps) | reward gap at the end (TIS 2 - off) | first statistic to "
        "move (seeds) | band goes inert (seeds) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for line in lines:
        r, start = line.regime, change_step(line.regime)
        fired = [run.alert for run in line.runs if run.alert is not None]
        kinds = sorted({run.kind for run in line.runs if run.kind})
        alert = "none" if not fired else f"{_span(fired)} ({'; '.join(kinds)})"
        if fired and len(fired) < len(line.runs):
            alert += f"; none on {len(line.runs) - len(fired)} seeds"
        leads = [x for x in line.leads if x is not None]
        lead = "-" if not leads else f"{_span(leads)} (mean {mean_se(leads)[0]:.0f})"
        firsts: dict[str, int] = {}
        for run in line.runs:
            for label in run.first[0] or ("none",):
                firsts[label] = firsts.get(label, 0) + 1
        first = ", ".join(
            f"{label} ({n})" for label, n in sorted(firsts.items(), key=lambda x: -x[1])
        )
        inert = sum(any(kind == "band_inert" for kind, _ in run.events) for run in line.runs)
        damage = "-" if start is None else "none" if line.damage is None else str(line.damage)
        out.append(
            f"| {r.name} | {'-' if start is None else start} | {_seeds(line.seeds)} | {alert} "
            f"| {damage} | {lead} | {line.gap[0]:+.3f} +- {line.gap[1]:.3f} | {first} "
            f"| {inert} of {len(line.runs)} |"
        )
    out += [
        "",
        "| rule | " + " | ".join(f"{line.regime.name}: fired, step" for line in lines) + " |",
        "|---|" + "---|" * len(lines),
    ]
    for label in RULES:
        cells = []
        for line in lines:
            steps = [run.rules[label] for run in line.runs if run.rules[label] is not None]
            where = f", {_span(steps)}" if steps else ""
            cells.append(f"{len(steps)} of {len(line.runs)}{where}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    for line in lines:
        if change_step(line.regime) is None:
            broken = sum(run.broken for run in line.runs)
            steps = sum(run.steps for run in line.runs)
            out.append(
                f"\nOn {line.regime.name}, {broken} of {steps} steps had broken sequences "
                f"({broken / steps:.2%}): the broken test's false positives on steps of "
                f"{line.runs[0].tokens:,} tokens."
            )
    return "\n".join(out) + "\n"


def _seeds(seeds: Sequence[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 1 else str(seeds[0])


def _span(values: Sequence[int]) -> str:
    low, high = min(values), max(values)
    return str(low) if low == high else f"{low}-{high}"
