"""Figures as plotly JSON specs (plain dicts): of an analysis, shared by the HTML report and the
app, and the app's own (lengths, one sequence's tokens, a threshold's read-outs).

The engine never imports plotly: a figure here is the `{"data": [...], "layout": {...}}` dict
that plotly.js renders (and `plotly.graph_objects.Figure` accepts). Every figure is built from
the small pre-binned tables of an `Analysis`, never from per-token data, so a page stays small
whatever the size of the dump.

What every figure keeps to, so that it reads at a glance in a light or a dark page:

- setting i is drawn in `color(i)`, `dash(i)` and `symbol(i)` on every figure, earlier settings
  wider than later ones (`style`), so that settings that coincide stay visible; no two of the
  first 60 settings share both color and dash;
- backgrounds are transparent and grid and reference lines a grey with alpha: the app's theme
  (`st.plotly_chart(..., theme="streamlit")`) or the report's white page gives the fonts;
- legends sit outside the plot area (right of it), never over an axis title;
- log axes label whole decades, few enough not to crowd, in exponent form (`10⁻³`), and
  1-2-5 times them (or finer) where that leaves fewer than 3 labels;
- every hover names its quantities with their units ("sequence length (loss tokens)");
- histograms are re-binned per figure from the analysis' fine ones (`rebin`), so that the
  central 98% of the data spans 40 to 80 bins wherever it lies.

>>> fig = lr_scale_by_step(analysis)  # doctest: +SKIP
>>> fig["layout"]["yaxis"]["title"]["text"]  # doctest: +SKIP
'LR scale (corrected / uncorrected)'
"""

from __future__ import annotations

import html
import itertools
import math
from collections.abc import Sequence
from typing import Any

from iscore.analysis import Analysis
from iscore.tune import TuneResult

PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#7f7f7f",
)
"""One color per setting, in order, on every figure (the app uses the same). Each has a
mid luminance, so that it reads on a white and on a near-black background."""

DASHES = ("solid", "dash", "dot", "dashdot", "longdash", "longdashdot")
"""One dash pattern per setting, by index (`dash`)."""

SYMBOLS = (
    "circle",
    "square",
    "diamond",
    "triangle-up",
    "x",
    "triangle-down",
    "cross",
    "star",
    "pentagon",
    "hourglass",
)
"""One marker per setting, by index."""

OVERLAY_MAX = 4
"""Up to this many settings share one plot; beyond, `collapse_by_length` draws a panel each."""

DATA = "#5b84b1"
"""Quantities of the dump itself (d, |d|, lengths): not a setting's color."""
ACCENT = "#b5527e"
"""A second quantity beside `DATA` (k3 beside mean |d|)."""
MIDDLE = "rgba(91, 132, 177, 0.5)"
"""The middle bar of `signed_diff_histogram` (|d| below its scale): `DATA`, lighter."""
NEUTRAL = "rgba(128, 128, 128, 0.9)"
"""Reference lines and expectations: a grey that reads on light and dark pages."""
TRAIN = "rgba(255, 140, 40, 0.55)"
"""The trainer's log-probs, wide and light under the rollout's (`sequence_figure`)."""
GRID = "rgba(128, 128, 128, 0.22)"
AXIS_LINE = "rgba(128, 128, 128, 0.6)"

Figure = dict[str, Any]


def color(i: int) -> str:
    """The color of the i-th setting."""
    return PALETTE[i % len(PALETTE)]


def _cycle(i: int) -> int:
    """The i-th setting's index into the dashes and markers: i, shifted by one more each time
    the colors start over, so that settings PALETTE apart differ in dash and marker (without
    the shift, the 6 dashes and 10 colors would repeat together every 30 settings and the
    markers with the colors). Settings 0 to 9 keep their own index."""
    return i + i // len(PALETTE)


def dash(i: int) -> str:
    """The dash pattern of the i-th setting: (color, dash) is unique for the first 60."""
    return DASHES[_cycle(i) % len(DASHES)]


def symbol(i: int) -> str:
    """The marker of the i-th setting: (color, marker) is unique for the first 100."""
    return SYMBOLS[_cycle(i) % len(SYMBOLS)]


def style(i: int, n: int) -> dict[str, Any]:
    """Line and marker of the i-th of n settings drawn on one plot: its color, dash and marker,
    and a width that shrinks with the index, so that a later setting drawn over an earlier one
    with the same values leaves the earlier one visible around it.

    >>> style(0, 3)["line"], style(2, 3)["line"]["width"]
    ({'color': '#1f77b4', 'dash': 'solid', 'width': 3.5}, 1.5)
    """
    rank = max(min(n, OVERLAY_MAX) - 1 - i, 0)  # 0 for the last (thinnest) setting
    return {
        "line": {"color": color(i), "dash": dash(i), "width": 1.5 + rank},
        "marker": {
            "color": color(i),
            "symbol": symbol(i),
            "size": 6 + 2 * rank,
            "line": {"color": color(i), "width": 1},
        },
    }


def setting_name(setting: dict[str, Any]) -> str:
    """How a setting is named in legends: `name (framework)`, or just `name` where the two
    are the same (a framework's default setting is named after it: not "trl (trl)").

    >>> [setting_name({"name": name, "framework": "trl"}) for name in ("mine", "trl")]
    ['mine (trl)', 'trl']
    """
    if setting["name"] == setting["framework"]:
        return setting["name"]
    return f"{setting['name']} ({setting['framework']})"


def text(value: object) -> str:
    """`value` as plain text for a plotly text field (title, legend, label, hover): plotly
    renders a subset of HTML there (<b>, <a href>, <span style>), so a setting's name or a
    sequence id from an upload or a config must arrive with <, > and & as entities.

    >>> text("<b>x</b> & y")
    '&lt;b&gt;x&lt;/b&gt; &amp; y'
    """
    return html.escape(str(value), quote=False)


def _label(setting: dict[str, Any]) -> str:
    """`setting_name`, as plotly text."""
    return text(setting_name(setting))


# ------------------------------------------------------------------ layout helpers


