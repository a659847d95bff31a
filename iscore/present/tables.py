"""The tables people read, as specs: which statistic each column shows, under which header and
in which format, for every surface that draws the table (the HTML report, the app)."""

from iscore.packed import META_COLUMNS

SUMMARY_COLUMNS = (
    ("weight_mean", "mean w (token)", "{:.4g}"),
    ("weight_mean_seq", "mean w (seq)", "{:.4g}"),
    ("ess", "ESS", "{:.1%}"),
    ("lr_scale", "LR scale", "{:.4g}"),
    ("token_masked_fraction", "tokens masked", "{:.2%}"),
    ("seq_masked_fraction", "sequences masked", "{:.2%}"),
    ("truncated_high_fraction", "truncated high", "{:.2%}"),
    ("truncated_low_fraction", "truncated low", "{:.2%}"),
    ("broken_gradient_kept", "broken gradient kept", "{:.1%}"),
)
"""The settings table's columns (report and app): key of `Analysis.settings`, header, format."""

METADATA_COLUMNS = (
    ("value", "value", "{}"),
    ("sequences", "sequences", "{:,}"),
    ("tokens", "loss tokens", "{:,}"),
    ("steps", "steps", "{:,}"),
    ("k3", "k3", "{:.4g}"),
    ("k3_stderr", "k3 std. error", "{:.2g}"),
    ("abs_diff_mean", "mean |d|", "{:.4g}"),
    ("d_mean", "mean d", "{:+.3g}"),
    ("ratio_mean", "<e^d>", "{:.4f}"),
    ("broken_sequences", "broken", "{:,}"),
)
"""The columns of a metadata column's table (`mismatch.by_replica`, ...): key, header, format."""

METADATA_SHOWN = 12
"""The most values a metadata table shows: those of the largest k3, in value order (a
`weight_version` a step has hundreds; the document holds them all)."""


def metadata_tables(mismatch: dict) -> list[tuple[str, list[dict], int]]:
    """Per metadata column of the document's `mismatch` (`by_<column>`): the column, the rows
    shown (`METADATA_SHOWN` at most) and how many are left out.

    >>> rows = [{"value": v, "k3": k} for v, k in ((0, 0.1), (1, None), (2, 0.3))]
    >>> metadata_tables({"by_replica": rows})[0][0], metadata_tables({"by_replica": rows})[0][2]
    ('replica', 0)
    """
    out = []
    for key, rows in mismatch.items():
        if not key.startswith("by_") or key.removeprefix("by_") not in META_COLUMNS:
            continue
        ranked = sorted(range(len(rows)), key=lambda i: -(rows[i]["k3"] or 0.0))
        kept = sorted(ranked[:METADATA_SHOWN])
        out.append((key.removeprefix("by_"), [rows[i] for i in kept], len(rows) - len(kept)))
    return out


def metadata_cell(row: dict, key: str, pattern: str) -> str:
    """One cell of a metadata table: "-" for a statistic without a value, "(no value)" for the
    row of sequences whose column is null."""
    value = row.get(key)
    if value is None:
        return "(no value)" if key == "value" else "-"
    return pattern.format(value)
