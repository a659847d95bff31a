"""Read canonical logprob dumps (Parquet) into `TokenBatch`es, whole or streamed.

A dump is one Parquet file, a directory of them or a glob, in token layout (one row per
token) or sequence layout (one row per sequence, equal-length list columns); see
`iscore.columns` for the columns and the frameworks' names for them. Files are read row
group by row group, and `Dump.batches` yields whole sequences in chunks of bounded size, so
a dump larger than memory streams in constant memory.

Everything wrong with a dump is reported as a `Problem` naming the file, the column and the
first offending rows (0-based row numbers of that file); `DumpError.problems` holds them all.

>>> dump = Dump("data/dense_bf16.parquet")          # doctest: +SKIP
>>> batch = dump.load()                              # doctest: +SKIP
>>> for chunk in dump.batches(max_tokens=1_000_000):  # doctest: +SKIP
...     ...
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from iscore.budget import DEFAULT_CHUNK_TOKENS
from iscore.columns import EXPERT_COLUMNS, LOGPROB_COLUMNS, dump_schema
from iscore.dump.files import (
    import_framework_dump,
    is_framework_dump,
    leaf,
    open_file,
    resolve_files,
)
from iscore.dump.readers import INVALID, Chunk, check_values, invalid_values, open_reader
from iscore.dump.tensors import concat_batches, to_batch
from iscore.dump.values import DropReport, DumpFile, Extra, Layout, StepRange
from iscore.errors import DumpError, DumpProblems, Problem, clip, quote
from iscore.where import Judge, Where

if TYPE_CHECKING:
    import torch

    from iscore.batch import TokenBatch


class Dump:
    """A logprob dump on disk: one file, a directory or a glob of Parquet files.

    Args:
        source: a path, a directory, a glob, or a list of those.
        columns: explicit canonical -> source column names, winning over the aliases.
        steps: only read sequences whose step lies in this range.
        drop_invalid: drop sequences with NaN, infinite or positive log-probs (counted in
            `dropped`) instead of raising.
        where: only read sequences where this SQL predicate over the sequence table's dump
            and mismatch columns holds (`iscore.sequences`), judged chunk by chunk as they are read.
        extras: carry every per-sequence column of the dump (`Extra`) into the batches'
            `extra` table; without it only those `where` reads are carried.

    Raises:
        DumpProblems: files that cannot be opened or have the wrong columns (all listed).
        QueryError: `where` is not a boolean expression over the sequence table's columns.
    """

    def __init__(
        self,
        source: str | Path | Sequence[str | Path],
        *,
        columns: Mapping[str, str] | None = None,
        steps: StepRange | None = None,
        drop_invalid: bool = False,
        fmt: str | None = None,
        allow_pickle: bool = False,
        where: str | None = None,
        extras: bool = False,
    ):
        sources = [source] if isinstance(source, str | Path) else list(source)
        files: list[tuple[str, bytes | None]] = []
        imported = False
        for item in sources:
            if fmt is not None or is_framework_dump(item):
                files.append(import_framework_dump(item, fmt, allow_pickle))
                imported = True
            else:
                files.extend((path, None) for path in resolve_files(item))
        self._setup(files, columns, steps, drop_invalid, where, extras, imported)

    @classmethod
    def from_buffers(
        cls,
        files: Sequence[tuple[str, bytes]],
        *,
        columns: Mapping[str, str] | None = None,
        steps: StepRange | None = None,
        drop_invalid: bool = False,
        where: str | None = None,
        extras: bool = False,
    ) -> Dump:
        """A dump of Parquet files held in memory, e.g. uploads: (name, bytes) pairs.

        Reads exactly like a dump on disk (same problems, same messages, the names standing
        for paths) and writes nothing anywhere.
        """
        if not files:
            raise DumpError("no files given")
        dump = cls.__new__(cls)
        files = [(name, data) for name, data in files]
        dump._setup(files, columns, steps, drop_invalid, where, extras)
        return dump

    def _setup(
        self,
        files: Sequence[tuple[str, bytes | None]],
        columns: Mapping[str, str] | None,
        steps: StepRange | None,
        drop_invalid: bool,
        where: str | None = None,
        extras: bool = False,
        imported: bool = False,
    ) -> None:
        self.imported = imported  # a framework's own dump, converted to Parquet in memory
        self._mapping = dict(columns or {})
        self.steps = steps or StepRange()
        self.drop_invalid = drop_invalid
        self.dropped = DropReport()
        self.files: list[DumpFile] = []
        self._parquet: list[pq.ParquetFile] = []
        self._data: list[bytes | None] = []
        problems: list[Problem] = []
        for path, data in files:
            try:
                parquet, info = open_file(path, self._mapping, data)
            except DumpProblems as e:
                problems.extend(e.problems)
                continue
            except DumpError as e:
                problems.append(Problem(path, None, str(e).removeprefix(f"{path}: ")))
                continue
            self.files.append(info)
            self._parquet.append(parquet)
            self._data.append(data)
        if problems:
            raise DumpProblems(problems)
        for name in ("policy_logprob", "rollout_experts", "turn"):
            _check_everywhere(self.files, name)
        first = self.files[0]
        other = next((f for f in self.files if f.layout != first.layout), None)
        if other is not None:
            message = (
                f"{other.layout} layout, but {first.path} is in {first.layout} layout; the "
                "files of a dump share one layout (files mix token and sequence layouts)"
            )
            raise DumpProblems([Problem(other.path, None, message)])
        self.layout: Layout = self.files[0].layout
        self._extras = _union_extras(self.files)
        self.sequence_schema = dump_schema(
            _seq_id_type(self.files), pa.schema([(e.name, e.type) for e in self._extras])
        )
        """The sequence table's columns that come from the dump (`iscore.sequences`)."""
        self.where = None
        if where is not None:
            self.where = Where.compile(where, self.sequence_schema)
        """The `where` predicate, checked against `sequence_schema`."""
        carried = {e.name for e in self._extras}
        if not extras:
            carried &= set() if self.where is None else self.where.extras
        self.carried = pa.schema([(e.name, e.type) for e in self._extras if e.name in carried])
        """The extra columns each batch's `extra` table holds (`None` when there are none)."""

    @property
    def columns(self) -> dict[str, str | None]:
        """The explicit canonical -> source column names it was opened with (a copy)."""
        return dict(self._mapping)

    @property
    def in_memory(self) -> bool:
        """Whether some of its files are held in memory (uploads, converted framework dumps)
        rather than read from disk."""
        return any(data is not None for data in self._data)

    @property
    def provenance(self) -> list[dict]:
        """Per file, where an imported dump came from (framework, source files, steps), or {}."""
        return [f.provenance for f in self.files]

    def head(self, rows: int) -> pa.Table:
        """The first `rows` rows of the first file, every column as stored (to show what the
        dump holds)."""
        batch = next(self._parquet[0].iter_batches(batch_size=rows), None)
        schema = self._parquet[0].schema_arrow
        return pa.Table.from_batches([] if batch is None else [batch], schema=schema)

    def datasets(self) -> list[pads.Dataset]:
        """Each file as an Arrow dataset with its own column names (read lazily when
        scanned, as DuckDB does for the `tokens` view of `iscore.sequences`)."""
        out = []
        checked = pads.ParquetFragmentScanOptions(page_checksum_verification=True)
        parquet = pads.ParquetFileFormat(default_fragment_scan_options=checked)
        for info, data in zip(self.files, self._data, strict=True):
            if data is None:
                out.append(pads.dataset(info.path, format=parquet))
                continue
            fragment = parquet.make_fragment(pa.BufferReader(data))
            out.append(pads.FileSystemDataset([fragment], fragment.physical_schema, parquet))
        return out

    @property
    def num_tokens(self) -> int:
        """Tokens of all files together before any step filter, from the Parquet footers."""
        return sum(f.num_tokens for f in self.files)

    def load(
        self,
        device: str | torch.device = "cpu",
        progress: Callable[[int], None] | None = None,
    ) -> TokenBatch:
        """Read the whole dump into one `TokenBatch` on `device`.

        It is read in chunks of `DEFAULT_CHUNK_TOKENS` joined at the end: the decoded
        columns of one chunk at a time are in memory beside the tokens kept, never the whole
        file's (at 19.5M tokens: 0.4x the peak and about half the time of reading each file
        in one piece). `progress` is called with the number of tokens of each chunk read.

        Raises:
            DumpProblems: the dump has problems (all of them are listed).
        """
        parts = []
        try:
            for part in self.batches(DEFAULT_CHUNK_TOKENS):
                parts.append(part)
                if progress is not None:
                    progress(part.num_tokens)
        except DumpProblems:
            # Those of one chunk; each file read in one piece lists every one.
            parts.clear()
            for _ in self.batches(max_tokens=None):
                pass
            raise
        if not parts:
            raise DumpError(f"{self.files[0].path}: {self.why_empty()}")
        import torch

        batch = parts[0] if len(parts) == 1 else concat_batches(parts)
        return batch.to(device) if torch.device(device) != batch.device else batch

    def batches(
        self, max_tokens: int | None = DEFAULT_CHUNK_TOKENS, *, whole_steps: bool = False
    ) -> Iterator[TokenBatch]:
        """Yield whole sequences in batches of about `max_tokens` tokens each.

        A batch overshoots `max_tokens` by at most one read (256k tokens) or one sequence
        longer than that; `None` yields one batch per file. With `whole_steps`, a training step
        is never split across batches (a batch then holds at least one whole step): settings
        that normalize over a step's batch need all of it at once.

        Raises:
            DumpProblems: the first chunk with problems, listing every problem in it.
        """
        seen: dict[tuple[int, object], str] = {}
        sequences = tokens = in_loss = 0
        with self._judge() as judge:
            for info, parquet in zip(self.files, self._parquet, strict=True):
                reader = open_reader(
                    info, parquet, self.steps, seen, whole_steps, self._carry(info)
                )
                for chunk in reader.chunks(max_tokens):
                    problems = check_values(chunk, info.columns)
                    if problems:
                        chunk, problems = self._drop(chunk, problems)
                    if problems:
                        raise DumpProblems(problems)
                    batch = self._select(chunk, judge)
                    if batch is not None:
                        sequences += batch.num_sequences
                        tokens += batch.num_tokens
                        in_loss += int(batch.loss_mask.sum())
                        yield batch
        if sequences and not in_loss:
            raise DumpProblems([self.nothing_in_loss(sequences, tokens)])

    def why_empty(self) -> str:
        """Why reading yielded no sequence, for messages: all were dropped as invalid, or
        none is in the selection."""
        if self.dropped.sequences:
            n = self.dropped.sequences
            if n == 1:
                return "its only sequence was dropped as invalid"
            return f"all {n:,} sequences were dropped as invalid"
        return f"no sequences in the {self.describe_selection()}"

    def describe_selection(self) -> str:
        """What reading selects, for messages: the steps (with those the dump has, when a
        range was asked for), and the `where` predicate."""
        steps = "selected steps"
        if self.steps != StepRange():
            lo, hi = ("" if v is None else v for v in (self.steps.lo, self.steps.hi))
            asked = str(lo) if lo == hi else f"{lo}:{hi}"
            span = self._step_span()
            if span is not None:
                low, high = span
                has = f"step {low}" if low == high else f"steps {low}..{high}"
                asked += f"; the dump has {has}"
            steps = f"selected steps ({asked})"
        if self.where is None:
            return steps
        return f"{steps} where {quote(self.where.text)}"

    def _step_span(self) -> tuple[int, int] | None:
        """The smallest and largest step of every file, from the footers' statistics (None
        where one lacks them). A file without a step column is step 0."""
        lows, highs = [], []
        for info, parquet in zip(self.files, self._parquet, strict=True):
            source = info.columns.source.get("step")
            if source is None:
                lows.append(0)
                highs.append(0)
                continue
            for g in range(parquet.num_row_groups):
                stats = leaf(parquet.metadata, g, source).statistics
                if stats is None or not stats.has_min_max:
                    return None
                lows.append(int(stats.min))
                highs.append(int(stats.max))
        return (min(lows), max(highs)) if lows else None

    def _carry(self, info: DumpFile) -> tuple[Extra, ...]:
        """The extra columns to read from `info`."""
        return tuple(e for e in info.extras if e.name in self.carried.names)

    @contextlib.contextmanager
    def _judge(self) -> Iterator[Judge | None]:
        """A judge of the `where` predicate for one pass (None without one)."""
        if self.where is None:
            yield None
            return
        with self.where.judge() as judge:
            yield judge

    def _select(self, chunk: Chunk, judge: Judge | None) -> TokenBatch | None:
        """The chunk as a batch with the carried columns, only its sequences where the
        predicate holds; None when none is left."""
        if not chunk.lengths.size:
            return None
        batch = to_batch(chunk, self.carried)
        if judge is not None:
            batch = judge.select(batch)
        return batch if batch.num_sequences else None

    def _keep(self, chunk: Chunk, judge: Judge | None) -> Chunk | None:
        """`_select` kept as a chunk: tensors are made only for the `where` judge."""
        if judge is not None and chunk.lengths.size:
            chunk = chunk.subset(judge.keep(to_batch(chunk, self.carried)))
        return chunk if chunk.lengths.size else None

    def nothing_in_loss(self, sequences: int, tokens: int) -> Problem:
        """The problem of a dump whose sequences hold no token in the loss."""
        where = self.files[0].path if len(self.files) == 1 else f"{len(self.files)} files"
        if not tokens:
            return Problem(where, None, f"all {sequences:,} sequences are empty (0 tokens)")
        return Problem(
            where,
            "loss_mask",
            f"no token is in the loss: loss_mask is false for all {tokens:,} tokens",
        )

    def scan(
        self, max_tokens: int | None = DEFAULT_CHUNK_TOKENS
    ) -> Iterator[tuple[list[Problem], dict[str, np.ndarray] | None]]:
        """Read the whole dump, yielding each chunk's problems and its sequences as numpy
        arrays (`Chunk.arrays`; None if it has problems, or if `where` selects none of its
        sequences). Tensors are made only to judge a `where` predicate: validating a
        dump needs no torch.

        This is `batches` for validation: a file with a structural problem (duplicate
        sequences, unequal lists, corrupt pages) is reported and skipped, and reading goes on
        with the next file; value problems are reported per chunk.
        """
        seen: dict[tuple[int, object], str] = {}
        with self._judge() as judge:
            for info, parquet in zip(self.files, self._parquet, strict=True):
                reader = open_reader(info, parquet, self.steps, seen, extras=self._carry(info))
                try:
                    for chunk in reader.chunks(max_tokens):
                        problems = check_values(chunk, info.columns)
                        if problems:
                            chunk, problems = self._drop(chunk, problems)
                        kept = None if problems else self._keep(chunk, judge)
                        yield problems, None if kept is None else kept.arrays()
                except DumpProblems as e:
                    yield list(e.problems), None

    def _drop(self, chunk: Chunk, problems: list[Problem]) -> tuple[Chunk, list[Problem]]:
        """With `drop_invalid`, remove sequences whose only problems are invalid values."""
        if not self.drop_invalid or any(not p.message.startswith(INVALID) for p in problems):
            return chunk, problems
        bad_token = np.zeros(int(chunk.lengths.sum()), dtype=bool)
        for name in LOGPROB_COLUMNS:
            if name in chunk.per_token:
                bad_token |= invalid_values(chunk.per_token[name])
        seq_of_token = np.repeat(np.arange(chunk.lengths.size), chunk.lengths)
        bad_seq = np.zeros(chunk.lengths.size, dtype=bool)
        bad_seq[seq_of_token[bad_token]] = True
        for p in problems:
            key = p.column.split(" ")[0] if p.column else "?"
            self.dropped.reasons[key] = self.dropped.reasons.get(key, 0) + p.count
        self.dropped.sequences += int(bad_seq.sum())
        self.dropped.tokens += int(chunk.lengths[bad_seq].sum())
        return chunk.subset(~bad_seq), []


