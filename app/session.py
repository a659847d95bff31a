"""The browser session's state: what it loaded (uploads, server paths, a followed run) and
holds in the process's caches, the widgets' values kept across pages, and its messages.

Caching: a loaded dump is an `iscore.session.workspace.Workspace` (the batch, and the analyses,
settings and tuner computed from it on demand, memoized inside), held in the process's
`iscore.session.budget.WorkspaceCache` within its memory budget. Uploads are keyed by the session
and the content digest, so each browser session has its own (the loaded one and those kept as
runs, within one token budget together); dumps opened from a server-side path (only inside the
data folders, see
`iscore.session.serving.DataRoots`) or a bundled sample are shared, keyed by their files' (path,
size, mtime). A session's holds are released when Streamlit drops the session.

Runs: the session may keep up to `MAX_RUNS` dumps it opened, each under a name (`Run`), to
compare them (`add_run`, `run_workspaces`); each is got back from the caches as the loaded dump
is, through the same checks.

State that outlives a page switch lives in `st.session_state` under plain keys; widgets get
a mirror key (`persist`), since Streamlit drops the state of widgets that are not rendered.
"""

from __future__ import annotations

import sys
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import streamlit as st
from render import escape, show_error

from iscore import frameworks
from iscore.advice import (
    Targets,
    Trend,
)
from iscore.dump import PICKLED, SUFFIXES, Preview, StepRange, preview_parquet
from iscore.errors import DumpError, DumpProblems, IscoreError
from iscore.frameworks import Spec
from iscore.passes import Follower, ResultStore, ready_files
from iscore.session import (
    Options,
    Selection,
    Workspace,
    WorkspaceCache,
    digest,
    fingerprint,
    open_path,
    open_uploads,
    parse_options,
    worst_sequences_sql,
)
from iscore.utils import default_folder

T = TypeVar("T")

ROOT = Path(__file__).resolve().parents[1]
"""The folder holding `app/` and `data/`: the checkout, or the installed package, where a wheel
puts them in the same layout (pyproject.toml)."""
SAMPLES = sorted((ROOT / "data").glob("*.parquet"))
"""The bundled sample dumps."""


# ------------------------------------------------------------------------------------------
# Session state


