"""A generated corpus of hostile inputs: dumps, configs and paths an attacker or a broken
pipeline could hand iscore, each with what iscore must answer.

`dumps()` and `configs()` return name -> writer (a function of a directory that writes the
input there and returns its path); `test_hostile.py` runs every one through every command
that reads it.
"""

from __future__ import annotations

import io
import json
import pickle
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from iscore.dump.writer import PROVENANCE_KEY
from iscore.frameworks.resolve import MAX_CONFIG_BYTES

Writer = Callable[[Path], Path]

_F64 = pa.list_(pa.float64())
_IDS = pa.array([[1], [2], [3], [4]])
"""A token-layout file's expert ids (one per token)."""


def _write(table: pa.Table, name: str) -> Writer:
    def write(directory: Path) -> Path:
        path = directory / name
        pq.write_table(table, path)
        return path

    return write


def _sequence(**columns: pa.Array) -> pa.Table:
    """Two sequences of two tokens, with `columns` replacing or adding to the defaults."""
    base = {
        "seq_id": pa.array([0, 1]),
        "rollout_logprob": pa.array([[-1.0, -0.5], [-2.0, -0.1]], _F64),
        "train_logprob": pa.array([[-1.1, -0.5], [-2.0, -0.2]], _F64),
    }
    return pa.table({**base, **columns})


def _token(**columns: pa.Array) -> pa.Table:
    """The same two sequences in token layout."""
    base = {
        "seq_id": pa.array([0, 0, 1, 1]),
        "rollout_logprob": pa.array([-1.0, -0.5, -2.0, -0.1]),
        "train_logprob": pa.array([-1.1, -0.5, -2.0, -0.2]),
    }
    return pa.table({**base, **columns})


