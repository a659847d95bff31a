"""Reading dumps: layouts, aliases, ordering, streaming, step filters and every bad input."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

import iscore.dump.facade
import iscore.dump.readers
from iscore import Dump, DumpError, StepRange, TokenBatch, load
from iscore.errors import DumpProblems
from tests.conftest import DEVICES, Sequences, make_sequences, write


def expected_batch(s: Sequences, keep: list[int] | None = None) -> TokenBatch:
    """The batch a dump of `s` must load to, built without iscore's reader."""
    keep = list(range(len(s.seq_id))) if keep is None else keep
    lengths = [s.lengths[i] for i in keep]
    return TokenBatch(
        rollout=torch.tensor(np.concatenate([s.rollout[i] for i in keep]), dtype=torch.float32),
        train=torch.tensor(np.concatenate([s.train[i] for i in keep]), dtype=torch.float32),
        cu_seqlens=torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int64),
        loss_mask=torch.tensor(np.concatenate([s.loss_mask[i] for i in keep])),
        step=torch.tensor([s.step[i] for i in keep], dtype=torch.int64),
        seq_id=pa.array([s.seq_id[i] for i in keep]),
    )


def same_values(a: TokenBatch, b: TokenBatch) -> bool:
    """Equal up to how positions are stored (given 0..T-1 vs implied)."""
    return a.equal(b)


ALIASES = {
    "rollout_logprob": "generation_logprobs",
    "train_logprob": "prev_logprobs",
    "loss_mask": "token_loss_mask",
}


class TestLayouts:
    def test_token_layout(self, tmp_path, sequences):
        path = write(sequences.token_table(), tmp_path / "t.parquet")
        assert same_values(load(path), expected_batch(sequences))

    def test_sequence_layout(self, tmp_path, sequences):
        path = write(sequences.sequence_table(), tmp_path / "s.parquet")
        assert same_values(load(path), expected_batch(sequences))

    @pytest.mark.parametrize(
        "names",
        [
            ALIASES,
            {"rollout_logprob": "rollout_log_probs", "train_logprob": "old_log_probs"},
            {"rollout_logprob": "inference_logprobs", "train_logprob": "trainer_logprobs"},
            {"rollout_logprob": "rollout_logprobs", "train_logprob": "action_log_probs"},
            {"rollout_logprob": "sampling_per_token_logps", "train_logprob": "log_probs"},
        ],
    )
    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_aliases_load_identically(self, tmp_path, sequences, names, layout):
        table = getattr(sequences, f"{layout}_table")(names)
        batch = load(write(table, tmp_path / "a.parquet"))
        assert same_values(batch, expected_batch(sequences))

    def test_explicit_mapping_wins(self, tmp_path, sequences):
        table = sequences.token_table({"rollout_logprob": "lp_a", "train_logprob": "lp_b"})
        path = write(table, tmp_path / "m.parquet")
        batch = load(path, columns={"rollout_logprob": "lp_a", "train_logprob": "lp_b"})
        assert same_values(batch, expected_batch(sequences))
        swapped = load(path, columns={"rollout_logprob": "lp_b", "train_logprob": "lp_a"})
        assert torch.equal(swapped.rollout, batch.train)

    def test_optional_columns_default(self, tmp_path):
        s = make_sequences([2, 3])
        table = pa.table(
            {
                "seq_id": [7, 7, 9, 9, 9],
                "rollout_logprob": np.concatenate(s.rollout).astype(np.float32),
                "train_logprob": np.concatenate(s.train).astype(np.float32),
            }
        )
        batch = load(write(table, tmp_path / "min.parquet"))
        assert batch.loss_mask.all() and batch.step.tolist() == [0, 0]
        assert batch.positions().tolist() == [0, 1, 0, 1, 2]
        assert batch.seq_id.to_pylist() == [7, 9] and batch.policy is None

    def test_sequence_layout_without_seq_id_uses_row_number(self, tmp_path, sequences):
        table = sequences.sequence_table().drop_columns(["seq_id"])
        batch = load(write(table, tmp_path / "noid.parquet"))
        assert batch.seq_id.to_pylist() == list(range(6))

    def test_float64_and_int_mask_are_converted(self, tmp_path, sequences):
        table = sequences.token_table()
        table = table.set_column(
            table.schema.get_field_index("rollout_logprob"),
            "rollout_logprob",
            pa.array(np.concatenate(sequences.rollout)),  # float64
        )
        table = table.set_column(
            table.schema.get_field_index("loss_mask"),
            "loss_mask",
            pa.array(np.concatenate(sequences.loss_mask).astype(np.int8)),
        )
        batch = load(write(table, tmp_path / "f64.parquet"))
        assert same_values(batch, expected_batch(sequences))

    def test_policy_logprob_is_read(self, tmp_path, sequences):
        table = sequences.token_table()
        policy = np.concatenate(sequences.train).astype(np.float32) - 0.5
        batch = load(
            write(table.append_column("curr_logprobs", pa.array(policy)), tmp_path / "p.pq")
        )
        assert torch.equal(batch.policy, torch.from_numpy(policy))