def _axis(title: str, *, log: bool = False, span: tuple[float, float] | None = None) -> dict:
    """An axis with a neutral grid; a log axis labels whole decades in exponent form, at most
    about six of them, and at least 3 labels whatever its `span` (the lowest and highest value
    shown, when known: `_log_ticks`)."""
    axis: dict[str, Any] = {
        "title": {"text": title},
        "zeroline": False,
        "gridcolor": GRID,
        "linecolor": AXIS_LINE,
        "showline": True,
        "ticks": "outside",
        "tickcolor": AXIS_LINE,
        "automargin": True,
    }
    if not log:
        return axis | {"type": "linear", "nticks": 8}
    axis |= {"type": "log", "exponentformat": "power", "minorloglabels": "none"}
    if not span or span[0] <= 0 or span[1] <= span[0]:
        return axis
    return axis | _log_ticks(math.log10(span[0]), math.log10(span[1]))


def _log_ticks(low: float, high: float) -> dict[str, Any]:
    """The ticks of a log axis over 10^low to 10^high: the coarsest of whole decades (one per
    1, 2, 3... decades, at most about six), 1-2-5 times the decades, or round steps of the
    value itself, with at least 3 inside the span (whole decades alone leave a single label on
    a span of 1.5 decades, 1-2-5 on 0.6). Below whole decades, the labels are listed and
    written out (0.5, not "5" or "5x10^-1", and as large as 1: plotly's own draw 2 and 5
    smaller).

    >>> _log_ticks(-6.0, 0.5)["dtick"], _log_ticks(-1.0, 0.5)["ticktext"]
    (2, ['0.1', '0.2', '0.5', '1', '2'])
    >>> _log_ticks(-0.1, 0.1)["ticktext"]
    ['0.8', '0.9', '1', '1.1', '1.2']
    """
    every = max(1, math.ceil((high - low) / 6))
    # dtick on a log axis is in decades: one label per `every` decades, none between.
    if len(_ladder(low, high, (1,), every)) >= 3:
        return {"dtick": every, "tick0": 0}
    values = _ladder(low, high, (1, 2, 5))
    if len(values) < 3:  # under 0.7 decades: 3 to 7 round steps of the value
        third = (10.0**high - 10.0**low) / 3
        power = 10.0 ** math.floor(math.log10(third))
        step = max(m * power for m in (1, 2, 5) if m * power <= third)
        first, last = math.ceil(10.0**low / step - 1e-9), math.floor(10.0**high / step + 1e-9)
        values = [j * step for j in range(first, last + 1)]
    return {"tickmode": "array", "tickvals": values, "ticktext": [_written(v) for v in values]}


def _ladder(low: float, high: float, mantissas: Sequence[int], every: int = 1) -> list[float]:
    """The values m x 10^k (m in `mantissas`, k a multiple of `every`) in 10^low to 10^high."""
    return [
        m * 10.0**k
        for k in range(math.floor(low), math.ceil(high) + 1)
        if k % every == 0
        for m in mantissas
        if low - 1e-9 <= k + math.log10(m) <= high + 1e-9
    ]


def _written(v: float) -> str:
    """A tick label: the value written out (0.002, 10,000), or a power of ten beyond 10^-4
    and 10^5 (5x10^-5, in superscript)."""
    if 1e-4 * (1 - 1e-9) <= v < 1e5:
        return f"{v:,.6g}"
    k = math.floor(math.log10(v) + 1e-9)
    power = f"10<sup>{k}</sup>".replace("-", "\u2212")
    mantissa = f"{v / 10.0**k:.3g}"
    return power if mantissa == "1" else f"{mantissa}\u00d7{power}"


def _legend() -> dict[str, Any]:
    """Right of the plot area (which shrinks to make room): never over an axis title."""
    return {
        "orientation": "v",
        "x": 1.02,
        "xanchor": "left",
        "y": 1,
        "yanchor": "top",
        "bgcolor": "rgba(0,0,0,0)",
    }


def _layout(
    title: str,
    x: str,
    y: str,
    *,
    xlog: bool = False,
    ylog: bool = False,
    xspan: tuple[float, float] | None = None,
    yspan: tuple[float, float] | None = None,
    height: int = 400,
) -> dict[str, Any]:
    return {
        "title": {"text": text(title), "x": 0.01, "xanchor": "left"},
        "xaxis": _axis(x, log=xlog, span=xspan),
        "yaxis": _axis(y, log=ylog, span=yspan),
        "height": height,
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        "legend": _legend(),
        "hoverlabel": {"namelength": -1},
        # Transparent, so that the figure takes the page's light or dark background.
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
    }


def _hline(y: float, label: str = "", yref: str = "y") -> dict[str, Any]:
    return {
        "type": "line",
        "xref": "paper",
        "yref": yref,
        "x0": 0,
        "x1": 1,
        "y0": y,
        "y1": y,
        "line": {"dash": "dot", "color": NEUTRAL, "width": 1},
        "label": {"text": label, "textposition": "end", "font": {"size": 10}} if label else {},
    }


def _vline(x: float, label: str = "", position: str = "end") -> dict[str, Any]:
    return {
        "type": "line",
        "yref": "paper",
        "y0": 0,
        "y1": 1,
        "x0": x,
        "x1": x,
        "line": {"dash": "dot", "color": NEUTRAL, "width": 1},
        "label": {"text": label, "textposition": position, "font": {"size": 10}} if label else {},
    }


# ------------------------------------------------------------------ binning


