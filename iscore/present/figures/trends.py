"""A run's figures step by step, from its trend (`iscore.advice.trend.Trend`): one figure per
diagnostic and one per setting statistic (a line per setting), smoothed as TensorBoard smooths
its scalars, on a log y-axis where the values span decades, with each event marked at the step
it begins (a dotted line, and a marker at the top whose hover says what changed).

The HTML report draws `trend_figure(trend)` (k3 per step, unsmoothed); the app's Trends page
draws `trend_figures(trend, smoothing)`, and with several runs `runs_trend_figures` (each
diagnostic, a line per run).

>>> fig = trend_figure(analysis.trend, "healthy_k3", smoothing=0.6)  # doctest: +SKIP
>>> [t["name"] for t in fig["data"]]                                 # doctest: +SKIP
['per step', 'smoothed', 'events']
"""

from __future__ import annotations

import itertools
import math
import textwrap
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from iscore.advice import EVENT_KINDS, Event, Trend
from iscore.errors import IscoreError
from iscore.present.figures.axes import figure_layout, hline, step_axis, vline
from iscore.present.figures.style import ACCENT, DATA, NEUTRAL, Figure, style, text

SMOOTHING = 0.6
"""TensorBoard's default smoothing weight."""

LOG_DECADES = 2.0
"""A metric whose values are all positive and span more than this many decades is drawn on a
log y-axis (k3 rising from 1e-4 to 1e-1 is a straight climb there, and a flat line linearly)."""

FAINT = 0.3
"""The opacity of the raw values behind the smoothed line."""


@dataclass(frozen=True, slots=True)
class Metric:
    """How one column of the per-step table is drawn.

    Attributes:
        column: the column (for a setting's statistic, the suffix after its prefix).
        title: the figure's title.
        axis: the y-axis title.
        quantity: the value in a hover, with its unit (a plotly format of `%{y}`).
        reference: a value marked across the plot and its label (1 for a ratio), or None.
    """

    column: str
    title: str
    axis: str
    quantity: str
    reference: tuple[float, str] | None = None


DIAGNOSTICS = (
    Metric(
        "healthy_k3",
        "k3 per step (over the sequences not called broken), and when the run changed",
        "k3 (KL estimate, nats)",
        "k3 %{y:.3g} nats",
    ),
    Metric("k3", "k3 per step, every sequence", "k3 (KL estimate, nats)", "k3 %{y:.3g} nats"),
    Metric("chi2_token", "χ² per token", "χ² (E[w²] - 1)", "χ² %{y:.3g}"),
    Metric(
        "token_mult_prob_error",
        "Token probability ratio error ⟨e^|d|⟩",
        "⟨e^|d|⟩ (1 where the two sides agree)",
        "⟨e^|d|⟩ %{y:.5g}",
        (1.0, "agree"),
    ),
    Metric("abs_diff_p99", "99th percentile of |d|", "|d| p99 (nats)", "|d| p99 %{y:.3g} nats"),
    Metric(
        "tail_share",
        "Share of loss tokens with |d| ≥ 1 nat",
        "share of loss tokens",
        "%{y:.3%} of loss tokens with |d| ≥ 1 nat",
    ),
    Metric(
        "broken_sequences",
        "Sequences outside their step's noise (broken)",
        "sequences",
        "%{y:,} broken sequences",
    ),
    Metric(
        "healthy_ratio_mean",
        "⟨e^d⟩ over the sequences not called broken",
        "⟨e^d⟩ (1 when both sides are right)",
        "⟨e^d⟩ %{y:.5g}",
        (1.0, "1"),
    ),
    Metric("d_median", "The step's noise: median d", "median d (nats)", "median d %{y:.3g} nats"),
    Metric(
        "d_spread",
        "The step's noise: spread of d (1.4826 MAD)",
        "spread of d (nats)",
        "spread of d %{y:.3g} nats",
    ),
)
"""The mismatch's columns drawn, in reading order."""