class TestOrder:
    def test_pos_orders_tokens_within_a_sequence(self, tmp_path, sequences):
        table = sequences.token_table()
        rng = np.random.default_rng(1)
        # Shuffle the rows of each sequence; pos must restore the order.
        starts = np.concatenate([[0], np.cumsum(sequences.lengths)])
        order = np.concatenate(
            [rng.permutation(np.arange(a, b)) for a, b in itertools.pairwise(starts)]
        )
        batch = load(write(table.take(order), tmp_path / "shuffled.parquet"))
        assert torch.equal(batch.rollout, expected_batch(sequences).rollout)
        assert (
            batch.positions().tolist()
            == np.concatenate([np.arange(n) for n in sequences.lengths]).tolist()
        )

    def test_pos_after_an_empty_first_sequence(self, tmp_path):
        """An empty first sequence put its boundary at index -1: an IndexError with one token
        after it, and otherwise the last pair of positions went unchecked (a repeat passed)."""
        lists = pa.list_(pa.float64())
        one = {"rollout_logprob": pa.array([[], [-1.0]], lists), "pos": [[], [0]]}
        table = pa.table({"train_logprob": pa.array([[], [-1.0]], lists), **one})
        assert load(write(table, tmp_path / "one.parquet")).num_tokens == 1
        lp = pa.array([[], [-1.0, -2.0, -3.0]], lists)
        table = pa.table({"rollout_logprob": lp, "train_logprob": lp, "pos": [[], [0, 1, 1]]})
        msg = problems_of(write(table, tmp_path / "repeat.parquet"))
        assert "column pos: duplicate (seq_id, pos): 1 tokens repeat a position" in msg

    @pytest.mark.parametrize("dtype", [pa.uint64(), pa.uint8(), pa.int8()])
    def test_pos_order_is_compared_not_subtracted(self, tmp_path, dtype):
        """uint64 positions [1, 0] differ by 2^64 - 1, "in order": they were read reversed
        (and int8 [100, -100] by 56)."""
        top = 100 if dtype == pa.int8() else 1
        table = pa.table(
            {
                "seq_id": [0, 0],
                "rollout_logprob": [-1.0, -2.0],
                "train_logprob": [-1.0, -2.0],
                "pos": pa.array([top, -top if dtype == pa.int8() else 0], dtype),
            }
        )
        assert load(write(table, tmp_path / "p.parquet")).rollout.tolist() == [-2.0, -1.0]

    def test_pos_kept_in_one_read_and_dropped_in_another(self, tmp_path):
        """One row group's positions were 0..T-1 (dropped as redundant), the next's were not
        (a gap): joining the two reads raised KeyError('pos')."""
        lists = pa.list_(pa.float64())
        lp = pa.array([[-1.0, -2.0], [-3.0, -4.0]], lists)
        positions = pa.array([[0, 1], [2, 0]], pa.list_(pa.int32()))
        table = pa.table({"rollout_logprob": lp, "train_logprob": lp, "pos": positions})
        path = tmp_path / "two_groups.parquet"
        pq.write_table(table, path, row_group_size=1)
        batch = load(path)
        assert batch.rollout.tolist() == [-1.0, -2.0, -4.0, -3.0]
        assert batch.positions().tolist() == [0, 1, 0, 2]

    def test_without_pos_file_order_is_kept(self, tmp_path, sequences):
        path = write(sequences.token_table(pos=False), tmp_path / "nopos.parquet")
        assert same_values(load(path), expected_batch(sequences))

    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_round_trip(self, tmp_path, sequences, layout):
        table = getattr(sequences, f"{layout}_table")()
        first = load(write(table, tmp_path / "in.parquet"))
        first.to_parquet(tmp_path / "out.parquet")
        again = load(tmp_path / "out.parquet")
        assert again.equal(first)
        assert again.seq_id.to_pylist() == sequences.seq_id

    def test_round_trip_keeps_given_positions(self, tmp_path):
        table = pa.table(
            {
                "seq_id": [1, 1, 1],
                "pos": [10, 20, 15],
                "rollout_logprob": np.float32([-1, -2, -3]),
                "train_logprob": np.float32([-1, -2, -3]),
            }
        )
        first = load(write(table, tmp_path / "gap.parquet"))
        assert first.positions().tolist() == [10, 15, 20]
        assert first.rollout.tolist() == [-1, -3, -2]
        first.to_parquet(tmp_path / "again.parquet")
        assert load(tmp_path / "again.parquet").equal(first)


