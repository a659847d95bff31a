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
import glob
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from iscore.budget import DEFAULT_CHUNK_TOKENS
from iscore.columns import (
    COMPUTED,
    LOGPROB_COLUMNS,
    PER_SEQUENCE,
    PER_TOKEN,
    ColumnMap,
    dump_schema,
    resolve_columns,
)
from iscore.errors import DumpError, counted, quote
from iscore.paths import list_files
from iscore.where import Judge, Where
from iscore.writer import PROVENANCE_KEY

if TYPE_CHECKING:
    import torch

    from iscore.batch import TokenBatch


_READ_TOKENS = 262_144
"""Tokens per Parquet read (rows in token layout); chunks are assembled from these."""

_SHOW_ROWS = 5
"""How many offending rows a problem names."""

_INT64_MAX = 2**63 - 1

Layout = Literal["token", "sequence"]


@dataclass(frozen=True, slots=True)
class Problem:
    """One thing wrong with a dump.

    Attributes:
        file: the file it is in.
        column: the canonical column it concerns (with its source name), if any.
        message: what is wrong and what was expected.
        rows: the first offending rows, 0-based row numbers within the file.
        count: how many rows (or tokens, where the message says so) are affected.
    """

    file: str
    column: str | None
    message: str
    rows: tuple[int, ...] = ()
    count: int = 0

    def __str__(self) -> str:
        where = self.file if self.column is None else f"{self.file}, column {self.column}"
        text = f"{where}: {self.message}"
        if self.rows:
            shown = ", ".join(str(r) for r in self.rows)
            more = (
                f" (first {len(self.rows)} of {self.count:,})"
                if self.count > len(self.rows)
                else ""
            )
            text += f" at row{'s' if len(self.rows) > 1 else ''} {shown}{more}"
        return text


class DumpProblems(DumpError):
    """A dump has problems; `problems` lists every one found."""

    def __init__(self, problems: Sequence[Problem]):
        self.problems = tuple(problems)
        super().__init__("\n".join(str(p) for p in self.problems))


@dataclass(frozen=True, slots=True)
class StepRange:
    """Inclusive range of training steps to read; None leaves that side open.

    >>> StepRange.parse("3:7"), StepRange.parse("5"), StepRange.parse(":2")
    (StepRange(lo=3, hi=7), StepRange(lo=5, hi=5), StepRange(lo=None, hi=2))
    """

    lo: int | None = None
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.lo is not None and self.hi is not None and self.lo > self.hi:
            raise DumpError(f"Expected a step range with lo <= hi, but got {self.lo}:{self.hi}")

    @classmethod
    def parse(cls, text: str) -> StepRange:
        """Parse `N`, `LO:HI`, `LO:` or `:HI`."""
        lo, sep, hi = text.partition(":")
        try:
            if not sep:
                return cls(int(lo), int(lo))
            return cls(int(lo) if lo.strip() else None, int(hi) if hi.strip() else None)
        except ValueError:
            raise DumpError(
                f"Expected a step range like 5, 3:7, 3: or :7, but got {quote(text)}"
            ) from None

    def row_group_may_match(self, lo: int, hi: int) -> bool:
        """Whether a row group whose steps span [lo, hi] can hold a selected step."""
        return (self.lo is None or hi >= self.lo) and (self.hi is None or lo <= self.hi)

    def mask(self, step: pa.Array) -> pa.Array:
        """Boolean mask of the selected rows."""
        keep = pa.array(np.ones(len(step), dtype=bool))
        if self.lo is not None:
            keep = pc.and_(keep, pc.greater_equal(step, self.lo))
        if self.hi is not None:
            keep = pc.and_(keep, pc.less_equal(step, self.hi))
        return keep


@dataclass(frozen=True, slots=True)
class Extra:
    """A per-sequence column of the dump that the engine does not read (reward, group_id,
    ...), carried with its sequences into `TokenBatch.extra` when asked for.

    Attributes:
        name: its name in the sequence table: the canonical name, else the file's (prefixed
            `dump_` where that is a computed column's name).
        source: the file's column.
        reduce: "value" (one per row of a sequence-layout file), "first" (the value of a
            sequence's rows in token layout, which must all hold the same) or "mean" (over
            the sequence's tokens, or its list).
        type: its type in the table.
    """

    name: str
    source: str
    reduce: Literal["value", "first", "mean"]
    type: pa.DataType


_CARRIED = ("group_id", "reward", "advantage", "entropy")
"""The canonical extra columns the sequence table holds (token_id is per token)."""

_PER_SEQUENCE_EXTRA = ("group_id", "reward")
"""Extra columns that hold one value per sequence (in token layout, repeated on its rows)."""


def _scalar_type(t: pa.DataType) -> pa.DataType | None:
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


def _extras(schema: pa.Schema, columns: ColumnMap, layout: Layout) -> tuple[Extra, ...]:
    """The per-sequence columns of a file beyond those the engine reads: the canonical
    extras (token_id aside), and in sequence layout every other scalar column."""
    out = []
    for name in _CARRIED:
        if name not in columns:
            continue
        source = columns.source[name]
        t = schema.field(source).type
        if _is_list(t):
            numeric = _scalar_type(t.value_type) in (pa.int64(), pa.float64())
            if layout == "sequence" and name not in _PER_SEQUENCE_EXTRA and numeric:
                out.append(Extra(name, source, "mean", pa.float64()))
            continue
        kind = _scalar_type(t)
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
            kind = _scalar_type(schema.field(source).type)
            if source in known or kind is None:
                continue
            name = f"dump_{source}" if source in COMPUTED else source
            out.append(Extra(name, source, "value", kind))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class DumpFile:
    """One Parquet file of a dump, opened and its columns resolved."""

    path: str
    layout: Layout
    columns: ColumnMap
    num_rows: int
    num_tokens: int
    extras: tuple[Extra, ...]
    seq_id_type: pa.DataType


