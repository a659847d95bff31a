"""Data: load a dump (upload, server path or bundled sample), map its columns, see what it
holds, pick steps."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import render
import session
import streamlit as st

from iscore.dump import Preview
from iscore.errors import IscoreError
from iscore.present import figures

st.title("Data")
st.caption(
    "iscore replays logged rollout-vs-trainer log-probs through every RL framework's "
    "importance-sampling correction. Load a dump in canonical Parquet (token or sequence "
    "layout; the frameworks' column names are understood, and any column can be mapped), or "
    "a framework's own dump: NeMo-RL or prime-rl JSON Lines, slime `.pt`, SkyRL `.pkl`."
)
state = st.session_state
drop = st.toggle(
    "Drop sequences with invalid log-probs (NaN, infinite or positive) instead of failing",
    **session.persist("drop_invalid", False),
)
pickles = st.toggle(
    "Allow pickled files (runs code from the file: only for files you trust)",
    help="slime's .pt and SkyRL's .pkl dumps are pickles. iscore reads them with restricted "
    "loaders that rebuild only tensors and plain containers, but a pickle is code: open only "
    "files you or your team wrote.",
    **session.persist("allow_pickle", False),
)
errors = state.setdefault("load_errors", {})
state.setdefault("mapping", ())  # the mapping chosen for the dump last tried (`attempt`)

COLUMNS = {
    "rollout_logprob": "Rollout log-prob",
    "train_logprob": "Train log-prob",
    "policy_logprob": "Policy log-prob (optional)",
    "loss_mask": "Loss mask (optional)",
    "seq_id": "Sequence id",
    "step": "Step",
}
# Offered when the file has them (found by name, or mapped before).
EXTRA = {"reward": "Reward", "advantage": "Advantage", "group_id": "Group id"}
NONE = "(none)"


def _open(attempt: tuple[str, str, str]) -> None:
    """Load `attempt` (tab, "upload" or "path", the source) with the session's options and
    column mapping; keep its error (shown in the tab until the next attempt there). A new
    source starts from iscore's own column detection. A new dump reruns the app, so that the
    sidebar, drawn before this page, shows it."""
    tab, kind, source = attempt
    if state.get("attempt") != attempt:
        state.attempt, state.mapping = attempt, ()
    if kind == "upload":
        state.uploads_seen = (drop, pickles, state.mapping)
    errors.pop(tab, None)
    before = state.loaded
    try:
        if kind == "upload":
            session.load_uploads(uploads, drop, state.mapping, pickles)
        else:
            session.load_path(source, drop, state.mapping, pickles)
    except IscoreError as e:
        errors[tab] = e
    if state.loaded != before:
        st.rerun()


upload_tab, path_tab, sample_tab = st.tabs(["Upload", "Server path", "Sample data"])
with upload_tab:
    uploads = st.file_uploader(
        "Files of one dump: Parquet, or a framework's own dump",
        type=["parquet", "pq", "parq", "jsonl", "pt", "pkl"],
        accept_multiple_files=True,
        help="Kept in this session's memory only, never written to disk; at most "
        f"{session.options().max_upload_tokens:,} tokens. The CLI streams larger dumps "
        "(`iscore analyze`).",
    )
    digests = tuple(session.upload_digest(u) for u in uploads)
    in_view = state.get("attempt", ("",))[0] == "upload"  # the uploads are the dump tried last
    if not uploads:
        state.pop("upload_digests", None)  # the same files uploaded again are new again
    elif digests != state.get("upload_digests"):
        state.upload_digests = digests
        _open(("upload", "upload", "+".join(digests)))
    elif in_view and (drop, pickles, state.mapping) != state.get("uploads_seen"):
        _open(state.attempt)
    if uploads and "upload" in errors:
        render.show_error(errors["upload"])
with path_tab:
    app = session.options()
    st.caption(
        "Inside the folders this server may read: "
        + ", ".join(f"`{render.escape(str(f))}`" for f in app.roots.folders)
        + f"; at most {app.max_path_tokens:,} tokens a dump"
        + (" (the one the app was started with may hold more)" if app.preload else "")
    )
    state.setdefault("_w_path", state.path)  # after a page switch
    with st.form("open_path", border=False):
        text = st.text_input(
            "File, directory or glob on the server",
            key="_w_path",
            placeholder="runs/rollouts/step_*.parquet",
        )
        submitted = st.form_submit_button("Open", icon=":material/folder_open:")
    # The run `iscore app DIR --follow` names opens once its first step file is whole.
    if submitted or (state.path_pending and not session.waiting()):
        state.path, state.path_pending = text, False
        _open(("path", "path", text.strip()))
    if "path" in errors:
        render.show_error(errors["path"])
with sample_tab:
    st.caption(
        "Simulated dumps whose mismatch is known exactly (see data/README.md): a healthy bf16 "
        "baseline, FP8, MoE routing flips, an offset bug, drift, long responses, and an "
        "off-policy run with the current policy's log-probs (for bypass settings)."
    )
    preload = session.options().preload
    named = [s for s in session.SAMPLES if preload and s == Path(preload).resolve()]
    sample = st.selectbox(
        "Sample",
        session.SAMPLES,
        format_func=lambda p: p.stem,
        **session.persist("sample", next(iter(named + session.SAMPLES), None)),
    )
    if st.button("Open sample", icon=":material/science:", disabled=sample is None):
        _open(("sample", "path", str(sample)))
    if "sample" in errors:
        render.show_error(errors["sample"])


def _add_run() -> None:
    try:
        name = session.add_run(state.get("_w_run_name", ""))
    except IscoreError as e:
        session.say("warning", str(e))
    else:
        state._w_run_name = ""
        session.say("success", f"Kept as the run {name}.")


def _rename_run(index: int, key: str) -> None:
    session.rename_run(index, state[key])


def _runs() -> None:
    """The session's runs: the loaded dump added under a name, each run renamed or removed."""
    kept = session.runs()
    with st.expander(
        f"Runs ({len(kept)})", expanded=state.loaded is not None, icon=":material/stacks:"
    ):
        st.caption(
            "Keep dumps as named runs to compare them: open one (upload, server path or "
            "sample), add it, open the next, add it too. With two runs or more, Mismatch and "
            "Trends overlay them (a colour each), Compare shows each setting on each run, and "
            f"Runs compares any two (the first is the baseline). At most {session.MAX_RUNS}; "
            "uploads share this session's token budget."
        )
        cols = st.columns([3, 1], vertical_alignment="bottom")
        cols[0].text_input(
            "Name of the loaded dump as a run",
            key="_w_run_name",
            placeholder="its file's name",
            disabled=state.loaded is None,
        )
        cols[1].button(
            "Add as a run",
            icon=":material/add:",
            on_click=_add_run,
            disabled=state.loaded is None,
        )
        for i, run in enumerate(kept):
            cols = st.columns([3, 1], vertical_alignment="bottom")
            # Keyed by the name too: a run renamed or moved up starts from its own name.
            key = f"_w_run_{i}_{run.name}"
            cols[0].text_input(
                f"Run {i + 1}" + (" (the baseline)" if i == 0 else ""),
                value=run.name,
                key=key,
                on_change=_rename_run,
                args=(i, key),
                help=f"Opened from {render.escape(run.loaded.label)}",
            )
            cols[1].button(
                "Remove",
                key=f"remove_run_{i}_{run.name}",
                icon=":material/delete:",
                on_click=session.remove_run,
                args=(i,),
            )