SETTING_METRICS = (
    Metric(
        "token_masked_fraction",
        "Tokens masked per step",
        "share of loss tokens with weight 0",
        "%{y:.3%} of loss tokens masked",
    ),
    Metric(
        "seq_masked_fraction",
        "Sequences masked per step",
        "share of sequences masked",
        "%{y:.3%} of sequences masked",
    ),
    Metric(
        "truncated_fraction",
        "Tokens truncated per step",
        "share of loss tokens truncated",
        "%{y:.3%} of loss tokens truncated",
    ),
    Metric(
        "lr_scale",
        "Effective learning-rate scale per step",
        "LR scale (corrected / uncorrected)",
        "LR scale %{y:.4g}",
        (1.0, "uncorrected"),
    ),
    Metric(
        "ess",
        "Effective sample size per step",
        "ESS (share of loss tokens)",
        "ESS %{y:.2%} of loss tokens",
    ),
)
"""Each setting's columns drawn (suffixes of its prefix), in reading order."""


def smooth(values: Sequence[float | None], weight: float) -> list[float | None]:
    """TensorBoard's smoothing of a scalar series: an exponential moving average, debiased
    for its start (divided by 1 - weight^n after n values, so that the first values are not
    pulled toward 0). Missing values (None, NaN, infinite) stay as they are and do not count;
    a constant series is returned as it is.

    Args:
        values: the series, in step order.
        weight: 0 (no smoothing) to below 1.

    Raises:
        IscoreError: `weight` outside [0, 1).

    >>> smooth([1.0, 2.0, 3.0], 0.5)
    [1.0, 1.6666666666666667, 2.4285714285714284]
    >>> smooth([1.0, None, 3.0], 0.0)
    [1.0, None, 3.0]
    """
    if not 0.0 <= weight < 1.0:
        raise IscoreError(f"Expected the smoothing weight to be in [0, 1), but got {weight}")
    present = [v for v in values if _finite(v)]
    if all(v == present[0] for v in present):
        return list(values)
    out: list[float | None] = []
    last, n = 0.0, 0
    for v in values:
        if not _finite(v):
            out.append(v)
            continue
        last = last * weight + (1.0 - weight) * v
        n += 1
        out.append(last / (1.0 - weight**n))
    return out


def log_axis(values: Sequence[float | None]) -> bool:
    """Whether a per-step metric is drawn on a log y-axis: its values (missing ones aside) are
    all positive and span more than `LOG_DECADES` decades. A metric with a zero or a negative
    value stays linear: a log axis cannot show those.

    >>> log_axis([1e-4, 3e-3, 0.2]), log_axis([0.01, 0.5]), log_axis([0.0, 1e-4, 0.2])
    (True, False, False)
    """
    present = [v for v in values if _finite(v)]
    if len(present) < 2 or min(present) <= 0:
        return False
    return math.log10(max(present) / min(present)) > LOG_DECADES


def trend_figure(trend: Trend, column: str = "healthy_k3", smoothing: float = 0.0) -> Figure:
    """One column of the mismatch per training step (`DIAGNOSTICS`): the values as they are,
    faint behind their smoothing (`smooth`) when `smoothing` > 0, and each event marked at its
    step. k3 over the sequences not called broken (the default) is drawn against the early
    steps' band, with the steps that hold broken sequences marked."""
    metric = next(m for m in DIAGNOSTICS if m.column == column)
    rows = [r for r in trend.rows if _finite(r.get(column))]
    steps = [r["step"] for r in rows]
    values = [r[column] for r in rows]
    k3 = column == "healthy_k3"
    hover = f"training step %{{x}}<br>{metric.quantity}"
    customdata = None
    if k3:
        hover += "<br>%{customdata:,} broken sequences"
        customdata = [r.get("broken_sequences") or 0 for r in rows]
    line = {"color": DATA, "width": 2}
    data = _lines(steps, values, smoothing, hover, "per step", line, customdata)
    for trace in data:  # the legend names the broken steps' markers only
        trace["showlegend"] = False
    broken = [r for r in rows if r.get("broken_sequences")] if k3 else []
    if broken:
        data.append(
            {
                "type": "scatter",
                "mode": "markers",
                "x": [r["step"] for r in broken],
                "y": [r[column] for r in broken],
                "customdata": [r["broken_sequences"] for r in broken],
                "name": "steps with broken sequences",
                "marker": {"color": ACCENT, "size": 10, "symbol": "x"},
                "hovertemplate": f"{hover}<extra></extra>",
            }
        )
    span = list(values)
    shapes = []
    band = trend.band if k3 else None
    if band is not None:
        span += [band.median, band.upper]
        shapes += [
            hline(band.median, f"median of {band.early}"),
            hline(band.upper, "the early band's edge"),
        ]
    if metric.reference is not None:
        shapes.append(hline(*metric.reference))
    figure = _figure(metric, trend.events, steps, data, span, shapes)
    figure["layout"]["showlegend"] = bool(broken)
    return figure


