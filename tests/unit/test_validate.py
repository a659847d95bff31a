"""`validate`'s summary against a float64 reference written from its definitions."""

from __future__ import annotations

import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from iscore.cli import main
from iscore.dump import Dump, StepRange
from iscore.dump.simulate import SimConfig, write_simulated
from iscore.passes.validation import validate
from tests.conftest import Sequences, make_sequences, write


def _reference(s: Sequences) -> dict[str, float]:
    """Mean and max |d| and mean e^d - 1 - d over loss tokens, d = train - rollout, with the
    log-probs rounded to float32 as the dump stores them."""
    d = np.concatenate(
        [
            (t.astype(np.float32).astype(np.float64) - r.astype(np.float32))[m]
            for r, t, m in zip(s.rollout, s.train, s.loss_mask, strict=True)
        ]
    )
    with np.errstate(over="ignore"):
        k3 = [math.expm1(x) - x if x < 709 else math.inf for x in d.tolist()]
    return {
        "loss_tokens": d.size,
        "abs_diff_mean": math.fsum(abs(x) for x in d.tolist()) / d.size,
        "abs_diff_max": float(np.max(np.abs(d))),
        "k3": math.fsum(k3) / d.size,
    }


def _check(s: Sequences, path, **dump) -> None:
    report = validate(Dump(write(s.sequence_table(), path), **dump), max_tokens=64)
    want = _reference(s)
    assert report.ok and report.loss_tokens == want["loss_tokens"]
    assert report.tokens == sum(s.lengths) and report.sequences == len(s.lengths)
    assert report.abs_diff_max == want["abs_diff_max"]
    for key in ("abs_diff_mean", "k3"):
        assert getattr(report, key) == pytest.approx(want[key], rel=1e-12, abs=0), key


@pytest.mark.parametrize("seed", range(4))
def test_summary_equals_the_reference_on_random_dumps(tmp_path, seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 300, size=int(rng.integers(1, 40))).tolist()
    _check(make_sequences(lengths, seed=seed), tmp_path / "d.parquet")


def test_edge_cases(tmp_path):
    """One-token sequences, a sequence outside the loss, |d| past e^d's float64 range, and
    tokens exactly equal."""
    s = make_sequences([1, 1, 6, 4, 3], seed=5)
    s.loss_mask[0][:] = True
    s.loss_mask[2][:] = False  # a whole sequence outside the loss
    s.rollout[3][:] = [-1000.0, -0.5, -2.0, -3.0]
    s.train[3][:] = [-1.0, -0.5, -2.0, -3.0]  # d = 999 (k3 overflows), then d = 0 exactly
    s.loss_mask[3][:] = True
    _check(s, tmp_path / "d.parquet")
    report = validate(Dump(tmp_path / "d.parquet"))
    assert report.k3 == math.inf and report.abs_diff_max == 999.0


def test_where_and_steps_summarize_only_the_selected_sequences(tmp_path):
    s = make_sequences([5, 9, 2, 30], steps=[0, 1, 1, 2], seed=3)
    path = write(s.sequence_table(), tmp_path / "d.parquet")
    kept = Sequences(
        *([v[i] for i in (1, 2)] for v in (s.seq_id, s.step, s.rollout, s.train)),
        loss_mask=[s.loss_mask[i] for i in (1, 2)],
    )
    want = _reference(kept)
    for dump in (Dump(path, where="step = 1"), Dump(path, steps=StepRange.parse("1"))):
        report = validate(dump)
        assert report.steps == [1] and report.sequences == 2
        assert report.abs_diff_mean == pytest.approx(want["abs_diff_mean"], rel=1e-12)
        assert report.k3 == pytest.approx(want["k3"], rel=1e-12)


def _strict(text: str) -> dict:
    """JSON as a strict reader (jq, JSON.parse) reads it: NaN and Infinity are errors."""

    def refuse(constant: str) -> None:
        raise ValueError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_the_json_of_an_invalid_dump_is_json_and_claims_no_counts(tmp_path, capsys):
    """`validate --json` of an invalid dump wrote NaN (not JSON) and `sequences: 0`, which
    reads as an empty dump: the summary is null where the dump has problems."""
    table = pa.table(
        {
            "seq_id": [1, 1, 2],
            "rollout_logprob": np.float32([-1, np.nan, -1]),
            "train_logprob": np.float32([-1, -1, -1]),
        }
    )
    path, out = write(table, tmp_path / "bad.parquet"), tmp_path / "report.json"
    assert main(["validate", str(path), "-q", "--json", str(out)]) == 1
    report = _strict(out.read_text())
    assert report["ok"] is False and len(report["problems"]) == 1
    assert report["sequences"] is None and report["tokens"] is None and report["k3"] is None
    good = tmp_path / "good.json"
    assert main(["validate", "data/fp8.parquet", "-q", "--json", str(good)]) == 0
    assert _strict(good.read_text())["sequences"] == 48
    capsys.readouterr()


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_expert_ids_and_turns_are_checked_and_listed(tmp_path, layout):
    path = tmp_path / "moe.parquet"
    config = SimConfig(sequences=8, median_len=40, experts=4, routing_differ=0.2, turns=3)
    write_simulated(path, config, layout=layout)
    report = validate(Dump(path))
    assert report.ok and report.tokens > 0
    assert {"turn", "rollout_experts", "train_experts"} <= set(report.columns)
    table = pq.read_table(path)
    ids = table["train_experts"].combine_chunks()
    flat = ids.flatten().flatten() if layout == "sequence" else ids.flatten()
    negative = pa.array(np.where(np.arange(len(flat)) == 5, -1, flat.to_numpy()), pa.int16())
    if layout == "sequence":
        inner = pa.ListArray.from_arrays(ids.values.offsets, negative)
        bad = pa.ListArray.from_arrays(ids.offsets, inner)
    else:
        bad = pa.ListArray.from_arrays(ids.offsets, negative)
    table = table.set_column(table.schema.get_field_index("train_experts"), "train_experts", bad)
    report = validate(Dump(write(table, tmp_path / "bad.parquet")))
    (problem,) = report.problems
    assert problem.column == "train_experts" and problem.rows == (
        (0,) if layout == "sequence" else (1,)
    )
    assert problem.message == "1 negative expert id"
