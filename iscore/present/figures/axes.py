"""Axes, layouts, legends, reference lines and panel grids, as plotly layout dicts: log axes
labelled in whole decades (or 1-2-5 where that leaves fewer than 3 labels), transparent
backgrounds, legends right of the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from iscore.present.figures.style import AXIS_LINE, GRID, NEUTRAL, color, text


def axis_layout(title: str, *, log: bool = False, span: tuple[float, float] | None = None) -> dict:
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


def figure_layout(
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
        "xaxis": axis_layout(x, log=xlog, span=xspan),
        "yaxis": axis_layout(y, log=ylog, span=yspan),
        "height": height,
        "margin": {"l": 70, "r": 20, "t": 50, "b": 60},
        "legend": _legend(),
        "hoverlabel": {"namelength": -1},
        # Transparent, so that the figure takes the page's light or dark background.
        "paper_bgcolor": "rgba(0,0,0,0)",
        "plot_bgcolor": "rgba(0,0,0,0)",
    }


def step_axis(axis: dict[str, Any], steps: Sequence[int]) -> None:
    """Ticks of a training-step axis at whole steps only, at most about 8 (with 2 steps, auto
    ticks fall at halves and print as "-1, -1, 0, 1, 1")."""
    if steps:
        every = max(1, math.ceil((max(steps) - min(steps)) / 7))
        axis |= {"tickmode": "linear", "tick0": min(steps), "dtick": every}
    axis["tickformat"] = "d"


def hline(y: float, label: str = "", yref: str = "y") -> dict[str, Any]:
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


def vline(x: float, label: str = "", position: str = "end") -> dict[str, Any]:
    """A dotted vertical line at x; its label along it, at its top (`position` "end") or
    running up from its bottom ("start": clear of the tick labels under the axis)."""
    label_ = {"text": label, "textposition": position, "font": {"size": 10}}
    if position == "start":
        label_["xanchor"] = "left"
    return {
        "type": "line",
        "yref": "paper",
        "y0": 0,
        "y1": 1,
        "x0": x,
        "x1": x,
        "line": {"dash": "dot", "color": NEUTRAL, "width": 1},
        "label": label_ if label else {},
    }


def panel_axes(p: int) -> dict[str, str]:
    """The x and y axes of panel p of a grid (plotly names them x, x2, x3...)."""
    suffix = "" if p == 0 else str(p + 1)
    return {"xaxis": f"x{suffix}", "yaxis": f"y{suffix}"}


def panel_grid(
    layout: dict[str, Any], n: int, rows: int, columns: int, titles: Sequence[str]
) -> None:
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
