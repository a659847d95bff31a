"""Runs: several dumps kept under names on the Data page; Mismatch and Trends overlay them,
Compare shows each setting on each, and the Runs page compares two (the diff on their loaded
data, its verdicts and evidence, its downloads); names stay text; uploads share the session's
token budget."""

from __future__ import annotations

import json
import sys

from streamlit.testing.v1 import AppTest

from tests.app.conftest import DATA, new_app, no_exception, open_path, plain


def _add_run(at: AppTest, name: str = "") -> AppTest:
    at.text_input(key="_w_run_name").input(name)
    return next(b for b in at.button if b.label == "Add as a run").click().run()


def _two_runs(at: AppTest) -> AppTest:
    """dense_bf16 as "bf16", then fp8 under its file's name: fp8 is loaded."""
    _add_run(open_path(at, DATA / "dense_bf16.parquet"), "bf16")
    return _add_run(open_path(at, DATA / "fp8.parquet"))


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def _titled(at: AppTest, start: str) -> dict:
    return next(f for f in _figures(at) if f["layout"]["title"]["text"].startswith(start))


def test_with_one_dump_the_runs_page_points_to_the_data_page(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/runs.py").run()
    no_exception(at)
    assert "Keep two dumps or more as runs" in at.info[0].value
    mismatch = at.switch_page("pages/mismatch.py").run()
    assert "The runs, overlaid" not in [s.value for s in mismatch.subheader]


def test_two_samples_as_runs_are_overlaid_and_compared(at: AppTest) -> None:
    _two_runs(at)
    no_exception(at)
    assert [r.name for r in at.session_state.runs] == ["bf16", "fp8.parquet"]
    assert "Kept as the run fp8.parquet." in [s.value for s in at.success]

    mismatch = at.switch_page("pages/mismatch.py").run()
    no_exception(mismatch)
    assert "The runs, overlaid" in [s.value for s in mismatch.subheader]
    overlay = _titled(mismatch, "Distribution of |d| = |train - rollout log-prob|, each run")
    assert [t["name"] for t in overlay["data"]] == ["bf16", "fp8.parquet"]
    colours = [t["line"]["color"] for t in overlay["data"]]
    assert len(set(colours)) == 2  # a colour a run
    by_step = _titled(mismatch, "k3 by training step, each run")
    assert [t["x"] for t in by_step["data"]] == [[0, 1], [0]]

    trends = at.switch_page("pages/trends.py").run()  # listed: two runs
    no_exception(trends)
    k3 = _titled(trends, "k3 per step, every sequence")
    assert {t["name"] for t in k3["data"] if "legendgroup" in t} == {"bf16", "fp8.parquet"}

    compare = at.switch_page("pages/compare.py").run()
    no_exception(compare)
    table = next(d.value for d in compare.dataframe if "run" in d.value.columns)
    specs = len(compare.session_state.settings)
    assert list(table["run"]) == ["bf16", "fp8.parquet"] * specs

    runs = at.switch_page("pages/runs.py").run()
    no_exception(runs)
    assert runs.selectbox(key="_w_runs_baseline").value == "bf16"
    assert runs.selectbox(key="_w_runs_candidate").value == "fp8.parquet"
    verdicts = runs.dataframe[0].value.set_index("metric")
    assert verdicts.loc["k3", "verdict"] == "worse"
    assert verdicts.loc["k3", "change"].startswith("x")
    evidence = verdicts.loc["k3", "evidence"]
    assert "bf16 0.0004" in evidence and "95% interval [" in evidence
    assert "1,000 resamples" in evidence and "unpaired" in evidence
    assert "Worse on the candidate" in runs.error[0].value
    figure = _figures(runs)[0]
    assert figure["data"][0]["hovertext"][0].startswith("k3 (")  # the evidence on hover
    labels = [b.proto.label for b in runs.get("download_button")]
    assert labels == ["Diff HTML", "Diff JSON"]
    assert any("dense_bf16.parquet" in plain(c.value) for c in runs.caption)  # its files

    # The other way round: the candidate is better.
    runs.selectbox(key="_w_runs_baseline").set_value("fp8.parquet").run()
    no_exception(runs)
    assert runs.selectbox(key="_w_runs_candidate").value == "bf16"
    assert runs.dataframe[0].value.set_index("metric").loc["k3", "verdict"] == "better"
    assert "No metric is worse on the candidate." in runs.success[0].value


def test_runs_are_renamed_and_removed_and_names_stay_text(at: AppTest) -> None:
    _two_runs(at)
    at.switch_page("pages/runs.py").run()  # its baseline is bf16, renamed below
    at.switch_page("pages/data.py").run()
    evil = "<b>bf16</b>"
    at.text_input(key="_w_run_0_bf16").input(evil).run()
    no_exception(at)
    assert [r.name for r in at.session_state.runs] == [evil, "fp8.parquet"]
    runs = at.switch_page("pages/runs.py").run()
    no_exception(runs)
    assert runs.selectbox(key="_w_runs_baseline").value == evil
    mismatch = at.switch_page("pages/mismatch.py").run()
    said = next(c.value for c in mismatch.caption if c.value.startswith("Each run whole"))
    assert f"{evil}, fp8.parquet" in plain(said) and "<b>" not in said  # escaped Markdown
    names = [t["name"] for t in _titled(mismatch, "Distribution of |d|")["data"]]
    assert names == ["&lt;b&gt;bf16&lt;/b&gt;", "fp8.parquet"]

    # A name taken is numbered; the same dump twice is refused.
    at.switch_page("pages/data.py").run()
    at.text_input(key="_w_run_1_fp8.parquet").input(evil).run()
    assert [r.name for r in at.session_state.runs] == [evil, f"{evil} (2)"]
    _add_run(at)
    assert any("is the run" in w.value and "already" in w.value for w in at.warning)

    next(b for b in at.button if b.label == "Remove").click().run()
    no_exception(at)
    assert [r.name for r in at.session_state.runs] == [f"{evil} (2)"]
    assert at.text_input(key=f"_w_run_0_{evil} (2)").value == f"{evil} (2)"
    runs = at.switch_page("pages/runs.py").run()
    assert "Keep two dumps or more as runs" in runs.info[0].value


def test_uploaded_runs_share_the_sessions_token_budget(monkeypatch) -> None:
    """dense_bf16 holds 106,256 tokens and fp8 45,541 (loss tokens fewer): under a budget of
    120,000 one fits at a time, and a removed run makes room."""
    monkeypatch.setattr(sys, "argv", ["main.py", "--max-upload-tokens", "120000"])
    at = new_app()
    upload = at.file_uploader[0]
    upload.upload("dense_bf16.parquet", (DATA / "dense_bf16.parquet").read_bytes()).run()
    _add_run(at, "bf16")
    at.file_uploader[0].set_value(("fp8.parquet", (DATA / "fp8.parquet").read_bytes(), "x")).run()
    no_exception(at)
    message = plain(at.error[0].value)
    assert "runs hold 106,256 uploaded tokens of its 120,000" in message
    assert at.session_state.loaded.label == "dense_bf16.parquet"

    next(b for b in at.button if b.label == "Remove").click().run()
    at.file_uploader[0].clear().run()  # uploaded again, as a browser would
    at.file_uploader[0].set_value(("fp8.parquet", (DATA / "fp8.parquet").read_bytes(), "x")).run()
    no_exception(at)
    assert at.session_state.loaded.label == "fp8.parquet"
