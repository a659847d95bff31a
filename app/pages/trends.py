"""Trends: the run step by step, each diagnostic and each setting in Compare per training
step, smoothed, with the run's events; a click on a step opens its worst sequences on Explore.
Between two steps, or at an event, `iscore why`'s split of a metric's change (docs/why.md).
With `iscore app DIR --follow`, new steps appear as they land, without a reload."""

from __future__ import annotations

from functools import partial
from typing import Any

import compare_list
import pandas as pd
import render
import runs
import session
import streamlit as st

from iscore.advice import EVENT_KINDS, Trend
from iscore.errors import IscoreError
from iscore.passes import Why, why
from iscore.present import figures
from iscore.stats import SHIFT_METRICS

ws = compare_list.require_workspace()
specs = compare_list.settings()
folder = session.followed()
state = st.session_state

st.title("Trends")
session.notice()
st.caption(
    "Each diagnostic, and each setting in Compare, per training step: faint the step's own "
    "value, solid its smoothing (an exponential moving average, as TensorBoard smooths). A "
    "dotted line marks the step where the run changed; hover its triangle for the evidence. "
    "Click a step to open its worst sequences on Explore."
)
if session.selected_steps() is not None:
    st.caption(
        "Trends shows the whole run: the selected steps and the slice apply to the other pages."
    )


kept = runs.overlaid()
if kept is not None:
    with st.expander("The runs, overlaid", expanded=True, icon=":material/stacks:"):
        st.caption(
            "Each diagnostic of each run per training step, a colour each, smoothed as below: "
            + ", ".join(render.escape(name) for name in kept)
            + "."
        )
        smoothing = st.session_state.get("trends_smoothing", figures.SMOOTHING)
        drawn = figures.runs_trend_figures(runs.trends(kept), smoothing)
        for pair in range(0, len(drawn), 2):
            shown = list(drawn.values())[pair : pair + 2]
            for cell, figure in zip(st.columns(2), shown, strict=False):
                with cell:
                    render.plot(figure)


def _clicked(key: str) -> None:
    """A click on a step's point: open its worst sequences (in the page's next run, where a
    page can be switched)."""
    points = state[key].selection.points
    if points:
        state.trends_step = int(points[0]["x"])


def _chart(column: str, figure: dict[str, Any]) -> None:
    """A figure whose points open their step; its key changes with each click handled, so
    that a chart shown again starts without a selection."""
    key = f"trends_{column}_{state.get('trends_clicks', 0)}"
    st.plotly_chart(
        figure,
        width="stretch",
        config=render.PLOT_CONFIG,
        theme="streamlit",
        key=key,
        on_select=lambda: _clicked(key),
        selection_mode="points",
    )


def _events(trend: Trend) -> None:
    if not trend.events:
        st.success(
            "No event: the mismatch stays within its early steps' band, no step has broken "
            "sequences or an offset, and no setting stops meeting the targets."
        )
        return
    st.markdown(
        "\n".join(
            f"- **Step {e.step}: {render.escape(EVENT_KINDS[e.kind])}**: "
            f"{render.escape(e.evidence)}"
            for e in trend.events
        )
    )


def _pair(trend: Trend) -> tuple[int, int] | None:
    """The two steps to split between: an event's (from the step before it) or two chosen;
    None with a single step."""
    steps = [int(row["step"]) for row in trend.rows]
    if len(steps) < 2:
        return None
    events = {
        f"Step {e.step}: {EVENT_KINDS[e.kind]} ({e.metric})": e.step
        for e in trend.events
        if e.step > steps[0]
    }
    # Plain keys, not persisted: another dump has other steps and events.
    chosen = st.selectbox("Explain", ["Two steps", *events], key="why_at")
    if chosen in events:
        to = events[chosen]
        return max(s for s in steps if s < to), to
    left, right = st.columns(2)
    a = left.selectbox("From step", steps, index=0, key="why_from")
    b = right.selectbox("To step", steps, index=len(steps) - 1, key="why_to")
    return (a, b) if a != b else None


def _why(trend: Trend) -> None:
    """`iscore why` between two steps: the sentence, each factor's split, one factor's bins."""
    pair = _pair(trend)
    if pair is None:
        st.info("Pick two different steps (a run of one step has nothing to split).")
        return
    metric = st.selectbox("Metric", SHIFT_METRICS, **session.persist("why_metric", "k3"))
    a, b = pair
    source = folder if folder is not None else ws.full
    try:
        result: Why = ws.cached(
            ("why", folder, a, b, metric),
            lambda: session.compute(
                "Splitting the change…", partial(why, metric=metric), source, a, b
            ),
        )
    except IscoreError as e:
        render.show_error(e)
        return
    st.markdown(render.escape(result.sentence))
    if not result.change:
        return
    render.plot(figures.why_figure(result))
    titles = {s.title: s.factor for s in result.by}
    best = result.best.title if result.best is not None else next(iter(titles))
    factor = titles[
        st.selectbox("Its bins, by", list(titles), index=list(titles).index(best), key="why_by")
    ]
    render.plot(figures.why_bins_figure(result, factor))
    rows = pd.DataFrame(figures.why_rows(result, factor))
    percent = st.column_config.NumberColumn(format="percent")
    shares = [c for c in rows.columns if c.startswith("share at") or c in ("composition", "within")]
    st.dataframe(rows, hide_index=True, column_config=dict.fromkeys(shares, percent))


@st.fragment(run_every=session.options().interval if folder is not None else None)
def trends() -> None:
    step = state.pop("trends_step", None)
    if step is not None:
        state.trends_clicks = state.get("trends_clicks", 0) + 1
        session.open_worst_sequences(step)
    try:
        if folder is None:
            trend = session.compute("Computing each step's figures…", ws.analysis, specs).trend
        else:
            trend = session.run_trend(folder, specs)
    except IscoreError as e:
        render.show_error(e)
        return
    if not trend.rows:
        st.info("No step yet.")
        return
    cols = st.columns(3)
    cols[0].metric("Steps", len(trend.rows), border=True)
    cols[1].metric("Latest step", trend.rows[-1]["step"], border=True)
    cols[2].metric("Events", len(trend.events), border=True)
    if folder is not None:
        st.caption(
            f"Following {render.escape(folder)}: new steps appear here as they land (looked "
            f"for every {session.options().interval:g} s)."
        )
    _events(trend)
    with st.expander("Why did it change?", icon=":material/troubleshoot:"):
        st.caption(
            "A token-mean metric's change between two steps, split for each factor into "
            "composition (the token mix moved across the factor's bins: more low-probability "
            "tokens, longer responses) and within (each bin's value moved: the arithmetic "
            "drifted); the two add up to the change (`iscore why`, docs/why.md)."
        )
        _why(trend)
    smoothing = st.slider(
        "Smoothing (0: none)",
        min_value=0.0,
        max_value=0.99,
        step=0.01,
        **session.persist("trends_smoothing", figures.SMOOTHING),
    )
    drawn = figures.trend_figures(trend, smoothing)
    st.subheader("The mismatch")
    first, *shown = [m.column for m in figures.DIAGNOSTICS]
    _chart(first, drawn[first])  # k3 against the early band: across the page
    for pair in range(0, len(shown), 2):
        for cell, column in zip(st.columns(2), shown[pair : pair + 2], strict=False):
            with cell:
                _chart(column, drawn[column])
    if not trend.settings:
        st.info("Add settings on Compare to follow what each does, step by step.")
        return
    st.subheader("The settings in Compare")
    for metric in figures.SETTING_METRICS:
        _chart(metric.column, drawn[metric.column])


trends()
