"""Recommend: which of the user's framework's settings to use on this dump, why, and what it
does; "Use this setting" hands it to Compare, Tune and Export."""

from __future__ import annotations

import compare_list
import exports
import pandas as pd
import render
import session
import streamlit as st

from iscore.advice import RULE_SYMBOLS, Targets
from iscore.errors import IscoreError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.stats import BROKEN_KEPT

ws = compare_list.require_workspace()
steps = session.selected_steps()
state = st.session_state
title = compare_list.framework_title(compare_list.framework())

st.title(f"Which {title} setting?")
st.caption(
    f"iscore places each kind of {title} correction's thresholds from this dump's own noise, "
    f"replays every candidate beside {title}'s default and ranks them: first those that meet "
    "the targets, then by the gradient they misweight plus the variance they add "
    "(docs/recommend.md)."
)
session.notice()
st.selectbox(
    "Your framework",
    FRAMEWORKS,
    format_func=compare_list.framework_title,
    help="Recommend ranks its settings; Compare, Tune and Export start from them.",
    on_change=compare_list.framework_changed,
    **session.persist("framework", FRAMEWORKS[0], on_change=False),
)
compare_list.seed_settings(ws, steps)  # a Compare list that followed the framework


def _set_targets() -> None:
    try:
        state.targets = Targets(
            state.t_token / 100, state.t_seq / 100, tuple(state.t_lr), state.t_ess / 100
        )
    except IscoreError as e:
        session.say("error", str(e))


with st.expander("Targets: what a good setting may do to this data", icon=":material/flag:"):
    t = state.targets
    with st.form("targets_form", border=False):
        cols = st.columns(4)
        cols[0].number_input(
            "Tokens losing their gradient, at most (%)",
            0.0, 100.0, t.max_token_drop * 100, 0.5, key="t_token",
        )  # fmt: skip
        cols[1].number_input(
            "Sequences dropped, at most (%)", 0.0, 100.0, t.max_seq_drop * 100, 1.0, key="t_seq"
        )
        cols[2].slider(
            "LR scale within", 0.1, 3.0, t.lr_scale, 0.05, key="t_lr",
            help="The corrected gradient's size relative to the uncorrected one",
        )  # fmt: skip
        cols[3].number_input(
            "ESS, at least (% of tokens)", 0.0, 100.0, t.min_ess * 100, 5.0, key="t_ess"
        )
        st.form_submit_button("Rank again", icon=":material/refresh:", on_click=_set_targets)

OBJECTIVE_HELP = (
    "What the ranking minimizes (docs/recommend.md): the gradient misweighted per token plus "
    "the variance the weights add, in units of one token's gradient; the fewest targets "
    "missed first, ties (0.001 apart) keep your default"
)
LR_SCALE_HELP = (
    "The corrected gradient's size over the uncorrected one under the framework's loss "
    "aggregation: 1 leaves the step size alone, 0.5 halves the effective learning rate"
)
rec = compare_list.recommendation(ws, steps)
best = rec.best

if rec.regimes:
    st.subheader("What this dump shows")
    st.markdown("\n".join(f"- {render.escape(r)}" for r in rec.regimes))

st.subheader("Ranked candidates")
rows = [
    {
        "meets targets": c.passes,
        "setting": c.title,
        "misses": "; ".join(c.missed),  # beside the name: the table is wider than the page
        "objective": c.stats["objective"],
        "misweighted (%)": c.misweighted * 100,
        "variance added (%)": c.stats["variance"] * 100,
        "LR scale": c.stats["lr_scale"],
        "ESS": c.stats["ess"] * 100,
        "tokens dropped (%)": c.stats["token_masked_fraction"] * 100,
        "sequences dropped (%)": c.stats["seq_masked_fraction"] * 100,
        "broken gradient kept (%)": c.stats["broken_gradient_kept"] * 100,
        "healthy tokens dropped (%)": c.stats["healthy_token_dropped"] * 100,
    }
    for c in rec.candidates
]
percent = st.column_config.NumberColumn(format="%.2f")
st.dataframe(
    pd.DataFrame(rows),
    column_config={
        "meets targets": st.column_config.CheckboxColumn(
            "meets", width="small", help="Whether the setting meets the targets"
        ),
        "setting": st.column_config.TextColumn(width="large"),
        "objective": st.column_config.NumberColumn(format="%.4f", help=OBJECTIVE_HELP),
        "misweighted (%)": st.column_config.NumberColumn(
            format="%.2f",
            help="The gradient the setting misweights, per token: the mismatch it leaves, what "
            "it truncates or drops of the healthy tokens, and what it keeps of broken ones",
        ),
        "variance added (%)": st.column_config.NumberColumn(
            format="%.2f", help="1/ESS - 1: how much its weights inflate the gradient's variance"
        ),
        "LR scale": st.column_config.NumberColumn(format="%.4g", help=LR_SCALE_HELP),
        "ESS": st.column_config.NumberColumn("ESS (% of tokens)", format="%.1f"),
        "tokens dropped (%)": percent,
        "sequences dropped (%)": percent,
        "broken gradient kept (%)": st.column_config.NumberColumn(
            format="%.2f", help=BROKEN_KEPT[0].upper() + BROKEN_KEPT[1:]
        ),
        "healthy tokens dropped (%)": st.column_config.NumberColumn(
            format="%.2f", help="Tokens of healthy sequences whose gradient the setting removes"
        ),
        "misses": st.column_config.TextColumn(width="medium"),
    },
    hide_index=True,
    width="stretch",
)
st.caption(render.escape(f"Why the first: {rec.pick}"))

index = st.selectbox(
    "Setting",
    range(len(rec.candidates)),
    format_func=lambda i: f"#{i + 1}: {rec.candidates[i].title}",
    key=f"rec_pick_{rec.framework}",
)
chosen = rec.candidates[index]
cols = st.columns(4)
cols[0].metric("LR scale", f"{chosen.stats['lr_scale']:.4g}", help=LR_SCALE_HELP, border=True)
cols[1].metric("ESS", f"{chosen.stats['ess']:.1%}", border=True)
cols[2].metric("Tokens dropped", f"{chosen.stats['token_masked_fraction']:.2%}", border=True)
cols[3].metric("Sequences dropped", f"{chosen.stats['seq_masked_fraction']:.2%}", border=True)
# A semantics bug is not the correction's to fix: no green light then (the Mismatch page's
# flags of the same steps).
green = chosen.green_light(ws.mismatch(steps).flags)
(st.success if green else st.warning)(render.escape(chosen.reason))
st.markdown(f"**Rule:** `{chosen.rule}`", help=RULE_SYMBOLS)
spec = compare_list.recommended(rec, index)
try:
    out = exports.export(ws, spec, spec.framework, steps)
except IscoreError as e:
    render.show_error(e)
else:
    st.code(out.snippet, language=render.LANGUAGE[out.syntax])


def _use() -> None:
    name = compare_list.use_setting(compare_list.recommended(rec, index))
    session.say("success", f"{name} is in Compare, Tune and Export.")


st.button("Use this setting", icon=":material/check:", type="primary", on_click=_use)
for warning in rec.warnings:
    st.warning(render.escape(warning), icon=":material/warning:")
