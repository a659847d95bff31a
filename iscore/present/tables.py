"""The tables people read, as specs: which statistic each column shows, under which header and
in which format, for every surface that draws the table (the HTML report, the app)."""

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