def _choices(preview: Preview, chosen: dict[str, str | None]) -> list[str]:
    """The canonical columns to offer: the main ones, and the extras the file has."""
    extra = [c for c in EXTRA if c in preview.found or c in chosen]
    return [*COLUMNS, *extra]


def _mapping_form(preview: Preview, attempt: tuple[str, str, str]) -> None:
    """The file's first rows and a column picker per canonical column; reloads the dump the
    mapping is for with the columns picked (those that differ from iscore's detection)."""
    chosen = dict(state.mapping)
    st.caption(f"First rows of {render.escape(preview.name)}:")
    frame = pd.DataFrame(list(preview.rows), columns=list(preview.names))
    st.dataframe(frame, hide_index=True, width="stretch")
    if attempt[1] == "upload" and not uploads:
        st.info(
            "The upload box empties when you leave this page: upload the files again to "
            "read them with another mapping."
        )
        return
    for canonical, candidates in preview.ambiguous.items():
        if canonical not in chosen:
            names = ", ".join(f"`{render.escape(c)}`" for c in candidates)
            st.warning(f"{names} could each be {canonical}: pick one.")
    # Keys of their own per file and mapping: a browser would keep a picker's old choice for
    # as long as its key lives, the previous file's column included.
    form = abs(hash((attempt, state.mapping, preview.names)))
    with st.form("column_mapping", border=False):
        picks: dict[str, str | None] = {}
        wanted = _choices(preview, chosen)
        cells = st.columns(3)
        for i, canonical in enumerate(wanted):
            current = chosen.get(canonical, preview.found.get(canonical))
            options = [NONE, *preview.names]
            with cells[i % 3]:
                pick = st.selectbox(
                    (COLUMNS | EXTRA)[canonical],
                    options,
                    index=options.index(current) if current in options else 0,
                    key=f"_w_column_{canonical}_{form}",
                    help=f"The file's column read as `{canonical}`.",
                )
            picks[canonical] = None if pick == NONE else pick
        reload = st.form_submit_button("Reload with this mapping", icon=":material/refresh:")
    if reload:
        state.mapping = tuple(sorted((c, s) for c, s in picks.items() if s != preview.found.get(c)))
        _open(attempt)
        if attempt[0] in errors:  # shown here too: the tab's own message is out of sight
            render.show_error(errors[attempt[0]])


