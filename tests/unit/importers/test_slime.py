"""slime's train dumps (format_version 2 and the older per-rank layout), and its rollout dump."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.dump.importers import convert, detect, read
from iscore.errors import DumpError
from tests.unit.importers.conftest import Seq, assert_rows, make_seqs, provenance

PROMPTS = [6, 2, 9, 4, 3, 5]


def train_sample(s: Seq, *, index: int, position: int, dp_rank: int = 0) -> dict:
    """One entry of format_version 2's `samples`: response fields are 1-D, response long."""
    prompt = torch.arange(PROMPTS[position], dtype=torch.long) + 10
    n = s.n
    return {
        "data_parallel_rank": dp_rank,
        "sample_index": index,
        "rollout_position": position,
        "tokens": torch.cat([prompt, torch.tensor(s.token_id, dtype=torch.long)]),
        "response_lengths": n,
        "rewards": s.reward - 0.5,  # group-normalized: NOT the reward
        "truncated": 0,
        "local_raw_reward": s.reward,
        "loss_masks": torch.tensor(s.loss_mask, dtype=torch.int),
        "rollout_ids": index,
        "rollout_mask_sums": torch.tensor(float(s.loss_mask.sum())),
        "rollout_log_probs": torch.tensor(s.rollout),
        "log_probs": torch.tensor(s.train),
        "ref_log_probs": torch.tensor(s.train) - 0.01,
        "advantages": torch.full((n,), s.advantage),
        "returns": torch.full((n,), s.advantage),
        "kl": torch.zeros(n),
        "entropy": torch.tensor(s.entropy),
    }


def write_v2(folder: Path, rollout_id: int, seqs: list[Seq], *, base_index: int = 0) -> Path:
    """DIR/train_data/{rollout_id}.pt as --dump-details writes it (format_version 2)."""
    samples = [train_sample(s, index=base_index + i, position=i) for i, s in enumerate(seqs)]
    payload = {
        "format_version": 2,
        "rollout_id": rollout_id,
        "rank": 0,
        "samples": samples,
        "dp_shards": [
            {
                "rank": 0,
                "data_parallel_rank": 0,
                "sample_indices": [base_index + i for i in range(len(seqs))],
                "partition": list(range(len(seqs))),
                "micro_batch_indices": [list(range(len(seqs)))],
                "num_microbatches": [1],
                "global_batch_sizes": [len(seqs)],
            }
        ],
        "raw_reward": [s.reward for s in seqs],  # the whole rollout's, by position
    }
    path = folder / "train_data" / f"{rollout_id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(payload, path)
    return path


def write_rollout(folder: Path, rollout_id: int, seqs: list[Seq], *, base_index: int = 0) -> Path:
    """DIR/rollout_data/{rollout_id}.pt: Sample.to_dict() per sample, in rollout order.

    R3 routing as a numpy array: the reason slime loads this file with weights_only=False.
    """
    samples = [
        {
            "group_index": s.group,
            "index": base_index + i,
            "rollout_id": None,
            "prompt": f"question {s.group}",
            "tokens": list(range(10, 10 + PROMPTS[i])) + s.token_id.tolist(),
            "multimodal_inputs": None,
            "response": "answer",
            "response_length": s.n,
            "label": "42",
            "reward": s.reward,
            "loss_mask": s.loss_mask.astype(int).tolist(),
            "weight_versions": ["1"],
            "rollout_log_probs": s.rollout.tolist(),
            "rollout_routed_experts": np.zeros((s.n, 2, 1), dtype=np.int32),
            "remove_sample": False,
            "status": "completed",
            "metadata": {},
            "spec_info": {"spec_accept_token_num": 0, "spec_draft_token_num": 0},
            "prefix_cache_info": {"cached_tokens": 0, "total_prompt_tokens": PROMPTS[i]},
        }
        for i, s in enumerate(seqs)
    ]
    path = folder / "rollout_data" / f"{rollout_id}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"rollout_id": rollout_id, "samples": samples}, path)
    return path


COLUMNS = ("loss_mask", "token_id", "entropy", "advantage_per_token", "reward")


