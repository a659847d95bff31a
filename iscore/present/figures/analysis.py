"""The figures of an `Analysis`, shared by the app and the HTML report: weight
distributions, collapse and mask rates by length, LR scale by step, the mismatch histograms
and the mismatch by step, probability, position and length."""

from __future__ import annotations

import itertools
import math
from typing import Any

from iscore.passes import Analysis
from iscore.present.figures.axes import (
    figure_layout,
    hline,
    panel_axes,
    panel_grid,
    step_axis,
    vline,
)
from iscore.present.figures.binning import (
    bin_data,
    decade_label,
    rebin,
    regroup,
    step_outline,
    widths,
)
from iscore.present.figures.style import (
    ACCENT,
    DATA,
    MIDDLE,
    NEUTRAL,
    OVERLAY_MAX,
    Figure,
    color,
    legend_label,
    style,
)
from iscore.present.figures.trends import trend_figure
from iscore.stats import SettingSummary


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
        hist = getattr(s, f"{kind}_hist")
        total = sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"]
        if not total:
            continue
        zero_share = f", {hist['zeros'] / total:.1%} zero" if hist["zeros"] else ""
        if not hist["counts"]:  # every weight 0 (or out of range): in the legend all the same
            data.append(
                {"type": "scatter", "mode": "lines", "x": [], "y": [], "legendgroup": str(i),
                 "line": style(i, n)["line"], "name": f"{legend_label(s)}{zero_share}"}
            )  # fmt: skip
            continue
        edges, counts = rebin(hist["edges"], hist["counts"])
        shares = [c / total for c in counts]
        x, y = step_outline(edges, [a / w for a, w in zip(shares, widths(edges), strict=True)])
        low, high = min(low, edges[0]), max(high, edges[-1])
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x,
                "y": y,
                "line": {**style(i, n)["line"], "shape": "hv"},
                "name": f"{legend_label(s)}{zero_share}",
                "legendgroup": str(i),
                "customdata": bin_data(edges, shares),
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
    layout = figure_layout(
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
    layout["shapes"] = [vline(1.0, "1")]
    layout["showlegend"] = True  # even for one setting: its name, color and zero share
    return {"data": data, "layout": layout}


def _weight_band(s: SettingSummary, i: int, panels: bool) -> dict[str, Any]:
    """Setting i's p10-p90 band of the per-sequence weight, by length."""
    rows_ = s.by_length
    x = [r["length_median"] for r in rows_]
    return {
        "type": "scatter",
        "mode": "lines",
        "x": x + x[::-1],
        "y": [r["seq_weight_p90"] for r in rows_] + [r["seq_weight_p10"] for r in rows_][::-1],
        "fill": "toself",
        "fillcolor": color(i),
        "opacity": 0.12 if not panels else 0.2,
        "line": {"width": 0},
        "hoverinfo": "skip",
        "showlegend": False,
        "legendgroup": str(i),
        **(panel_axes(i) if panels else {}),
    }


def _weight_line(s: SettingSummary, i: int, n: int, panels: bool) -> dict[str, Any]:
    """Setting i's median per-sequence weight, by length, of n settings."""
    rows_ = s.by_length
    return {
        "type": "scatter",
        "mode": "lines+markers",
        "x": [r["length_median"] for r in rows_],
        "y": [r["seq_weight_median"] for r in rows_],
        **style(i, 1 if panels else n),
        "name": legend_label(s),
        "legendgroup": str(i),
        "customdata": [
            [r["bucket"], r["sequences"], r["seq_weight_p10"], r["seq_weight_p90"]] for r in rows_
        ],
        "hovertemplate": "<b>%{fullData.name}</b><br>"
        "sequence length ≈ %{x:,.0f} loss tokens (%{customdata[0]})<br>"
        "median sequence weight %{y:.3g} (p10 %{customdata[2]:.3g}, "
        "p90 %{customdata[3]:.3g})<br>%{customdata[1]:,} sequences<extra></extra>",
        **(panel_axes(i) if panels else {}),
    }


def _expected_line(expected: list[dict[str, Any]], p: int, panels: bool) -> dict[str, Any]:
    """The median e^S expected of independent tokens by length, in panel p."""
    return {
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
        **(panel_axes(p) if panels else {}),
    }


def _weight_range(settings: list[SettingSummary]) -> list[float]:
    """The log10 y-range of the settings' positive per-sequence weights, padded."""
    measured = [
        v
        for s in settings
        for r in s.by_length
        for v in (r["seq_weight_p10"], r["seq_weight_median"], r["seq_weight_p90"])
        if v and v > 0
    ]
    # The y-range follows the settings' own weights (down to 1e-6 at most): an expected
    # curve at e^-300 would otherwise squash them into a line at the top.
    low = max(min(measured), 1e-6) if measured else 1e-3
    high = max(max(measured), 1.0) if measured else 1.0
    return [math.log10(low) - 0.3, math.log10(high) + 0.3]


def _zero_medians(
    settings: list[SettingSummary], floor: float, panels: bool
) -> list[dict[str, Any]]:
    """Each setting's lengths with a median weight of 0 (most sequences masked), as markers on
    the y-axis' `floor`: 0 has no place on a log axis."""
    n = len(settings)
    zeros = []
    for i, s in enumerate(settings):
        at = [r["length_median"] for r in s.by_length if not r["seq_weight_median"]]
        if at:
            zeros.append(
                {
                    "type": "scatter",
                    "mode": "markers",
                    "x": at,
                    "y": [floor] * len(at),
                    "marker": style(i, 1 if panels else n)["marker"] | {"opacity": 0.6},
                    "cliponaxis": False,
                    "name": legend_label(s),
                    "legendgroup": str(i),
                    "showlegend": False,
                    "hovertemplate": "<b>%{fullData.name}</b><br>sequence length ≈ %{x:,.0f} "
                    "loss tokens<br>median sequence weight 0 (masked)<extra></extra>",
                    **(panel_axes(i) if panels else {}),
                }
            )
    return zeros


def _collapse_panels(
    layout: dict[str, Any], settings: list[SettingSummary], rows: int, columns: int
) -> None:
    """Lay `layout` out as a grid of one panel per setting, each with its line at 1."""
    n = len(settings)
    panel_grid(layout, n, rows, columns, [legend_label(s) for s in settings])
    layout["title"]["subtitle"] = {
        "text": "one panel per setting; wide grey: the median e^S expected of independent tokens"
    }
    layout["shapes"] = [
        hline(1.0, yref=panel_axes(p)["yaxis"]) | {"xref": f"{panel_axes(p)['xaxis']} domain"}
        for p in range(n)
    ]


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
    expected = analysis.mismatch.by_length
    bands = [_weight_band(s, i, panels) for i, s in enumerate(settings)]
    lines = [_weight_line(s, i, n, panels) for i, s in enumerate(settings)]
    references = (
        [_expected_line(expected, p, panels) for p in range(n if panels else 1)] if expected else []
    )
    lengths = [r["length_median"] for s in settings for r in s.by_length]
    y_range = _weight_range(settings)
    layout = figure_layout(
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
    zeros = _zero_medians(settings, 10 ** y_range[0], panels)
    if panels:
        _collapse_panels(layout, settings, rows, columns)
    else:
        layout["shapes"] = [hline(1.0, "1")]
        layout["showlegend"] = True
    return {"data": references + bands + lines + zeros, "layout": layout}


def mask_rate_by_length(analysis: Analysis) -> Figure:
    """Fraction of loss tokens whose weight is 0 (masked or zeroed), per length bucket."""
    n = len(analysis.settings)
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            **style(i, n),
            "x": [r["length_median"] for r in s.by_length],
            "y": [r["token_masked_fraction"] for r in s.by_length],
            "customdata": [[r["bucket"], r["sequences"]] for r in s.by_length],
            "name": legend_label(s),
            "hovertemplate": "<b>%{fullData.name}</b><br>"
            "sequence length ≈ %{x:,.0f} loss tokens (%{customdata[0]}, "
            "%{customdata[1]:,} sequences)<br>"
            "%{y:.2%} of loss tokens with weight 0<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    lengths = [r["length_median"] for s in analysis.settings for r in s.by_length]
    layout = figure_layout(
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
            "name": legend_label(s),
            "x": [label for _, label in MASK_RATES],
            "y": [getattr(s, key) for key, _ in MASK_RATES],
            "marker": {"color": color(i), "line": {"width": 0}},
            "texttemplate": "%{y:.1%}" if n <= OVERLAY_MAX else "",
            "textposition": "outside",
            "hovertemplate": "<b>%{fullData.name}</b><br>%{x}: %{y:.2%}<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    layout = figure_layout("Mask and truncation rates", "", "share")
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
            "x": [r["step"] for r in s.by_step],
            "y": [r.get("lr_scale") for r in s.by_step],
            "name": f"{legend_label(s)}: {s.aggregation}",
            "hovertemplate": "<b>%{fullData.name}</b><br>training step %{x}<br>"
            "LR scale %{y:.4g} (corrected / uncorrected gradient)<extra></extra>",
        }
        for i, s in enumerate(analysis.settings)
    ]
    scales = [r["lr_scale"] for s in analysis.settings for r in s.by_step if r.get("lr_scale")]
    layout = figure_layout(
        "Effective learning-rate scale per step",
        "training step",
        "LR scale (corrected / uncorrected)",
        ylog=True,
        yspan=(min([*scales, 1.0]), max([*scales, 1.0])) if scales else None,
    )
    step_axis(layout["xaxis"], sorted({r["step"] for s in analysis.settings for r in s.by_step}))
    layout["shapes"] = [hline(1.0, "uncorrected")]
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def abs_diff_histogram(analysis: Analysis) -> Figure:
    """Distribution of |d| over loss tokens, log x-axis, re-binned for its spread, with the
    median and the 99th percentile marked."""
    m = analysis.mismatch
    hist = m.abs_diff_hist
    total = max(sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"], 1)
    data = []
    layout_span = None
    if hist["counts"]:
        edges, counts = rebin(hist["edges"], hist["counts"])
        shares = [c / total for c in counts]
        x, y = step_outline(edges, [a / w for a, w in zip(shares, widths(edges), strict=True)])
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
                "customdata": bin_data(edges, shares),
                "hovertemplate": "|d| from %{customdata[0]:.3g} to %{customdata[1]:.3g} nats"
                "<br>%{customdata[2]:.3%} of loss tokens<extra></extra>",
            }
        )
        layout_span = (edges[0], edges[-1])
        heights = [v for v in y if v > 0]
        quantiles = m.abs_diff_quantiles or {}
        for key, label, style_ in (("p50", "median", "dash"), ("p99", "99th percentile", "dot")):
            value = quantiles.get(key)
            if value and value > 0:
                line = _marker_line(value, (min(heights), max(heights)), "", style_)
                line["name"] = f"{label} of |d|: {value:.3g} nats"
                data.append(line)
    layout = figure_layout(
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
    hist = m.signed_diff_hist
    neg, pos = hist["negative"], hist["positive"]
    total = (
        sum(neg["counts"]) + sum(pos["counts"]) + hist["zeros"]
        + neg["underflow"] + pos["underflow"] + neg["overflow"] + pos["overflow"]
    )  # fmt: skip
    title = "Distribution of signed d = train - rollout log-prob"
    layout = figure_layout(
        title, "d (nats), log scale either side of 0", "share of loss tokens per bin"
    )
    layout["showlegend"] = True
    if not total or not hist["edges"]:
        return {"data": [], "layout": layout}
    both = [a + b for a, b in zip(neg["counts"], pos["counts"], strict=True)]
    edges, _ = rebin(hist["edges"], both, central=central, tails=None)
    # Re-bin each side on the same bins (the both-sides bins, padded to where the data starts).
    below = regroup(hist["edges"], neg["counts"], edges)
    above = regroup(hist["edges"], pos["counts"], edges)
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
    mean = m.d_mean
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
        "ticktext": [f"\u2212{decade_label(k)}" for k in reversed(shown)]
        + ["0"]
        + [decade_label(k) for k in shown],
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


_BY_TITLES = {
    "by_prob": "rollout probability of the sampled token",
    "by_pos": "position in the sequence",
    "by_length": "sequence length (loss tokens)",
    "by_step": "training step",
}


def mismatch_by(analysis: Analysis, key: str) -> Figure:
    """Mean |d| (bars, left axis) and k3 (line, right axis) per bucket: `key` is by_prob,
    by_pos, by_length or by_step. Each axis is titled in its trace's color: no legend."""
    rows = getattr(analysis.mismatch, key)
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
    layout = figure_layout(f"Mismatch by {x_title}", x_title, "mean |d| (nats)")
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
    joint = analysis.mismatch.joint_hist
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
    layout = figure_layout(
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
    return len(analysis.mismatch.by_step or [])


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
        figures["trend"] = trend_figure(analysis.trend)
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
