"""Hypothesis strategies for hostile inputs: Parquet dumps, framework files and configs.

Each builds what a user or a broken pipeline could hand iscore, from a valid base that a
draw then breaks in a few ways (or not at all, so valid inputs are exercised too).
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
import math

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from hypothesis import assume
from hypothesis import strategies as st

from iscore.dump.writer import PROVENANCE_KEY

NAN, INF = math.nan, math.inf

# ------------------------------------------------------------------------------- values

VALID_EXTREMES = (0.0, -0.0, -1e-45, -1e-300, -3e38, -3.4028235e38)
"""Valid log-probs (finite, <= 0, within float32) at the edges: zero, denormals, -3.4e38."""

INVALID = (-3.5e38, -1e300, 1e-30, 5.0, NAN, INF, -INF)
"""Log-probs iscore refuses: beyond float32's range, positive, not finite."""

_ORDINARY = st.floats(-12.0, 0.0, allow_nan=False)
VALID_LOGPROBS = st.one_of(_ORDINARY, _ORDINARY, _ORDINARY, st.sampled_from(VALID_EXTREMES))
"""Valid log-probs: mostly ordinary, sometimes extreme."""

LOGPROBS = st.one_of(VALID_LOGPROBS, VALID_LOGPROBS, st.sampled_from(INVALID))
"""Log-probs of a hostile input: valid ones and a fair share of invalid ones."""


def logprobs(n: int, hostile: bool) -> st.SearchStrategy:
    """`n` log-probs; invalid ones only where `hostile`."""
    return st.lists(LOGPROBS if hostile else VALID_LOGPROBS, min_size=n, max_size=n)


BREAKS = st.sampled_from([0, 0, 0, 1, 1, 2, 3])
"""How many ways an input is broken: none half the time, so valid inputs are run too."""

HUGE_INTS = (2**31, 2**40, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, -(2**63), -1)
"""Integers at the edges of int32, float64's exact range, int64 and uint64."""

_TYPES = {
    "f64": pa.float64(),
    "f32": pa.float32(),
    "f16": pa.float16(),
    "i8": pa.int8(),
    "i64": pa.int64(),
    "u64": pa.uint64(),
    "bool": pa.bool_(),
    "str": pa.string(),
    "bin": pa.binary(),
    "null": pa.null(),
    "dict": pa.dictionary(pa.int32(), pa.string()),
    "date": pa.date32(),
    "struct": pa.struct([("a", pa.int64())]),
}


def _values(kind: str) -> st.SearchStrategy:
    """One value of a column of type `_TYPES[kind]` (nulls included)."""
    values = {
        "f64": LOGPROBS,
        "f32": LOGPROBS,  # cast by `_array`
        "f16": st.floats(width=16),
        "i8": st.integers(-128, 127),
        "i64": st.one_of(
            st.integers(-3, 8), st.sampled_from(HUGE_INTS).filter(lambda v: v < 2**63)
        ),
        "u64": st.one_of(st.integers(0, 8), st.sampled_from([2**63, 2**64 - 1])),
        "bool": st.booleans(),
        "str": st.text(max_size=3),
        "bin": st.binary(max_size=3),
        "null": st.none(),
        "dict": st.text(max_size=2),
        "date": st.integers(0, 20_000),
        "struct": st.fixed_dictionaries({"a": st.integers(0, 3)}),
    }[kind]
    return st.one_of(st.none(), values) if kind != "null" else values


def _array(values: list, kind: str) -> pa.Array:
    if kind == "dict":
        return pa.array(values, pa.string()).dictionary_encode()
    if kind == "f32":
        with np.errstate(over="ignore"):
            return pa.array(values, pa.float64()).cast(pa.float32(), safe=False)
    return pa.array(values, _TYPES[kind])


@st.composite
def column_of(draw, kind: str, rows: int, lengths: list[int] | None) -> pa.Array:
    """A column of `rows` scalars, or (with `lengths`) of lists that long, of `kind`."""
    if lengths is None:
        return _array(draw(st.lists(_values(kind), min_size=rows, max_size=rows)), kind)
    flat = draw(st.lists(_values(kind), min_size=sum(lengths), max_size=sum(lengths)))
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    large = draw(st.booleans())
    items = _array(flat, kind)
    if large:
        return pa.LargeListArray.from_arrays(pa.array(offsets.astype(np.int64)), items)
    return pa.ListArray.from_arrays(pa.array(offsets), items)


