"""The sweep's statistics and its tables (Markdown for docs/recommend.md, JSON for machines).

Every candidate of a regime trains on the same seeds, and a seed fixes the task, the initial
policy and every random draw of the rollouts (`testbed.task`, `testbed.engine`), so candidates
are compared seed by seed: the difference of two candidates is the mean over seeds of their
per-seed differences, and its standard error is those differences' standard deviation over
sqrt(seeds). A candidate is **within noise of the best** when its difference to the best mean
is at most twice that standard error; it **beats** another when it is ahead by more than twice.

>>> diff, se = paired([0.5, 0.6, 0.7], [0.4, 0.6, 0.5])
>>> round(diff, 3), round(se, 3)
(0.1, 0.058)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from testbed.engine import Regime
from testbed.sweep import Candidate, Dump, Sweep
from testbed.training import Run

Z = 2.0
"""Standard errors of a paired difference within which two candidates are not told apart."""


def mean_se(values: Sequence[float]) -> tuple[float, float]:
    """(mean, standard error of the mean); the error is 0 for fewer than two values."""
    n = len(values)
    mean = sum(values) / n
    if n < 2:
        return mean, 0.0
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return mean, math.sqrt(var / n)


def paired(a: Sequence[float], b: Sequence[float]) -> tuple[float, float]:
    """(mean of a - b, its standard error), seed by seed."""
    return mean_se([x - y for x, y in zip(a, b, strict=True)])


@dataclass(frozen=True, slots=True)
class Row:
    """One candidate's line of a regime's table.

    Attributes:
        candidate: the setting.
        rewards: its final reward on each seed.
        mean, se: their mean and standard error.
        gap, gap_se: the best candidate's mean minus this one's, seed by seed, and its
            standard error (0 and 0 for the best itself).
        stats: iscore's statistics of the setting on the training batches (`STATS`),
            averaged over the seeds.
    """

    candidate: Candidate
    rewards: tuple[float, ...]
    mean: float
    se: float
    gap: float
    gap_se: float
    stats: dict[str, float]

    @property
    def within_noise(self) -> bool:
        return self.gap <= Z * self.gap_se


@dataclass(frozen=True, slots=True)
class RegimeTable:
    """A regime's rows, in candidate order, and its verdicts."""

    regime: Regime
    dump: Dump
    rows: tuple[Row, ...]
    best: str

    def find(self, label: str) -> Row | None:
        """The row of the candidate with this label or alias (the pick may be the default),
        or None where it was not trained."""
        return next(
            (r for r in self.rows if label in (r.candidate.label, *r.candidate.aliases)), None
        )

    def row(self, label: str) -> Row:
        found = self.find(label)
        if found is None:
            raise KeyError(f"no candidate {label!r} in the {self.regime.name} table")
        return found

    def versus(self, label: str, other: str) -> tuple[float, float]:
        """(label's mean reward minus other's, seed by seed, and its standard error)."""
        return paired(self.row(label).rewards, self.row(other).rewards)

    def beats(self, label: str, other: str) -> bool:
        diff, se = self.versus(label, other)
        return diff > Z * se


def summarize(
    regime: Regime, dump: Dump, found: Sequence[Candidate], runs: dict[str, list[Run]]
) -> RegimeTable:
    """A regime's table from every candidate's runs (one per seed, in the sweep's order)."""
    rewards = {c.label: tuple(run.final_reward for run in runs[c.label]) for c in found}
    best = max(found, key=lambda c: mean_se(rewards[c.label])[0]).label
    rows = []
    for c in found:
        mine = rewards[c.label]
        gap, gap_se = paired(rewards[best], mine)
        stats = {
            name: mean_se([run.stats[name] for run in runs[c.label]])[0]
            for name in runs[c.label][0].stats
        }
        rows.append(Row(c, mine, *mean_se(mine), gap, gap_se, stats))
    return RegimeTable(regime, dump, tuple(rows), best)