class TestFormatVersion2:
    def test_every_response_token_with_its_loss_mask(self, tmp_path):
        seqs = make_seqs([5, 1, 8, 3])
        write_v2(tmp_path, 4, seqs, base_index=20)
        table = read(tmp_path / "train_data" / "4.pt")
        expected = [replace(s, seq_id=20 + i) for i, s in enumerate(seqs)]
        assert_rows(table, expected, 4, COLUMNS)
        assert "group_id" not in table.column_names
        assert provenance(table.schema)["format_version"] == 2

    def test_rollout_dump_needs_allow_pickle(self, tmp_path):
        seqs = make_seqs([2, 3, 4, 2])
        write_v2(tmp_path, 1, seqs)
        write_rollout(tmp_path, 1, seqs)
        table = read(tmp_path, fmt="slime")
        assert "group_id" not in table.column_names
        (note,) = provenance(table.schema)["notes"]
        assert "group_id not imported" in note and "allow_pickle" in note
        joined = read(tmp_path, fmt="slime", allow_pickle=True)
        assert joined["group_id"].to_pylist() == [s.group for s in seqs]
        assert "notes" not in provenance(joined.schema)

    def test_rollout_dump_from_another_rollout_is_refused(self, tmp_path):
        seqs = make_seqs([2, 3])
        write_v2(tmp_path, 1, seqs, base_index=0)
        write_rollout(tmp_path, 1, seqs, base_index=50)
        with pytest.raises(DumpError, match="not of the same rollout"):
            read(tmp_path, allow_pickle=True)

    def test_rollout_dump_with_arbitrary_objects_is_refused_even_allowed(self, tmp_path):
        seqs = make_seqs([2])
        write_v2(tmp_path, 1, seqs)
        marker = tmp_path / "pwned"
        torch.save({"rollout_id": 1, "samples": [_Evil(f"touch {marker}")]}, _rollout(tmp_path))
        with pytest.raises(DumpError, match="does not rebuild, even with allow_pickle"):
            read(tmp_path, allow_pickle=True)
        assert not marker.exists()

    def test_dump_details_folder_detected_without_the_rollout_dumps(self, tmp_path):
        seqs = make_seqs([2, 2])
        for rollout_id in (0, 1, 2):
            write_v2(tmp_path, rollout_id, seqs)
            write_rollout(tmp_path, rollout_id, seqs)
        (tmp_path / "tokenizer").mkdir()
        assert detect(tmp_path) == "slime"
        out = tmp_path / "slime.parquet"
        report = convert(tmp_path, out, allow_pickle=True)
        assert (report.files, report.steps, report.sequences) == (3, 3, 6)
        assert pq.ParquetFile(out).num_row_groups == 3
        batch = iscore.load(out)
        np.testing.assert_array_equal(
            batch.loss_mask.numpy(), np.concatenate([s.loss_mask for s in seqs] * 3)
        )
        np.testing.assert_array_equal(
            batch.train.numpy(), np.concatenate([s.train for s in seqs] * 3)
        )


def _rollout(folder: Path) -> Path:
    path = folder / "rollout_data" / "1.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


