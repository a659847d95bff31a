"""Read canonical logprob dumps (Parquet) into `TokenBatch`es, whole or streamed.

A dump is one Parquet file, a directory of them or a glob, in token layout (one row per
token) or sequence layout (one row per sequence, equal-length list columns); see
`iscore.dump.columns` for the columns and the frameworks' names for them. Files are read row
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
import math
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from iscore.dump.columns import EXPERT_COLUMNS, LOGPROB_COLUMNS, TOPK_COLUMNS, dump_schema
from iscore.dump.files import (
    import_framework_dump,
    is_framework_dump,
    leaf,
    open_file,
    resolve_files,
)
from iscore.dump.readers import INVALID, Chunk, check_values, invalid_values, open_reader
from iscore.dump.tensors import concat_batches, to_batch
from iscore.dump.values import DEFAULT_CHUNK_TOKENS, DropReport, DumpFile, Extra, Layout, StepRange
from iscore.dump.where import Judge, Where
from iscore.errors import ConfigError, DumpError, DumpProblems, Problem, clip, quote
from iscore.packed import META_COLUMNS
from iscore.utils import Engine, check_engine, footer, ordered, storage

if TYPE_CHECKING:
    import torch

    from iscore.packed import TokenBatch


class Dump:
    """A logprob dump on disk: one file, a directory or a glob of Parquet files.

    Args:
        source: a path, a directory, a glob, or a list of those.
        columns: explicit canonical -> source column names, winning over the aliases.
        steps: only read sequences whose step lies in this range.
        drop_invalid: drop sequences with NaN, infinite or positive log-probs (counted in
            `dropped`) instead of raising.
        where: only read sequences where this SQL predicate over the sequence table's dump
            and mismatch columns holds (`iscore.passes.sequences`), judged chunk by chunk as they
        are read. extras: carry every per-sequence column of the dump (`Extra`) into the batches'
            `extra` table; without it only the metadata columns (`META_COLUMNS`) and those
            `where` reads are carried.
        footers: footers known to pass `footer.check` (a results store's `footers`): a
            file's footer found there is not parsed again, one that passes is added.

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
        footers: footer.Passed | None = None,
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
        self._setup(files, columns, steps, drop_invalid, where, extras, imported, footers=footers)

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
        piece: Piece | None = None,
        footers: footer.Passed | footer.Known | None = None,
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
            # A piece is opened by its absolute path and named as its dump names it.
            name = path if piece is None else piece.path
            try:
                parquet, info = open_file(path, self._mapping, data, footers)
            except DumpProblems as e:
                problems.extend(replace(p, file=name) for p in e.problems)
                continue
            except DumpError as e:
                problems.append(Problem(name, None, str(e).removeprefix(f"{path}: ")))
                continue
            self.files.append(info if piece is None else replace(info, path=name))
            self._parquet.append(parquet)
            self._data.append(data)
        if problems:
            raise DumpProblems(problems)
        for name in (
            "policy_logprob",
            "floor_logprob",
            "rollout_experts",
            "rollout_topk_ids",
            "turn",
        ):
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
        self.sequence_schema = (
            dump_schema(
                _seq_id_type(self.files), pa.schema([(e.name, e.type) for e in self._extras])
            )
            if piece is None
            else piece.schema
        )
        """The sequence table's columns that come from the dump (`iscore.passes.sequences`)."""
        self.where = None
        if where is not None:
            self.where = Where.compile(where, self.sequence_schema)
        """The `where` predicate, checked against `sequence_schema`."""
        carried = {e.name for e in self._extras}
        if not extras:
            # The metadata columns always: the mismatch is broken down by each.
            carried &= set(META_COLUMNS) | (set() if self.where is None else self.where.extras)
        self.carried = (
            pa.schema([(e.name, e.type) for e in self._extras if e.name in carried])
            if piece is None
            else piece.carried
        )
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
        scanned, as DuckDB does for the `tokens` view of `iscore.passes.sequences`)."""
        out = []
        checked = pads.ParquetFragmentScanOptions(page_checksum_verification=True)
        parquet = pads.ParquetFileFormat(default_fragment_scan_options=checked)
        for info, data in zip(self.files, self._data, strict=True):
            if data is None and storage.is_uri(info.path):
                fs, path = storage.locate(info.path)
                out.append(pads.dataset(path, format=parquet, filesystem=fs))
                continue
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
        engine: Engine = "local",
    ) -> TokenBatch:
        """Read the whole dump into one `TokenBatch` on `device`.

        It is read in chunks of `DEFAULT_CHUNK_TOKENS` joined at the end: the decoded
        columns of one chunk at a time are in memory beside the tokens kept, never the whole
        file's (at 19.5M tokens: 0.4x the peak and about half the time of reading each file
        in one piece). `progress` is called with the number of tokens of each chunk read.
        With `engine="ray"`, Ray tasks read the files (a file's pieces, `pieces`) and the
        batch is joined here in dump order: the same batch (`iscore.utils.distributed`).

        Raises:
            DumpProblems: the dump has problems (all of them are listed; on Ray, those of
                the first piece with any).
        """
        import torch  # here: this module is imported without torch (the CLI's start)

        check_engine(engine)
        if engine == "ray":
            batch = self._load_on_ray(progress)
            return batch.to(device) if torch.device(device) != batch.device else batch
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
        batch = parts[0] if len(parts) == 1 else concat_batches(parts)
        return batch.to(device) if torch.device(device) != batch.device else batch

    def _load_on_ray(self, progress: Callable[[int], None] | None) -> TokenBatch:
        """The whole dump read by Ray tasks, a piece each (`_read_piece`), joined in order;
        refused as one process refuses it: no sequence, none with a token in the loss, or a
        sequence in two files."""
        work = (p for i in range(len(self.files)) for p in self.pieces(i, DEFAULT_CHUNK_TOKENS))

        def done(piece: Piece, read: tuple[TokenBatch | None, DropReport]) -> None:
            if progress is not None and read[0] is not None:
                progress(read[0].num_tokens)

        parts: list[TokenBatch] = []
        owners: list[tuple[str, int]] = []
        for piece, (batch, dropped) in ordered(_read_piece, work, name=_path, done=done):
            self.dropped.add(dropped)
            if batch is not None:
                parts.append(batch)
                owners.append((piece.path, batch.num_sequences))
        if not parts:
            raise DumpError(f"{self.files[0].path}: {self.why_empty()}")
        batch = parts[0] if len(parts) == 1 else concat_batches(parts)
        if not bool(batch.loss_mask.any()):
            raise DumpProblems([self.nothing_in_loss(batch.num_sequences, batch.num_tokens)])
        if len({path for path, _ in owners}) > 1:  # each task's reader saw its piece alone
            check_unique(batch.step.numpy(), batch.seq_id, owners)
        return batch

    def batches(
        self,
        max_tokens: int | None = DEFAULT_CHUNK_TOKENS,
        *,
        whole_steps: bool = False,
        part: bool = False,
    ) -> Iterator[TokenBatch]:
        """Yield whole sequences in batches of about `max_tokens` tokens each.

        A batch overshoots `max_tokens` by at most one read (256k tokens) or one sequence
        longer than that; `None` yields one batch per file. A file whose tokens list top-k
        log-probs counts each of its k entries as a quarter of a token (`readers.TOPK_WEIGHT`:
        at k = 20 a batch holds a sixth of the tokens). With `whole_steps`, a training step
        is never split across batches (a batch then holds at least one whole step): settings
        that normalize over a step's batch need all of it at once. With `part`, this dump is
        part of a larger one (one of its files, or a piece: `piece`), and sequences with no
        token in the loss are not a problem of their own: the whole dump may have others.

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
        if sequences and not in_loss and not part:
            raise DumpProblems([self.nothing_in_loss(sequences, tokens)])

    def piece(self, index: int, steps: StepRange | None = None) -> Piece:
        """What this dump reads of its file `index`, or of the steps `steps` of it (within
        its own selection), as plain values that another process opens (`Piece.open`): a
        Ray task reads one (`iscore.utils.distributed`).

        Raises:
            DumpError: the file is held in memory (an upload, a converted framework dump),
                which another process cannot open.
        """
        info = self.files[index]
        if self._data[index] is not None:
            raise DumpError(
                f"{info.path}: held in memory (an upload, or a framework's dump converted "
                "when read), so another process cannot read it; write it as Parquet first "
                "(`iscore convert`)"
            )
        return Piece(
            path=info.path,
            location=info.path if storage.is_uri(info.path) else os.path.abspath(info.path),
            columns=self.columns,
            steps=self.steps if steps is None else steps,
            drop_invalid=self.drop_invalid,
            where=None if self.where is None else self.where.text,
            schema=self.sequence_schema,
            carried=self.carried,
            tokens=info.num_tokens,
            footer=info.footer,
        )

    def pieces(self, index: int, tokens: int) -> list[Piece]:
        """File `index` as pieces (`piece`) of at least `tokens` tokens where it can be cut:
        between row groups where every step before the cut is below every step after it
        (the footer's step statistics), so that no step spans two pieces and the pieces,
        read in order, read what the file does. A file without those statistics is one
        piece; a piece with none of the selected steps is left out."""
        out = []
        for lo, hi, size in _step_cuts(self.files[index], self._parquet[index], self.steps, tokens):
            steps = self.steps.within(lo, hi)
            if steps is not None and size:
                out.append(replace(self.piece(index, steps), tokens=size))
        return out

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


@dataclass(frozen=True, slots=True)
class Piece:
    """One file of a dump, or a range of its steps, as `Dump.piece` describes it: plain
    values (picklable) from which another process reads what the dump reads of it.

    Attributes:
        path: the file as its dump names it (in messages).
        location: its absolute path or its object's URI, which is opened.
        columns: the dump's explicit canonical -> source column names.
        steps: the steps read.
        drop_invalid, where: as the dump was opened with them.
        schema: the dump's `sequence_schema` (`where` is checked against it).
        carried: the dump's `carried` columns, which each batch's `extra` table holds.
        tokens: its tokens, as the footer counts them (for progress).
        footer: the SHA-256 of the file's footer as its dump checked it: not parsed again
            where the file still has it.
    """

    path: str
    location: str
    columns: dict[str, str | None]
    steps: StepRange
    drop_invalid: bool
    where: str | None
    schema: pa.Schema
    carried: pa.Schema
    tokens: int
    footer: str = ""

    def open(self) -> Dump:
        """A dump of this piece alone, reading what its dump reads of it.

        Raises:
            DumpProblems: the file cannot be opened (named as its dump names it).
        """
        dump = Dump.__new__(Dump)
        dump._setup(
            [(self.location, None)],
            self.columns,
            self.steps,
            self.drop_invalid,
            self.where,
            piece=self,
            footers=footer.Known([self.footer] if self.footer else []),
        )
        return dump


def _read_piece(piece: Piece) -> tuple[TokenBatch | None, DropReport]:
    """What a Ray task reads of a piece (`Dump.load`): its sequences as one batch (None
    where it has none) and what `drop_invalid` dropped."""
    dump = piece.open()
    # A piece with no token in the loss is one piece of the dump (`part`).
    parts = list(dump.batches(DEFAULT_CHUNK_TOKENS, part=True))
    batch = None if not parts else parts[0] if len(parts) == 1 else concat_batches(parts)
    return batch, dump.dropped


def _path(piece: Piece) -> str:
    return piece.path


def check_unique(step: np.ndarray, seq_id: pa.Array, owners: Sequence[tuple[str, int]]) -> None:
    """Refuse a sequence (step, seq_id) found in two files, for a dump read file by file
    (through the results store, or on Ray), where the reader's own check sees one file at a
    time.

    Args:
        step, seq_id: [B], each sequence read, in order.
        owners: (file, sequences) of each run of them, in the same order.

    Raises:
        DumpError: naming the sequence and both files.
    """
    table = pa.table({"step": step, "seq_id": seq_id})
    counts = table.group_by(["step", "seq_id"]).aggregate([("step", "count")])
    repeated = counts.filter(pc.greater(counts["step_count"], 1))
    if not repeated.num_rows:
        return
    first_step, sid = repeated["step"][0].as_py(), repeated["seq_id"][0]
    where = np.flatnonzero(
        (step == first_step) & pc.equal(seq_id, sid).to_numpy(zero_copy_only=False)
    )
    file_of = np.repeat([path for path, _ in owners], [n for _, n in owners])
    first, second = file_of[where[0]], file_of[where[1]]
    raise DumpError(
        f"{second}: sequence (step {first_step}, seq_id {sid.as_py()!r}) is also in {first}; "
        "a sequence's rows belong in one file"
    )


def _step_cuts(
    info: DumpFile, parquet: pq.ParquetFile, selected: StepRange, tokens: int
) -> list[tuple[int | None, int | None, int]]:
    """(first step, last step, tokens of the selected row groups) of each piece of a file
    (`Dump.pieces`); None leaves a side open."""
    meta = parquet.metadata
    source = info.columns.source.get("step")
    sizes = [
        meta.row_group(g).num_rows
        if info.layout == "token"
        else leaf(meta, g, info.columns.source["rollout_logprob"]).num_values
        for g in range(meta.num_row_groups)
    ]
    spans = []
    for g in range(meta.num_row_groups):
        stats = None if source is None else leaf(meta, g, source).statistics
        if stats is None or not stats.has_min_max:
            return [(None, None, sum(sizes))]
        spans.append((int(stats.min), int(stats.max)))
    suffix_min = np.minimum.accumulate([lo for lo, _ in spans][::-1])[::-1]
    cuts: list[tuple[int | None, int | None, int]] = []
    first: int | None = None
    highest = -math.inf
    size = 0
    for g, (lo, hi) in enumerate(spans):
        highest = max(highest, hi)
        size += sizes[g] if selected.row_group_may_match(lo, hi) else 0
        if g + 1 < len(spans) and size >= tokens and highest < suffix_min[g + 1]:
            cuts.append((first, int(highest), size))
            first, size = int(highest) + 1, 0
    cuts.append((first, None, size))
    return cuts


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
    from iscore.packed import TokenBatch  # torch, only when data is given

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


def load_data(data: Data, engine: Engine = "local") -> TokenBatch:
    """`data` loaded whole: a batch as it is, a dump read into one (see `open_data`), here
    or by Ray tasks (`Dump.load`).

    Raises:
        ConfigError: the Ray engine asked of a loaded batch.
    """
    check_engine(engine)
    opened = open_data(data)
    if isinstance(opened, Dump):
        return opened.load(engine=engine)
    if engine == "ray":
        raise ConfigError(
            "the Ray engine reads a dump's files on its workers; a loaded batch is used as "
            "it is (engine='local')"
        )
    return opened


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
    """A column with no default (policy_logprob, floor_logprob, the expert ids, turn): the
    files of a dump all have it, or none does."""
    having = [f.path for f in files if name in f.columns]
    lacking = [f.path for f in files if name not in f.columns]
    if having and lacking:
        others = f" (and {len(lacking) - 1:,} other files)" if len(lacking) > 1 else ""
        both = next((group for group in (EXPERT_COLUMNS, TOPK_COLUMNS) if name in group), (name,))
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
