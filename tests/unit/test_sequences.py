"""The sequence table against float64 references, `--where` against analyzing a hand-sliced
dump (every number, several predicates, both layouts), the per-sequence columns carried through
reading, `iscore sequences` and the `tokens` view."""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest
import torch

from iscore.advice.conversion import to_file_text
from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.dump.where import sequence_rows
from iscore.errors import DumpProblems
from iscore.frameworks.resolve import presets
from iscore.packed.batch import TokenBatch
from iscore.passes.analysis import analyze
from iscore.passes.sequences import (
    SequenceTable,
    batch_schema,
    catalog,
    read_schema,
    sequence_table,
)
from iscore.stats.columns import setting_columns
from iscore.stats.setting import aggregation_of
from iscore.utils.sql import QueryError, query
from tests.unit.frameworks.conftest import edge_batch, make_batch
from tests.unit.test_mismatch import assert_same

SPECS = [
    presets()[name]
    for name in (
        "verl:decoupled_geo_rs",  # token-mean, rejected tokens leave the denominator
        "verl:decoupled_seq_is",
        "trl:trl_default",  # token-mean
        "nemo_rl:nemo_gspo_is",  # seq-mean-token-mean
        "slime:slime_mis_example",  # seq-mean-token-mean
        "skyrl:skyrl_geo_mask",
    )
]


def reference_rows(batch: TokenBatch) -> dict[str, list]:
    """Each sequence's statistics from their definitions (docs/sql.md), in float64 with
    math.fsum, one sequence at a time."""
    out: dict[str, list] = {k: [] for k in ("length", "loss_tokens", "d_sum", "d_mean", "k1")}
    out.update({k: [] for k in ("abs_diff_mean", "abs_diff_max", "k3", "geo_ratio")})
    mask = batch.loss_mask.numpy()
    for a, b in itertools.pairwise(batch.cu_seqlens.tolist()):
        m = mask[a:b]
        d = batch.train[a:b].numpy().astype(np.float64)[m] - batch.rollout[a:b].numpy()[m]
        out["length"].append(b - a)
        out["loss_tokens"].append(int(m.sum()))
        if not m.any():
            for key in ("d_sum", "d_mean", "k1", "abs_diff_mean", "abs_diff_max", "k3"):
                out[key].append(None)
            out["geo_ratio"].append(None)
            continue
        S, T = math.fsum(d), len(d)
        out["d_sum"].append(S)
        out["d_mean"].append(S / T)
        out["k1"].append(-S / T)
        out["abs_diff_mean"].append(math.fsum(abs(x) for x in d) / T)
        out["abs_diff_max"].append(max(abs(x) for x in d))
        out["k3"].append(math.fsum(math.expm1(x) - x for x in d) / T)
        out["geo_ratio"].append(math.exp(S / T))
    return out


@pytest.mark.parametrize(
    "batch",
    [make_batch([1, 7, 300, 2048, 5], seed=1, sigma=0.3), edge_batch()],
    ids=["random", "edges"],
)
def test_statistics_match_float64_reference(batch) -> None:
    table = sequence_rows(batch, batch_schema(batch))
    expected = reference_rows(batch)
    assert table.column_names[:2] == ["step", "seq_id"]
    for name, values in expected.items():
        got = table[name].to_pylist()
        assert [g is None for g in got] == [v is None for v in values], name
        for g, v in zip(got, values, strict=True):
            if v is not None:
                assert g == pytest.approx(v, rel=1e-12, abs=1e-15), name


def reference_setting(batch: TokenBatch, spec) -> dict[str, list]:
    """weight, kept and share of one setting from its replay, by their definitions."""
    result = spec.replay(batch)
    w, keep = result.weight.double().numpy(), result.keep.numpy()
    mask, step = batch.loss_mask.numpy(), batch.step.numpy()
    aggregation = aggregation_of(spec)
    rows = []
    for a, b in itertools.pairwise(batch.cu_seqlens.tolist()):
        m = mask[a:b]
        T = int(m.sum())
        wsum = math.fsum(w[a:b][m])
        kept_tokens = int((keep[a:b] & m).sum())
        if aggregation.mode == "seq-mean-token-mean":
            denominator = kept_tokens if aggregation.shrinks else T
            part = wsum / denominator if denominator else 0.0
        else:
            part = wsum
        rows.append((T, wsum, int((w[a:b][m] > 0).sum()), part if T else 0.0))
    out: dict[str, list] = {"weight": [], "kept": [], "share": []}
    for i, (T, wsum, positive, part) in enumerate(rows):
        total = math.fsum(r[3] for j, r in enumerate(rows) if step[j] == step[i])
        out["weight"].append(wsum / T if T else None)
        out["kept"].append(positive / T if T else None)
        out["share"].append(part / total if T and total > 0 else None)
    return out


