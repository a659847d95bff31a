"""The noise floor (`floor_logprob`: the trainer's second recompute) and MaxText's retention
bands, each against a float64 reference written here from the formulas: k3 and mean |f| of
f = train - floor over the loss tokens, the rollout mismatch over them, and the shares of loss
tokens (e^d) and of sequences (e^(mean d)) inside [0.999, 1.002], +-1% and +-5%."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.advice import gated_values, judge, parse_bound
from iscore.cli import main
from iscore.dump import SimConfig, read_truth, write_simulated
from iscore.errors import DumpError, DumpProblems
from iscore.passes import analyze
from iscore.passes.results_store import ResultStore

BANDS = {"strict": (0.999, 1.002), "1pct": (0.99, 1.01), "5pct": (0.95, 1.05)}


def _dump(
    seed: int, *, floor: bool = True, lengths=None, steps: int = 3, first: int = 0
) -> pa.Table:
    """A token-layout dump of random sequences: lengths 1..40 (one-token ones included), a
    loss mask with holes and one sequence fully masked, a floor 10x quieter than the engine."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 40, 60) if lengths is None else np.asarray(lengths)
    lengths[0], lengths[1] = 1, 7
    n = int(lengths.sum())
    rollout = -rng.exponential(1.0, n).astype(np.float32)
    train = np.minimum(rollout + rng.normal(0, 0.05, n), 0).astype(np.float32)
    mask = rng.random(n) > 0.15
    mask[lengths[0] : lengths[0] + lengths[1]] = False  # the second sequence: no loss token
    columns = {
        "step": np.repeat(rng.integers(0, steps, lengths.size), lengths),
        "seq_id": np.repeat(np.arange(first, first + lengths.size), lengths),
        "rollout_logprob": rollout,
        "train_logprob": train,
        "loss_mask": mask,
    }
    if floor:
        columns["floor_logprob"] = np.minimum(train + rng.normal(0, 0.005, n), 0).astype(np.float32)
    return pa.table(columns)


def _file(tmp_path, table: pa.Table, name: str = "d.parquet") -> str:
    pq.write_table(table, tmp_path / name)
    return str(tmp_path / name)


def _reference(table: pa.Table) -> dict:
    """The floor's statistics and the retention shares in float64 from the formulas, overall
    and per step."""
    col = {name: table[name].to_numpy() for name in table.column_names}
    m = col["loss_mask"]
    d = col["train_logprob"].astype(np.float64) - col["rollout_logprob"].astype(np.float64)

    def numbers(sel: np.ndarray) -> dict:
        out = {}
        if "floor_logprob" in col:
            f = col["train_logprob"].astype(np.float64) - col["floor_logprob"].astype(np.float64)
            f, dd = f[sel & m], d[sel & m]
            out["floor_k3"] = np.mean(np.expm1(f) - f)
            out["floor_abs_diff_mean"] = np.mean(np.abs(f))
            out["k3_ratio"] = np.mean(np.expm1(dd) - dd) / out["floor_k3"]
            out["abs_diff_ratio"] = np.mean(np.abs(dd)) / out["floor_abs_diff_mean"]
        ratio = np.exp(d[sel & m])
        for band, (lo, hi) in BANDS.items():
            out[f"token_{band}"] = np.mean((ratio >= lo) & (ratio <= hi))
        geo = []
        for seq in np.unique(col["seq_id"][sel]):
            tokens = sel & m & (col["seq_id"] == seq)
            if tokens.any():
                geo.append(math.exp(d[tokens].mean()))
        geo = np.array(geo)
        for band, (lo, hi) in BANDS.items():
            out[f"seq_{band}"] = np.mean((geo >= lo) & (geo <= hi))
        return out

    every = np.ones(len(d), dtype=bool)
    steps = {int(s): numbers(col["step"] == s) for s in np.unique(col["step"])}
    return {"all": numbers(every), "steps": steps}