def dumps() -> dict[str, Writer]:
    """Dumps every reader must refuse with a problem naming file, column and row."""
    big = 2**63 + 5
    return {
        # float64 values beyond float32's range are infinite once cast to the engine's dtype
        "logprob_f64_overflow_neg": _write(
            _token(rollout_logprob=pa.array([-1.0, -1e300, -2.0, -0.1])), "t.parquet"
        ),
        "logprob_f64_overflow_in_list": _write(
            _sequence(train_logprob=pa.array([[-1.1, -1e39], [-2.0, -0.2]], _F64)), "s.parquet"
        ),
        "logprob_positive_f64": _write(
            _token(train_logprob=pa.array([-1.0, 1e300, -2.0, -0.1])), "t.parquet"
        ),
        "logprob_nan": _write(
            _token(train_logprob=pa.array([-1.0, float("nan"), -2.0, -0.1])), "t.parquet"
        ),
        # integers int64 cannot hold
        "step_uint64_above_int64": _write(
            _sequence(step=pa.array([big, 1], pa.uint64())), "s.parquet"
        ),
        "step_uint64_token_layout": _write(
            _token(step=pa.array([big, big, 1, 1], pa.uint64())), "t.parquet"
        ),
        "seq_id_uint64_above_int64": _write(
            _token(seq_id=pa.array([big, big, 1, 1], pa.uint64())), "t.parquet"
        ),
        "pos_uint64_above_int64": _write(
            _token(pos=pa.array([0, big, 0, 1], pa.uint64())), "t.parquet"
        ),
        "pos_uint64_in_list": _write(
            _sequence(pos=pa.array([[0, big], [0, 1]], pa.list_(pa.uint64()))), "s.parquet"
        ),
        # nulls
        "null_in_loss_mask_list": _write(
            _sequence(loss_mask=pa.array([[True, None], [True, True]])), "s.parquet"
        ),
        "null_in_pos_list": _write(
            _sequence(pos=pa.array([[0, None], [0, 1]], pa.list_(pa.int64()))), "s.parquet"
        ),
        "null_in_logprob_list": _write(
            _sequence(rollout_logprob=pa.array([[-1.0, None], [-2.0, -0.1]], _F64)), "s.parquet"
        ),
        "null_loss_mask_token": _write(
            _token(loss_mask=pa.array([True, None, True, True])), "t.parquet"
        ),
        "null_seq_id": _write(_sequence(seq_id=pa.array([0, None])), "s.parquet"),
        # nothing to compute on
        "all_sequences_empty": _write(
            _sequence(
                rollout_logprob=pa.array([[], []], _F64), train_logprob=pa.array([[], []], _F64)
            ),
            "s.parquet",
        ),
        "no_loss_token": _write(_token(loss_mask=pa.array([False] * 4)), "t.parquet"),
        "no_loss_token_lists": _write(
            _sequence(loss_mask=pa.array([[False, False], [False, False]])), "s.parquet"
        ),
        # fractional ids and positions (Parquet has no complex type: see test_writer_casts)
        "step_fractional": _write(_sequence(step=pa.array([1.5, 2.0])), "s.parquet"),
        "seq_id_fractional": _write(_token(seq_id=pa.array([0.5, 0.5, 1.0, 1.0])), "t.parquet"),
        "pos_fractional": _write(_token(pos=pa.array([0.0, 0.5, 0.0, 1.0])), "t.parquet"),
        "loss_mask_two": _write(_token(loss_mask=pa.array([1, 2, 1, 1])), "t.parquet"),
        # files that are not what they claim
        "not_parquet": lambda d: _bytes(d / "x.parquet", b'{"a": 1}\n'),
        "truncated": lambda d: _bytes(d / "x.parquet", b"PAR1" + b"\0" * 64),
        "empty_file": lambda d: _bytes(d / "x.parquet", b""),
        # a column twice: which one would be read?
        "duplicate_column": _write(
            _token().append_column("rollout_logprob", pa.array([-1.0, -0.5, -2.0, -0.1])),
            "t.parquet",
        ),
        # iscore's own metadata, malformed
        **{
            f"provenance_{name}": _write(
                _sequence().replace_schema_metadata({PROVENANCE_KEY: raw}), "s.parquet"
            )
            for name, raw in {
                "not_json": b"{framework: verl",
                "a_list": b"[1, 2]",
                "a_string": b'"verl"',
                "source_files_a_number": b'{"framework": "nemo_rl", "source_files": 3}',
            }.items()
        },
        # a column name that is not UTF-8 (the footer has no checksum)
        "column_name_not_utf8": _not_utf8,
        # footers pyarrow aborts the process on (a C++ exception its binding does not catch):
        # seq_id's repetition type as an i16 (skipped, so the column reads as required and
        # its level histogram misfits); seq_id's chunk typed DOUBLE (read with --steps)
        "footer_levels_misfit": _patched(b"%\x02\x18\x06seq_id", b"$\x02\x18\x06seq_id"),
        "footer_type_misfit": _patched(b"\x1c\x15\x04\x195", b"\x1c\x15\n\x195"),
        # a byte flipped in a data page of a file written with page checksums
        "flipped_byte_with_checksum": _flipped,
        # policy_logprob in one file of a folder but not in the other
        "policy_in_some_files": _policy_in_some_files,
        # expert ids and turns: bad values, one side alone, in one file of a folder only
        "experts_negative_id": _write(
            _token(rollout_experts=pa.array([[1], [-2], [3], [4]]), train_experts=_IDS),
            "t.parquet",
        ),
        "experts_uint64_above_int64": _write(
            _token(
                rollout_experts=pa.array([[1], [big], [3], [4]], pa.list_(pa.uint64())),
                train_experts=_IDS,
            ),
            "t.parquet",
        ),
        "experts_null_inside_inner_list": _write(
            _sequence(
                rollout_experts=pa.array([[[1], [2]], [[3], [None]]]),
                train_experts=pa.array([[[1], [2]], [[3], [4]]]),
            ),
            "s.parquet",
        ),
        "experts_one_side": _write(
            _sequence(train_experts=pa.array([[[1], [2]], [[3], [4]]])), "s.parquet"
        ),
        "turn_goes_back": _write(_token(turn=pa.array([1, 0, 0, 1])), "t.parquet"),
        "experts_in_some_files": _two_files(
            _sequence(
                rollout_experts=pa.array([[[1], [2]], [[3], [4]]]),
                train_experts=pa.array([[[1], [2]], [[3], [4]]]),
            ),
            _sequence(seq_id=pa.array([2, 3])),
        ),
        # files that disagree on their layout, or on the type of seq_id or an extra column
        "layouts_differ": _two_files(_token(), _sequence(seq_id=pa.array([2, 3]))),
        "seq_id_types_differ": _two_files(_sequence(), _sequence(seq_id=pa.array(["a", "b"]))),
        "reward_types_differ": _two_files(
            _sequence(reward=pa.array([1.0, 0.0])),
            _sequence(seq_id=pa.array([2, 3]), reward=pa.array(["good", "bad"])),
        ),
    }


