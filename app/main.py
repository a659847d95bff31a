"""iscore's dashboard: `iscore app [DUMP]`, or `streamlit run app/main.py [-- --path DUMP]`.

The entry file builds the navigation and the sidebar; each page is a small module under
`pages/` that calls iscore and plots its small result tables.
"""

from __future__ import annotations

import argparse
import sys

import common
import streamlit as st


def _preload() -> str | None:
    """The dump named on the command line (`-- --path DUMP`), opened on the Data page."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--path")
    args, _ = parser.parse_known_args(sys.argv[1:])
    return args.path


st.set_page_config(page_title="iscore", page_icon=":material/balance:", layout="wide")
common.init_state(_preload())
page = st.navigation(
    [
        st.Page("pages/data.py", title="Data", icon=":material/database:", default=True),
        st.Page("pages/mismatch.py", title="Mismatch", icon=":material/compare_arrows:"),
        st.Page("pages/compare.py", title="Compare", icon=":material/stacked_line_chart:"),
        st.Page("pages/tune.py", title="Tune", icon=":material/tune:"),
        st.Page("pages/export.py", title="Export", icon=":material/download:"),
    ]
)
with st.sidebar:
    loaded = st.session_state.loaded
    if loaded is None:
        st.caption("No dump loaded.")
    else:
        steps = common.selected_steps()
        where = "all steps" if steps is None else f"steps {steps.lo}-{steps.hi}"
        st.caption(f"**Dump:** {common.escape(loaded.label)} ({where})")
    st.caption(f"**Settings in Compare:** {len(st.session_state.settings)}")
page.run()
