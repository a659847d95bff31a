"""The per-rank, per-step layout of a dump written from a training loop.

A run is a folder; each data-parallel rank writes one Parquet file per step::

    run_dir/step_000123/rank_0007.parquet

iscore reads the folder as one run (a directory is every `*.parquet` below it). `StepFiles`
writes these files in a background thread, so the training step only hands over references:

- A file appears whole or not at all: it is written under a temporary name that no reader
  opens (`.rank_0007.parquet.<pid>.partial`, not a `*.parquet`), synced to disk, then renamed.
  A process killed mid-step loses that step's file and leaves at most a `.partial` behind.
- The queue is bounded by what it holds, not by what it says: when `max_pending` calls already
  wait for the thread, the step being added is dropped whole and counted (`dropped_steps`),
  and the training step does not wait.
- A step whose values are invalid or whose file cannot be written is not written; the others
  are, and `close` raises with the first reason and warns as soon as it happens.

>>> import tempfile, pyarrow as pa
>>> run = tempfile.mkdtemp()
>>> files = StepFiles(run, rank=7, build=lambda job: pa.table({"x": job}), footer=lambda s: {})
>>> files.add(3, [1, 2])
>>> files.add(3, [4])  # the same step: one file
>>> files.add(4, [5])
>>> files.close()
>>> step_file(run, 3, 7).relative_to(run).as_posix(), files.steps_written
('step_000003/rank_0007.parquet', 2)
"""

from __future__ import annotations

import atexit
import os
import queue
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from iscore.errors import DumpError, counted

__all__ = ["StepFiles", "describe_runs", "step_file", "write_atomic"]

_PART = "part"
_END = "end"


def step_file(run_dir: str | Path, step: int, rank: int) -> Path:
    """Where `rank` writes `step` in `run_dir`."""
    return Path(run_dir) / f"step_{step:06d}" / f"rank_{rank:04d}.parquet"


def write_atomic(
    path: Path,
    tables: Sequence[pa.Table],
    metadata: Mapping[str, str],
    compression: str = "zstd",
) -> None:
    """Write `tables` as the row groups of one Parquet file that appears whole or not at all.

    Raises:
        DumpError: the tables' columns differ.
    """
    schema = tables[0].schema
    for table in tables[1:]:
        if not table.schema.equals(schema):
            raise DumpError(
                f"{path}: the calls of one step gave different columns "
                f"({', '.join(schema.names)} / {', '.join(table.schema.names)}); pass the same "
                "optional fields every time"
            )
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        # No Arrow schema in the file: its metadata would be read before the footer's.
        with pq.ParquetWriter(
            partial, schema, compression=compression, store_schema=False
        ) as writer:
            for table in tables:
                writer.write_table(table, row_group_size=max(table.num_rows, 1))
            writer.add_key_value_metadata(dict(metadata))
        with open(partial, "rb") as f:
            os.fsync(f.fileno())
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def describe_runs(provenance: Sequence[Mapping[str, Any]]) -> list[str]:
    """One line per framework for the files a training loop wrote (their provenance has a
    `rank`), however many steps and ranks: a run folder holds one file per step and rank.

    >>> files = [{"framework": "trl", "rank": r, "steps": [s]} for r in (0, 1) for s in (3, 4, 6)]
    >>> describe_runs(files)
    ['written by a trl training loop: 6 files from 2 ranks, steps 3..6 (3 of them)']
    """
    runs: dict[str, tuple[int, set[int], set[int]]] = {}
    for record in provenance:
        if "rank" not in record:
            continue
        files, ranks, steps = runs.get(str(record.get("framework")), (0, set(), set()))
        ranks.add(record["rank"])
        steps.update(record.get("steps", []))
        runs[str(record.get("framework"))] = (files + 1, ranks, steps)
    lines = []
    for framework, (files, ranks, steps) in runs.items():
        span = f"{min(steps)}..{max(steps)}" if steps else "none"
        if steps and len(steps) != max(steps) - min(steps) + 1:
            span += f" ({len(steps)} of them)"
        lines.append(
            f"written by a {framework} training loop: {counted(files, 'file')} from "
            f"{counted(len(ranks), 'rank')}, steps {span}"
        )
    return lines


