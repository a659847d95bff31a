"""Figures as plotly JSON specs (plain dicts): of an analysis, shared by the HTML report and the
app, and the app's own (lengths, one sequence's tokens, a threshold's read-outs).

The engine never imports plotly: a figure here is the `{"data": [...], "layout": {...}}` dict
that plotly.js renders (and `plotly.graph_objects.Figure` accepts). Every figure is built from
the small pre-binned tables of an `Analysis`, never from per-token data, so a page stays small
whatever the size of the dump.

>>> fig = lr_scale_by_step(analysis)  # doctest: +SKIP
>>> fig["layout"]["yaxis"]["title"]["text"]  # doctest: +SKIP
'LR scale (corrected / uncorrected)'
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from iscore.analyze import Analysis
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
"""One color per setting, in order, on every figure (the app uses the same)."""

Figure = dict[str, Any]


def color(i: int) -> str:
    """The color of the i-th setting."""
    return PALETTE[i % len(PALETTE)]


def _layout(
    title: str, x: str, y: str, *, xlog: bool = False, ylog: bool = False, height: int = 380
) -> dict[str, Any]:
    return {
        "title": {"text": title, "x": 0.01, "xanchor": "left"},
        "xaxis": {"title": {"text": x}, "zeroline": False, **_scale(xlog)},
        "yaxis": {"title": {"text": y}, "zeroline": False, **_scale(ylog)},
        "height": height,
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        # Right of the plot area (which shrinks to make room): never over an axis title.
        "legend": {"orientation": "v", "x": 1.02, "xanchor": "left", "y": 1, "yanchor": "top"},
        # Transparent, so that the figure takes the page's light or dark background.
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
    }


def _scale(log: bool) -> dict[str, Any]:
    """An axis' type; a log axis gets few ticks, so that its minor labels do not crowd."""
    return {"type": "log", "nticks": 8} if log else {"type": "linear"}


def _hline(y: float, label: str = "") -> dict[str, Any]:
    return {
        "type": "line",
        "xref": "paper",
        "x0": 0,
        "x1": 1,
        "y0": y,
        "y1": y,
        "line": {"dash": "dot", "color": "#555", "width": 1},
        "label": {"text": label, "textposition": "end", "font": {"size": 10}} if label else {},
    }


def _vline(x: float, label: str = "") -> dict[str, Any]:
    return {
        "type": "line",
        "yref": "paper",
        "y0": 0,
        "y1": 1,
        "x0": x,
        "x1": x,
        "line": {"dash": "dot", "color": "#555", "width": 1},
        "label": {"text": label, "textposition": "end", "font": {"size": 10}} if label else {},
    }


def weight_histogram(analysis: Analysis, kind: str = "weight") -> Figure:
    """Distribution of the applied (`kind="weight"`) or raw weights per setting, log x-axis.

    Zeros (masked tokens) cannot sit on a log axis; their share is in the legend.
    """
    data = []
    for i, s in enumerate(analysis.settings):
        hist = s[f"{kind}_hist"]
        total = sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"]
        if not total:
            continue
        edges = hist["edges"]
        centers = [(a * b) ** 0.5 for a, b in itertools.pairwise(edges)]
        zero_share = f", {hist['zeros'] / total:.1%} zero" if hist["zeros"] else ""
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "line": {"shape": "hvh", "color": color(i)},
                "x": centers,
                "y": [c / total for c in hist["counts"]],
                "name": f"{s['name']} ({s['framework']}){zero_share}",
            }
        )
    what = "applied weight w" if kind == "weight" else "raw ratio (before truncation or masks)"
    layout = _layout(
        f"Distribution of the {what}",
        what,
        "fraction of tokens per bin (10 bins/decade)",
        xlog=True,
        ylog=True,
    )
    layout["shapes"] = [_vline(1.0, "1")]
    return {"data": data, "layout": layout}