@pytest.mark.parametrize("seed", range(4))
def test_floor_and_retention_match_a_float64_reference(tmp_path, seed):
    table = _dump(seed)
    pq.write_table(table, tmp_path / "d.parquet", row_group_size=300)  # several chunks
    want = _reference(table)
    doc = analyze(str(tmp_path / "d.parquet"), store=None, max_tokens=500).to_dict()
    m = doc["mismatch"]
    floor = m["floor"]
    assert floor["k3"] == pytest.approx(want["all"]["floor_k3"], rel=1e-12)
    assert floor["abs_diff_mean"] == pytest.approx(want["all"]["floor_abs_diff_mean"], rel=1e-12)
    assert floor["k3_ratio"] == pytest.approx(want["all"]["k3_ratio"], rel=1e-12)
    assert floor["abs_diff_ratio"] == pytest.approx(want["all"]["abs_diff_ratio"], rel=1e-12)
    for band in BANDS:
        assert m["retention"]["token"][band] == pytest.approx(want["all"][f"token_{band}"])
        assert m["retention"]["sequence"][band] == pytest.approx(want["all"][f"seq_{band}"])
    for row in m["by_step"]:
        step = want["steps"][row["step"]]
        for key in ("floor_k3", "floor_abs_diff_mean", "k3_ratio", "abs_diff_ratio"):
            assert row[key] == pytest.approx(step[key], rel=1e-12), key


def test_retention_counts_the_limits_as_inside(tmp_path):
    # One-token sequences whose e^d sits a few float32 steps either side of each limit (d is
    # the engine's: float32 log-probs differenced in float64), and d = 0.
    rollout = np.float32(-1.0)
    train = [rollout]
    for limits in BANDS.values():
        for limit in limits:
            near = np.float32(rollout + np.log(limit))
            train += [near + k * np.spacing(near) for k in range(-3, 4)]
    train = np.array(train, np.float32)
    table = pa.table(
        {
            "seq_id": np.arange(train.size),
            "rollout_logprob": np.full(train.size, rollout, np.float32),
            "train_logprob": train,
        }
    )
    m = analyze(_file(tmp_path, table), store=None).mismatch.retention
    ratio = np.exp(train.astype(np.float64) - np.float64(rollout))
    for band, (lo, hi) in BANDS.items():
        inside = (ratio >= lo) & (ratio <= hi)
        assert m["token"][band] == np.mean(inside)
        assert m["sequence"][band] == np.mean(inside)  # one-token sequences: e^(mean d) = e^d
        # The limits are met from both sides: some of the near values in, some out.
        near_lo, near_hi = np.abs(ratio - lo) < 1e-6, np.abs(ratio - hi) < 1e-6
        assert inside[near_lo].any() and not inside[near_lo].all()
        assert inside[near_hi].any() and not inside[near_hi].all()


def test_an_extreme_floor_overflows_to_null_not_a_traceback(tmp_path):
    table = _dump(0)
    floor = table["floor_logprob"].to_numpy().copy()
    floor[3] = -3e38  # f = train + 3e38: e^f overflows
    mask = table["loss_mask"].to_numpy().copy()
    mask[3] = True
    table = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", pa.array(mask))
    table = table.set_column(
        table.schema.get_field_index("floor_logprob"), "floor_logprob", pa.array(floor)
    )
    pq.write_table(table, tmp_path / "d.parquet")
    out = tmp_path / "a.json"
    assert main(["analyze", str(tmp_path / "d.parquet"), "-q", "--no-cache", "--json",
                 str(out)]) == 0  # fmt: skip
    floor = json.loads(out.read_text())["mismatch"]["floor"]
    assert floor["k3"] is None and floor["k3_ratio"] is not None and floor["k3_ratio"] == 0.0
    assert floor["abs_diff_mean"] > 1e34  # 3e38 over some hundred loss tokens


