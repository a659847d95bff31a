"""Export: a setting of the Compare list as a config for any framework, and the analysis as an
HTML report or JSON."""

from __future__ import annotations

import json

import compare_list
import exports
import render
import session
import streamlit as st

from iscore.errors import IscoreError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.present import render_html

ws = compare_list.require_workspace()
steps = session.selected_steps()
specs = compare_list.settings()
st.title("Export")

st.subheader("A setting as a framework config")
if not specs:
    st.info("The Compare list is empty: add a setting there (or on the Tune page) first.")
    st.page_link("pages/compare.py", label="Go to Compare", icon=":material/arrow_forward:")
else:
    labels = [compare_list.label(s) for s in specs]
    if st.session_state.get("export_setting") not in labels:
        st.session_state.export_setting = labels[0]
    cols = st.columns(2)
    choice = cols[0].selectbox(
        "Setting (from the Compare list)", labels, **session.persist("export_setting", labels[0])
    )
    spec = specs[labels.index(choice)]
    to = cols[1].selectbox(
        "As a config of",
        FRAMEWORKS,
        index=FRAMEWORKS.index(spec.framework),
        key=f"export_to_{choice}",
    )
    try:
        out = session.compute(f"Writing it for {to}…", exports.export, ws, spec, to, steps)
    except IscoreError as e:
        render.show_error(e)
    else:
        if not out.exact:
            st.warning(
                "**Not an exact translation.** "
                + render.escape(" ".join(out.notes) or "The settings replay differently.")
            )
        elif to != spec.framework:
            # What is exact is the weights and masks; a note is about what surrounds them
            # (the loss aggregation, the numerical path), so it reads as a "but", not a clash.
            st.success(
                "An exact translation: the weights and masks replay identically"
                + (" (see the note below)." if out.notes else ".")
            )
        if out.exact and out.notes:
            st.info("**Note.** " + render.escape(" ".join(out.notes)), icon=":material/info:")
        if out.difference is not None:
            st.dataframe(out.difference, width="content")
        st.code(out.snippet, language=render.LANGUAGE[out.syntax])
        cols = st.columns(2)
        cols[0].download_button(
            "Download the snippet",
            out.commented,
            file_name=f"{spec.name}.{to}.{render.EXTENSION[out.syntax]}",
            mime="text/plain",
            icon=":material/download:",
            on_click="ignore",
            help="With what the snippet alone does not say (exact or not, the notes) as "
            "comments above it",
        )
        if out.config != out.snippet:
            cols[1].download_button(
                "Download the iscore config",
                out.config,
                file_name=f"{spec.name}.{to}.iscore.yaml",
                mime="text/yaml",
                icon=":material/download:",
                on_click="ignore",
                help="For `iscore replay --config FILE` and the Compare page",
            )

st.subheader("The analysis")
st.caption(
    "The mismatch diagnostics and every setting of the Compare list on the selected steps: a "
    "self-contained HTML report (opens with no network) or the versioned JSON document."
)
cols = st.columns(2)
# Computed when a button is clicked, not when the page opens: outside the script run, where
# session state cannot be read, so what the callables need is taken now.
targets = st.session_state.targets
cols[0].download_button(
    "HTML report",
    lambda: render_html(ws.analysis(specs, steps), targets),
    file_name="iscore-report.html",
    mime="text/html",
    icon=":material/description:",
    on_click="ignore",
)
cols[1].download_button(
    "Analysis JSON",
    lambda: json.dumps(ws.analysis(specs, steps).to_dict(), indent=1, allow_nan=False),
    file_name="iscore-analysis.json",
    mime="application/json",
    icon=":material/data_object:",
    on_click="ignore",
)
