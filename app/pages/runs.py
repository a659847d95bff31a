"""Runs: two of the session's runs compared (`iscore diff` on their loaded data): every
metric's ratio with its interval and the verdict, each verdict's evidence on hover, and the
diff as an HTML page or JSON."""

from __future__ import annotations

import json

import compare_list
import pandas as pd
import render
import runs
import session
import streamlit as st

from iscore.errors import IscoreError
from iscore.present import MISMATCH, diff_figure, diff_rows, render_diff_html, step_rows
from iscore.utils import json_ready

st.title("Runs")
session.notice()
kept = runs.overlaid()
if kept is None:
    st.info(
        "Keep two dumps or more as runs on the Data page (open one, add it as a run, open the "
        "next, add it too) to compare them here."
    )
    st.page_link("pages/data.py", label="Go to the Data page", icon=":material/database:")
    st.stop()

names = list(kept)
state = st.session_state
if state.get("runs_baseline") not in names:  # renamed or removed since
    state.runs_baseline = names[0]
cols = st.columns(2)
baseline = cols[0].selectbox("Baseline", names, **session.persist("runs_baseline", names[0]))
others = [n for n in names if n != baseline]
if state.get("runs_candidate") not in others:
    state.runs_candidate = others[0]
candidate = cols[1].selectbox("Candidate", others, **session.persist("runs_candidate", others[0]))
specs = compare_list.settings()
st.caption(
    "Each run whole (the step selection and the slice are the loaded dump's), through the "
    f"{len(specs)} setting{'s' * (len(specs) != 1)} of the Compare list. A verdict is the "
    "candidate's: better (green) or worse (red) where the interval of candidate / baseline "
    "lies wholly on one side of 1, same where it holds it (docs/compare.md)."
)
try:
    result = runs.diff_of(kept, baseline, candidate, specs)
except IscoreError as e:
    render.show_error(e)
    st.stop()

cols = st.columns(2)
for col, role, arm in zip(cols, ("Baseline", "Candidate"), result.arms, strict=True):
    with col.container(border=True):
        st.markdown(f"**{role}: {render.escape(arm.name)}**")
        steps = ", ".join(map(str, arm.steps)) if len(arm.steps) < 8 else f"{len(arm.steps)}"
        st.caption(
            f"{arm.tokens:,} loss tokens · {arm.sequences:,} sequences · steps {steps}\n\n"
            + render.escape(", ".join(arm.source))
        )
st.caption(
    ("**Paired**: both hold the same sequences, resampled together. " if result.paired else "")
    + f"{result.level:.0%} intervals of {result.resamples:,} resamples of the sequences within "
    f"steps (seed {result.seed})."
)
worse = result.worse()
if worse:
    st.error(
        "**Worse on the candidate:** " + render.escape(", ".join(worse)), icon=":material/warning:"
    )
else:
    st.success("No metric is worse on the candidate.", icon=":material/check_circle:")


def _table(rows, by_step: bool = False) -> None:
    """The rows of a diff, the verdict coloured; the evidence in its own column and, for the
    ratios, on hover of the figure."""
    frame = pd.DataFrame(
        [
            {
                **({"step": r.step} if by_step else {}),
                "setting": "" if r.group == MISMATCH else r.group,
                "metric": r.metric,
                "baseline": r.baseline,
                "candidate": r.candidate,
                "change": r.change_text,
                f"{result.level:.0%} interval": r.interval_text,
                "verdict": r.verdict,
                "evidence": r.evidence,
            }
            for r in rows
        ]
    )
    style = frame.style.format({"baseline": "{:.4g}", "candidate": "{:.4g}"}, na_rep="-").map(
        lambda v: render.VERDICT_STYLE.get(v, ""), subset=["verdict"]
    )
    st.dataframe(
        style,
        hide_index=True,
        width="stretch",
        column_config={
            "change": st.column_config.Column(
                help="candidate / baseline of the badness (x), or candidate - baseline where "
                "the ratio has no interval"
            ),
            "verdict": st.column_config.Column(help="the candidate's; its evidence at the right"),
            "evidence": st.column_config.TextColumn(width="large"),
        },
    )


st.subheader("Every metric")
_table(diff_rows(result))
render.plot(diff_figure(result))
by_step = step_rows(result)
if by_step:
    with st.expander("By step", icon=":material/timeline:"):
        _table(by_step, by_step=True)

st.subheader("Export")
cols = st.columns(2)
cols[0].download_button(
    "Diff HTML",
    render_diff_html(result),
    file_name="iscore-diff.html",
    mime="text/html",
    icon=":material/description:",
    on_click="ignore",
    help="A self-contained page: no script, opens with no network",
)
cols[1].download_button(
    "Diff JSON",
    json.dumps(json_ready(result.to_dict()), indent=1, allow_nan=False),
    file_name="iscore-diff.json",
    mime="application/json",
    icon=":material/data_object:",
    on_click="ignore",
    help="The iscore.diff document, as `iscore diff --json` writes it",
)