def load(
    source: Data,
    *,
    columns: Mapping[str, str] | None = None,
    steps: StepRange | None = None,
    drop_invalid: bool = False,
    device: str | torch.device = "cpu",
) -> TokenBatch:
    """Read a whole dump into one `TokenBatch`; see `Dump` for the arguments (they apply to
    a dump opened from its path: a `Dump` was opened with its own).

    >>> batch = load("data/dense_bf16.parquet")
    >>> batch.num_sequences, batch.num_tokens
    (112, 106256)
    """
    options = {"columns": columns, "steps": steps, "drop_invalid": drop_invalid}
    return load_data(open_data(source, **options)).to(device)


Data: TypeAlias = "str | Path | Sequence[str | Path] | Dump | TokenBatch"
"""What every public function takes for data: a path, a directory or a glob (or a list of
them), an opened `Dump`, or a loaded `TokenBatch`."""


def open_data(data: Data, **options: Any) -> Dump | TokenBatch:
    """`data` as a `Dump` to stream, or the `TokenBatch` it already is: the one place that
    tells the forms of data apart, so that the same bad input gets the same error from every
    function and command.

    Args:
        data: a path, a directory or a glob (or a list of them), a `Dump` or a `TokenBatch`.
        options: `Dump`'s keyword arguments, for a dump opened from its path; those that
            differ from their defaults are refused for a `Dump` or a batch, already opened.

    >>> open_data(3)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    iscore.errors.DumpError: Expected data to be a path, ... or a TokenBatch, but got int

    Raises:
        DumpError: `data` is none of those forms, or the dump cannot be opened.
    """
    from iscore.batch import TokenBatch  # torch, only when data is given

    if isinstance(data, Dump | TokenBatch):
        given = sorted(k for k, v in options.items() if v not in (None, False))
        if given:
            raise DumpError(
                f"{', '.join(given)} apply to a dump opened from its path; this "
                f"{type(data).__name__} is open already (open it with Dump(path, ...))"
            )
        return data
    paths = [data] if isinstance(data, str | os.PathLike) else data
    if (
        not isinstance(paths, list | tuple)
        or not paths
        or not all(isinstance(p, str | os.PathLike) for p in paths)
    ):
        raise DumpError(
            "Expected data to be a path, a directory or a glob (or a list of them), a Dump or "
            f"a TokenBatch, but got {_kind(data)}"
        )
    return Dump([os.fspath(p) for p in paths], **options)