def test_setting_columns_match_reference() -> None:
    lengths = [3, 40, 900, 12, 1, 500, 77, 64]
    batch = make_batch(lengths, seed=3, sigma=0.4, masked_fraction=0.2)
    batch = TokenBatch(
        rollout=batch.rollout,
        train=batch.train,
        cu_seqlens=batch.cu_seqlens,
        loss_mask=batch.loss_mask,
        policy=batch.policy,
        step=torch.tensor([0, 0, 0, 1, 1, 1, 2, 2]),
    )
    table = sequence_table(batch, SPECS)
    for spec, prefix in zip(SPECS, setting_columns(SPECS), strict=True):
        expected = reference_setting(batch, spec)
        for name, values in expected.items():
            got = table[f"{prefix}_{name}"].to_pylist()
            assert [g is None for g in got] == [v is None for v in values], (prefix, name)
            for g, v in zip(got, values, strict=True):
                if v is not None:
                    assert g == pytest.approx(v, rel=1e-12, abs=1e-15), (prefix, name)
        for step in range(3):  # a step's shares sum to 1 (when any sequence has weight)
            shares = table.filter(pc.equal(table["step"], step))[f"{prefix}_share"]
            if shares.null_count < len(shares):
                assert pc.sum(shares).as_py() == pytest.approx(1.0, rel=1e-12)


def test_setting_column_names() -> None:
    a, b = presets()["verl:decoupled_geo_rs"], presets()["skyrl:skyrl_geo_mask"]
    assert setting_columns([a, b]) == ["decoupled_geo_rs", "skyrl_geo_mask"]
    twin = replace(b, name="decoupled_geo_rs")
    assert setting_columns([a, twin]) == ["verl_decoupled_geo_rs", "skyrl_decoupled_geo_rs"]
    with pytest.raises(Exception, match="two settings are both named"):
        setting_columns([a, a])
    with pytest.raises(Exception, match="already a column of the dump"):
        setting_columns([replace(a, name="reward")], ["reward_share"])


# ------------------------------------------------------------------------------------------
# --where against hand-sliced dumps


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> dict[str, str]:
    """The same simulated run in both layouts: 3 steps, sequences of 20..3000 tokens."""
    folder = tmp_path_factory.mktemp("where")
    config = SimConfig(regime="moe_routing", sequences=24, steps=3, median_len=300, seed=5)
    out = {}
    for layout in ("sequence", "token"):
        out[layout] = str(folder / f"{layout}.parquet")
        write_simulated(out[layout], config, layout=layout)
    return out


