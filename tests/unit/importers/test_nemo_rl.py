"""NeMo-RL's train_data_step{N}.jsonl: full padded sequences, batch dimension kept, mask-driven."""

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

PAD = 151643  # Qwen's pad id; NeMo-RL pads token ids with the tokenizer's


def nemo_record(s: Seq, idx: int, *, prompt: int, width: int, sample_mask: float = 1.0) -> dict:
    """One line of train_data_step{N}.jsonl, as Logger.log_batched_dict_as_jsonl writes it.

    Prompt positions have generation logprob 0 and a real recomputed prev logprob (the first
    is 0); a tool-output token (token_loss_mask 0) precedes each response token where
    `s.loss_mask` is false; padding to `width` is zeros.
    """
    rng = np.random.default_rng(idx + 100)
    tokens, mask, gen, prev, adv = [], [], [], [], []
    for p in range(prompt):
        tokens.append(int(rng.integers(100, 50_000)))
        mask.append(0)
        gen.append(0.0)
        prev.append(0.0 if p == 0 else float(-rng.exponential(2.0)))
        adv.append(0.0)
    for j in range(s.n):
        if not s.loss_mask[j]:  # a tool-output token: in the sequence, not in the loss
            tokens.append(int(rng.integers(100, 50_000)))
            mask.append(0)
            gen.append(0.0)
            prev.append(float(-rng.exponential(1.0)))
            adv.append(0.0)
        tokens.append(int(s.token_id[j]))
        mask.append(1)
        gen.append(float(s.rollout[j]))
        prev.append(float(s.train[j]))
        adv.append(s.advantage)
    length = len(tokens)
    assert length <= width
    pad = width - length
    return {
        "content": [f"response {idx}"],
        "rewards": [s.reward],
        "input_lengths": [length],
        "token_ids": [tokens + [PAD] * pad],
        "token_loss_mask": [mask + [0] * pad],
        "sample_loss_mask": [sample_mask],
        "advantages": [adv + [0.0] * pad],
        "generation_logprobs": [gen + [0.0] * pad],
        "prev_logprobs": [prev + [0.0] * pad],
        "idx": idx,
    }


def write_step(folder: Path, step: int, seqs: list[Seq], **kwargs) -> Path:
    path = folder / f"train_data_step{step}.jsonl"
    prompts = [7, 3, 12, 1, 5, 9][: len(seqs)]
    width = max(p + 2 * s.n for p, s in zip(prompts, seqs, strict=True))
    with open(path, "w") as f:
        for i, (s, p) in enumerate(zip(seqs, prompts, strict=True)):
            f.write(json.dumps(nemo_record(s, i, prompt=p, width=width, **kwargs)) + "\n")
    return path


def expected(seqs: list[Seq]) -> list[Seq]:
    """What the import must give: every response token, none of the tool tokens between."""
    return [replace(s, seq_id=i, loss_mask=np.ones(s.n, dtype=bool)) for i, s in enumerate(seqs)]


COLUMNS = ("loss_mask", "token_id", "advantage_per_token", "reward")


class TestRead:
    def test_prompt_padding_and_tool_tokens_excluded_by_the_mask(self, tmp_path):
        seqs = make_seqs([5, 1, 9, 4])
        write_step(tmp_path, 3, seqs)
        table = read(tmp_path)
        assert_rows(table, expected(seqs), 3, COLUMNS)
        assert table.column_names == [
            "step",
            "seq_id",
            "rollout_logprob",
            "train_logprob",
            "loss_mask",
            "advantage",
            "token_id",
            "reward",
        ]

    def test_sample_loss_mask_becomes_the_loss_mask(self, tmp_path):
        seqs = make_seqs([3, 2], holes=False)
        write_step(tmp_path, 1, seqs, sample_mask=0.0)
        table = read(tmp_path)
        assert table["loss_mask"].to_pylist() == [[False] * 3, [False] * 2]

    def test_steps_from_file_names_in_numeric_order(self, tmp_path):
        for step in (10, 2, 1):
            write_step(tmp_path, step, make_seqs([2, 3], seed=step))
        (tmp_path / "val_data_step2.jsonl").write_text('{"content": ["no logprobs"]}\n')
        table = read(tmp_path)
        assert table["step"].to_pylist() == [1, 1, 2, 2, 10, 10]
        meta = provenance(table.schema)
        assert meta["framework"] == "nemo_rl"
        assert meta["steps"] == [1, 2, 10]
        assert [Path(p).name for p in meta["source_files"]] == [
            "train_data_step1.jsonl",
            "train_data_step2.jsonl",
            "train_data_step10.jsonl",
        ]

    def test_rows_without_batch_dimension_are_accepted(self, tmp_path):
        record = {
            "token_loss_mask": [0, 1, 1],
            "generation_logprobs": [0.0, -0.5, -0.25],
            "prev_logprobs": [-3.0, -0.5, -0.125],
        }
        (tmp_path / "train_data_step4.jsonl").write_text(json.dumps(record) + "\n")
        table = read(tmp_path)
        assert table["rollout_logprob"].to_pylist() == [[-0.5, -0.25]]
        assert table["train_logprob"].to_pylist() == [[-0.5, -0.125]]
        assert table["seq_id"].to_pylist() == [0]

    def test_nan_from_json_is_kept_for_validate(self, tmp_path):
        line = (
            '{"token_loss_mask": [[1, 1]], "generation_logprobs": [[-0.5, NaN]], '
            '"prev_logprobs": [[-0.5, -Infinity]]}\n'
        )
        (tmp_path / "train_data_step1.jsonl").write_text(line)
        table = read(tmp_path)
        assert np.isnan(table["rollout_logprob"][0].as_py()[1])
        assert table["train_logprob"][0].as_py()[1] == -np.inf