def _patched(old: bytes, new: bytes) -> Writer:
    """The token-layout dump with the first `old` in its footer replaced by `new`."""

    def write(directory: Path) -> Path:
        path = directory / "f.parquet"
        pq.write_table(_token(step=pa.array([0, 0, 1, 1])), path)
        data = path.read_bytes()
        at = data.index(old, len(data) - 8 - int.from_bytes(data[-8:-4], "little"))
        path.write_bytes(data[:at] + new + data[at + len(old) :])
        return path

    return write


def _not_utf8(directory: Path) -> Path:
    path = directory / "name.parquet"
    pq.write_table(_token(), path)
    path.write_bytes(path.read_bytes().replace(b"train_logprob", b"\xf2rain_logprob"))
    return path


def _flipped(directory: Path) -> Path:
    path = directory / "crc.parquet"
    table = _token(rollout_logprob=pa.array([-1.0, -0.5, -2.0, -0.125]))
    pq.write_table(table, path, write_page_checksum=True, compression="none")
    data = bytearray(path.read_bytes())
    data[data.index(np.float64(-0.125).tobytes()) + 3] ^= 0x40  # still a valid float
    path.write_bytes(bytes(data))
    return path


def _two_files(a: pa.Table, b: pa.Table) -> Writer:
    def write(directory: Path) -> Path:
        folder = directory / "run"
        folder.mkdir()
        pq.write_table(a, folder / "a.parquet")
        pq.write_table(b, folder / "b.parquet")
        return folder

    return write


def _policy_in_some_files(directory: Path) -> Path:
    folder = directory / "run"
    folder.mkdir()
    policy = pa.array([[-1.0, -0.5], [-2.0, -0.1]], _F64)
    pq.write_table(_sequence(policy_logprob=policy), folder / "a.parquet")
    pq.write_table(_sequence(seq_id=pa.array([2, 3])), folder / "b.parquet")
    return folder


_NEMO = {
    "token_loss_mask": [[0, 1, 1]],
    "generation_logprobs": [[0.0, -0.5, -0.25]],
    "prev_logprobs": [[-2.0, -0.5, -0.375]],
}
_PRIME = {
    "step": 1,
    "rank": 0,
    "loss_mask": [False, True, True],
    "inference_logprobs": [0.0, -0.5, -0.25],
    "trainer_logprobs": [-2.0, -0.5, -0.375],
}


def _nemo(line: str | dict) -> Writer:
    """A NeMo-RL log folder of one step whose one line is `line` (a record or raw JSON)."""

    def write(directory: Path) -> Path:
        (directory / "logs").mkdir()
        text = line if isinstance(line, str) else json.dumps(line)
        (directory / "logs" / "train_data_step1.jsonl").write_text(text + "\n")
        return directory / "logs"

    return write


def _prime(line: str | dict) -> Writer:
    """A prime-rl export of one step, one rank, whose one line is `line`."""

    def write(directory: Path) -> Path:
        step = directory / "token_exports" / "step_1"
        step.mkdir(parents=True)
        text = line if isinstance(line, str) else json.dumps(line)
        (step / "rank_0.jsonl").write_text(text + "\n")
        (step / "STABLE").touch()
        return directory / "token_exports"

    return write


def _slime(sample: dict | None = None, payload: dict | None = None) -> Writer:
    """A slime train dump (format_version 2) of one sample, with `sample`'s fields replaced;
    or `payload` saved as it is."""

    def write(directory: Path) -> Path:
        base = {
            "sample_index": 0,
            "response_lengths": 2,
            "rollout_log_probs": torch.tensor([-1.0, -0.5]),
            "log_probs": torch.tensor([-1.1, -0.5]),
        }
        data = payload or {"format_version": 2, "rollout_id": 1, "samples": [{**base, **sample}]}
        torch.save(data, directory / "1.pt")
        return directory / "1.pt"

    return write