@dataclass(slots=True)
class _Chunk:
    """Whole sequences of one file, as flat arrays, before conversion to tensors."""

    file: str
    per_token: dict[str, pa.Array]
    seq_id: pa.Array
    step: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray  # file row of each token (in sequence layout: of its sequence)
    extra: pa.Table | None = None  # the carried `Extra` columns, one row per sequence

    def sequences(self, start: int, stop: int) -> _Chunk:
        """Sequences start..stop-1 of this chunk."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        a, b = int(offsets[start]), int(offsets[stop])
        return _Chunk(
            self.file,
            {k: v.slice(a, b - a) for k, v in self.per_token.items()},
            self.seq_id.slice(start, stop - start),
            self.step[start:stop],
            self.lengths[start:stop],
            self.rows[a:b],
            None if self.extra is None else self.extra.slice(start, stop - start),
        )

    def subset(self, keep: np.ndarray) -> _Chunk:
        """The sequences where `keep` (bool [B]) is true."""
        keep_token = np.repeat(keep, self.lengths)
        return _Chunk(
            self.file,
            {k: v.filter(pa.array(keep_token)) for k, v in self.per_token.items()},
            self.seq_id.filter(pa.array(keep)),
            self.step[keep],
            self.lengths[keep],
            self.rows[keep_token],
            None if self.extra is None else self.extra.filter(pa.array(keep)),
        )

    def arrays(self) -> dict[str, np.ndarray]:
        """`step` and `lengths` [B], the `rollout` and `train` log-probs [N] as the engine
        holds them (float32) and `loss_mask` [N] when the dump has one, as numpy arrays."""
        t = self.per_token
        out = {
            "step": self.step,
            "lengths": self.lengths,
            "rollout": _plain(t["rollout_logprob"], pa.float32()).to_numpy(),
            "train": _plain(t["train_logprob"], pa.float32()).to_numpy(),
        }
        if "loss_mask" in t:
            out["loss_mask"] = _bools(t["loss_mask"])
        return out


@dataclass(slots=True)
class DropReport:
    """Sequences dropped by `drop_invalid`, accumulated while reading."""

    sequences: int = 0
    tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """As the analysis document's `source.dropped` has it."""
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "invalid_values": dict(self.reasons),
        }


def resolve_files(source: str | Path | Sequence[str | Path]) -> list[str]:
    """Expand a file, a directory (every `*.parquet` below it) or a glob into sorted paths.

    A path that exists is read as itself, even when its name looks like a glob
    (`run[1].parquet`). See `list_files` for the limits of walks and globs.

    Raises:
        DumpError: nothing matches, or a walk or glob went past its budget.
    """
    if isinstance(source, str | Path):
        sources: Sequence[str | Path] = [source]
    else:
        sources = source
    files: list[str] = []
    for item in sources:
        found = sorted(list_files(item, (".parquet",)))
        if not found:
            is_dir = Path(item).is_dir()
            what = (
                "directory holds no *.parquet files" if is_dir else "the pattern matches no files"
            )
            raise DumpError(f"{item}: {what}")
        files.extend(found)
    return files


Source = str | bytes
"""Where a file's bytes are: a path on disk, or the bytes themselves (an upload, an import)."""


def _open(
    path: str, mapping: Mapping[str, str], data: bytes | None = None
) -> tuple[pq.ParquetFile, DumpFile]:
    """Open one file, telling an empty, truncated or non-Parquet file apart.

    Args:
        path: the file's path, or for `data` the name that stands for it in messages.
        mapping: explicit canonical -> source column names.
        data: the file's bytes when it is held in memory.
    """
    if data is None:
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 4, 0))
            tail = f.read(4)
    else:
        size, head, tail = len(data), data[:4], data[-4:]
    if size == 0:
        raise DumpError(f"{path}: empty file (0 bytes)")
    if head != b"PAR1":
        hint = {
            b"{": " (looks like JSON Lines)",
            b"\x80": " (looks like a pickle)",
        }.get(
            head[:1],
            " (looks like a zip archive, e.g. torch.save)" if head[:2] == b"PK" else "",
        )
        raise DumpError(f"{path}: not a Parquet file{hint}; expected the magic bytes PAR1")
    if tail != b"PAR1" or size < 12:
        raise DumpError(
            f"{path}: truncated Parquet file ({size:,} bytes, no footer); "
            "was the write interrupted?"
        )
    try:
        parquet = pq.ParquetFile(path if data is None else pa.BufferReader(data))
    except (pa.ArrowException, OSError) as e:
        raise DumpError(f"{path}: unreadable Parquet footer: {e}") from e
    if parquet.metadata.num_rows == 0:
        raise DumpError(f"{path}: empty file (a Parquet schema but no rows)")
    schema = parquet.schema_arrow
    columns = resolve_columns(schema.names, mapping, path, sequence_layout=True)
    rollout_type = schema.field(columns.source["rollout_logprob"]).type
    layout: Layout = "sequence" if _is_list(rollout_type) else "token"
    if layout == "token" and "seq_id" not in columns:
        resolve_columns(schema.names, mapping, path)  # raises: seq_id is required here
    _check_types(path, schema, columns, layout)
    meta = parquet.metadata
    tokens = meta.num_rows
    if layout == "sequence":
        # The leaf column's value counts are the token counts.
        tokens = sum(
            _leaf(meta.row_group(g), columns.source["rollout_logprob"]).num_values
            for g in range(meta.num_row_groups)
        )
    seq_id_type = pa.int64()
    if "seq_id" in columns:
        seq_id_type = _scalar_type(schema.field(columns.source["seq_id"]).type)
    extras = _extras(schema, columns, layout)
    info = DumpFile(path, layout, columns, meta.num_rows, tokens, extras, seq_id_type)
    return parquet, info