class TestConvert:
    def test_round_trip_through_iscore_load(self, tmp_path):
        dump = tmp_path / "logs"
        dump.mkdir()
        steps = {1: make_seqs([4, 2, 6], seed=1), 2: make_seqs([3, 5], seed=2)}
        for step, seqs in steps.items():
            write_step(dump, step, seqs)
        out = tmp_path / "run.parquet"
        report = convert(dump, out)
        assert (report.framework, report.files, report.steps, report.sequences) == (
            "nemo_rl",
            2,
            2,
            5,
        )
        kept = [e for seqs in steps.values() for e in expected(seqs)]
        assert report.tokens == sum(s.n for s in kept)
        assert pq.ParquetFile(out).num_row_groups == 2
        assert pq.ParquetFile(out).metadata.row_group(0).column(0).compression == "ZSTD"
        batch = iscore.load(out)
        np.testing.assert_array_equal(
            batch.rollout.numpy(), np.concatenate([s.rollout for s in kept])
        )
        np.testing.assert_array_equal(batch.train.numpy(), np.concatenate([s.train for s in kept]))
        assert batch.lengths.tolist() == [s.n for s in kept]
        assert batch.step.tolist() == [1, 1, 1, 2, 2]
        meta = provenance(pq.read_table(out).schema)
        assert meta["steps"] == [1, 2] and meta["framework"] == "nemo_rl"

    def test_no_output_when_a_file_is_bad(self, tmp_path):
        write_step(tmp_path, 1, make_seqs([2]))
        (tmp_path / "train_data_step2.jsonl").write_text("{not json}\n")
        out = tmp_path / "out" / "run.parquet"
        out.parent.mkdir()
        with pytest.raises(DumpError, match="line 1"):
            convert(tmp_path, out)
        assert list(out.parent.iterdir()) == []


class TestMalformed:
    def write(self, tmp_path: Path, *lines: str) -> Path:
        path = tmp_path / "train_data_step7.jsonl"
        path.write_text("".join(lines))
        return path

    GOOD = (
        '{"token_loss_mask": [[0, 1]], "generation_logprobs": [[0.0, -1.0]], '
        '"prev_logprobs": [[-2.0, -1.0]], "idx": 0}\n'
    )

    def test_bad_json_line_names_the_line(self, tmp_path):
        path = self.write(tmp_path, self.GOOD, "\n", '{"token_loss_mask": [[0, 1]\n')
        with pytest.raises(DumpError, match=rf"{path}: line 3: not valid JSON"):
            read(path)

    def test_truncated_last_line(self, tmp_path):
        path = self.write(tmp_path, self.GOOD, '{"token_loss_mask": [[0')
        with pytest.raises(DumpError, match=r"line 2: not valid JSON.*cut off"):
            read(path)

    def test_missing_key(self, tmp_path):
        path = self.write(tmp_path, self.GOOD.replace('"prev_logprobs"', '"other"'))
        with pytest.raises(DumpError, match=rf"{path}: line 1: missing key 'prev_logprobs'"):
            read(path)

    def test_missing_mask_is_refused(self, tmp_path):
        line = '{"generation_logprobs": [[0.0, -1.0]], "prev_logprobs": [[-2.0, -1.0]]}\n'
        path = self.write(tmp_path, line)
        with pytest.raises(DumpError, match=r"missing key 'token_loss_mask'.*prompt"):
            read(path, fmt="nemo_rl")

    def test_key_missing_on_a_later_line(self, tmp_path):
        first = self.GOOD.replace('"idx": 0', '"idx": 0, "rewards": [1.0]')
        path = self.write(tmp_path, first, self.GOOD)
        with pytest.raises(DumpError, match="line 2: missing key 'rewards', which line 1 has"):
            read(path)

    def test_unequal_lengths(self, tmp_path):
        path = self.write(tmp_path, self.GOOD.replace("[[-2.0, -1.0]]", "[[-2.0, -1.0, 0.0]]"))
        with pytest.raises(
            DumpError, match="line 1: 'prev_logprobs' has 3 values but 'token_loss_mask' has 2"
        ):
            read(path)

    def test_batch_dimension_above_one(self, tmp_path):
        path = self.write(tmp_path, self.GOOD.replace("[[0.0, -1.0]]", "[[0.0, -1.0], [0, 0]]"))
        with pytest.raises(DumpError, match="'generation_logprobs' has a batch dimension of 2"):
            read(path)

    def test_not_numbers(self, tmp_path):
        path = self.write(tmp_path, self.GOOD.replace("[[0.0, -1.0]]", '[["a", -1.0]]'))
        expected = "'generation_logprobs' must be a flat list of numbers, found 'a'"
        with pytest.raises(DumpError, match=expected):
            read(path)

    def test_step_needs_the_file_name(self, tmp_path):
        path = tmp_path / "renamed.jsonl"
        path.write_text(self.GOOD)
        assert detect(path) == "nemo_rl"  # by content
        with pytest.raises(DumpError, match="cannot tell the step"):
            read(path)

    def test_not_an_object(self, tmp_path):
        path = self.write(tmp_path, "[1, 2]\n")
        with pytest.raises(DumpError, match="line 1: expected a JSON object, found list"):
            read(path)
