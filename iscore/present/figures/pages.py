"""The app's own figures, each of a small table the app computes: the Data page's sequence
lengths, one sequence's per-token curves (Mismatch, Explore) and a threshold's read-outs
(Tune)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

from iscore.advice import TuneResult
from iscore.present.figures.axes import axis_layout, figure_layout, hline, vline
from iscore.present.figures.style import ACCENT, DATA, NEUTRAL, TRAIN, Figure, style, text


def length_figure(summary: dict[str, Any]) -> Figure:
    """The pre-binned histogram of sequence lengths (`iscore.session.workspace.summarize`)."""
    edges = summary["length_hist"]["edges"]
    layout = figure_layout("Sequence lengths", "sequence length (tokens)", "sequences")
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
    (`iscore.session.workspace.sequence_tokens`), drawn with WebGL; with `weights` (legend name: the
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
    layout = figure_layout(title, "position in the sequence", "log-prob (nats)", height=460)
    layout["yaxis"]["domain"] = [0.42, 1.0]
    layout["yaxis2"] = axis_layout("d (nats)") | {"domain": [0.0, 0.36]}
    if weights:
        layout["height"] = 640
        layout["yaxis"]["domain"] = [0.6, 1.0]
        layout["yaxis2"]["domain"] = [0.32, 0.54]
        layout["yaxis3"] = axis_layout("weight") | {"domain": [0.0, 0.26]}
    layout["xaxis"]["anchor"] = "y3" if weights else "y2"
    layout["shapes"] = [hline(0.0, yref="y2")]
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
    layout = figure_layout(f"Read-outs across {bound}", bound, "fraction / scale", height=300)
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
        vline(x)
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
    ] + [{**hline(1.0), "line": {"dash": "dot", "color": NEUTRAL, "width": 1}}]
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