def is_framework_dump(item: str | Path) -> bool:
    """Whether `item` is a framework's own dump (JSONL, .pt, .pkl) rather than Parquet."""
    path = Path(item)
    if path.is_dir():
        return not any(list_files(path, (".parquet",)))
    if glob.has_magic(str(item)) and not path.exists():
        return False
    return path.suffix in (".jsonl", ".pt", ".pkl")


def _import(item: str | Path, fmt: str | None, allow_pickle: bool) -> tuple[str, bytes]:
    """A framework dump converted in memory to canonical Parquet bytes, named for messages."""
    from iscore import importers  # torch.load and JSON parsing, only when needed

    fmt = fmt or importers.detect(item)
    table = importers.read(item, fmt, allow_pickle=allow_pickle)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return f"{item} ({fmt})", sink.getvalue().to_pybytes()


def _leaf(row_group: pq.RowGroupMetaData, source: str) -> pq.ColumnChunkMetaData:
    """The column chunk of a (list) column's leaf values."""
    for i in range(row_group.num_columns):
        column = row_group.column(i)
        if column.path_in_schema.split(".")[0] == source:
            return column
    raise KeyError(source)


def _is_list(t: pa.DataType) -> bool:
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
    "loss_mask": "mask",
    "pos": "int",
    "step": "int",
    "seq_id": "id",
}


def _check_types(path: str, schema: pa.Schema, columns: ColumnMap, layout: Layout) -> None:
    problems = []
    for name, kind in _COLUMN_KIND.items():
        if name not in columns:
            continue
        source = columns.source[name]
        t = schema.field(source).type
        if pa.types.is_dictionary(t):
            t = t.value_type  # decoded while reading
        is_kind, expected = _KIND[kind]
        per_token = name in PER_TOKEN and layout == "sequence"
        if per_token:
            ok = _is_list(t) and is_kind(t.value_type)
            expected = f"a list of {expected.removeprefix('a ').removeprefix('an ')} values"
        else:
            ok = is_kind(t)
            expected += " column"
        if not ok:
            problems.append(
                Problem(
                    path,
                    _label(columns, name),
                    f"expected {expected} ({layout} layout), found {t}",
                )
            )
    if problems:
        raise DumpProblems(problems)


def _label(columns: ColumnMap, name: str) -> str:
    source = columns.source.get(name, name)
    return name if source == name else f"{name} (source {quote(source)})"