def test_without_the_column_nothing_is_added(tmp_path):
    with_floor, without = _dump(1), _dump(1, floor=False)
    a = analyze(_file(tmp_path, with_floor, "a.parquet"), store=None).to_dict()
    b = analyze(_file(tmp_path, without, "b.parquet"), store=None).to_dict()
    assert "floor" not in b["mismatch"] and "floor" not in b["health"]
    assert not any(k.startswith("floor_") or (k.endswith("_ratio") and "k3" in k)
                   for row in b["mismatch"]["by_step"] for k in row)  # fmt: skip
    # The rest of the document is the same number for number.
    del a["mismatch"]["floor"], a["health"]["floor"]
    for row in a["mismatch"]["by_step"]:
        for key in ("floor_k3", "floor_abs_diff_mean", "k3_ratio", "abs_diff_ratio"):
            del row[key]
    a["source"], b["source"] = {}, {}
    assert json.dumps(a, sort_keys=True, default=str) == json.dumps(b, sort_keys=True, default=str)


def test_the_floor_survives_the_store_and_the_workers(tmp_path):
    for rank in range(2):
        table = _dump(rank, first=1000 * rank)
        pq.write_table(table, tmp_path / f"rank{rank}.parquet", row_group_size=400)
    source = str(tmp_path / "rank*.parquet")
    alone = analyze(source, store=None).mismatch
    store = ResultStore(tmp_path / "store")
    first = analyze(source, store=store).mismatch
    again = analyze(source, store=ResultStore(tmp_path / "store")).mismatch
    workers = analyze(source, store=None, jobs=2).mismatch
    for got in (first, again, workers):
        assert got.floor == pytest.approx(alone.floor, rel=1e-12)
        assert got.retention == alone.retention


def test_files_with_and_without_a_floor_are_refused_naming_the_file(tmp_path):
    pq.write_table(_dump(0), tmp_path / "a.parquet")
    pq.write_table(_dump(1, floor=False), tmp_path / "b.parquet")
    with pytest.raises(DumpProblems) as caught:
        iscore.Dump(str(tmp_path / "*.parquet"))
    problem = caught.value.problems[0]
    assert problem.file.endswith("b.parquet") and problem.column == "floor_logprob"
    with pytest.raises(DumpError, match="floor_logprob"):
        iscore.load(str(tmp_path / "*.parquet"))


def test_a_floor_column_of_positive_log_probs_is_a_clear_error(tmp_path):
    table = _dump(0)
    floor = table["floor_logprob"].to_numpy().copy()
    floor[5] = 0.5
    table = table.set_column(
        table.schema.get_field_index("floor_logprob"), "floor_logprob", pa.array(floor)
    )
    pq.write_table(table, tmp_path / "d.parquet")
    with pytest.raises(DumpProblems) as caught:
        analyze(str(tmp_path / "d.parquet"), store=None)
    assert any(p.column and p.column.startswith("floor_logprob") for p in caught.value.problems)


def test_a_floor_100x_quieter_than_the_engine_gives_k3_ratio_near_100(tmp_path):
    # The fp8 regime's engine noise; a second recompute with logit noise 0.075 nats is about
    # 100x quieter in KL (the simulator's exact truth says by how much).
    config = SimConfig("fp8", sequences=256, steps=2, floor_sigma=0.075, seed=3)
    truth = write_simulated(tmp_path / "sim.parquet", config)
    want = truth.kl_rollout_train / truth.kl_train_floor
    assert 80 < want < 125
    got = analyze(str(tmp_path / "sim.parquet"), store=None)
    assert got.mismatch.floor["k3_ratio"] == pytest.approx(want, rel=0.1)
    assert "the trainer's own noise" in got.health.floor.sentence()
    assert f"{got.mismatch.floor['k3_ratio']:.0f}x" in got.health.floor.sentence()