# ------------------------------------------------------------------------------ Parquet

PER_TOKEN = ("rollout_logprob", "train_logprob", "policy_logprob", "loss_mask", "pos")


@st.composite
def _base(draw, layout: str, first_id: int, optional: frozenset[str]) -> pa.Table:
    """A valid dump of a few short sequences (some empty), with the `optional` columns."""
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    steps = sorted(draw(st.lists(st.integers(0, 3), min_size=n, max_size=n)))
    total = sum(lengths)
    rollout = draw(logprobs(total, draw(st.booleans())))
    noise = draw(st.lists(st.floats(-0.2, 0.2), min_size=total, max_size=total))
    train = [
        min(r + e, 0.0) if math.isfinite(r) and r > -1e30 else r
        for r, e in zip(rollout, noise, strict=True)
    ]
    per_token = {"rollout_logprob": (rollout, pa.float64()), "train_logprob": (train, pa.float64())}
    if "policy_logprob" in optional:
        policy = [t if draw(st.booleans()) else r for t, r in zip(train, rollout, strict=True)]
        per_token["policy_logprob"] = (policy, pa.float64())
    if "loss_mask" in optional:
        mask = draw(st.lists(st.booleans(), min_size=total, max_size=total))
        per_token["loss_mask"] = (mask, pa.bool_())
    if "pos" in optional:
        pos = []
        for length in lengths:
            order = list(range(length))
            pos += draw(st.permutations(order)) if draw(st.booleans()) else order
        per_token["pos"] = (pos, pa.int64())
    ids = list(range(first_id, first_id + n))
    if layout == "token":
        columns = {"seq_id": pa.array(np.repeat(ids, lengths), pa.int64())}
        if "step" in optional:
            columns["step"] = pa.array(np.repeat(steps, lengths), pa.int64())
        columns |= {name: pa.array(v, t) for name, (v, t) in per_token.items()}
        return pa.table(columns)
    bounds = list(itertools.pairwise(np.concatenate([[0], np.cumsum(lengths)])))
    columns = {"seq_id": pa.array(ids, pa.int64())}
    if "step" in optional:
        columns["step"] = pa.array(steps, pa.int64())
    for name, (values, kind) in per_token.items():
        columns[name] = pa.array([values[a:b] for a, b in bounds], pa.list_(kind))
    if "reward" in optional:
        rewards = draw(st.lists(st.one_of(st.none(), st.floats()), min_size=n, max_size=n))
        columns["reward"] = pa.array(rewards, pa.float64())
    return pa.table(columns)


def _json_values() -> st.SearchStrategy:
    scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=5))
    return st.recursive(
        scalars,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
        ),
        max_leaves=8,
    )


PROVENANCE = st.one_of(
    st.builds(
        lambda v: v.encode(),
        st.one_of(
            _json_values().map(lambda v: json.dumps(v)),
            st.fixed_dictionaries(
                {"framework": st.one_of(st.none(), st.text(max_size=8), st.integers())},
                optional={
                    "source_files": _json_values(),
                    "steps": _json_values(),
                    "notes": _json_values(),
                },
            ).map(lambda v: json.dumps(v)),
        ),
    ),
    st.binary(max_size=20),
)
"""`iscore.provenance` metadata: JSON of any shape, a plausible record, or raw bytes."""

_ALIASES = ("rollout_logprobs", "old_log_probs", "response_mask", "inference_logprobs")


def _lengths(column: pa.ChunkedArray) -> list[int] | None:
    column = column.combine_chunks()
    if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
        return [len(v) if v is not None else 0 for v in column.to_pylist()]
    return None


