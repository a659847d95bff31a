"""Is this mismatch normal? One verdict for a dump and for each of its steps.

- `broken`: the data shows broken sequences (far outside their step's noise: a stale replica,
  a bad rank) or a semantics bug (a one-sided offset, a biased ratio, a temperature on one
  side). Both are the mismatch flags' decisions (`iscore.advice.flags`, over `iscore.stats.noise`),
  read here, never re-derived: no IS correction repairs them.
- `elevated`: no such flag, but a statistic lies outside a band a framework's docs publish
  (`Framework.bands`, listed by `iscore.advice.reference.bands`): FP8-like noise, MoE routing
  flips, drift.
- `normal`: inside every published band.

Each step is judged on its own: its broken sequences, the test of E_rollout[e^d] = 1 on its
healthy tokens (`noise.ratio_bias`, the test of the dump's `ratio_mean_bias` flag and of the
trend's `offset` event) and the bands on its
statistics; a semantics bug found on the whole dump (a one-sided temperature is a
correlation over every token) breaks every step.

With a noise floor (a second trainer recompute, `floor_logprob`), `Floor` states the mismatch
as a multiple of the trainer's own noise and names the bands that sit below it: bands no engine
can meet while the trainer disagrees with itself by more. The verdict is the bands' alone.

>>> from iscore.passes.analysis import analyze
>>> health = analyze("data/dense_bf16.parquet").health  # `assess` of its mismatch and flags
>>> health.verdict, [s.verdict for s in health.by_step]
('normal', ['normal', 'normal'])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal

from iscore.advice.flags import Flag, flags_of
from iscore.advice.reference import Placement, bands, placements
from iscore.frameworks import HealthBand
from iscore.stats import MismatchSummary, noise

Verdict = Literal["normal", "elevated", "broken"]

VERDICTS: tuple[Verdict, ...] = ("normal", "elevated", "broken")
"""The verdicts, the mildest first."""

HEADLINES: dict[str, str] = {
    "normal": "Normal: inside every band the frameworks publish",
    "elevated": "Elevated: outside a band a framework publishes",
    "broken": "Broken: the data shows broken sequences or a semantics bug",
}
"""Each verdict in a few words, as every surface heads it."""


@dataclass(frozen=True, slots=True)
class Check:
    """One published band, and the value it was judged against.

    Attributes:
        framework: the framework whose docs publish the band (its name for people).
        band: the band.
        value: the dump's (or step's) value of the band's statistic; None where it has none.
    """

    framework: str
    band: HealthBand

    value: float | None

    @property
    def within(self) -> bool | None:
        """Whether the value is inside the band; None without a finite value."""
        if self.value is None or not math.isfinite(self.value):
            return None
        return self.band.contains(self.value)

    def short(self) -> str:
        """A line such as "NeMo-RL gen_kl_error 0.0498 (healthy <= 0.001)"."""
        value = "no value" if self.value is None else f"{self.value:.4g}"
        return f"{self.framework} {self.band.logged_as} {value} (healthy {self.band.describe()})"

    def describe(self) -> str:
        """`short`, and where the value is outside the band what that means, per its source."""
        said = self.short()
        return said if self.within is not False else f"{said}: {self.band.meaning}"

    def to_dict(self) -> dict[str, Any]:
        b = self.band
        return {
            "statistic": b.statistic,
            "value": self.value,
            "low": b.low,
            "high": b.high,
            "healthy": b.describe(),
            "within": self.within,
            "framework": self.framework,
            "logged_as": b.logged_as,
            "meaning": b.meaning,
            "source": {"name": b.source.name, "url": b.source.url},
        }


FLOOR_STATISTICS = {"k3": "k3", "abs_diff_mean": "abs_diff_mean"}
"""The band statistics the floor has a value of: the statistic -> its key in `mismatch.floor`."""


@dataclass(frozen=True, slots=True)
class Floor:
    """The mismatch against the trainer's own noise floor (`MismatchSummary.floor`).

    Attributes:
        k3_ratio: the rollout mismatch's k3 over the floor's; None where the floor is 0.
        abs_diff_ratio: the same of the mean |d|.
        below: the bands whose upper bound lies below the floor's own value of their
            statistic (`Check`s, judged on the floor's value).
    """

    k3_ratio: float | None
    abs_diff_ratio: float | None
    below: tuple[Check, ...] = ()

    def sentence(self) -> str:
        """The mismatch as a multiple of the floor, and the bands below it, in a sentence.

        >>> Floor(80.2, 9.1).sentence()
        "The engine's mismatch is 80x the trainer's own noise (k3; 9.1x in mean |d|)."
        """
        if self.k3_ratio is None:
            said = "The trainer's second recompute repeats it exactly: no noise floor to compare."
        else:
            times = f"{self.k3_ratio:.2g}x" if self.k3_ratio < 10 else f"{self.k3_ratio:.0f}x"
            absd = (
                "" if self.abs_diff_ratio is None else f"; {self.abs_diff_ratio:.2g}x in mean |d|"
            )
            said = f"The engine's mismatch is {times} the trainer's own noise (k3{absd})."
            if self.k3_ratio <= 1:
                said += (
                    " The rollout agrees with the trainer as well as the trainer agrees with "
                    "itself."
                )
        for check in self.below:
            said += (
                f" {check.framework}'s band on {check.band.logged_as} ({check.band.describe()}) "
                f"sits below the floor ({check.value:.3g}): no engine can meet it."
            )
        return said

    def to_dict(self) -> dict[str, Any]:
        return {
            "k3_ratio": self.k3_ratio,
            "abs_diff_ratio": self.abs_diff_ratio,
            "sentence": self.sentence(),
            "below_floor": [c.to_dict() for c in self.below],
        }


def floor_of(floor: dict[str, Any] | None) -> Floor | None:
    """The `Floor` of a `mismatch.floor` (or a step row's `floor_*` fields, renamed); None
    without one.

    >>> floor = {"k3": 0.01, "abs_diff_mean": 0.1, "k3_ratio": 3.0, "abs_diff_ratio": 2.0}
    >>> floor_of(floor).below[0].short()
    'NeMo-RL gen_kl_error 0.01 (healthy <= 0.001)'
    """
    if floor is None:
        return None
    below = tuple(
        check
        for check in _checks(lambda statistic: floor.get(FLOOR_STATISTICS.get(statistic, "")))
        if check.within is False and check.band.high is not None
    )
    return Floor(floor.get("k3_ratio"), floor.get("abs_diff_ratio"), below)


def whole_distribution(mismatch: MismatchSummary) -> str | None:
    """The sampled tokens' mismatch beside the whole distribution's, in a sentence, where the
    dump has top-k columns (`MismatchSummary.distribution`, docs/distribution.md); else None.

    >>> m = analyze("data/fp8.parquet", store=None).mismatch  # doctest: +SKIP
    >>> whole_distribution(m) is None  # no top-k columns               # doctest: +SKIP
    True
    """
    found = mismatch.distribution
    if not found:
        return None
    kl = found["kl"]
    return (
        f"The sampled tokens differ by mean |d| {mismatch.abs_diff_mean:.3g} nats (k3 "
        f"{mismatch.k3:.3g}); the distributions differ by KL {kl['estimate']:.3g} over the "
        f"whole vocabulary (estimated from the top-k log-probs; at least {kl['lower']:.3g}), "
        f"and the trainer's top-1 is the engine's at {found['top1_agreement']:.1%} of tokens."
    )


@dataclass(frozen=True, slots=True)
class StepHealth:
    """The verdict of one training step.

    Attributes:
        step: the step.
        verdict: its verdict.
        reasons: why, one line each (empty for `normal`).
        checks: every band, judged on the step's values.
    """

    step: int
    verdict: Verdict
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "verdict": self.verdict,
            "reasons": list(self.reasons),
            "outside": [c.band.statistic for c in self.checks if c.within is False],
        }


@dataclass(frozen=True, slots=True)
class Health:
    """The verdict of a dump, with what it was judged against.

    Attributes:
        verdict: `normal`, `elevated` or `broken`.
        reasons: why, one line each: the flags that break it, the bands it exceeds.
        checks: every published band, with the dump's value.
        by_step: the verdict of each step, in step order.
        flags: the codes of the mismatch flags that make it `broken`.
        placements: where the dump sits among the published measurements
            (`iscore.advice.reference`), one per statistic that has some.
        floor: the mismatch against the trainer's own noise, where the dump has a floor.
    """

    verdict: Verdict
    reasons: tuple[str, ...]
    checks: tuple[Check, ...]
    by_step: tuple[StepHealth, ...]
    flags: tuple[str, ...] = ()
    placements: tuple[Placement, ...] = ()
    floor: Floor | None = None

    @property
    def headline(self) -> str:
        return HEADLINES[self.verdict]

    def steps_by_verdict(self) -> dict[str, list[int]]:
        """The steps of each verdict (those with none left out)."""
        out: dict[str, list[int]] = {}
        for s in self.by_step:
            out.setdefault(s.verdict, []).append(s.step)
        return out

    @property
    def outside(self) -> tuple[Check, ...]:
        """The bands the dump's values lie outside."""
        return tuple(c for c in self.checks if c.within is False)

    def summary(self) -> str:
        """One line: the verdict, and what decided it.

        >>> Health("normal", (), (), ()).summary()
        'normal (inside all 0 published bands)'
        """
        if self.verdict == "normal":
            return f"normal (inside all {len(self.checks)} published bands)"
        if self.verdict == "broken":
            return f"broken: {', '.join(self.flags)}"
        return "elevated: " + "; ".join(c.short() for c in self.outside)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": self.verdict,
            "headline": self.headline,
            "summary": self.summary(),
            "reasons": list(self.reasons),
            "bands": [c.to_dict() for c in self.checks],
            "by_step": [s.to_dict() for s in self.by_step],
            "reference": [p.to_dict() for p in self.placements],
            **({} if self.floor is None else {"floor": self.floor.to_dict()}),
        }


def _checks(value: Callable[[str], Any]) -> tuple[Check, ...]:
    """Every band's check of the statistic `value` gives by name (None where there is none)."""
    return tuple(
        Check(framework, band, _number(value(band.statistic))) for framework, band in bands()
    )


def _number(value: Any) -> float | None:
    return None if value is None else float(value)


def _exceeded(checks: tuple[Check, ...]) -> list[str]:
    return [c.describe() for c in checks if c.within is False]


def assess(mismatch: MismatchSummary, flags: Sequence[Flag]) -> Health:
    """The verdict of an analysis' mismatch diagnostics (`MismatchStats.compute`, its
    `by_step` included) and their `flags`, and of each of its steps."""
    broken = flags_of(flags, "broken") + flags_of(flags, "semantics_bug")
    dump_bug = [f"{f.code} (over the whole dump)" for f in flags_of(flags, "semantics_bug")]
    by_step = tuple(_step(row, dump_bug) for row in mismatch.by_step)
    found = [(f.code, f"{f.code}: {f.message}") for f in broken]
    return replace(_judge(found, mismatch.value, by_step), floor=floor_of(mismatch.floor))


def assess_values(values: dict[str, Any], broken: int, ratio: float, stderr: float) -> Health:
    """The verdict where no flags were computed (`iscore validate`, which reads a dump without
    torch): `values` holds the bands' statistics, `broken` the sequences outside their step's
    noise (`noise.outside_by_step`), `ratio` and `stderr` the mean e^d over the others and its
    standard error (for the `ratio_mean_bias` flag's test, `noise.ratio_bias`). A one-sided
    temperature or offset, and the steps, are `assess`'s alone.

    >>> assess_values({"k3": 0.05}, 0, 1.0, 0.0).summary()
    'elevated: NeMo-RL gen_kl_error 0.05 (healthy <= 0.001)'
    """
    found = []
    if broken:
        found.append(("broken_sequences", f"broken_sequences: {broken:,} broken sequences"))
    z = noise.ratio_bias(ratio, stderr)
    if z is not None:
        found.append(
            ("ratio_mean_bias", f"ratio_mean_bias: <e^d> = {ratio:.4f} (z = {z:+.0f}), not 1")
        )
    return _judge(found, values.get, ())


def _judge(
    found: list[tuple[str, str]], value: Callable[[str], Any], by_step: tuple[StepHealth, ...]
) -> Health:
    """Broken where something is `found` (a flag's code and its line), elevated where a value
    (`value` of a statistic's name) lies outside a band, else normal."""
    checks = _checks(value)
    reasons = [line for _, line in found] + _exceeded(checks)
    verdict: Verdict = "broken" if found else "elevated" if reasons else "normal"
    codes = tuple(code for code, _ in found)
    return Health(verdict, tuple(reasons), checks, by_step, codes, tuple(placements(value)))


def _step(row: dict[str, Any], dump_bug: list[str]) -> StepHealth:
    """A step's verdict from its own row of `mismatch.by_step`."""
    found = list(dump_bug)
    if row.get("broken_sequences"):
        found.append(f"{row['broken_sequences']:,} broken sequences")
    ratio, se = row.get("healthy_ratio_mean"), row.get("healthy_ratio_mean_stderr")
    z = None if ratio is None or se is None or math.isnan(ratio) else noise.ratio_bias(ratio, se)
    if z is not None:
        found.append(f"<e^d> = {ratio:.4f} (z = {z:+.0f}): a biased ratio")
    checks = _checks(row.get)
    exceeded = _exceeded(checks)
    verdict: Verdict = "broken" if found else "elevated" if exceeded else "normal"
    return StepHealth(int(row["step"]), verdict, tuple(found + exceeded), checks)
