"""Tune: move a family's thresholds and see what they do, at interactive speed (every read-out
is a binary search over the dump's sorted ratios, never a replay)."""

from __future__ import annotations

import common
import streamlit as st

from iscore import figures, frameworks, tune
from iscore.errors import IscoreError
from iscore.tune import FAMILIES

ws = common.require_workspace()
steps = common.selected_steps()
state = st.session_state
tuner = common.compute("Sorting the dump's ratios (once per dump and steps)…", ws.tuner, steps)

st.title("Tune thresholds")
st.caption(
    f"{tuner.tokens:,} loss tokens in {tuner.sequences:,} sequences. Slider ranges follow the "
    "data: they reach past its 0.1% and 99.9% quantiles of the thresholded statistic."
)
common.notice()
cols = st.columns(2)
family = cols[0].selectbox(
    "Family", list(FAMILIES), format_func=lambda k: FAMILIES[k].label,
    **common.persist("tune_family", "token_tis"),
)  # fmt: skip
f = FAMILIES[family]
choices = tune.frameworks_for(family)
if state.get("tune_framework") not in choices:  # a family the last framework cannot express
    state.tune_framework = choices[0]
framework = cols[1].selectbox(
    "Framework", choices, key="tune_framework",
    help="Whose setting this is: the LR scale follows that framework's loss aggregation",
)  # fmt: skip
grids = ws.grid(family, steps)
values = []
for col, bound, default in zip(st.columns(len(f.bounds)), f.bounds, f.defaults, strict=True):
    key = f"tune_{family}_{bound}"
    if state.get(key, default) not in grids[bound]:  # a new dump or step selection
        state[key] = tune.nearest(grids[bound], state.get(key, default))
    values.append(
        col.select_slider(
            bound, grids[bound], format_func=lambda v: f"{v:.4g}", **common.persist(key, default)
        )
    )
result = tune.query(tuner, family, values, framework)
aggregation = frameworks.get(framework).aggregation(tune.family_spec(family, values, framework))
st.caption(
    f"{f.rule}. Read-outs are over loss tokens; the LR scale is under {framework}'s loss "
    f"aggregation ({aggregation.describe()})."
)

cols = st.columns(5)
cols[0].metric("Tokens with weight 0", f"{result.token_masked_fraction:.2%}", border=True)
cols[1].metric(
    "Sequences masked",
    "n/a" if result.seq_masked_fraction is None else f"{result.seq_masked_fraction:.2%}",
    help="Sequences all of whose tokens have weight 0 (sequence-level families)",
    border=True,
)
cols[2].metric(
    "LR scale", f"{result.lr_scale:.4g}",
    help="The corrected gradient's scale under the framework's loss aggregation: 1 leaves the "
    "step size alone",
    border=True,
)  # fmt: skip
cols[3].metric(
    "ESS", f"{result.ess:.1%}", help="(sum w)² / (N sum w²), a fraction of the tokens",
    border=True,
)  # fmt: skip
cols[4].metric(
    "Tokens truncated",
    f"{result.truncated_fraction:.2%}" if f.truncates else "n/a",
    help="Tokens whose weight the cap lowered (capping families)",
    border=True,
)
shown = [
    field
    for field, _, _ in figures.READOUTS
    if (field != "seq_masked_fraction" or result.seq_masked_fraction is not None)
    and (field != "truncated_fraction" or f.truncates)
]

for col, (i, bound) in zip(st.columns(len(f.bounds)), enumerate(f.bounds), strict=True):
    with col:
        curve = tune.sweep(tuner, family, values, i, grids[bound], framework)
        common.plot(figures.tune_figure(bound, grids[bound], curve, values[i], shown))


def _use() -> None:
    chosen = [state[f"tune_{family}_{bound}"] for bound in f.bounds]
    try:
        spec = tune.family_spec(family, chosen, framework, state.tune_name.strip() or None)
        common.say("success", f"Added {common.add_setting(spec)} to the Compare list.")
    except IscoreError as e:
        common.say("error", str(e))


st.subheader("Use this setting")
cols = st.columns([3, 1], vertical_alignment="bottom")
cols[0].text_input("Name", placeholder=tune.setting_name(family, values), key="tune_name")
cols[1].button("Use this setting", icon=":material/playlist_add:", on_click=_use, type="primary")
st.page_link("pages/compare.py", label="Compare it with others", icon=":material/arrow_forward:")