def _first(mask: np.ndarray, rows: np.ndarray) -> tuple[tuple[int, ...], int]:
    hits = np.flatnonzero(mask)
    return tuple(int(r) for r in rows[hits[:_SHOW_ROWS]]), int(hits.size)


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
                files.append(_import(item, fmt, allow_pickle))
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
                parquet, info = _open(path, self._mapping, data)
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
        layouts = {f.layout for f in self.files}
        if len(layouts) > 1:
            raise DumpError(
                "files mix token and sequence layouts: "
                + ", ".join(f"{f.path} ({f.layout})" for f in self.files)
            )
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
    def provenance(self) -> list[dict]:
        """Per file, where an imported dump came from (framework, source files, steps), or {}."""
        out = []
        for parquet in self._parquet:
            meta = parquet.schema_arrow.metadata or {}
            raw = meta.get(PROVENANCE_KEY)
            out.append(json.loads(raw) if raw else {})
        return out

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
        for info, data in zip(self.files, self._data, strict=True):
            if data is None:
                out.append(pads.dataset(info.path, format="parquet"))
                continue
            parquet = pads.ParquetFileFormat()
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

        batch = parts[0] if len(parts) == 1 else _concat(parts)
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
                reader = _reader(info, parquet, self.steps, seen, whole_steps, self._carry(info))
                for chunk in reader.chunks(max_tokens):
                    problems = _check(chunk, info.columns)
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
                stats = _leaf(parquet.metadata.row_group(g), source).statistics
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

    def _select(self, chunk: _Chunk, judge: Judge | None) -> TokenBatch | None:
        """The chunk as a batch with the carried columns, only its sequences where the
        predicate holds; None when none is left."""
        if not chunk.lengths.size:
            return None
        batch = _to_batch(chunk, self.carried)
        if judge is not None:
            batch = judge.select(batch)
        return batch if batch.num_sequences else None

    def _keep(self, chunk: _Chunk, judge: Judge | None) -> _Chunk | None:
        """`_select` kept as a chunk: tensors are made only for the `where` judge."""
        if judge is not None and chunk.lengths.size:
            chunk = chunk.subset(judge.keep(_to_batch(chunk, self.carried)))
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
        arrays (`_Chunk.arrays`; None if it has problems, or if `where` selects none of its
        sequences). Tensors are made only to judge a `where` predicate: validating a
        dump needs no torch.

        This is `batches` for validation: a file with a structural problem (duplicate
        sequences, unequal lists, corrupt pages) is reported and skipped, and reading goes on
        with the next file; value problems are reported per chunk.
        """
        seen: dict[tuple[int, object], str] = {}
        with self._judge() as judge:
            for info, parquet in zip(self.files, self._parquet, strict=True):
                reader = _reader(info, parquet, self.steps, seen, extras=self._carry(info))
                try:
                    for chunk in reader.chunks(max_tokens):
                        problems = _check(chunk, info.columns)
                        if problems:
                            chunk, problems = self._drop(chunk, problems)
                        kept = None if problems else self._keep(chunk, judge)
                        yield problems, None if kept is None else kept.arrays()
                except DumpProblems as e:
                    yield list(e.problems), None

    def _drop(self, chunk: _Chunk, problems: list[Problem]) -> tuple[_Chunk, list[Problem]]:
        """With `drop_invalid`, remove sequences whose only problems are invalid values."""
        if not self.drop_invalid or any(not p.message.startswith(_INVALID) for p in problems):
            return chunk, problems
        bad_token = np.zeros(int(chunk.lengths.sum()), dtype=bool)
        for name in LOGPROB_COLUMNS:
            if name in chunk.per_token:
                bad_token |= _invalid(chunk.per_token[name])
        seq_of_token = np.repeat(np.arange(chunk.lengths.size), chunk.lengths)
        bad_seq = np.zeros(chunk.lengths.size, dtype=bool)
        bad_seq[seq_of_token[bad_token]] = True
        for p in problems:
            key = p.column.split(" ")[0] if p.column else "?"
            self.dropped.reasons[key] = self.dropped.reasons.get(key, 0) + p.count
        self.dropped.sequences += int(bad_seq.sum())
        self.dropped.tokens += int(chunk.lengths[bad_seq].sum())
        return chunk.subset(~bad_seq), []


_INVALID = "invalid log-prob"


def _invalid(values: pa.Array) -> np.ndarray:
    """NaN, +-inf, > 0 or null entries of a float array, as the engine will hold them."""
    x = _as_float32(values)
    bad = ~np.isfinite(x) | (x > 0)
    return bad


def _as_float32(values: pa.Array) -> np.ndarray:
    """The values as float32, the engine's dtype, nulls as NaN.

    Checked after this cast, not before: a float64 -1e300 is finite but becomes -inf in the
    engine, and must be reported as what the engine would see.
    """
    x = values.to_numpy(zero_copy_only=False)
    with np.errstate(over="ignore"):
        return x.astype(np.float32, copy=False)


def _check(chunk: _Chunk, columns: ColumnMap) -> list[Problem]:
    """Value problems of a chunk: invalid log-probs and loss masks other than 0/1."""
    problems = []
    token_rows = chunk.rows
    for name in LOGPROB_COLUMNS:
        if name not in chunk.per_token:
            continue
        x = _as_float32(chunk.per_token[name])
        infinite = np.isinf(x)
        kinds = [
            ("NaN or null", np.isnan(x)),
            ("infinite (or beyond float32's range, +-3.4e38)", infinite),
            ("positive (a log-prob must be <= 0)", (x > 0) & ~infinite),
        ]
        for what, mask in kinds:
            if mask.any():
                rows, count = _first(mask, token_rows)
                problems.append(
                    Problem(
                        chunk.file,
                        _label(columns, name),
                        f"{_INVALID}: {counted(count, f'{what} value')}",
                        tuple(dict.fromkeys(rows)),
                        count,
                    )
                )
    mask = chunk.per_token.get("loss_mask")
    if mask is not None and not pa.types.is_boolean(mask.type):
        m = mask.to_numpy(zero_copy_only=False)
        bad = (m != 0) & (m != 1)
        if bad.any():
            rows, count = _first(bad, token_rows)
            problems.append(
                Problem(
                    chunk.file,
                    _label(columns, "loss_mask"),
                    f"expected 0 or 1, found other values ({count:,} tokens)",
                    tuple(dict.fromkeys(rows)),
                    count,
                )
            )
    return problems


class _Reader:
    """Reads one file row group by row group and assembles chunks of whole sequences."""

    def __init__(
        self,
        info: DumpFile,
        parquet: pq.ParquetFile,
        steps: StepRange,
        seen: dict,
        whole_steps: bool = False,
        extras: tuple[Extra, ...] = (),
    ):
        self.info = info
        self.parquet = parquet
        self.steps = steps
        self.seen = seen
        self._here: set[tuple[int, object]] = set()
        self.whole_steps = whole_steps
        self.extras = extras
        # What a chunk boundary must not split: a sequence, or a whole training step.
        self.unit = ("step",) if whole_steps else ("step", "seq_id")
        self.source = {
            k: v for k, v in info.columns.source.items() if k in PER_TOKEN + PER_SEQUENCE
        }
        self.source.update({e.name: e.source for e in extras})

    def _row_groups(self) -> list[int]:
        """Row groups that can hold selected steps, judged by their statistics."""
        groups = list(range(self.parquet.num_row_groups))
        if (self.steps.lo is None and self.steps.hi is None) or "step" not in self.source:
            return groups
        index = self.parquet.schema_arrow.get_field_index(self.source["step"])
        keep = []
        for g in groups:
            stats = self.parquet.metadata.row_group(g).column(index).statistics
            if (
                stats is None
                or not stats.has_min_max
                or self.steps.row_group_may_match(stats.min, stats.max)
            ):
                keep.append(g)
        return keep

    def _read_rows(self, group: int) -> int:
        """Rows per read so that a read holds about `_READ_TOKENS` tokens."""
        if self.info.layout == "token":
            return _READ_TOKENS
        meta = self.parquet.metadata.row_group(group)
        tokens = _leaf(meta, self.source["rollout_logprob"]).num_values
        mean_length = max(tokens / max(meta.num_rows, 1), 1.0)
        return max(1, int(_READ_TOKENS / mean_length))

    def _record_batches(self) -> Iterator[tuple[int, pa.Table]]:
        """(file row of the first row, canonical-named table) per read, step-filtered later."""
        groups = self._row_groups()
        starts = np.concatenate(
            [
                [0],
                np.cumsum(
                    [
                        self.parquet.metadata.row_group(g).num_rows
                        for g in range(self.parquet.num_row_groups)
                    ]
                ),
            ]
        )
        names = list(self.source)
        for g in groups:
            row = int(starts[g])
            try:
                for rb in self.parquet.iter_batches(
                    batch_size=self._read_rows(g),
                    row_groups=[g],
                    columns=list(self.source.values()),
                    use_threads=True,
                ):
                    table = pa.Table.from_batches([rb]).rename_columns(names)
                    yield row, _decode_dictionaries(table)
                    row += rb.num_rows
            except (pa.ArrowException, OSError) as e:
                raise DumpProblems(
                    [Problem(self.info.path, None, f"corrupt data in row group {g}: {e}")]
                ) from e

    def _filter_steps(self, table: pa.Table, rows: np.ndarray) -> tuple[pa.Table, np.ndarray]:
        if self.steps.lo is None and self.steps.hi is None:
            return table, rows
        if "step" not in table.column_names:
            keep = (self.steps.lo is None or self.steps.lo <= 0) and (
                self.steps.hi is None or self.steps.hi >= 0
            )
            return (table, rows) if keep else (table.slice(0, 0), rows[:0])
        mask = self.steps.mask(table["step"].combine_chunks())
        return table.filter(mask), rows[mask.to_numpy(zero_copy_only=False)]

    def _read_problems(self, table: pa.Table, rows: np.ndarray) -> list[Problem]:
        """Nulls (inside lists too) and steps or positions int64 cannot hold, as read."""
        problems = []
        carried = {e.name for e in self.extras}  # nulls there are values (no reward yet)
        for name in table.column_names:
            if name in carried:
                continue
            column = table[name].combine_chunks()
            label = _label(self.info.columns, name)
            # Null log-probs of token layout are reported with the invalid values (as NaN),
            # so that --drop-invalid can drop their sequences; so are those inside lists.
            if column.null_count and not (name in LOGPROB_COLUMNS and self.info.layout == "token"):
                problems.append(self._problem(label, "null values", column.is_null(), rows))
            values = pc.list_flatten(column) if _is_list(column.type) else column
            if values is not column and values.null_count and name not in LOGPROB_COLUMNS:
                what = "null values inside its lists"
                problems.append(self._problem(label, what, values.is_null(), rows, column))
            if name in ("step", "pos") and values.type == pa.uint64():
                above = pc.greater(values, pa.scalar(_INT64_MAX, pa.uint64()))
                if pc.any(above).as_py():
                    what = f"values above {_INT64_MAX:,} (2^63 - 1), which int64 cannot hold"
                    lists = column if values is not column else None
                    problems.append(self._problem(label, what, above, rows, lists))
        return problems

    def _problem(
        self,
        label: str,
        what: str,
        bad: pa.Array,
        rows: np.ndarray,
        lists: pa.Array | None = None,
    ) -> Problem:
        """A problem at the rows where `bad` is true; with `lists`, `bad` is over their
        flattened values and each value is mapped back to the row of its list."""
        if lists is not None:
            lengths = pc.list_value_length(lists).fill_null(0)
            rows = np.repeat(rows, lengths.to_numpy(zero_copy_only=False))
        r, count = _first(bad.fill_null(False).to_numpy(zero_copy_only=False), rows)
        return Problem(self.info.path, label, f"{count:,} {what}", tuple(dict.fromkeys(r)), count)

    def _extra(
        self,
        values: dict[str, pa.Array],
        lengths: np.ndarray | None = None,
        rows: np.ndarray | None = None,
    ) -> pa.Table | None:
        """The carried extra columns, one row per sequence, from their `values` as read: per
        token (token layout, with each sequence's `lengths` and the tokens' file `rows`) or
        per sequence, scalars or lists (sequence layout)."""
        if not self.extras:
            return None
        columns = []
        for extra in self.extras:
            column = values[extra.name]
            if extra.reduce == "value":
                columns.append(column.cast(extra.type))
                continue
            if lengths is None:  # a list per sequence
                counts = pc.list_value_length(column).fill_null(0).to_numpy(zero_copy_only=False)
                flat = pc.list_flatten(column)
            else:
                counts, flat = lengths, column
            if extra.reduce == "mean":
                columns.append(_means(flat, counts))
            else:
                columns.append(self._first(extra, flat, counts, rows))
        return pa.table(columns, names=[e.name for e in self.extras])

    def _first(
        self, extra: Extra, values: pa.Array, lengths: np.ndarray, rows: np.ndarray
    ) -> pa.Array:
        """Each sequence's value of a per-sequence column repeated on its rows."""
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        first = values.take(pa.array(starts))
        again = first.take(pa.array(np.repeat(np.arange(lengths.size), lengths)))
        same = pc.fill_null(pc.equal(values, again), False)
        same = pc.or_(same, pc.and_(values.is_null(), again.is_null()))
        differ = ~same.to_numpy(zero_copy_only=False)
        if differ.any():
            r, count = _first(differ, rows)
            message = (
                f"{count:,} values differ from the first of their sequence; {extra.name} holds "
                "one value per sequence, repeated on each of its rows in token layout"
            )
            label = _label(self.info.columns, extra.name)
            raise DumpProblems([Problem(self.info.path, label, message, r, count)])
        return first.cast(extra.type)

    def _mark_seen(self, step: np.ndarray, seq_id: pa.Array, first_rows: np.ndarray) -> None:
        """Remember each sequence's file; a sequence met twice is an error naming both."""
        ids = seq_id.to_pylist()
        keys = list(zip(step.tolist(), ids, strict=True))
        if len(set(keys)) == len(keys) and self.seen.keys().isdisjoint(keys):
            # All new (the common case): no error to look for, one key at a time.
            self.seen.update(dict.fromkeys(keys, self.info.path))
            self._here.update(keys)
            return
        for s, i, r in zip(step.tolist(), ids, first_rows.tolist(), strict=True):
            key = (s, i)
            first = self.seen.setdefault(key, self.info.path)
            if first is not self.info.path or key in self._here:
                where = "" if first is self.info.path else f" (it is also in {first})"
                message = (
                    f"sequence seq_id={quote(i)} step={s} appears twice or its rows are not "
                    f"contiguous{where}; a dump holds each sequence once, its rows together"
                )
                label = _label(self.info.columns, "seq_id")
                raise DumpProblems([Problem(self.info.path, label, message, (r,), 1)])
            self._here.add(key)