@st.composite
def _mutated(draw, table: pa.Table, layout: str) -> pa.Table:
    """`table` broken in up to three ways (or not at all)."""
    for _ in range(draw(BREAKS)):
        names = table.column_names
        what = draw(
            st.sampled_from(
                [
                    "drop",
                    "duplicate",
                    "retype",
                    "retype",
                    "nulls",
                    "ragged",
                    "alias",
                    "shuffle",
                    "ints",
                    "empty",
                    "metadata",
                ]
            )
        )
        if what == "empty":
            table = table.slice(0, 0)
            continue
        if what == "metadata":
            table = table.replace_schema_metadata({PROVENANCE_KEY: draw(PROVENANCE)})
            continue
        if what == "shuffle":
            order = draw(st.permutations(list(range(table.num_rows))))
            table = table.take(pa.array(order, pa.int64()))
            continue
        if not names:
            continue
        name = draw(st.sampled_from(names))
        index = names.index(name)
        column = table.column(index).combine_chunks()
        if what == "drop":
            table = table.remove_column(index)
        elif what == "duplicate":
            table = table.append_column(name, column)
        elif what == "alias":
            table = table.append_column(draw(st.sampled_from(_ALIASES)), column)
        elif what == "retype":
            kind = draw(st.sampled_from(list(_TYPES)))
            lengths = _lengths(table.column(index))
            if lengths is None and layout == "sequence" and name in PER_TOKEN:
                lengths = draw(
                    st.lists(st.integers(0, 4), min_size=table.num_rows, max_size=table.num_rows)
                )
            if lengths is not None and draw(st.integers(0, 3)) == 0:
                lengths = None  # a list column becomes scalars
            table = table.set_column(index, name, draw(column_of(kind, table.num_rows, lengths)))
        elif what == "nulls" and table.num_rows:
            values = column.to_pylist()
            row = draw(st.integers(0, len(values) - 1))
            if isinstance(values[row], list) and values[row]:
                values[row][draw(st.integers(0, len(values[row]) - 1))] = None
            else:
                values[row] = None
            table = table.set_column(index, name, pa.array(values, column.type))
        elif what == "ragged" and _lengths(table.column(index)) and table.num_rows:
            values = column.to_pylist()
            row = draw(st.integers(0, len(values) - 1))
            values[row] = (
                (values[row] or [])[:-1] if draw(st.booleans()) else (values[row] or []) + [-1.0]
            )
            with contextlib.suppress(pa.ArrowInvalid, pa.ArrowTypeError):  # -1.0 among strings
                table = table.set_column(index, name, pa.array(values, column.type))
        elif what == "ints" and table.num_rows:
            kind = draw(st.sampled_from([pa.int64(), pa.uint64()]))
            pick = st.sampled_from(
                [v for v in HUGE_INTS if (v >= 0 if kind == pa.uint64() else v < 2**63)]
            )
            lengths = _lengths(table.column(index))
            if lengths is None:
                values = draw(st.lists(pick, min_size=table.num_rows, max_size=table.num_rows))
                table = table.set_column(index, name, pa.array(values, kind))
            else:
                values = [draw(st.lists(pick, min_size=n, max_size=n)) for n in lengths]
                table = table.set_column(index, name, pa.array(values, pa.list_(kind)))
    return table


@st.composite
def _written(draw, table: pa.Table) -> bytes:
    """`table` as Parquet bytes, written with drawn options, sometimes then damaged."""
    sink = pa.BufferOutputStream()
    try:
        pq.write_table(
            table,
            sink,
            row_group_size=draw(st.sampled_from([None, 1, 2, 3])),
            compression=draw(st.sampled_from(["none", "snappy", "zstd"])),
            use_dictionary=draw(st.booleans()),
            write_page_checksum=draw(st.booleans()),
            store_schema=draw(st.booleans()),
            data_page_version=draw(st.sampled_from(["1.0", "2.0"])),
        )
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        assume(False)  # a type Parquet cannot store: no file to hand iscore
    data = bytearray(sink.getvalue().to_pybytes())
    damage = draw(st.sampled_from(["none", "none", "none", "flip", "truncate"]))
    if damage == "flip":
        at = draw(st.integers(0, len(data) - 1))
        data[at] ^= 1 << draw(st.integers(0, 7))
    elif damage == "truncate":
        data = data[: draw(st.integers(0, len(data) - 1))]
    return bytes(data)


