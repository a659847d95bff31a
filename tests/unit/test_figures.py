"""The app's own figures (`iscore.present.figures`): plain plotly specs built from small tables."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import re

import numpy as np
import pytest
import torch

from iscore.advice.trend import Event, Trend
from iscore.advice.tuning import TuneResult
from iscore.errors import IscoreError
from iscore.passes.analysis import analyze
from iscore.passes.document import Analysis
from iscore.present import figures
from iscore.present.figures import axes, binning
from iscore.stats.histogram import BINS_PER_DECADE
from iscore.stats.mismatch import MismatchStats
from iscore.stats.noise import Baseline
from tests.unit.frameworks.conftest import make_batch


def test_length_figure_has_one_bar_per_bin() -> None:
    summary = {"length_hist": {"edges": [1.0, 3.0, 7.0], "counts": [4, 2]}}
    (bars,) = figures.length_figure(summary)["data"]
    assert bars["x"] == [2.0, 5.0] and bars["width"] == [2.0, 4.0] and bars["y"] == [4, 2]


def test_sequence_figure_draws_d_below_the_log_probs() -> None:
    rollout, train = np.array([-1.0, -2.0, -0.5]), np.array([-1.1, -1.5, -0.5])
    tokens = {"pos": np.arange(3), "rollout": rollout, "train": train, "d": train - rollout}
    fig = figures.sequence_figure(tokens, "one sequence")
    by_name = {trace["name"]: trace for trace in fig["data"]}
    assert by_name["d = train - rollout"]["yaxis"] == "y2"
    assert by_name["d = train - rollout"]["y"] == pytest.approx([-0.1, 0.5, 0.0])
    assert by_name["rollout log-prob"]["yaxis"] == "y"
    assert fig["layout"]["yaxis2"]["domain"][1] < fig["layout"]["yaxis"]["domain"][0]


def test_sequence_figure_draws_each_settings_weights_below_d_on_the_same_positions() -> None:
    d = np.array([0.0, 0.9, -0.1])
    tokens = {"pos": np.array([5, 6, 7]), "rollout": -np.ones(3), "train": d - 1, "d": d}
    weights = {"verl:token_tis": np.array([1.0, 2.0, 0.9]), "slime:icepop": np.array([1, 0, 0.9])}
    fig = figures.sequence_figure(tokens, "one sequence", weights)
    layout = fig["layout"]
    panels = [layout[axis]["domain"] for axis in ("yaxis", "yaxis2", "yaxis3")]
    assert all(low[1] < high[0] for low, high in itertools.pairwise(panels[::-1]))
    assert layout["xaxis"]["anchor"] == "y3"  # the position axis under the lowest panel
    drawn = [t for t in fig["data"] if t["yaxis"] == "y3"]
    assert [t["name"] for t in drawn] == list(weights)
    for i, (trace, values) in enumerate(zip(drawn, weights.values(), strict=True)):
        assert trace["x"] == [5.0, 6.0, 7.0] and trace["xaxis"] == "x"
        assert trace["y"] == pytest.approx(list(values))
        assert trace["line"] == figures.style(i, 2)["line"]
        assert "%{fullData.name}" in trace["hovertemplate"]
    # Without weights: the two panels only.
    plain = figures.sequence_figure(tokens, "one sequence")
    assert "yaxis3" not in plain["layout"] and plain["layout"]["xaxis"]["anchor"] == "y2"
    assert {t["yaxis"] for t in plain["data"]} == {"y", "y2"}


def test_tune_figure_draws_the_asked_read_outs_and_marks_the_value() -> None:
    results = [TuneResult(1.0, 0.9, 0.8 + i / 10, 0.1, None, 0.0) for i in range(3)]
    marks = [("recommended", 4.0), ("verl default", 1.1)]
    fig = figures.tune_figure("upper", [1.0, 2.0, 4.0], results, 2.0, ["lr_scale", "ess"], marks)
    assert [trace["name"] for trace in fig["data"]] == ["ESS", "LR scale"]
    assert fig["data"][1]["y"] == pytest.approx([0.8, 0.9, 1.0])
    # Slider positions, labelled with the values; marks at the nearest position (log scale).
    assert fig["data"][0]["x"] == [0, 1, 2]
    assert fig["layout"]["xaxis"]["ticktext"] == ["1", "2", "4"]
    shapes = fig["layout"]["shapes"]
    assert [(s["x0"], s["label"]["text"]) for s in shapes[:2]] == [
        (2, "recommended"),
        (0, "verl default"),
    ]
    assert shapes[2]["x0"] == 1 and shapes[2]["label"]["text"] == "2"


def _tune(n: int, value: int, marks: dict[str, int]) -> dict:
    """A tune figure over n slider values (1.1^i), all read-outs at 1, the value and the
    marks at the given steps."""
    xs = [1.1**i for i in range(n)]
    results = [TuneResult(0.1, 0.2, 1.0, 0.9, 0.05, 0.0)] * n
    fields = [field for field, _, _ in figures.READOUTS]
    at = [(label, xs[i]) for label, i in marks.items()]
    return figures.tune_figure("upper", xs, results, xs[value], fields, at)


@pytest.mark.parametrize("n", range(2, 80))
def test_tune_figure_ticks_are_even_and_few(n) -> None:
    """Ticks one slider step apart times a constant, at most 6 (they crowded a half-width
    column at 7), from the first step to the last where a spacing allows (41 steps ended at
    step 36 of 40)."""
    axis = _tune(n, 0, {})["layout"]["xaxis"]
    ticks = axis["tickvals"]
    assert ticks[0] == 0 and len(set(np.diff(ticks))) <= 1, ticks
    assert 2 <= len(ticks) <= 6, ticks
    assert n - 1 - ticks[-1] < (ticks[1] if len(ticks) > 1 else n), ticks
    if any((n - 1) % gaps == 0 for gaps in (4, 5)):
        assert ticks[-1] == n - 1, ticks
    assert axis["ticktext"] == [f"{1.1**i:.6g}" for i in ticks]


def test_tune_figure_labels_its_lines_at_the_top_clear_of_the_ticks_and_each_other() -> None:
    """The audit's case: the chosen value and the framework's default at one step, the
    recommended one 3 steps right of them. The labels were at the lines' bottom ends, over
    the tick labels."""
    fig = _tune(41, 12, {"verl default": 12, "recommended": 15})
    layout = fig["layout"]
    lines = {s["label"]["text"]: s for s in layout["shapes"] if s.get("label")}
    assert set(lines) == {f"{1.1**12:.6g}", "verl default", "recommended"}
    for line in lines.values():  # upright, just above the line's top end
        label = line["label"]
        assert (label["textposition"], label["textangle"], label["yanchor"]) == ("end", 0, "bottom")
        assert line["yref"] == "paper" and line["y0"] == 0 and line["y1"] < 1
    # A row each, all of them above the read-outs (at 1 or below), with room for the text.
    ends = sorted(line["y1"] for line in lines.values())
    low, high = layout["yaxis"]["range"]
    assert low == 0 and 1.0 / high <= ends[0] - figures.LABEL_ROW / 2 + 1e-9
    assert all(b - a == pytest.approx(figures.LABEL_ROW) for a, b in itertools.pairwise(ends))
    assert ends[-1] + figures.LABEL_ROW <= 1
    # Toward the middle, never off the plot's edge: in the left half, right of the line.
    assert {line["label"]["xanchor"] for line in lines.values()} == {"left"}
    assert _tune(41, 1, {})["layout"]["shapes"][0]["label"]["xanchor"] == "left"
    assert _tune(41, 25, {})["layout"]["shapes"][0]["label"]["xanchor"] == "right"


# ------------------------------------------------------------------ figures of an analysis

SETTINGS = [
    "verl:decoupled_token_is",
    "verl:decoupled_geo_rs",
    "skyrl:skyrl_token_tis",
    "nemo_rl:nemo_icepop",
    "verl:decoupled_seq_is",
    "slime:slime_tis",
]


def _batch(seed: int = 0, sigma: float = 0.1, offset: float = 0.0, steps: int = 2):
    """Random log-probs over `steps` steps with some masked tokens, exact zeros of d and,
    outside the loss mask, huge d that must not count."""
    rng = np.random.default_rng(seed)
    lengths = [1, 3, *rng.lognormal(5, 1, 40).astype(int).clip(1, 3000).tolist()]
    batch = make_batch(lengths, seed=seed, sigma=sigma)
    train = batch.train.clone()
    if offset:
        train = (train + offset).clamp_(max=0.0)
    train[::17] = batch.rollout[::17]  # d == 0 exactly
    train[~batch.loss_mask] = batch.rollout[~batch.loss_mask] - 30.0
    step = torch.tensor(np.sort(rng.integers(0, steps, len(lengths))))
    return dataclasses.replace(batch, train=train, step=step)


@pytest.fixture(scope="module")
def four() -> Analysis:
    return analyze(_batch(), SETTINGS[:4], device="cpu")


@pytest.fixture(scope="module")
def six() -> Analysis:
    return analyze(_batch(1), SETTINGS, device="cpu")


def _every_figure(analysis: Analysis) -> dict[str, dict]:
    trends = figures.trend_figures(analysis.trend, smoothing=0.6)
    return (
        figures.all_figures(analysis)
        | {
            "mask_rates": figures.mask_rates(analysis),
            "joint": figures.joint_histogram(analysis),
        }
        | {f"trend_{column}": figure for column, figure in trends.items()}
    )


def _setting_of(trace: dict, analysis: Analysis) -> int | None:
    """The index of the setting a trace draws (by its legend group or its name)."""
    if trace.get("legendgroup", "").isdigit():
        return int(trace["legendgroup"])
    for i, s in enumerate(analysis.settings):
        if trace.get("name", "").startswith(figures.setting_name(s)):
            return i
    return None


def _colors(trace: dict) -> set[str]:
    """Every color a trace is drawn in."""
    out = {trace.get("fillcolor"), trace.get("line", {}).get("color")}
    marker = trace.get("marker", {}).get("color")
    out |= set(marker) if isinstance(marker, list) else {marker}
    return out - {None}


@pytest.mark.parametrize("which", ["four", "six"])
def test_every_trace_of_a_setting_carries_its_color(which, request) -> None:
    analysis = request.getfixturevalue(which)
    for key in ("weights", "raw", "collapse", "mask_by_length", "lr_scale", "mask_rates"):
        fig = _every_figure(analysis)[key]
        drawn = set()
        for trace in fig["data"]:
            i = _setting_of(trace, analysis)
            if i is None:
                assert not _colors(trace) & set(figures.PALETTE), (key, trace.get("name"))
                continue
            drawn.add(i)
            assert _colors(trace) == {figures.color(i)}, (key, trace.get("name"))
        assert drawn == set(range(len(analysis.settings))), key


def test_settings_differ_in_dash_and_marker_and_later_ones_are_thinner(four) -> None:
    for key in ("collapse", "mask_by_length", "lr_scale"):
        lines = [
            t
            for t in figures.all_figures(four)[key]["data"]
            if t.get("mode") == "lines+markers" and _setting_of(t, four) is not None
        ]
        assert len(lines) == 4, key
        assert len({t["line"]["dash"] for t in lines}) == 4, key
        assert len({t["marker"]["symbol"] for t in lines}) == 4, key
        widths = [t["line"]["width"] for t in lines]
        sizes = [t["marker"]["size"] for t in lines]
        assert widths == sorted(widths, reverse=True) and widths[0] > widths[-1], key
        assert sizes == sorted(sizes, reverse=True) and sizes[0] > sizes[-1], key
    # Deterministic by index: the same setting looks the same in another analysis.
    assert figures.style(2, 4) == figures.style(2, 4)
    assert figures.style(1, 4)["line"]["dash"] == figures.dash(1) != figures.dash(0)


def test_collapse_beyond_four_settings_is_one_panel_each(six) -> None:
    fig = figures.collapse_by_length(six)
    layout = fig["layout"]
    xaxes = sorted(k for k in layout if k.startswith("xaxis"))
    assert len(xaxes) == 6
    domains = [tuple(layout[k]["domain"]) + tuple(layout[f"y{k[1:]}"]["domain"]) for k in xaxes]
    assert len(set(domains)) == 6  # no two panels on top of each other
    for trace in fig["data"]:
        i = _setting_of(trace, six)
        if i is not None:  # each setting in its own panel
            assert trace["xaxis"] == ("x" if i == 0 else f"x{i + 1}"), trace["name"]


def _legend_outside(layout: dict) -> bool:
    legend = layout.get("legend", {})
    right = legend.get("x", 0) >= 1 and legend.get("xanchor") == "left"
    above = legend.get("y", 0) >= 1 and legend.get("yanchor") == "bottom"
    return right or above


@pytest.mark.parametrize("which", ["four", "six"])
def test_legends_sit_outside_the_plot_and_backgrounds_are_transparent(which, request) -> None:
    analysis = request.getfixturevalue(which)
    for key, fig in figures.all_figures(analysis).items():
        layout = fig["layout"]
        shown = layout.get("showlegend", len(fig["data"]) > 1)
        if shown:
            assert _legend_outside(layout), key
        for name, axis in layout.items():
            if name.startswith(("xaxis", "yaxis")) and "domain" in axis:
                assert 0 <= axis["domain"][0] <= axis["domain"][1] <= 1, (key, name)
        assert layout["paper_bgcolor"] == layout["plot_bgcolor"] == "rgba(0,0,0,0)", key
        assert "template" not in layout, key  # the app's theme or plotly.js' defaults
        text = json.dumps(fig).lower()
        for hard in ('"#fff"', '"#ffffff"', '"white"', '"#000"', '"#000000"', '"black"'):
            assert hard not in text, (key, hard)


_SNAKE = re.compile(r"\b[a-z0-9]+_[a-z0-9_]+\b")


def _words(template: str) -> str:
    """A hover template's own text: without %{...} placeholders and HTML tags."""
    return re.sub(r"<[^>]*>", " ", re.sub(r"%\{[^}]*\}", " ", template))


