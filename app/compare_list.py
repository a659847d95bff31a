"""The settings the pages work on (the Compare list, seeded once per dump with the user's
framework's default and its recommended setting), the user's framework, and a setting
exported for any framework."""

from __future__ import annotations

from dataclasses import replace

import streamlit as st
from session import compute, selected_steps, store, workspace

from iscore import frameworks
from iscore.advice import (
    FAMILIES,
    Recommendation,
    family_of,
)
from iscore.dump import StepRange
from iscore.frameworks import Spec, presets
from iscore.session import (
    Workspace,
)


def label(spec: Spec) -> str:
    """`framework:name`, the form of `iscore.passes.analysis.presets()` keys."""
    return f"{spec.framework}:{spec.name}"


def settings() -> list[Spec]:
    """The session's settings, in order: setting i is drawn in `iscore.present.figures.color(i)`."""
    return list(st.session_state.settings)


def known_settings() -> dict[str, Spec]:
    """Every setting the user can pick: the presets and those added this session."""
    return {**presets(), **st.session_state.custom}


def add_setting(spec: Spec) -> str:
    """Add a custom setting to the Compare list (renamed if its label is taken by another
    setting); returns its label."""
    known = known_settings()
    name, n = spec.name, 1
    while label(spec) in known and known[label(spec)] != spec:
        n += 1
        spec = replace(spec, name=f"{name}_{n}")
    st.session_state.custom[label(spec)] = spec
    if spec not in st.session_state.settings:
        st.session_state.settings.append(spec)
    return label(spec)


def use_setting(spec: Spec) -> str:
    """Make `spec` the setting the pages work on: add it to the Compare list, open it on the
    Export page, and move Tune's sliders to it when it is one of Tune's families; returns
    its label."""
    state = st.session_state
    name = add_setting(spec)
    state.export_setting = name
    found = family_of(spec)
    if found is not None:
        family, values = found
        state.tune_family = family
        state.tune_framework = spec.framework
        for bound, value in zip(FAMILIES[family].bounds, values, strict=True):
            state[f"tune_{family}_{bound}"] = value
    return name


def framework() -> str:
    """The user's framework (the sidebar's choice): Recommend ranks its settings, and Compare,
    Tune and Export start from them."""
    return st.session_state.framework


def framework_title(name: str) -> str:
    """A framework's name for people, e.g. "NeMo-RL"."""
    return frameworks.get(name).title


def framework_changed() -> None:
    """A Compare list still as the app started it follows a new framework choice."""
    store("framework")
    state = st.session_state
    if state.settings and state.settings == state.get("_seeded_list"):
        state.settings.clear()
        state.pop("_seeded", None)


def framework_default(name: str | None = None) -> Spec:
    """The preset users of a framework (default: the user's) most likely run."""
    fw = frameworks.get(name or framework())
    return presets()[f"{fw.name}:{fw.default}"]


def recommendation(ws: Workspace, steps: StepRange | None) -> Recommendation:
    """The user's framework's settings ranked on the selected steps for the session's targets
    (memoized with the workspace)."""
    state = st.session_state
    what = f"Ranking {state.framework}'s settings on this dump…"
    return compute(what, ws.recommend, state.framework, state.targets, steps)


def recommended(rec: Recommendation, index: int = 0) -> Spec:
    """Candidate `index` of `rec` named for the Compare list, e.g. `recommended_token_tis`."""
    candidate = rec.candidates[index]
    return replace(candidate.spec, name=f"recommended_{candidate.kind}")


def seed_settings(ws: Workspace, steps: StepRange | None) -> None:
    """Once per dump, the Compare list starts with the user's framework's default and the
    recommended setting, so that every page has something to show on first open; a list the
    user emptied stays empty until another dump is opened.

    A new dump drops the previous one's recommended settings (their thresholds were placed on
    that dump, and this dump's may take their names) and its unchanged seeds; the settings the
    user added otherwise stay."""
    state = st.session_state
    if state.get("_seeded") == state.loaded:
        return
    # The ranking is the step a rerun can cut short (the user switching page while it runs):
    # nothing changes before it is done, so that the next run seeds again, not half.
    best = recommended(recommendation(ws, steps))
    stale = [
        s
        for s in state.settings
        if s.name.startswith("recommended_") or s in state.get("_seeded_list", ())
    ]
    for spec in stale:
        state.settings.remove(spec)
        state.custom.pop(label(spec), None)
    default = framework_default()
    if default not in state.settings:
        state.settings.append(default)
    name = use_setting(best)
    state._seeded = state.loaded
    state._seeded_list = [default, state.custom[name]]


def require_workspace() -> Workspace:
    """The session's dump, its Compare list seeded (`seed_settings`); without one, a pointer
    to the Data page and the page stops."""
    ws = workspace()
    if ws is None:
        st.info("Load a dump first: upload one, open a server path or pick a sample.")
        st.page_link("pages/data.py", label="Go to the Data page", icon=":material/upload:")
        st.stop()
    seed_settings(ws, selected_steps())
    return ws