OPTIONAL = ("step", "loss_mask", "pos", "policy_logprob", "reward")


@st.composite
def parquet_dumps(draw) -> list[tuple[str, bytes]]:
    """A dump of one to three Parquet files, as (name, bytes): valid, or broken in a few ways
    per file (so files can also disagree with each other)."""
    layout = draw(st.sampled_from(["token", "sequence"]))
    optional = frozenset(draw(st.sets(st.sampled_from(OPTIONAL))))
    files = []
    for i in range(draw(st.integers(1, 3))):
        table = draw(_base(layout, 10 * i, optional))
        table = draw(_mutated(table, layout))
        files.append((f"part{i}.parquet", draw(_written(table))))
    return files


# ------------------------------------------------------------------------ JSON Lines

HOSTILE_JSON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.sampled_from([10**400, -(10**400), 2**31, 2**40, 2**63, -1]),
    st.floats(),
    st.text(max_size=4),
    st.lists(
        st.one_of(
            st.integers(-1, 2),
            st.floats(-3, 0),
            st.none(),
            st.booleans(),
            st.text(max_size=2),
            st.lists(st.integers(0, 1), max_size=2),
            st.sampled_from([10**400, 2**40, math.nan, math.inf]),
        ),
        max_size=5,
    ),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
"""A JSON value where a framework's record holds a number or a list of them."""

_DEEP = "[" * 3000 + "]" * 3000


@st.composite
def _record_mutations(draw, record: dict, keys: list[str]) -> dict:
    """`record` with up to three of its fields replaced, deleted, cut or extended."""
    for _ in range(draw(BREAKS)):
        key = draw(st.sampled_from(keys))
        what = draw(st.sampled_from(["replace", "delete", "item", "length"]))
        if what == "delete":
            record.pop(key, None)
        elif what == "replace" or not isinstance(record.get(key), list):
            record[key] = draw(HOSTILE_JSON)
        else:
            values = record[key]
            inner = values[0] if values and isinstance(values[0], list) else values
            if what == "item" and inner:
                inner[draw(st.integers(0, len(inner) - 1))] = draw(HOSTILE_JSON)
            elif inner and draw(st.booleans()):
                inner.pop()
            else:
                inner.append(draw(st.sampled_from([0, 1, -0.5])))
    return record


@st.composite
def _lines(draw, records: list[dict]) -> bytes:
    """The records as JSON Lines, sometimes with a line broken."""
    lines = [json.dumps(r).encode() for r in records]
    damage = draw(
        st.sampled_from(["none", "none", "none", "cut", "utf8", "deep", "array", "blank"])
    )
    at = draw(st.integers(0, len(lines) - 1))
    if damage == "cut":
        lines[at] = lines[at][: draw(st.integers(0, len(lines[at])))]
    elif damage == "utf8":
        lines[at] = lines[at][:-1] + b'"\xff\xfe"}'
    elif damage == "deep":
        lines[at] = lines[at][:-1] + b', "content": ' + _DEEP.encode() + b"}"
    elif damage == "array":
        lines[at] = b"[" + lines[at] + b"]"
    elif damage == "blank":
        lines.insert(at, b"   ")
    return b"\n".join(lines) + (b"\n" if draw(st.booleans()) else b"")


@st.composite
def nemo_rl_files(draw) -> list[tuple[str, bytes]]:
    """NeMo-RL train_data_step{N}.jsonl files, valid or broken."""
    files = []
    hostile = draw(st.booleans())
    for step in draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True)):
        records = []
        for index in range(draw(st.integers(1, 3))):
            n = draw(st.integers(0, 5))
            mask = draw(st.lists(st.integers(0, 1), min_size=n, max_size=n))
            rollout = draw(logprobs(n, hostile))
            record = {
                "token_loss_mask": [mask],
                "generation_logprobs": [rollout],
                "prev_logprobs": [[min(x + 0.01, 0.0) if math.isfinite(x) else x for x in rollout]],
                "token_ids": [draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n))],
                "advantages": [[0.5] * n],
                "rewards": [draw(st.floats(-1, 1))],
                "sample_loss_mask": [draw(st.sampled_from([0, 1, 1.0]))],
                "idx": index,
            }
            keys = list(record)
            records.append(draw(_record_mutations(record, keys)))
        files.append((f"train_data_step{step}.jsonl", draw(_lines(records))))
    return files