SKYRL_MODULE = "skyrl.backends.skyrl_train.training_batch"


def skyrl_pickle(state: dict) -> bytes:
    """The bytes SkyRL's `TensorBatch.save` writes for a batch of this `state`
    (`_rebuild_tensor_batch(TrainingInputBatch, state)`), built without SkyRL: the two
    globals by name, then the state pickled as plain containers."""
    module = SKYRL_MODULE.encode()
    head = b"\x80\x03c" + module + b"\n_rebuild_tensor_batch\nc" + module
    body = pickle.dumps(state, protocol=3)[2:-1]  # no PROTO, no STOP: a nested value
    return head + b"\nTrainingInputBatch\n" + body + b"\x86R."


def numpy_state(array: np.ndarray) -> dict:
    """A tensor as SkyRL's batch state holds it (its numpy format)."""
    return {
        "format": "numpy",
        "data": array.tobytes(),
        "shape": array.shape,
        "dtype": str(array.dtype),
    }


def torch_state(tensor: torch.Tensor) -> dict:
    """A tensor as SkyRL's batch state holds a dtype numpy lacks: torch.save bytes."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return {"format": "torch", "data": buffer.getvalue()}


def skyrl_batch(fields: dict | None = None, metadata: dict | None = None) -> dict:
    """The state of a SkyRL batch of two right-aligned rows, `fields` replacing its tensors."""
    base = {
        "response_mask": numpy_state(np.array([[1, 1], [0, 1]])),
        "rollout_logprobs": numpy_state(np.array([[-1.0, -0.5], [0.0, -2.0]], np.float32)),
        "action_log_probs": numpy_state(np.array([[-1.1, -0.5], [0.0, -2.0]], np.float32)),
    }
    return {"batch_dict": {**base, **(fields or {})}, "metadata": metadata}


def _skyrl(fields: dict | None = None, metadata: dict | None = None) -> Writer:
    def write(directory: Path) -> Path:
        path = directory / "global_step_3_training_input.pkl"
        path.write_bytes(skyrl_pickle(skyrl_batch(fields, metadata)))
        return path

    return write


def _bf16_state() -> dict:
    return torch_state(torch.ones(2, 2, dtype=torch.bfloat16))


def _zeros_claiming_a_tebibyte() -> dict:
    """A [2^20, 2^20] float tensor over one float of storage (stride 0): 4 TiB as numpy."""
    return torch_state(torch.zeros(1).expand(2**20, 2**20))


def framework_dumps() -> dict[str, Writer]:
    """Framework dumps every command must refuse with one problem naming the file."""
    deep = "[" * 100_000 + "]" * 100_000
    return {
        "nemo_deep_nesting": _nemo(json.dumps(_NEMO)[:-1] + f', "content": {deep}}}'),
        "nemo_ragged_mask": _nemo({**_NEMO, "token_loss_mask": [[0, [1, 1], 1]]}),
        "nemo_idx_2_70": _nemo({**_NEMO, "idx": 2**70}),
        "nemo_token_id_2_40": _nemo({**_NEMO, "token_ids": [[1, 2**40, 3]]}),
        "nemo_logprob_string": _nemo({**_NEMO, "prev_logprobs": [[-2.0, "-0.5", -0.375]]}),
        "nemo_logprob_bool": _nemo({**_NEMO, "prev_logprobs": [[-2.0, True, -0.375]]}),
        "nemo_mask_two": _nemo({**_NEMO, "token_loss_mask": [[0, 2, 1]]}),
        "prime_deep_nesting": _prime('{"loss_mask": ' + deep + "}"),
        "prime_ragged_mask": _prime({**_PRIME, "loss_mask": [0, [1], 1]}),
        "prime_index_2_70": _prime({**_PRIME, "export_sequence_idx": 2**70}),
        "prime_rank_a_list": _prime({**_PRIME, "rank": [0]}),
        "prime_token_id_2_40": _prime({**_PRIME, "token_ids": [1, 2**40, 3]}),
        "prime_schema_version_a_list": _prime({**_PRIME, "schema_version": []}),  # TypeError
        "slime_index_string": _slime({"sample_index": "abc"}),
        "slime_index_fraction": _slime({"sample_index": 1.5}),
        "slime_index_2_70": _slime({"sample_index": 2**70}),
        "slime_lengths_two_elements": _slime({"response_lengths": torch.tensor([2, 2])}),
        "slime_lengths_negative": _slime({"response_lengths": -1}),
        "slime_complex_logprobs": _slime({"log_probs": torch.tensor([-1.1 + 2j, -0.5 + 0j])}),
        "slime_legacy_truncated": _slime(
            payload={
                "rollout_id": 1,
                "rank": 0,
                "rollout_data": {
                    "response_lengths": [2, 2],
                    "sample_indices": [0, 1],
                    "rollout_log_probs": [torch.tensor([-1.0, -0.5])] * 2,
                    "log_probs": [torch.tensor([-1.0, -0.5])],  # one sample short
                },
            }
        ),
        "skyrl_a_tebibyte": _skyrl({k: _zeros_claiming_a_tebibyte() for k in _SKYRL_FIELDS}),
        "skyrl_pad_size_true": _skyrl(metadata={"pad_size": True}),
        "skyrl_tensor_list_field": _skyrl(  # a TypeError from numpy, for bf16
            {"response_mask": {"format": "tensor_list", "items": [_bf16_state()]}}
        ),
    }


_SKYRL_FIELDS = ("response_mask", "rollout_logprobs", "action_log_probs")


def _bytes(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


VERL = "algorithm: {rollout_correction: {rollout_is: token, rollout_is_threshold: 2.0}}\n"


def _bomb(levels: int = 9) -> str:
    """A "billion laughs" YAML: 9 levels of 9 aliases each expand to 9**9 strings."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "framework: verl\n" + "\n".join(lines) + "\n"


