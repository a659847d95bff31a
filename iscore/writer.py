"""Write canonical sequence-layout Parquet dumps, from a training loop or from an importer.

verl, TRL, OpenRLHF and AReaL hold the rollout and trainer log-probs in memory and never
write them. `DumpWriter` turns the tensors they already
have into the dump iscore reads (README, "The dump"): one row per sequence, one Parquet row
group per `add` call, written to disk before `add` returns. Calling it every step of a long
run therefore holds one step's data in memory, never the run's.

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

Where to call it, per framework (names as of the upstream commits of
docs/corrections.md#frameworks). Create
`writer = DumpWriter("run.parquet", framework=...)` once and call `writer.close()` at the end
(or use it as a context manager). With several processes, give each its own file and pass
`seq_ids` that are unique across them: a dump identifies a sequence by (step, seq_id).

verl, `RayPPOTrainer.fit` in `verl/trainer/ppo/ray_trainer.py`, after `compute_advantage`
and before `update_actor` (the batch then holds both log-probs; in bypass mode
`old_log_probs` IS `rollout_log_probs` and the dump shows no mismatch)::

    writer.add(
        step=self.global_steps,
        rollout_logprobs=batch.batch["rollout_log_probs"],  # [B, R] vLLM/SGLang
        train_logprobs=batch.batch["old_log_probs"],  # [B, R] FSDP/Megatron recompute
        mask=batch.batch["response_mask"],  # left-aligned, right-padded
        advantages=batch.batch["advantages"],  # [B, R] per token
        group_ids=list(batch.non_tensor_batch["uid"]),  # the prompt of each response
    )

TRL, `GRPOTrainer._generate_and_score_completions` in `trl/trainer/grpo_trainer.py`, just
before `return output` (`old_per_token_logps` is None unless vLLM IS correction or gradient
accumulation asked for it)::

    writer.add(
        step=self.state.global_step,
        rollout_logprobs=sampling_per_token_logps,  # [B, C] vLLM
        train_logprobs=old_per_token_logps,  # [B, C] trainer
        mask=completion_mask,  # right-padded; zero rows for masked truncations
        advantages=advantages,  # [B] per sequence
    )

OpenRLHF, `make_experience` in `openrlhf/trainer/ppo_utils/experience_maker.py`, before
`return samples_list` (`rollout_log_probs` exists only with
`--algo.advantage.is_correction_enable`); one row per sequence across all experiences::

    rows = lambda name: [row for e in samples_list for row in getattr(e, name)]
    writer.add(
        step=step,  # your own step counter
        rollout_logprobs=rows("rollout_log_probs"),  # [b, A] each
        train_logprobs=rows("action_log_probs"),
        mask=rows("action_mask"),
    )

AReaL, `areal/trainer/rl_trainer.py`, after the `prox_logp` recompute and before
`compute_advantages` (which may overwrite `logprobs`). AReaL's `logprobs` are the ROLLOUT
log-probs, aligned with the token they score; `prox_logp` and the loss are shifted by one,
hence the rolls::

    writer.add(
        step=global_step,
        rollout_logprobs=[torch.roll(t["logprobs"], -1, dims=-1)[0] for t in rollout_batch],
        train_logprobs=[t["prox_logp"][0] for t in rollout_batch],
        mask=[torch.roll(t["loss_mask"], -1, dims=-1)[0] for t in rollout_batch],
    )

Provenance (`{"framework", "source_files", "steps", ...}` as JSON) is stored under the
Parquet footer key `iscore.provenance` when the writer closes, so it also shows in
`pq.read_table(path).schema.metadata`. A process killed before `close` leaves a file without
its footer, which no Parquet reader can open: close it (the context manager closes it even
when the block raises).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from iscore.errors import DumpError, quote

__all__ = ["COLUMN_ORDER", "PROVENANCE_KEY", "DumpWriter", "canonical_table", "schema_mismatch"]

PROVENANCE_KEY = b"iscore.provenance"
"""Parquet footer (and Arrow schema metadata) key of the provenance JSON."""

COLUMN_ORDER = (
    "step",
    "seq_id",
    "rollout_logprob",
    "train_logprob",
    "loss_mask",
    "policy_logprob",
    "advantage",
    "token_id",
    "reward",
    "group_id",
    "entropy",
)
"""The canonical columns a written dump may hold, in the order they are written."""

_TOKEN_TYPES = {
    "rollout_logprob": pa.float32(),
    "train_logprob": pa.float32(),
    "loss_mask": pa.bool_(),
    "policy_logprob": pa.float32(),
    "advantage": pa.float32(),
    "token_id": pa.int32(),
    "entropy": pa.float32(),
}
"""Per-token columns and the type of their list items."""

_SEQUENCE_TYPES = {"advantage": pa.float32(), "reward": pa.float32(), "group_id": None}
"""Per-sequence columns; None: integers or strings, whichever the values are."""

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
        sequences: canonical per-sequence column (`advantage`, `reward`, `group_id`) -> [B].

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
        if values.shape != (total,):
            raise DumpError(
                f"Expected {total:,} values of {name} (the sequences' lengths sum to that), "
                f"but got shape {list(values.shape)}"
            )
        flat = pa.array(exact_cast(name, values, np.dtype(_TOKEN_TYPES[name].to_pandas_dtype())))
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


def _check_kind(name: str, array: np.ndarray, kind: tuple[str, str]) -> None:
    if array.size and array.dtype.kind not in kind[0]:
        raise DumpError(f"Expected argument `{name}` to hold {kind[1]}, but got {array.dtype}")


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

    def _array(self, name: str, value: object) -> tuple[np.ndarray, object]:
        """One array ([B, T] padded, concatenated when ragged) and its shape (ragged: lengths)."""
        if not self.ragged:
            array = _to_numpy(name, value)
            if array.ndim != 2:
                raise DumpError(
                    f"Expected argument `{name}` to be a padded [B, T] array or a list of "
                    f"per-sequence 1-D arrays, but got shape {list(array.shape)}"
                )
            return array, array.shape
        rows = [_to_numpy(f"{name}[{i}]", v) for i, v in enumerate(value)]
        for i, row in enumerate(rows):
            if row.ndim != 1:
                raise DumpError(
                    f"Expected argument `{name}` sequence {i} to be 1-D, "
                    f"but got shape {list(row.shape)}"
                )
        lengths = np.array([row.size for row in rows], dtype=np.int64)
        return (np.concatenate(rows) if rows else np.zeros(0)), lengths

    def values(self, name: str, value: object) -> np.ndarray:
        """An argument as one array, checked against the layout of `rollout_logprobs`."""
        if isinstance(value, list | tuple) != self.ragged:
            expected = "a list of per-sequence arrays" if self.ragged else "a padded array"
            raise DumpError(
                f"Expected argument `{name}` to be {expected} like `rollout_logprobs`, "
                f"but got {type(value).__name__}"
            )
        array, shape = self._array(name, value)
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
        if array.dtype.kind != "b":
            _check_kind("mask", array, ("iuf", "booleans or 0/1"))
            odd = array[(array != 0) & (array != 1)]
            if odd.size:
                raise DumpError(
                    f"Expected argument `mask` to hold booleans or 0/1, but found {odd[0]}"
                )
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
    """Append training steps to a canonical Parquet dump, one row group per call.

    Args:
        path: the Parquet file to write (its folder is created; an existing file is replaced).
        framework: recorded in the provenance, e.g. "verl".
        compression: Parquet codec.

    Attributes:
        sequences: sequences written so far.
        tokens: tokens written so far.
        row_groups: row groups written so far.

    Nothing is written until the first `add`; closing a writer that was never given a row
    leaves no file.
    """

    def __init__(
        self, path: str | Path, framework: str | None = None, *, compression: str = "zstd"
    ):
        self.path = Path(path)
        self.framework = framework
        self.compression = compression
        self.sequences = 0
        self.tokens = 0
        self.row_groups = 0
        self._writer: pq.ParquetWriter | None = None
        self._schema: pa.Schema | None = None
        self._steps: set[int] = set()
        self._next_id = 0
        self._closed = False

    def add(
        self,
        *,
        step: int,
        rollout_logprobs: object,
        train_logprobs: object,
        mask: object = None,
        seq_ids: object = None,
        policy_logprobs: object = None,
        advantages: object = None,
        token_ids: object = None,
        entropy: object = None,
        rewards: object = None,
        group_ids: object = None,
    ) -> None:
        """Write one batch of sequences (one step) as one row group.

        Per-token arguments are padded [B, T] tensors/arrays (any alignment, holes allowed)
        or lists of B per-sequence 1-D arrays, all in the layout of `rollout_logprobs`.

        Args:
            step: the training step of every sequence in the batch.
            rollout_logprobs: rollout engine log-probs, per token.
            train_logprobs: the trainer's recomputed log-probs (pi_old), per token.
            mask: which positions are tokens (bool or 0/1). Required when padded; for lists,
                None keeps every value.
            seq_ids: [B] integer or string ids; by default a counter running across calls.
            policy_logprobs: current-policy log-probs, per token.
            advantages: [B] per sequence, or per token.
            token_ids: sampled token ids, per token.
            entropy: per-token entropy.
            rewards: [B] per-sequence rewards.
            group_ids: [B] integer or string ids of each sequence's prompt group.

        Raises:
            DumpError: an argument of the wrong shape or dtype (the message names it), an
                optional argument given in one call but not in an earlier one (a file has
                one schema), or a closed writer.
        """
        if self._closed:
            raise DumpError(f"{self.path}: the writer is closed")
        if isinstance(step, bool) or not isinstance(step, int | np.integer):
            raise DumpError(f"Expected argument `step` to be an integer, but got {quote(step)}")
        layout = _Layout(rollout_logprobs)
        lengths = layout.set_mask(mask)
        tokens: dict[str, np.ndarray] = {}
        given = {
            "rollout_logprob": ("rollout_logprobs", rollout_logprobs, _REAL),
            "train_logprob": ("train_logprobs", train_logprobs, _REAL),
            "policy_logprob": ("policy_logprobs", policy_logprobs, _REAL),
            "token_id": ("token_ids", token_ids, _INTEGER),
            "entropy": ("entropy", entropy, _REAL),
        }
        sequences: dict[str, np.ndarray] = {}
        if advantages is not None:
            if _is_per_sequence(advantages):
                sequences["advantage"] = _per_sequence("advantages", advantages, layout.count)
                _check_kind("advantages", sequences["advantage"], _REAL)
            else:
                given["advantage"] = ("advantages", advantages, _REAL)
        for column, (name, value, kind) in given.items():
            if value is None:
                continue
            array = layout.rollout if column == "rollout_logprob" else layout.values(name, value)
            _check_kind(name, array, kind)
            tokens[column] = layout.select(array)
        if rewards is not None:
            sequences["reward"] = _per_sequence("rewards", rewards, layout.count)
            _check_kind("rewards", sequences["reward"], _REAL)
        if group_ids is not None:
            sequences["group_id"] = _ids_argument("group_ids", group_ids, layout.count)
        if seq_ids is None:
            ids = np.arange(self._next_id, self._next_id + layout.count, dtype=np.int64)
        else:
            ids = _ids_argument("seq_ids", seq_ids, layout.count)
        table = canonical_table(
            step=int(step), seq_id=ids, lengths=lengths, tokens=tokens, sequences=sequences
        )
        self.write_table(table, what="add() call")
        if seq_ids is None:
            self._next_id += layout.count

    @property
    def steps(self) -> list[int]:
        """The distinct steps written so far, in order."""
        return sorted(self._steps)

    def write_table(self, table: pa.Table, *, what: str = "table") -> None:
        """Write a canonical sequence-layout table (see `canonical_table`) as one row group.

        Raises:
            DumpError: the table's columns differ from the first table's.
        """
        if self._closed:
            raise DumpError(f"{self.path}: the writer is closed")
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

        Args:
            provenance: fields added to (or replacing) `framework`, `source_files` and
                `steps` in the provenance JSON.
        """
        if self._closed:
            return
        self._closed = True
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


def _is_per_sequence(value: object) -> bool:
    """Whether `advantages` holds one value per sequence rather than one per token."""
    if isinstance(value, list | tuple):
        return all(np.ndim(_to_numpy("advantages", v)) == 0 for v in value)
    return _to_numpy("advantages", value).ndim == 1


def _ids_argument(name: str, value: object, count: int) -> pa.Array:
    if is_tensor(value) or isinstance(value, np.ndarray):
        array = _to_numpy(name, value)
        if array.dtype.kind not in "iuUO":
            raise DumpError(
                f"Expected argument `{name}` to hold integers or strings, but got {array.dtype}"
            )
        value = array
    return _id_array(name, value, count)
