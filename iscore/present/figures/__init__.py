"""Figures as plotly JSON specs (plain dicts): of an analysis (`analysis`), shared by the HTML
report and the app, and the app's own (`pages`: lengths, one sequence's tokens, a threshold's
read-outs), a run's per-step figures (`trends`: each diagnostic and each setting's statistics
per step, smoothed, with the run's events), several runs on one figure (`runs`, and
`trends.runs_trend_figures`), a metric's change between two steps split by factor (`why`),
drawn with the shared `style`, `axes` and `binning`.

The engine never imports plotly: a figure here is the `{"data": [...], "layout": {...}}` dict
that plotly.js renders (and `plotly.graph_objects.Figure` accepts). Every figure is built from
the small pre-binned tables of an `Analysis`, never from per-token data, so a page stays small
whatever the size of the dump.

What every figure keeps to, so that it reads at a glance in a light or a dark page:

- setting i is drawn in `color(i)`, `dash(i)` and `symbol(i)` on every figure, earlier settings
  wider than later ones (`style`), so that settings that coincide stay visible; no two of the
  first 60 settings share both color and dash;
- backgrounds are transparent and grid and reference lines a grey with alpha: the app's theme
  (`st.plotly_chart(..., theme="streamlit")`) or the report's white page gives the fonts;
- legends sit outside the plot area (right of it), never over an axis title;
- log axes label whole decades, few enough not to crowd, in exponent form (`10⁻³`), and
  1-2-5 times them (or finer) where that leaves fewer than 3 labels;
- every hover names its quantities with their units ("sequence length (loss tokens)");
- histograms are re-binned per figure from the analysis' fine ones (`rebin`), so that the
  central 98% of the data spans 40 to 80 bins wherever it lies.

>>> fig = lr_scale_by_step(analysis)  # doctest: +SKIP
>>> fig["layout"]["yaxis"]["title"]["text"]  # doctest: +SKIP
'LR scale (corrected / uncorrected)'
"""

from iscore.present.figures.analysis import (
    MASK_RATES,
    abs_diff_histogram,
    all_figures,
    collapse_by_length,
    joint_histogram,
    lr_scale_by_step,
    mask_rate_by_length,
    mask_rates,
    mismatch_by,
    mismatch_figures,
    setting_figures,
    signed_diff_histogram,
    weight_histogram,
)
from iscore.present.figures.axes import figure_layout, vline
from iscore.present.figures.binning import rebin, widths
from iscore.present.figures.pages import (
    LABEL_ROW,
    READOUTS,
    length_figure,
    sequence_figure,
    tune_figure,
)
from iscore.present.figures.runs import runs_abs_diff, runs_mismatch_by, runs_mismatch_figures
from iscore.present.figures.style import (
    DASHES,
    NEUTRAL,
    PALETTE,
    SYMBOLS,
    Figure,
    color,
    dash,
    setting_name,
    style,
    symbol,
    text,
)
from iscore.present.figures.trends import (
    DIAGNOSTICS,
    SETTING_METRICS,
    SMOOTHING,
    log_axis,
    runs_trend_figures,
    setting_trend_figure,
    smooth,
    trend_figure,
    trend_figures,
)
from iscore.present.figures.why import why_bins_figure, why_figure, why_rows

__all__ = [
    "DASHES",
    "DIAGNOSTICS",
    "LABEL_ROW",
    "MASK_RATES",
    "NEUTRAL",
    "PALETTE",
    "READOUTS",
    "SETTING_METRICS",
    "SMOOTHING",
    "SYMBOLS",
    "Figure",
    "abs_diff_histogram",
    "all_figures",
    "collapse_by_length",
    "color",
    "dash",
    "figure_layout",
    "joint_histogram",
    "length_figure",
    "log_axis",
    "lr_scale_by_step",
    "mask_rate_by_length",
    "mask_rates",
    "mismatch_by",
    "mismatch_figures",
    "rebin",
    "runs_abs_diff",
    "runs_mismatch_by",
    "runs_mismatch_figures",
    "runs_trend_figures",
    "sequence_figure",
    "setting_figures",
    "setting_name",
    "setting_trend_figure",
    "signed_diff_histogram",
    "smooth",
    "style",
    "symbol",
    "text",
    "trend_figure",
    "trend_figures",
    "tune_figure",
    "vline",
    "weight_histogram",
    "why_bins_figure",
    "why_figure",
    "why_rows",
    "widths",
]
