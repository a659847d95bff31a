"""prime-rl's token_exports/step_{N}/rank_{R}.jsonl: aligned full-sequence arrays, loss_mask."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

import iscore
from iscore.dump.importers import convert, detect, read
from iscore.errors import DumpError
from tests.unit.importers.conftest import Seq, assert_rows, make_seqs, provenance


def export_record(s: Seq, *, step: int, rank: int, index: int, prompt: int) -> dict:
    """One record as prime-rl's TokenExporter writes it (schema_version 1).

    Prompt tokens and tool output (where `s.loss_mask` is false, a tool token precedes the
    response token) have loss_mask false and inference logprob 0; the trainer scores every
    position. The exporter trims padding, so the lists end with the sequence.
    """
    rng = np.random.default_rng(1000 * step + 10 * rank + index)
    cols: dict[str, list] = {k: [] for k in ("ids", "mask", "inf", "trn", "adv", "ent")}

    def token(tid: int, trained: bool, inf: float, trn: float, ent: float) -> None:
        cols["ids"].append(tid)
        cols["mask"].append(trained)
        cols["inf"].append(inf)
        cols["trn"].append(trn)
        cols["adv"].append(s.advantage)
        cols["ent"].append(ent)

    for _ in range(prompt):
        token(int(rng.integers(100, 50_000)), False, 0.0, float(-rng.exponential(2)), 1.5)
    for j in range(s.n):
        if not s.loss_mask[j]:
            token(int(rng.integers(100, 50_000)), False, 0.0, float(-rng.exponential()), 0.5)
        token(int(s.token_id[j]), True, float(s.rollout[j]), float(s.train[j]), float(s.entropy[j]))
    n = len(cols["ids"])
    ratio = [float(np.exp(t - i)) for t, i in zip(cols["trn"], cols["inf"], strict=True)]
    return {
        "schema_version": 1,
        "step": step,
        "export_step": step,
        "rank": rank,
        "micro_step": index // 2,
        "micro_sequence_idx": index % 2,
        "export_sequence_idx": index,
        "run_id": None,
        "env_name": "math",
        "token_ids": cols["ids"],
        "position_ids": list(range(n)),
        "loss_mask": cols["mask"],
        "advantages": cols["adv"],
        "losses": [
            {"rl": {"advantage": a, "mask": m}}
            for a, m in zip(cols["adv"], cols["mask"], strict=True)
        ],
        "rewards": [None] * n,
        "inference_logprobs": cols["inf"],
        "trainer_logprobs": cols["trn"],
        "entropy": cols["ent"],
        "mismatch_kl": [0.0] * n,
        "log_importance_ratio": [float(np.log(r)) for r in ratio],
        "importance_ratio": ratio,
        "prob_delta": [0.0] * n,
        "is_masked": [False] * n,
        "is_masked_high": [False] * n,
        "is_masked_low": [False] * n,
    }


def write_rank(root: Path, step: int, rank: int, seqs: list[Seq], *, stable: bool = True) -> Path:
    folder = root / "token_exports" / f"step_{step}"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank_{rank}.jsonl"
    with open(path, "w") as f:
        for i, s in enumerate(seqs):
            record = export_record(s, step=step, rank=rank, index=i, prompt=3 + i)
            f.write(json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n")
    if stable:
        (folder / "STABLE").touch()
    return path


def expected(seqs: list[Seq], rank: int) -> list[Seq]:
    return [replace(s, seq_id=f"{rank}:{i}") for i, s in enumerate(seqs)]


COLUMNS = ("token_id", "entropy", "advantage_per_token")


class TestRead:
    def test_loss_mask_selects_completion_tokens(self, tmp_path):
        seqs = make_seqs([4, 1, 7])
        write_rank(tmp_path, 5, 0, seqs)
        table = read(tmp_path)
        assert_rows(table, expected(seqs, 0), 5, COLUMNS)
        assert "loss_mask" not in table.column_names  # every kept token is trained
        meta = provenance(table.schema)
        assert meta["framework"] == "prime_rl"
        assert meta["format_version"] == 1
        assert "notes" not in meta

    def test_ranks_get_distinct_ids(self, tmp_path):
        a, b = make_seqs([2, 3], seed=1), make_seqs([4, 1], seed=2)
        write_rank(tmp_path, 0, 0, a)
        write_rank(tmp_path, 0, 1, b)
        table = read(tmp_path / "token_exports")
        assert table["seq_id"].to_pylist() == ["0:0", "0:1", "1:0", "1:1"]
        assert_rows(table.slice(2), expected(b, 1), 0, COLUMNS)

    def test_multi_run_ids_carry_the_run(self, tmp_path):
        path = write_rank(tmp_path, 2, 0, make_seqs([2]))
        record = json.loads(path.read_text())
        record["run_id"] = "run-a"
        record["export_step"] = 7
        path.write_text(json.dumps(record) + "\n")
        table = read(path)
        assert table["seq_id"].to_pylist() == ["run-a/0:0"]
        assert table["step"].to_pylist() == [7]

    def test_missing_stable_marker_is_noted(self, tmp_path):
        write_rank(tmp_path, 1, 0, make_seqs([2]), stable=False)
        notes = provenance(read(tmp_path).schema)["notes"]
        assert any("no STABLE marker" in n for n in notes)

    def test_null_logprob_becomes_nan(self, tmp_path):
        path = write_rank(tmp_path, 1, 0, make_seqs([3], holes=False))
        record = json.loads(path.read_text())
        first = record["loss_mask"].index(True)
        record["trainer_logprobs"][first] = None  # how prime-rl writes a non-finite value
        record["trainer_logprobs"][0] = None  # a prompt position: dropped
        path.write_text(json.dumps(record) + "\n")
        values = read(path)["train_logprob"][0].as_py()
        assert np.isnan(values[0]) and not np.isnan(values[1:]).any()

    def test_detected_by_content_outside_the_layout(self, tmp_path):
        path = write_rank(tmp_path, 3, 2, make_seqs([2]))
        moved = tmp_path / "export.jsonl"
        path.rename(moved)
        assert detect(moved) == "prime_rl"
        assert read(moved)["seq_id"].to_pylist() == ["2:0"]  # rank and step from the record


def test_convert_one_row_group_per_file_and_load(tmp_path):
    runs = {(0, 0): make_seqs([3, 2], seed=3), (0, 1): make_seqs([5], seed=4)}
    runs[(1, 0)] = make_seqs([1, 6], seed=5)
    for (step, rank), seqs in runs.items():
        write_rank(tmp_path, step, rank, seqs)
    out = tmp_path / "prime.parquet"
    report = convert(tmp_path, out)
    assert (report.files, report.steps, report.sequences) == (3, 2, 5)
    assert pq.ParquetFile(out).num_row_groups == 3
    batch = iscore.load(out)
    every = [s for seqs in runs.values() for s in seqs]
    np.testing.assert_array_equal(batch.rollout.numpy(), np.concatenate([s.rollout for s in every]))
    assert batch.seq_id.to_pylist() == ["0:0", "0:1", "1:0", "0:0", "0:1"]
    assert batch.step.tolist() == [0, 0, 0, 1, 1]


class TestMalformed:
    def record(self, tmp_path: Path) -> tuple[Path, dict]:
        path = write_rank(tmp_path, 1, 0, make_seqs([3]))
        return path, json.loads(path.read_text())

    def test_missing_field(self, tmp_path):
        path, record = self.record(tmp_path)
        del record["inference_logprobs"]
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(DumpError, match=rf"{path}: line 1: missing key 'inference_logprobs'"):
            read(path, fmt="prime_rl")

    def test_unequal_lengths(self, tmp_path):
        path, record = self.record(tmp_path)
        record["entropy"].append(1.0)
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(DumpError, match=r"line 1: 'entropy' has .* values but 'loss_mask'"):
            read(path)

    def test_null_in_mask(self, tmp_path):
        path, record = self.record(tmp_path)
        record["loss_mask"][0] = None
        path.write_text(json.dumps(record) + "\n")
        with pytest.raises(DumpError, match="'loss_mask' must be a flat list of booleans"):
            read(path)

    def test_bad_json_line(self, tmp_path):
        path, record = self.record(tmp_path)
        path.write_text(json.dumps(record) + "\n" + json.dumps(record)[:-1] + "\n")
        with pytest.raises(DumpError, match="line 2: not valid JSON"):
            read(path)
