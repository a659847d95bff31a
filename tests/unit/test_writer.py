"""DumpWriter: padded batches of any alignment, ragged lists, validation, streaming row groups."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import iscore
from iscore.dump.writer import PROVENANCE_KEY, DumpWriter, canonical_table
from iscore.errors import DumpError

GARBAGE = 7.0  # a padding value no log-prob can take: if it shows up, padding leaked in


def padded(lengths: list[int], width: int, *, align: str, seed: int = 0):
    """[B, width] rollout/train tensors, the mask, and the per-sequence truth.

    `align`: "left" (tokens first, verl/TRL/OpenRLHF), "right" (padding first, SkyRL) or
    "holes" (tokens scattered, e.g. tool output masked out between turns).
    """
    rng = np.random.default_rng(seed)
    rollout = torch.full((len(lengths), width), GARBAGE)
    train = torch.full((len(lengths), width), GARBAGE)
    mask = torch.zeros((len(lengths), width), dtype=torch.bool)
    truth = []
    for i, n in enumerate(lengths):
        if align == "left":
            where = np.arange(n)
        elif align == "right":
            where = np.arange(width - n, width)
        else:
            where = np.sort(rng.choice(width, n, replace=False))
        r = (-rng.exponential(0.7, n)).astype(np.float32)
        t = np.minimum(r + rng.normal(0, 0.05, n), 0).astype(np.float32)
        rollout[i, where] = torch.from_numpy(r)
        train[i, where] = torch.from_numpy(t)
        mask[i, where] = True
        truth.append((r, t))
    return rollout, train, mask, truth


def concat(truth: list, k: int) -> np.ndarray:
    return np.concatenate([pair[k] for pair in truth])


class TestRoundTrip:
    @pytest.mark.parametrize("align", ["left", "right", "holes"])
    def test_padded_batch_through_iscore_load(self, tmp_path, align):
        lengths = [5, 1, 8, 0, 3]
        rollout, train, mask, truth = padded(lengths, 8, align=align)
        path = tmp_path / "run.parquet"
        with DumpWriter(path, framework="verl") as writer:
            writer.add(step=3, rollout_logprobs=rollout, train_logprobs=train, mask=mask)
        batch = iscore.load(path)
        np.testing.assert_array_equal(batch.rollout.numpy(), concat(truth, 0))
        np.testing.assert_array_equal(batch.train.numpy(), concat(truth, 1))
        assert batch.lengths.tolist() == lengths
        assert batch.seq_id.to_pylist() == [0, 1, 2, 3, 4]
        assert batch.step.tolist() == [3] * 5
        assert bool(batch.loss_mask.all())

    def test_integer_and_float_masks(self, tmp_path):
        rollout, train, mask, truth = padded([2, 3], 4, align="right")
        path = tmp_path / "run.parquet"
        with DumpWriter(path) as writer:
            writer.add(step=0, rollout_logprobs=rollout, train_logprobs=train, mask=mask.int())
            writer.add(step=1, rollout_logprobs=rollout, train_logprobs=train, mask=mask.float())
        batch = iscore.load(path)
        np.testing.assert_array_equal(batch.rollout.numpy(), np.tile(concat(truth, 0), 2))
        assert batch.seq_id.to_pylist() == [0, 1, 2, 3]  # the counter runs across calls

    def test_ragged_lists_with_and_without_mask(self, tmp_path):
        rows = [np.array([-0.5, -1.0, GARBAGE], np.float32), np.array([-2.0], np.float32)]
        path = tmp_path / "run.parquet"
        with DumpWriter(path) as writer:
            writer.add(
                step=0,
                rollout_logprobs=rows,
                train_logprobs=[r - 0.0 for r in rows],
                mask=[[1, 1, 0], [1]],
            )
            writer.add(step=1, rollout_logprobs=[[-0.25, -0.5]], train_logprobs=[[-0.3, -0.5]])
        batch = iscore.load(path)
        np.testing.assert_array_equal(batch.rollout.numpy(), [-0.5, -1.0, -2.0, -0.25, -0.5])
        assert batch.lengths.tolist() == [2, 1, 2]

    def test_every_optional_field(self, tmp_path):
        rollout, train, mask, _ = padded([3, 2], 5, align="holes")
        policy = train - 0.01
        tokens = torch.arange(10).reshape(2, 5)
        entropy = torch.rand(2, 5)
        path = tmp_path / "run.parquet"
        with DumpWriter(path, framework="trl") as writer:
            writer.add(
                step=9,
                rollout_logprobs=rollout,
                train_logprobs=train,
                mask=mask,
                seq_ids=["a", "b"],
                policy_logprobs=policy,
                advantages=torch.tensor([0.5, -1.5]),
                token_ids=tokens,
                entropy=entropy,
                rewards=[1.0, 0.0],
                group_ids=[4, 4],
            )
        table = pq.read_table(path)
        assert table.column_names == [
            "step",
            "seq_id",
            "rollout_logprob",
            "train_logprob",
            "policy_logprob",
            "advantage",
            "token_id",
            "reward",
            "group_id",
            "entropy",
        ]
        assert table["advantage"].to_pylist() == [0.5, -1.5]
        assert table["token_id"].to_pylist() == [
            tokens[0][mask[0]].tolist(),
            tokens[1][mask[1]].tolist(),
        ]
        assert table["reward"].to_pylist() == [1.0, 0.0]
        assert table["group_id"].to_pylist() == [4, 4]
        np.testing.assert_array_equal(table["entropy"][1].as_py(), entropy[1][mask[1]].numpy())
        batch = iscore.load(path)
        np.testing.assert_array_equal(batch.policy.numpy(), policy[mask].numpy())
        assert batch.seq_id.to_pylist() == ["a", "b"]

    def test_per_token_advantages(self, tmp_path):
        rollout, train, mask, _ = padded([2, 3], 4, align="left")
        advantages = torch.arange(8, dtype=torch.float32).reshape(2, 4)
        path = tmp_path / "run.parquet"
        with DumpWriter(path) as writer:
            writer.add(
                step=0,
                rollout_logprobs=rollout,
                train_logprobs=train,
                mask=mask,
                advantages=advantages,
            )
        assert pq.read_table(path)["advantage"].to_pylist() == [[0.0, 1.0], [4.0, 5.0, 6.0]]

    def test_bfloat16_tensors_are_widened(self, tmp_path):
        rollout, train, mask, _ = padded([3], 3, align="left")
        path = tmp_path / "run.parquet"
        with DumpWriter(path) as writer:
            writer.add(
                step=0,
                rollout_logprobs=rollout.bfloat16(),
                train_logprobs=train.bfloat16(),
                mask=mask,
            )
        batch = iscore.load(path)
        assert batch.rollout.dtype == torch.float32
        np.testing.assert_array_equal(batch.rollout.numpy(), rollout.bfloat16().float()[0])


class TestStreaming:
    def test_one_row_group_per_add_in_bounded_memory(self, tmp_path):
        rollout, train, mask, _ = padded([1024] * 64, 1024, align="right")
        path = tmp_path / "long.parquet"
        arrow_after, python_after = [], []
        tracemalloc.start()
        try:
            with DumpWriter(path, framework="openrlhf") as writer:
                for step in range(60):
                    writer.add(step=step, rollout_logprobs=rollout, train_logprobs=train, mask=mask)
                    arrow_after.append(pa.total_allocated_bytes())
                    python_after.append(tracemalloc.get_traced_memory()[0])
        finally:
            tracemalloc.stop()
        step_bytes = rollout.numel() * 4
        # Nothing accumulates: after the 60th call the writer holds what it held after the 5th
        # (give or take a few hundred bytes of bookkeeping per step), not 55 steps of data.
        assert max(arrow_after[5:]) - arrow_after[4] < step_bytes // 4
        assert python_after[-1] - python_after[4] < step_bytes // 4
        parquet = pq.ParquetFile(path)
        assert parquet.num_row_groups == 60
        assert parquet.metadata.row_group(59).num_rows == 64
        assert (writer.sequences, writer.tokens, writer.row_groups) == (3840, 3840 * 1024, 60)
        meta = json.loads(parquet.metadata.metadata[PROVENANCE_KEY])
        assert meta == {"framework": "openrlhf", "source_files": [], "steps": list(range(60))}
        assert iscore.Dump(path).num_tokens == 3840 * 1024

    def test_context_manager_closes_on_error(self, tmp_path):
        rollout, train, mask, truth = padded([2], 2, align="left")
        path = tmp_path / "crash.parquet"
        with pytest.raises(RuntimeError), DumpWriter(path) as writer:
            writer.add(step=0, rollout_logprobs=rollout, train_logprobs=train, mask=mask)
            raise RuntimeError("training crashed")
        np.testing.assert_array_equal(iscore.load(path).rollout.numpy(), concat(truth, 0))

    def test_no_rows_no_file(self, tmp_path):
        with DumpWriter(tmp_path / "empty.parquet"):
            pass
        assert not (tmp_path / "empty.parquet").exists()

    def test_closed_writer(self, tmp_path):
        rollout, train, mask, _ = padded([2], 2, align="left")
        writer = DumpWriter(tmp_path / "a.parquet")
        writer.close()
        with pytest.raises(DumpError, match="the writer is closed"):
            writer.add(step=0, rollout_logprobs=rollout, train_logprobs=train, mask=mask)


class TestValidation:
    @pytest.fixture
    def args(self):
        rollout, train, mask, _ = padded([2, 3], 5, align="left")
        return {"step": 0, "rollout_logprobs": rollout, "train_logprobs": train, "mask": mask}

    @pytest.mark.parametrize(
        ("change", "message"),
        [
            (
                {"train_logprobs": torch.zeros(2, 4)},
                r"Expected argument `train_logprobs` to have shape \[2, 5\] like "
                r"`rollout_logprobs`, but got \[2, 4\]",
            ),
            ({"mask": None}, r"Expected argument `mask` for padded \[B, T\] tensors"),
            ({"mask": torch.full((2, 5), 0.5)}, "`mask` to hold booleans or 0/1, but found 0.5"),
            ({"token_ids": torch.zeros(2, 5)}, "`token_ids` to hold integers, but got float32"),
            ({"rollout_logprobs": torch.zeros(5)}, r"a padded \[B, T\] array .* got shape \[5\]"),
            ({"seq_ids": [1, 2, 3]}, "Expected 2 values of seq_ids .* but got 3"),
            ({"seq_ids": [1, "b"]}, "`seq_ids` to hold integers or strings .* found int, str"),
            ({"rewards": [1.0]}, r"`rewards` to have shape \[2\] .* but got \[1\]"),
            ({"train_logprobs": [[-1.0, -1.0], [-1.0]]}, "`train_logprobs` to be a padded"),
            ({"step": 1.5}, "`step` to be an integer, but got 1.5"),
            ({"entropy": torch.zeros(2, 5, dtype=torch.bool)}, "`entropy` to hold real numbers"),
        ],
    )
    def test_messages_name_the_argument(self, tmp_path, args, change, message):
        with DumpWriter(tmp_path / "a.parquet") as writer, pytest.raises(DumpError, match=message):
            writer.add(**{**args, **change})

    def test_ragged_lengths_must_match(self, tmp_path):
        with (
            DumpWriter(tmp_path / "a.parquet") as writer,
            pytest.raises(
                DumpError,
                match="`mask` sequence 1 to have 1 values like `rollout_logprobs`, but got 2",
            ),
        ):
            writer.add(
                step=0,
                rollout_logprobs=[[-1.0, -2.0], [-1.0]],
                train_logprobs=[[-1.0, -2.0], [-1.0]],
                mask=[[1, 1], [1, 0]],
            )

    def test_optional_arguments_must_stay(self, tmp_path, args):
        with DumpWriter(tmp_path / "a.parquet") as writer:
            writer.add(**args, rewards=[1.0, 2.0])
            with pytest.raises(DumpError, match="this add\\(\\) call lacks reward"):
                writer.add(**args)
            with pytest.raises(DumpError, match="has seq_id as string, where the first had int64"):
                writer.add(**args, rewards=[1.0, 2.0], seq_ids=["x", "y"])


def test_canonical_table_rejects_miscounted_values():
    with pytest.raises(DumpError, match=r"Expected 3 values of train_logprob .* got shape \[2\]"):
        canonical_table(
            step=0,
            seq_id=[0],
            lengths=np.array([3]),
            tokens={"rollout_logprob": np.zeros(3), "train_logprob": np.zeros(2)},
        )


@pytest.mark.gpu
def test_cuda_tensors_are_copied_to_the_host(tmp_path):
    rollout, train, mask, truth = padded([3, 2], 4, align="right")
    path = tmp_path / "cuda.parquet"
    with DumpWriter(path) as writer:
        writer.add(
            step=0,
            rollout_logprobs=rollout.cuda().bfloat16(),
            train_logprobs=train.cuda(),
            mask=mask.cuda(),
            token_ids=torch.ones(2, 4, dtype=torch.long, device="cuda"),
        )
    batch = iscore.load(path, device="cuda")
    np.testing.assert_array_equal(batch.train.cpu().numpy(), concat(truth, 1))
    expected = torch.from_numpy(concat(truth, 0)).bfloat16().float().numpy()
    np.testing.assert_array_equal(batch.rollout.cpu().numpy(), expected)