def rebin(
    edges: Sequence[float],
    counts: Sequence[float],
    *,
    central: float = 0.98,
    most: int = 80,
    tails: int | None = 5,
) -> tuple[list[float], list[float]]:
    """A log-spaced histogram merged into fewer, wider bins, for a plot.

    Inside the central `central` share of the counts, bins merge `g` at a time, the smallest
    `g` with which that range spans at most `most` bins (so at least `most / 2` where the
    input resolves that many). Beyond it the tails get at most `tails` bins per decade
    (`None`: the same bins as the centre), so that a few outliers decades away cost few
    points. Bins are anchored at 1 (an edge stays at 1); empty bins at either end are dropped.
    Bins may differ in width: divide by `widths(edges)` for a density.

    >>> edges = [10 ** (k / 200) for k in range(-400, 401)]
    >>> new_edges, new_counts = rebin(edges, [1] * 800)
    >>> len(new_counts), new_edges[0], sum(new_counts)
    (80, 0.01, 800)
    """
    edges, counts = list(edges), list(counts)
    if len(counts) < 2:
        return edges, counts
    per_decade = round(1.0 / math.log10(edges[1] / edges[0]))
    lo, hi = _central(counts, central)
    group = max(1, math.ceil((hi - lo + 1) / most))
    wide = group if tails is None else max(group, per_decade // tails // group * group)
    # Fine bin i has lower edge 10^((first + i) / per_decade); the centre is widened to
    # multiples of `wide`, so that both grids line up.
    first = round(math.log10(edges[0]) * per_decade)
    start = math.floor(first / wide) * wide
    end = -math.floor(-(first + len(counts)) / wide) * wide
    c0 = math.floor((first + lo) / wide) * wide
    c1 = -math.floor(-(first + hi + 1) / wide) * wide
    padded = [0.0] * (first - start) + counts + [0.0] * (end - first - len(counts))
    bounds = [
        *range(start, c0, wide),
        *range(c0, c1, group),
        *range(c1, end + 1, wide),
    ]
    grouped = [sum(padded[a - start : b - start]) for a, b in itertools.pairwise(bounds)]
    return _trim([10.0 ** (k / per_decade) for k in bounds], grouped)


def widths(edges: Sequence[float]) -> list[float]:
    """The width in decades of each bin of a log-spaced histogram."""
    return [math.log10(b / a) for a, b in itertools.pairwise(edges)]


def _central(counts: Sequence[float], central: float) -> tuple[int, int]:
    """The first and last bin of the central `central` share of the counts."""
    total = sum(counts)
    tail = (1.0 - central) / 2.0 * total
    cumulative = list(itertools.accumulate(counts))
    lo = next(i for i, c in enumerate(cumulative) if c > tail)
    hi = next(i for i, c in enumerate(cumulative) if c >= total - tail)
    return lo, hi


def _trim(edges: list[float], counts: list[float]) -> tuple[list[float], list[float]]:
    used = [i for i, c in enumerate(counts) if c]
    if not used:
        return edges[:1], []
    return edges[used[0] : used[-1] + 2], counts[used[0] : used[-1] + 1]


def _bin_data(edges: Sequence[float], shares: Sequence[float]) -> list[list[float]]:
    """Per point of a `_step` line: its bin's edges and share (the last point closes the line)."""
    bins = [[a, b, share] for (a, b), share in zip(itertools.pairwise(edges), shares, strict=True)]
    return [*bins, [edges[-1], edges[-1], 0.0]]


def _step(edges: Sequence[float], values: Sequence[float]) -> tuple[list[float], list[float]]:
    """x and y of a step line (`line.shape = "hv"`) drawing `values` over the bins."""
    return list(edges), [*values, values[-1]]


# ------------------------------------------------------------------ the analysis' figures


def weight_histogram(analysis: Analysis, kind: str = "weight") -> Figure:
    """Distribution of the applied (`kind="weight"`) or raw weights per setting, log x-axis.

    Each setting is re-binned for its own spread (`rebin`), so the y-axis is a density: the
    share of the loss tokens per decade of w, comparable across bin widths. Zeros (masked
    tokens) cannot sit on a log axis; their share is in the legend.
    """
    data = []
    what = "applied weight w" if kind == "weight" else "raw ratio (before truncation or masks)"
    symbol_ = "w" if kind == "weight" else "ratio"
    n = len(analysis.settings)
    low, high = math.inf, 0.0
    for i, s in enumerate(analysis.settings):
        hist = s[f"{kind}_hist"]
        total = sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"]
        if not total:
            continue
        zero_share = f", {hist['zeros'] / total:.1%} zero" if hist["zeros"] else ""
        if not hist["counts"]:  # every weight 0 (or out of range): in the legend all the same
            data.append(
                {"type": "scatter", "mode": "lines", "x": [], "y": [], "legendgroup": str(i),
                 "line": style(i, n)["line"], "name": f"{_label(s)}{zero_share}"}
            )  # fmt: skip
            continue
        edges, counts = rebin(hist["edges"], hist["counts"])
        shares = [c / total for c in counts]
        x, y = _step(edges, [a / w for a, w in zip(shares, widths(edges), strict=True)])
        low, high = min(low, edges[0]), max(high, edges[-1])
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x,
                "y": y,
                "line": {**style(i, n)["line"], "shape": "hv"},
                "name": f"{_label(s)}{zero_share}",
                "legendgroup": str(i),
                "customdata": _bin_data(edges, shares),
                "hovertemplate": f"<b>%{{fullData.name}}</b><br>{symbol_} from "
                "%{customdata[0]:.4g} to %{customdata[1]:.4g}<br>"
                "%{customdata[2]:.3%} of loss tokens<extra></extra>",
            }
        )
    shown = None
    if math.isfinite(low):
        # At least a fifth of a decade either side: a single bin (every weight 1) stays a bar.
        pad = max(0.1, (math.log10(high / low)) * 0.03)
        shown = [math.log10(min(low, 1.0)) - pad, math.log10(high) + pad]
    layout = _layout(
        f"Distribution of the {what}",
        what,
        "share of loss tokens per decade",
        xlog=True,
        ylog=True,
        # The ticks span the range shown, not only the bins: a single bin has a fifth of a
        # decade's worth of ticks around it, not six crowded onto it.
        xspan=(10.0 ** shown[0], 10.0 ** shown[1]) if shown else None,
    )
    if shown:
        layout["xaxis"]["range"] = shown
    layout["shapes"] = [_vline(1.0, "1")]
    layout["showlegend"] = True  # even for one setting: its name, color and zero share
    return {"data": data, "layout": layout}