def collapse_by_length(analysis: Analysis) -> Figure:
    """Per-sequence weight (median, p10-p90 band) against length, beside the independent-token
    expectation for the product ratio e^S at the dump's per-token mismatch."""
    data = []
    for i, s in enumerate(analysis.settings):
        rows = s["by_length"]
        x = [r["length_median"] for r in rows]
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x + x[::-1],
                "y": [r["seq_weight_p90"] for r in rows]
                + [r["seq_weight_p10"] for r in rows][::-1],
                "fill": "toself",
                "fillcolor": color(i),
                "opacity": 0.15,
                "line": {"width": 0},
                "hoverinfo": "skip",
                "showlegend": False,
            }
        )
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": x,
                "y": [r["seq_weight_median"] for r in rows],
                "line": {"color": color(i)},
                "name": f"{s['name']} ({s['framework']})",
                "customdata": [
                    [r["sequences"], r["seq_weight_p10"], r["seq_weight_p90"]] for r in rows
                ],
                "hovertemplate": "T=%{x:.0f}: median %{y:.3g} (p10 %{customdata[1]:.3g}, p90 "
                "%{customdata[2]:.3g}), %{customdata[0]} sequences<extra></extra>",
            }
        )
    rows = analysis.mismatch["by_length"]
    if rows:
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": [r["length_median"] for r in rows],
                "y": [r["expected_seq_ratio_median"] for r in rows],
                "line": {"dash": "dash", "color": "#000"},
                "name": "expected median e^S, independent tokens",
            }
        )
    layout = _layout(
        "Per-sequence weight vs length (median and p10-p90)",
        "sequence length (loss tokens)",
        "mean weight of the sequence's tokens",
        xlog=True,
        ylog=True,
        height=420,
    )
    layout["shapes"] = [_hline(1.0, "1")]
    # The y-range follows the settings' own weights (down to 1e-6 at most): an expected
    # curve at e^-300 would otherwise squash them into a line at the top.
    measured = [
        v
        for s in analysis.settings
        for r in s["by_length"]
        for v in (r["seq_weight_p10"], r["seq_weight_median"], r["seq_weight_p90"])
        if v and v > 0
    ]
    if measured:
        low = max(min(measured), 1e-6)
        high = max(max(measured), 1.0)
        layout["yaxis"]["range"] = [math.log10(low) - 0.3, math.log10(high) + 0.3]
    return {"data": data, "layout": layout}


def mask_rate_by_length(analysis: Analysis) -> Figure:
    """Fraction of loss tokens whose weight is 0 (masked or zeroed), per length bucket."""
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "line": {"color": color(i)},
            "x": [r["length_median"] for r in s["by_length"]],
            "y": [r["token_masked_fraction"] for r in s["by_length"]],
            "name": f"{s['name']} ({s['framework']})",
        }
        for i, s in enumerate(analysis.settings)
    ]
    layout = _layout(
        "Masked token fraction vs length",
        "sequence length (loss tokens)",
        "fraction of loss tokens with weight 0",
        xlog=True,
    )
    layout["yaxis"]["range"] = [0, 1.02]
    layout["yaxis"]["tickformat"] = ".0%"
    return {"data": data, "layout": layout}


def mask_rates(analysis: Analysis) -> Figure:
    """Token and sequence mask rates per setting, side by side."""
    names = [f"{s['name']} ({s['framework']})" for s in analysis.settings]
    data = [
        {
            "type": "bar",
            "name": label,
            "x": names,
            "y": [s[key] for s in analysis.settings],
            "marker": {"color": shade},
            "texttemplate": "%{y:.1%}",
            "textposition": "outside",
        }
        for key, label, shade in (
            ("token_masked_fraction", "tokens with weight 0", "#1f77b4"),
            ("seq_masked_fraction", "sequences entirely masked", "#ff7f0e"),
            ("truncated_high_fraction", "tokens truncated down", "#2ca02c"),
        )
    ]
    layout = _layout("Mask and truncation rates", "", "fraction")
    layout["xaxis"]["type"] = "category"
    layout["yaxis"]["tickformat"] = ".0%"
    layout["barmode"] = "group"
    return {"data": data, "layout": layout}