def load_data(data: Data) -> TokenBatch:
    """`data` loaded whole: a batch as it is, a dump read into one (see `open_data`)."""
    opened = open_data(data)
    return opened.load() if isinstance(opened, Dump) else opened


def _kind(value: object) -> str:
    """What a value is, for messages: its type, and for a list the types inside it."""
    if isinstance(value, list | tuple):
        inside = sorted({type(v).__name__ for v in value})
        return f"a {type(value).__name__} of {', '.join(inside)}" if inside else "an empty list"
    return type(value).__name__


def _union_extras(files: Sequence[DumpFile]) -> tuple[Extra, ...]:
    """The extra columns of all files, in order of appearance; one type per name."""
    found: dict[str, Extra] = {}
    where: dict[str, str] = {}
    for info in files:
        for extra in info.extras:
            known = found.setdefault(extra.name, extra)
            where.setdefault(extra.name, info.path)
            if known.type != extra.type:
                message = (
                    f"{extra.type} here but {known.type} in {where[extra.name]}; the files of "
                    "a dump agree on it"
                )
                raise DumpProblems([Problem(info.path, clip(extra.source), message)])
    return tuple(found.values())


def _check_everywhere(files: Sequence[DumpFile], name: str) -> None:
    """A column with no default (policy_logprob, the expert ids, turn): the files of a dump
    all have it, or none does."""
    having = [f.path for f in files if name in f.columns]
    lacking = [f.path for f in files if name not in f.columns]
    if having and lacking:
        others = f" (and {len(lacking) - 1:,} other files)" if len(lacking) > 1 else ""
        both = EXPERT_COLUMNS if name in EXPERT_COLUMNS else (name,)
        message = (
            f"missing here{others} but present in {having[0]}; the files of a dump all have "
            f"it or none does (leave it out of every file with "
            f"{' '.join(f'--column {n}=' for n in both)})"
        )
        raise DumpProblems([Problem(lacking[0], name, message)])


def _seq_id_type(files: Sequence[DumpFile]) -> pa.DataType:
    first = files[0]
    for info in files:
        if info.seq_id_type != first.seq_id_type:
            message = (
                f"{info.seq_id_type} here but {first.seq_id_type} in {first.path}; the files "
                "of a dump agree on the type of seq_id"
            )
            raise DumpProblems([Problem(info.path, "seq_id", message)])
    return first.seq_id_type
