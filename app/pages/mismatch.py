"""Mismatch: how far apart the rollout and trainer log-probs are, where, and whether it looks
like a bug rather than noise."""

from __future__ import annotations

import compare_list
import pandas as pd
import render
import runs
import session
import streamlit as st

from iscore.advice import NO_SEMANTICS_BUG, flags_of, whole_distribution
from iscore.present import figures
from iscore.stats import BANDS, DEFINITIONS, METRIC_NAMES

ws = compare_list.require_workspace()
analysis = session.compute(
    "Computing the mismatch diagnostics…", ws.mismatch, session.selected_steps()
)
m = analysis.mismatch

st.title("Mismatch")
st.caption(
    "d = train_logprob - rollout_logprob over loss tokens; k3 = e^d - 1 - d estimates "
    "KL(rollout ‖ train)."
)
health = render.show_health(analysis)
if health.floor is not None:  # a second trainer recompute in the dump
    st.info(render.escape(health.floor.sentence()), icon=":material/graphic_eq:")
whole = whole_distribution(m)
if whole is not None:  # the engine's top-k log-probs in the dump
    st.info(render.escape(whole), icon=":material/stacked_bar_chart:")
render.show_reference(health)
render.show_attribution(analysis)

_SHOW = {
    "semantics_bug": (st.warning, ":material/bug_report:"),
    "broken": (st.warning, ":material/heart_broken:"),
    "drift": (st.warning, ":material/trending_up:"),
    "heavy_tail": (st.info, ":material/warning:"),
}
for kind, (show, icon) in _SHOW.items():
    for flag in flags_of(analysis.flags, kind):
        show(f"**{flag.code}**: {render.escape(flag.message)}", icon=icon)
    if kind == "semantics_bug" and not flags_of(analysis.flags, kind):  # the verdict on bugs, first
        # Green only beside a normal verdict: no bug is no all-clear for FP8-like noise.
        (st.success if health.verdict == "normal" else st.info)(NO_SEMANTICS_BUG)

cols = st.columns(4)
cols[0].metric("mean |d|", f"{m.abs_diff_mean:.3g}", border=True)
cols[1].metric("max |d|", f"{m.abs_diff_max:.3g}", border=True)
cols[2].metric("k3", f"{m.k3:.3g}", border=True)
cols[3].metric(
    "<e^d>", f"{m.ratio_mean:.4f}", help="1 in expectation when both sides are right",
    border=True,
)  # fmt: skip

kept = runs.overlaid()
if kept is not None:
    st.subheader("The runs, overlaid")
    st.caption(
        "Each run whole, a colour each (the loaded dump's own figures follow): "
        + ", ".join(render.escape(name) for name in kept)
        + ". Runs compares any two, with intervals and verdicts."
    )
    for figure in figures.runs_mismatch_figures(runs.analyses(kept)).values():
        render.plot(figure)
    st.subheader("The loaded dump")

# One per row: beside another, a plot keeps a third of its width once its legend is placed.
for figure in figures.mismatch_figures(analysis).values():
    render.plot(figure)

st.subheader("The numbers, and what each framework logs them as")
st.dataframe(
    pd.DataFrame(
        [
            {
                "statistic": key,
                "value": m.value(key),
                "definition": DEFINITIONS[key],
                "logged as": "; ".join(names),
                "healthy, per the frameworks' docs": "; ".join(BANDS[key]),
            }
            for key, names in METRIC_NAMES.items()
        ]
    ),
    column_config={
        "statistic": st.column_config.TextColumn(width="medium"),  # token_mult_prob_error
        "value": st.column_config.NumberColumn(format="%.4g"),
        "definition": st.column_config.TextColumn(width="large"),
        "logged as": st.column_config.TextColumn(width="large"),
        "healthy, per the frameworks' docs": st.column_config.TextColumn(width="medium"),
    },
    hide_index=True,
    width="stretch",
    height=35 * (len(METRIC_NAMES) + 1) + 3,
)

st.subheader("Worst sequences (largest summed k3)")
worst = m.worst_sequences
if not worst:
    st.stop()
st.dataframe(
    pd.DataFrame(worst),
    column_config={
        key: st.column_config.NumberColumn(format="%.4g")
        for key in ("abs_diff_mean", "abs_diff_max", "k3_sum", "log_ratio_sum")
    },
    hide_index=True,
    width="stretch",
    height=240,
)
row = st.selectbox(
    "Sequence to inspect",
    range(len(worst)),
    format_func=lambda i: (
        f"#{i + 1}: step {worst[i]['step']}, seq_id {worst[i]['seq_id']} "
        f"({worst[i]['tokens']:,} tokens, k3 sum {worst[i]['k3_sum']:.3g})"
    ),
)
pick = worst[row]
tokens = ws.sequence(pick["step"], pick["seq_id"])
render.plot(
    figures.sequence_figure(
        tokens, f"Sequence {pick['seq_id']} of step {pick['step']}: log-probs and d per token"
    )
)