@st.composite
def prime_rl_files(draw) -> list[tuple[str, bytes]]:
    """prime-rl token_exports/step_{N}/rank_{R}.jsonl files, valid or broken."""
    files = []
    hostile = draw(st.booleans())
    for step in draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True)):
        records = []
        for index in range(draw(st.integers(1, 3))):
            n = draw(st.integers(0, 5))
            rollout = draw(logprobs(n, hostile))
            record = {
                "schema_version": 1,
                "step": step,
                "export_step": step,
                "rank": 0,
                "export_sequence_idx": index,
                "run_id": draw(st.sampled_from([None, "run"])),
                "loss_mask": draw(st.lists(st.booleans(), min_size=n, max_size=n)),
                "inference_logprobs": rollout,
                "trainer_logprobs": [
                    min(x + 0.01, 0.0) if math.isfinite(x) else x for x in rollout
                ],
                "token_ids": draw(st.lists(st.integers(0, 50_000), min_size=n, max_size=n)),
                "entropy": [1.0] * n,
            }
            records.append(draw(_record_mutations(record, list(record))))
        files.append((f"token_exports/step_{step}/rank_0.jsonl", draw(_lines(records))))
    return files


# ----------------------------------------------------------------------------- tensors

_DTYPES = [
    "float32",
    "float64",
    "bfloat16",
    "float16",
    "int64",
    "int32",
    "bool",
    "complex64",
    "uint8",
]


@st.composite
def tensors(draw, n: int):
    """A tensor where one of `n` values is expected: of any dtype and shape, sometimes one
    whose values repeat over a larger shape (stride 0) or a non-contiguous view."""
    import torch

    dtype = getattr(torch, draw(st.sampled_from(_DTYPES)))
    shape = draw(st.sampled_from([(n,), (n,), (n,), (), (1, n), (n + 1,), (max(n - 1, 0),)]))
    values = torch.tensor(
        draw(st.lists(LOGPROBS, min_size=1, max_size=1)) * max(1, math.prod(shape))
    )
    tensor = values[: math.prod(shape)].reshape(shape).to(dtype)
    kind = draw(st.sampled_from(["plain", "plain", "expanded", "strided"]))
    if kind == "expanded" and tensor.dim():
        tensor = tensor.flatten()[:1].expand(*tensor.shape)
    elif kind == "strided" and tensor.dim():
        tensor = torch.cat([tensor, tensor]).flatten()[::2][: tensor.numel()].reshape(tensor.shape)
    return tensor


def _python_or_tensor(n: int) -> st.SearchStrategy:
    return st.one_of(tensors(n), HOSTILE_JSON)


@st.composite
def slime_files(draw) -> list[tuple[str, bytes]]:
    """slime train dumps (format_version 2, or the older per-rank layout), valid or broken."""
    import torch

    files = []
    hostile = draw(st.booleans())
    for rollout_id in draw(st.lists(st.integers(0, 3), min_size=1, max_size=2, unique=True)):
        samples = []
        for index in range(draw(st.integers(1, 3))):
            n = draw(st.integers(0, 4))
            rollout = torch.tensor(draw(logprobs(n, hostile)), dtype=torch.float32)
            sample = {
                "sample_index": index + 10 * rollout_id,
                "rollout_position": index,
                "response_lengths": n,
                "rollout_log_probs": rollout,
                "log_probs": rollout.clamp(max=0.0),
                "loss_masks": torch.ones(n, dtype=torch.int32),
                "tokens": torch.arange(n + 2),
                "advantages": torch.zeros(n),
                "local_raw_reward": 1.0,
            }
            for _ in range(draw(BREAKS)):
                key = draw(st.sampled_from(list(sample)))
                if draw(st.booleans()):
                    sample[key] = draw(_python_or_tensor(n))
                else:
                    del sample[key]
            samples.append(sample)
        if draw(st.booleans()):
            payload = {"format_version": 2, "rollout_id": rollout_id, "rank": 0, "samples": samples}
        else:  # the older layout: {key: one entry per sample}
            keys = {k for s in samples for k in s}
            data = {k: [s.get(k) for s in samples] for k in keys}
            for key in draw(st.lists(st.sampled_from(sorted(keys) or ["x"]), max_size=1)):
                data[key] = data.get(key, [])[:-1]  # a record cut short
            payload = {"rollout_id": rollout_id, "rank": 0, "rollout_data": data}
        if draw(st.integers(0, 4)) == 0:
            payload[draw(st.sampled_from(["rollout_id", "format_version"]))] = draw(HOSTILE_JSON)
        buffer = io.BytesIO()
        torch.save(payload, buffer, _use_new_zipfile_serialization=draw(st.booleans()))
        files.append((f"{rollout_id}.pt", draw(_damaged(buffer.getvalue()))))
    return files