def setting_trend_figure(trend: Trend, column: str, smoothing: float = 0.0) -> Figure:
    """One statistic of every setting per training step (`SETTING_METRICS`), a line per
    setting in its style (`iscore.present.figures.style`), faint behind its smoothing when
    `smoothing` > 0, with each event marked at its step."""
    metric = next(m for m in SETTING_METRICS if m.column == column)
    series = [
        (name, trend.rows, f"{prefix}_{column}")
        for prefix, name in zip(trend.settings, trend.names, strict=True)
    ]
    return _series_figure(metric, series, smoothing, trend.events)


def runs_trend_figures(
    trends: Mapping[str, Trend], smoothing: float = SMOOTHING
) -> dict[str, Figure]:
    """Every diagnostic (`DIAGNOSTICS`) of several runs per training step, by column: a line
    per run in its style (the i-th run as the i-th setting), smoothed as `trend_figures`
    smooths; no events marked (each run has its own)."""
    series = [(name, trend.rows) for name, trend in trends.items()]
    return {
        m.column: _series_figure(
            m, [(name, rows, m.column) for name, rows in series], smoothing, ()
        )
        for m in DIAGNOSTICS
    }


def _series_figure(
    metric: Metric,
    series: Sequence[tuple[str, Sequence[dict[str, Any]], str]],
    smoothing: float,
    events: Sequence[Event],
) -> Figure:
    """`metric` of each series (its name, its per-step rows and their column) per training
    step, a line each in its style, faint behind its smoothing, with `events` marked."""
    data, span, steps = [], [], set()
    for i, (name, rows, key) in enumerate(series):
        found = [r for r in rows if _finite(r.get(key))]
        x, y = [r["step"] for r in found], [r[key] for r in found]
        hover = f"<b>%{{fullData.name}}</b><br>training step %{{x}}<br>{metric.quantity}"
        lines = _lines(x, y, smoothing, hover, text(name), style(i, len(series))["line"])
        for trace in lines:
            trace["legendgroup"] = str(i)
            trace["name"] = text(name)
        if len(lines) == 2:  # the raw values: in the legend through the smoothed line
            lines[0]["showlegend"] = False
        data += lines
        span += y
        steps.update(x)
    shapes = [] if metric.reference is None else [hline(*metric.reference)]
    figure = _figure(metric, events, sorted(steps), data, span, shapes)
    figure["layout"]["showlegend"] = bool(series)
    return figure


def trend_figures(trend: Trend, smoothing: float = SMOOTHING) -> dict[str, Figure]:
    """Every diagnostic (`DIAGNOSTICS`) and, with settings, every setting statistic
    (`SETTING_METRICS`) per training step, by column, in reading order."""
    figures = {m.column: trend_figure(trend, m.column, smoothing) for m in DIAGNOSTICS}
    if trend.settings:
        figures |= {
            m.column: setting_trend_figure(trend, m.column, smoothing) for m in SETTING_METRICS
        }
    return figures


