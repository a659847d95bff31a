"""Explore: SQL over the sequence table (and the dump's tokens), one sequence's per-token
curves under each setting, and a slice that every page then looks at."""

from __future__ import annotations

import compare_list
import render
import session
import streamlit as st

from iscore.errors import IscoreError
from iscore.present import figures
from iscore.session import worst_sequences_sql
from iscore.stats import setting_columns
from iscore.utils import ROW_LIMIT, TIMEOUT_S

ws = compare_list.require_workspace()
selection = session.selected_steps()
specs = compare_list.settings()
state = st.session_state
columns = ws.schema.names
prefixes = setting_columns(specs, columns)

st.title("Explore")
session.notice()
st.caption(
    "`sequences` has one row per sequence of the selection: its step, seq_id and the dump's "
    "own per-sequence columns, length, loss_tokens, its mismatch (d_mean, abs_diff_mean, "
    "abs_diff_max, k1, k3, d_sum, geo_ratio) and, for each setting in Compare, its weight, "
    "kept fraction and gradient share (NAME_weight, NAME_kept, NAME_share). `tokens` has one "
    "row per token (step, seq_id, pos, rollout_logprob, train_logprob, loss_mask, d). "
    "DuckDB SQL; see docs/sql.md."
)

# ------------------------------------------------------------------------------------------
# The slice

SLICES = {
    "long responses": "length > 4000",
    "large mismatch": "k3 > 1e-3",
    "one huge token": "abs_diff_max > 5",
    "later steps": f"step > {ws.steps[len(ws.steps) // 2]}" if len(ws.steps) > 1 else None,
    "rewarded": "reward > 0" if "reward" in columns else None,
}


def _slice_example() -> None:
    pick = state.get("_w_slice_example")
    if pick:
        state._w_slice = SLICES[pick]


st.subheader("Slice every page")
st.pills(
    "Examples",
    [k for k, v in SLICES.items() if v],
    key="_w_slice_example",
    on_change=_slice_example,
    label_visibility="collapsed",
)
state.setdefault("_w_slice", state.get("slice") or "")
text = st.text_input(
    "Only the sequences where (a condition on the columns of `sequences` other than the "
    "settings', e.g. `length > 4000 AND reward = 1`)",
    key="_w_slice",
)
left, right = st.columns(2)
if left.button("Apply as slice", icon=":material/filter_alt:", type="primary"):
    try:
        session.apply_slice(ws, text.strip())
        st.rerun()
    except IscoreError as e:
        render.show_error(e)
right.button(
    "Clear the slice",
    icon=":material/filter_alt_off:",
    on_click=session.clear_slice,
    disabled=state.get("slice") is None,
)
if state.get("slice") is not None:
    sequences = ws.summary(selection)["sequences"]
    st.info(
        f"Every page looks only at the {sequences:,} sequence{'s' * (sequences != 1)} where "
        f"`{state.slice}`.",
        icon=":material/filter_alt:",
    )

# ------------------------------------------------------------------------------------------
# The query

first = prefixes[0] if prefixes else None
QUERIES = {
    "worst sequences": worst_sequences_sql(),
    "k3 by step": "SELECT step, count(*) AS sequences, avg(k3) AS k3, "
    "max(abs_diff_max) AS abs_diff_max\nFROM sequences GROUP BY step ORDER BY step",
    "worst groups": "SELECT group_id, count(*) AS sequences, avg(k3) AS k3, "
    "max(abs_diff_max) AS abs_diff_max\nFROM sequences GROUP BY group_id ORDER BY k3 DESC "
    "LIMIT 20"
    if "group_id" in columns
    else None,
    "dropped but rewarded": f"SELECT step, seq_id, reward, length, k3, {first}_weight\n"
    f"FROM sequences WHERE {first}_kept = 0 AND reward > 0"
    if first and "reward" in columns
    else None,
    "largest |d| tokens": "SELECT step, seq_id, pos, rollout_logprob, train_logprob, d\n"
    "FROM tokens ORDER BY abs(d) DESC LIMIT 20"
    if ws.dump is not None
    else None,
}


def _query_example() -> None:
    pick = state.get("_w_query_example")
    if pick:
        state.explore_sql = QUERIES[pick]
        state._w_explore_sql = QUERIES[pick]


st.subheader("Query")
st.pills(
    "Examples",
    [k for k, v in QUERIES.items() if v],
    key="_w_query_example",
    on_change=_query_example,
    label_visibility="collapsed",
)
sql = st.text_area(
    "DuckDB SQL over `sequences` and `tokens`",
    height=110,
    **session.persist("explore_sql", QUERIES["worst sequences"]),
)
try:
    result = session.compute(
        "Running the query…",
        ws.cached,
        ("explore", sql, tuple(specs), ws.selection(selection)),
        lambda: ws.query(sql, specs, selection, limit=ROW_LIMIT, timeout=TIMEOUT_S),
    )
except IscoreError as e:
    render.show_error(e)
    st.stop()

rows = result.table.to_pandas()
shown = f"{len(rows):,} row{'s' * (len(rows) != 1)}"
if result.truncated:
    shown = f"the first {ROW_LIMIT:,} rows (there are more: add a LIMIT or a WHERE)"
opens = {"step", "seq_id"} <= set(rows.columns)
st.caption(
    shown + (" · click a row to open its sequence · click a header to sort" if opens else "")
)
event = st.dataframe(
    rows,
    hide_index=True,
    width="stretch",
    # Four significant digits: mismatch columns (k3 ~ 1e-4) would read 0.0007 at 4 decimals.
    column_config={
        c: st.column_config.NumberColumn(format="%.4g")
        for c in rows.select_dtypes("floating").columns
    },
    height=min(35 * (len(rows) + 1) + 3, 420),
    on_select="rerun" if opens else "ignore",
    selection_mode="single-row",
    key=f"explore_rows_{hash(sql)}",
)
picked = event.selection.rows if opens else []
if picked:
    i = picked[0]
    state.explore_pick = (state.loaded, int(rows["step"].iloc[i]), rows["seq_id"].tolist()[i])
pick = state.get("explore_pick")
if pick is None or pick[0] != state.loaded:
    st.stop()

# ------------------------------------------------------------------------------------------
# One sequence

_, step, seq_id = pick
try:
    tokens = ws.sequence(step, seq_id)
    weights = session.compute(
        "Replaying the settings on its step…", ws.sequence_weights, specs, step, seq_id, selection
    )
except IscoreError as e:
    render.show_error(e)
    st.stop()
st.subheader(f"Sequence {seq_id} of step {step}")
render.plot(
    figures.sequence_figure(
        tokens,
        f"Sequence {seq_id} of step {step}: "
        + ("log-probs, d and each setting's weight" if specs else "log-probs and d"),
        {compare_list.label(spec): weights[spec] for spec in specs},
    )
)
if specs:
    st.caption("Bottom: the weight each setting gives each token (0 where it masks the token).")