def test_simulate_writes_a_floor_only_when_asked(tmp_path):
    assert main(["simulate", str(tmp_path / "f.parquet"), "--sequences", "8", "--floor",
                 "0.1"]) == 0  # fmt: skip
    assert main(["simulate", str(tmp_path / "n.parquet"), "--sequences", "8"]) == 0
    with_floor, plain = pq.read_table(tmp_path / "f.parquet"), pq.read_table(tmp_path / "n.parquet")
    assert "floor_logprob" in with_floor.column_names
    assert "floor_logprob" not in plain.column_names
    # Every other column is the same: the floor draws from a stream of its own.
    for name in plain.column_names:
        assert with_floor[name].equals(plain[name]), name
    assert "kl_train_floor" not in read_truth(tmp_path / "n.parquet").to_dict()
    assert read_truth(tmp_path / "f.parquet").kl_train_floor > 0


def test_a_band_below_the_floor_is_named():
    # The floor's own k3 above NeMo-RL's gen_kl_error band (<= 0.001): no engine can meet it.
    from iscore.advice import floor_of

    floor = floor_of({"k3": 0.004, "abs_diff_mean": 0.05, "k3_ratio": 3.0, "abs_diff_ratio": 2})
    assert [c.band.logged_as for c in floor.below] == ["gen_kl_error"]
    assert "sits below the floor" in floor.sentence()
    quiet = floor_of({"k3": 1e-6, "abs_diff_mean": 1e-3, "k3_ratio": 80.0, "abs_diff_ratio": 9})
    assert quiet.below == ()
    assert quiet.sentence().startswith("The engine's mismatch is 80x the trainer's own noise")


def test_the_writer_writes_the_floor(tmp_path):
    rollout = torch.tensor([[-0.5, -1.0, 0.0]])
    inputs = {
        "sampling_per_token_logps": rollout,
        "old_per_token_logps": torch.tensor([[-0.4, -1.1, -2.0]]),
        "completion_mask": torch.tensor([[1, 1, 0]]),
        "advantages": torch.tensor([0.5]),
    }
    with iscore.DumpWriter(tmp_path / "trl.parquet", framework="trl") as writer:
        writer.add_batch(inputs, step=0, floor_logprobs=torch.tensor([[-0.41, -1.09, 5.0]]))
    assert iscore.load(tmp_path / "trl.parquet").floor.tolist() == pytest.approx([-0.41, -1.09])
    with iscore.DumpWriter(tmp_path / "plain.parquet") as writer:
        writer.add(step=0, rollout_logprobs=[np.array([-1.0, -2.0])],
                   train_logprobs=[np.array([-1.1, -2.0])],
                   floor_logprobs=[np.array([-1.05, -2.0])])  # fmt: skip
    floor = iscore.load(tmp_path / "plain.parquet").floor.numpy()
    assert floor.tolist() == np.array([-1.05, -2.0], np.float32).tolist()
    blocks = [inputs, inputs]  # OpenRLHF-like objects hold several blocks
    with iscore.DumpWriter(tmp_path / "o.parquet", framework="openrlhf") as writer:
        from tests.batches import make_truth, openrlhf_blocks

        with pytest.raises(DumpError, match="floor_logprobs"):
            writer.add_batch(openrlhf_blocks(make_truth()), step=0, floor_logprobs=blocks)


def test_gate_holds_the_floor_ratio_and_retention(tmp_path):
    summary = analyze(_file(tmp_path, _dump(2)), store=None).mismatch
    values = gated_values(summary)
    want = _reference(_dump(2))["all"]
    assert values["k3_ratio"] == pytest.approx(want["k3_ratio"], rel=1e-12)
    assert values["seq_retention_5pct"] == pytest.approx(want["seq_5pct"])
    low = math.floor(values["k3_ratio"])
    assert [c.passed for c in judge(values, [parse_bound(f"k3_ratio={low}", "--min")])] == [True]
    assert [c.passed for c in judge(values, [parse_bound(f"k3_ratio={low}", "--max")])] == [False]
    plain = analyze(_file(tmp_path, _dump(2, floor=False), "p.parquet"), store=None).mismatch
    plain = gated_values(plain)
    assert math.isnan(plain["k3_ratio"])
    assert [c.passed for c in judge(plain, [parse_bound("k3_ratio=1", "--min")])] == [False]