@st.composite
def _damaged(draw, data: bytes) -> bytes:
    """`data`, or (sometimes) with a byte flipped or cut short."""
    damage = draw(st.sampled_from(["none", "none", "none", "flip", "truncate"]))
    if damage == "none" or not data:
        return data
    if damage == "truncate":
        return data[: draw(st.integers(0, len(data) - 1))]
    out = bytearray(data)
    out[draw(st.integers(0, len(out) - 1))] ^= 1 << draw(st.integers(0, 7))
    return bytes(out)


@st.composite
def _skyrl_field(draw, shape: tuple[int, int]):
    """One field of a SkyRL batch state: any of SkyRL's encodings, of any dtype and shape."""
    from tests.unit import hostile

    b, r = shape
    tensor = draw(tensors(b * r))
    if tensor.dim() == 1 and tensor.numel() == b * r and draw(st.booleans()):
        tensor = tensor.reshape(b, r)
    how = draw(st.sampled_from(["numpy", "torch", "bytes", "list", "raw", "none"]))
    if how == "numpy":
        try:
            return hostile.numpy_state(tensor.numpy())
        except TypeError:  # bfloat16: numpy has none, SkyRL saves torch bytes
            return hostile.torch_state(tensor)
    if how == "torch":
        return hostile.torch_state(tensor)
    if how == "bytes":
        return hostile.torch_state(tensor)["data"]
    if how == "list":
        return {"format": "tensor_list", "items": [hostile.torch_state(tensor)]}
    if how == "raw":
        return draw(
            st.fixed_dictionaries(
                {
                    "format": st.sampled_from(["numpy", "torch", "other"]),
                    "dtype": st.sampled_from(["float32", "complex64", "object", "<U3", "V8", "x"]),
                    "shape": st.one_of(
                        st.tuples(st.integers(-1, 3)), st.just((2**40,)), HOSTILE_JSON
                    ),
                    "data": st.one_of(st.binary(max_size=16), HOSTILE_JSON),
                }
            )
        )
    return None


@st.composite
def skyrl_files(draw) -> list[tuple[str, bytes]]:
    """SkyRL global_step_{N}_training_input.pkl pickles (SkyRL's own globals, by name), valid
    or broken: fields of any encoding, dtype and shape; hostile metadata; damaged bytes."""
    import numpy as np

    from tests.unit import hostile

    b, r = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    with np.errstate(over="ignore"):  # beyond float32: infinite, as a trainer would hold it
        rollout = np.array(draw(logprobs(b * r, draw(st.booleans()))), np.float32)
    fields = {
        "response_mask": hostile.numpy_state(np.ones((b, r), np.int64)),
        "loss_mask": hostile.numpy_state(np.ones((b, r), np.float32)),
        "rollout_logprobs": hostile.numpy_state(rollout.reshape(b, r)),
        "action_log_probs": hostile.numpy_state(np.minimum(rollout, 0).reshape(b, r)),
        "sequences": hostile.numpy_state(np.arange(b * (r + 2)).reshape(b, r + 2)),
    }
    for _ in range(draw(BREAKS)):
        fields[draw(st.sampled_from(list(fields)))] = draw(_skyrl_field((b, r)))
    metadata = draw(
        st.one_of(
            st.none(),
            st.fixed_dictionaries(
                {},
                optional={
                    "pad_size": st.one_of(st.integers(0, b), HOSTILE_JSON),
                    "policy_prompt_boundaries": st.one_of(
                        st.just([(0, b)]),
                        st.lists(st.tuples(HOSTILE_JSON, HOSTILE_JSON), max_size=2),
                        HOSTILE_JSON,
                    ),
                },
            ),
        )
    )
    state = {"batch_dict": fields, "metadata": metadata}
    data = draw(_damaged(hostile.skyrl_pickle(state)))
    return [(f"global_step_{draw(st.integers(0, 3))}_training_input.pkl", data)]