@pytest.mark.parametrize("which", ["four", "six"])
def test_hovers_name_quantities_not_fields(which, request) -> None:
    analysis = request.getfixturevalue(which)
    fields = set(analysis.mismatch.to_dict()) | {k for s in analysis.settings for k in s.to_dict()}
    fields |= {k for s in analysis.settings for r in s.by_length for k in r}
    tokens = {"pos": np.arange(3), "rollout": np.zeros(3), "train": np.zeros(3), "d": np.zeros(3)}
    every = _every_figure(analysis) | {
        "length": figures.length_figure({"length_hist": {"edges": [1, 2, 4], "counts": [3, 1]}}),
        "sequence": figures.sequence_figure(tokens, "one sequence"),
        "weights": figures.sequence_figure(tokens, "one", {"verl:token_tis": np.ones(3)}),
    }
    for key, fig in every.items():
        for trace in fig["data"]:
            if trace.get("hoverinfo") == "skip":
                continue
            template = trace.get("hovertemplate")
            assert template, (key, trace.get("name"))
            words = _words(template)
            # Raw field names (seq_weight_median, length_median...) are snake case; the
            # setting's own name comes in through %{fullData.name}, never spelled out.
            assert not _SNAKE.search(words), (key, words)
            assert not any(field in words for field in fields if "_" in field), key
        for name, axis in fig["layout"].items():
            if name.startswith(("xaxis", "yaxis")):
                assert not _SNAKE.search(axis.get("title", {}).get("text", "")), (key, name)


