"""Tune: move a framework's thresholds and see what they do, at interactive speed (every
read-out is a binary search over the dump's sorted statistics, never a replay)."""

from __future__ import annotations

import compare_list
import render
import session
import streamlit as st

from iscore import frameworks
from iscore.advice import FAMILIES, tuning
from iscore.errors import IscoreError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.present import figures

ws = compare_list.require_workspace()
steps = session.selected_steps()
state = st.session_state
tuner = session.compute("Sorting the dump's ratios (once per dump and steps)…", ws.tuner, steps)
rec = compare_list.recommendation(ws, steps)

st.title("Tune thresholds")
st.caption(
    f"{tuner.tokens:,} loss tokens in {tuner.sequences:,} sequences. Each slider step moves "
    "the share of the data beyond the threshold by a constant factor, so the range is where "
    "your data is."
)
session.notice()

tunable = [name for name in FRAMEWORKS if frameworks.get(name).families]
if state.get("tune_framework", compare_list.framework()) not in tunable:
    state.tune_framework = tunable[0]
cols = st.columns(2)
framework = cols[0].selectbox(
    "Framework", tunable, format_func=compare_list.framework_title,
    help="Whose setting this is: the LR scale follows that framework's loss aggregation",
    **session.persist("tune_framework", compare_list.framework()),
)  # fmt: skip
expressed = [k for k in FAMILIES if k in frameworks.get(framework).families]
# DPPO picks its side by each sequence's advantage: a dump without one cannot place it.
choices = [k for k in expressed if tuner.advantages or not FAMILIES[k].needs_advantage]
if state.get("tune_family") not in choices:  # a family the framework cannot express
    state.tune_family = choices[0]
family = cols[1].selectbox(
    "Method", choices, format_func=lambda k: FAMILIES[k].label,
    **session.persist("tune_family", choices[0]),
)  # fmt: skip
f = FAMILIES[family]
if len(choices) < len(expressed):
    missing = ", ".join(FAMILIES[k].label for k in expressed if k not in choices)
    st.caption(f"{missing}: needs the dump's `advantage` column, which this dump lacks.")


def _marks() -> list[tuple[str, tuple[float, ...]]]:
    """The framework's own setting of this family (its first preset of it) and the best
    recommended one, where they exist."""
    out = []
    for spec in frameworks.get(framework).presets().values():
        found = tuning.family_of(spec)
        if found is not None and found[0] == family:
            out.append((f"{framework} {spec.name}", found[1]))
            break
    for candidate in rec.candidates:
        found = tuning.family_of(candidate.spec)
        if found is not None and found[0] == family:
            out.append(("recommended", found[1]))
            break
    return out


marks = _marks()
grids = ws.cached(
    ("tune-grid", family, tuple(v for _, v in marks), ws.selection(steps)),
    lambda: tuning.grid(tuner, family, include=[v for _, v in marks]),
)
st.caption(
    f"{f.rule}. Dashed lines: "
    + (", ".join(label for label, _ in marks) or "none for this method")
    + "."
)


@st.fragment
def _sliders() -> None:
    """The sliders, read-outs and curves: moving a slider reruns only this part."""
    values = []
    # A method opens on the recommended setting of it where there is one: the usual defaults
    # can drop most of a dump (a geometric band of [0.999, 1.001] kept 0.4% of fp8's tokens).
    start = dict(marks).get("recommended", f.defaults)
    for col, bound, default in zip(st.columns(len(f.bounds)), f.bounds, start, strict=True):
        key = f"tune_{family}_{bound}"
        if state.get(key, default) not in grids[bound]:  # a new dump or step selection
            state[key] = tuning.nearest(grids[bound], state.get(key, default))
        values.append(
            col.select_slider(
                bound, grids[bound], format_func=lambda v: f"{v:.6g}",
                **session.persist(key, default),
            )
        )  # fmt: skip
    result = tuning.query(tuner, family, values, framework)
    spec = tuning.family_spec(family, values, framework)
    aggregation = frameworks.get(framework).aggregation(spec)
    st.caption(
        f"Read-outs are over loss tokens; the LR scale is under {framework}'s loss aggregation "
        f"({aggregation.describe()})."
    )
    cols = st.columns(5)
    cols[0].metric("Tokens with weight 0", f"{result.token_masked_fraction:.2%}", border=True)
    cols[1].metric(
        "Sequences masked",
        "n/a" if result.seq_masked_fraction is None else f"{result.seq_masked_fraction:.2%}",
        help="Sequences all of whose tokens have weight 0 (sequence-level methods)",
        border=True,
    )
    cols[2].metric(
        "LR scale", f"{result.lr_scale:.4g}",
        help="The corrected gradient's scale under the framework's loss aggregation: 1 "
        "leaves the step size alone",
        border=True,
    )  # fmt: skip
    cols[3].metric(
        "ESS", f"{result.ess:.1%}", help="(sum w)² / (N sum w²), a fraction of the tokens",
        border=True,
    )  # fmt: skip
    cols[4].metric(
        "Tokens truncated",
        f"{result.truncated_fraction:.2%}" if f.truncates else "n/a",
        help="Tokens whose weight the cap lowered (capping methods)",
        border=True,
    )
    if result.token_masked_fraction >= 1.0:
        st.warning("Every loss token is dropped: no gradient is left.", icon=":material/block:")
    elif aggregation.shrinks and result.token_masked_fraction > 0:
        st.caption(
            f"{framework} divides by the tokens it keeps, so dropping "
            f"{result.token_masked_fraction:.2%} of them does not shrink the step (LR scale "
            f"{result.lr_scale:.4g}): the step is as large, taken on less data."
        )
    shown = [
        field
        for field, _, _ in figures.READOUTS
        if (field != "seq_masked_fraction" or result.seq_masked_fraction is not None)
        and (field != "truncated_fraction" or f.truncates)
    ]
    # One curve per row: side by side, two bounds left each plot too narrow for its legend
    # and its lines' labels.
    for i, bound in enumerate(f.bounds):
        curve = ws.cached(
            ("tune-sweep", family, framework, i, tuple(values), ws.selection(steps)),
            lambda i=i, bound=bound: tuning.sweep(
                tuner, family, values, i, grids[bound], framework
            ),
        )
        at = [(label, v[i]) for label, v in marks]
        render.plot(figures.tune_figure(bound, grids[bound], curve, values[i], shown, at))


_sliders()


def _use() -> None:
    chosen = [state[f"tune_{family}_{bound}"] for bound in f.bounds]
    try:
        spec = tuning.family_spec(family, chosen, framework, state.tune_name.strip() or None)
        name = compare_list.use_setting(spec)
        session.say("success", f"{name} is in Compare and Export.")
    except IscoreError as e:
        session.say("error", str(e))


st.subheader("Use this setting")
cols = st.columns([3, 1], vertical_alignment="bottom")
cols[0].text_input("Name", placeholder="e.g. my_tis (default: the method and its values)",
                   key="tune_name")  # fmt: skip
cols[1].button("Use this setting", icon=":material/playlist_add:", on_click=_use, type="primary")
st.page_link("pages/compare.py", label="Compare it with others", icon=":material/arrow_forward:")
