"""A file's columns checked against what the engine reads: the types of the canonical
columns, and the extra per-sequence columns the sequence table carries."""

from __future__ import annotations

import pyarrow as pa

from iscore.dump.columns import COMPUTED, EXPERT_COLUMNS, PER_TOKEN, TOPK_COLUMNS, ColumnMap
from iscore.dump.values import Extra, Layout
from iscore.errors import DumpProblems, Problem, quote
from iscore.packed import META_COLUMNS

_CARRIED = ("group_id", "reward", "advantage", "entropy", *META_COLUMNS)
"""The canonical extra columns the sequence table holds (token_id is per token)."""


_PER_SEQUENCE_EXTRA = ("group_id", "reward", *META_COLUMNS)
"""Extra columns that hold one value per sequence (in token layout, repeated on its rows)."""


def scalar_type(t: pa.DataType) -> pa.DataType | None:
    """The sequence table's type for a scalar column of type `t`, None if it has none."""
    if pa.types.is_dictionary(t):
        t = t.value_type
    if pa.types.is_integer(t):
        return pa.int64()
    if pa.types.is_floating(t):
        return pa.float64()
    if pa.types.is_boolean(t):
        return pa.bool_()
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return pa.string()
    return None


def extras_of(schema: pa.Schema, columns: ColumnMap, layout: Layout) -> tuple[Extra, ...]:
    """The per-sequence columns of a file beyond those the engine reads: the canonical
    extras (token_id aside), and in sequence layout every other scalar column."""
    out = []
    for name in _CARRIED:
        if name not in columns:
            continue
        source = columns.source[name]
        t = schema.field(source).type
        if is_list(t):
            numeric = scalar_type(t.value_type) in (pa.int64(), pa.float64())
            if layout == "sequence" and name not in _PER_SEQUENCE_EXTRA and numeric:
                out.append(Extra(name, source, "mean", pa.float64()))
            continue
        kind = scalar_type(t)
        if kind is None:
            continue
        if layout == "sequence":
            out.append(Extra(name, source, "value", kind))
        elif name in _PER_SEQUENCE_EXTRA:
            out.append(Extra(name, source, "first", kind))
        elif kind in (pa.int64(), pa.float64()):
            out.append(Extra(name, source, "mean", pa.float64()))
    if layout == "sequence":
        known = set(columns.source.values())
        for source in schema.names:
            kind = scalar_type(schema.field(source).type)
            if source in known or kind is None:
                continue
            name = f"dump_{source}" if source in COMPUTED else source
            out.append(Extra(name, source, "value", kind))
    return tuple(out)


def is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


_KIND = {
    "float": (pa.types.is_floating, "a float"),
    "int": (pa.types.is_integer, "an integer"),
    "mask": (
        lambda t: pa.types.is_boolean(t) or pa.types.is_integer(t),
        "a bool (or 0/1 integer)",
    ),
    "id": (
        lambda t: pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t),
        "an integer or string",
    ),
}


_COLUMN_KIND = {
    "rollout_logprob": "float",
    "train_logprob": "float",
    "policy_logprob": "float",
    "floor_logprob": "float",
    "loss_mask": "mask",
    "pos": "int",
    "turn": "int",
    "train_token_id": "int",
    "step": "int",
    "weight_version": "int",
    "rank": "int",
    "replica": "id",
    "host": "id",
    "device": "id",
    "seq_id": "id",
    "rollout_experts": "ids",
    "train_experts": "ids",
    "rollout_topk_ids": "ids",
    "rollout_topk_logprobs": "floats",
    "train_topk_logprobs": "floats",
}


def check_types(path: str, schema: pa.Schema, columns: ColumnMap, layout: Layout) -> None:
    problems = []
    present = [name for name in EXPERT_COLUMNS if name in columns]
    if len(present) == 1:
        (name,) = present
        (other,) = set(EXPERT_COLUMNS) - {name}
        message = (
            f"present without {other}; routing agreement compares both sides' expert ids, so "
            f"a dump has both or neither (leave it out with --column {name}=)"
        )
        problems.append(Problem(path, column_label(columns, name), message))
    present = [name for name in TOPK_COLUMNS if name in columns]
    if present and len(present) < len(TOPK_COLUMNS):
        missing = ", ".join(n for n in TOPK_COLUMNS if n not in columns)
        message = (
            f"present without {missing}; the distribution statistics need the engine's top-k ids, "
            f"their log-probs and the trainer's at them (leave it out with --column {present[0]}=)"
        )
        problems.append(Problem(path, column_label(columns, present[0]), message))
    if "train_token_id" in columns and "token_id" not in columns:
        message = (
            "present without token_id; the trainer's token ids are compared with the sampled "
            "ones, so a dump has token_id beside them (leave it out with --column train_token_id=)"
        )
        problems.append(Problem(path, column_label(columns, "train_token_id"), message))
    for name, kind in _COLUMN_KIND.items():
        if name not in columns:
            continue
        source = columns.source[name]
        t = schema.field(source).type
        if pa.types.is_dictionary(t):
            t = t.value_type  # decoded while reading
        if kind in ("ids", "floats"):
            # A token's ids (or log-probs) are a list: a list of them per sequence in sequence
            # layout.
            inner = t.value_type if layout == "sequence" and is_list(t) else t
            test = pa.types.is_integer if kind == "ids" else pa.types.is_floating
            ok = is_list(inner) and test(inner.value_type)
            noun = "an integer" if kind == "ids" else "a float"
            expected = (
                f"a list of {noun[noun.index(' ') + 1 :]} lists"
                if layout == "sequence"
                else f"{noun} list"
            )
            if not ok:
                problems.append(
                    Problem(
                        path,
                        column_label(columns, name),
                        f"expected {expected} column ({layout} layout), found {t}",
                    )
                )
            continue
        is_kind, expected = _KIND[kind]
        per_token = name in PER_TOKEN and layout == "sequence"
        if per_token:
            ok = is_list(t) and is_kind(t.value_type)
            expected = f"a list of {expected.removeprefix('a ').removeprefix('an ')} values"
        else:
            ok = is_kind(t)
            expected += " column"
        if not ok:
            problems.append(
                Problem(
                    path,
                    column_label(columns, name),
                    f"expected {expected} ({layout} layout), found {t}",
                )
            )
    if problems:
        raise DumpProblems(problems)


def column_label(columns: ColumnMap, name: str) -> str:
    source = columns.source.get(name, name)
    return name if source == name else f"{name} (source {quote(source)})"
