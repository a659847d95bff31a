"""The Tune page: sliders are Tuner queries; the tuned setting joins the Compare list."""

from __future__ import annotations

import json

from streamlit.testing.v1 import AppTest

from tests.app.conftest import metric, no_exception, plain


def _slider_value(at: AppTest, index: int) -> float:
    return float(at.select_slider[0].options[index])


def test_moving_the_cap_changes_the_read_outs(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/tune.py").run()
    no_exception(at)
    assert at.select_slider[0].value == 2.0  # the family's default is on the grid
    truncated = metric(at, "Tokens truncated")
    at.select_slider[0].set_value(_slider_value(at, 3)).run()
    assert metric(at, "Tokens truncated") != truncated
    curve = json.loads(at.get("plotly_chart")[0].proto.spec)
    marker = curve["layout"]["shapes"][0]
    assert marker["x0"] == at.select_slider[0].value
    assert curve["layout"]["xaxis"]["type"] == "log"


def test_sequence_families_and_use_this_setting(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/tune.py").run()
    at.selectbox(key="_w_tune_family").set_value("geometric_mask").run()
    no_exception(at)
    assert len(at.select_slider) == 2
    assert metric(at, "Sequences masked") != "n/a"
    at.selectbox(key="tune_framework").set_value("skyrl").run()
    next(b for b in at.button if b.label == "Use this setting").click().run()
    no_exception(at)
    assert "to the Compare list" in plain(at.success[0].value)
    assert at.session_state.settings[0].framework == "skyrl"

    at.switch_page("pages/compare.py").run()
    no_exception(at)
    assert at.multiselect[0].value == ["skyrl:geometric_mask_0.999_1.001"]
    assert len(at.dataframe[0].value) == 1


def test_slider_values_survive_a_page_switch(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/tune.py").run()
    chosen = _slider_value(at, 5)
    at.select_slider[0].set_value(chosen).run()
    at.switch_page("pages/data.py").run()
    at.switch_page("pages/tune.py").run()
    assert at.select_slider[0].value == chosen
