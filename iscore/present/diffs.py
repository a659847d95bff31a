"""A diff (`iscore.passes.Diff`) as people read it: one row per compared metric, with the
change shown (the ratio of badness, or the difference where the ratio has no interval), its
interval, the verdict and the evidence behind it in words (`diff_rows`, `step_rows`; the app's
Runs page draws the same rows), and a self-contained HTML page of it (`render_diff_html`,
`write_diff_html`).

The page runs no script and loads nothing: its Content-Security-Policy allows neither, and
every name from a dump or a config (the arms' names and files, the settings) is escaped, so an
arm named `<script>alert(1)</script>` stays text. A verdict's evidence is the `title` of its
cell: shown on hover.

>>> write_diff_html(iscore.diff("before.parquet", "after.parquet"), "diff.html")  # doctest: +SKIP
"""

from __future__ import annotations

import html
import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from iscore.advice import METRICS, SETTING_METRICS, Metric, Verdict
from iscore.passes import Diff, MetricDiff
from iscore.present.figures import NEUTRAL, Figure, figure_layout, text, vline
from iscore.present.report import STYLE, content_policy
from iscore.utils import output_path

MISMATCH = "mismatch"
"""The group of the mismatch's own metrics (a setting's rows are grouped by its name)."""

_SETTING_METRICS = {m.name: m for m in SETTING_METRICS}

_BAD = {
    "higher": "higher is worse",
    "lower": "lower is worse",
    "away_from_1": "its distance from 1 is compared",
}

GRADES: dict[Verdict, str] = {"better": "good", "worse": "bad", "same": ""}
"""Each verdict in the colours of the settings table's grades (`iscore.advice.Targets.grade`):
better green, worse red, same uncoloured."""


@dataclass(frozen=True, slots=True)
class DiffRow:
    """One compared metric as a table shows it.

    Attributes:
        group: `MISMATCH`, or the setting's `framework:name`.
        step: the training step of a per-step row, None overall.
        metric: its name; baseline, candidate: its values on each arm.
        by: "ratio" (candidate / baseline of the badness) or "difference" (candidate -
            baseline of the badness, where the ratio has no interval).
        change: that ratio or difference (NaN where there is none).
        interval: its 95% interval (NaN ends where it has none).
        verdict: the candidate's, `iscore.advice.verdict`.
        evidence: the numbers behind the verdict, in words.
    """

    group: str
    step: int | None
    metric: str
    baseline: float
    candidate: float
    by: str
    change: float
    interval: tuple[float, float]
    verdict: Verdict
    evidence: str

    @property
    def change_text(self) -> str:
        """The change as the CLI prints it: `x1.52` or `+0.0031` (`-` where there is none)."""
        if not math.isfinite(self.change):
            return "-"
        return f"x{self.change:.3g}" if self.by == "ratio" else f"{self.change:+.3g}"

    @property
    def interval_text(self) -> str:
        """The interval as `[1.21, 1.93]`, or `-` where there is none."""
        lo, hi = self.interval
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return "-"
        sign = "+" if self.by == "difference" else ""
        return f"[{lo:{sign}.3g}, {hi:{sign}.3g}]"


def diff_rows(diff: Diff) -> tuple[DiffRow, ...]:
    """Every metric `diff` compares overall: the mismatch's, then each setting's."""
    rows = [_row(diff, m, METRICS[m.name], MISMATCH, None) for m in diff.metrics]
    for s in diff.settings:
        rows += [_row(diff, m, _SETTING_METRICS[m.name], s.setting, None) for m in s.metrics]
    return tuple(rows)


def step_rows(diff: Diff) -> tuple[DiffRow, ...]:
    """The token-mean metrics of every step both arms hold, step by step."""
    return tuple(
        _row(diff, m, METRICS[m.name], MISMATCH, row["step"])
        for row in diff.by_step
        for m in row["metrics"]
    )


