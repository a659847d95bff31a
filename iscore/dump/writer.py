"""Write canonical sequence-layout Parquet dumps, from a training loop or from an importer.

verl, TRL, SkyRL, OpenRLHF and AReaL hold the rollout and trainer log-probs in memory and
never write both. `DumpWriter` turns what they hold into the dump iscore reads (README, "The
dump"): one row per sequence. `add_batch(obj, step=N)` takes the framework's own batch object
(verl's `DataProto`, TRL's loss inputs, ...), which the framework's module reads
(`iscore.frameworks.<name>.read_batch`); `add` takes the tensors themselves.
docs/integrations.md shows the line to add in each framework's loop.

Two layouts:

- `DumpWriter("run.parquet")`: one file, one row group per `add` call, written before the call
  returns (scripts, importers, a single process).
- `DumpWriter("run_dir", framework=F, rank=R)`: the training-loop layout. Each data-parallel rank
  writes one file per step, `run_dir/step_000123/rank_0007.parquet` (`iscore.dump.stepfiles`), in a
  background thread: the call keeps references to the batch's tensors and returns; the thread
  converts them and writes the file atomically (a temporary name, then a rename), so a crash
  loses at most the step being written and never leaves a file a reader trusts. When too many
  calls wait (`max_pending`), the step is dropped and counted (`dropped_steps`), never waited
  for. The tensors must not be written into afterwards: each hook in docs/integrations.md is at
  a point after which the framework replaces them rather than writing into them. iscore reads
  the folder as one run (`iscore.load("run_dir")`, `iscore validate run_dir`).

Sequence ids: the framework's own where it has them (OpenRLHF's `index`), else a counter
running across calls; in the per-rank layout the counter starts at rank x 10^9
(`RANK_STRIDE`), so ranks never collide. Opt-in sampling keeps dumping cheap: `every=N` writes
the steps divisible by N and skips the others before reading anything; `max_sequences=M` keeps
the first M sequences of each step (batches are ordered by prompt, so groups stay whole).

Padded `[B, T]` tensors may be left-aligned (verl, TRL, OpenRLHF), right-aligned (SkyRL) or
have holes (multi-turn tool output): `mask` alone says which positions are tokens, kept in
their order; padding values are never looked at. A list of per-sequence 1-D arrays works
too, with or without a mask.

>>> import tempfile, torch, iscore
>>> path = tempfile.mkdtemp() + "/run.parquet"
>>> with DumpWriter(path, framework="verl") as writer:
...     writer.add(
...         step=0,
...         rollout_logprobs=torch.tensor([[-0.5, -1.0, 0.0], [0.0, -0.2, -0.3]]),
...         train_logprobs=torch.tensor([[-0.4, -1.1, 0.0], [0.0, -0.2, -0.4]]),
...         mask=torch.tensor([[1, 1, 0], [0, 1, 1]]),  # row 0 left-, row 1 right-aligned
...     )
>>> iscore.load(path).lengths.tolist()
[2, 2]

Provenance (`{"framework", "source_files", "steps", ...}` as JSON) is stored under the
Parquet footer key `iscore.provenance` when a file closes, so it also shows in
`pq.read_table(path).schema.metadata`. A process killed before `close` leaves a single-file
dump without its footer, which no Parquet reader can open: close it (the context manager
closes it even when the block raises).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import fields, replace
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from iscore import frameworks
from iscore.dump.stepfiles import StepFiles
from iscore.errors import DumpError, quote
from iscore.frameworks import BatchFields
from iscore.packed import META_COLUMNS

__all__ = [
    "COLUMN_ORDER",
    "PROVENANCE_KEY",
    "RANK_STRIDE",
    "DumpWriter",
    "canonical_table",
    "schema_mismatch",
]

RANK_STRIDE = 10**9
"""In the per-rank layout, the ids the writer counts start at rank x RANK_STRIDE."""

PROVENANCE_KEY = b"iscore.provenance"
"""Parquet footer (and Arrow schema metadata) key of the provenance JSON."""

COLUMN_ORDER = (
    "step",
    "seq_id",
    "rollout_logprob",
    "train_logprob",
    "loss_mask",
    "policy_logprob",
    "floor_logprob",
    "advantage",
    "token_id",
    "train_token_id",
    "reward",
    "group_id",
    "entropy",
    "rollout_topk_ids",
    "rollout_topk_logprobs",
    "train_topk_logprobs",
    *META_COLUMNS,
)
"""The canonical columns a written dump may hold, in the order they are written."""

_TOKEN_TYPES = {
    "rollout_logprob": pa.float32(),
    "train_logprob": pa.float32(),
    "loss_mask": pa.bool_(),
    "policy_logprob": pa.float32(),
    "floor_logprob": pa.float32(),
    "advantage": pa.float32(),
    "token_id": pa.int32(),
    "train_token_id": pa.int32(),
    "entropy": pa.float32(),
    "rollout_topk_ids": pa.int32(),
    "rollout_topk_logprobs": pa.float32(),
    "train_topk_logprobs": pa.float32(),
}
"""Per-token columns and the type of their list items (of the items of their k-lists, for the
top-k ones: [tokens, k] values each)."""

_TOPK = {
    "rollout_topk_ids": "rollout_topk_ids",
    "rollout_topk_logprobs": "rollout_topk_logprobs",
    "train_topk_logprobs": "train_topk_logprobs",
}
"""The top-k columns by the argument that gives each (docs/distribution.md)."""

_SEQUENCE_TYPES = {
    "advantage": pa.float32(),
    "reward": pa.float32(),
    "group_id": None,
    "weight_version": pa.int64(),
    "replica": None,
    "rank": pa.int64(),
    "host": None,
    "device": None,
}
"""Per-sequence columns; None: integers or strings, whichever the values are."""

_META = {
    "weight_version": "weight_versions",
    "replica": "replicas",
    "rank": "ranks",
    "host": "hosts",
    "device": "devices",
}
"""The metadata columns by the argument of `DumpWriter.add` that gives each."""

_MAX_TOKENS = 2**31 - 1  # list offsets are int32


def canonical_table(
    *,
    step: int | np.ndarray,
    seq_id: Sequence[int] | Sequence[str] | np.ndarray,
    lengths: np.ndarray,
    tokens: Mapping[str, np.ndarray],
    sequences: Mapping[str, Sequence | np.ndarray] | None = None,
) -> pa.Table:
    """Build a canonical sequence-layout table from flat per-token values.

    Args:
        step: the step of every sequence, or one per sequence [B].
        seq_id: [B] integer or string ids.
        lengths: [B] tokens per sequence.
        tokens: canonical per-token column -> flat values [sum(lengths)], sequences back to
            back; must hold `rollout_logprob` and `train_logprob`.
        sequences: canonical per-sequence column (`advantage`, `reward`, `group_id`, the
            metadata columns `weight_version`, `replica`, `rank`, `host`, `device`) -> [B].

    Raises:
        DumpError: an unknown column, or values whose count does not match `lengths`.

    >>> t = canonical_table(step=3, seq_id=[7, 8], lengths=np.array([2, 1]),
    ...     tokens={"rollout_logprob": np.array([-1.0, -0.5, -2.0]),
    ...             "train_logprob": np.array([-1.1, -0.5, -2.0])})
    >>> t.column_names, t["rollout_logprob"].to_pylist()
    (['step', 'seq_id', 'rollout_logprob', 'train_logprob'], [[-1.0, -0.5], [-2.0]])
    """
    lengths = np.asarray(lengths, dtype=np.int64)
    count, total = lengths.size, int(lengths.sum())
    if total > _MAX_TOKENS:
        raise DumpError(f"{total:,} tokens in one row group; write at most {_MAX_TOKENS:,}")
    for name in ("rollout_logprob", "train_logprob"):
        if name not in tokens:
            raise DumpError(f"Expected per-token column {name}, but it is missing")
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    steps = exact_cast("step", np.asarray(step), np.dtype(np.int64))
    if steps.shape not in ((), (count,)):
        raise DumpError(f"Expected one step, or {count} (one per sequence), but got {steps.shape}")
    columns: dict[str, pa.Array] = {
        "step": pa.array(np.broadcast_to(steps, (count,))),
        "seq_id": _id_array("seq_id", seq_id, count),
    }
    for name, values in tokens.items():
        if name not in _TOKEN_TYPES:
            raise DumpError(
                f"Unknown per-token column {quote(name)}; expected one of {tuple(_TOKEN_TYPES)}"
            )
        values = np.asarray(values)
        if values.shape[:1] != (total,) or values.ndim != (2 if name in _TOPK else 1):
            count = f"[{total:,}, k]" if name in _TOPK else f"{total:,}"
            raise DumpError(
                f"Expected {count} values of {name} (the sequences' lengths sum to {total:,}), "
                f"but got shape {list(values.shape)}"
            )
        dtype = np.dtype(_TOKEN_TYPES[name].to_pandas_dtype())
        flat = pa.array(exact_cast(name, values.ravel(), dtype))
        if name in _TOPK:  # a k-list per token
            k = values.shape[1]
            flat = pa.ListArray.from_arrays(
                pa.array(np.arange(total + 1, dtype=np.int32) * k), flat
            )
        columns[name] = pa.ListArray.from_arrays(offsets, flat)
    for name, values in (sequences or {}).items():
        if name not in _SEQUENCE_TYPES:
            raise DumpError(
                f"Unknown per-sequence column {quote(name)}; expected one of "
                f"{tuple(_SEQUENCE_TYPES)}"
            )
        if name in columns:
            raise DumpError(f"{name} given both per token and per sequence")
        kind = _SEQUENCE_TYPES[name]
        if kind is None:
            columns[name] = _id_array(name, values, count)
            continue
        values = np.asarray(values)
        if values.shape != (count,):
            raise DumpError(
                f"Expected {count} values of {name} (one per sequence), "
                f"but got shape {list(values.shape)}"
            )
        columns[name] = pa.array(exact_cast(name, values, np.dtype(kind.to_pandas_dtype())))
    return pa.table({name: columns[name] for name in COLUMN_ORDER if name in columns})


def _id_array(name: str, values: Sequence | np.ndarray | pa.Array, count: int) -> pa.Array:
    """Ids as int64 or string; one type for all, as a dump requires."""
    if isinstance(values, pa.Array):
        array = values
    elif isinstance(values, np.ndarray) and values.dtype.kind in "iu":
        array = pa.array(exact_cast(name, values, np.dtype(np.int64)))
    else:
        items = values.tolist() if isinstance(values, np.ndarray) else list(values)
        if all(isinstance(v, int | np.integer) and not isinstance(v, bool) for v in items):
            array = pa.array([int(v) for v in items], pa.int64())
        elif all(isinstance(v, str) for v in items):
            array = pa.array(items, pa.string())
        else:
            found = ", ".join(sorted({type(v).__name__ for v in items}))
            raise DumpError(
                f"Expected `{name}` to hold integers or strings (one type), but found {found}"
            )
    if len(array) != count:
        raise DumpError(
            f"Expected {count} values of {name} (one per sequence), but got {len(array)}"
        )
    return array


def exact_cast(name: str, values: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`values` cast to `dtype`, refusing what the cast would change rather than store it.

    numpy's casts wrap integers (token id 2**40 into int32, uint64 2**63 into int64),
    truncate fractions (step 1.5 -> 1) and drop imaginary parts; each is an error here.
    Floats that overflow float32 become infinite and are reported when the dump is read.

    Raises:
        DumpError: complex values, fractions or non-finite values for an integer column,
            or integers outside its range.
    """
    kind = values.dtype.kind
    if kind == "c" or (kind not in "biuf" and values.size):
        raise DumpError(f"Expected `{name}` to hold real numbers, but got {values.dtype}")
    if dtype.kind in "iu" and values.size:
        if kind == "f":
            whole = np.isfinite(values) & (values == np.trunc(values))
            if not whole.all():
                bad = values[~whole][0]
                raise DumpError(f"Expected `{name}` to hold integers, but got {float(bad)!r}")
        info = np.iinfo(dtype)
        lo, hi = values.min(), values.max()
        if (kind == "f" and (lo < info.min or hi > info.max)) or (
            kind in "iu" and (int(lo) < info.min or int(hi) > info.max)
        ):
            raise DumpError(
                f"Expected `{name}` to fit {dtype} ({info.min:,} to {info.max:,}), "
                f"but got values from {lo} to {hi}"
            )
    with np.errstate(over="ignore"):  # beyond float32: infinite, reported when read
        return values.astype(dtype)


