"""Data: load a dump (upload, server path or bundled sample), see what it holds, pick steps."""

from __future__ import annotations

from collections.abc import Callable

import common
import pandas as pd
import streamlit as st

from iscore import figures
from iscore.errors import IscoreError

st.title("Data")
st.caption(
    "iscore replays logged rollout-vs-trainer log-probs through every RL framework's "
    "importance-sampling correction. Load a dump in canonical Parquet (token or sequence "
    "layout; the frameworks' column names are understood)."
)
drop = st.toggle(
    "Drop sequences with invalid log-probs (NaN, infinite or positive) instead of failing",
    **common.persist("drop_invalid", False),
)
errors = st.session_state.setdefault("load_errors", {})


def _open(tab: str, load: Callable[[], object]) -> None:
    """Run a load; keep its error (shown in the tab until the next attempt there). A new dump
    reruns the app, so that the sidebar, drawn before this page, shows it."""
    errors.pop(tab, None)
    before = st.session_state.loaded
    try:
        load()
    except IscoreError as e:
        errors[tab] = e
    if st.session_state.loaded != before:
        st.rerun()


upload_tab, path_tab, sample_tab = st.tabs(["Upload", "Server path", "Sample data"])
with upload_tab:
    uploads = st.file_uploader(
        "Parquet files of one dump",
        type=["parquet", "pq", "parq"],
        accept_multiple_files=True,
        help="Kept in this session's memory only, never written to disk. For dumps larger "
        "than the upload limit, open a server path instead.",
    )
    seen = (drop, *(common.upload_digest(u) for u in uploads))
    if uploads and seen != st.session_state.get("uploads_seen"):
        st.session_state.uploads_seen = seen
        _open("upload", lambda: common.load_uploads(uploads, drop))
    if uploads and "upload" in errors:
        common.show_error(errors["upload"])
with path_tab:
    folders = common.options().roots.folders
    st.caption(
        "Inside the folders this server may read: "
        + ", ".join(f"`{common.escape(str(f))}`" for f in folders)
    )
    st.session_state.setdefault("_w_path", st.session_state.path)  # after a page switch
    with st.form("open_path", border=False):
        text = st.text_input(
            "File, directory or glob on the server",
            key="_w_path",
            placeholder="runs/rollouts/step_*.parquet",
        )
        submitted = st.form_submit_button("Open", icon=":material/folder_open:")
    if submitted or st.session_state.path_pending:
        st.session_state.path, st.session_state.path_pending = text, False
        _open("path", lambda: common.load_path(text.strip(), drop))
    if "path" in errors:
        common.show_error(errors["path"])
with sample_tab:
    st.caption(
        "Simulated dumps whose mismatch is known exactly (see data/README.md): a healthy bf16 "
        "baseline, FP8, MoE routing flips, an offset bug, drift, long responses."
    )
    sample = st.selectbox(
        "Sample",
        common.SAMPLES,
        format_func=lambda p: p.stem,
        **common.persist("sample", common.SAMPLES[0] if common.SAMPLES else None),
    )
    if st.button("Open sample", icon=":material/science:", disabled=sample is None):
        _open("sample", lambda: common.load_path(str(sample), drop))
    if "sample" in errors:
        common.show_error(errors["sample"])

ws = common.workspace()
if ws is None:
    st.info("No dump loaded yet.")
    st.stop()

st.subheader(common.escape(ws.source.name))
if st.session_state.loaded.label != ws.source.name:
    st.caption(common.escape(st.session_state.loaded.label))
if len(ws.steps) > 1:
    st.select_slider(
        "Training steps to analyze (every page uses this selection)",
        options=ws.steps,
        **common.persist("step_range", (ws.steps[0], ws.steps[-1]), as_value=True),
    )
summary = common.compute("Summarizing…", ws.summary, common.selected_steps())
steps = summary["steps"]
cols = st.columns(4)
cols[0].metric("Training steps", len(steps), help=f"steps {steps[0]}…{steps[-1]}", border=True)
cols[1].metric("Sequences", f"{summary['sequences']:,}", border=True)
cols[2].metric("Tokens", f"{summary['tokens']:,}", border=True)
cols[3].metric("Loss tokens", f"{summary['loss_tokens']:,}", border=True)
length = summary["length"]
st.caption("Sequence length (tokens): " + " · ".join(f"{k} {v:,}" for k, v in length.items()))
left, right = st.columns([3, 2])
with left:
    common.plot(figures.length_figure(summary))
with right:
    source = ws.source
    st.markdown(f"**Layout:** {source.layout} · **files:** {len(source.files)}")
    st.dataframe(
        pd.DataFrame(source.columns, columns=["canonical column", "read from"]),
        hide_index=True,
        width="stretch",
    )
    for line in source.provenance:
        st.info(common.escape(line))
    if source.dropped_sequences:
        st.warning(f"{source.dropped_sequences:,} sequences dropped as invalid.")
    with st.expander("Files"):
        st.text("\n".join(source.files))