def _row(diff: Diff, m: MetricDiff, metric: Metric, group: str, step: int | None) -> DiffRow:
    by_ratio = m.ratio is not None and all(math.isfinite(v) for v in m.ci)
    change = m.ratio if by_ratio else m.difference
    row = DiffRow(
        group,
        step,
        m.name,
        m.baseline,
        m.candidate,
        "ratio" if by_ratio else "difference",
        math.nan if change is None else change,
        m.ci if by_ratio else m.difference_ci,
        m.verdict,
        "",
    )
    return replace(row, evidence=_evidence(row, diff, metric))


def _evidence(row: DiffRow, diff: Diff, metric: Metric) -> str:
    """What the metric is and which way it is bad, both values, the change with its
    interval, and how the interval was drawn."""
    base, cand = diff.arms
    what = "candidate / baseline" if row.by == "ratio" else "candidate - baseline"
    if row.interval_text == "-":
        interval = "no interval (defined on too few resamples)"
    else:
        interval = f"{diff.level:.0%} interval {row.interval_text}"
    pairing = (
        "paired: both arms hold the same sequences, resampled together"
        if diff.paired
        else "unpaired: each arm's sequences resampled on their own"
    )
    where = "" if row.step is None else f" at step {row.step}"
    return (
        f"{row.metric}{where} ({metric.about}; {_BAD[metric.bad]}): "
        f"{base.name} {_number(row.baseline)}, {cand.name} {_number(row.candidate)}. "
        f"{what} of the badness {row.change_text}, {interval}, from {diff.resamples:,} "
        f"resamples of the sequences within steps (seed {diff.seed}), {pairing}. "
        f"Verdict: {row.verdict}."
    )


def _number(value: float) -> str:
    return f"{value:.4g}" if math.isfinite(value) else "-"


_COLORS: dict[Verdict, str] = {
    "better": "rgb(46, 160, 67)",
    "worse": "rgb(248, 81, 73)",
    "same": NEUTRAL,
}
"""Each verdict's marker: the colours of `GRADES`, opaque."""


def diff_figure(diff: Diff) -> Figure:
    """Each overall metric's ratio of badness (candidate / baseline) with its interval, on a
    log axis about 1, its marker in its verdict's colour and its evidence on hover; a metric
    compared by its difference (no ratio) is left to the table."""
    rows = [r for r in diff_rows(diff) if r.by == "ratio"]
    labels = [text(r.metric if r.group == MISMATCH else f"{r.group}: {r.metric}") for r in rows]
    data = [
        {
            "type": "scatter",
            "mode": "markers",
            "x": [r.change for r in rows],
            "y": labels,
            "error_x": {
                "type": "data",
                "symmetric": False,
                "array": [r.interval[1] - r.change for r in rows],
                "arrayminus": [r.change - r.interval[0] for r in rows],
                "color": NEUTRAL,
            },
            "marker": {"color": [_COLORS[r.verdict] for r in rows], "size": 10},
            "hovertext": ["<br>".join(map(text, textwrap.wrap(r.evidence, 80))) for r in rows],
            "hovertemplate": "%{hovertext}<extra></extra>",
            "showlegend": False,
        }
    ]
    layout = figure_layout(
        f"Candidate / baseline of each metric's badness, with its {diff.level:.0%} interval",
        "ratio of badness (1: the same; hover a point for its evidence)",
        "",
        xlog=True,
        height=max(300, 110 + 30 * len(rows)),
    )
    # Every metric named (plotly thins category labels that would crowd), the first on top.
    layout["yaxis"] |= {"autorange": "reversed", "type": "category", "dtick": 1}
    layout["shapes"] = [vline(1.0, "the same")]
    return {"data": data, "layout": layout}


