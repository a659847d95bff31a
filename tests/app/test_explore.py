"""The Explore page: queries over the sequence table, a sequence's curves under each setting,
and a slice that every page then uses."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.compute as pc
from streamlit.testing.v1 import AppTest

from iscore import load
from iscore.dump import Dump
from iscore.passes.analysis import analyze
from iscore.passes.sequences import sequence_table
from tests.app.conftest import DATA, no_exception, open_path, plain


def _explore(at: AppTest) -> AppTest:
    at.switch_page("pages/explore.py").run()
    no_exception(at)
    return at


def _table():
    """fp8.parquet's sequence table, computed outside the app."""
    return sequence_table(Dump(DATA / "fp8.parquet", extras=True))


def test_without_a_dump_it_points_to_the_data_page(at: AppTest) -> None:
    _explore(at)
    assert "Load a dump first" in at.info[0].value


def test_default_query_lists_the_worst_sequences(loaded: AppTest) -> None:
    """Worst as Mismatch has it: the largest summed k3, in the same order."""
    at = _explore(loaded)
    shown = at.dataframe[0].value
    table = _table()
    k3_sum = table["k3"].to_numpy() * table["loss_tokens"].to_numpy()
    order = np.argsort(-k3_sum, kind="stable")
    assert shown["seq_id"].tolist() == table["seq_id"].to_numpy()[order].tolist()
    np.testing.assert_allclose(shown["k3_sum"], k3_sum[order], rtol=1e-12)
    assert any("48 rows" in c.value for c in at.caption)
    worst = analyze(load(DATA / "fp8.parquet"), []).mismatch.worst_sequences
    assert shown["seq_id"].tolist()[: len(worst)] == [w["seq_id"] for w in worst]
    np.testing.assert_allclose(shown["k3_sum"][: len(worst)], [w["k3_sum"] for w in worst])


def test_examples_fill_the_box_and_errors_are_one_line(loaded: AppTest) -> None:
    at = _explore(loaded)
    query_examples = at.button_group[1]
    query_examples.set_value("worst groups").run()
    assert "GROUP BY group_id" in at.text_area[0].value
    groups = at.dataframe[0].value
    table = _table()
    assert sorted(groups["group_id"]) == sorted(set(table["group_id"].to_pylist()))
    assert groups["sequences"].sum() == 48

    at.text_area[0].input("COPY sequences TO 'x.csv'").run()
    no_exception(at)
    assert "only a SELECT query may run" in at.error[0].value
    at.text_area[0].input("SELECT * FROM read_csv('/etc/passwd')").run()
    assert "read_csv() is not allowed" in plain(at.error[0].value)
    at.text_area[0].input("SELECT nope FROM sequences").run()
    assert "Binder Error" in at.error[0].value and "\n" not in at.error[0].value


def test_a_picked_sequence_shows_its_curves_under_each_setting(loaded: AppTest) -> None:
    at = _explore(loaded)
    at.session_state["explore_pick"] = (at.session_state["loaded"], 0, 4)
    at.run()
    no_exception(at)
    assert at.subheader[-1].value == "Sequence 4 of step 0"
    (curves,) = at.get("plotly_chart")
    tokens = _table().filter(pc.equal(_table()["seq_id"], 4))["length"][0].as_py()
    data = json.loads(curves.proto.spec)["data"]
    assert len(data[0]["x"]) == tokens
    # One weight curve per setting, in the session's order, on the sequence's positions.
    settings = [f"{s.framework}:{s.name}" for s in at.session_state["settings"]]
    weights = [trace for trace in data if trace["yaxis"] == "y3"]
    assert settings and [trace["name"] for trace in weights] == settings
    assert all(len(trace["y"]) == tokens for trace in weights)


def test_apply_as_slice_filters_every_page(at: AppTest) -> None:
    at = _explore(open_path(at, DATA / "fp8.parquet"))
    table = _table()
    long = int(pc.sum(pc.greater(table["length"], 1500)).as_py())
    at.text_input[0].input("length > 1500")
    next(b for b in at.button if b.label == "Apply as slice").click().run()
    no_exception(at)
    assert f"the {long:,} sequences where `length > 1500`" in at.info[0].value
    assert at.dataframe[0].value["length"].min() > 1500  # the query sees the slice too

    at.switch_page("pages/data.py").run()
    no_exception(at)
    assert next(m.value for m in at.metric if m.label == "Sequences") == f"{long:,}"
    at.switch_page("pages/mismatch.py").run()
    no_exception(at)
    worst = next(d.value for d in at.dataframe if "k3_sum" in d.value)
    assert worst["tokens"].min() > 1500

    at = _explore(at)
    next(b for b in at.button if b.label == "Clear the slice").click().run()
    at.switch_page("pages/data.py").run()
    assert next(m.value for m in at.metric if m.label == "Sequences") == "48"


def test_a_bad_slice_is_not_applied(loaded: AppTest) -> None:
    at = _explore(loaded)
    for text, message in (
        ("lenght > 3", "no column 'lenght'"),
        ("length > 100000", "no sequence of the selected steps"),
        ("count(*) > 3", "an aggregate (count(*)) is not allowed"),
    ):
        at.text_input[0].input(text)
        next(b for b in at.button if b.label == "Apply as slice").click().run()
        no_exception(at)
        assert message in plain(at.error[0].value)
        assert at.session_state["slice"] is None
