"""The parts of an analysis computed as tasks, on a Ray cluster (`--engine ray`) or in this
machine's worker processes (`--jobs N`): a task per piece of a file, each analyzed on a
worker's CPU as one process analyzes a file, merged here in the order one process reads
them."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from iscore.dump import (
    DropReport,
    Dump,
    Piece,
    StepRange,
)
from iscore.errors import IscoreError
from iscore.frameworks import Spec
from iscore.packed import ops
from iscore.passes.parts import StepPart, analyzed, step_runs
from iscore.passes.results_store import (
    Context,
    FileIdentity,
    ResultStore,
    StoredFile,
    StoredPart,
)
from iscore.passes.sequences import SequenceTable
from iscore.passes.stored import part_of, served_parts, to_store
from iscore.passes.streaming import prefetched
from iscore.utils import Ready

FanOut = Callable[..., Iterator[tuple[Any, Any]]]
"""How tasks run: `iscore.utils.ordered` (Ray) or `iscore.utils.ordered_here` with its jobs
(worker processes); either takes `(fn, work, name=, done=)` and yields `(task, result)` in
the order of the work."""


@dataclass(frozen=True, slots=True)
class _PieceTask:
    """What a task analyzes (`_analyze_piece`): a piece of a dump's file, with what the
    results store holds of it (parts to take settings from), and the sequence table's
    columns where one is filled in the same pass.

    Attributes:
        index: the file's index in its dump; last: whether it is the file's last piece (the
            driver's bookkeeping).
        keep: hand back the parts as the store keeps them (a store keeps them), else the
            accumulators themselves (nothing to decode on the driver's side).
    """

    index: int
    last: bool
    piece: Piece
    specs: tuple[Spec, ...]
    max_tokens: int
    held: tuple[StoredPart, ...] = ()
    table: pa.Schema | None = None
    keep: bool = True


@dataclass(slots=True)
class _PieceDone:
    """What a task hands back: its parts (as the store keeps them, plain arrays, or as
    accumulators: `_PieceTask.keep`), the tokens read, the sequences `drop_invalid` dropped
    and its rows of the sequence table."""

    parts: list[StoredPart] | list[StepPart]
    tokens: int
    dropped: DropReport
    table: SequenceTable | None


def _analyze_piece(task: _PieceTask) -> _PieceDone:
    """A piece analyzed by a worker (on its CPU), as `stored_parts` analyzes a file."""
    dump = task.piece.open()
    held = {(p.step, p.run): p for p in task.held}
    table = None if task.table is None else SequenceTable(task.table, task.specs)
    runs: dict[int, int] = {}
    done: list[Any] = []
    tokens = 0
    chunks = dump.batches(task.max_tokens, whole_steps=True, part=True)
    with ops.reused_buffers():
        for chunk in prefetched(chunks):
            tokens += chunk.num_tokens
            for step, run in step_runs(chunk):
                runs[step] = runs.get(step, -1) + 1
                stored = held.get((step, runs[step]))
                part = analyzed(run, step, task.specs, table, stored)
                done.append(to_store(part, runs[step], task.specs, stored) if task.keep else part)
    return _PieceDone(done, tokens, dump.dropped, table)


def task_parts(
    fan_out: FanOut,
    dump: Dump,
    specs: Sequence[Spec],
    store: ResultStore | None,
    max_tokens: int,
    sequences: SequenceTable | None,
    progress: Callable[[int], None] | None,
    owners: list[tuple[str, int]],
) -> Iterator[StepPart]:
    """The parts of `dump`, in the order one process reads them: from `store` where it
    holds a file, else analyzed by tasks that `fan_out` runs (a file's pieces of at least
    `max_tokens` tokens, `Dump.pieces`) and kept in the store. `sequences` gets the tasks' rows, the
    dump's `dropped` what they dropped, `progress` each file's tokens as it is done and
    `owners` the file and sequences of each part.

    Raises:
        IscoreError: as one process would raise it, or a task that failed, naming its file.
    """
    whole = dump.steps == StepRange()
    keys: dict[int, tuple[FileIdentity | None, str]] = {}
    saved: list[StoredPart] = []

    def work() -> Iterator[Any]:
        for index, info in enumerate(dump.files):
            stored = None
            if store is not None:
                identity = FileIdentity.of(info.path)
                context = Context(tuple(sorted(info.columns.source.items())), "cpu").key
                keys[index] = identity, context
                stored = None if identity is None else store.load(identity, context)
                served = None if stored is None else served_parts(stored, specs, dump.steps)
                if served is not None:
                    yield Ready((index, served))
                    continue
            pieces = dump.pieces(index, max_tokens)
            for k, piece in enumerate(pieces):
                held = () if stored is None or not whole else tuple(stored.parts)
                yield _PieceTask(
                    index,
                    k == len(pieces) - 1,
                    piece,
                    tuple(specs),
                    max_tokens,
                    tuple(p for p in held if piece.steps.row_group_may_match(p.step, p.step)),
                    None if sequences is None else sequences.schema,
                    keep=whole and store is not None,
                )

    def finished(task: _PieceTask, result: _PieceDone) -> None:
        if progress is not None:
            progress(result.tokens)

    tasks = fan_out(_analyze_piece, work(), name=lambda task: task.piece.path, done=finished)
    for item, result in tasks:
        if isinstance(item, Ready):
            index, served = result
            for part in served:
                owners.append((dump.files[index].path, part.sequences))
                if progress is not None:
                    progress(part.tokens)
                yield part
            continue
        path = item.piece.path
        dump.dropped.add(result.dropped)
        if sequences is not None:
            sequences.extend(result.table)
        for held in result.parts:
            part = held if isinstance(held, StepPart) else part_of(held, specs)
            if part is None:
                raise IscoreError(f"{path}: the task's results do not make accumulators")
            owners.append((path, part.sequences))
            yield part
        if item.keep:
            saved += result.parts
        if item.last:
            identity, context = keys.get(item.index, (None, ""))
            if whole and store is not None and identity is not None:
                try:
                    store.save(identity, context, StoredFile(saved, complete=True))
                except IscoreError as e:
                    warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
                    store = None
            saved = []