def collapse_by_length(analysis: Analysis) -> Figure:
    """Per-sequence weight (median, p10-p90 band) against length, beside the independent-token
    expectation for the product ratio e^S at the dump's per-token mismatch.

    Up to `OVERLAY_MAX` settings share the plot (bands under all lines, lines thinner in
    order); beyond, each setting gets a panel of a grid with shared axes.
    """
    settings = analysis.settings
    n = len(settings)
    panels = n > OVERLAY_MAX
    columns = 2 if n <= 6 else 3
    rows = math.ceil(n / columns) if panels else 1
    expected = analysis.mismatch["by_length"]
    bands, lines = [], []
    for i, s in enumerate(settings):
        rows_ = s["by_length"]
        x = [r["length_median"] for r in rows_]
        axes = _panel_axes(i) if panels else {}
        bands.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x + x[::-1],
                "y": [r["seq_weight_p90"] for r in rows_]
                + [r["seq_weight_p10"] for r in rows_][::-1],
                "fill": "toself",
                "fillcolor": color(i),
                "opacity": 0.12 if not panels else 0.2,
                "line": {"width": 0},
                "hoverinfo": "skip",
                "showlegend": False,
                "legendgroup": str(i),
                **axes,
            }
        )
        lines.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": x,
                "y": [r["seq_weight_median"] for r in rows_],
                **style(i, 1 if panels else n),
                "name": _label(s),
                "legendgroup": str(i),
                "customdata": [
                    [r["bucket"], r["sequences"], r["seq_weight_p10"], r["seq_weight_p90"]]
                    for r in rows_
                ],
                "hovertemplate": "<b>%{fullData.name}</b><br>"
                "sequence length ≈ %{x:,.0f} loss tokens (%{customdata[0]})<br>"
                "median sequence weight %{y:.3g} (p10 %{customdata[2]:.3g}, "
                "p90 %{customdata[3]:.3g})<br>%{customdata[1]:,} sequences<extra></extra>",
                **axes,
            }
        )
    references = []
    for p in range(rows * columns if panels else 1):
        if not expected or (panels and p >= n):
            continue
        references.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": [r["length_median"] for r in expected],
                "y": [r["expected_seq_ratio_median"] for r in expected],
                # Wide and faint: an expectation, unlike any setting's line.
                "line": {"color": "rgba(128, 128, 128, 0.45)", "width": 7},
                "name": "expected median e^S, independent tokens",
                "legendgroup": "expected",
                "showlegend": p == 0,
                "hovertemplate": "independent tokens at the dump's mismatch<br>"
                "sequence length ≈ %{x:,.0f} loss tokens<br>"
                "expected median e^S %{y:.3g}<extra></extra>",
                **(_panel_axes(p) if panels else {}),
            }
        )
    measured = [
        v
        for s in settings
        for r in s["by_length"]
        for v in (r["seq_weight_p10"], r["seq_weight_median"], r["seq_weight_p90"])
        if v and v > 0
    ]
    lengths = [r["length_median"] for s in settings for r in s["by_length"]]
    # The y-range follows the settings' own weights (down to 1e-6 at most): an expected
    # curve at e^-300 would otherwise squash them into a line at the top.
    low = max(min(measured), 1e-6) if measured else 1e-3
    high = max(max(measured), 1.0) if measured else 1.0
    y_range = [math.log10(low) - 0.3, math.log10(high) + 0.3]
    layout = _layout(
        "Per-sequence weight vs length (median and p10-p90)",
        "sequence length (loss tokens)",
        "mean weight of the sequence's tokens",
        xlog=True,
        ylog=True,
        xspan=(min(lengths), max(lengths)) if lengths else None,
        yspan=(10 ** y_range[0], 10 ** y_range[1]),
        height=420 if not panels else 140 + 200 * rows,
    )
    layout["yaxis"]["range"] = y_range
    # A median of 0 (most sequences masked) has no place on a log axis: drawn on its floor.
    zeros = []
    for i, s in enumerate(settings):
        at = [r["length_median"] for r in s["by_length"] if not r["seq_weight_median"]]
        if at:
            zeros.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "x": at,
                    "y": [10 ** y_range[0]] * len(at),
                    "marker": style(i, 1 if panels else n)["marker"] | {"opacity": 0.6},
                    "cliponaxis": False,
                    "name": _label(s),
                    "legendgroup": str(i),
                    "showlegend": False,
                    "hovertemplate": "<b>%{fullData.name}</b><br>sequence length ≈ %{x:,.0f} "
                    "loss tokens<br>median sequence weight 0 (masked)<extra></extra>",
                    **(_panel_axes(i) if panels else {}),
                }
            )
    data = references + bands + lines + zeros
    if not panels:
        layout["shapes"] = [_hline(1.0, "1")]
        layout["showlegend"] = True
        return {"data": data, "layout": layout}
    _grid(layout, n, rows, columns, [_label(s) for s in settings])
    layout["title"]["subtitle"] = {
        "text": "one panel per setting; wide grey: the median e^S expected of independent tokens"
    }
    layout["shapes"] = [
        _hline(1.0, yref=_panel_axes(p)["yaxis"]) | {"xref": f"{_panel_axes(p)['xaxis']} domain"}
        for p in range(n)
    ]
    return {"data": data, "layout": layout}


def _panel_axes(p: int) -> dict[str, str]:
    """The x and y axes of panel p of a grid (plotly names them x, x2, x3...)."""
    suffix = "" if p == 0 else str(p + 1)
    return {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}


def _grid(layout: dict[str, Any], n: int, rows: int, columns: int, titles: Sequence[str]) -> None:
    """Lay out n panels on a rows x columns grid sharing the first panel's axes: axis titles
    on the outer panels only, each panel titled above its plot area."""
    gap_x, gap_y = 0.08, 0.5 / max(rows * 2, 4)
    width = (1 - gap_x * (columns - 1)) / columns
    height = (1 - gap_y * (rows - 1)) / rows
    x_axis, y_axis = layout.pop("xaxis"), layout.pop("yaxis")
    layout["annotations"] = []
    for p in range(n):
        row, col = divmod(p, columns)
        x0 = col * (width + gap_x)
        y1 = 1 - row * (height + gap_y)
        suffix = "" if p == 0 else str(p + 1)
        bottom = p + columns >= n
        # Clamped: the last row's bottom is 0 only up to rounding (plotly refuses -2.8e-17).
        xa = x_axis | {
            "domain": [x0, min(x0 + width, 1.0)],
            "anchor": f"y{suffix}",
            "showticklabels": bottom,
            "title": {"text": ""},
        }
        ya = y_axis | {
            "domain": [max(y1 - height, 0.0), y1],
            "anchor": f"x{suffix}",
            "showticklabels": col == 0,
            "title": {"text": ""},
        }
        if p:
            xa["matches"], ya["matches"] = "x", "y"
        layout[f"xaxis{suffix}"], layout[f"yaxis{suffix}"] = xa, ya
        layout["annotations"].append(
            {
                "text": titles[p],
                "xref": "paper",
                "yref": "paper",
                "x": x0,
                "y": y1,
                "xanchor": "left",
                "yanchor": "bottom",
                "showarrow": False,
                "font": {"size": 12, "color": color(p)},
            }
        )
    # The axes' titles once for the grid, centred under and left of it.
    common = {"xref": "paper", "yref": "paper", "showarrow": False, "font": {"size": 13}}
    layout["annotations"] += [
        common | {"text": x_axis["title"]["text"], "x": 0.5, "y": 0, "yanchor": "top",
                  "yshift": -28},
        common | {"text": y_axis["title"]["text"], "x": 0, "y": 0.5, "xanchor": "right",
                  "xshift": -48, "textangle": -90},
    ]  # fmt: skip
    layout["margin"] |= {"t": 100, "l": 90, "b": 70}
    layout["showlegend"] = False


