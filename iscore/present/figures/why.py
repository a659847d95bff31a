"""The split of a metric's change between two steps (`iscore.passes.Why`, docs/why.md) drawn:
each factor's composition and within as shares of the change, and one factor's bins, their
terms and their share of the loss tokens at each step; with the bins' table.

>>> w = iscore.why("data/drift.parquet", 0, 3)               # doctest: +SKIP
>>> why_figure(w)["data"][0]["name"]                         # doctest: +SKIP
'composition (the token mix moved)'
"""

from __future__ import annotations

from typing import Any

from iscore.advice import share_of
from iscore.passes import Why
from iscore.present.figures.axes import figure_layout
from iscore.present.figures.style import Figure, color, text

PARTS = (
    ("composition", "composition (the token mix moved)"),
    ("within", "within (each bin moved)"),
)
"""The two terms, as the figures name them."""


def why_figure(result: Why) -> Figure:
    """Each factor's composition and within as shares of the change: a bar each, side by side
    per factor (they add up to 100%; either can pass it, the other then negative)."""
    factors = [text(s.title) for s in result.by]
    data = [
        {
            "type": "bar",
            "name": name,
            "x": factors,
            "y": [share_of(getattr(s, part), result.change) for s in result.by],
            "marker": {"color": color(i), "line": {"width": 0}},
            "texttemplate": "%{y:.0%}",
            "textposition": "outside",
            "hovertemplate": f"<b>%{{x}}</b><br>{name}: %{{y:.1%}} of the change<extra></extra>",
        }
        for i, (part, name) in enumerate(PARTS)
    ]
    layout = figure_layout(
        f"{text(result.metric)} from step {result.steps[0]} to step {result.steps[1]}, by factor",
        "factor",
        "share of the change",
    )
    layout["xaxis"]["type"] = "category"
    layout["yaxis"]["tickformat"] = ".0%"
    layout["barmode"] = "group"
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def why_bins_figure(result: Why, factor: str) -> Figure:
    """One factor's bins: each bin's composition and within terms as shares of the change
    (bars, left axis) and its share of the loss tokens at each step (lines, right axis)."""
    shift = result.factor(factor)
    labels = [text(b.label) for b in shift.bins]
    data: list[dict[str, Any]] = [
        {
            "type": "bar",
            "name": name,
            "x": labels,
            "y": [share_of(getattr(b, part), result.change) for b in shift.bins],
            "marker": {"color": color(i), "line": {"width": 0}},
            "hovertemplate": f"<b>%{{x}}</b><br>{name}: %{{y:.1%}} of the change<extra></extra>",
        }
        for i, (part, name) in enumerate(PARTS)
    ]
    for s, step in enumerate(result.steps):
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "name": f"share of the loss tokens at step {step}",
                "x": labels,
                "y": [b.share[s] for b in shift.bins],
                "yaxis": "y2",
                "line": {"color": color(2 + s), "dash": "dot" if s == 0 else "solid"},
                "hovertemplate": f"<b>%{{x}}</b><br>step {step}: %{{y:.1%}} of the loss "
                "tokens<extra></extra>",
            }
        )
    layout = figure_layout(
        f"By {text(shift.title)}: each bin's terms and its share of the tokens",
        text(shift.title),
        "share of the change",
        height=440,
    )
    layout["xaxis"]["type"] = "category"
    layout["yaxis"]["tickformat"] = ".0%"
    layout["yaxis2"] = {
        "title": {"text": "share of the loss tokens"},
        "overlaying": "y",
        "side": "right",
        "tickformat": ".0%",
        "rangemode": "tozero",
        "showgrid": False,
    }
    layout["margin"]["r"] = 70
    layout["barmode"] = "group"
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def why_rows(result: Why, factor: str) -> list[dict[str, Any]]:
    """One factor's bins as table rows: the loss tokens, share and metric at each step, and
    the two terms as shares of the change (None where a bin has no token, or no change)."""
    shift = result.factor(factor)
    a, b = result.steps
    return [
        {
            "bin": row.label,
            f"tokens at {a}": row.tokens[0],
            f"tokens at {b}": row.tokens[1],
            f"share at {a}": row.share[0],
            f"share at {b}": row.share[1],
            f"{result.metric} at {a}": row.value[0],
            f"{result.metric} at {b}": row.value[1],
            "composition": share_of(row.composition, result.change),
            "within": share_of(row.within, result.change),
        }
        for row in shift.bins
    ]
