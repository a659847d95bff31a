"""The Tune page: sliders are Tuner queries over the data's quantiles, opening on the
recommended setting; the tuned setting joins the Compare list."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

import iscore
from iscore import frameworks
from iscore.advice.recommendation import recommend
from iscore.advice.tuning import FAMILIES, family_of, family_spec
from iscore.stats.setting import quick_stats
from tests.app.conftest import DATA, metric, no_exception, plain


def _tune(at: AppTest) -> AppTest:
    at.switch_page("pages/tune.py").run()
    no_exception(at)
    return at


def _chart(at: AppTest, index: int = 0) -> dict:
    return json.loads(at.get("plotly_chart")[index].proto.spec)


def test_opens_on_the_recommended_setting_with_marks(loaded: AppTest) -> None:
    at = _tune(loaded)
    family, values = family_of(recommend(iscore.load(DATA / "fp8.parquet"), "verl").best.spec)
    assert at.selectbox(key="_w_tune_family").value == family
    assert [s.value for s in at.select_slider] == list(values)
    # The curve is drawn as the slider is: one step per value; the chosen value, the
    # framework's own setting and the recommended one are marked.
    curve = _chart(at)
    options = [float(o) for o in at.select_slider[0].options]
    assert curve["data"][0]["x"] == list(range(len(options)))
    labels = [s.get("label", {}).get("text") for s in curve["layout"]["shapes"]]
    assert "recommended" in labels and any(str(t).startswith("verl ") for t in labels)


def test_moving_the_slider_changes_the_read_outs(loaded: AppTest) -> None:
    at = _tune(loaded)
    at.selectbox(key="_w_tune_family").set_value("token_tis").run()
    truncated = metric(at, "Tokens truncated")
    options = [float(o) for o in at.select_slider[0].options]
    at.select_slider[0].set_value(options[3]).run()
    no_exception(at)
    assert metric(at, "Tokens truncated") != truncated
    chosen = _chart(at)["layout"]["shapes"][-2]
    assert chosen["x0"] == 3


def test_sequence_families_and_use_this_setting(loaded: AppTest) -> None:
    at = _tune(loaded)
    at.selectbox(key="_w_tune_framework").set_value("skyrl").run()
    at.selectbox(key="_w_tune_family").set_value("geometric_mask").run()
    no_exception(at)
    assert len(at.select_slider) == 2
    assert metric(at, "Sequences masked") != "n/a"
    lower, upper = (s.value for s in at.select_slider)
    next(b for b in at.button if b.label == "Use this setting").click().run()
    no_exception(at)
    assert "is in Compare and Export" in plain(at.success[0].value)
    added = at.session_state.settings[-1]
    assert added.framework == "skyrl"
    assert family_of(added) == ("geometric_mask", (lower, upper))

    at.switch_page("pages/compare.py").run()
    no_exception(at)
    assert at.multiselect[0].value[-1] == f"skyrl:{added.name}"
    assert len(at.dataframe[0].value) == len(at.session_state.settings)


def test_a_mask_that_keeps_the_step_size_says_why(loaded: AppTest) -> None:
    """verl's rejection leaves its token count: dropping tokens keeps LR scale ~1, and the
    page says so beside the read-outs."""
    at = _tune(loaded)
    at.selectbox(key="_w_tune_family").set_value("token_tis").run()  # drops no token
    assert not any("divides by the tokens it keeps" in c.value for c in at.caption)
    at.selectbox(key="_w_tune_family").set_value("geometric_mask").run()
    lower = at.select_slider[0]
    lower.set_value(float(lower.options[len(lower.options) // 2])).run()
    no_exception(at)
    dropped = metric(at, "Tokens with weight 0")
    assert dropped != "0.00%"
    assert any(
        f"divides by the tokens it keeps, so dropping {dropped} of them" in c.value
        for c in at.caption
    )


def test_slider_values_survive_a_page_switch(loaded: AppTest) -> None:
    at = _tune(loaded)
    chosen = float(at.select_slider[0].options[5])
    at.select_slider[0].set_value(chosen).run()
    at.switch_page("pages/data.py").run()
    _tune(at)
    assert at.select_slider[0].value == chosen


@pytest.mark.parametrize("framework", [fw.name for fw in frameworks.every() if fw.families])
def test_tune_reads_what_compare_shows(loaded: AppTest, framework: str) -> None:
    # For every framework and one family of each, the Tune page's LR scale, ESS and mask rate
    # equal what the Compare page's table shows for the same setting.
    at = _tune(loaded)
    at.selectbox(key="_w_tune_framework").set_value(framework).run()
    family = at.selectbox(key="_w_tune_family").value
    values = [s.value for s in at.select_slider]
    tuned = {
        "LR scale": metric(at, "LR scale"),
        "ESS": metric(at, "ESS"),
        "Tokens with weight 0": metric(at, "Tokens with weight 0"),
    }
    spec = family_spec(family, values, framework)
    at.session_state.settings = [spec]
    at.switch_page("pages/compare.py").run()
    no_exception(at)
    row = at.dataframe[0].value.iloc[0]
    # The table shows formatted numbers: compare at the Tune metric's precision.
    assert f"{row['LR scale']:.4g}" == tuned["LR scale"]
    assert f"{row['ESS']:.1%}" == tuned["ESS"]
    if framework != "trl" or FAMILIES[family].statistic != "product":
        assert f"{row['tokens masked']:.2%}" == tuned["Tokens with weight 0"]
    # With its per-sequence columns, as the app opens it: prime-rl's DPPO sides by the advantage.
    batch = iscore.Dump(DATA / "fp8.parquet", extras=True).load()
    assert quick_stats(batch, spec).lr_scale == pytest.approx(float(tuned["LR scale"]), rel=1e-3)


def test_a_method_opens_on_its_recommended_setting(loaded: AppTest) -> None:
    """The geometric mask opened at [0.999, 1.001], which drops 99.6% of fp8's tokens, while
    the recommended band drops none; with nothing kept, the page says there is no gradient."""
    at = _tune(loaded)
    at.selectbox(key="_w_tune_family").set_value("geometric_mask").run()
    no_exception(at)
    rec = recommend(iscore.load(DATA / "fp8.parquet"), "verl")
    geo = next(c for c in rec.candidates if c.kind == "geo_mask")
    lower, upper = family_of(geo.spec)[1]
    sliders = at.select_slider
    assert sliders[0].value <= lower * 1.001 and sliders[1].value >= upper / 1.001
    assert metric(at, "Tokens with weight 0") == "0.00%"
    assert not at.warning
    at.selectbox(key="_w_tune_family").set_value("k3_mask").run()
    at.select_slider[0].set_value(float(at.select_slider[0].options[0])).run()  # below all
    no_exception(at)
    assert metric(at, "Tokens with weight 0") == "100.00%"
    assert "no gradient is left" in at.warning[0].value
    assert not any("divides by the tokens it keeps" in c.value for c in at.caption)


def test_prime_rl_without_advantages_offers_ipo_and_says_why_not_dppo(at: AppTest) -> None:
    import pyarrow.parquet as pq

    from tests.app.conftest import parquet_bytes

    table = pq.read_table(DATA / "fp8.parquet").drop_columns(["advantage"])
    at.file_uploader[0].upload("fp8.parquet", parquet_bytes(table), "application/octet-stream")
    at.run()
    no_exception(at)
    at = _tune(at)
    at.selectbox(key="_w_tune_framework").set_value("prime_rl").run()
    no_exception(at)
    assert at.selectbox(key="_w_tune_family").options == ["IPO trust region"]
    why = "DPPO trust region (by the advantage's sign): needs the dump's `advantage` column"
    assert any(why in plain(c.value) for c in at.caption)
    assert metric(at, "Tokens with weight 0").endswith("%")
