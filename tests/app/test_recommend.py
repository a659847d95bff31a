"""The Recommend page: the user's framework's candidates ranked on the dump, and "Use this
setting" handing one to Compare, Tune and Export."""

from __future__ import annotations

import pytest
import streamlit as st
from streamlit.testing.v1 import AppTest

import iscore
from iscore.advice.recommendation import recommend
from iscore.advice.targets import Targets
from iscore.advice.tuning import family_of
from iscore.session.workspace import Workspace
from tests.app.conftest import DATA, no_exception, open_path, plain


@pytest.fixture(scope="module")
def fp8() -> iscore.TokenBatch:
    return iscore.load(DATA / "fp8.parquet")


def _recommend(at: AppTest) -> AppTest:
    at.switch_page("pages/recommend.py").run()
    no_exception(at)
    return at


def test_ranks_the_frameworks_candidates(loaded: AppTest, fp8) -> None:
    at = _recommend(loaded)
    rec = recommend(fp8, "verl")
    assert at.title[0].value == "Which verl setting?"
    table = at.dataframe[0].value
    assert len(table) == len(rec.candidates)
    assert list(table["LR scale"]) == pytest.approx([c.stats["lr_scale"] for c in rec.candidates])
    assert list(table["meets targets"]) == [c.passes for c in rec.candidates]
    assert at.selectbox(key="rec_pick_verl").value == 0
    assert "rollout_correction" in at.code[0].value
    assert "effective learning rate" in next(m for m in at.metric if m.label == "LR scale").help
    rule = next(m for m in at.markdown if m.value.startswith("**Rule:**"))
    assert rule.value == f"**Rule:** `{rec.best.rule}`" and "rho = e^d" in rule.help


def test_a_semantics_bug_gets_no_green_light(at: AppTest) -> None:
    at = _recommend(open_path(at, DATA / "offset_bug.parquet"))
    assert not at.success  # the passing pick is a warning: the bug comes first
    assert any("Fix the semantics bug first" in plain(w.value) for w in at.warning)
    clean = _recommend(open_path(AppTest.from_file(at._script_path).run(), DATA / "fp8.parquet"))
    assert clean.success and not any("semantics bug" in plain(w.value) for w in clean.warning)


def test_use_a_candidate_everywhere(loaded: AppTest, fp8) -> None:
    at = _recommend(loaded)
    rec = recommend(fp8, "verl")
    index = next(i for i, c in enumerate(rec.candidates) if c.kind == "geo_mask")
    at.selectbox(key="rec_pick_verl").set_value(index).run()
    next(b for b in at.button if b.label == "Use this setting").click().run()
    no_exception(at)
    name = "verl:recommended_geo_mask"
    assert plain(at.success[0].value) == f"{name} is in Compare, Tune and Export."
    assert [f"{s.framework}:{s.name}" for s in at.session_state.settings][-1] == name
    assert at.session_state.export_setting == name
    family, values = family_of(rec.candidates[index].spec)
    assert at.session_state.tune_family == family
    tune = at.switch_page("pages/tune.py").run()
    assert [s.value for s in tune.select_slider] == list(values)
    export = at.switch_page("pages/export.py").run()
    assert export.selectbox[0].value == name


def test_targets_rerank(loaded: AppTest, fp8) -> None:
    at = _recommend(loaded)
    at.number_input(key="t_ess").set_value(99.0)
    next(b for b in at.button if b.label == "Rank again").click().run()
    no_exception(at)
    strict = Targets(min_ess=0.99)
    assert at.session_state.targets == strict
    rec = recommend(fp8, "verl", strict)
    assert list(at.dataframe[0].value["meets targets"]) == [c.passes for c in rec.candidates]


def test_another_framework_reseeds_an_untouched_compare_list(loaded: AppTest) -> None:
    at = _recommend(loaded)
    assert [s.framework for s in at.session_state.settings] == ["verl", "verl"]
    at.selectbox(key="_w_framework").set_value("skyrl").run()
    no_exception(at)
    assert at.title[0].value == "Which SkyRL setting?"
    settings = at.session_state.settings
    assert [s.framework for s in settings] == ["skyrl", "skyrl"]
    assert settings[0].name == "skyrl_geo_mask"  # SkyRL's default


def test_a_first_ranking_cut_short_seeds_the_whole_list_on_the_next_run(
    at: AppTest, monkeypatch
) -> None:
    # Opening a dump seeds the Compare list with the framework's default and the recommended
    # setting; the ranking takes a while, and a page switch meanwhile stops that run.
    real, stopped = Workspace.recommend, []

    def cut_short(self, *args, **kwargs):
        if not stopped:
            stopped.append(True)
            st.stop()  # what a rerun does to the run it interrupts, at its next st call
        return real(self, *args, **kwargs)

    monkeypatch.setattr(Workspace, "recommend", cut_short)
    at = open_path(at, DATA / "fp8.parquet")
    at.switch_page("pages/compare.py").run()  # the first run that seeds, stopped in the ranking
    assert stopped
    at.run()  # the run that the page switch started
    no_exception(at)
    names = [s.name for s in at.session_state.settings]
    assert names == ["decoupled_token_is", "recommended_token_tis"], names