def lr_scale_by_step(analysis: Analysis) -> Figure:
    """Effective learning-rate scale per training step, one line per setting."""
    data = [
        {
            "type": "scatter",
            "mode": "lines+markers",
            "line": {"color": color(i)},
            "x": [r["step"] for r in s["by_step"]],
            "y": [r.get("lr_scale") for r in s["by_step"]],
            "name": f"{s['name']} ({s['framework']}): {s['aggregation']}",
        }
        for i, s in enumerate(analysis.settings)
    ]
    layout = _layout(
        "Effective learning-rate scale per step",
        "training step",
        "LR scale (corrected / uncorrected)",
        ylog=True,
    )
    layout["shapes"] = [_hline(1.0, "uncorrected")]
    return {"data": data, "layout": layout}


def abs_diff_histogram(analysis: Analysis) -> Figure:
    """Distribution of |d| over loss tokens, log x-axis."""
    hist = analysis.mismatch["abs_diff_hist"]
    edges = hist["edges"]
    total = max(sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"], 1)
    data = [
        {
            "type": "scatter",
            "mode": "lines",
            "line": {"shape": "hvh", "color": "#1f77b4"},
            "x": [(a * b) ** 0.5 for a, b in itertools.pairwise(edges)],
            "y": [c / total for c in hist["counts"]],
            "name": "|d|",
        }
    ]
    layout = _layout(
        "Distribution of |d| = |train - rollout log-prob|",
        "|d| (nats)",
        "fraction of tokens per bin",
        xlog=True,
        ylog=True,
    )
    return {"data": data, "layout": layout}


def mismatch_by(analysis: Analysis, key: str) -> Figure:
    """Mean |d| and k3 per bucket: `key` is by_prob, by_pos, by_length or by_step."""
    rows = analysis.mismatch[key]
    x_title = {
        "by_prob": "rollout probability of the sampled token",
        "by_pos": "position in the sequence",
        "by_length": "sequence length (loss tokens)",
        "by_step": "training step",
    }[key]
    x = [r["step"] for r in rows] if key == "by_step" else [r["bucket"] for r in rows]
    data = [
        {
            "type": "bar",
            "x": x,
            "y": [r.get("abs_diff_mean") for r in rows],
            "name": "mean |d|",
            "marker": {"color": "#1f77b4"},
        },
        {
            "type": "scatter",
            "mode": "lines+markers",
            "x": x,
            "y": [r.get("k3") for r in rows],
            "name": "k3 (KL estimate)",
            "yaxis": "y2",
            "line": {"color": "#d62728"},
        },
    ]
    layout = _layout(f"Mismatch by {x_title}", x_title, "mean |d| (nats)")
    # Linear: a log axis over less than a decade shows only stray labels (2, 4, 5).
    layout["yaxis2"] = {
        "title": {"text": "k3"},
        "overlaying": "y",
        "side": "right",
        "rangemode": "tozero",
        "tickformat": ".2g",
        "showgrid": False,
    }
    layout["xaxis"]["type"] = "category"
    return {"data": data, "layout": layout}


def joint_histogram(analysis: Analysis) -> Figure:
    """2-D histogram of train vs rollout log-prob (log color scale), with the diagonal."""
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
            "hovertemplate": "rollout %{x:.2f}, train %{y:.2f}: 10^%{z:.1f} tokens<extra></extra>",
        }
    ]
    layout = _layout("Train vs rollout log-prob", "rollout log-prob", "train log-prob", height=460)
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