class StepFiles:
    """One rank's step files, built and written by a background thread.

    Args:
        run_dir: the run's folder.
        rank: this process's data-parallel rank.
        build: turns what `add` was given into a table, in the background thread (it may
            raise: that step is then not written).
        footer: the steps of a file -> its Parquet footer metadata.
        compression: Parquet codec.
        max_pending: the most `add` calls waiting for the thread before a step is dropped.

    Attributes:
        steps_written: files written so far.
        dropped_steps: steps dropped because the thread was behind.
        failed: (step, reason) of each step not written because of an error.
    """

    def __init__(
        self,
        run_dir: str | Path,
        rank: int,
        *,
        build: Callable[[Any], pa.Table],
        footer: Callable[[Sequence[int]], Mapping[str, str]],
        compression: str = "zstd",
        max_pending: int = 4,
    ):
        self.run_dir = Path(run_dir)
        self.rank = rank
        self.steps_written = 0
        self.dropped_steps = 0
        self.failed: list[tuple[int, str]] = []
        self._build = build
        self._footer = footer
        self._compression = compression
        self._max_pending = max_pending
        self._pending = 0
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._step: int | None = None  # the step being added
        self._dropping = False  # whether that step is being dropped
        self._ended: set[int] = set()
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, step: int, job: Any) -> None:
        """Hand `job` (part of `step`) to the thread; a new step ends the previous one.

        Raises:
            DumpError: `step` was already ended (its file may exist: it would be replaced).
        """
        if step != self._step:
            if step in self._ended:
                raise DumpError(
                    f"step {step} was already written by rank {self.rank}; a step's calls must "
                    "come together"
                )
            self._end()
            self._step, self._dropping = step, False
        if self._dropping:
            return
        with self._lock:
            full = self._pending >= self._max_pending
            if not full:
                self._pending += 1
        if full:
            self._dropping = True
            return
        self._start()
        self._queue.put((_PART, step, job))

    def close(self) -> None:
        """End the last step, wait for every file, and stop the thread.

        Raises:
            DumpError: steps that were not written because of an error.
        """
        if self._closed:
            return
        self._closed = True
        self._end()
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
            atexit.unregister(self.close)
        if self.failed:
            step, reason = self.failed[0]
            raise DumpError(
                f"{self.run_dir}: rank {self.rank} did not write "
                f"{counted(len(self.failed), 'step')}; step {step}: {reason}"
            )

    def _end(self) -> None:
        if self._step is None:
            return
        self._ended.add(self._step)
        if self._dropping:
            self.dropped_steps += 1
        if self._thread is not None:
            self._queue.put((_END, self._step, self._dropping))
        self._step = None

    def _start(self) -> None:
        if self._thread is None:
            # A daemon, closed at exit, so that a loop that never calls close still writes its
            # last step on a normal exit and never hangs the interpreter.
            self._thread = threading.Thread(
                target=self._run, name=f"iscore-dump-rank{self.rank}", daemon=True
            )
            self._thread.start()
            atexit.register(self.close)

    def _run(self) -> None:
        tables: list[pa.Table] = []
        error: str | None = None
        while (message := self._queue.get()) is not None:
            kind, step, payload = message
            if kind == _PART:
                try:
                    if error is None:
                        tables.append(self._build(payload))
                except Exception as e:  # reported at close; the loop goes on
                    error = str(e) or type(e).__name__
                finally:
                    del payload
                    with self._lock:
                        self._pending -= 1
                continue
            dropped = payload
            if error is None and not dropped and any(t.num_rows for t in tables):
                try:
                    write_atomic(
                        step_file(self.run_dir, step, self.rank),
                        [t for t in tables if t.num_rows],
                        self._footer([step]),
                        self._compression,
                    )
                    self.steps_written += 1
                except Exception as e:
                    error = str(e) or type(e).__name__
            if error is not None:
                self.failed.append((step, error))
                warnings.warn(
                    f"iscore: rank {self.rank} did not write step {step}: {error}",
                    RuntimeWarning,
                    stacklevel=1,
                )
            tables, error = [], None