# ----------------------------------------------------------------------------- configs

CONFIG_VALUES = st.one_of(
    HOSTILE_JSON,
    st.sampled_from([0, -1, 1, 0.5, 1.0, 1e-12, 2**63, 10**400, INF, -INF, NAN, "2.0", "0.5_5.0"]),
    st.sampled_from(["token", "sequence", "geometric", "tis", "icepop", "mask", "truncate"]),
)
"""A value where a config holds a number, a bool, a name or a section."""

RAW_YAML = (
    ".inf",
    "-.inf",
    ".nan",
    ".NaN",
    "1e999",
    "1e400",
    "-1e999",
    "0x1F",
    "0o17",
    "1_000",
    "~",
    "yes",
    "on",
    "2001-12-14",
    "[1, [2]]",
    "{a: 1}",
    "!!binary aGVsbG8=",
    "1" + "0" * 400,
    "!!python/object/apply:os.system [echo]",
    "'1e999'",
    '"nan"',
    "0.5_1e999",
    "-0",
)
"""Values as YAML spells them, written into the config's text where a leaf was."""

FLAG_TOKENS = (
    "nan",
    "inf",
    "-inf",
    "1e999",
    "-1",
    "0",
    "abc",
    "",
    "1" + "0" * 400,
    "--unknown",
    "2.0",
    "0.5",
    "--use-tis",
    "token",
    "sequence",
)
"""Tokens put into a config's `args:` flag string."""

_RAW = "__iscore_raw_yaml__"


def _leaves(config: object, path: tuple = ()) -> list[tuple]:
    """The paths of every value in a nested mapping (sections included)."""
    out = [path] if path else []
    if isinstance(config, dict):
        for key, value in config.items():
            out += _leaves(value, (*path, key))
    return out


def _set(config: dict, path: tuple, value: object) -> None:
    for key in path[:-1]:
        config = config[key]
    config[path[-1]] = value


@st.composite
def configs(draw) -> str:
    """A framework config as YAML text: a preset's config broken in a few ways (or not)."""
    import shlex

    import yaml

    from iscore.frameworks.resolve import presets

    name = draw(st.sampled_from(sorted(presets())))
    config = presets()[name].to_config()
    raw = None
    for _ in range(draw(BREAKS)):
        paths = [p for p in _leaves(config) if p != ("framework",)]
        if not paths:
            break
        path = draw(st.sampled_from(paths))
        what = draw(st.sampled_from(["value", "value", "raw", "delete", "unknown", "flags"]))
        parent = config
        for key in path[:-1]:
            parent = parent[key]
        if what == "delete":
            del parent[path[-1]]
        elif what == "unknown":
            parent[draw(st.text(min_size=1, max_size=6))] = draw(CONFIG_VALUES)
        elif what == "raw" and raw is None:
            raw = draw(st.sampled_from(RAW_YAML))
            _set(config, path, _RAW)
        elif what == "flags" and isinstance(parent[path[-1]], str) and path[-1] == "args":
            tokens = shlex.split(parent[path[-1]])
            at = draw(st.integers(0, len(tokens)))
            tokens.insert(at, draw(st.sampled_from(FLAG_TOKENS)))
            parent[path[-1]] = shlex.join(tokens)
        else:
            _set(config, path, draw(CONFIG_VALUES))
    text = yaml.safe_dump(config, sort_keys=False)
    return text if raw is None else text.replace(repr(_RAW) if repr(_RAW) in text else _RAW, raw)