session.notice()
_runs()
ws = session.workspace()
attempt = state.get("attempt")
failed = attempt is not None and attempt[0] in errors
if failed:
    preview = session.preview_attempt(attempt[1], attempt[2], uploads or [])
elif ws is not None:
    preview = ws.source.preview
else:
    preview = None
if preview is not None and attempt is not None:
    with st.expander("Columns", expanded=failed, icon=":material/view_column:"):
        _mapping_form(preview, attempt)

if ws is None:
    if session.waiting():
        st.info(
            f"Waiting for the first whole step file in {render.escape(app.preload)}: the run "
            "opens as soon as one lands.",
            icon=":material/hourglass_top:",
        )
        session.rerun_on_new_files(app.preload)
    else:
        st.info("No dump loaded yet.")
    st.stop()

st.subheader(render.escape(ws.source.name))
if state.loaded.label != ws.source.name:
    st.caption(render.escape(state.loaded.label))
if len(ws.steps) > 1:
    # None is every step, those of a followed run that land later included.
    every = (ws.steps[0], ws.steps[-1])
    chosen = state.get("step_range")
    if chosen is not None and not set(chosen) <= set(ws.steps):
        chosen = state.step_range = None
    slider = f"_w_step_range_{state.get('loads', 0)}_{ws.steps[0]}_{ws.steps[-1]}"
    st.select_slider(
        "Training steps to analyze (every page uses this selection)",
        options=ws.steps,
        value=chosen or every,
        key=slider,
        on_change=lambda: state.update(
            step_range=None if tuple(state[slider]) == every else state[slider]
        ),
    )
analysis = session.compute(
    "Computing the mismatch diagnostics…", ws.mismatch, session.selected_steps()
)
render.show_health(analysis)
st.page_link(
    "pages/mismatch.py",
    label="Where it comes from, and the published measurements: Mismatch",
    icon=":material/query_stats:",
)
summary = session.compute("Summarizing…", ws.summary, session.selected_steps())
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
    render.plot(figures.length_figure(summary))
with right:
    source = ws.source
    st.markdown(f"**Layout:** {source.layout} · **files:** {len(source.files)}")
    st.dataframe(
        pd.DataFrame(source.columns, columns=["canonical column", "read from"]),
        hide_index=True,
        width="stretch",
    )
    if source.unused:
        names = ", ".join(f"`{render.escape(n)}`" for n in source.unused)
        st.warning(
            f"These columns were not used: {names}. They look like log-probs: if one is the "
            "column to read, pick it under Columns above and reload.",
            icon=":material/warning:",
        )
    for line in source.provenance:
        st.info(render.escape(line))
    if source.dropped.sequences:
        st.warning(
            f"{source.dropped.sequences:,} sequences ({source.dropped.tokens:,} tokens) dropped "
            "as invalid."
        )
    with st.expander("Files"):
        st.text("\n".join(source.files))
folder = session.followed()
if folder is not None:
    session.rerun_on_new_files(folder)
