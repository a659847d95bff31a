"""The Compare page: presets, pasted configs and built settings side by side."""

from __future__ import annotations

import json
from dataclasses import replace

from streamlit.testing.v1 import AppTest

from iscore import load
from iscore.advice.recommendation import recommend
from iscore.present.figures import color
from tests.app.conftest import DATA, no_exception, open_path, plain


def _compare(at: AppTest, *settings: str) -> AppTest:
    at.switch_page("pages/compare.py").run()
    return at.multiselect[0].set_value(list(settings)).run()


def test_two_presets_side_by_side(loaded: AppTest) -> None:
    at = _compare(loaded, "verl:decoupled_geo_rs", "skyrl:skyrl_token_tis")
    no_exception(at)
    table = at.dataframe[0].value
    assert list(table["setting"]) == ["decoupled_geo_rs (verl)", "skyrl_token_tis (skyrl)"]
    charts = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    assert len(charts) == 4  # one training step: no per-step figure
    weights = charts[0]
    assert [t["line"]["color"] for t in weights["data"]] == [color(0), color(1)]
    assert weights["layout"]["xaxis"]["type"] == "log"


def test_paste_a_config_and_see_its_errors(loaded: AppTest) -> None:
    at = _compare(loaded, "verl:decoupled_geo_rs")
    at.text_area[0].input(
        "framework: verl\nname: my_tis\nalgorithm:\n  rollout_correction:\n"
        "    rollout_is: token\n    rollout_is_threshold: 3.0\n"
    )
    next(b for b in at.button if b.label == "Add this config").click().run()
    no_exception(at)
    assert "Added verl:my_tis" in plain(at.success[0].value)
    assert at.multiselect[0].value == ["verl:decoupled_geo_rs", "verl:my_tis"]
    assert len(at.dataframe[0].value) == 2

    bad = "framework: verl\nalgorithm: {rollout_correction: {rollout_is: x}}"
    at.text_area[0].input(bad)
    next(b for b in at.button if b.label == "Add this config").click().run()
    no_exception(at)
    assert "rollout_is" in plain(at.error[0].value)
    # Shown in the panel, under the text to fix, which stays as typed.
    assert at.expander[0].error[0].value == at.error[0].value
    assert at.text_area[0].value == bad
    at.text_area[0].input("framework: [verl")
    next(b for b in at.button if b.label == "Add this config").click().run()
    assert "not valid YAML" in plain(at.error[0].value)


def test_build_a_setting_for_a_framework(loaded: AppTest) -> None:
    at = _compare(loaded)
    at.selectbox(key="build_framework").set_value("trl").run()
    at.selectbox(key="build_family").set_value("icepop").run()
    at.number_input(key="build_icepop_upper").set_value(3.0).run()
    next(b for b in at.button if b.label == "Add this setting").click().run()
    no_exception(at)
    assert at.multiselect[0].value == ["trl:icepop_0.5_3"]
    assert len(at.dataframe[0].value) == 1


def test_build_a_prime_rl_trust_region(loaded: AppTest) -> None:
    """prime-rl's DPPO band is built by its two bounds (the tab raised a KeyError while
    prime-rl had no method to offer) and replays on the sample's advantages."""
    at = _compare(loaded)
    at.selectbox(key="build_framework").set_value("prime_rl").run()
    no_exception(at)
    assert at.selectbox(key="build_family").options == [
        "DPPO trust region (by the advantage's sign)",
        "IPO trust region",
    ]
    at.number_input(key="build_dppo_high").set_value(0.1).run()
    next(b for b in at.button if b.label == "Add this setting").click().run()
    no_exception(at)
    assert at.multiselect[0].value == ["prime_rl:dppo_0.2_0.1"]
    assert len(at.dataframe[0].value) == 1


def test_a_setting_the_dump_cannot_replay_is_removed_with_a_reason(loaded: AppTest) -> None:
    at = _compare(loaded, "verl:decoupled_geo_rs", "verl:bypass_pg_is")
    no_exception(at)
    assert "policy_logprob" in plain(at.warning[0].value)
    assert at.multiselect[0].value == ["verl:decoupled_geo_rs"]


def test_a_new_dump_brings_its_own_recommended_setting(loaded: AppTest) -> None:
    """The recommended setting's thresholds are placed on the dump: opening another dump
    replaces it (it kept the first dump's cap under the same name); the user's own stay."""
    at = _compare(loaded, "verl:decoupled_token_is", "verl:recommended_token_tis", "verl:disabled")
    at.switch_page("pages/data.py").run()
    open_path(at, DATA / "offset_bug.parquet")
    no_exception(at)
    at.switch_page("pages/compare.py").run()
    no_exception(at)
    settings = {f"{s.framework}:{s.name}": s for s in at.session_state.settings}
    best = recommend(load(DATA / "offset_bug.parquet"), "verl").best
    assert settings[f"verl:recommended_{best.kind}"] == replace(
        best.spec, name=f"recommended_{best.kind}"
    )
    assert "verl:disabled" in settings  # the user's own
    assert not any(name.endswith("_2") for name in settings)  # no renamed duplicate