def all_figures(analysis: Analysis) -> dict[str, Figure]:
    """Every figure of the report, by section key."""
    figures = {
        "abs_diff": abs_diff_histogram(analysis),
        "by_prob": mismatch_by(analysis, "by_prob"),
        "by_pos": mismatch_by(analysis, "by_pos"),
        "by_length": mismatch_by(analysis, "by_length"),
        "by_step": mismatch_by(analysis, "by_step"),
        "joint": joint_histogram(analysis),
    }
    if analysis.settings:
        figures |= {
            "weights": weight_histogram(analysis, "weight"),
            "raw": weight_histogram(analysis, "raw"),
            "collapse": collapse_by_length(analysis),
            "mask_by_length": mask_rate_by_length(analysis),
            "mask_rates": mask_rates(analysis),
            "lr_scale": lr_scale_by_step(analysis),
        }
    return figures


# ------------------------------------------------------------------ the app's own figures


def length_figure(summary: dict[str, Any]) -> Figure:
    """The pre-binned histogram of sequence lengths (`iscore.workspace.summarize`)."""
    edges = summary["length_hist"]["edges"]
    layout = _layout("Sequence lengths", "tokens per sequence", "sequences")
    layout["bargap"] = 0.05
    return {
        "data": [
            {
                "type": "bar",
                "x": [(a + b) / 2 for a, b in itertools.pairwise(edges)],
                "width": [b - a for a, b in itertools.pairwise(edges)],
                "y": summary["length_hist"]["counts"],
                "marker": {"color": PALETTE[0]},
                "hovertemplate": "length ≈ %{x:.0f}: %{y} sequences<extra></extra>",
            }
        ],
        "layout": layout,
    }


def sequence_figure(tokens: dict[str, Any], title: str) -> Figure:
    """One sequence's rollout and train log-probs (top) and d (bottom) along its positions
    (`iscore.workspace.sequence_tokens`), drawn with WebGL."""
    pos = [float(p) for p in tokens["pos"]]

    def line(name: str, values: Any, axis: str, **style: Any) -> dict[str, Any]:
        return {
            "type": "scattergl", "mode": "lines", "name": name, "x": pos,
            "y": [float(v) for v in values], "xaxis": "x", "yaxis": axis, "line": style,
        }  # fmt: skip

    layout = _layout(title, "position in the sequence", "log-prob (nats)", height=460)
    layout["xaxis"]["anchor"] = "y2"
    layout["yaxis"]["domain"] = [0.42, 1.0]
    layout["yaxis2"] = {"title": {"text": "d (nats)"}, "domain": [0.0, 0.36], "zeroline": False}
    layout["legend"] = {"orientation": "h", "y": -0.15}
    layout["shapes"] = [{**_hline(0.0), "yref": "y2"}]
    return {
        "data": [
            # The trainer's curve wide and light under the rollout's: where they differ, it shows.
            line("train log-prob", tokens["train"], "y", color="#ffbb78", width=3),
            line("rollout log-prob", tokens["rollout"], "y", color=PALETTE[0], width=1),
            line("d = train - rollout", tokens["d"], "y2", color=PALETTE[1], width=1),
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
    framework's default and the recommended setting, drawn as vertical lines."""
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
    every = max(1, len(xs) // 6)
    layout["xaxis"].update(
        tickmode="array", tickvals=steps[::every], ticktext=labels[::every], range=[0, len(xs) - 1]
    )
    layout["yaxis"]["rangemode"] = "tozero"

    def at(x: float) -> int:
        return min(steps, key=lambda i: abs(math.log(xs[i]) - math.log(x)))

    layout["shapes"] = [
        {
            **_vline(at(x), label),
            "line": {"dash": "dash", "color": "#888", "width": 1},
            "label": {"text": label, "textposition": "start", "font": {"size": 10}},
        }
        for label, x in marks
    ] + [
        {**_vline(at(value), f"{value:.6g}"), "line": {"color": "#888", "width": 2}},
        {**_hline(1.0), "line": {"dash": "dot", "color": "#999", "width": 1}},
    ]
    return {"data": data, "layout": layout}
