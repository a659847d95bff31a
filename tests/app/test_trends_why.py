"""The Trends page's split of a metric's change (`iscore why`, docs/why.md): between two steps
picked, or at one of the run's events (from the step before it); the sentence, each factor's
composition and within, one factor's bins as a figure and a table, all `iscore.why`'s."""

from __future__ import annotations

import json

import pytest
from streamlit.testing.v1 import AppTest

import iscore
from iscore.advice import share_of
from tests.app.conftest import DATA, no_exception, open_path, plain

DRIFT = DATA / "drift.parquet"


def _figure(at: AppTest, title: str) -> dict:
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    return next(f for f in specs if f["layout"]["title"]["text"] == title)


def _sentence(at: AppTest, start: str) -> str:
    return next(plain(m.value) for m in at.markdown if plain(m.value).startswith(start))


@pytest.fixture
def drift(at: AppTest) -> AppTest:
    """data/drift.parquet (4 steps, k3 growing 1.5x a step) open, on the Trends page."""
    return open_path(at, DRIFT).switch_page("pages/trends.py").run()


def test_two_steps_are_split_as_iscore_why_splits_them(drift: AppTest) -> None:
    at = drift
    no_exception(at)
    assert at.selectbox(key="why_from").value == 0 and at.selectbox(key="why_to").value == 3
    expected = iscore.why(DRIFT, 0, 3)
    assert _sentence(at, "k3 rose") == expected.sentence
    by = _figure(at, "k3 from step 0 to step 3, by factor")
    composition, within = by["data"]
    assert composition["x"] == [s.title for s in expected.by]
    assert composition["y"] == pytest.approx(
        [share_of(s.composition, expected.change) for s in expected.by]
    )
    assert [c + w for c, w in zip(composition["y"], within["y"], strict=True)] == pytest.approx(
        [1.0] * len(expected.by)
    )
    # The best factor's bins first: its figure and its table.
    best = expected.best
    assert at.selectbox(key="why_by").value == best.title
    bins = _figure(at, f"By {best.title}: each bin's terms and its share of the tokens")
    assert bins["data"][0]["x"] == [b.label for b in best.bins]
    table = at.dataframe[-1].value
    assert list(table["bin"]) == [b.label for b in best.bins]
    assert sum(table["composition"]) + sum(table["within"]) == pytest.approx(1.0)


def test_an_event_splits_from_the_step_before_it(drift: AppTest) -> None:
    at = drift
    (event,) = [o for o in at.selectbox(key="why_at").options if o.startswith("Step ")]
    assert event.startswith("Step 2: The mismatch began to grow")
    at.selectbox(key="why_at").select(event).run()
    no_exception(at)
    assert _sentence(at, "k3 rose") == iscore.why(DRIFT, 1, 2).sentence
    _figure(at, "k3 from step 1 to step 2, by factor")


def test_another_metric_and_factor_and_the_same_step_twice(drift: AppTest) -> None:
    at = drift
    at.selectbox(key="why_by").select("position").run()
    _figure(at, "By position: each bin's terms and its share of the tokens")
    at.selectbox(key="_w_why_metric").select("abs_diff_mean").run()
    no_exception(at)
    assert (
        _sentence(at, "abs_diff_mean rose")
        == iscore.why(DRIFT, 0, 3, metric="abs_diff_mean").sentence
    )
    at.selectbox(key="why_to").select(0).run()
    assert any("Pick two different steps" in i.value for i in at.info)