class _TokenReader(_Reader):
    """Token layout: one row per token; a sequence is a run of rows with one (step, seq_id)."""

    def chunks(self, max_tokens: int | None) -> Iterator[_Chunk]:
        pending: list[pa.Table] = []
        pending_rows: list[np.ndarray] = []
        count = 0
        for row, table in self._record_batches():
            rows = np.arange(row, row + table.num_rows)
            table, rows = self._filter_steps(table, rows)
            if not table.num_rows:
                continue
            problems = self._read_problems(table, rows)
            if problems:
                raise DumpProblems(problems)
            pending.append(table)
            pending_rows.append(rows)
            count += table.num_rows
            if max_tokens is not None and count >= max_tokens:
                table = pa.concat_tables(pending)
                rows = np.concatenate(pending_rows)
                # Hold back the last sequence (or step): its rows may go on in the next
                # read. One longer than max_tokens keeps accumulating until it ends.
                cut = _last_run_start(table, self.unit)
                if cut == 0:
                    pending, pending_rows = [table], [rows]
                    continue
                yield self._chunk(table.slice(0, cut), rows[:cut])
                pending, pending_rows = [table.slice(cut)], [rows[cut:]]
                count = table.num_rows - cut
        if count:
            yield self._chunk(pa.concat_tables(pending), np.concatenate(pending_rows))

    def _chunk(self, table: pa.Table, rows: np.ndarray) -> _Chunk:
        table = table.combine_chunks()
        starts = _run_starts(table)
        lengths = np.diff(np.append(starts, table.num_rows))
        step = (
            table["step"].to_numpy()[starts]
            if "step" in table.column_names
            else np.zeros(starts.size, dtype=np.int64)
        ).astype(np.int64)
        seq_id = table["seq_id"].chunk(0).take(pa.array(starts))
        self._mark_seen(step, seq_id, rows[starts])
        extra = self._extra({e.name: table[e.name].chunk(0) for e in self.extras}, lengths, rows)
        per_token = {n: table[n].chunk(0) for n in PER_TOKEN if n in table.column_names}
        if "pos" in per_token:
            per_token, rows = _order_by_pos(self.info, per_token, lengths, rows)
        return _Chunk(self.info.path, per_token, seq_id, step, lengths, rows, extra)