def test_the_signed_histogram_counts_match_a_float64_reference() -> None:
    chunks = [_batch(2, sigma=0.05, offset=-0.02), _batch(3, sigma=0.3)]
    whole, merged = MismatchStats(), MismatchStats()
    for chunk in chunks:
        whole.update(chunk)
        part = MismatchStats()
        part.update(chunk)
        merged.merge(part)
    got = whole.compute().signed_diff_hist
    assert merged.compute().signed_diff_hist == got

    d = np.concatenate(
        [
            (b.train.double().numpy() - b.rollout.double().numpy())[b.loss_mask.numpy()]
            for b in chunks
        ]
    )
    edges = np.asarray(got["edges"])
    per_decade = round(1 / np.log10(edges[1] / edges[0]))
    first = round((np.log10(edges[0]) + 12) * per_decade)
    for side, values in (("negative", -d[d < 0]), ("positive", d[d > 0])):
        index = np.floor((np.log10(values) + 12) * BINS_PER_DECADE).astype(int)
        index = index // (BINS_PER_DECADE // per_decade) - first
        assert index.min() >= 0 and index.max() < len(edges) - 1
        expected = np.bincount(index, minlength=len(edges) - 1)
        np.testing.assert_array_equal(got[side]["counts"], expected, err_msg=side)
        assert got[side]["underflow"] == got[side]["overflow"] == 0
    assert got["zeros"] == int((d == 0).sum()) > 0


