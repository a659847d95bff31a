"""The metadata columns and the signatures that need new columns (docs/why.md)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from iscore.advice import metadata_flags, standouts
from iscore.dump import REGIMES, Dump, SimConfig, write_simulated
from iscore.dump.writer import DumpWriter
from iscore.errors import DumpError
from iscore.passes.analysis import analyze
from iscore.present import render_html


def _sim(tmp_path, name="run.parquet", layout="sequence", **config):
    path = tmp_path / name
    defaults = {"sequences": 64, "steps": 3, "median_len": 120}
    write_simulated(path, SimConfig(**(defaults | config)), layout=layout)
    return path


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_the_noisier_replica_is_named(tmp_path, layout):
    path = _sim(
        tmp_path, layout=layout, median_len=600, replicas=4, noisy_replica=2, noisy_factor=3.0
    )
    a = analyze(path)
    rows = a.mismatch.to_dict()["by_replica"]
    assert [r["value"] for r in rows] == [0, 1, 2, 3]
    found = [f for f in a.attribution.findings if f.kind == "metadata"]
    assert found and found[0].summary.startswith("replica 2: k3")


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_no_standout_nor_flag_where_replicas_are_alike(tmp_path, regime):
    a = analyze(_sim(tmp_path, regime=regime, replicas=4, stale_share=0.2))
    assert not standouts(a.mismatch.metadata)
    assert not {f.code for f in a.flags} & {"engine_drift", "token_id_mismatch"}


@pytest.mark.parametrize("sequences", [16, 32])
def test_small_dumps_name_nothing(tmp_path, sequences):
    for seed in range(3):
        a = analyze(_sim(tmp_path, f"s{seed}.parquet", sequences=sequences, replicas=4, seed=seed))
        assert not standouts(a.mismatch.metadata)


def test_samples_have_no_metadata_keys():
    a = analyze("data/fp8.parquet")
    assert a.mismatch.metadata is None
    assert not [k for k in a.mismatch.to_dict() if k.startswith("by_") and k.endswith("replica")]


def test_engine_drift_fires_on_a_fixed_version_and_not_when_it_moves(tmp_path):
    drift = dict(replicas=2, grow_from=1, steps=4)
    fixed = analyze(_sim(tmp_path, "f.parquet", fixed_version=True, **drift))
    assert "engine_drift" in {f.code for f in fixed.flags}
    moving = analyze(_sim(tmp_path, "m.parquet", **drift))
    assert "engine_drift" not in {f.code for f in moving.flags}


def test_token_id_mismatch_names_the_first_token(tmp_path):
    a = analyze(_sim(tmp_path, retokenized=0.1))
    (flag,) = [f for f in a.flags if f.code == "token_id_mismatch"]
    ids = a.mismatch.metadata.token_ids
    assert ids.differ > 0 and f"position {ids.first['pos']}" in flag.message
    assert not [
        f for f in analyze(_sim(tmp_path, "b.parquet")).flags if f.code == "token_id_mismatch"
    ]


def _write(path, replicas, hosts, steps=1, **extra):
    rng = np.random.default_rng(0)
    with DumpWriter(path) as w:
        for step in range(steps):
            r = -rng.exponential(1.0, (len(replicas), 6)).astype(np.float32)
            t = np.minimum(r + rng.normal(0, 0.05, r.shape), 0).astype(np.float32)
            w.add(step=step, rollout_logprobs=r, train_logprobs=t, mask=np.ones(r.shape, bool),
                  replicas=replicas, hosts=hosts, **extra)  # fmt: skip


def test_nulls_one_replica_html_escaped_and_where(tmp_path):
    path = tmp_path / "w.parquet"
    _write(path, [0, 0, 0, 0], ["<b>h</b>", "<b>h</b>", "x", "x"], steps=2)
    table = pq.read_table(path)
    hosts = pa.array(["<b>h</b>", None, "x", "x"] * 2)
    pq.write_table(table.set_column(table.schema.get_field_index("host"), "host", hosts), path)
    a = analyze(path)
    rows = a.mismatch.to_dict()["by_host"]
    assert [r["value"] for r in rows] == ["<b>h</b>", "x", None]
    assert len(a.mismatch.to_dict()["by_replica"]) == 1
    page = render_html(a)
    assert "&lt;b&gt;h&lt;/b&gt;" in page and "<b>h</b>" not in page
    assert Dump(path, where="host = 'x'").load().num_sequences == 4


def test_token_layout_refuses_a_value_that_changes_within_a_sequence(tmp_path):
    path = tmp_path / "w.parquet"
    _write(path, [0, 1], "h")
    batch = Dump(path).load()
    table = batch.to_arrow()
    replica = table["replica"].to_numpy().copy()
    replica[1] = 7
    token = tmp_path / "t.parquet"
    pq.write_table(
        table.set_column(table.schema.get_field_index("replica"), "replica", pa.array(replica)),
        token,
    )
    with pytest.raises(DumpError, match="replica") as e:
        Dump(token).load()
    assert "t.parquet" in str(e.value) and "1" in str(e.value)


def test_a_value_only_in_one_step_through_the_store_and_workers(tmp_path):
    from iscore.passes import ResultStore

    path = _sim(tmp_path, replicas=3, stale_share=0.3)
    one = analyze(path, jobs=1).mismatch.to_dict()
    assert any(r["steps"] == 1 for r in one["by_weight_version"])
    store = ResultStore(tmp_path / "cache")
    analyze(path, store=store, jobs=1)
    again = analyze(path, store=store, jobs=1).mismatch.to_dict()
    assert store.reads and again == one
    assert analyze(path, jobs=2, max_tokens=4000).mismatch.to_dict() == one


def test_metadata_flags_of_nothing():
    assert metadata_flags(None) == [] and standouts(None) == []