def _decode_dictionaries(table: pa.Table) -> pa.Table:
    """Plain arrays for dictionary-encoded columns (ids written by pandas categoricals)."""
    for i, f in enumerate(table.schema):
        if pa.types.is_dictionary(f.type):
            table = table.set_column(i, f.name, table[i].cast(f.type.value_type))
    return table


def _run_starts(table: pa.Table, keys: tuple[str, ...] = ("step", "seq_id")) -> np.ndarray:
    """Row indices where a new run of `keys` values begins; always includes 0."""
    change = np.zeros(table.num_rows, dtype=bool)
    change[0] = True
    for name in keys:
        if name in table.column_names:
            col = table[name].combine_chunks()
            change[1:] |= pc.not_equal(col.slice(1), col.slice(0, len(col) - 1)).to_numpy(
                zero_copy_only=False
            )
    return np.flatnonzero(change)


def _last_run_start(table: pa.Table, keys: tuple[str, ...]) -> int:
    """`_run_starts(table, keys)[-1]`, looking only as far back from the end as the last run
    goes (a sequence, or a step: not the whole table)."""
    size = 4096
    while True:
        lo = max(0, table.num_rows - size)
        starts = _run_starts(table.slice(lo), keys)
        if starts.size > 1 or lo == 0:  # past its first row, a slice's starts are real
            return lo + int(starts[-1])
        size *= 4


