"""Compare: any number of correction settings side by side on the loaded dump."""

from __future__ import annotations

import compare_list
import render
import runs
import session
import streamlit as st

from iscore.advice import FAMILIES, family_spec, flags_of, frameworks_for
from iscore.errors import IscoreError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.frameworks import load_config_text, parse_config
from iscore.present import SUMMARY_COLUMNS, figures

ws = compare_list.require_workspace()
steps = session.selected_steps()
state = st.session_state
known = compare_list.known_settings()


def _pick() -> None:
    state.settings = [known[key] for key in state._w_compare]


st.title("Compare settings")
session.notice()
state._w_compare = [compare_list.label(s) for s in compare_list.settings()]
st.multiselect(
    "Settings compared: framework presets, and the settings added below or on the Tune page",
    list(known),
    key="_w_compare",
    on_change=_pick,
    placeholder="Pick presets, e.g. verl:decoupled_geo_rs",
)


@st.fragment
def _add_your_own() -> None:
    """The pasted or built setting; its widgets rerun only this part until a setting is added
    (then the whole page, to replay it)."""
    paste, build = st.tabs(["Paste a framework config", "Build one"])
    with paste:
        text = st.text_area(
            "YAML: the framework's own config plus a top-level `framework:` (and `name:`)",
            height=180,
            key="paste_yaml",
            placeholder="framework: verl\nname: my_tis\nalgorithm:\n  rollout_correction:\n"
            "    rollout_is: token\n    rollout_is_threshold: 2.0",
        )
        if st.button("Add this config", icon=":material/add:"):
            try:
                config = load_config_text(text, "the pasted config") if text.strip() else None
                session.say("success", f"Added {compare_list.add_setting(parse_config(config))}.")
            except IscoreError as e:
                # Here, under the text to fix: a whole-page rerun would fold the panel away.
                st.error(render.escape(str(e)))
            else:
                st.rerun()
    with build:
        cols = st.columns(2)
        framework = cols[0].selectbox(
            "Framework",
            FRAMEWORKS,
            index=FRAMEWORKS.index(compare_list.framework()),
            key="build_framework",
        )
        methods = [k for k in FAMILIES if framework in frameworks_for(k)]
        family = cols[1].selectbox(
            "Method", methods, format_func=lambda k: FAMILIES[k].label, key="build_family"
        )
        st.caption(FAMILIES[family].rule)
        bounds = FAMILIES[family].bounds
        cols = st.columns(len(bounds) + 1)
        values = [
            col.number_input(
                bound, value=default, min_value=0.0, format="%.4g", key=f"build_{family}_{bound}"
            )
            for col, bound, default in zip(cols, bounds, FAMILIES[family].defaults, strict=False)
        ]
        name = cols[-1].text_input("Name (optional)", key="build_name")
        if st.button("Add this setting", icon=":material/add:"):
            try:
                spec = family_spec(family, values, framework, name.strip() or None)
                session.say("success", f"Added {compare_list.add_setting(spec)}.")
            except IscoreError as e:
                st.error(render.escape(str(e)))
            else:
                st.rerun()


with st.expander("Add a setting of your own", icon=":material/add:"):
    _add_your_own()

specs = compare_list.settings()
if not specs:
    st.info("Pick at least one setting to compare.")
    st.stop()
for spec in specs:
    try:
        session.compute(f"Replaying {compare_list.label(spec)}…", ws.setting, spec, steps)
    except IscoreError as e:
        state.settings.remove(spec)
        session.say("warning", f"Removed {compare_list.label(spec)}: {e}")
        st.rerun()
analysis = ws.analysis(specs, steps)
bugs = [f.code for f in flags_of(analysis.flags, "semantics_bug")]
if bugs:  # the colours grade the corrections, not the data
    st.warning(
        f"Mismatch finds a semantics bug ({', '.join(bugs)}): no setting here corrects it, "
        "however green its row. Fix it first (see Mismatch).",
        icon=":material/bug_report:",
    )
if flags_of(analysis.flags, "broken"):
    st.warning(
        f"Mismatch finds {analysis.mismatch.broken_sequences:,} broken sequences (a stale "
        "replica or a bad rank): 'broken kept' says how much of their gradient each setting "
        "lets through; only a sequence-level mask removes them.",
        icon=":material/heart_broken:",
    )
if flags_of(analysis.flags, "drift"):
    st.info(
        "The mismatch drifts over training (see Mismatch): these numbers pool every step, so "
        "a setting that is green here may act differently on the last steps than on the first.",
        icon=":material/trending_up:",
    )

# Headers that fit a narrow column (st.dataframe cuts, never wraps, them); the full one on hover.
_SHORT = {
    "mean w (token)": "w (tok)",
    "mean w (seq)": "w (seq)",
    "tokens masked": "tok masked",
    "sequences masked": "seq masked",
    "truncated high": "trunc high",
    "truncated low": "trunc low",
    "broken gradient kept": "broken kept",
}
st.subheader("Summary")
st.dataframe(
    render.summary_table(analysis),
    hide_index=True,
    width="stretch",
    column_config={
        "setting": st.column_config.Column(width="medium"),
        "loss aggregation": st.column_config.Column("aggregation", width="small"),
        **{
            header: st.column_config.Column(_SHORT.get(header, header), help=header, width="small")
            for _, header, _ in SUMMARY_COLUMNS
        },
    },
)
st.caption(
    "Setting names in their plot colours. Green: good for training; amber: fair; red: bad "
    "(LR scale, drop rates and ESS against the targets set on the Recommend page). LR scale: "
    "the corrected gradient's size relative to the uncorrected one under the framework's loss "
    "aggregation; where the framework divides by the tokens it keeps, a mask that drops most "
    "of them still reads about 1 (a step as large, on less data: read it with the masked "
    "share). Click a column header to sort."
)
kept = runs.overlaid()
if kept is not None:
    st.subheader("Each setting on each run")
    st.caption(
        "Each run whole (the step selection and the slice are the loaded dump's), coloured as "
        "above; Runs says where a difference is more than the runs' noise."
    )
    st.dataframe(
        render.runs_summary_table(runs.settings(kept, specs)),
        hide_index=True,
        width="stretch",
        column_config={
            "setting": st.column_config.Column(width="medium"),
            "run": st.column_config.Column(width="small"),
            "loss aggregation": st.column_config.Column("aggregation", width="small"),
            **{
                header: st.column_config.Column(
                    _SHORT.get(header, header), help=header, width="small"
                )
                for _, header, _ in SUMMARY_COLUMNS
            },
        },
    )
for figure in figures.setting_figures(analysis).values():
    render.plot(figure)
