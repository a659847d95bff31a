"""The app's own figures (`iscore.figures`): plain plotly specs built from small tables."""

from __future__ import annotations

import numpy as np
import pytest

from iscore import figures
from iscore.tune import TuneResult


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