class _Evil:
    """Runs a shell command when unpickled, if anything ever unpickles it."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def write_per_rank(folder: Path, rollout_id: int, rank: int, seqs: list[Seq], part: list[int]):
    """The older layout: {rollout_id, rank, rollout_data: {key: per-sample list}}, every rank."""
    picked = [seqs[i] for i in part]
    data = {
        "partition": part,
        "tokens": [
            torch.cat([torch.arange(PROMPTS[i]) + 10, torch.tensor(seqs[i].token_id)]) for i in part
        ],
        "response_lengths": [s.n for s in picked],
        "rewards": [s.reward - 0.5 for s in picked],
        "truncated": [0 for _ in picked],
        "loss_masks": [torch.tensor(s.loss_mask, dtype=torch.int) for s in picked],
        "sample_indices": [100 + i for i in part],
        "rollout_log_probs": [torch.tensor(s.rollout) for s in picked],
        "log_probs": [torch.tensor(s.train) for s in picked],
        "advantages": [torch.full((s.n,), s.advantage) for s in picked],
        "entropy": [torch.tensor(s.entropy) for s in picked],
        "raw_reward": [s.reward for s in seqs],
        "total_lengths": [PROMPTS[i] + s.n for i, s in enumerate(seqs)],
        "global_batch_sizes": [len(seqs)],
        "num_microbatches": [1],
        "micro_batch_indices": [list(range(len(part)))],
    }
    path = folder / f"train_{rollout_id}_{rank}.pt"
    torch.save({"rollout_id": rollout_id, "rank": rank, "rollout_data": data}, path)
    return path


class TestPerRankLayout:
    def test_replicas_read_once_and_pipeline_stages_skipped(self, tmp_path):
        seqs = make_seqs([3, 4, 2, 5])
        write_per_rank(tmp_path, 6, 0, seqs, [0, 2])  # DP 0, TP 0
        write_per_rank(tmp_path, 6, 1, seqs, [0, 2])  # DP 0, TP 1: a replica
        write_per_rank(tmp_path, 6, 2, seqs, [1, 3])  # DP 1
        stage = write_per_rank(tmp_path, 6, 3, seqs, [1, 3])
        payload = torch.load(stage, weights_only=True)
        del payload["rollout_data"]["log_probs"]  # an earlier pipeline stage
        torch.save(payload, stage)
        assert detect(tmp_path) == "slime"
        table = read(tmp_path)
        order = [0, 2, 1, 3]
        expected = [replace(seqs[i], seq_id=100 + i) for i in order]
        assert_rows(table, expected, 6, COLUMNS)
        notes = provenance(table.schema)["notes"]
        assert any("2 samples already read from another rank" in n for n in notes)
        assert any("no log_probs" in n and "train_6_3.pt" in n for n in notes)
        assert "format_version" not in provenance(table.schema)

    def test_context_parallel_shards_are_refused(self, tmp_path):
        seqs = make_seqs([6, 4])
        path = write_per_rank(tmp_path, 0, 0, seqs, [0, 1])
        payload = torch.load(path, weights_only=True)
        payload["rollout_data"]["log_probs"][0] = payload["rollout_data"]["log_probs"][0][:3]
        torch.save(payload, path)
        with pytest.raises(
            DumpError, match=r"sample 0 .*'log_probs' has 3 values but .* 6.*context"
        ):
            read(path)


class TestMalformed:
    def test_not_a_dict(self, tmp_path):
        path = tmp_path / "train.pt"
        torch.save([1, 2, 3], path)
        with pytest.raises(DumpError, match=rf"{path}: expected a dict .* found list"):
            read(path, fmt="slime")

    def test_rollout_dump_given_as_train_dump(self, tmp_path):
        path = write_rollout(tmp_path, 0, make_seqs([2]))
        with pytest.raises(DumpError, match="this is slime's rollout dump"):
            read(path, fmt="slime")

    def test_needs_unpickling(self, tmp_path):
        marker = tmp_path / "pwned"
        path = tmp_path / "train_0.pt"
        torch.save({"format_version": 2, "samples": [_Evil(f"touch {marker}")]}, path)
        with pytest.raises(DumpError, match=r"weights_only=True\) refused it .*never unpickles"):
            read(path)
        assert not marker.exists()

    def test_missing_log_probs(self, tmp_path):
        path = write_v2(tmp_path, 0, make_seqs([2, 2]))
        payload = torch.load(path, weights_only=True)
        del payload["samples"][1]["log_probs"]
        torch.save(payload, path)
        with pytest.raises(DumpError, match=r"sample 1 \(sample_index 1\): no 'log_probs'"):
            read(path)

    def test_length_mismatch(self, tmp_path):
        path = write_v2(tmp_path, 0, make_seqs([4]))
        payload = torch.load(path, weights_only=True)
        payload["samples"][0]["rollout_log_probs"] = torch.zeros(5)
        torch.save(payload, path)
        with pytest.raises(
            DumpError, match=r"'rollout_log_probs' has 5 values but response_lengths is 4$"
        ):
            read(path)

    def test_not_a_torch_file(self, tmp_path):
        path = tmp_path / "train.pt"
        path.write_bytes(b"format_version but not torch")
        with pytest.raises(DumpError, match=r"not a file torch.save wrote"):
            read(path)

    def test_unsupported_version(self, tmp_path):
        path = tmp_path / "x.pt"
        torch.save({"format_version": 3, "samples": []}, path)
        with pytest.raises(DumpError, match="format_version 3"):
            read(path)