class TestStreaming:
    @pytest.mark.parametrize("max_tokens", [1, 6, 13, 1000])
    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_chunks_hold_whole_sequences_and_equal_whole_load(
        self, tmp_path, monkeypatch, layout, max_tokens
    ):
        monkeypatch.setattr(iscore.dump.readers, "READ_TOKENS", 4)  # sequences straddle reads
        s = make_sequences([5, 1, 40, 7, 3, 12, 2, 9], steps=[0, 0, 0, 1, 1, 1, 2, 2])
        table = getattr(s, f"{layout}_table")()
        path = write(table, tmp_path / "d.parquet", row_group_size=3 if layout == "token" else 2)
        chunks = list(Dump(path).batches(max_tokens=max_tokens))
        ids = [i for c in chunks for i in c.seq_id.to_pylist()]
        assert ids == s.seq_id  # each sequence exactly once, whole, in order
        lengths = [n for c in chunks for n in c.lengths.tolist()]
        assert lengths == s.lengths
        whole = torch.cat([c.rollout for c in chunks])
        assert torch.equal(whole, load(path).rollout)
        for c in chunks[:-1]:
            # A chunk overshoots by at most one read, unless one sequence is longer.
            assert c.num_tokens <= max_tokens + 40 + 4

    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_load_joins_chunks_into_the_whole_dump(self, tmp_path, monkeypatch, layout):
        # Reads of 4 tokens, chunks of about 6: every sequence of two files is in some chunk.
        monkeypatch.setattr(iscore.dump.readers, "READ_TOKENS", 4)
        monkeypatch.setattr(iscore.dump.facade, "DEFAULT_CHUNK_TOKENS", 6)
        a = make_sequences([5, 1, 40, 7], steps=[0, 0, 1, 1], ids=["a", "b", "c", "d"])
        b = make_sequences([3, 12, 2], steps=[2, 2, 3], seed=1, ids=["e", "f", "g"])
        paths, given = [], []
        for name, s, shift in (("a", a, 3), ("b", b, 0)):  # a's positions start at 3
            policy = [t.astype(np.float32) - np.float32(0.25) for t in s.train]
            reward = np.arange(len(s.seq_id), dtype=np.float64)
            table = getattr(s, f"{layout}_table")()
            if layout == "token":
                pos = table["pos"].to_numpy() + shift
                given.append(pos)
                table = table.set_column(5, "pos", pa.array(pos))
                policy, reward = np.concatenate(policy), np.repeat(reward, s.lengths)
            else:
                policy = pa.array(policy, pa.list_(pa.float32()))
            table = table.append_column("policy_logprob", pa.array(policy))
            table = table.append_column("reward", pa.array(reward))
            paths.append(write(table, tmp_path / f"{name}.parquet", row_group_size=3))
        done = []
        batch = Dump(paths, extras=True).load(progress=done.append)
        assert len(done) > 2 and sum(done) == batch.num_tokens == sum(a.lengths + b.lengths)
        both = Sequences(*(getattr(a, f) + getattr(b, f) for f in Sequences.__dataclass_fields__))
        expected = expected_batch(both)
        expected = dataclasses.replace(
            expected,
            policy=expected.train - 0.25,
            pos=torch.from_numpy(np.concatenate(given)) if given else None,
        )
        assert batch.equal(expected) and (batch.pos is None) == (layout == "sequence")
        assert batch.extra["reward"].to_pylist() == [0.0, 1.0, 2.0, 3.0, 0.0, 1.0, 2.0]

    def test_load_lists_the_problems_of_every_chunk(self, tmp_path, monkeypatch):
        monkeypatch.setattr(iscore.dump.readers, "READ_TOKENS", 4)
        monkeypatch.setattr(iscore.dump.facade, "DEFAULT_CHUNK_TOKENS", 6)
        s = make_sequences([5, 1, 40, 7, 3, 12])
        table = s.token_table()
        train = table["train_logprob"].to_numpy().copy()
        train[[2, 60]] = np.nan  # in the first chunk and in the last
        table = table.set_column(3, "train_logprob", pa.array(train))
        msg = problems_of(write(table, tmp_path / "nan.parquet", row_group_size=3))
        assert "2 NaN or null values at rows 2, 60" in msg

    @pytest.mark.parametrize("max_tokens", [1, 10, 30])
    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_whole_steps_are_never_split(self, tmp_path, monkeypatch, layout, max_tokens):
        monkeypatch.setattr(iscore.dump.readers, "READ_TOKENS", 4)
        s = make_sequences([5, 1, 40, 7, 3, 12, 2, 9, 4], steps=[0, 0, 0, 1, 1, 1, 2, 2, 5])
        path = write(getattr(s, f"{layout}_table")(), tmp_path / "d.parquet", row_group_size=2)
        chunks = list(Dump(path).batches(max_tokens=max_tokens, whole_steps=True))
        steps = [sorted(set(c.step.tolist())) for c in chunks]
        flat = [step for group in steps for step in group]
        assert flat == sorted(set(flat)) == [0, 1, 2, 5]  # each step in exactly one chunk
        assert [i for c in chunks for i in c.seq_id.to_pylist()] == s.seq_id
        assert torch.equal(torch.cat([c.train for c in chunks]), load(path).train)
        if max_tokens == 1:
            assert steps == [[0], [1], [2], [5]]

    def test_step_filter_skips_row_groups(self, tmp_path):
        s = make_sequences([4, 4, 4, 4], steps=[0, 1, 2, 3])
        path = write(s.sequence_table(), tmp_path / "steps.parquet", row_group_size=1)
        batch = load(path, steps=StepRange(1, 2))
        assert batch.step.tolist() == [1, 2]
        assert same_values(batch, expected_batch(s, keep=[1, 2]))
        assert load(path, steps=StepRange.parse("3:")).step.tolist() == [3]
        with pytest.raises(DumpError, match="no sequences in the selected steps"):
            load(path, steps=StepRange(9, 9))

    def test_an_empty_step_selection_names_the_steps_the_dump_has(self, tmp_path):
        from iscore.passes.analysis import analyze

        s = make_sequences([4, 4, 4, 4], steps=[2, 3, 5, 5])
        path = write(s.sequence_table(), tmp_path / "steps.parquet", row_group_size=1)
        with pytest.raises(DumpError, match=r"selected steps \(9:; the dump has steps 2..5\)"):
            load(path, steps=StepRange(9, None))
        with pytest.raises(DumpError, match=r"selected steps \(4; the dump has steps 2..5\)$"):
            analyze(Dump(path, steps=StepRange(4, 4)), ["trl:trl_default"], device="cpu")
        no_step = write(s.sequence_table().drop_columns(["step"]), tmp_path / "no_step.parquet")
        with pytest.raises(DumpError, match=r"\(:-1; the dump has step 0\)"):
            load(no_step, steps=StepRange(None, -1))
        # Without statistics in the footer the range alone is named (nothing is read for it).
        bare = write(s.sequence_table(), tmp_path / "bare.parquet", write_statistics=False)
        with pytest.raises(DumpError, match=r"selected steps \(9\)$"):
            load(bare, steps=StepRange(9, 9))

    def test_directory_and_glob(self, tmp_path):
        a, b = make_sequences([3, 2], seed=1), make_sequences([4], seed=2, ids=[500])
        write(a.token_table(), tmp_path / "part-0.parquet")
        write(b.token_table(), tmp_path / "part-1.parquet")
        by_dir = load(tmp_path)
        by_glob = load(str(tmp_path / "part-*.parquet"))
        assert by_dir.equal(by_glob)
        assert by_dir.seq_id.to_pylist() == [100, 101, 500]
        assert by_dir.num_tokens == 9