def schema_mismatch(expected: pa.Schema, found: pa.Schema) -> str | None:
    """Why a table cannot go into a file whose first table had `expected`; None if it can."""
    if expected.names != found.names:
        missing = [n for n in expected.names if n not in found.names]
        extra = [n for n in found.names if n not in expected.names]
        parts = ([f"lacks {', '.join(missing)}"] if missing else []) + (
            [f"adds {', '.join(extra)}"] if extra else []
        )
        return " and ".join(parts) or f"orders its columns as {', '.join(found.names)}"
    for a, b in zip(expected, found, strict=True):
        if a.type != b.type:
            return f"has {a.name} as {b.type}, where the first had {a.type}"
    return None


def is_tensor(value: object) -> bool:
    """Whether `value` is a torch tensor, without importing torch: a process that never
    imported it holds none."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(value, torch.Tensor)


def _to_numpy(name: str, value: object) -> np.ndarray:
    if is_tensor(value):
        import torch  # already imported: `value` is one of its tensors

        value = value.detach()
        if value.is_floating_point() and value.dtype not in (torch.float32, torch.float64):
            value = value.float()  # bf16/fp16: numpy has no bfloat16, and dumps are float32
        return value.cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError) as e:
        raise DumpError(
            f"Expected argument `{name}` to be an array, a tensor or a list, "
            f"but got {type(value).__name__}: {e}"
        ) from e


_REAL = ("iuf", "real numbers")
_INTEGER = ("iu", "integers")
_MASK = ("biuf", "booleans or 0/1")


def _check_kind(name: str, array: np.ndarray, kind: tuple[str, str]) -> None:
    if array.size and array.dtype.kind not in kind[0]:
        raise DumpError(f"Expected argument `{name}` to hold {kind[1]}, but got {array.dtype}")


def _check_mask(name: str, array: np.ndarray) -> None:
    if array.dtype.kind != "b":
        _check_kind(name, array, _MASK)
        odd = array[(array != 0) & (array != 1)]
        if odd.size:
            raise DumpError(
                f"Expected argument `{name}` to hold booleans or 0/1, but found {odd[0]}"
            )


class _Layout:
    """The batch layout `rollout_logprobs` sets: padded [B, T], or a list of 1-D arrays.

    Every other per-token argument must come in the same layout and shape; `select` then
    picks the tokens the mask marks out of any of them, sequences back to back.
    """

    def __init__(self, rollout_logprobs: object):
        self.ragged = isinstance(rollout_logprobs, list | tuple)
        self.rollout, self.shape = self._array("rollout_logprobs", rollout_logprobs)
        self.count = len(self.shape) if self.ragged else self.shape[0]
        self.selection = np.ones(self.rollout.shape, dtype=bool)

    def _array(self, name: str, value: object, k: bool = False) -> tuple[np.ndarray, object]:
        """One array ([B, T] padded, concatenated when ragged; [B, T, k] and [N, k] for a
        per-token list of k, `k`) and its shape (ragged: lengths; without the k)."""
        extra = int(k)
        if not self.ragged:
            array = _to_numpy(name, value)
            if array.ndim != 2 + extra:
                shape = "[B, T, k]" if k else "[B, T]"
                raise DumpError(
                    f"Expected argument `{name}` to be a padded {shape} array or a list of "
                    f"per-sequence {1 + extra}-D arrays, but got shape {list(array.shape)}"
                )
            return array, array.shape[:2]
        rows = [_to_numpy(f"{name}[{i}]", v) for i, v in enumerate(value)]
        for i, row in enumerate(rows):
            if row.ndim != 1 + extra or (k and row.shape[1:] != rows[0].shape[1:]):
                expected = "[T, k] with one k" if k else "1-D"
                raise DumpError(
                    f"Expected argument `{name}` sequence {i} to be {expected}, "
                    f"but got shape {list(row.shape)}"
                )
        lengths = np.array([row.shape[0] for row in rows], dtype=np.int64)
        return (np.concatenate(rows) if rows else np.zeros((0,) * (1 + extra))), lengths

    def values(self, name: str, value: object, k: bool = False) -> np.ndarray:
        """An argument as one array, checked against the layout of `rollout_logprobs`."""
        if isinstance(value, list | tuple) != self.ragged:
            expected = "a list of per-sequence arrays" if self.ragged else "a padded array"
            raise DumpError(
                f"Expected argument `{name}` to be {expected} like `rollout_logprobs`, "
                f"but got {type(value).__name__}"
            )
        array, shape = self._array(name, value, k)
        if not self.ragged:
            if shape != self.shape:
                raise DumpError(
                    f"Expected argument `{name}` to have shape {list(self.shape)} like "
                    f"`rollout_logprobs`, but got {list(shape)}"
                )
            return array
        if len(shape) != self.count:
            raise DumpError(
                f"Expected argument `{name}` to have {self.count} sequences like "
                f"`rollout_logprobs`, but got {len(shape)}"
            )
        differ = np.flatnonzero(shape != self.shape)
        if differ.size:
            i = differ[0]
            raise DumpError(
                f"Expected argument `{name}` sequence {i} to have {self.shape[i]} values like "
                f"`rollout_logprobs`, but got {shape[i]}"
            )
        return array

    def set_mask(self, mask: object) -> np.ndarray:
        """Fix which positions are tokens; returns the tokens per sequence [B]."""
        if mask is None:
            if not self.ragged:
                raise DumpError(
                    "Expected argument `mask` for padded [B, T] tensors: padding cannot be "
                    "told from values, so the mask must say which positions are tokens"
                )
            return self.shape
        array = self.values("mask", mask)
        _check_mask("mask", array)
        self.selection = array != 0
        if not self.ragged:
            return self.selection.sum(axis=1, dtype=np.int64)
        kept = np.concatenate([[0], np.cumsum(self.selection, dtype=np.int64)])
        ends = np.cumsum(self.shape)
        return kept[ends] - kept[ends - self.shape]

    def select(self, array: np.ndarray) -> np.ndarray:
        """The tokens of an argument (as `values` returns it), sequences back to back."""
        return array[self.selection]


def _per_sequence(name: str, value: object, count: int) -> np.ndarray:
    array = _to_numpy(name, value)
    if array.shape != (count,):
        raise DumpError(
            f"Expected argument `{name}` to have shape [{count}] (one value per sequence), "
            f"but got {list(array.shape)}"
        )
    return array


class DumpWriter:
    """Write training steps to a canonical Parquet dump: one file, or one file per step and rank.

    Args:
        path: the Parquet file to write (its folder is created; an existing file is replaced),
            or with `rank`, the run's folder.
        framework: the framework whose batch objects `add_batch` reads (e.g. "verl"); recorded
            in the provenance.
        rank: this process's data-parallel rank: writes `path/step_{N}/rank_{rank}.parquet` in
            a background thread (module docstring). None: the single file `path`.
        every: write the steps divisible by `every`; calls for other steps return at once.
        max_sequences: write at most this many sequences per step (the first ones); None: all.
        max_pending: with `rank`, how many calls may wait for the background thread before a
            step is dropped rather than waited for.
        compression: Parquet codec.

    Attributes:
        sequences: sequences handed to the writer so far (in the per-rank layout, including
            those of steps that end up dropped).
        tokens: tokens written so far (single file).
        row_groups: row groups written so far (single file).
        dropped_steps: steps the per-rank layout dropped because the background thread was
            behind.

    Nothing is written until the first `add`; closing a writer that was never given a row
    leaves no file.

    Raises:
        DumpError: `rank`, `every` or `max_sequences` is not a valid count, or `path` is a
            folder without `rank`.
    """

    def __init__(
        self,
        path: str | Path,
        framework: str | None = None,
        *,
        rank: int | None = None,
        every: int = 1,
        max_sequences: int | None = None,
        max_pending: int = 4,
        compression: str = "zstd",
    ):
        self.path = Path(path)
        self.framework = framework
        self.compression = compression
        for name, value, low in (
            ("rank", rank, 0),
            ("every", every, 1),
            ("max_sequences", max_sequences, 1),
            ("max_pending", max_pending, 1),
        ):
            if value is not None and (not isinstance(value, int | np.integer) or value < low):
                raise DumpError(
                    f"Expected argument `{name}` to be an integer >= {low}, but got {quote(value)}"
                )
        if rank is None and self.path.is_dir():
            raise DumpError(
                f"{self.path} is a folder: pass rank= to write one file per step and rank into "
                "it, or name a .parquet file"
            )
        self.rank = None if rank is None else int(rank)
        self.every = int(every)
        self.max_sequences = max_sequences
        self.sequences = 0
        self.tokens = 0
        self.row_groups = 0
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._steps: set[int] = set()
        self._next_id = 0
        self._taken: tuple[int, int] = (-1, 0)  # (step, sequences kept of it)
        self._closed = False
        self._files = (
            None
            if self.rank is None
            else StepFiles(
                self.path,
                self.rank,
                build=self._table,
                footer=self._footer,
                compression=compression,
                max_pending=max_pending,
            )
        )

    @property
    def dropped_steps(self) -> int:
        return 0 if self._files is None else self._files.dropped_steps

    def add_batch(self, batch: object, *, step: int, **extra: object) -> None:
        """Write the sequences of a framework's own batch object for `step`.

        The framework's module says how to read it (`read_batch`, cited to the upstream lines
        it relies on); docs/integrations.md shows where each framework's loop holds it.

        Args:
            batch: verl's `DataProto` after the old-log-prob recompute, TRL's GRPO loss inputs
                (the dict `_generate_and_score_completions` returns), SkyRL's
                `TrainingInputBatch`, an OpenRLHF `Experience` or list of them, AReaL's list of
                trajectory dicts, NeMo-RL's `train_data`, slime's `rollout_data`.
            step: the training step.
            extra: what no framework's object holds, in the layout of the batch's own
                log-probs (padded like them): `floor_logprobs`, the trainer's log-probs of the
                same tokens from a second recompute (the noise floor,
                docs/compare.md#the-noise-floor); `rollout_topk_ids`, `rollout_topk_logprobs`,
                `train_topk_logprobs`, the engine's top-k and the trainer's log-probs at them
                (docs/distribution.md); `train_token_ids`, the tokens the trainer scored; and
                per sequence, or one value for every sequence of the object, `weight_versions`,
                `replicas`, `ranks`, `hosts`, `devices` (`add`).

        Raises:
            DumpError: no `framework`, a framework without an adapter, or an object lacking
                what a dump needs (both log-probs and the mask; the message says where the
                framework computes them); an `extra` name that is none of those, or one for
                an object of several blocks (OpenRLHF's experiences, AReaL's groups: give each
                its own with `add`); those of `add`.

        >>> import tempfile, torch, iscore
        >>> path = tempfile.mkdtemp() + "/run.parquet"
        >>> inputs = {  # TRL's loss inputs, as GRPOTrainer builds them
        ...     "sampling_per_token_logps": torch.tensor([[-0.5, -1.0, 0.0]]),
        ...     "old_per_token_logps": torch.tensor([[-0.4, -1.1, -2.0]]),
        ...     "completion_mask": torch.tensor([[1, 1, 0]]),
        ...     "advantages": torch.tensor([0.5]),
        ... }
        >>> with DumpWriter(path, framework="trl") as writer:
        ...     writer.add_batch(inputs, step=7)
        >>> iscore.load(path).train.tolist()
        [-0.4000000059604645, -1.100000023841858]
        """
        self._check_open()
        if not self._wanted(step):
            return
        parts = list(self._reader()(batch))
        given = {name: value for name, value in extra.items() if value is not None}
        known = ("floor_logprobs", *_TOPK, "train_token_ids", *_META.values())
        unknown = sorted(set(extra) - set(known))
        if unknown:
            raise DumpError(
                f"Unknown argument `{unknown[0]}` of add_batch; expected {', '.join(known)}"
            )
        # One metadata value for the whole object goes to each of its blocks.
        each = {k: v for k, v in given.items() if k in _META.values() and _is_one(v)}
        given = {k: v for k, v in given.items() if k not in each}
        parts = [
            replace(part, **_metadata(_count(part.rollout_logprobs), **each)) for part in parts
        ]
        if given:
            if len(parts) != 1:
                raise DumpError(
                    f"Expected one block of sequences with `{next(iter(given))}`, but this "
                    f"{self.framework} object holds {len(parts)}: write each with add()"
                )
            parts = [replace(parts[0], **given)]
        for part in parts:
            self._add(int(step), part)

    def add(
        self,
        *,
        step: int,
        rollout_logprobs: object,
        train_logprobs: object,
        mask: object = None,
        loss_mask: object = None,
        seq_ids: object = None,
        policy_logprobs: object = None,
        floor_logprobs: object = None,
        rollout_topk_ids: object = None,
        rollout_topk_logprobs: object = None,
        train_topk_logprobs: object = None,
        advantages: object = None,
        token_ids: object = None,
        entropy: object = None,
        rewards: object = None,
        group_ids: object = None,
        train_token_ids: object = None,
        weight_versions: object = None,
        replicas: object = None,
        ranks: object = None,
        hosts: object = None,
        devices: object = None,
    ) -> None:
        """Write one batch of sequences of one step.

        Per-token arguments are padded [B, T] tensors/arrays (any alignment, holes allowed)
        or lists of B per-sequence 1-D arrays, all in the layout of `rollout_logprobs`.

        Args:
            step: the training step of every sequence in the batch.
            rollout_logprobs: rollout engine log-probs, per token.
            train_logprobs: the trainer's recomputed log-probs (pi_old), per token.
            mask: which positions are tokens (bool or 0/1). Required when padded; for lists,
                None keeps every value.
            loss_mask: of those tokens, the ones the loss trains on: per token, or [B] per
                sequence; None: all of them.
            seq_ids: [B] integer or string ids; by default a counter running across calls.
            policy_logprobs: current-policy log-probs, per token.
            floor_logprobs: the trainer's log-probs of the same tokens from a second recompute
                (another micro-batch size or parallel layout, or the same forward repeated),
                per token: the noise floor (docs/compare.md#the-noise-floor).
            rollout_topk_ids, rollout_topk_logprobs, train_topk_logprobs: the engine's k most
                likely ids at each token, their log-probs, and the trainer's log-probs at the
                same ids: [B, T, k] padded, or B arrays [T, k]; all three or none
                (docs/distribution.md).
            advantages: [B] per sequence, or per token.
            token_ids: sampled token ids, per token.
            entropy: per-token entropy.
            rewards: [B] per-sequence rewards.
            group_ids: [B] integer or string ids of each sequence's prompt group.
            train_token_ids: the ids of the tokens the trainer scored, per token, beside
                `token_ids` (they differ where the trainer's input was re-tokenized).
            weight_versions: the policy version the engine sampled each sequence with
                (integers), [B] or one for the whole call.
            replicas: the engine instance that sampled each sequence (integers or strings),
                [B] or one.
            ranks: the trainer rank that scored each sequence (integers), [B] or one.
            hosts, devices: the host and the GPU model (integers or strings), [B] or one.

        Raises:
            DumpError: an argument of the wrong shape or dtype (the message names it), an
                optional argument given in one call but not in an earlier one of the same
                file (a file has one schema), or a closed writer. In the per-rank layout,
                what only the values show (a mask of 2s, an id too large) is found by the
                background thread: that step is not written, and `close` raises.
        """
        self._check_open()
        if not self._wanted(step):
            return
        fields = BatchFields(
            rollout_logprobs,
            train_logprobs,
            mask=mask,
            loss_mask=loss_mask,
            policy_logprobs=policy_logprobs,
            floor_logprobs=floor_logprobs,
            rollout_topk_ids=rollout_topk_ids,
            rollout_topk_logprobs=rollout_topk_logprobs,
            train_topk_logprobs=train_topk_logprobs,
            advantages=advantages,
            token_ids=token_ids,
            entropy=entropy,
            rewards=rewards,
            group_ids=group_ids,
            seq_ids=seq_ids,
            train_token_ids=train_token_ids,
            **_metadata(
                _count(rollout_logprobs),
                weight_versions=weight_versions,
                replicas=replicas,
                ranks=ranks,
                hosts=hosts,
                devices=devices,
            ),
        )
        self._add(int(step), fields)

    def _check_open(self) -> None:
        if self._closed:
            raise DumpError(f"{self.path}: the writer is closed")

    def _wanted(self, step: object) -> bool:
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise DumpError(f"Expected argument `step` to be an integer, but got {quote(step)}")
        return step % self.every == 0

    def _reader(self) -> Callable[[object], Sequence[BatchFields]]:
        if self.framework is None:
            raise DumpError(
                "Expected the writer's `framework` (DumpWriter(path, framework=...)) for "
                "add_batch, which reads that framework's batch object"
            )
        reader = frameworks.get(self.framework).read_batch
        if reader is None:
            have = [fw.name for fw in frameworks.every() if fw.read_batch is not None]
            raise DumpError(
                f"iscore cannot read {self.framework}'s batch objects; add_batch reads those of "
                f"{', '.join(have)} (use add() with the tensors otherwise)"
            )
        return reader

    def _add(self, step: int, fields: BatchFields) -> None:
        """Sample, number and hand over one block of sequences (`_table` converts it)."""
        count = _count(fields.rollout_logprobs)
        taken_step, taken = self._taken
        if taken_step != step:
            taken = 0
        if self.max_sequences is not None:
            if taken >= self.max_sequences:
                return
            if count > self.max_sequences - taken:
                count = self.max_sequences - taken
                fields = _head(fields, count)
        self._taken = (step, taken + count)
        ids = fields.seq_ids
        if ids is None:
            base = 0 if self.rank is None else self.rank * RANK_STRIDE
            if self._next_id + count > RANK_STRIDE and self.rank is not None:
                raise DumpError(f"rank {self.rank} wrote more than {RANK_STRIDE:,} sequences")
            ids = np.arange(base + self._next_id, base + self._next_id + count, dtype=np.int64)
            self._next_id += count
        fields = replace(fields, seq_ids=ids)
        if self._files is not None:
            _precheck(fields)
            self.sequences += count
            self._files.add(step, (step, fields))
            return
        self.write_table(self._table((step, fields)), what="add() call")

    def _table(self, job: tuple[int, BatchFields]) -> pa.Table:
        """One block of sequences as a canonical table (checks every value)."""
        step, f = job
        layout = _Layout(f.rollout_logprobs)
        lengths = layout.set_mask(f.mask)
        tokens: dict[str, np.ndarray] = {}
        given = {
            "rollout_logprob": ("rollout_logprobs", f.rollout_logprobs, _REAL),
            "train_logprob": ("train_logprobs", f.train_logprobs, _REAL),
            "policy_logprob": ("policy_logprobs", f.policy_logprobs, _REAL),
            "floor_logprob": ("floor_logprobs", f.floor_logprobs, _REAL),
            "token_id": ("token_ids", f.token_ids, _INTEGER),
            "train_token_id": ("train_token_ids", f.train_token_ids, _INTEGER),
            "entropy": ("entropy", f.entropy, _REAL),
        }
        sequences: dict[str, np.ndarray] = {}
        for column, name, value in (
            ("advantage", "advantages", f.advantages),
            ("loss_mask", "loss_mask", f.loss_mask),
        ):
            if value is None:
                continue
            if not _is_per_sequence(name, value):
                given[column] = (name, value, _MASK if column == "loss_mask" else _REAL)
                continue
            array = _per_sequence(name, value, layout.count)
            if column == "loss_mask":
                _check_mask(name, array)
                tokens["loss_mask"] = np.repeat(array != 0, lengths)
            else:
                _check_kind(name, array, _REAL)
                sequences[column] = array
        for column, (name, value, kind) in given.items():
            if value is None:
                continue
            array = layout.rollout if column == "rollout_logprob" else layout.values(name, value)
            if kind is _MASK:
                _check_mask(name, array)
                array = array != 0
            else:
                _check_kind(name, array, kind)
            tokens[column] = layout.select(array)
        for column, name in _TOPK.items():
            value = getattr(f, name)
            if value is None:
                continue
            array = layout.values(name, value, k=True)
            _check_kind(name, array, _INTEGER if column == "rollout_topk_ids" else _REAL)
            tokens[column] = layout.select(array)
        given_topk = [name for name in _TOPK.values() if getattr(f, name) is not None]
        if given_topk and len(given_topk) < len(_TOPK):
            missing = ", ".join(n for n in _TOPK.values() if getattr(f, n) is None)
            raise DumpError(f"Expected {missing} with {', '.join(given_topk)} (all three or none)")
        if f.rewards is not None:
            sequences["reward"] = _per_sequence("rewards", f.rewards, layout.count)
            _check_kind("rewards", sequences["reward"], _REAL)
        if f.group_ids is not None:
            sequences["group_id"] = _ids_argument("group_ids", f.group_ids, layout.count)
        if f.train_token_ids is not None and f.token_ids is None:
            raise DumpError("Expected `token_ids` with `train_token_ids` (they are compared)")
        for column, name in _META.items():
            value = getattr(f, name)
            if value is None:
                continue
            if _SEQUENCE_TYPES[column] is None:
                sequences[column] = _ids_argument(name, value, layout.count)
                continue
            sequences[column] = _per_sequence(name, value, layout.count)
            _check_kind(name, sequences[column], _INTEGER)
        ids = _ids_argument("seq_ids", f.seq_ids, layout.count)
        if self._files is not None:  # the single file counts in write_table
            self.tokens += int(lengths.sum())
        return canonical_table(
            step=step, seq_id=ids, lengths=lengths, tokens=tokens, sequences=sequences
        )

    def _footer(self, steps: Sequence[int]) -> dict[str, str]:
        record = {
            "framework": self.framework,
            "source_files": [],
            "steps": sorted(steps),
            "rank": self.rank,
        }
        return {PROVENANCE_KEY.decode(): json.dumps(record)}

    @property
    def steps(self) -> list[int]:
        """The distinct steps written so far, in order."""
        return sorted(self._steps)

    def write_table(self, table: pa.Table, *, what: str = "table") -> None:
        """Write a canonical sequence-layout table (see `canonical_table`) as one row group.

        Raises:
            DumpError: the table's columns differ from the first table's.
        """
        self._check_open()
        if self._files is not None:
            raise DumpError("write_table writes a single file; this writer has a rank")
        if table.num_rows == 0:
            return
        if self._schema is None:
            self._schema = table.schema
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # The Arrow schema is not stored: its metadata would hold the provenance as it
            # was at the first row group, and Arrow readers prefer it to the footer's.
            self._writer = pq.ParquetWriter(
                self.path, table.schema, compression=self.compression, store_schema=False
            )
        else:
            why = schema_mismatch(self._schema, table.schema)
            if why:
                raise DumpError(
                    f"{self.path}: this {what} {why}; every row group of a file has the columns "
                    "of the first (pass the same optional arguments every time)"
                )
        assert self._writer is not None
        self._writer.write_table(table, row_group_size=table.num_rows)
        self._steps.update(int(s) for s in pc.unique(table["step"]).to_pylist())
        self.sequences += table.num_rows
        self.tokens += int(pc.sum(pc.list_value_length(table["rollout_logprob"])).as_py() or 0)
        self.row_groups += 1

    def close(self, provenance: Mapping[str, object] | None = None) -> None:
        """Write the footer with the provenance and close the file; later calls do nothing.

        In the per-rank layout: write the last step and wait for the background thread.

        Args:
            provenance: fields added to (or replacing) `framework`, `source_files` and
                `steps` in the provenance JSON of the single file.

        Raises:
            DumpError: in the per-rank layout, steps whose values were invalid or whose file
                could not be written (the others are written).
        """
        if self._closed:
            return
        self._closed = True
        if self._files is not None:
            self._files.close()
            return
        if self._writer is None:
            return
        record = {"framework": self.framework, "source_files": [], "steps": self.steps}
        record.update(provenance or {})
        self._writer.add_key_value_metadata({PROVENANCE_KEY.decode(): json.dumps(record)})
        self._writer.close()

    def __enter__(self) -> DumpWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def _is_per_sequence(name: str, value: object) -> bool:
    """Whether `value` holds one value per sequence rather than one per token."""
    if isinstance(value, list | tuple):
        return all(_ndim(name, v) == 0 for v in value)
    return _ndim(name, value) == 1


def _ndim(name: str, value: object) -> int:
    ndim = getattr(value, "ndim", None)  # a tensor's, read without copying it
    return ndim if isinstance(ndim, int) else _to_numpy(name, value).ndim


def _count(value: object) -> int:
    """The number of sequences of a per-token argument, read without copying it."""
    if isinstance(value, list | tuple):
        return len(value)
    shape = getattr(value, "shape", None)
    if shape is None:
        shape = _to_numpy("rollout_logprobs", value).shape
    if len(shape) != 2:
        raise DumpError(
            "Expected argument `rollout_logprobs` to be a padded [B, T] array or a list of "
            f"per-sequence 1-D arrays, but got shape {list(shape)}"
        )
    return int(shape[0])


def _head(batch: BatchFields, count: int) -> BatchFields:
    """The first `count` sequences of every field (views of tensors and arrays)."""
    return replace(
        batch,
        **{
            f.name: value[:count]
            for f in fields(batch)
            if (value := getattr(batch, f.name)) is not None
        },
    )


def _precheck(batch: BatchFields) -> None:
    """What can be told from shapes alone, before the background thread reads the values."""
    if batch.train_logprobs is None:
        raise DumpError("Expected argument `train_logprobs`, but it is None")
    ragged = isinstance(batch.rollout_logprobs, list | tuple)
    if not ragged and batch.mask is None:
        raise DumpError(
            "Expected argument `mask` for padded [B, T] tensors: padding cannot be told from "
            "values, so the mask must say which positions are tokens"
        )
    shape = getattr(batch.rollout_logprobs, "shape", None)
    if ragged or shape is None:
        return
    for name in (
        "train_logprobs",
        "mask",
        "policy_logprobs",
        "floor_logprobs",
        "token_ids",
        "train_token_ids",
        "entropy",
    ):
        found = getattr(getattr(batch, name), "shape", None)
        if found is not None and tuple(found) != tuple(shape):
            raise DumpError(
                f"Expected argument `{name}` to have shape {list(shape)} like "
                f"`rollout_logprobs`, but got {list(found)}"
            )


def _metadata(count: int, **given: object) -> dict[str, object]:
    """The metadata arguments of `DumpWriter.add`, one value given for a whole call repeated
    for each of its `count` sequences (a list or an array stays as it is)."""
    return {name: [value] * count if _is_one(value) else value for name, value in given.items()}


def _is_one(value: object) -> bool:
    """Whether a metadata argument is one value (an integer or a string), not one a sequence."""
    return isinstance(value, int | np.integer | str) and not isinstance(value, bool)


def _ids_argument(name: str, value: object, count: int) -> pa.Array:
    if is_tensor(value) or isinstance(value, np.ndarray):
        array = _to_numpy(name, value)
        if array.dtype.kind not in "iuUO":
            raise DumpError(
                f"Expected argument `{name}` to hold integers or strings, but got {array.dtype}"
            )
        value = array
    return _id_array(name, value, count)
