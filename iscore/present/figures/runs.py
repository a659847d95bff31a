"""Several dumps (the app's runs) on one figure, a colour each (`color(i)` for the i-th run, as
the i-th setting elsewhere): the distribution of |d|, k3 by the rollout probability of the
sampled token, and k3 per training step, from each run's mismatch analysis.

>>> figs = runs_mismatch_figures({"bf16": bf16, "fp8": fp8})  # doctest: +SKIP
>>> [t["name"] for t in figs["abs_diff"]["data"]]             # doctest: +SKIP
['bf16', 'fp8']
"""

from __future__ import annotations

from collections.abc import Mapping

from iscore.passes import Analysis
from iscore.present.figures.axes import figure_layout, step_axis
from iscore.present.figures.binning import rebin, step_outline, widths
from iscore.present.figures.style import Figure, style, text


def runs_abs_diff(runs: Mapping[str, Analysis]) -> Figure:
    """The distribution of |d| over loss tokens of each run (a line each, re-binned for its
    own spread), log axes: a run's curve to the right of another's is its larger mismatch."""
    data = []
    lows, highs = [], []
    for i, (name, analysis) in enumerate(runs.items()):
        hist = analysis.mismatch.abs_diff_hist
        if not hist["counts"]:
            continue
        total = sum(hist["counts"]) + hist["zeros"] + hist["underflow"] + hist["overflow"]
        edges, counts = rebin(hist["edges"], hist["counts"])
        per_decade = [c / max(total, 1) / w for c, w in zip(counts, widths(edges), strict=True)]
        x, y = step_outline(edges, per_decade)
        data.append(
            {
                "type": "scatter",
                "mode": "lines",
                "x": x,
                "y": y,
                "name": text(name),
                "line": style(i, len(runs))["line"] | {"shape": "hv"},
                "hovertemplate": "<b>%{fullData.name}</b><br>|d| %{x:.3g} nats<br>"
                "%{y:.3g} of loss tokens per decade<extra></extra>",
            }
        )
        lows.append(edges[0])
        highs.append(edges[-1])
    layout = figure_layout(
        "Distribution of |d| = |train - rollout log-prob|, each run",
        "|d| (nats)",
        "share of loss tokens per decade",
        xlog=True,
        ylog=True,
        xspan=(min(lows), max(highs)) if lows else None,
    )
    layout["showlegend"] = True
    return {"data": data, "layout": layout}


def runs_mismatch_by(runs: Mapping[str, Analysis], key: str) -> Figure:
    """k3 of each run (a line each) per bucket of `key`: "by_prob" (the rollout probability of
    the sampled token) or "by_step" (the training step)."""
    by_step = key == "by_step"
    x_title = "training step" if by_step else "rollout probability of the sampled token"
    data, order, steps = [], [], set()
    for i, (name, analysis) in enumerate(runs.items()):
        rows = getattr(analysis.mismatch, key) or []
        x = [r["step"] if by_step else r["bucket"] for r in rows]
        steps.update(x if by_step else ())
        order += [b for b in x if b not in order]
        data.append(
            {
                "type": "scatter",
                "mode": "lines+markers",
                "x": x,
                "y": [r.get("k3") for r in rows],
                "name": text(name),
                "customdata": [[r.get("abs_diff_mean"), r.get("tokens")] for r in rows],
                **style(i, len(runs)),
                "hovertemplate": f"<b>%{{fullData.name}}</b><br>{x_title} %{{x}}<br>"
                "k3 %{y:.3g} (KL estimate, nats)<br>mean |d| %{customdata[0]:.3g} nats<br>"
                "%{customdata[1]:,} loss tokens<extra></extra>",
            }
        )
    layout = figure_layout(f"k3 by {x_title}, each run", x_title, "k3 (KL estimate, nats)")
    layout["yaxis"]["rangemode"] = "tozero"
    layout["showlegend"] = True
    if by_step:
        step_axis(layout["xaxis"], sorted(steps))
    else:
        layout["xaxis"] |= {"type": "category", "categoryorder": "array", "categoryarray": order}
    return {"data": data, "layout": layout}


def runs_mismatch_figures(runs: Mapping[str, Analysis]) -> dict[str, Figure]:
    """The runs' mismatch overlaid, by key, in reading order (k3 per step only where a run has
    two steps or more)."""
    figures = {
        "abs_diff": runs_abs_diff(runs),
        "by_prob": runs_mismatch_by(runs, "by_prob"),
    }
    if any(len(a.mismatch.by_step or []) >= 2 for a in runs.values()):
        figures["by_step"] = runs_mismatch_by(runs, "by_step")
    return figures