def sequences_of(path: str) -> pa.Table:
    """(step, seq_id) and the columns the predicates below read, from the file with numpy."""
    table = pq.read_table(path)
    if pa.types.is_list(table.schema.field("rollout_logprob").type):
        per_seq = table.select(["step", "seq_id", "reward", "group_id"])
        rollout = [np.asarray(x, np.float32) for x in table["rollout_logprob"].to_pylist()]
        train = [np.asarray(x, np.float32) for x in table["train_logprob"].to_pylist()]
    else:
        keys = list(zip(table["step"].to_pylist(), table["seq_id"].to_pylist(), strict=True))
        starts = [0] + [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
        per_seq = table.take(starts).select(["step", "seq_id", "reward", "group_id"])
        bounds = [*starts, len(keys)]
        r = table["rollout_logprob"].to_numpy()
        t = table["train_logprob"].to_numpy()
        rollout = [r[a:b] for a, b in itertools.pairwise(bounds)]
        train = [t[a:b] for a, b in itertools.pairwise(bounds)]
    d = [tr.astype(np.float64) - ro for ro, tr in zip(rollout, train, strict=True)]
    return (
        per_seq.append_column("length", pa.array([len(x) for x in d]))
        .append_column("k3", pa.array([float(np.mean(np.expm1(x) - x)) for x in d]))
        .append_column("abs_diff_max", pa.array([float(np.abs(x).max()) for x in d]))
    )


PREDICATES = {
    "step >= 1": lambda s: s["step"] >= 1,
    "length > 400": lambda s: s["length"] > 400,
    "reward = 1 AND k3 > 1e-3": lambda s: (s["reward"] == 1) & (s["k3"] > 1e-3),
    "group_id IN (0, 4, 7) OR abs_diff_max > 3": lambda s: (
        np.isin(s["group_id"], [0, 4, 7]) | (s["abs_diff_max"] > 3)
    ),
}


def hand_slice(path: str, keep: set, out: str) -> None:
    """Write the rows of `path` whose (step, seq_id) is in `keep`."""
    table = pq.read_table(path)
    pairs = zip(table["step"].to_pylist(), table["seq_id"].to_pylist(), strict=True)
    pq.write_table(table.filter(pa.array([p in keep for p in pairs])), out)


@pytest.mark.parametrize("layout", ["sequence", "token"])
@pytest.mark.parametrize("text", list(PREDICATES))
def test_where_equals_analyzing_a_hand_sliced_dump(dumps, tmp_path, layout, text) -> None:
    path = dumps[layout]
    seqs = sequences_of(path)
    columns = {name: seqs[name].to_numpy() for name in seqs.column_names}
    chosen = PREDICATES[text](columns)
    assert 0 < chosen.sum() < len(chosen)
    keep = {
        (int(s), int(i))
        for s, i, c in zip(columns["step"], columns["seq_id"], chosen, strict=True)
        if c
    }
    sliced = str(tmp_path / "sliced.parquet")
    hand_slice(path, keep, sliced)
    settings = [*SPECS, "verl:decoupled_token_is"]
    got = analyze(Dump(path, where=text), settings, max_tokens=5_000).to_dict()
    expected = analyze(Dump(sliced), settings, max_tokens=5_000).to_dict()
    assert got["source"].pop("where") == text
    assert expected["source"].pop("where") is None
    for doc in (got, expected):
        doc["source"].pop("files")
    assert got["source"]["sequences"] == len(keep)
    assert_same(got, expected)


def test_where_applies_to_replay_validate_and_load(dumps, tmp_path, capsys) -> None:
    path, text = dumps["token"], "length > 400"
    keep = sequence_table(Dump(path, where=text)).select(["step", "seq_id"])
    sliced = str(tmp_path / "sliced.parquet")
    hand_slice(path, set(zip(*keep.to_pydict().values(), strict=True)), sliced)
    assert Dump(path, where=text).load().equal(Dump(sliced).load())
    config = str(tmp_path / "geo_rs.yaml")
    Path(config).write_text(to_file_text(presets()["verl:decoupled_geo_rs"]))
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    assert main(["replay", path, "--where", text, "--config", config, "--out", str(a), "-q"]) == 0
    assert main(["replay", sliced, "--config", config, "--out", str(b), "-q"]) == 0
    assert pq.read_table(a).equals(pq.read_table(b))
    assert main(["validate", path, "--where", text, "--json", str(tmp_path / "v.json")]) == 0
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["where"] == text and report["sequences"] == keep.num_rows
    assert f"sequences   {keep.num_rows:,} where length > 400" in capsys.readouterr().out


def test_where_errors_name_the_columns(dumps) -> None:
    with pytest.raises(QueryError, match=r"no column 'lenght'; the columns are step, seq_id"):
        Dump(dumps["sequence"], where="lenght > 3")
    with pytest.raises(QueryError, match="per-setting columns are not available"):
        Dump(dumps["sequence"], where="decoupled_geo_rs_kept = 0")
    with pytest.raises(Exception, match="no sequences in the selected steps where 'length < 0'"):
        Dump(dumps["sequence"], where="length < 0").load()


def test_where_reads_only_the_extra_columns_it_names(dumps) -> None:
    assert Dump(dumps["token"], where="length > 3").carried.names == []
    assert Dump(dumps["token"], where="reward > 0").carried.names == ["reward"]
    every = Dump(dumps["token"], extras=True)
    assert every.carried.names == ["group_id", "reward", "advantage"]


def test_both_layouts_give_the_same_table(dumps) -> None:
    tables = [
        sequence_table(Dump(dumps[layout], extras=True), SPECS, max_tokens=4_000)
        for layout in ("sequence", "token")
    ]
    assert tables[0].equals(tables[1])
    whole = sequence_table(Dump(dumps["sequence"], extras=True).load(), SPECS)
    assert whole.equals(tables[0])
    assert tables[0].column_names[:7] == [
        "step", "seq_id", "group_id", "reward", "advantage", "length", "loss_tokens",
    ]  # fmt: skip
    # The per-sequence columns are the dump's own.
    seqs = pq.read_table(dumps["sequence"])
    for name in ("group_id", "reward", "advantage"):
        np.testing.assert_array_equal(
            tables[0][name].to_numpy(), seqs[name].to_numpy().astype(np.float64)
        )


def test_the_table_fills_in_the_analysis_pass(dumps) -> None:
    dump = Dump(dumps["sequence"], extras=True, where="step < 2")
    table = SequenceTable(read_schema(dump), SPECS)
    analysis = analyze(dump, SPECS, max_tokens=4_000, sequences=table)
    alone = sequence_table(Dump(dumps["sequence"], extras=True, where="step < 2"), SPECS)
    assert table.compute().equals(alone)
    assert analysis.source["sequences"] == alone.num_rows


def test_token_layout_per_sequence_columns_must_not_vary(tmp_path) -> None:
    table = pa.table(
        {
            "seq_id": [0, 0, 1, 1, 1],
            "rollout_logprob": [-1.0, -0.5, -0.2, -0.3, -0.1],
            "train_logprob": [-1.0, -0.4, -0.2, -0.3, -0.2],
            "reward": [1.0, 1.0, 0.0, 0.5, 0.0],
            "advantage": [0.5, 1.5, -1.0, -1.0, -1.0],
            "note": ["a", "a", "b", "b", "b"],
        }
    )
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    assert Dump(path, where="length > 1").load().num_sequences == 2  # reward is not read
    with pytest.raises(DumpProblems) as caught:
        Dump(path, where="reward = 1").load()
    (problem,) = caught.value.problems
    assert problem.column == "reward" and problem.rows == (3,) and problem.count == 1
    assert "differ from the first of their sequence" in str(problem)
    fixed = table.set_column(3, "reward", pa.array([1.0, 1.0, 0.0, 0.0, 0.0]))
    pq.write_table(fixed, path)
    rows = sequence_table(Dump(path, extras=True))
    assert rows["advantage"].to_pylist() == [1.0, -1.0]  # the mean of its tokens
    assert "note" not in rows.column_names  # per token in this layout


def test_sequence_layout_carries_other_scalar_columns(tmp_path) -> None:
    table = pa.table(
        {
            "rollout_logprob": [[-1.0, -0.5], [-0.2]],
            "train_logprob": [[-1.0, -0.4], [-0.3]],
            "prompt": ["why", "how"],
            "length": [99, 98],  # a computed column's name
            "score_parts": [[1, 2], [3, 4]],  # a list that is not an iscore column
            "entropy": [[0.5, 1.5], [2.0]],
        }
    )
    path = tmp_path / "s.parquet"
    pq.write_table(table, path)
    rows = sequence_table(Dump(path, extras=True))
    assert rows.column_names[:5] == ["step", "seq_id", "entropy", "prompt", "dump_length"]
    assert rows["entropy"].to_pylist() == [1.0, 2.0]
    assert rows["length"].to_pylist() == [2, 1]
    assert "score_parts" not in rows.column_names
    assert Dump(path, where="prompt = 'how' AND dump_length = 98").load().num_tokens == 1


# ------------------------------------------------------------------------------------------
# Queries and `iscore sequences`


def test_tokens_view_holds_the_selected_sequences_tokens(dumps) -> None:
    for layout in ("sequence", "token"):
        dump = Dump(dumps[layout], extras=True, where="length > 400 AND step = 1")
        table = sequence_table(dump)
        batch = dump.load()
        sql = "SELECT step, seq_id, pos, d, loss_mask FROM tokens ORDER BY step, seq_id, pos"
        tables, views = catalog(table, sql, dump)
        got = query(tables, sql, views=views).table
        assert got.num_rows == batch.num_tokens
        order = np.lexsort((np.arange(batch.num_sequences), batch.seq_id.to_numpy()))
        d = (batch.train.double() - batch.rollout.double()).numpy()
        cu = batch.cu_seqlens.numpy()
        expected = np.concatenate([d[cu[i] : cu[i + 1]] for i in order])
        np.testing.assert_array_equal(got["d"].to_numpy(), expected)
        assert pc.all(got["loss_mask"]).as_py()


def test_sequences_command(dumps, tmp_path, capsys) -> None:
    path = dumps["sequence"]
    out = tmp_path / "seq.parquet"
    args = ["sequences", path, "--preset", "verl:decoupled_geo_rs", "-q"]
    assert main([*args, "--out", str(out)]) == 0
    table = pq.read_table(out)
    expected = sequence_table(Dump(path, extras=True), [presets()["verl:decoupled_geo_rs"]])
    assert table.equals(expected)

    sql = (
        "SELECT step, count(*) AS n, sum(k3 * loss_tokens) AS k3_sum FROM sequences "
        "GROUP BY step ORDER BY step"
    )
    assert (
        main([*args, "--where", "length > 400", "--sql", sql, "--out", str(tmp_path / "q.csv")])
        == 0
    )
    got = pacsv.read_csv(tmp_path / "q.csv").to_pydict()
    chosen = expected.filter(pc.greater(expected["length"], 400))
    steps = sorted(set(chosen["step"].to_pylist()))
    assert got["step"] == steps
    assert got["n"] == [chosen["step"].to_pylist().count(s) for s in steps]
    k3 = chosen["k3"].to_numpy() * chosen["loss_tokens"].to_numpy()
    np.testing.assert_allclose(
        got["k3_sum"], [k3[chosen["step"].to_numpy() == s].sum() for s in steps], rtol=1e-12
    )
    capsys.readouterr()
    assert main([*args, "--sql", "SELECT count(*) AS n FROM tokens WHERE d > 1"]) == 0
    d_count = int((d_values(path) > 1).sum())
    assert capsys.readouterr().out.splitlines() == ['"n"', str(d_count)]

    for bad, message in (
        ("COPY sequences TO 'x.csv'", "only a SELECT query may run"),
        ("SELECT * FROM read_parquet('x.parquet')", "read_parquet() is not allowed"),
    ):
        assert main([*args, "--sql", bad]) == 2
        assert message in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "x.json")]) == 2
    assert "expected a .parquet or .csv file name" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.csv", "seq.parquet"]


def d_values(path: str) -> np.ndarray:
    table = pq.read_table(path)
    rollout = pc.list_flatten(table["rollout_logprob"]).to_numpy()
    train = pc.list_flatten(table["train_logprob"]).to_numpy()
    return train.astype(np.float64) - rollout


def test_analyze_records_the_predicate_and_writes_the_table(dumps, tmp_path) -> None:
    path, text = dumps["token"], "k3 > 1e-3 AND reward = 1"
    files = {n: tmp_path / n for n in ("a.json", "a.html", "s.csv")}
    args = ["analyze", path, "--preset", "verl:decoupled_geo_rs", "--where", text, "-q"]
    args += ["--json", str(files["a.json"]), "--html", str(files["a.html"])]
    assert main([*args, "--sequences", str(files["s.csv"])]) == 0
    doc = json.loads(files["a.json"].read_text())
    assert doc["source"]["where"] == text
    assert (
        "only sequences where <code>k3 &gt; 1e-3 AND reward = 1</code>"
        in files["a.html"].read_text()
    )
    rows = pacsv.read_csv(files["s.csv"])
    assert rows.num_rows == doc["source"]["sequences"]
    assert pc.all(pc.equal(rows["reward"], 1.0)).as_py()