def _order_by_pos(
    info: DumpFile,
    per_token: dict[str, pa.Array],
    lengths: np.ndarray,
    rows: np.ndarray,
) -> tuple[dict[str, pa.Array], np.ndarray]:
    """Sort tokens by `pos` within each sequence (stable) and reject duplicate positions.

    `pos` is dropped when it is just 0..T-1 in every sequence (the common case), so the
    batch carries no redundant int64 per token.
    """
    pos = per_token["pos"].to_numpy(zero_copy_only=False)
    step = np.diff(pos)  # in pos's own dtype: no int64 copy of a sorted column
    first = np.cumsum(lengths)[:-1] - 1  # index into `step` of each sequence boundary
    step[first[first < step.size]] = 1
    if (step <= 0).any():
        seq = np.repeat(np.arange(lengths.size), lengths)
        order = np.lexsort((pos, seq))
        index = pa.array(order)
        per_token = {k: v.take(index) for k, v in per_token.items()}
        pos, rows = pos[order], rows[order]
        step = np.diff(pos)
        step[first[first < step.size]] = 1
    if (step == 0).any():
        dup = np.concatenate([[False], step == 0])
        r, count = _first(dup, rows)
        message = f"duplicate (seq_id, pos): {count:,} tokens repeat a position of their sequence"
        raise DumpProblems(
            [
                Problem(
                    info.path, _label(info.columns, "pos"), message, tuple(dict.fromkeys(r)), count
                )
            ]
        )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if (step == 1).all() and (pos[starts[lengths > 0]] == 0).all():
        del per_token["pos"]
    return per_token, rows


class _SequenceReader(_Reader):
    """Sequence layout: one row per sequence, per-token values in equal-length lists."""

    def chunks(self, max_tokens: int | None) -> Iterator[_Chunk]:
        pending: list[_Chunk] = []
        count = 0
        for row, table in self._record_batches():
            rows = np.arange(row, row + table.num_rows)
            table, rows = self._filter_steps(table, rows)
            if not table.num_rows:
                continue
            pending.append(self._chunk(table, rows))
            count += int(pending[-1].lengths.sum())
            if max_tokens is not None and count >= max_tokens:
                chunk = _concat_chunks(pending)
                cut = chunk.lengths.size
                if self.whole_steps:
                    # Hold back the last step: its sequences may go on in the next read.
                    cut = int(np.flatnonzero(np.diff(chunk.step, prepend=chunk.step[0] - 1))[-1])
                    if cut == 0:
                        pending = [chunk]
                        continue
                yield chunk.sequences(0, cut)
                pending = [chunk.sequences(cut, chunk.lengths.size)]
                count = int(pending[0].lengths.sum())
        pending = [c for c in pending if c.lengths.size]
        if pending:
            yield _concat_chunks(pending)

    def _chunk(self, table: pa.Table, rows: np.ndarray) -> _Chunk:
        problems = self._read_problems(table, rows)
        if problems:
            raise DumpProblems(problems)
        lists = {n: table[n].combine_chunks() for n in PER_TOKEN if n in table.column_names}
        lengths = pc.list_value_length(lists["rollout_logprob"]).to_numpy(zero_copy_only=False)
        for name, values in lists.items():
            other = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            differ = other != lengths
            if name != "rollout_logprob" and differ.any():
                r, count = _first(differ, rows)
                example = f"{int(other[differ][0])} vs {int(lengths[differ][0])}"
                message = f"list lengths differ from rollout_logprob's (e.g. {example})"
                raise DumpProblems(
                    [Problem(self.info.path, _label(self.info.columns, name), message, r, count)]
                )
        per_token = {n: pc.list_flatten(v) for n, v in lists.items()}
        seq_id = (
            table["seq_id"].combine_chunks()
            if "seq_id" in table.column_names
            else pa.array(rows.astype(np.int64))
        )
        step = (
            table["step"].to_numpy()
            if "step" in table.column_names
            else np.zeros(table.num_rows, dtype=np.int64)
        ).astype(np.int64)
        self._mark_seen(step, seq_id, rows)
        lengths = lengths.astype(np.int64)
        token_rows = np.repeat(rows, lengths)
        extra = self._extra({e.name: table[e.name].combine_chunks() for e in self.extras})
        if "pos" in per_token:
            per_token, token_rows = _order_by_pos(self.info, per_token, lengths, token_rows)
        return _Chunk(self.info.path, per_token, seq_id, step, lengths, token_rows, extra)


def _reader(
    info: DumpFile,
    parquet: pq.ParquetFile,
    steps: StepRange,
    seen: dict,
    whole_steps: bool = False,
    extras: tuple[Extra, ...] = (),
) -> _Reader:
    reader = _TokenReader if info.layout == "token" else _SequenceReader
    return reader(info, parquet, steps, seen, whole_steps, extras)


def _means(values: pa.Array, counts: np.ndarray) -> pa.Array:
    """float64 mean of each run of `counts` values (null for an empty run, or one holding a
    null or NaN)."""
    x = pc.cast(values, pa.float64()).to_numpy(zero_copy_only=False)  # nulls become NaN
    sums = np.zeros(counts.size)
    nonempty = counts > 0
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    if x.size:
        sums[nonempty] = np.add.reduceat(x, starts[nonempty])
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums / counts
    return pa.array(means, mask=~nonempty | np.isnan(means))


def _union_extras(files: Sequence[DumpFile]) -> tuple[Extra, ...]:
    """The extra columns of all files, in order of appearance; one type per name."""
    found: dict[str, Extra] = {}
    where: dict[str, str] = {}
    for info in files:
        for extra in info.extras:
            known = found.setdefault(extra.name, extra)
            where.setdefault(extra.name, info.path)
            if known.type != extra.type:
                raise DumpError(
                    f"{info.path}: column {extra.source} is {extra.type} here but "
                    f"{known.type} in {where[extra.name]}; the files of a dump agree on it"
                )
    return tuple(found.values())


