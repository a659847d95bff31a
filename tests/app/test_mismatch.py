"""The Mismatch page: diagnostics as plots, the numbers with the frameworks' names, bug flags,
and one worst sequence token by token."""

from __future__ import annotations

import base64
import json

import numpy as np
from streamlit.testing.v1 import AppTest

from iscore.dump.simulate import SimConfig, write_simulated
from tests.app.conftest import DATA, new_app, no_exception, open_path, plain


def _figures(at: AppTest) -> list[dict]:
    return [json.loads(chart.proto.spec) for chart in at.get("plotly_chart")]


def _values(array: list | dict) -> np.ndarray:
    """A plotly JSON array: a list, or numpy's bytes in base64 (plotly >= 6)."""
    if isinstance(array, dict):
        return np.frombuffer(base64.b64decode(array["bdata"]), dtype=array["dtype"])
    return np.asarray(array)


def test_without_a_dump_it_points_to_the_data_page(at: AppTest) -> None:
    at.switch_page("pages/mismatch.py").run()
    no_exception(at)
    assert "Load a dump first" in at.info[0].value
    assert not at.get("plotly_chart")


def test_diagnostics_numbers_and_worst_sequence(loaded: AppTest) -> None:
    at = loaded.switch_page("pages/mismatch.py").run()
    no_exception(at)
    titles = [f["layout"]["title"]["text"] for f in _figures(at)]
    assert titles[0].startswith("Distribution of signed d")  # an offset shows here
    assert titles[1].startswith("Distribution of |d|")
    assert sum(t.startswith("Mismatch by") for t in titles) == 3  # one step: no by-step
    # Not green: FP8 is elevated.
    assert any("No signature of a semantics bug" in i.value for i in at.info)
    assert not any("No signature of a semantics bug" in s.value for s in at.success)

    numbers = next(d.value for d in at.dataframe if "logged as" in d.value)
    numbers = numbers.set_index("statistic")
    assert abs(numbers.loc["k3", "value"] - 0.0498) < 1e-3
    assert "verl rollout_corr/k3_kl" in numbers.loc["k3", "logged as"]

    worst = next(d.value for d in at.dataframe if "k3_sum" in d.value)
    curves = _figures(at)[-1]
    assert {t["type"] for t in curves["data"]} == {"scattergl"}
    assert len(_values(curves["data"][0]["x"])) == worst.loc[0, "tokens"]
    at.selectbox[0].set_value(3).run()
    assert len(_values(_figures(at)[-1]["data"][0]["x"])) == worst.loc[3, "tokens"]


def test_bug_flags_are_warnings(at: AppTest) -> None:
    open_path(at, DATA / "offset_bug.parquet").switch_page("pages/mismatch.py").run()
    no_exception(at)
    assert any("ratio_mean_bias" in plain(w.value) for w in at.warning)


def test_a_heavy_tail_is_named_beside_no_bug(loaded: AppTest) -> None:
    """fp8's max |d| is 15 nats: 'the mismatch looks like numerical noise' alone read as all
    clear beside token_mult_prob_error 79.8."""
    fp8 = loaded.switch_page("pages/mismatch.py").run()
    no_exception(fp8)
    assert any(i.value.startswith("No signature of a semantics bug") for i in fp8.info)
    assert any("heavy_tail**: the largest |d| is 15.1 nats" in plain(i.value) for i in fp8.info)
    dense = open_path(new_app(), DATA / "dense_bf16.parquet")
    dense.switch_page("pages/mismatch.py").run()
    assert not any("heavy_tail" in i.value for i in dense.info)  # max |d| 0.79


def test_compare_repeats_a_semantics_bug(loaded: AppTest) -> None:
    """Compare graded every setting green on offset_bug with no word of the bug."""
    bug = open_path(new_app(), DATA / "offset_bug.parquet").switch_page("pages/compare.py").run()
    no_exception(bug)
    assert "Mismatch finds a semantics bug (ratio_mean_bias" in plain(bug.warning[0].value)
    clean = loaded.switch_page("pages/compare.py").run()
    assert not any("semantics bug" in plain(w.value) for w in clean.warning)


