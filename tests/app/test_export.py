"""The Export page: a setting as any framework's config, and the report downloads."""

from __future__ import annotations

import yaml
from streamlit.testing.v1 import AppTest

import iscore
from iscore.advice.recommendation import recommend
from iscore.frameworks.resolve import parse_config
from tests.app.conftest import DATA, no_exception


def _with_settings(at: AppTest, *settings: str) -> AppTest:
    at.switch_page("pages/compare.py").run()
    at.multiselect[0].set_value(list(settings)).run()
    return at.switch_page("pages/export.py").run()


def _downloads(at: AppTest) -> list[str]:
    return [button.proto.label for button in at.get("download_button")]


def test_snippet_and_downloads(loaded: AppTest) -> None:
    at = _with_settings(loaded, "verl:decoupled_geo_rs")
    no_exception(at)
    snippet = at.code[0].value
    assert "rollout_correction" in snippet
    spec = parse_config({"framework": "verl", **yaml.safe_load(snippet)})
    assert spec.rs == parse_config({"framework": "verl", "preset": "decoupled_geo_rs"}).rs
    assert _downloads(at) == [
        "Download the snippet",
        "Download the iscore config",
        "HTML report",
        "Analysis JSON",
    ]


def test_as_another_framework(loaded: AppTest) -> None:
    at = _with_settings(loaded, "verl:decoupled_token_is")
    at.selectbox(key="export_to_verl:decoupled_token_is").set_value("skyrl").run()
    no_exception(at)
    # verl's threshold 2.0 is SkyRL's default clip, so the snippet leaves it out.
    snippet = at.code[0].value
    assert "tis_ratio_type: token" in snippet
    assert "clip_high" not in snippet
    spec = parse_config({"framework": "skyrl", **yaml.safe_load(snippet)})
    assert spec.tis_ratio_type == "token"
    assert spec.token_tis_ratio_clip_high == 2.0
    assert "exact translation" in at.success[0].value
    at.selectbox(key="export_to_verl:decoupled_token_is").set_value("openrlhf").run()
    no_exception(at)
    assert at.code[0].language == "bash"  # OpenRLHF is configured by its launch flags


def test_an_exact_translation_with_another_step_size_reads_as_one_message(loaded) -> None:
    """The weights are exact; slime's aggregation is a note about the loss around them, which
    the green box points to instead of contradicting it."""
    at = _with_settings(loaded, "verl:decoupled_token_is")
    at.selectbox(key="export_to_verl:decoupled_token_is").set_value("slime").run()
    no_exception(at)
    assert at.success[0].value.endswith("replay identically (see the note below).")
    note = at.info[0].value
    assert note.startswith("**Note.**") and "different step size" in note


def test_an_inexact_translation_says_what_is_lost(loaded: AppTest) -> None:
    at = _with_settings(loaded, "verl:decoupled_geo_rs")
    at.selectbox(key="export_to_verl:decoupled_geo_rs").set_value("fireworks").run()
    no_exception(at)
    assert "Not an exact translation" in at.warning[0].value
    assert "no rejection mask" in at.warning[0].value
    measured = at.dataframe[0].value
    assert list(measured.columns) == ["verl:decoupled_geo_rs", "as fireworks"]


def test_opens_on_the_recommended_setting(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/export.py").run()
    no_exception(at)
    best = recommend(iscore.load(DATA / "fp8.parquet"), "verl").best
    assert at.selectbox[0].value == f"verl:recommended_{best.kind}"
    shown = parse_config({"framework": "verl", **yaml.safe_load(at.code[0].value)})
    assert shown.replay(iscore.load(DATA / "fp8.parquet")).weight.equal(
        best.spec.replay(iscore.load(DATA / "fp8.parquet")).weight
    )


def test_reports_without_settings(loaded: AppTest) -> None:
    at = _with_settings(loaded)  # the user emptied the Compare list: it stays empty
    no_exception(at)
    assert "Compare list is empty" in at.info[0].value
    assert _downloads(at) == ["HTML report", "Analysis JSON"]


def test_a_snippet_is_shown_in_the_syntax_the_core_wrote_it_in(loaded: AppTest) -> None:
    """The page guessed the syntax from `startswith("--")`: OpenRLHF's launch flags with a
    comment first (here: nothing to set) were shown as YAML."""
    at = _with_settings(loaded, "verl:disabled")
    at.selectbox(key="export_to_verl:disabled").set_value("openrlhf").run()
    no_exception(at)
    assert at.code[0].value.startswith("# nothing to set")
    assert at.code[0].language == "bash"