def _seq_id_type(files: Sequence[DumpFile]) -> pa.DataType:
    types = {f.seq_id_type for f in files}
    if len(types) > 1:
        raise DumpError(
            "files disagree on the type of seq_id: "
            + ", ".join(f"{f.path} ({f.seq_id_type})" for f in files)
        )
    return types.pop()


def _concat_chunks(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    return _Chunk(
        chunks[0].file,
        {k: pa.concat_arrays([c.per_token[k] for c in chunks]) for k in chunks[0].per_token},
        pa.concat_arrays([c.seq_id for c in chunks]),
        np.concatenate([c.step for c in chunks]),
        np.concatenate([c.lengths for c in chunks]),
        np.concatenate([c.rows for c in chunks]),
        None if chunks[0].extra is None else pa.concat_tables([c.extra for c in chunks]),
    )


def _plain(values: pa.Array, dtype: pa.DataType) -> pa.Array:
    """`values` as `dtype` (cast only when needed), nulls as 0."""
    if values.type != dtype:
        values = pc.cast(values, dtype)
    if values.null_count:
        values = pc.fill_null(values, 0)
    return values


def _bools(values: pa.Array) -> np.ndarray:
    """A boolean column as numpy (nulls as false)."""
    return values.to_numpy(zero_copy_only=False).astype(bool)


def _tensor(values: pa.Array, dtype: pa.DataType, torch_dtype: torch.dtype) -> torch.Tensor:
    """Zero-copy view of an Arrow array when its type already fits, else one cast."""
    import torch

    values = _plain(values, dtype)
    data = values.buffers()[1]
    width = np.dtype(torch.empty((), dtype=torch_dtype).numpy().dtype).itemsize
    if len(values) == 0:
        return torch.empty(0, dtype=torch_dtype)
    return torch.frombuffer(
        data, dtype=torch_dtype, count=len(values), offset=values.offset * width
    )


def _to_batch(chunk: _Chunk, carried: pa.Schema | None = None) -> TokenBatch:
    """The chunk as tensors; its extra columns as the `carried` schema (missing ones null)."""
    import torch  # here, where tensors are made: validating a dump needs none

    from iscore.batch import TokenBatch

    t = chunk.per_token
    mask = t.get("loss_mask")
    lengths = torch.from_numpy(chunk.lengths)
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    return TokenBatch(
        rollout=_tensor(t["rollout_logprob"], pa.float32(), torch.float32),
        train=_tensor(t["train_logprob"], pa.float32(), torch.float32),
        cu_seqlens=cu,
        loss_mask=None if mask is None else torch.from_numpy(_bools(mask)),
        policy=_tensor(t["policy_logprob"], pa.float32(), torch.float32)
        if "policy_logprob" in t
        else None,
        step=torch.from_numpy(chunk.step),
        seq_id=chunk.seq_id,
        pos=_tensor(t["pos"], pa.int64(), torch.int64) if "pos" in t else None,
        extra=_conform(chunk.extra, carried, chunk.lengths.size),
    )


def _conform(extra: pa.Table | None, schema: pa.Schema | None, rows: int) -> pa.Table | None:
    """`extra` with exactly the columns of `schema` (nulls where its file has none)."""
    if schema is None or not schema.names:
        return None
    columns = [
        extra[f.name].combine_chunks()
        if extra is not None and f.name in extra.column_names
        else pa.nulls(rows, f.type)
        for f in schema
    ]
    return pa.table(columns, schema=schema)


def _concat(parts: list[TokenBatch]) -> TokenBatch:
    """Join batches (chunks of one file or of several) into one."""
    import torch

    from iscore.batch import TokenBatch

    def cat(name: str) -> torch.Tensor | None:
        tensors = [getattr(p, name) for p in parts]
        if all(t is None for t in tensors):
            return None
        if name == "pos":
            tensors = [p.positions() for p in parts]
        return torch.cat(tensors)

    lengths = torch.cat([p.lengths for p in parts])
    cu = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
    torch.cumsum(lengths, 0, out=cu[1:])
    policies = [p.policy for p in parts]
    if any(x is None for x in policies) and not all(x is None for x in policies):
        raise DumpError("some files have policy_logprob and others do not")
    ids = [p.seq_id for p in parts]
    if len({a.type for a in ids}) > 1:
        raise DumpError(
            "files disagree on the type of seq_id: " + ", ".join(str(a.type) for a in ids)
        )
    extras = [p.extra for p in parts]
    return TokenBatch(
        rollout=cat("rollout"),
        train=cat("train"),
        cu_seqlens=cu,
        loss_mask=cat("loss_mask"),
        policy=cat("policy"),
        step=cat("step"),
        seq_id=pa.concat_arrays(ids),
        pos=cat("pos"),
        extra=None if extras[0] is None else pa.concat_tables(extras).combine_chunks(),
    )


def load(
    source: str | Path | Sequence[str | Path],
    *,
    columns: Mapping[str, str] | None = None,
    steps: StepRange | None = None,
    drop_invalid: bool = False,
    device: str | torch.device = "cpu",
) -> TokenBatch:
    """Read a whole dump into one `TokenBatch`; see `Dump` for the arguments.

    >>> batch = load("data/dense_bf16.parquet")
    >>> batch.num_sequences, batch.num_tokens
    (112, 106256)
    """
    return Dump(source, columns=columns, steps=steps, drop_invalid=drop_invalid).load(device)
