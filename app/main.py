"""iscore's dashboard: `iscore app [DUMP]`, or `streamlit run app/serve.py [-- --path DUMP]`
(`app/serve.py` adds the Host check; `iscore.session.launch.Options` lists the script's
arguments).

The entry file builds the navigation and the sidebar (the dump, the user's framework, the
number of settings compared); each page is a small module under `pages/` that calls iscore and plots
its small result tables. The favicon is a file of the app, so the page fetches nothing from
the network.
"""

from __future__ import annotations

import compare_list
import render
import session
import streamlit as st

st.set_page_config(
    page_title="iscore",
    page_icon=session.ROOT / "app" / "static" / "favicon.png",
    layout="wide",
)
session.init_state(session.options().preload, session.options().where)
ws = session.workspace(quiet=True)
# A run of more than one step opens on its trends, right after Data; so do several runs.
overlaid = len(st.session_state.runs) >= 2
trends = (
    [st.Page("pages/trends.py", title="Trends", icon=":material/timeline:")]
    if ws is not None and (len(ws.steps) > 1 or overlaid)
    else []
)
page = st.navigation(
    [
        st.Page("pages/data.py", title="Data", icon=":material/database:", default=True),
        *trends,
        st.Page("pages/recommend.py", title="Recommend", icon=":material/recommend:"),
        st.Page("pages/compare.py", title="Compare", icon=":material/stacked_line_chart:"),
        st.Page("pages/runs.py", title="Runs", icon=":material/difference:"),
        st.Page("pages/tune.py", title="Tune", icon=":material/tune:"),
        st.Page("pages/mismatch.py", title="Mismatch", icon=":material/compare_arrows:"),
        st.Page("pages/explore.py", title="Explore", icon=":material/query_stats:"),
        st.Page("pages/export.py", title="Export", icon=":material/download:"),
    ]
)
if ws is not None:  # before the sidebar counts the settings
    compare_list.seed_settings(ws, session.selected_steps())
with st.sidebar:
    title = compare_list.framework_title(compare_list.framework())
    st.caption(f"**Your framework:** {title} (change it on Recommend)")
    loaded = st.session_state.loaded
    if loaded is None:
        st.caption("No dump loaded.")
    else:
        chosen = session.selected_steps()
        steps = None if chosen is None else chosen.steps
        where = "all steps" if steps is None or steps.lo is None else f"steps {steps.lo}-{steps.hi}"
        st.caption(f"**Dump:** {render.escape(loaded.label)} ({where})")
        if session.followed() is not None:
            st.caption(f"**Following** its new step files (every {session.options().interval:g} s)")
        if chosen is not None and chosen.where is not None:
            st.caption(f"**Slice:** only sequences where `{chosen.where.replace('`', '')}`")
            st.button(
                "Clear the slice", icon=":material/filter_alt_off:", on_click=session.clear_slice
            )
    st.caption(f"**Settings in Compare:** {len(st.session_state.settings)}")
    if st.session_state.runs:
        st.caption("**Runs:** " + ", ".join(render.escape(r.name) for r in st.session_state.runs))
page.run()