def mask_rate_by_length(analysis: Analysis) -> Figure:
    """Fraction of loss tokens whose weight is 0 (masked or zeroed), per length bucket."""
    n = len(analysis.settings)
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            **style(i, n),
            "x": [r["length_median"] for r in s["by_length"]],
            "y": [r["token_masked_fraction"] for r in s["by_length"]],
            "customdata": [[r["bucket"], r["sequences"]] for r in s["by_length"]],
            "name": _label(s),
            "hovertemplate": "<b>%{fullData.name}</b><br>"
            "sequence length ≈ %{x:,.0f} loss tokens (%{customdata[0]}, "
            "%{customdata[1]:,} sequences)<br>"
            "%{y:.2%} of loss tokens with weight 0<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    lengths = [r["length_median"] for s in analysis.settings for r in s["by_length"]]
    layout = _layout(
        "Masked token fraction vs length",
        "sequence length (loss tokens)",
        "share of loss tokens with weight 0",
        xlog=True,
        xspan=(min(lengths), max(lengths)) if lengths else None,
    )
    layout["yaxis"]["range"] = [-0.02, 1.02]
    layout["yaxis"]["tickformat"] = ".0%"
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


MASK_RATES = (
    ("token_masked_fraction", "tokens with weight 0"),
    ("seq_masked_fraction", "sequences entirely masked"),
    ("truncated_high_fraction", "tokens truncated down"),
)