def verdict(table: RegimeTable) -> str:
    """The regime's answer in a line: is the pick within noise of the best, and does it beat
    no correction."""
    pick = table.find("pick")
    if pick is None:
        return "the pick was not trained"
    words = "within noise of the best" if pick.within_noise else "**worse than the best**"
    line = f"pick {words} ({_diff(-pick.gap, pick.gap_se)} vs {table.best})"
    if table.find("off") is not None:
        diff, se = table.versus("pick", "off")
        relation = (
            "beats off" if diff > Z * se else "**loses to off**" if -diff > Z * se else "ties off"
        )
        line += f"; {relation} ({_diff(diff, se)})"
    return line


def markdown(tables: Sequence[RegimeTable], sweep: Sweep, made: str = "") -> str:
    """The tables as Markdown: how they were made (`made`, a line), a summary line per regime,
    then each regime's candidates."""
    lines = [made, ""] if made else []
    lines += [
        f"Framework {sweep.framework}, {len(sweep.seeds)} seeds "
        f"({sweep.seeds[0]}..{sweep.seeds[-1]}), {sweep.training.steps} steps of "
        f"{sweep.training.groups} x {sweep.training.group_size} sequences; final reward = "
        f"exact expected reward of the last {sweep.training.final_window} steps' policies "
        f"(a uniform policy earns {1 / sweep.task.vocab:.3f}); "
        f"mean +- standard error over seeds; gap = best - candidate, seed by seed, within noise "
        f"when gap <= {Z:g} SE.",
        "",
        "| regime | best | pick | verdict |",
        "|---|---|---|---|",
    ]
    for t in tables:
        pick = t.find("pick")
        title = "" if pick is None else pick.candidate.title
        lines.append(f"| {t.regime.name} | {t.best} | {title} | {verdict(t)} |")
    for t in tables:
        lines += [
            "",
            f"**{t.regime.name}**: {t.regime.description}, {t.regime.length} tokens. The "
            f"recommendation read steps {t.dump.steps[0]}-{t.dump.steps[1]} of an uncorrected "
            f"run ({t.dump.sequences} sequences): {'; '.join(t.dump.regimes)}.",
            "",
            "| candidate | setting | final reward | gap to best | LR scale | tokens masked "
            "| seqs masked | ESS |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in t.rows:
            label = r.candidate.label
            if r.candidate.aliases:
                label += f" (= {', '.join(r.candidate.aliases)})"
            gap = "best" if r.candidate.label == t.best else _gap(r)
            s = r.stats
            lines.append(
                f"| {label} | {r.candidate.title} | {r.mean:.3f} +- {r.se:.3f} | {gap} "
                f"| {s['lr_scale']:.3f} | {s['token_masked_fraction']:.1%} "
                f"| {s['seq_masked_fraction']:.1%} | {s['ess']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def _gap(r: Row) -> str:
    text = f"{r.gap:.3f} +- {r.gap_se:.3f}"
    return text if r.within_noise else f"**{text}**"


def _diff(diff: float, se: float) -> str:
    return f"{diff:+.3f} +- {se:.3f}"


def to_json(tables: Sequence[RegimeTable], sweep: Sweep) -> dict:
    """The sweep's results as plain JSON values: its settings, and per regime the dump the
    recommendation read and every candidate's config, rewards and statistics."""
    return {
        "framework": sweep.framework,
        "seeds": list(sweep.seeds),
        "task": asdict(sweep.task),
        "training": asdict(sweep.training),
        "dump_steps": list(sweep.dump_steps),
        "dump_seed": sweep.dump_seed,
        "z": Z,
        "regimes": [
            {
                "regime": asdict(t.regime),
                "dump": asdict(t.dump),
                "best": t.best,
                "verdict": verdict(t),
                "candidates": [
                    {
                        "label": r.candidate.label,
                        "aliases": list(r.candidate.aliases),
                        "title": r.candidate.title,
                        "config": r.candidate.config,
                        "rewards": list(r.rewards),
                        "mean": r.mean,
                        "se": r.se,
                        "gap": r.gap,
                        "gap_se": r.gap_se,
                        "within_noise": r.within_noise,
                        "stats": r.stats,
                    }
                    for r in t.rows
                ],
            }
            for t in tables
        ],
    }
