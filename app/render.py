"""How the pages draw what iscore computed and decided: text made literal for Markdown,
errors, the health verdict and where the mismatch comes from, the settings table coloured by
its grades, and figures; nothing here computes or decides."""

from __future__ import annotations

import math
import re
from typing import Any

import pandas as pd
import streamlit as st

from iscore.advice import (
    Health,
    point_dict,
    points,
)
from iscore.errors import DumpProblems
from iscore.passes import Analysis
from iscore.present import GRADES, SUMMARY_COLUMNS, color, setting_name
from iscore.stats import SettingSummary

PLOT_CONFIG = {"displaylogo": False, "responsive": True}


_MARKDOWN = re.compile(r"([\\`*_\[\]<>|$~])")


def escape(text: str) -> str:
    """Text shown literally by Streamlit's Markdown (paths and column names have `_`, `*`)."""
    return _MARKDOWN.sub(r"\\\1", text)


def show_error(error: Exception) -> None:
    """An error the user can fix, as the CLI words it: every problem of a dump, listed."""
    if isinstance(error, DumpProblems):
        count = len(error.problems)
        items = "\n".join(f"- {escape(str(p))}" for p in error.problems)
        st.error(f"**{count} problem{'s' * (count > 1)}:**\n\n{items}", icon=":material/error:")
    else:
        st.error(escape(str(error)), icon=":material/error:")


_VERDICT = {
    "normal": (st.success, ":material/check_circle:"),
    "elevated": (st.warning, ":material/warning:"),
    "broken": (st.error, ":material/heart_broken:"),
}


def show_health(analysis: Analysis) -> Health:
    """The verdict (`iscore.advice.health`) as a green, amber or red box with what decided it, the
    published bands it was judged against (with their sources) and each step's verdict in an
    expander; returns it."""
    health = analysis.health
    show, icon = _VERDICT[health.verdict]
    reasons = "\n".join(f"- {escape(r)}" for r in health.reasons)
    show(f"**{escape(health.headline)}**" + (f"\n\n{reasons}" if reasons else ""), icon=icon)
    with st.expander("The published bands it was judged against", icon=":material/rule:"):
        st.dataframe(
            pd.DataFrame(
                [
                    {
                        "statistic": c.band.statistic,
                        "value": c.value,
                        "healthy": c.band.describe(),
                        "within": c.within,
                        "published as": f"{c.framework} {c.band.logged_as}",
                        "outside it": c.band.meaning,
                        "source": c.band.source.name,
                        "link": c.band.source.url,
                    }
                    for c in health.checks
                ]
            ),
            column_config={
                "value": st.column_config.NumberColumn(format="%.4g"),
                "link": st.column_config.LinkColumn(display_text="open"),
            },
            hide_index=True,
            width="stretch",
        )
        if len(health.by_step) > 1:
            st.caption(
                "By step: "
                + " · ".join(
                    f"{', '.join(map(str, steps))}: {verdict}"
                    for verdict, steps in health.steps_by_verdict().items()
                )
            )
    return health


def show_reference(health: Health) -> None:
    """Where the dump sits among published measurements, and the measurements, each with its
    source."""
    if not health.placements:
        return
    st.markdown(
        "**Among published measurements:**\n\n"
        + "\n".join(f"- {escape(p.describe())}" for p in health.placements)
    )
    with st.expander("The published measurements", icon=":material/menu_book:"):
        rows = [point_dict(p) | {"source": p.source.name, "link": p.source.url} for p in points()]
        st.dataframe(
            pd.DataFrame(rows),
            column_config={
                "value": st.column_config.NumberColumn(format="%.4g"),
                "link": st.column_config.LinkColumn(display_text="open"),
            },
            hide_index=True,
            width="stretch",
        )


def show_attribution(analysis: Analysis) -> None:
    """Where the mismatch comes from (`iscore.stats.attribution`): each finding, its evidence and
    what to do."""
    findings = analysis.attribution.findings
    if not findings:
        return
    st.subheader("Where it comes from")
    for f in findings:
        with st.container(border=True):
            st.markdown(f"**{escape(f.title)}** (`{f.kind}`): {escape(f.summary)}")
            st.markdown(f":material/build: {escape(f.action)}")


_GRADES = {
    "good": "background-color: rgba(46, 160, 67, 0.22)",
    "fair": "background-color: rgba(210, 153, 34, 0.25)",
    "bad": "background-color: rgba(248, 81, 73, 0.25)",
}
"""A cell's colour per `Targets.grade`."""


VERDICT_STYLE = {verdict: _GRADES[grade] for verdict, grade in GRADES.items() if grade}
"""A diff verdict's cell colour: better as good, worse as bad (`iscore.present.GRADES`)."""


def _or_nan(value: float | None) -> float:
    return math.nan if value is None else value


def summary_table(analysis: Analysis) -> pd.io.formats.style.Styler:
    """One row per setting, its name in its plot colour; each number coloured by whether it is
    good (green), fair (amber) or bad (red) for training, against the session's targets."""
    return _summary([(None, s) for s in analysis.settings])


def runs_summary_table(analyses: dict[str, Analysis]) -> pd.io.formats.style.Styler:
    """`summary_table` of each setting on each run (`analyses` by run name): a row per setting
    and run, the settings in their order, the runs in theirs under each."""
    settings = zip(*(a.settings for a in analyses.values()), strict=True)
    return _summary([(run, s) for row in settings for run, s in zip(analyses, row, strict=True)])


def _summary(rows: list[tuple[str | None, SettingSummary]]) -> pd.io.formats.style.Styler:
    """The settings table of `rows` (the run, None for none, and a setting's summary)."""
    frame = pd.DataFrame(
        [
            {
                "setting": setting_name(s),
                **({} if run is None else {"run": run}),
                "loss aggregation": s.aggregation,
                # None (no broken sequences to keep) as NaN, which the table shows as "-".
                **{header: _or_nan(s.value(key)) for key, header, _ in SUMMARY_COLUMNS},
            }
            for run, s in rows
        ]
    )
    names = {}
    for _, s in rows:
        names.setdefault(setting_name(s), len(names))
    targets = st.session_state.targets
    style = frame.style.format({header: fmt for _, header, fmt in SUMMARY_COLUMNS}, na_rep="-").map(
        lambda v: f"color: {color(names[v])}; font-weight: 600", subset=["setting"]
    )
    for key, header, _ in SUMMARY_COLUMNS:
        style = style.map(
            lambda v, key=key: _GRADES.get(targets.grade(key, v), ""), subset=[header]
        )
    return style


LANGUAGE = {"yaml": "yaml", "flags": "bash"}
"""The code block language of each snippet syntax."""


EXTENSION = {"yaml": "yaml", "flags": "sh"}
"""The file extension of each snippet syntax."""


def plot(figure: dict[str, Any]) -> None:
    """Show an `iscore.present.figures` figure across the column, in the app's light or dark theme
    (fonts, axes and grid from Streamlit; the settings keep their colours)."""
    st.plotly_chart(figure, width="stretch", config=PLOT_CONFIG, theme="streamlit")