def _finite(value: Any) -> bool:
    return value is not None and math.isfinite(value)


def _lines(
    steps: list[int],
    values: list[float],
    smoothing: float,
    hover: str,
    name: str,
    line: dict[str, Any],
    customdata: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """The values per step as a line with markers (each a step to click), and with
    `smoothing`, faint behind their smoothed line (without markers, so that a click lands on a
    step's own value); `customdata`, one per step, for the hover of both."""
    extra = {} if customdata is None else {"customdata": customdata}
    raw = {
        "type": "scatter",
        "mode": "lines+markers",
        "x": steps,
        "y": values,
        "name": name,
        "line": line,
        "marker": {"color": line["color"], "size": 6},
        "hovertemplate": f"{hover}<extra></extra>",
        **extra,
    }
    if not smoothing:
        return [raw]
    raw |= {"opacity": FAINT, "line": line | {"width": 1}}
    smoothed = {
        "type": "scatter",
        "mode": "lines",
        "x": steps,
        "y": smooth(values, smoothing),
        "name": "smoothed",
        "line": line,
        "hovertemplate": f"{hover}<br>(smoothed)<extra></extra>",
        **extra,
    }
    return [raw, smoothed]


def _figure(
    metric: Metric,
    events: Sequence[Event],
    steps: list[int],
    data: list[dict[str, Any]],
    span: list[float],
    shapes: list[dict[str, Any]],
) -> Figure:
    """The figure of one metric: its log or linear y-axis, whole-step ticks and the events."""
    log = log_axis(span)
    layout = figure_layout(
        metric.title,
        "training step",
        metric.axis,
        ylog=log,
        yspan=(min(span), max(span)) if log else None,
        height=340,
    )
    if not log:
        # Small values as 4x10^-4, as on the log axes, not with an SI prefix (400 micro).
        layout["yaxis"]["exponentformat"] = "power"
        if all(v >= 0 for v in span if _finite(v)):
            layout["yaxis"]["rangemode"] = "nonnegative"  # a share or a count: from 0
    step_axis(layout["xaxis"], steps)
    data.append(_event_markers(events))
    # A second, hidden y-axis from 0 to 1 over the plot: the events' markers sit at its top
    # whatever the metric's range.
    layout["yaxis2"] = {
        "overlaying": "y",
        "range": [0, 1],
        "visible": False,
        "fixedrange": True,
    }
    for step, group in itertools.groupby(events, key=lambda e: e.step):
        label = ", ".join(dict.fromkeys(e.kind.replace("_", " ") for e in group))
        shapes.append(vline(step, text(label), position="start"))
    layout["shapes"] = shapes
    return {"data": data, "layout": layout}


def _event_markers(events: Sequence[Event]) -> dict[str, Any]:
    """A marker at the top of the plot at each event's step; its hover says what changed,
    where it was found and the evidence (every event of the step)."""
    steps, hovers = [], []
    for step, group in itertools.groupby(events, key=lambda e: e.step):
        steps.append(step)
        hovers.append("<br><br>".join(_event_hover(e) for e in group))
    return {
        "type": "scatter",
        "mode": "markers",
        "x": steps,
        "y": [1.0] * len(steps),
        "yaxis": "y2",
        "name": "events",
        "showlegend": False,
        "cliponaxis": False,
        "marker": {"color": NEUTRAL, "size": 11, "symbol": "triangle-down"},
        "hovertext": hovers,
        "hovertemplate": "%{hovertext}<extra></extra>",
    }


def _event_hover(event: Event) -> str:
    """An event in words for a hover: its heading and step, the column it was found in, and
    the evidence wrapped to lines a hover box can show, as plain text."""
    lines = [
        f"<b>{text(EVENT_KINDS[event.kind])}</b> from step {event.step}",
        f"found in {text(event.metric)}",
        *(text(line) for line in textwrap.wrap(event.evidence, 90)),
    ]
    return "<br>".join(lines)