def mask_rates(analysis: Analysis) -> Figure:
    """Token and sequence mask rates and the truncated share: one bar per setting in its color
    for each rate. (The settings table holds the same numbers: not among `setting_figures`.)"""
    n = len(analysis.settings)
    data = [
        {
            "type": "bar",
            "name": _label(s),
            "x": [label for _, label in MASK_RATES],
            "y": [s[key] for key, _ in MASK_RATES],
            "marker": {"color": color(i), "line": {"width": 0}},
            "texttemplate": "%{y:.1%}" if n <= OVERLAY_MAX else "",
            "textposition": "outside",
            "hovertemplate": "<b>%{fullData.name}</b><br>%{x}: %{y:.2%}<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    layout = _layout("Mask and truncation rates", "", "share")
    layout["xaxis"]["type"] = "category"
    layout["yaxis"]["tickformat"] = ".0%"
    layout["yaxis"]["rangemode"] = "tozero"
    layout["barmode"] = "group"
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def lr_scale_by_step(analysis: Analysis) -> Figure:
    """Effective learning-rate scale per training step, one line per setting."""
    n = len(analysis.settings)
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            **style(i, n),
            "x": [r["step"] for r in s["by_step"]],
            "y": [r.get("lr_scale") for r in s["by_step"]],
            "name": f"{_label(s)}: {s['aggregation']}",
            "hovertemplate": "<b>%{fullData.name}</b><br>training step %{x}<br>"
            "LR scale %{y:.4g} (corrected / uncorrected gradient)<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    scales = [r["lr_scale"] for s in analysis.settings for r in s["by_step"] if r.get("lr_scale")]
    layout = _layout(
        "Effective learning-rate scale per step",
        "training step",
        "LR scale (corrected / uncorrected)",
        ylog=True,
        yspan=(min([*scales, 1.0]), max([*scales, 1.0])) if scales else None,
    )
    steps = sorted({r["step"] for s in analysis.settings for r in s["by_step"]})
    if steps:
        # Whole steps only, at most about 8: with 2 steps, auto ticks fall at halves and
        # print as "-1, -1, 0, 1, 1".
        every = max(1, math.ceil((steps[-1] - steps[0]) / 7))
        layout["xaxis"] |= {"tickmode": "linear", "tick0": steps[0], "dtick": every}
    layout["xaxis"]["tickformat"] = "d"
    layout["shapes"] = [_hline(1.0, "uncorrected")]
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def abs_diff_histogram(analysis: Analysis) -> Figure:
    """Distribution of |d| over loss tokens, log x-axis, re-binned for its spread, with the
    median and the 99th percentile marked."""
    m = analysis.mismatch
    hist = m["abs_diff_hist"]
    total = max(sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"], 1)
    data = []
    layout_span = None
    if hist["counts"]:
        edges, counts = rebin(hist["edges"], hist["counts"])
        shares = [c / total for c in counts]
        x, y = _step(edges, [a / w for a, w in zip(shares, widths(edges), strict=True)])
        zero = f", {hist['zeros'] / total:.1%} exactly 0" if hist["zeros"] else ""
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "line": {"shape": "hv", "color": DATA, "width": 2},
                "fill": "tozeroy",
                "fillcolor": "rgba(91, 132, 177, 0.25)",
                "x": x,
                "y": y,
                "name": f"|d|{zero}",
                "customdata": _bin_data(edges, shares),
                "hovertemplate": "|d| from %{customdata[0]:.3g} to %{customdata[1]:.3g} nats"
                "<br>%{customdata[2]:.3%} of loss tokens<extra></extra>",
            }
        )
        layout_span = (edges[0], edges[-1])
        heights = [v for v in y if v > 0]
        quantiles = m.get("abs_diff_quantiles") or {}
        for key, label, style_ in (("p50", "median", "dash"), ("p99", "99th percentile", "dot")):
            value = quantiles.get(key)
            if value and value > 0:
                line = _marker_line(value, (min(heights), max(heights)), "", style_)
                line["name"] = f"{label} of |d|: {value:.3g} nats"
                data.append(line)
    layout = _layout(
        "Distribution of |d| = |train - rollout log-prob|",
        "|d| (nats)",
        "share of loss tokens per decade",
        xlog=True,
        ylog=True,
        xspan=layout_span,
    )
    layout["showlegend"] = bool(data)
    return {"data": data, "layout": layout}


def signed_diff_histogram(analysis: Analysis, central: float = 0.98) -> Figure:
    """Distribution of signed d = train - rollout over loss tokens, on a symmetric log scale:
    |d| grows in decades away from the middle on either side, and the smallest 1% of |d|
    (exact zeros included) share the middle bar. An offset shows as one side outweighing the
    other; the dotted line is the histogram's mirror image (a symmetric d lies on it), and the
    mean of d is marked."""
    m = analysis.mismatch
    hist = m["signed_diff_hist"]
    neg, pos = hist["negative"], hist["positive"]
    total = (
        sum(neg["counts"]) + sum(pos["counts"]) + hist["zeros"]
        + neg["underflow"] + pos["underflow"] + neg["overflow"] + pos["overflow"]
    )  # fmt: skip
    title = "Distribution of signed d = train - rollout log-prob"
    layout = _layout(title, "d (nats), log scale either side of 0", "share of loss tokens per bin")
    layout["showlegend"] = True
    if not total or not hist["edges"]:
        return {"data": [], "layout": layout}
    both = [a + b for a, b in zip(neg["counts"], pos["counts"], strict=True)]
    edges, _ = rebin(hist["edges"], both, central=central, tails=None)
    # Re-bin each side on the same bins (the both-sides bins, padded to where the data starts).
    below = _regroup(hist["edges"], neg["counts"], edges)
    above = _regroup(hist["edges"], pos["counts"], edges)
    width = widths(edges)[0]
    # The middle bar: exact zeros, underflow and the bins below the 1% quantile of |d|.
    floor_share = (1.0 - central) / 2.0
    middle = hist["zeros"] + neg["underflow"] + pos["underflow"]
    cut = 0
    while cut < len(below) - 1 and middle + below[cut] + above[cut] <= floor_share * total:
        middle += below[cut] + above[cut]
        cut += 1
    floor = edges[cut]
    edges, below, above = edges[cut:], below[cut:], above[cut:]
    half = width / 2.0

    def t(v: float) -> float:
        """Position on the symmetric log axis of |d| = v >= floor."""
        return math.log10(v / floor) + half

    centers = [t(math.sqrt(a * b)) for a, b in itertools.pairwise(edges)]
    x = [-c for c in reversed(centers)] + [0.0] + centers
    counts = [*reversed(below), middle, *above]
    shares = [c / total for c in counts]
    ranges = (
        [[-b, -a] for a, b in reversed(list(itertools.pairwise(edges)))]
        + [[-floor, floor]]
        + [[a, b] for a, b in itertools.pairwise(edges)]
    )
    side_below = sum(below) + neg["underflow"] + neg["overflow"]
    side_above = sum(above) + pos["underflow"] + pos["overflow"]
    middle_index = len(below)
    data = [
        {
            "type": "bar",
            "x": x,
            "y": shares,
            "width": width,
            "marker": {
                "color": [MIDDLE if j == middle_index else DATA for j in range(len(x))],
                "line": {"width": 0},
            },
            "name": f"d: {side_below / total:.1%} below 0, {side_above / total:.1%} above",
            "customdata": [[a, b, s] for (a, b), s in zip(ranges, shares, strict=True)],
            "hovertemplate": "d from %{customdata[0]:.3g} to %{customdata[1]:.3g} nats<br>"
            "%{customdata[2]:.3%} of loss tokens<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "lines",
            "x": x,
            "y": shares[::-1],
            "line": {"shape": "hvh", "color": NEUTRAL, "width": 1.5, "dash": "dot"},
            "name": "mirror image (a symmetric d lies on it)",
            "hoverinfo": "skip",
        },
    ]
    mean = m.get("d_mean")
    if mean is not None and math.isfinite(mean):
        at = 0.0 if abs(mean) < floor else math.copysign(t(abs(mean)), mean)
        data.append(_marker_line(at, (0.0, max(shares) * 1.05), f"mean d = {mean:+.3g} nats"))
    top = t(edges[-1])
    # Decades labelled on each side: at most 3, none within 1.5 decades of the middle (the
    # "0" label's place).
    decades = [
        k
        for k in range(math.ceil(math.log10(floor)), math.floor(math.log10(edges[-1])) + 1)
        if t(10.0**k) >= 1.5
    ]
    every = max(1, math.ceil(len(decades) / 3))
    shown = decades[::-1][::every][::-1]
    layout["xaxis"] |= {
        "tickmode": "array",
        "tickvals": [-t(10.0**k) for k in reversed(shown)] + [0.0] + [t(10.0**k) for k in shown],
        "ticktext": [f"\u2212{_decade(k)}" for k in reversed(shown)]
        + ["0"]
        + [_decade(k) for k in shown],
        "tickangle": 0,
        "range": [-top - width, top + width],
        "zeroline": False,
    }
    layout["yaxis"] |= {"tickformat": ".1%", "rangemode": "tozero"}
    layout["bargap"] = 0
    layout["xaxis"]["title"]["text"] = (
        f"d (nats), log scale either side of 0; |d| < {floor:.1g} in the middle bar"
    )
    return {"data": data, "layout": layout}


def _marker_line(
    x: float, y: tuple[float, float], name: str, dash_: str = "dash"
) -> dict[str, Any]:
    """A vertical line at x from y[0] to y[1] as a trace: named in the legend, where a
    shape's label would sit over the data."""
    return {
        "type": "scatter",
        "mode": "lines",
        "x": [x, x],
        "y": list(y),
        "name": name,
        "line": {"color": ACCENT, "width": 2, "dash": dash_},
        "hovertemplate": "%{fullData.name}<extra></extra>",
    }


def _regroup(fine_edges: Sequence[float], counts: Sequence[float], edges: Sequence[float]) -> list:
    """`counts` over `fine_edges` summed into the coarser bins `edges` (whose edges are among
    the fine ones, up to rounding); counts outside them are dropped."""
    out = [0.0] * (len(edges) - 1)
    j = 0
    for (a, _), c in zip(itertools.pairwise(fine_edges), counts, strict=True):
        while j < len(out) and a >= edges[j + 1] * (1 - 1e-9):
            j += 1
        if j < len(out) and a >= edges[j] * (1 - 1e-9):
            out[j] += c
    return out


def _decade(k: int) -> str:
    """10^k as a tick label: plain down to 0.01, a power below."""
    return f"{10.0**k:g}" if k >= -2 else f"10<sup>{k}</sup>".replace("-", "\u2212")


_BY_TITLES = {
    "by_prob": "rollout probability of the sampled token",
    "by_pos": "position in the sequence",
    "by_length": "sequence length (loss tokens)",
    "by_step": "training step",
}


def mismatch_by(analysis: Analysis, key: str) -> Figure:
    """Mean |d| (bars, left axis) and k3 (line, right axis) per bucket: `key` is by_prob,
    by_pos, by_length or by_step. Each axis is titled in its trace's color: no legend."""
    rows = analysis.mismatch[key]
    x_title = _BY_TITLES[key]
    x = [r["step"] for r in rows] if key == "by_step" else [r["bucket"] for r in rows]
    hover_x = f"{x_title} %{{x}}<br>%{{customdata:,}} loss tokens<br>"
    tokens = [r.get("tokens") for r in rows]
    data = [
        {
            "type": "bar",
            "x": x,
            "y": [r.get("abs_diff_mean") for r in rows],
            "name": "mean |d|",
            "marker": {"color": DATA, "line": {"width": 0}},
            "customdata": tokens,
            "hovertemplate": hover_x + "mean |d| %{y:.3g} nats<extra></extra>",
        },
        {
            "type": "scatter",
            "mode": "lines+markers",
            "x": x,
            "y": [r.get("k3") for r in rows],
            "name": "k3 (KL estimate)",
            "yaxis": "y2",
            "line": {"color": ACCENT, "width": 2},
            "marker": {"color": ACCENT, "size": 7},
            "customdata": tokens,
            "hovertemplate": hover_x + "k3 %{y:.3g} (KL estimate, nats)<extra></extra>",
        },
    ]
    layout = _layout(f"Mismatch by {x_title}", x_title, "mean |d| (nats)")
    layout["yaxis"]["title"]["font"] = {"color": DATA}
    layout["yaxis"]["tickfont"] = {"color": DATA}
    # Linear: a log axis over less than a decade shows only stray labels (2, 4, 5).
    layout["yaxis2"] = {
        "title": {"text": "k3 (KL estimate)", "font": {"color": ACCENT}},
        "tickfont": {"color": ACCENT},
        "overlaying": "y",
        "side": "right",
        "rangemode": "tozero",
        # Its own round ticks: plotly otherwise lines them up with the left axis's grid
        # (0.00094, 0.0019, ...).
        "tickmode": "auto",
        "tickformat": ".2~g",
        "showgrid": False,
        "zeroline": False,
        "automargin": True,
    }
    layout["xaxis"]["type"] = "category"
    layout["showlegend"] = False  # the axes' titles, in the traces' colors, name them
    return {"data": data, "layout": layout}


def joint_histogram(analysis: Analysis) -> Figure:
    """2-D histogram of train vs rollout log-prob (log color scale), with the diagonal.

    Not among `mismatch_figures`: at 0.25-nat cells every token sits on the diagonal unless
    |d| is huge, so it shows nothing that `signed_diff_histogram` and `mismatch_by(analysis,
    "by_prob")` do not show better.
    """
    joint = analysis.mismatch["joint_hist"]
    edges = joint["edges"]
    centers = [(a + b) / 2 for a, b in itertools.pairwise(edges)]
    z = [[math.log10(c) if c else None for c in row] for row in joint["counts"]]
    data = [
        {
            "type": "heatmap",
            "x": centers,
            "y": centers,
            "z": [list(col) for col in zip(*z, strict=True)],  # rows are y (train)
            "colorscale": "Viridis",
            "colorbar": {"title": {"text": "log10 tokens"}},
            "hovertemplate": "rollout log-prob %{x:.2f}, train log-prob %{y:.2f}<br>"
            "10^%{z:.1f} loss tokens<extra></extra>",
        }
    ]
    layout = _layout(
        "Train vs rollout log-prob", "rollout log-prob (nats)", "train log-prob (nats)", height=460
    )
    layout["shapes"] = [
        {
            "type": "line",
            "x0": edges[0],
            "y0": edges[0],
            "x1": edges[-1],
            "y1": edges[-1],
            "line": {"dash": "dot", "color": "#fff", "width": 1},
        }
    ]
    return {"data": data, "layout": layout}


def _steps(analysis: Analysis) -> int:
    return len(analysis.mismatch.get("by_step") or [])


def mismatch_figures(analysis: Analysis) -> dict[str, Figure]:
    """The mismatch figures worth showing for this analysis, by key, in reading order
    (per-step breakdowns only with two steps or more)."""
    figures = {
        "signed_diff": signed_diff_histogram(analysis),
        "abs_diff": abs_diff_histogram(analysis),
        "by_prob": mismatch_by(analysis, "by_prob"),
        "by_pos": mismatch_by(analysis, "by_pos"),
        "by_length": mismatch_by(analysis, "by_length"),
    }
    if _steps(analysis) >= 2:
        figures["by_step"] = mismatch_by(analysis, "by_step")
    return figures


def setting_figures(analysis: Analysis) -> dict[str, Figure]:
    """The settings' figures worth showing, by key, in reading order (none without settings;
    the LR scale per step only with two steps or more)."""
    if not analysis.settings:
        return {}
    figures = {
        "weights": weight_histogram(analysis, "weight"),
        "raw": weight_histogram(analysis, "raw"),
        "collapse": collapse_by_length(analysis),
        "mask_by_length": mask_rate_by_length(analysis),
    }
    if _steps(analysis) >= 2:
        figures["lr_scale"] = lr_scale_by_step(analysis)
    return figures


def all_figures(analysis: Analysis) -> dict[str, Figure]:
    """Every figure of the report, by section key."""
    return mismatch_figures(analysis) | setting_figures(analysis)


# ------------------------------------------------------------------ the app's own figures


def length_figure(summary: dict[str, Any]) -> Figure:
    """The pre-binned histogram of sequence lengths (`iscore.workspace.summarize`)."""
    edges = summary["length_hist"]["edges"]
    layout = _layout("Sequence lengths", "sequence length (tokens)", "sequences")
    layout["bargap"] = 0.05
    layout["showlegend"] = False
    return {
        "data": [
            {
                "type": "bar",
                "x": [(a + b) / 2 for a, b in itertools.pairwise(edges)],
                "width": [b - a for a, b in itertools.pairwise(edges)],
                "y": summary["length_hist"]["counts"],
                "customdata": list(itertools.pairwise(edges)),
                "marker": {"color": DATA, "line": {"width": 0}},
                "name": "sequences",
                "hovertemplate": "sequence length %{customdata[0]:,.0f} to "
                "%{customdata[1]:,.0f} tokens<br>%{y:,} sequences<extra></extra>",
            }
        ],
        "layout": layout,
    }


def sequence_figure(
    tokens: dict[str, Any], title: str, weights: dict[str, Any] | None = None
) -> Figure:
    """One sequence's rollout and train log-probs (top) and d (below) along its positions
    (`iscore.workspace.sequence_tokens`), drawn with WebGL; with `weights` (legend name: the
    per-token weight under that setting, 0 where it masks the token), a third panel at the
    bottom draws setting i in `style(i)`, on the same positions, so that a spike of d lines up
    with what each setting does to it."""
    pos = [float(p) for p in tokens["pos"]]

    def line(name: str, values: Any, axis: str, hover: str, **style_: Any) -> dict[str, Any]:
        return {
            "type": "scattergl", "mode": "lines", "name": name, "x": pos,
            "y": [float(v) for v in values], "xaxis": "x", "yaxis": axis, "line": style_,
            "hovertemplate": f"position %{{x:,.0f}}<br>{hover}<extra></extra>",
        }  # fmt: skip

    def nats(name: str, values: Any, axis: str, **style_: Any) -> dict[str, Any]:
        return line(name, values, axis, f"{name} %{{y:.4g}} nats", **style_)

    weights = weights or {}
    layout = _layout(title, "position in the sequence", "log-prob (nats)", height=460)
    layout["yaxis"]["domain"] = [0.42, 1.0]
    layout["yaxis2"] = _axis("d (nats)") | {"domain": [0.0, 0.36]}
    if weights:
        layout["height"] = 640
        layout["yaxis"]["domain"] = [0.6, 1.0]
        layout["yaxis2"]["domain"] = [0.32, 0.54]
        layout["yaxis3"] = _axis("weight") | {"domain": [0.0, 0.26]}
    layout["xaxis"]["anchor"] = "y3" if weights else "y2"
    layout["shapes"] = [_hline(0.0, yref="y2")]
    return {
        "data": [
            # The trainer's curve wide and light under the rollout's: where they differ, it shows.
            nats("train log-prob", tokens["train"], "y", color=TRAIN, width=4),
            nats("rollout log-prob", tokens["rollout"], "y", color=DATA, width=1.2),
            nats("d = train - rollout", tokens["d"], "y2", color=ACCENT, width=1.2),
            *(
                line(
                    text(name),
                    w,
                    "y3",
                    "weight under %{fullData.name} %{y:.4g}",
                    **style(i, len(weights))["line"],
                )
                for i, (name, w) in enumerate(weights.items())
            ),
        ],
        "layout": layout,
    }


READOUTS = (
    ("token_masked_fraction", "tokens with weight 0", "#1f77b4"),
    ("seq_masked_fraction", "sequences masked", "#ff7f0e"),
    ("truncated_fraction", "tokens truncated", "#2ca02c"),
    ("ess", "ESS", "#9467bd"),
    ("lr_scale", "LR scale", "#d62728"),
)
"""The read-outs of a threshold setting: `TuneResult` field, label, color."""


def tune_figure(
    bound: str,
    xs: Sequence[float],
    results: Sequence[TuneResult],
    value: float,
    fields: Sequence[str],
    marks: Sequence[tuple[str, float]] = (),
) -> Figure:
    """The read-outs `fields` across one threshold's slider values `xs`, placed as the slider
    places them (evenly, one step apart: each step moves the share of the data beyond the
    bound by a constant factor), with the chosen value and `marks` (label, value), e.g. the
    framework's default and the recommended setting, drawn as vertical lines.

    Ticks are every so many steps (`_even_steps`), labelled with the values there. The lines'
    labels sit at the top of the plot area, a row each (two lines may be a step apart), in
    room kept above the read-outs: at the bottom they ran into the tick labels."""
    xs = list(xs)
    steps = list(range(len(xs)))
    labels = [f"{x:.6g}" for x in xs]
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "x": steps,
            "y": [getattr(r, field) for r in results],
            "customdata": labels,
            "name": name,
            "line": {"color": shade, "dash": "dash" if field == "lr_scale" else "solid"},
            "hovertemplate": f"{bound} %{{customdata}}<br>{name} %{{y:.4g}}<extra></extra>",
        }
        for field, name, shade in READOUTS
        if field in fields
    ]
    layout = _layout(f"Read-outs across {bound}", bound, "fraction / scale", height=300)
    ticks = _even_steps(len(xs))
    layout["xaxis"].update(
        tickmode="array",
        tickvals=ticks,
        ticktext=[labels[i] for i in ticks],
        range=[0, len(xs) - 1],
    )

    def at(x: float) -> int:
        return min(steps, key=lambda i: abs(math.log(xs[i]) - math.log(x)))

    lines = [
        (text(label), at(x), {"dash": "dash", "color": NEUTRAL, "width": 1}) for label, x in marks
    ] + [(f"{value:.6g}", at(value), {"color": NEUTRAL, "width": 2})]
    # Line k ends LABEL_ROW * (k + 1) below the top, its label just above its end: a row each,
    # in a band at the top that the y-range keeps free of read-outs.
    top = max([1.0, *(y for trace in data for y in trace["y"] if y is not None)])
    layout["yaxis"]["range"] = [0.0, top / (1 - LABEL_ROW * (len(lines) + 0.5))]
    layout["shapes"] = [
        _vline(x)
        | {
            "y1": 1 - LABEL_ROW * (row + 1),
            "line": line,
            "label": {
                "text": label,
                "textposition": "end",
                "textangle": 0,
                "xanchor": "right" if _left_of(x, len(xs)) else "left",
                "yanchor": "bottom",
                "font": {"size": 10},
            },
        }
        for row, (label, x, line) in enumerate(lines)
    ] + [{**_hline(1.0), "line": {"dash": "dot", "color": NEUTRAL, "width": 1}}]
    return {"data": data, "layout": layout}


LABEL_ROW = 0.075
"""The height of a row of `tune_figure`'s line labels (font size 10), as a share of the plot
area's height: 14 px of the 190 px or so of a 300 px figure."""


def _left_of(x: int, n: int) -> bool:
    """Whether the label of `tune_figure`'s line at step x goes left of it: toward the middle
    of the plot, so that it never runs off its edge (a label away from a nearby line was cut
    at the left edge, 'ecoupled_token_icepop'); the lines' rows keep labels apart."""
    return x > (n - 1) / 2


def _even_steps(n: int, most: int = 5) -> list[int]:
    """Tick positions among n slider steps 0..n-1: every k-th, k the smallest with at most
    `most` gaps, or up to twice that where it also puts a tick on the last step; a tick falls
    only on a step, where the value is known, so the spacing is regular and the ends labelled
    where n allows.

    >>> _even_steps(41), _even_steps(43), _even_steps(42)
    ([0, 8, 16, 24, 32, 40], [0, 14, 28, 42], [0, 9, 18, 27, 36])
    """
    last = n - 1
    if last < 1:
        return [0] * n
    every = math.ceil(last / most)
    every = next((k for k in range(every, 2 * every + 1) if last % k == 0), every)
    return list(range(0, last + 1, every))