def configs() -> dict[str, str]:
    """Config texts every config reader must refuse with one short line."""
    return {
        "yaml_alias_bomb": _bomb(),
        "yaml_merge_alias": "base: &b {rollout_is: token}\nframework: verl\n"
        "algorithm: {rollout_correction: {<<: *b}}\n",
        "oversized": "framework: verl\n" + VERL + "# " + "x" * MAX_CONFIG_BYTES + "\n",
        "deep_nesting": "framework: verl\nx: " + "[" * 20_000 + "]" * 20_000 + "\n",
        "long_value": "framework: verl\nalgorithm: {rollout_correction: {rollout_is: "
        + "t" * 300_000
        + "}}\n",
        "long_framework": "framework: " + "v" * 300_000 + "\n",
        "long_key": "framework: verl\n" + "k" * 300_000 + ": 1\n",
        "not_a_mapping": "- framework\n- verl\n",
        "invalid_yaml": "framework: verl\nalgorithm: {\n",
        "binary": "\x00\x01\x02framework",
        "threshold_int_beyond_float": "framework: verl\nalgorithm: {rollout_correction: "
        "{rollout_is: token, rollout_is_threshold: 1" + "0" * 400 + "}}\n",
        "threshold_nan": VERL.replace("2.0", ".nan").replace(
            "algorithm", "framework: verl\nalgorithm"
        ),
        "wrong_type_mapping": "framework: verl\nalgorithm: {rollout_correction: "
        + "["
        + ", ".join(["1"] * 50_000)
        + "]}\n",
    }


def sizes() -> dict[str, int]:
    """Corpus size per class (the security note quotes these)."""
    return {
        "dump values": len(dumps()),
        "framework dumps": len(framework_dumps()),
        "configs": len(configs()),
    }


def valid_dump() -> pa.Table:
    """A small valid dump in sequence layout (the reference answers are computed on it)."""
    rng = np.random.default_rng(0)
    rollout = [(-rng.random(n) * 3).tolist() for n in (3, 5, 2, 7)]
    train = [[x + 0.01 * rng.standard_normal() for x in r] for r in rollout]
    train = [[min(x, 0.0) for x in r] for r in train]
    return pa.table(
        {
            "step": [0, 0, 1, 1],
            "seq_id": [0, 1, 2, 3],
            "rollout_logprob": pa.array(rollout, _F64),
            "train_logprob": pa.array(train, _F64),
        }
    )