Columns = tuple[tuple[str, str | None], ...]
"""An explicit column mapping, canonical -> source (None: left out), sorted: a cache key."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """How to get the session's dump back from the caches.

    Attributes:
        kind: "upload" (held in this session's memory) or "path" (a file on the server).
        key: the uploads' content digest, or the path / glob as typed.
        label: for people.
        drop_invalid: whether sequences with invalid log-probs were dropped.
        columns: the column mapping the user chose (empty: iscore's own detection).
        allow_pickle: whether the dump has pickled files, which the user allowed.
    """

    kind: str
    key: str
    label: str
    drop_invalid: bool = False
    columns: Columns = ()
    allow_pickle: bool = False


@dataclass(frozen=True, slots=True)
class Run:
    """A dump the session keeps under a name, to compare it with others.

    Attributes:
        name: for people (unique among the session's runs).
        loaded: how to get it back from the caches.
    """

    name: str
    loaded: Loaded


MAX_RUNS = 6
"""Runs one session may keep: each holds its dump in memory (an upload's within the session's
token budget, shared by all its uploads), so their number is bounded too."""


def init_state(preload: str | None, where: str | None = None) -> None:
    """Defaults of the session's state; `preload` is the dump `iscore app PATH` named, `where`
    the slice `iscore app --where` applies from the start."""
    state = st.session_state
    if "path" not in state:
        state.path = preload or ""
        state.path_pending = bool(preload)
        state.slice = where
    for key, value in (
        ("loaded", None),
        ("runs", []),
        ("settings", []),
        ("custom", {}),
        ("notice", None),
        ("framework", frameworks.NAMES[0]),
        ("targets", Targets()),
    ):
        state.setdefault(key, value)


_UNSET = object()


def persist(
    key: str, default: Any, *, as_value: bool = False, on_change: bool = True
) -> dict[str, Any]:
    """Widget arguments that keep the widget's value in `st.session_state[key]` across page
    switches: `st.slider(..., **persist("cap", 2.0))`.

    With `as_value`, the value is passed as the widget's `value=` instead of written to its
    state: a range `select_slider` is a range only when given a tuple `value`. Without
    `on_change`, the widget's own callback must call `store(key)`.
    """
    st.session_state.setdefault(key, default)
    widget = f"_w_{key}"
    callback = {"on_change": store, "args": (key,)} if on_change else {}
    if as_value:
        return {"key": widget, "value": st.session_state[key], **callback}
    # Only when they differ (the widget's state is gone after a page switch, or `key` was set
    # by the page): a value written to a widget's state is sent back to the browser, which
    # then drops the moves made while this run was under way.
    if st.session_state.get(widget, _UNSET) != st.session_state[key]:
        st.session_state[widget] = st.session_state[key]
    return {"key": widget, **callback}


def store(key: str) -> None:
    """Keep a `persist` widget's value under `key`."""
    st.session_state[key] = st.session_state[f"_w_{key}"]


def selected_steps() -> Selection | None:
    """The sequences the user selected (None: all): the training steps picked on the Data
    page, and the slice applied on Explore. A slice that does not apply to the loaded dump,
    or keeps none of those steps' sequences, is cleared, saying why."""
    chosen = st.session_state.get("step_range")
    steps = StepRange() if chosen is None else StepRange(*chosen)
    where = st.session_state.get("slice")
    ws = workspace(quiet=True) if where is not None else None
    if ws is not None:
        try:
            ws.batch(Selection(steps, where))
        except IscoreError as e:
            clear_slice()
            say("warning", f"The slice `{where}` was cleared: {e}")
            where = None
    if chosen is None and where is None:
        return None
    return Selection(steps, where)


def apply_slice(ws: Workspace, where: str) -> None:
    """Make `where` the slice of every page (checked against `ws` first).

    Raises:
        IscoreError: not a predicate over the sequence columns, or it keeps no sequence.
    """
    ws.batch(Selection(ws.selection(selected_steps()).steps, where))
    st.session_state.slice = where


def clear_slice() -> None:
    """Every page looks at all sequences of the selected steps again."""
    st.session_state.slice = None


def say(kind: str, message: str) -> None:
    """Leave a message for the page's next run (callbacks run before the page draws)."""
    st.session_state.notice = (kind, message)


def notice() -> None:
    """Show, once, the message `say` left: kind "success", "warning" or "error"."""
    note = st.session_state.get("notice")
    if note:
        st.session_state.notice = None
        kind, message = note
        getattr(st, kind)(escape(message))


# ------------------------------------------------------------------------------------------
# Workspaces


def options() -> Options:
    """The app's `Options`, from the script's arguments (read on each run: it is cheap)."""
    return parse_options(sys.argv[1:], ROOT / "data")


@st.cache_resource(show_spinner=False)
def _cache(limit_mb: int) -> WorkspaceCache:
    """The process's loaded dumps, within the memory budget."""
    return WorkspaceCache(limit_mb << 20)


@dataclass(frozen=True, slots=True)
class _Session:
    """A browser session's hold on the cache, released when Streamlit drops the session."""

    id: str
    cache: WorkspaceCache


def _end_session(session: _Session) -> None:
    session.cache.release(session.id)


@st.cache_resource(scope="session", show_spinner=False, on_release=_end_session)
def _session(limit_mb: int) -> _Session:
    return _Session(uuid.uuid4().hex, _cache(limit_mb))


def _this_session() -> _Session:
    return _session(options().cache_mb)


def _gone() -> Workspace:
    raise IscoreError("the uploaded dump is no longer in this session's memory; upload it again")


def _upload_key(session: _Session, loaded: Loaded) -> tuple:
    return ("upload", session.id, loaded.key, loaded.drop_invalid, loaded.columns)


def _pickled(names: Sequence[str], allow_pickle: bool) -> bool:
    """Whether `names` include pickled files; without `allow_pickle`, an error saying how to
    allow them (checked before any cache, so a session never gets a pickle's data from a
    session that allowed it without allowing it too).

    Raises:
        IscoreError: a pickled file, not allowed.
    """
    pickled = [name for name in names if name.endswith(PICKLED)]
    if pickled and not allow_pickle:
        raise IscoreError(
            f"{pickled[0]} is a pickled file (.pt/.pkl): loading one can run code from it. To "
            'read it, turn on "Allow pickled files" above, only for files you trust'
        )
    return bool(pickled)


def _path_workspace(loaded: Loaded, progress: Callable[[float], None] | None = None) -> Workspace:
    """A server-side dump's workspace, shared by the sessions that open it, keyed by its
    files' (path, size, mtime) and the column mapping: a rewritten file is read again. Any
    dump but the one the operator named holds at most `--max-path-tokens` tokens.

    The run `iscore app DIR --follow` follows is its whole step files so far (`run_files`).

    Raises:
        IscoreError: `loaded.key` is missing or outside the data folders (one message for
            both), holds pickled files `loaded` does not allow, is over the token budget, or is
            not a valid dump; a followed run without a whole step file yet.
    """
    app = options()
    if app.follow and loaded.key == app.preload:
        files = run_files(app.preload)
        if not files:
            raise IscoreError(f"{app.preload}: no whole step file yet")
    else:
        files = app.roots.files(loaded.key, fingerprint)
    session = _this_session()
    paths = [path for path, _, _ in files]
    _pickled(paths, loaded.allow_pickle)
    return session.cache.get(
        ("path", files, loaded.drop_invalid, loaded.columns),
        session.id,
        lambda: open_path(
            paths,
            columns=dict(loaded.columns),
            drop_invalid=loaded.drop_invalid,
            allow_pickle=loaded.allow_pickle,
            max_tokens=None if loaded.key == app.preload else app.max_path_tokens,
            progress=progress,
        ),
    )


@contextmanager
def _progress(text: str) -> Iterator[Callable[[float], None]]:
    """A progress bar saying `text`, moved by the share done it is called with; gone after."""
    bar = st.progress(0.0, text=text)
    try:
        yield lambda done: bar.progress(done, text=text)
    finally:
        bar.empty()


def upload_digest(upload: Any) -> str:
    """sha256 of an upload, computed once per uploaded file."""
    known = st.session_state.setdefault("_digests", {})
    if upload.file_id not in known:
        known[upload.file_id] = digest([(upload.name, upload.getvalue())])
    return known[upload.file_id]


def load_uploads(
    uploads: Sequence[Any], drop_invalid: bool, columns: Columns = (), allow_pickle: bool = False
) -> Workspace:
    """Open uploaded files (Streamlit `UploadedFile`s) as the session's dump, from memory:
    Parquet, or a framework's own dump (pickled ones only with `allow_pickle`).

    Raises:
        IscoreError: more tokens than the session's budget, a pickled file not allowed, or the
            files are not a valid dump (`DumpProblems` lists every problem).
    """
    key = "+".join(upload_digest(u) for u in uploads)
    pickled = _pickled([u.name for u in uploads], allow_pickle)
    label = ", ".join(u.name for u in uploads)
    loaded = Loaded("upload", key, label, drop_invalid, columns, pickled)
    files = tuple((u.name, u.getvalue()) for u in uploads)
    session = _this_session()
    this = _upload_key(session, loaded)
    # The session's uploads share its token budget: the loaded one and those kept as runs.
    kept = {k: n for k, n in _run_uploads(session).items() if k != this}
    budget, held = options().max_upload_tokens, sum(kept.values())
    with _progress(f"Reading {len(files)} uploaded file{'s' * (len(files) > 1)}…") as read:
        try:
            workspace = session.cache.get(
                this,
                session.id,
                lambda: open_uploads(
                    files,
                    columns=dict(columns),
                    drop_invalid=drop_invalid,
                    allow_pickle=pickled,
                    max_tokens=budget - held,
                    progress=read,
                ),
            )
        except DumpError as e:
            if not held or isinstance(e, DumpProblems):  # a problem of the files themselves
                raise
            raise DumpError(
                f"{e} (this session's runs hold {held:,} uploaded tokens of its {budget:,}: "
                "remove a run on the Data page to make room)"
            ) from e
    session.cache.discard(session.id, keep=lambda k: k[0] != "upload" or k == this or k in kept)
    _set_loaded(loaded)
    return workspace


def _run_uploads(session: _Session) -> dict[tuple, int]:
    """The cache keys of the session's runs that are uploads still held, with their tokens."""
    found = {}
    for run in st.session_state.get("runs", []):
        if run.loaded.kind == "upload":
            key = _upload_key(session, run.loaded)
            try:
                found[key] = session.cache.get(key, session.id, _gone).full.num_tokens
            except IscoreError:
                continue  # evicted: it holds nothing
    return found


def load_path(
    source: str, drop_invalid: bool, columns: Columns = (), allow_pickle: bool = False
) -> Workspace:
    """Open a dump on the server (file, directory or glob; Parquet or a framework's own dump,
    pickled ones only with `allow_pickle`) as the session's dump.

    Raises:
        IscoreError: nothing matches in the data folders, a pickled file not allowed, or the
            files are not a valid dump.
    """
    loaded = Loaded("path", source, source, drop_invalid, columns, allow_pickle)
    with _progress(f"Reading {source}…") as read:
        workspace = _path_workspace(loaded, read)
    _set_loaded(loaded)
    return workspace


def preview_attempt(kind: str, source: str, uploads: Sequence[Any]) -> Preview | None:
    """The first Parquet file of a dump that failed to load, for mapping its columns: of the
    uploads (kind "upload") or of a server path (None for a framework's own dump, whose
    importer's error says what is wrong, or a file that is no Parquet at all).
    """
    try:
        if kind == "upload":
            first = next((u for u in uploads if not u.name.endswith(SUFFIXES)), None)
            return None if first is None else preview_parquet(first.name, first.getvalue())
        files = [path for path, _, _ in options().roots.files(source, fingerprint)]
        first = next((f for f in files if not f.endswith(SUFFIXES)), None)
        return None if first is None else preview_parquet(first, first)
    except IscoreError:
        return None


def _set_loaded(loaded: Loaded) -> None:
    if st.session_state.loaded != loaded:
        if st.session_state.loaded is not None:  # `iscore app --where` slices the first dump
            clear_slice()
        st.session_state.loaded = loaded
        # Selections of the previous dump mean nothing for this one. The step slider's key
        # counts the loads: a browser keeps a widget's value as long as its key, and would
        # send the old dump's range back.
        st.session_state.loads = st.session_state.get("loads", 0) + 1
        for key in ("step_range", "_seeded"):
            st.session_state.pop(key, None)


def workspace(*, quiet: bool = False) -> Workspace | None:
    """The session's dump, or None before one is loaded (errors are shown in the page unless
    `quiet`)."""
    loaded: Loaded | None = st.session_state.get("loaded")
    if loaded is None:
        return None
    try:
        return _held(loaded)
    except IscoreError as e:
        if not quiet:
            show_error(e)
        return None


def _held(loaded: Loaded) -> Workspace:
    """The workspace of `loaded`, from the caches (a server path checked again: inside the
    data folders, within the token budget).

    Raises:
        IscoreError: as `_path_workspace` raises it, or an upload that is no longer held.
    """
    if loaded.kind == "upload":
        session = _this_session()
        return session.cache.get(_upload_key(session, loaded), session.id, _gone)
    return _path_workspace(loaded)


# ------------------------------------------------------------------------------------------
# Runs: dumps kept under a name, to compare


def runs() -> list[Run]:
    """The session's runs, in the order added: run i is drawn in `iscore.present.color(i)`,
    and the first is the baseline of the Runs page."""
    return list(st.session_state.get("runs", []))


def add_run(name: str) -> str:
    """Keep the loaded dump as a run named `name` (its file's name when empty; a number
    added when another run has the name); returns the name.

    Raises:
        IscoreError: no dump is loaded, it is a run already, or the session keeps
            `MAX_RUNS` runs.
    """
    loaded = st.session_state.get("loaded")
    kept = runs()
    if loaded is None:
        raise IscoreError("load a dump first, then add it as a run")
    same = next((r for r in kept if r.loaded == loaded), None)
    if same is not None:
        raise IscoreError(f"this dump is the run {same.name} already")
    if len(kept) >= MAX_RUNS:
        raise IscoreError(f"a session keeps at most {MAX_RUNS} runs: remove one first")
    name = _free_name(name.strip() or _held(loaded).source.name, kept)
    st.session_state.runs = [*kept, Run(name, loaded)]
    return name


def _free_name(name: str, kept: Sequence[Run]) -> str:
    """`name`, or `name (2)`, `name (3)`... where a run in `kept` has it."""
    taken = {r.name for r in kept}
    found, n = name, 1
    while found in taken:
        n += 1
        found = f"{name} ({n})"
    return found


def rename_run(index: int, name: str) -> str:
    """Give run `index` the name `name` (a number added when another run has it; unchanged
    when empty); returns its name."""
    kept = runs()
    others = kept[:index] + kept[index + 1 :]
    if name.strip():
        kept[index] = Run(_free_name(name.strip(), others), kept[index].loaded)
        st.session_state.runs = kept
    return kept[index].name


def remove_run(index: int) -> None:
    """Stop keeping run `index`; an upload that is not the loaded dump leaves memory."""
    kept = runs()
    del kept[index]
    st.session_state.runs = kept
    session = _this_session()
    wanted = {_upload_key(session, r.loaded) for r in kept if r.loaded.kind == "upload"}
    loaded = st.session_state.get("loaded")
    if loaded is not None and loaded.kind == "upload":
        wanted.add(_upload_key(session, loaded))
    session.cache.discard(session.id, keep=lambda k: k[0] != "upload" or k in wanted)


def run_workspaces() -> dict[str, Workspace]:
    """Each run's workspace by name, in order; a run that cannot be had (an upload evicted
    from memory, a file gone or changed past the budget) is left out, saying why."""
    found = {}
    for run in runs():
        try:
            found[run.name] = _held(run.loaded)
        except IscoreError as e:
            st.warning(f"Run {escape(run.name)} is left out: {escape(str(e))}")
    return found


def compute(what: str, fn: Callable[..., T], *args: Any) -> T:
    """`fn(*args)` under a spinner saying `what` (workspaces memoize, so repeats are free)."""
    with st.spinner(what):
        return fn(*args)


# ------------------------------------------------------------------------------------------
# A run followed as it is written (`iscore app DIR --follow`)


@st.cache_resource(show_spinner=False)
def _seen() -> dict[str, dict[Path, tuple[int, int]]]:
    """The whole files of each followed folder, with their size and modification time: each
    file's footer is checked once, not on every run of every page."""
    return {}


def run_files(folder: str) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of the whole step files below `folder`, by path; a file still
    being written is left out until it is whole (`iscore.passes.follow.ready_files`), and a folder
    that is gone has none."""
    seen = _seen()
    try:
        ready = seen[folder] = ready_files(folder, seen.get(folder))
    except IscoreError:
        return ()
    return tuple((str(path), size, mtime) for path, (size, mtime) in ready.items())


def followed() -> str | None:
    """The folder `iscore app DIR --follow` follows, while it is the session's dump (None
    when not following, or another dump is open)."""
    app = options()
    loaded = st.session_state.get("loaded")
    if app.follow and loaded is not None and loaded.kind == "path" and loaded.key == app.preload:
        return app.preload
    return None


def waiting() -> bool:
    """Whether the session waits for the first whole step file of the run it follows, to
    open it."""
    app = options()
    return app.follow and st.session_state.path_pending and not run_files(app.preload)


def rerun_on_new_files(folder: str) -> None:
    """Run the app again whenever the whole files below `folder` change (looked at every
    `--interval` seconds), so that the page, the navigation and the sidebar show them; says
    how many there are."""
    shown = run_files(folder)
    every = options().interval

    @st.fragment(run_every=every)
    def look() -> None:
        if run_files(folder) != shown:
            st.rerun()
        count = f"{len(shown):,} whole step file{'s' * (len(shown) != 1)}" if shown else "no file"
        st.caption(
            f"Following {escape(folder)}: {count} so far, looked for every {every:g} s.",
        )

    look()


@dataclass(frozen=True, slots=True)
class _Followed:
    """A run's follower, shared by the sessions following it with the same settings; one
    poll at a time."""

    follower: Follower
    lock: threading.Lock


def _keep_rows(followed: _Followed) -> None:
    with followed.lock:
        followed.follower.save()


@st.cache_resource(show_spinner=False, max_entries=8, on_release=_keep_rows)
def _follower(folder: str, specs: tuple[Spec, ...], columns: Columns) -> _Followed:
    """The follower of `folder` with `specs`: its per-step rows are kept in the results store
    (as `iscore watch` keeps them), so that a run opens again without reading its files."""
    store = ResultStore(default_folder())
    return _Followed(Follower(folder, specs, store=store, columns=dict(columns)), threading.Lock())


def run_trend(folder: str, specs: Sequence[Spec]) -> Trend:
    """The trend of the followed run with `specs`, after reading the step files that landed
    since the last look (those steps' analysis alone).

    Raises:
        IscoreError: a new file is not a dump, or the folder is gone.
    """
    followed = _follower(folder, tuple(specs), st.session_state.loaded.columns)
    with followed.lock:
        return followed.follower.poll().trend


def open_worst_sequences(step: int) -> None:
    """Switch to Explore on the worst sequences of `step` (a click on a step's row then opens
    its per-token curves); a step outside the selected steps selects all of them again,
    saying so."""
    state = st.session_state
    chosen = selected_steps()
    steps = StepRange() if chosen is None else chosen.steps
    if (steps.lo is not None and step < steps.lo) or (steps.hi is not None and step > steps.hi):
        state.step_range = None
        say(
            "warning", f"Step {step} lies outside the selected steps: all steps are selected again."
        )
    state.explore_sql = worst_sequences_sql(step)
    state.pop("explore_pick", None)
    st.switch_page("pages/explore.py")


# ------------------------------------------------------------------------------------------
# Errors


# ------------------------------------------------------------------------------------------
# Health: is the mismatch normal, and where does it come from


# ------------------------------------------------------------------------------------------
# Settings (the Compare list)


# ------------------------------------------------------------------------------------------
# The user's framework and the recommendation


# ------------------------------------------------------------------------------------------
# Plots