def render_diff_html(diff: Diff) -> str:
    """The diff as one self-contained HTML page: both arms, the verdicts, the metrics table
    (baseline, candidate, change, interval, verdict coloured, its evidence on hover), each
    setting's table and the per-step rows."""
    rows = diff_rows(diff)
    mismatch = [r for r in rows if r.group == MISMATCH]
    parts = [_header(diff), _arms(diff), _worse(diff), "<h2>The mismatch</h2>"]
    parts.append(_table(mismatch, diff.level))
    if diff.settings:
        parts.append("<h2>The settings</h2>")
    for s in diff.settings:
        own = [r for r in rows if r.group == s.setting]
        parts += [f"<h3>{html.escape(s.setting)}</h3>", _table(own, diff.level)]
    steps = step_rows(diff)
    if steps:
        parts += ["<h2>By step</h2>", _table(steps, diff.level, by_step=True)]
    return _PAGE.format(csp=content_policy(), style=STYLE, body="\n".join(parts))


def write_diff_html(diff: Diff, path: str | Path) -> None:
    """Write `render_diff_html(diff)` to `path`, whole or not at all."""
    text = render_diff_html(diff)
    with output_path(path) as tmp:
        Path(tmp).write_text(text, encoding="utf-8")


def _header(diff: Diff) -> str:
    base, cand = (html.escape(a.name) for a in diff.arms)
    pairing = (
        "paired (both hold the same sequences, resampled together)"
        if diff.paired
        else "unpaired (each arm's sequences resampled on their own)"
    )
    return (
        f"<h1>iscore diff: {cand} against {base}</h1><p class='meta'>{pairing} · "
        f"{diff.level:.0%} intervals of {diff.resamples:,} resamples of the sequences within "
        f"steps (seed {diff.seed}) · schema iscore.diff</p>"
    )


def _arms(diff: Diff) -> str:
    cells = "".join(
        f"<tr><td>{role}</td><td>{html.escape(a.name)}</td><td>{_source(a.source)}</td>"
        f"<td>{a.tokens:,}</td><td>{a.sequences:,}</td><td>{_steps(a.steps)}</td></tr>"
        for role, a in zip(("baseline", "candidate"), diff.arms, strict=True)
    )
    return (
        "<table><tr><th>arm</th><th>name</th><th>source</th><th>loss tokens</th>"
        f"<th>sequences</th><th>steps</th></tr>{cells}</table>"
    )


def _source(files: Sequence[str]) -> str:
    if not files:
        return "in-memory batch"
    return "<br>".join(html.escape(f) for f in files)


def _steps(steps: Sequence[int]) -> str:
    """`0-3` for a run of whole steps, else the steps listed."""
    if not steps:
        return "-"
    if list(steps) == list(range(steps[0], steps[-1] + 1)) and len(steps) > 2:
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def _worse(diff: Diff) -> str:
    worse = diff.worse()
    if not worse:
        return "<p class='ok'>No metric is worse on the candidate.</p>"
    named = ", ".join(html.escape(w) for w in worse)
    return f"<div class='verdict broken'><b>Worse on the candidate:</b> {named}</div>"


def _table(rows: Sequence[DiffRow], level: float, by_step: bool = False) -> str:
    head = "<th>step</th>" if by_step else ""
    body = "".join(
        "<tr>"
        + (f"<td>{r.step}</td>" if by_step else "")
        + f"<td>{html.escape(r.metric)}</td><td>{_number(r.baseline)}</td>"
        f"<td>{_number(r.candidate)}</td><td>{r.change_text}</td><td>{r.interval_text}</td>"
        f"<td class='{GRADES[r.verdict]}' title='{html.escape(r.evidence)}'>"
        f"<b>{r.verdict}</b></td>"
        "</tr>"
        for r in rows
    )
    return (
        f"<table><tr>{head}<th>metric</th><th>baseline</th><th>candidate</th><th>change</th>"
        f"<th>{level:.0%} interval</th><th>verdict</th></tr>{body}</table>"
    )


_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<title>iscore diff</title>
<style>
{style}</style></head>
<body>
{body}
<p class='note'>Change: candidate / baseline of each metric's badness (its value, or its
distance from 1 where 1 is ideal), or candidate - baseline where the ratio has no interval.
The verdict is the candidate's: better (green) or worse (red) where the interval lies wholly
on one side of 1 (of 0 for a difference), same where it holds it; hover a verdict for its
evidence. docs/compare.md says how it is computed.</p>
</body></html>
"""