def test_the_signed_figure_shows_an_offset_and_marks_the_mean() -> None:
    analysis = analyze(_batch(4, sigma=0.02, offset=-0.05), device="cpu")
    fig = figures.signed_diff_histogram(analysis)
    bars, mirror, mean = fig["data"]
    x, shares = np.asarray(bars["x"]), np.asarray(bars["y"])
    np.testing.assert_allclose(x, -x[::-1])  # a symmetric axis
    assert mirror["y"] == bars["y"][::-1]
    assert shares[x < 0].sum() > 3 * shares[x > 0].sum()  # the offset is visible
    d_mean = analysis.mismatch.d_mean
    assert d_mean < 0 and mean["x"][0] < 0 and f"{d_mean:+.3g}" in mean["name"]
    # Every loss token is in some bar: the shares sum to 1.
    assert shares.sum() == pytest.approx(1.0)
    ticks = fig["layout"]["xaxis"]["ticktext"]
    assert ticks[len(ticks) // 2] == "0" and len(ticks) <= 7


def test_rebin_puts_the_central_98_percent_in_40_to_80_bins() -> None:
    fine = 10 ** (np.arange(-2400, 1601) / BINS_PER_DECADE)
    rng = np.random.default_rng(0)
    for spread in (0.02, 0.1, 0.5, 2.0, 6.0):  # decades of the log-normal's sd
        values = 10 ** rng.normal(0.0, spread / 2.33, 200_000)
        counts = np.histogram(values, bins=fine)[0]
        edges, grouped = figures.rebin(fine, counts.tolist())
        assert sum(grouped) == counts.sum()
        assert 1.0 in edges  # anchored at 1
        lo, hi = binning.central_bins(grouped, 0.98)
        fine_lo, fine_hi = binning.central_bins(counts.tolist(), 0.98)
        if fine_hi - fine_lo + 1 >= 40:
            assert 40 <= hi - lo + 1 <= 80, spread
        else:  # the data is narrower than 40 fine bins: kept at full resolution
            assert hi - lo == fine_hi - fine_lo, spread


def test_weight_histograms_choose_their_bins_from_the_data(four) -> None:
    for key in ("weights", "raw"):
        for trace in figures.all_figures(four)[key]["data"]:
            if not trace["x"]:
                continue
            shares = [c[2] for c in trace["customdata"][:-1]]
            lo, hi = binning.central_bins(shares, 0.98)
            i = _setting_of(trace, four)
            fine = getattr(four.settings[i], f"{'weight' if key == 'weights' else 'raw'}_hist")
            fine_lo, fine_hi = binning.central_bins(fine["counts"], 0.98)
            assert hi - lo + 1 <= 80, (key, trace["name"])
            assert hi - lo + 1 >= min(40, fine_hi - fine_lo + 1), (key, trace["name"])
            # A density: the shares over the bins' widths in decades.
            x, y = trace["x"], trace["y"]
            assert y[0] == pytest.approx(shares[0] / np.log10(x[1] / x[0]))


def test_page_figure_sets_drop_what_carries_no_information() -> None:
    one_step = analyze(_batch(5, steps=1), SETTINGS[:2], device="cpu")
    assert len(one_step.source["steps"]) == 1
    assert "by_step" not in figures.mismatch_figures(one_step)
    assert "lr_scale" not in figures.setting_figures(one_step)
    assert list(figures.mismatch_figures(one_step))[:2] == ["signed_diff", "abs_diff"]
    assert "joint" not in figures.all_figures(one_step)
    assert figures.setting_figures(analyze(_batch(5), device="cpu")) == {}


@pytest.mark.parametrize("n", range(5, 25))
def test_every_grid_of_panels_lies_within_the_figure(six, n) -> None:
    """Panel domains in [0, 1] for any number of settings: plotly refuses -2.8e-17 (the
    bottom of a grid's last row, in float arithmetic), which broke Compare at 17 settings."""
    settings = [six.settings[i % len(six.settings)] for i in range(n)]
    analysis = dataclasses.replace(six, settings=settings)
    fig = figures.collapse_by_length(analysis)
    for key, axis in fig["layout"].items():
        if key.startswith(("xaxis", "yaxis")):
            low, high = axis["domain"]
            assert 0.0 <= low < high <= 1.0, (n, key, axis["domain"])


def _labelled(axis: dict, low: float, high: float) -> list[float]:
    """The values plotly.js labels on a log axis over 10^low to 10^high: its listed ticks, or
    one every `dtick` decades from tick0 = 0 (none known otherwise: plotly's own choice, or
    1-2-5 times the decades, whose 2 and 5 it draws smaller)."""
    if axis.get("tickmode") == "array":
        values = axis["tickvals"]
    elif isinstance(axis.get("dtick"), int) and axis.get("tick0") == 0:
        ks = range(math.floor(low) - 1, math.ceil(high) + 2)
        values = [10.0**k for k in ks if k % axis["dtick"] == 0]
    else:
        return []
    return [v for v in values if 10**low * (1 - 1e-9) <= v <= 10**high * (1 + 1e-9)]


@pytest.mark.parametrize("decades", [0.02, 0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.8, 1.0, 1.2, 1.5,
                                     1.6, 1.9, 2.2, 2.6, 3.1, 4.5, 7.0, 13.0])  # fmt: skip
def test_log_axes_label_at_least_3_values_whatever_the_span(decades) -> None:
    """A span of 1.5 decades showed one label (whole decades only), 0.6 decades one or two
    (1-2-5 only); none crowds past 10 labels."""
    for low in np.arange(-7.0, 3.0, 0.07):
        high = low + decades
        axis = axes.axis_layout("w", log=True, span=(10**low, 10**high))
        shown = _labelled(axis, low, high)
        assert 3 <= len(shown) <= 10, (low, decades, axis.get("dtick"), shown)


def test_per_sequence_weights_within_a_decade_get_3_labels(four) -> None:
    """Compare's per-sequence weight chart with weights from 0.25 to 2: its y-axis, whole
    decades across 1.5 decades, showed a single label (1)."""
    narrow = [
        dataclasses.replace(s, by_length=[r | {"seq_weight_p10": 0.25, "seq_weight_median": 1.0,
                                               "seq_weight_p90": 2.0} for r in s.by_length])
        for s in four.settings
    ]  # fmt: skip
    fig = figures.collapse_by_length(dataclasses.replace(four, settings=narrow))
    axis = fig["layout"]["yaxis"]
    low, high = axis["range"]
    assert high - low == pytest.approx(1.5, abs=0.01)
    assert len(_labelled(axis, low, high)) >= 3, axis


@pytest.mark.parametrize("n", [10, 17, 31, 40, 60])
def test_no_two_settings_look_alike_up_to_60(n) -> None:
    """Color and dash, and color and marker, differ between any two of n settings; with 6
    dashes and 10 colors, settings 30 apart looked the same, and 10 apart had one marker."""
    looks = [figures.style(i, n) for i in range(n)]
    assert len({(s["line"]["color"], s["line"]["dash"]) for s in looks}) == n
    assert len({(s["marker"]["color"], s["marker"]["symbol"]) for s in looks}) == n
    # The first ten look as they always did.
    for i in range(min(n, 10)):
        assert figures.color(i) == figures.PALETTE[i]
        assert figures.dash(i) == figures.DASHES[i % len(figures.DASHES)]
        assert figures.symbol(i) == figures.SYMBOLS[i]


def test_a_setting_named_after_its_framework_is_named_once(four) -> None:
    """A framework's default setting is named after it: "trl", not "trl (trl)"."""
    first = four.settings[0]
    trl = dataclasses.replace(first, name="trl", framework="trl")
    assert figures.setting_name(trl) == "trl"
    assert figures.setting_name(dataclasses.replace(trl, name="mine")) == "mine (trl)"
    renamed = [dataclasses.replace(first, name=first.framework), *four.settings[1:]]
    analysis = dataclasses.replace(four, settings=renamed)
    names = [t["name"] for t in figures.mask_rates(analysis)["data"]]
    assert names[0] == four.settings[0].framework
    assert names[1] == f"{four.settings[1].name} ({four.settings[1].framework})"


@pytest.mark.parametrize("steps", [2, 3, 20])
def test_step_axes_tick_whole_steps_only(steps) -> None:
    """With 2 steps, auto ticks fell at halves and read "-1, -1, 0, 1, 1"."""
    analysis = analyze(_batch(steps=steps), ["verl:decoupled_token_is"])
    axis = figures.lr_scale_by_step(analysis)["layout"]["xaxis"]
    assert axis["tickmode"] == "linear" and axis["tick0"] == 0
    assert isinstance(axis["dtick"], int) and axis["dtick"] >= 1
    assert (steps - 1) / axis["dtick"] <= 8  # not crowded


def test_names_from_a_config_or_a_dump_are_plain_text(four) -> None:
    """Plotly renders a subset of HTML in titles, legends and labels: a setting named
    `<b>x</b>` or a sequence id `<a href=...>` must show as written, not as markup."""
    hostile = "<a href='http://e.com'>x</a> & <b>y</b>"
    settings = [dataclasses.replace(s, name=hostile) for s in four.settings]
    analysis = dataclasses.replace(four, settings=settings)
    spec = json.dumps(figures.all_figures(analysis))
    assert "<a href" not in spec and "<b>y" not in spec
    assert "&lt;a href='http://e.com'&gt;x&lt;/a&gt; &amp; &lt;b&gt;y&lt;/b&gt;" in spec
    tokens = {"pos": [0, 1], "rollout": [-1.0, -1.0], "train": [-1.0, -1.1], "d": [0.0, -0.1]}
    fig = figures.sequence_figure(tokens, f"Sequence {hostile}", {hostile: [1.0, 1.0]})
    assert "<a href" not in json.dumps(fig)
    assert "<a href" not in json.dumps(_tune(5, 1, {hostile: 3}))


# ------------------------------------------------------------------ a run's figures per step


def _smoothed_reference(values: list, weight: float) -> list:
    """TensorBoard's debiased moving average in closed form, in float64: the n-th value
    present is the average of the values present so far, the k-th of them weighted
    (1 - w) w^(n-k), over the sum of those weights, 1 - w^n; a missing value stays missing."""
    present = [(i, v) for i, v in enumerate(values) if v is not None and np.isfinite(v)]
    out = list(values)
    for n, (i, _) in enumerate(present, start=1):
        x = np.array([v for _, v in present[:n]], dtype=np.float64)
        w = (1 - weight) * weight ** np.arange(n - 1, -1, -1, dtype=np.float64)
        out[i] = float((w * x).sum() / w.sum())
    return out


@pytest.mark.parametrize("weight", [0.0, 0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("seed", [0, 1])
def test_smoothing_is_tensorboards_debiased_moving_average(weight, seed) -> None:
    rng = np.random.default_rng(seed)
    values = rng.lognormal(-6, 2, 60).tolist()
    values[7] = values[30] = None  # a step without the value: a gap, not a zero
    values[31] = math.nan
    got = figures.smooth(values, weight)
    want = _smoothed_reference(values, weight)
    assert [g is None for g in got] == [v is None for v in want]
    kept = [i for i, v in enumerate(want) if v is not None and v == v]
    assert np.allclose([got[i] for i in kept], [want[i] for i in kept], rtol=1e-12, atol=0)
    assert math.isnan(got[31])
    if weight == 0:
        assert got == values
    # The first value is itself (debiased: not pulled toward 0); a constant stays constant.
    assert got[0] == pytest.approx(values[0], rel=1e-15)
    assert figures.smooth([3e-4] * 5, weight) == [3e-4] * 5


@pytest.mark.parametrize("weight", [-0.1, 1.0, 1.5])
def test_a_smoothing_weight_outside_0_to_1_is_refused(weight) -> None:
    with pytest.raises(IscoreError, match="smoothing weight to be in"):
        figures.smooth([1.0, 2.0], weight)


@pytest.mark.parametrize(
    ("values", "log"),
    [
        ([1e-4, 2e-4, 3e-2], True),  # 2.5 decades
        ([1e-4, 5e-3], False),  # 1.7 decades
        ([1e-3, 1e-1], False),  # exactly 2: not more
        ([1e-3, None, 2e-1, math.nan], True),  # missing values do not count
        ([0.0, 1e-5, 0.3], False),  # a zero cannot sit on a log axis
        ([-1e-3, 1e-5, 0.3], False),
        ([0.5], False),
        ([], False),
    ],
)
def test_the_y_axis_is_logarithmic_where_positive_values_span_over_2_decades(values, log):
    assert figures.log_axis(values) is log


HOSTILE = "<a href='http://e.com'>x</a> & <b>y</b>"


def _trend(k3: list[float], events=(), settings=("mine",)) -> Trend:
    """A hand-made trend: k3 per step (steps 10, 11, ...), 2 broken sequences at step 12, and
    per setting an LR scale falling from 1."""
    prefixes = tuple(f"s{i}" for i in range(len(settings)))
    rows = []
    for i, value in enumerate(k3):
        row = {"step": 10 + i, "healthy_k3": value, "k3": value, "broken_sequences": 0}
        row["healthy_ratio_mean"] = 1.0 + 1e-3 * i
        for j, prefix in enumerate(prefixes):
            row[f"{prefix}_lr_scale"] = 1.0 - 0.01 * i * (j + 1)
            row[f"{prefix}_token_masked_fraction"] = 0.0
        rows.append(row)
    if len(rows) > 2:
        rows[2]["broken_sequences"] = 2
    return Trend(tuple(rows), prefixes, tuple(settings), Baseline.of(k3), tuple(events))


def test_a_metric_is_drawn_faint_behind_its_smoothing() -> None:
    k3 = [1e-4, 1.2e-4, 0.9e-4, 1.1e-4, 3e-4, 1e-3, 4e-3, 2e-2, 5e-2]
    fig = figures.trend_figure(_trend(k3), "healthy_k3", smoothing=0.6)
    raw, smoothed = fig["data"][:2]
    assert raw["x"] == list(range(10, 19)) and raw["y"] == k3
    assert raw["opacity"] < 1 and "opacity" not in smoothed
    assert raw["mode"] == "lines+markers" and smoothed["mode"] == "lines"  # a click: a value
    assert smoothed["y"] == pytest.approx(_smoothed_reference(k3, 0.6), rel=1e-12)
    assert fig["layout"]["yaxis"]["type"] == "log"  # 2.7 decades
    # Unsmoothed (the report's): one line, as it is.
    (line, broken, events) = figures.trend_figure(_trend(k3), "healthy_k3")["data"]
    assert line["y"] == k3 and "opacity" not in line
    assert broken["x"] == [12] and broken["customdata"] == [2]
    assert events["x"] == []
    # A flat run stays on a linear axis, the early band marked.
    flat_trend = _trend([1e-4, 1.3e-4, 0.8e-4, 1.1e-4])
    flat, flat_band = figures.trend_figure(flat_trend, "healthy_k3"), flat_trend.band
    assert flat["layout"]["yaxis"]["type"] == "linear"
    labels = [s["label"].get("text") for s in flat["layout"]["shapes"]]
    assert labels == [f"median of {flat_band.early}", "the early band's edge"]


def test_each_event_is_marked_where_it_begins_with_what_changed_on_hover() -> None:
    events = (
        Event("growth", 13, "healthy_k3", "k3 rose " + "far above the band " * 10),
        Event("setting_degrades", 13, "s0_lr_scale", f"{HOSTILE} misses them", HOSTILE),
        Event("offset", 15, "healthy_ratio_mean", "<e^d> = 1.01"),
    )
    trend = _trend([1e-4, 1.1e-4, 0.9e-4, 5e-4, 1e-3, 2e-3], events, settings=(HOSTILE,))
    for column, fig in figures.trend_figures(trend, smoothing=0.5).items():
        lines = [s for s in fig["layout"]["shapes"] if s.get("yref") == "paper"]
        assert [s["x0"] for s in lines] == [13, 15], column
        assert lines[0]["label"]["text"] == "growth, setting degrades"
        (markers,) = [t for t in fig["data"] if t["name"] == "events"]
        assert markers["x"] == [13, 15] and markers["yaxis"] == "y2"
        assert fig["layout"]["yaxis2"]["overlaying"] == "y"
        assert markers["y"] == [1.0, 1.0] and fig["layout"]["yaxis2"]["range"] == [0, 1]
        first, second = markers["hovertext"]
        assert first.startswith("<b>The mismatch began to grow</b> from step 13<br>found in ")
        assert "<b>A setting stopped meeting the targets</b> from step 13" in first
        assert "found in s0_lr_scale<br>&lt;a href=" in first  # as plain text
        assert max(len(line) for line in first.split("<br>")) < 120  # wrapped
        assert "&lt;e^d&gt; = 1.01" in second
        assert "<a href" not in json.dumps(fig) and "<e^d>" not in json.dumps(fig)


def test_each_setting_is_a_line_in_its_style_with_its_raw_values_faint() -> None:
    names = ("first", "second", "third")
    trend = _trend([1e-4] * 6, settings=names)
    fig = figures.setting_trend_figure(trend, "lr_scale", smoothing=0.8)
    drawn = [t for t in fig["data"] if t["name"] != "events"]
    assert len(drawn) == 6
    for i, name in enumerate(names):
        raw, smoothed = drawn[2 * i : 2 * i + 2]
        assert raw["name"] == smoothed["name"] == name
        assert raw["legendgroup"] == smoothed["legendgroup"] == str(i)
        assert raw["showlegend"] is False and "showlegend" not in smoothed
        assert smoothed["line"] == figures.style(i, 3)["line"]
        assert raw["line"]["color"] == figures.color(i) and raw["opacity"] < 1
        values = [1.0 - 0.01 * k * (i + 1) for k in range(6)]
        assert raw["y"] == values
        assert smoothed["y"] == pytest.approx(_smoothed_reference(values, 0.8), rel=1e-12)
    assert fig["layout"]["yaxis"]["type"] == "linear"
    assert [s["y0"] for s in fig["layout"]["shapes"]] == [1.0]  # uncorrected
    assert fig["layout"]["showlegend"] is True
    # Every setting statistic, after every diagnostic; none without settings.
    keys = list(figures.trend_figures(trend))
    assert keys == [m.column for m in (*figures.DIAGNOSTICS, *figures.SETTING_METRICS)]
    assert list(figures.trend_figures(_trend([1e-4] * 3, settings=()))) == [
        m.column for m in figures.DIAGNOSTICS
    ]


def test_trend_figures_keep_to_the_house_style(four) -> None:
    """Legends outside the plot, transparent backgrounds, whole steps on the step axis."""
    for column, fig in figures.trend_figures(four.trend).items():
        layout = fig["layout"]
        if layout["showlegend"]:
            assert _legend_outside(layout), column
        assert layout["paper_bgcolor"] == layout["plot_bgcolor"] == "rgba(0,0,0,0)", column
        assert layout["xaxis"]["tickformat"] == "d" and layout["xaxis"]["dtick"] >= 1, column


# ------------------------------------------------------------------ several runs overlaid


def test_runs_are_overlaid_a_colour_each_their_names_as_text() -> None:
    """The app's runs on one figure: a line per run in the i-th setting's style, named as
    plotly text (a run named from an upload cannot inject markup), k3 per step only where a
    run has two steps."""
    bf16, drift = analyze("data/dense_bf16.parquet", []), analyze("data/drift.parquet", [])
    runs = {"<b>bf16</b>": bf16, "drift": drift}
    drawn = figures.runs_mismatch_figures(runs)
    assert list(drawn) == ["abs_diff", "by_prob", "by_step"]
    for figure in drawn.values():
        names = [t["name"] for t in figure["data"]]
        assert names == ["&lt;b&gt;bf16&lt;/b&gt;", "drift"]
        assert [t["line"]["color"] for t in figure["data"]] == [figures.color(0), figures.color(1)]
    by_step = drawn["by_step"]["data"]
    assert by_step[1]["x"] == [r["step"] for r in drift.mismatch.by_step]
    assert by_step[1]["y"] == [r["k3"] for r in drift.mismatch.by_step]
    one_step = analyze("data/fp8.parquet", [])
    assert "by_step" not in figures.runs_mismatch_figures({"a": one_step, "b": one_step})

    trends = figures.runs_trend_figures({"bf16": bf16.trend, "drift": drift.trend}, 0.6)
    assert list(trends) == [m.column for m in figures.DIAGNOSTICS]
    lines = [t for t in trends["k3"]["data"] if t.get("legendgroup")]
    assert {t["name"] for t in lines} == {"bf16", "drift"}  # raw and smoothed, per run
    assert len(trends["k3"]["data"][-1]["x"]) == 0  # no events marked: each run has its own