def problems_of(path, **kwargs) -> str:
    with pytest.raises(DumpError) as info:
        load(path, **kwargs)
    return str(info.value)


class TestBadInput:
    def test_missing_required_column_lists_aliases(self, tmp_path, sequences):
        table = sequences.token_table().drop_columns(["train_logprob"])
        msg = problems_of(write(table, tmp_path / "miss.parquet"))
        assert "miss.parquet" in msg and "missing required column train_logprob" in msg
        assert "prev_logprobs" in msg and "old_log_probs" in msg and "--column" in msg

    def test_every_missing_required_column_is_named(self, tmp_path, sequences):
        """A file missing both log-prob columns named only the first."""
        table = sequences.token_table().drop_columns(["train_logprob", "rollout_logprob"])
        msg = problems_of(write(table, tmp_path / "two.parquet"))
        assert "missing required columns rollout_logprob (tried rollout_logprob, " in msg
        assert ") and train_logprob (tried train_logprob, " in msg
        assert "Map each with --column CANONICAL=NAME" in msg

    def test_verl_uid_is_a_group_not_a_sequence(self, tmp_path, sequences):
        """verl's `uid` names the prompt a response answers (its group): read as seq_id, a
        group's responses were one sequence appearing twice."""
        table = sequences.sequence_table().drop_columns(["seq_id"])
        table = table.append_column("uid", pa.array(["p0", "p0", "p1", "p1", "p2", "p2"]))
        dump = iscore.dump.Dump(write(table, tmp_path / "verl.parquet"), extras=True)
        assert dump.files[0].columns.source.get("group_id") == "uid"
        assert dump.load().seq_id.to_pylist() == [0, 1, 2, 3, 4, 5]

    def test_a_column_mapped_away_is_named(self, tmp_path, sequences):
        """Mapping the rollout column to train_logprob leaves rollout_logprob without one:
        the message says where its column went, not that the file lacks it."""
        path = write(sequences.token_table(), tmp_path / "d.parquet")
        msg = problems_of(path, columns={"train_logprob": "rollout_logprob"})
        assert "missing required column rollout_logprob: the file's 'rollout_logprob' is " in msg
        assert "mapped to train_logprob (--column train_logprob=rollout_logprob)" in msg

    def test_ambiguous_aliases(self, tmp_path, sequences):
        table = sequences.token_table({"train_logprob": "old_log_probs"})
        table = table.append_column("prev_logprobs", table["old_log_probs"])
        msg = problems_of(write(table, tmp_path / "amb.parquet"))
        assert "'old_log_probs', 'prev_logprobs' could each be train_logprob" in msg

    def test_unequal_list_lengths(self, tmp_path, sequences):
        table = sequences.sequence_table()
        train = table["train_logprob"].to_pylist()
        train[2] = train[2][:-1]
        table = table.set_column(3, "train_logprob", pa.array(train, pa.list_(pa.float32())))
        msg = problems_of(write(table, tmp_path / "uneq.parquet"))
        assert "uneq.parquet, column train_logprob: list lengths differ" in msg
        assert "(e.g. 39 vs 40) at row 2" in msg

    @pytest.mark.parametrize(
        ("value", "what"),
        [(np.nan, "NaN or null"), (np.inf, "infinite"), (-np.inf, "infinite"), (0.5, "positive")],
    )
    def test_invalid_logprobs(self, tmp_path, sequences, value, what):
        table = sequences.token_table({"train_logprob": "prev_logprobs"})
        train = table["prev_logprobs"].to_numpy().copy()
        train[[6, 30]] = value
        table = table.set_column(3, "prev_logprobs", pa.array(train))
        path = write(table, tmp_path / "bad.parquet")
        msg = problems_of(path)
        assert "column train_logprob (source 'prev_logprobs')" in msg
        assert f"2 {what}" in msg and "at rows 6, 30" in msg
        assert msg.count("invalid log-prob") == 1  # +inf is infinite, not also positive
        batch = load(path, drop_invalid=True)  # rows 6 and 30 are both in sequence "c"
        assert batch.seq_id.to_pylist() == ["a", "b", "d", "e", "f"]
        assert same_values(batch, expected_batch(sequences, keep=[0, 1, 3, 4, 5]))

    def test_drop_invalid_reports_counts(self, tmp_path, sequences):
        table = sequences.sequence_table()
        rollout = table["rollout_logprob"].to_pylist()
        rollout[0][1] = float("nan")
        rollout[4][0] = 3.0
        table = table.set_column(2, "rollout_logprob", pa.array(rollout, pa.list_(pa.float32())))
        dump = Dump(write(table, tmp_path / "drop.parquet"), drop_invalid=True)
        batch = dump.load()
        assert batch.seq_id.to_pylist() == ["b", "c", "d", "f"]
        assert dump.dropped.sequences == 2 and dump.dropped.tokens == 5 + 3

    def test_null_logprob_is_invalid(self, tmp_path):
        table = pa.table(
            {
                "seq_id": [1, 1],
                "rollout_logprob": pa.array([-1.0, None], pa.float32()),
                "train_logprob": pa.array([-1.0, -1.0], pa.float32()),
            }
        )
        msg = problems_of(write(table, tmp_path / "null.parquet"))
        assert "column rollout_logprob: invalid log-prob: 1 NaN or null value at row 1" in msg

    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_duplicate_seq_id_pos(self, tmp_path, sequences, layout):
        if layout == "token":
            table = sequences.token_table()
            pos = table["pos"].to_numpy().copy()
            pos[8] = pos[7]  # two tokens of sequence "c" at one position
            table = table.set_column(table.schema.get_field_index("pos"), "pos", pa.array(pos))
        else:
            table = sequences.sequence_table()
            pos = [list(range(n)) for n in sequences.lengths]
            pos[2][3] = 2
            table = table.append_column("pos", pa.array(pos))
        msg = problems_of(write(table, tmp_path / "dup.parquet"))
        assert "column pos: duplicate (seq_id, pos): 1 tokens repeat a position" in msg

    def test_sequence_repeated_or_split(self, tmp_path, sequences):
        table = sequences.token_table()
        table = pa.concat_tables([table, table.slice(0, 2)])
        msg = problems_of(write(table, tmp_path / "twice.parquet"))
        assert "sequence seq_id='a' step=0 appears twice or its rows are not contiguous" in msg
        assert "at row 68" in msg

    @pytest.mark.parametrize("max_tokens", [None, 8])
    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_sequence_met_again_in_a_later_read_or_file(
        self, tmp_path, sequences, layout, max_tokens
    ):
        table = getattr(sequences, f"{layout}_table")()
        again = table.slice(0, 2 if layout == "token" else 1)  # the first rows of "a"
        path = write(pa.concat_tables([table, again]), tmp_path / "twice.parquet")
        with pytest.raises(DumpProblems) as info:
            list(Dump(path).batches(max_tokens=max_tokens))
        row = table.num_rows
        assert "twice.parquet, column seq_id: sequence seq_id='a' step=0 appears twice" in str(
            info.value
        ) and f"at row {row}" in str(info.value)
        (tmp_path / "two").mkdir()
        write(table, tmp_path / "two" / "a.parquet")
        write(again, tmp_path / "two" / "b.parquet")
        with pytest.raises(DumpProblems) as info:
            list(Dump(tmp_path / "two").batches(max_tokens=max_tokens))
        assert (
            "b.parquet, column seq_id: sequence seq_id='a' step=0 appears twice" in str(info.value)
            and "(it is also in " in str(info.value)
            and "a.parquet)" in str(info.value)
        )

    def test_empty_file(self, tmp_path):
        (tmp_path / "empty.parquet").write_bytes(b"")
        assert "empty.parquet: empty file (0 bytes)" in problems_of(tmp_path / "empty.parquet")

    def test_parquet_without_rows(self, tmp_path, sequences):
        path = write(sequences.token_table().slice(0, 0), tmp_path / "norows.parquet")
        assert "empty file (a Parquet schema but no rows)" in problems_of(path)

    def test_truncated_file(self, tmp_path, sequences):
        path = write(sequences.token_table(), tmp_path / "full.parquet")
        data = path.read_bytes()
        (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
        msg = problems_of(tmp_path / "cut.parquet")
        assert "cut.parquet: truncated Parquet file" in msg and "no footer" in msg

    @pytest.mark.parametrize(
        ("content", "hint"),
        [(b'{"a": 1}\n', "JSON Lines"), (b"\x80\x04K\x01.", "pickle"), (b"hello", "")],
    )
    def test_not_parquet(self, tmp_path, content, hint):
        (tmp_path / "x.parquet").write_bytes(content)
        msg = problems_of(tmp_path / "x.parquet")
        assert "x.parquet: not a Parquet file" in msg and hint in msg

    def test_wrong_column_type(self, tmp_path, sequences):
        table = sequences.token_table()
        table = table.set_column(
            table.schema.get_field_index("train_logprob"),
            "train_logprob",
            pa.array([str(x) for x in table["train_logprob"].to_pylist()]),
        )
        msg = problems_of(write(table, tmp_path / "typ.parquet"))
        assert "typ.parquet, column train_logprob: expected a float column" in msg
        assert "found string" in msg

    def test_sequence_layout_scalar_where_list_expected(self, tmp_path, sequences):
        table = sequences.sequence_table().append_column("pos", pa.array(range(6)))
        msg = problems_of(write(table, tmp_path / "typ2.parquet"))
        assert "column pos: expected a list of integer values (sequence layout)" in msg

    def test_mixed_layouts(self, tmp_path, sequences):
        write(sequences.token_table(), tmp_path / "a.parquet")
        write(sequences.sequence_table(), tmp_path / "b.parquet")
        assert "files mix token and sequence layouts" in problems_of(tmp_path)

    def test_all_open_problems_are_listed(self, tmp_path):
        (tmp_path / "a.parquet").write_bytes(b"")
        (tmp_path / "b.parquet").write_bytes(b"nope")
        with pytest.raises(DumpProblems) as info:
            Dump(tmp_path)
        assert len(info.value.problems) == 2

    def test_missing_path(self, tmp_path):
        assert "no such file or directory" in problems_of(tmp_path / "nope.parquet")
        assert "matches no files" in problems_of(str(tmp_path / "*.parquet"))

    def test_corrupt_pages(self, tmp_path):
        table = pa.table(
            {
                "seq_id": np.arange(2000) // 10,
                "rollout_logprob": -np.linspace(0.1, 5, 2000, dtype=np.float32),
                "train_logprob": -np.linspace(0.1, 5, 2000, dtype=np.float32),
            }
        )
        path = write(table, tmp_path / "ok.parquet", compression="zstd")
        data = bytearray(path.read_bytes())
        data[200:600] = bytes(400)  # zero out the middle of the column data
        (tmp_path / "corrupt.parquet").write_bytes(bytes(data))
        msg = problems_of(tmp_path / "corrupt.parquet")
        assert "corrupt.parquet: corrupt data in row group 0" in msg


@pytest.mark.parametrize("device", DEVICES)
def test_to_device(tmp_path, sequences, device):
    batch = load(write(sequences.token_table(), tmp_path / "d.parquet"), device=device)
    assert batch.device.type == device
    assert batch.to("cpu").equal(expected_batch(sequences))
    assert batch.seq_index.device.type == device


def test_parquet_metadata_is_not_needed(tmp_path, sequences):
    """Files written by other tools (no pandas metadata, dictionary ids) read the same."""
    table = sequences.token_table().replace_schema_metadata(None)
    table = table.set_column(
        table.schema.get_field_index("seq_id"), "seq_id", table["seq_id"].dictionary_encode()
    )
    path = tmp_path / "dict.parquet"
    pq.write_table(table, path, use_dictionary=True)
    assert load(path).seq_id.to_pylist() == sequences.seq_id


def test_from_buffers_reads_like_files(tmp_path, sequences):
    path = write(sequences.sequence_table(), tmp_path / "s.parquet")
    dump = Dump.from_buffers([("upload.parquet", path.read_bytes())])
    assert dump.load().equal(load(path))
    with pytest.raises(DumpProblems) as info:
        Dump.from_buffers([("a.parquet", b""), ("b.parquet", path.read_bytes()[:100])])
    assert [str(p) for p in info.value.problems] == [
        "a.parquet: empty file (0 bytes)",
        "b.parquet: truncated Parquet file (100 bytes, no footer); was the write interrupted?",
    ]


@pytest.mark.parametrize("keys", [("step",), ("step", "seq_id")])
def test_the_last_run_start_equals_the_last_of_all_run_starts(keys):
    """Runs shorter and far longer than the first look back (4096 rows), and one run only."""
    rng = np.random.default_rng(0)
    cases = [[3, 1, 7], [5000], [1, 20_000], [9000, 2, 70_000], list(rng.integers(1, 900, 60))]
    for lengths in cases:
        step = np.repeat(np.arange(len(lengths)) // 2, lengths)
        seq = np.repeat(np.arange(len(lengths)), lengths)
        table = pa.table({"step": step, "seq_id": seq})
        want = int(iscore.dump.readers._run_starts(table, keys)[-1])
        assert iscore.dump.readers._last_run_start(table, keys) == want


def test_a_batch_reads_as_one_line():
    """Its repr was a 41-line dump of tensors and ids."""
    batch = iscore.dump.Dump("data/drift.parquet", extras=True).load()
    assert repr(batch) == (
        "TokenBatch(48 sequences, 41,383 tokens (41,383 in the loss), steps 0..3, cpu, "
        "extra columns group_id, reward, advantage)"
    )


def _flat(lists: list[list]) -> list:
    return list(itertools.chain.from_iterable(lists))


def _routed(s: Sequences, seed: int = 0, k: int = 3) -> tuple[list[list], list[list], list]:
    """Expert ids per token for `s` (the trainer's in shuffled order, some swapped) and each
    token's turn, with the agreement an independent reference says they have."""
    rng = np.random.default_rng(seed)
    rollout, train, agrees, turns = [], [], [], []
    for n in s.lengths:
        ids = [rng.choice(16, k, replace=False).tolist() for _ in range(n)]
        other = [rng.permutation(i).tolist() for i in ids]
        for token in other:
            if rng.random() < 0.3:
                token[rng.integers(k)] = 16 + int(rng.integers(4))  # an expert not in ids
        rollout.append(ids)
        train.append(other)
        agrees.extend(set(a) == set(b) for a, b in zip(ids, other, strict=True))
        turns.append(np.sort(rng.integers(0, 3, n)).tolist())
    return rollout, train, [agrees, turns]


class TestRoutingAndTurns:
    @pytest.mark.parametrize("layout", ["token", "sequence"])
    def test_expert_ids_and_turns_are_read_with_their_tokens(self, tmp_path, layout):
        s = make_sequences([5, 1, 40, 7, 3, 12], steps=[0, 0, 0, 1, 1, 1])
        rollout, train, (agrees, turns) = _routed(s)
        ids = pa.list_(pa.int16())
        if layout == "token":
            table = s.token_table()
            table = table.append_column("rollout_experts", pa.array(_flat(rollout), ids))
            table = table.append_column("train_experts", pa.array(_flat(train), ids))
            table = table.append_column("turn", pa.array(_flat(turns)))
            # Rows shuffled within each sequence: pos restores the order, ids follow tokens.
            rng = np.random.default_rng(2)
            starts = np.concatenate([[0], np.cumsum(s.lengths)])
            table = table.take(
                np.concatenate(
                    [rng.permutation(np.arange(a, b)) for a, b in itertools.pairwise(starts)]
                )
            )
        else:
            table = s.sequence_table()
            table = table.append_column("rollout_experts", pa.array(rollout, pa.list_(ids)))
            table = table.append_column("train_experts", pa.array(train, pa.list_(ids)))
            table = table.append_column("turn", pa.array(turns))
        path = write(table, tmp_path / "r.parquet", row_group_size=7 if layout == "token" else 2)
        batch = load(path)
        assert batch.routing_agrees.tolist() == agrees
        assert batch.turn.tolist() == _flat(turns)
        assert "with turns, with routing agreement" in repr(batch)
        # Streamed in small chunks, the same tokens keep the same values.
        chunks = list(Dump(path).batches(max_tokens=6))
        assert torch.cat([c.routing_agrees for c in chunks]).tolist() == agrees
        assert torch.cat([c.turn for c in chunks]).tolist() == _flat(turns)
        picked = batch.select(torch.tensor([False, True, True, False, False, True]))
        assert picked.routing_agrees.tolist() == agrees[5:46] + agrees[-12:]
        assert batch.slice(2, 3).turn.tolist() == turns[2]

    @pytest.mark.parametrize("lengths", [[3] * 50, [1, 4, 2, 8, 1, 3] * 8])
    def test_agreement_is_equality_as_multisets(self, lengths):
        rng = np.random.default_rng(sum(lengths))
        a = [rng.integers(0, 4, n).tolist() for n in lengths]  # repeats, as across layers
        b = [
            rng.permutation(x).tolist()
            if rng.random() < 0.5
            else rng.integers(0, 4, len(x)).tolist()
            for x in a
        ]
        expected = [sorted(x) == sorted(y) for x, y in zip(a, b, strict=True)]
        got = iscore.dump.tensors.routing_agrees(pa.array(a), pa.array(b, pa.list_(pa.int8())))
        assert got.tolist() == expected and 0 < sum(expected) < len(expected)

    @pytest.mark.parametrize(
        ("columns", "said"),
        [
            (
                {"rollout_experts": [[1, 2], [3, 4], [5, -6], [7, 8]]},
                "column rollout_experts: 1 negative expert id at row 2",
            ),
            (
                {"train_experts": [[1, 2], [3, 4], [5, 6, 7], [7, 8]]},
                "column train_experts: 1 token whose list of expert ids differs in length from "
                "rollout_experts' (each token lists as many ids on both sides) at row 2",
            ),
            (
                {
                    "rollout_experts": [[1, 2], [], [5, 6], [7, 8]],
                    "train_experts": [[1, 2], [], [5, 6], [7, 8]],
                },
                "column rollout_experts: 1 empty list of expert ids (a token lists >= 1) at row 1",
            ),
            (
                {"train_experts": [[1, 2], [3, None], [5, 6], [7, 8]]},
                "column train_experts: 1 null value inside its lists at row 1",
            ),
            (
                {"train_experts": [[1, 2], None, [5, 6], [7, 8]]},
                "column train_experts: 1 null value at row 1",
            ),
            ({"turn": [1, 0, 0, 0]}, "column turn: turn decreases within a sequence (1 token)"),
            ({"turn": [0, None, 0, 0]}, "column turn: 1 null value at row 1"),
        ],
        ids=["negative", "lengths", "empty", "null-id", "null-list", "turn-back", "turn-null"],
    )
    def test_bad_values_name_file_column_and_row(self, tmp_path, columns, said):
        base = {
            "seq_id": [0, 0, 1, 1],
            "rollout_logprob": [-1.0, -0.5, -2.0, -0.1],
            "train_logprob": [-1.1, -0.5, -2.0, -0.2],
            "rollout_experts": [[1, 2], [3, 4], [5, 6], [7, 8]],
            "train_experts": [[2, 1], [3, 4], [5, 6], [8, 7]],
            "turn": [0, 0, 0, 1],
        }
        path = write(pa.table({**base, **columns}), tmp_path / "bad.parquet")
        msg = problems_of(path)
        assert f"bad.parquet, {said}" in msg

    def test_sequence_layout_nulls_and_lengths_name_the_row(self, tmp_path):
        ids = pa.list_(pa.list_(pa.int64()))
        base = {
            "rollout_logprob": pa.array([[-1.0, -0.5], [-2.0]]),
            "train_logprob": pa.array([[-1.1, -0.5], [-2.0]]),
            "rollout_experts": pa.array([[[1], [2]], [[3]]], ids),
            "train_experts": pa.array([[[1], [2]], [[3]]], ids),
        }
        for column, value, said in [
            (
                "train_experts",
                [[[1], [2]], [[None]]],
                "1 null value inside the lists of its lists at row 1",
            ),
            ("train_experts", [[[1], None], [[3]]], "1 null value inside its lists at row 0"),
            (
                "rollout_experts",
                [[[1]], [[3]]],
                "list lengths differ from rollout_logprob's (e.g. 1 vs 2) at row 0",
            ),
        ]:
            table = pa.table({**base, column: pa.array(value, ids)})
            msg = problems_of(write(table, tmp_path / "s.parquet"))
            assert f"s.parquet, column {column}: {said}" in msg, msg

    @pytest.mark.parametrize(
        ("table", "said"),
        [
            (
                {"rollout_experts": pa.array([[1], [2]])},
                "column rollout_experts: present without train_experts",
            ),
            (
                {
                    "rollout_experts": pa.array([[1.0], [2.0]]),
                    "train_experts": pa.array([[1.0], [2.0]]),
                },
                "column rollout_experts: expected an integer list column (token layout), found "
                "list<element: double>",
            ),
            (
                {"rollout_experts": pa.array([1, 2]), "train_experts": pa.array([1, 2])},
                "column train_experts: expected an integer list column (token layout), found int64",
            ),
            ({"turn": pa.array([0.5, 1.0])}, "column turn: expected an integer column"),
        ],
        ids=["one-side", "floats", "scalars", "turn-float"],
    )
    def test_column_problems(self, tmp_path, table, said):
        base = {"seq_id": [0, 1], "rollout_logprob": [-1.0, -0.5], "train_logprob": [-1.1, -0.5]}
        msg = problems_of(write(pa.table({**base, **table}), tmp_path / "c.parquet"))
        assert f"c.parquet, {said}" in msg, msg

    def test_the_files_of_a_dump_all_have_them_or_none_does(self, tmp_path):
        base = {"seq_id": [0, 1], "rollout_logprob": [-1.0, -0.5], "train_logprob": [-1.1, -0.5]}
        folder = tmp_path / "run"
        folder.mkdir()
        ids = {"rollout_experts": [[1], [2]], "train_experts": [[1], [3]], "turn": [0, 0]}
        write(pa.table({**base, **ids}), folder / "a.parquet")
        write(pa.table({**base, "seq_id": [2, 3]}), folder / "b.parquet")
        msg = problems_of(folder)
        assert "b.parquet, column rollout_experts: missing here but present in" in msg
        assert "--column rollout_experts= --column train_experts=" in msg
