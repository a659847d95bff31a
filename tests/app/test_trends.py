"""The Trends page: each diagnostic and each setting in Compare per step, smoothed, with the
run's events; a click on a step opens its worst sequences on Explore; and a run followed with
`iscore app DIR --follow`. That the navigation lists it right after Data, and only for more
than one step, is checked in a browser (tests/e2e/test_follow.py): after a run cut short by
`st.rerun` (opening a dump), AppTest runs a page whether the navigation lists it or not."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from iscore.dump.simulate import SimConfig, write_run
from iscore.present import figures
from tests.app.conftest import DATA, metric, new_app, no_exception, open_path, plain


def _figures(at: AppTest) -> list[dict]:
    """The per-step figures (not the split of a change, tests/app/test_trends_why.py)."""
    specs = [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]
    return [f for f in specs if f["layout"]["xaxis"]["title"]["text"] == "training step"]


@pytest.fixture
def drift(at: AppTest) -> AppTest:
    """data/drift.parquet (4 steps) open, on the Trends page."""
    return open_path(at, DATA / "drift.parquet").switch_page("pages/trends.py").run()


def test_every_diagnostic_and_every_setting_per_step(drift: AppTest) -> None:
    at = drift
    no_exception(at)
    assert metric(at, "Steps") == "4" and metric(at, "Latest step") == "3"
    drawn = _figures(at)
    columns = [*figures.DIAGNOSTICS, *figures.SETTING_METRICS]
    assert [f["layout"]["title"]["text"] for f in drawn] == [m.title for m in columns]
    # Smoothed as TensorBoard's default smooths, the raw values faint behind.
    assert at.slider[0].value == figures.SMOOTHING
    k3 = drawn[0]["data"]
    assert [t["name"] for t in k3[:2]] == ["per step", "smoothed"]
    assert k3[1]["y"] == pytest.approx(figures.smooth(k3[0]["y"], figures.SMOOTHING))
    # Each setting in Compare (the framework's default and the recommended one) a line.
    lr = drawn[len(figures.DIAGNOSTICS) + 3]
    names = {t["name"] for t in lr["data"] if t["name"] != "events"}
    assert names == {spec.name for spec in at.session_state.settings}
    at.slider[0].set_value(0.0).run()
    assert [t["name"] for t in _figures(at)[0]["data"]] == ["per step", "events"]


def test_events_are_listed_and_marked_on_every_figure(drift: AppTest) -> None:
    at = drift
    assert metric(at, "Events") == "1"  # the mismatch grows from step 2
    (listed,) = [m.value for m in at.markdown if m.value.startswith("- **Step ")]
    assert plain(listed).startswith("- **Step 2: The mismatch began to grow**: k3 (over the")
    for figure in _figures(at):
        marks = next(t for t in figure["data"] if t["name"] == "events")
        assert marks["x"] == [2] and "began to grow" in marks["hovertext"][0]
        assert [s["x0"] for s in figure["layout"]["shapes"] if s.get("yref") == "paper"] == [2]


def test_a_click_on_a_step_opens_its_worst_sequences_on_explore(drift: AppTest) -> None:
    at = drift
    at.session_state.trends_step = 2  # what a click on step 2's point leaves
    at.run()
    no_exception(at)
    assert at.title[0].value == "Explore"
    assert "FROM sequences WHERE step = 2 ORDER BY k3_sum DESC" in at.text_area[0].value
    rows = at.dataframe[0].value
    assert len(rows) and set(rows["step"]) == {2}
    assert rows["k3_sum"].is_monotonic_decreasing
    # A step outside the selected steps selects them all again, saying so.
    at.session_state.step_range = (0, 1)
    at.switch_page("pages/trends.py").run()
    at.session_state.trends_step = 3
    at.run()
    assert at.session_state.step_range is None
    assert "Step 3 lies outside the selected steps" in plain(at.warning[0].value)
    assert set(at.dataframe[0].value["step"]) == {3}


# ------------------------------------------------------------------ iscore app DIR --follow


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished run of 4 steps, whose files a test copies in as they 'land'."""
    folder = tmp_path_factory.mktemp("source") / "run"
    write_run(folder, SimConfig("dense_bf16", sequences=8, steps=4, median_len=40, seed=5))
    return folder


def _land(source: Path, run: Path, step: int) -> Path:
    name = Path(f"step_{step:06d}") / "rank_0000.parquet"
    (run / name).parent.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(source / name, run / name))


@pytest.fixture
def following(tmp_path, monkeypatch) -> tuple[Path, AppTest]:
    """`iscore app RUN --follow` on an empty folder, its results store in a temporary one."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(sys, "argv", ["main.py", "--path", str(run), "--follow", "--interval", "1"])
    return run, new_app()


def test_a_followed_run_opens_when_its_first_file_is_whole(source, following) -> None:
    run, at = following
    no_exception(at)
    assert "Waiting for the first whole step file" in plain(at.info[0].value)
    assert at.session_state.loaded is None and not at.error
    half = run / "step_000000" / "rank_0000.parquet"
    half.parent.mkdir()
    half.write_bytes((source / "step_000000" / "rank_0000.parquet").read_bytes()[:-100])
    at.run()  # what the page's look every second does: still waiting
    assert "Waiting for the first whole step file" in plain(at.info[0].value)
    _land(source, run, 0)
    at.run()
    no_exception(at)
    assert metric(at, "Training steps") == "1"
    assert "Following" in plain(at.caption[-1].value)


def test_new_steps_of_a_followed_run_appear_on_the_trends_page(source, following) -> None:
    run, at = following
    _land(source, run, 0)
    at.run()
    _land(source, run, 1)
    at.run()  # the Data page's look at the folder reruns the app: a second step
    assert metric(at, "Training steps") == "2"
    at.switch_page("pages/trends.py").run()
    no_exception(at)
    assert metric(at, "Steps") == "2"
    assert any("new steps appear here as they land" in plain(c.value) for c in at.caption)
    # A file still being written is skipped until it is whole.
    partial = run / "step_000002" / "rank_0000.parquet"
    partial.parent.mkdir()
    partial.write_bytes((source / "step_000002" / "rank_0000.parquet").read_bytes()[:-8])
    at.run()
    no_exception(at)
    assert metric(at, "Steps") == "2"
    _land(source, run, 2)
    at.run()
    assert metric(at, "Steps") == "3" and metric(at, "Latest step") == "2"
    assert _figures(at)[0]["data"][0]["x"] == [0, 1, 2]