def test_drift_is_its_own_kind_on_every_page() -> None:
    """Mismatch and the report counted drift among semantics bugs while Compare left it out:
    now each page reads the flag's kind, so drift is named as drift everywhere and as a bug
    nowhere."""
    at = open_path(new_app(), DATA / "drift.parquet")
    mismatch = at.switch_page("pages/mismatch.py").run()
    no_exception(mismatch)
    assert any(i.value.startswith("No signature of a semantics bug") for i in mismatch.info)
    assert any("**drift**" in plain(w.value) for w in mismatch.warning)
    compare = at.switch_page("pages/compare.py").run()
    no_exception(compare)
    assert not any("semantics bug" in plain(w.value) for w in compare.warning)
    assert any("drifts over training" in i.value for i in compare.info)


def test_a_stale_replica_is_one_verdict_on_every_page(tmp_path) -> None:
    """On a broken-replica dump Mismatch flagged a ratio bias (a semantics bug), Recommend
    found broken sequences, and Compare graded verl's default, which keeps all of their
    gradient, green in every column. Now Mismatch names the broken sequences (and no bug),
    and Compare shows each setting's broken gradient kept: the default's is graded bad."""
    path = tmp_path / "stale.parquet"
    write_simulated(path, SimConfig(regime="dense_bf16", sequences=64, broken_share=0.1, seed=3))
    at = new_app()
    at.file_uploader[0].upload("stale.parquet", path.read_bytes(), "application/octet-stream")
    at.run()
    mismatch = at.switch_page("pages/mismatch.py").run()
    no_exception(mismatch)
    assert any("**broken_sequences**" in plain(w.value) for w in mismatch.warning)
    assert not any("ratio_mean_bias" in plain(w.value) for w in mismatch.warning)
    compare = at.switch_page("pages/compare.py").run()
    no_exception(compare)
    assert any("broken sequences" in plain(w.value) for w in compare.warning)
    table = compare.dataframe[0].value
    default = table[table["setting"].str.contains("decoupled_token_is")].iloc[0]
    assert default["broken gradient kept"] > 1.0  # token TIS at 2 up-weights them


def test_routing_and_turn_findings_are_shown_with_what_to_do(tmp_path) -> None:
    """The expert ids and the turns are read from an upload like any column, and the findings
    they support appear under "Where it comes from" with their actions."""
    path = tmp_path / "moe.parquet"
    config = SimConfig(
        sequences=64,
        seed=91,
        experts=8,
        routing_differ=0.1,
        routing_scale=8.0,
        turns=4,
        turn_scale=8.0,
    )
    write_simulated(path, config)
    at = new_app()
    at.file_uploader[0].upload("moe.parquet", path.read_bytes(), "application/octet-stream")
    at.run()
    mismatch = at.switch_page("pages/mismatch.py").run()
    no_exception(mismatch)
    said = [plain(m.value) for m in mismatch.markdown]
    assert any("Tokens routed to other experts carry the mismatch" in s for s in said)
    assert any("Turn boundaries: a re-tokenized transcript" in s for s in said)
    assert any("routing replay, R3" in s for s in said)
    assert any("instead of re-tokenizing the transcript" in s for s in said)


def test_a_floor_and_top_k_columns_are_stated_beside_the_verdict(at: AppTest, tmp_path) -> None:
    path = tmp_path / "whole.parquet"
    write_simulated(path, SimConfig("fp8", sequences=16, steps=1, floor_sigma=0.075, topk=4))
    at.file_uploader[0].upload("whole.parquet", path.read_bytes()).run()
    at = at.switch_page("pages/mismatch.py").run()
    no_exception(at)
    said = [i.value for i in at.info]
    assert any("the trainer's own noise" in s for s in said)
    assert any("the distributions differ by KL" in s and "top-1" in s for s in said)
    plain_at = open_path(new_app(), DATA / "fp8.parquet").switch_page("pages/mismatch.py").run()
    assert not any(
        "own noise" in i.value or "distributions differ" in i.value for i in plain_at.info
    )
