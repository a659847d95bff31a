"""iscore's dashboard: `iscore app [DUMP]`, or `streamlit run app/serve.py [-- --path DUMP]`
(`app/serve.py` adds the Host check; `common.Options` lists the script's arguments).

The entry file builds the navigation and the sidebar; each page is a small module under
`pages/` that calls iscore and plots its small result tables.
"""

from __future__ import annotations

import common
import streamlit as st

st.set_page_config(page_title="iscore", page_icon=":material/balance:", layout="wide")
common.init_state(common.options().preload)
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
