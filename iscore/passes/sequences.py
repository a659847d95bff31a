"""The sequence table: one row per sequence of a dump, its own columns and its mismatch, and
for each setting what that setting does to it.

Columns (docs/sql.md#the-sequences-table): `step`, `seq_id`, the dump's other per-sequence
columns (`group_id`, `reward`; `advantage` and `entropy` as means over the sequence's tokens;
in sequence layout any other scalar column), then

- `length`: tokens of the sequence in the dump; `loss_tokens`: those with loss_mask true;
- over the loss tokens, with d = train_logprob - rollout_logprob in float64 (null for a
  sequence without loss tokens): `d_sum` = S = sum of d, `d_mean` = S / T, `k1` = -S / T,
  `abs_diff_mean` = mean |d|, `abs_diff_max` = max |d|, `k3` = mean of e^d - 1 - d,
  `geo_ratio` = e^(S / T), the geometric-mean ratio;
- per setting NAME (`setting_columns`): `NAME_weight`, the mean weight of its loss tokens;
  `NAME_kept`, the share of its loss tokens with weight > 0; `NAME_share`, its share of its
  step's gradient under the framework's loss aggregation (the step's shares sum to 1).

These are the columns `--where` can use (`iscore.dump.where`), except the per-setting ones (a
predicate selects the data every setting then sees); `SequenceTable` accumulates the whole table.

>>> import iscore                                         # doctest: +SKIP
>>> dump = iscore.Dump("data/fp8.parquet", where="length > 1000")  # doctest: +SKIP
>>> table = sequence_table(dump, [spec])                  # doctest: +SKIP
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import torch

from iscore.dump import (
    DEFAULT_CHUNK_TOKENS,
    Data,
    DropReport,
    Dump,
    Piece,
    check_unique,
    dump_schema,
    open_data,
    sequence_rows,
)
from iscore.errors import ConfigError, DumpProblems, IscoreError, quote
from iscore.frameworks import Replay, Setting, Spec, resolve_all
from iscore.packed import TokenBatch, ops
from iscore.passes.replay import replay
from iscore.stats import SETTING_STATISTICS, aggregation_of, setting_columns
from iscore.utils import (
    Engine,
    QueryError,
    TableSource,
    check_engine,
    ordered,
    output_path,
    referenced,
)


@dataclass(slots=True)
class SequenceTable:
    """Streaming accumulator of the sequence table: `update` each chunk (whole steps) inside
    `ops.shared`, `add` each setting's replay of it, `compute` at the end.

    Args:
        schema: the dump columns (`Dump.sequence_schema`); chunks carry its extras.
        specs: the settings whose columns the table gets.
    """

    schema: pa.Schema
    specs: Sequence[Spec] = ()
    chunks: list[pa.Table] = field(default_factory=list)
    prefixes: list[str] = field(init=False)
    sums: list[list[dict[str, np.ndarray]]] = field(init=False)

    def __post_init__(self) -> None:
        self.prefixes = setting_columns(self.specs, self.schema.names)
        self.sums = [[] for _ in self.specs]

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk's dump columns (before `add`ing its replays)."""
        self.chunks.append(sequence_rows(batch, self.schema))

    def add(self, index: int, batch: TokenBatch, replay: Replay) -> None:
        """Add setting `index`'s replay of the chunk last `update`d."""
        w = replay.weight  # 0 outside the loss mask and wherever keep is false
        sums = ops.segment_sums_on_host(batch, {"w": w, "nonzero": w > 0, "kept": replay.keep})
        self.sums[index].append(sums)

    def extend(self, other: SequenceTable) -> None:
        """Add the rows of `other`, a table of the same columns filled with the sequences
        that follow this one's (a Ray task's, `iscore.utils.distributed`)."""
        self.chunks += other.chunks
        for mine, theirs in zip(self.sums, other.sums, strict=True):
            mine += theirs

    def compute(self) -> pa.Table:
        """The whole table, in dump order."""
        table = (
            pa.concat_tables(self.chunks) if self.chunks else self.schema.empty_table()
        ).combine_chunks()
        T = table["loss_tokens"].to_numpy().astype(np.float64)
        step = table["step"].to_numpy()
        for spec, prefix, parts in zip(self.specs, self.prefixes, self.sums, strict=True):
            s = {
                k: np.concatenate([p[k] for p in parts]) if parts else np.zeros(0)
                for k in ("w", "nonzero", "kept")
            }
            columns = _setting_statistics(spec, s, T, step)
            for name in SETTING_STATISTICS:
                values = columns[name]
                table = table.append_column(
                    f"{prefix}_{name}", pa.array(values, mask=np.isnan(values))
                )
        return table


def _setting_statistics(
    spec: Spec, s: dict[str, np.ndarray], T: np.ndarray, step: np.ndarray
) -> dict[str, np.ndarray]:
    """float64 [B] weight, kept and share of one setting (NaN where undefined)."""
    aggregation = aggregation_of(spec)
    with np.errstate(invalid="ignore", divide="ignore"):
        weight = s["w"] / T
        kept = s["nonzero"] / T
        if aggregation.mode == "seq-mean-token-mean":
            denominator = s["kept"] if aggregation.shrinks else T
            part = np.where(denominator > 0, s["w"] / np.maximum(denominator, 1.0), 0.0)
        else:
            # token-mean and seq-mean-token-sum: the step's denominator is shared by all its
            # sequences, so a sequence's share is its weight sum over the step's.
            part = s["w"].copy()
        part[T == 0] = 0.0
        share = np.full(step.size, np.nan)
        for value in np.unique(step):
            rows = step == value
            total = part[rows].sum()
            if total > 0:
                share[rows] = part[rows] / total
        share[T == 0] = math.nan
    return {"weight": weight, "kept": kept, "share": share}


def sequence_table(
    source: Data,
    settings: Setting | Sequence[Setting] = (),
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    progress: Callable[[int], None] | None = None,
    engine: Engine = "local",
) -> pa.Table:
    """The sequence table of a dump (streamed in chunks of whole steps) or of a batch.

    Args:
        source: an opened `Dump` (its `where` and steps apply; open it with `extras=True`
            for all its per-sequence columns), a path (opened with `extras=True`), or a batch
            with its `extra` columns.
        settings: the settings whose columns the table gets
        (`iscore.frameworks.resolve.resolve_all`). max_tokens: tokens per streamed chunk.
        device: where to replay; default CUDA when available, else CPU.
        progress: called with the number of tokens of each chunk done (with the Ray
            engine, of each task).
        engine: "local" computes here; "ray" on a Ray cluster (`iscore.utils.distributed`), a
            task per file or range of a file's steps, their rows joined here in dump order
            (the table is held here either way). For a dump's files on disk only; the
            workers compute on their CPUs.

    >>> table = sequence_table(Dump("data/fp8.parquet", where="reward = 1", extras=True))
    >>> table.num_rows, table["reward"].unique().to_pylist()
    (25, [1.0])
    """
    specs = resolve_all(settings)
    check_engine(engine, device)
    # A dump opened here carries every per-sequence column; an open one, what it was given.
    opened = source if isinstance(source, Dump | TokenBatch) else open_data(source, extras=True)
    if engine == "ray":
        if not isinstance(opened, Dump):
            raise ConfigError(
                "the Ray engine reads a dump's files on its workers; a loaded batch's table "
                "is computed here (engine='local')"
            )
        return _ray_table(opened, specs, max_tokens, progress).compute()
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(opened, TokenBatch):
        schema = batch_schema(opened)
        chunks: Any = [opened]
    else:
        schema = read_schema(opened)
        chunks = opened.batches(max_tokens=max_tokens, whole_steps=True)
    table = SequenceTable(schema, specs)
    with ops.reused_buffers():
        for chunk in chunks:
            _fill(table, chunk.to(device), specs)
            if progress is not None:
                progress(chunk.num_tokens)
    return table.compute()


def _fill(table: SequenceTable, batch: TokenBatch, specs: Sequence[Spec]) -> None:
    """Add a chunk's rows and each setting's replay of it to `table`."""
    with ops.shared(batch):
        table.update(batch)
        for i, spec in enumerate(specs):
            table.add(i, batch, replay(batch, spec))


@dataclass(frozen=True, slots=True)
class _PieceTask:
    """What a Ray task fills (`_piece_table`): the table's rows of a piece of a file."""

    piece: Piece
    schema: pa.Schema
    specs: tuple[Spec, ...]
    max_tokens: int


@dataclass(slots=True)
class _PieceRows:
    """A Ray task's rows, the tokens it read and the sequences `drop_invalid` dropped."""

    table: SequenceTable
    tokens: int
    dropped: DropReport


def _piece_table(task: _PieceTask) -> _PieceRows:
    """A piece's rows of the sequence table, on a Ray worker (on its CPU)."""
    dump = task.piece.open()
    table = SequenceTable(task.schema, task.specs)
    tokens = 0
    with ops.reused_buffers():
        # A piece with no token in the loss is one piece of the dump (`part`).
        for chunk in dump.batches(task.max_tokens, whole_steps=True, part=True):
            _fill(table, chunk, task.specs)
            tokens += chunk.num_tokens
    return _PieceRows(table, tokens, dump.dropped)


def _ray_table(
    dump: Dump,
    specs: Sequence[Spec],
    max_tokens: int,
    progress: Callable[[int], None] | None,
) -> SequenceTable:
    """The sequence table of `dump`, its pieces (`Dump.pieces`) filled by Ray tasks and
    joined in dump order; `dump.dropped` gets what they dropped.

    Raises:
        DumpProblems: a whole dump with no token in the loss (as one process reads it),
            or a task's failure, naming its file.
        DumpError: a sequence in two files.
    """
    schema = read_schema(dump)
    work = (
        _PieceTask(piece, schema, tuple(specs), max_tokens)
        for index in range(len(dump.files))
        for piece in dump.pieces(index, max_tokens)
    )

    def finished(task: _PieceTask, rows: _PieceRows) -> None:
        if progress is not None:
            progress(rows.tokens)

    table = SequenceTable(schema, specs)
    owners: list[tuple[str, int]] = []
    for task, rows in ordered(_piece_table, work, name=lambda t: t.piece.path, done=finished):
        table.extend(rows.table)
        dump.dropped.add(rows.dropped)
        owners.append((task.piece.path, sum(chunk.num_rows for chunk in rows.table.chunks)))
    # One process refuses a dump whose sequences hold no token in the loss at all, and a
    # sequence in two files (each task's reader saw its piece alone).
    count = sum(n for _, n in owners)
    if count and not any(pc.sum(chunk["loss_tokens"]).as_py() for chunk in table.chunks):
        tokens = sum(pc.sum(chunk["length"]).as_py() for chunk in table.chunks)
        raise DumpProblems([dump.nothing_in_loss(count, tokens)])
    if len({path for path, _ in owners}) > 1:
        read = pa.concat_tables(table.chunks)
        check_unique(read["step"].to_numpy(), read["seq_id"].combine_chunks(), owners)
    return table


def read_schema(dump: Dump) -> pa.Schema:
    """The dump columns of the sequence table a pass over `dump` gives: its own per-sequence
    columns only where it carries them (`Dump(extras=True)` carries all)."""
    return dump_schema(dump.sequence_schema.field("seq_id").type, dump.carried)


def batch_schema(batch: TokenBatch) -> pa.Schema:
    """The dump columns of the sequence table of an in-memory batch."""
    extras = pa.schema([]) if batch.extra is None else batch.extra.schema
    return dump_schema(batch.seq_id.type, extras)


TABLES = ("sequences", "tokens")
"""The tables a query sees: the sequence table, and the `tokens` view over the dump."""


def _quoted(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def tokens_view(dump: Dump) -> tuple[dict[str, TableSource], str]:
    """The `tokens` view: one row per token of the sequences in the `sequences` table (so
    the steps, `--where` and dropped sequences apply), read lazily from the dump's files.

    Columns: step, seq_id, pos (null in a token-layout file without a pos column),
    rollout_logprob, train_logprob, policy_logprob and floor_logprob (where the dump has them),
    loss_mask, and
    d = train_logprob - rollout_logprob in float64 from the float32 values, as the engine
    computes it.

    Returns:
        the datasets to register (one per file) and the view's SELECT over them.

    Raises:
        QueryError: a sequence-layout file without a seq_id column (its sequences are
            numbered by row, which a scan of the file cannot tell).
    """
    seq_id = (
        "VARCHAR" if pa.types.is_string(dump.sequence_schema.field("seq_id").type) else "BIGINT"
    )
    tables: dict[str, TableSource] = {}
    parts = []
    for i, (info, dataset) in enumerate(zip(dump.files, dump.datasets(), strict=True)):
        name = f"__tokens_{i}"
        tables[name] = dataset
        source = {k: _quoted(v) for k, v in info.columns.source.items()}
        each = "unnest({})" if info.layout == "sequence" else "{}"
        if "seq_id" not in source:
            raise QueryError(f"tokens: {info.path} has no seq_id column; the tokens view needs one")
        columns = {
            "step": f"CAST({source['step']} AS BIGINT)"
            if "step" in source
            else "CAST(0 AS BIGINT)",
            "seq_id": f"CAST({source['seq_id']} AS {seq_id})",
        }
        if "pos" in source:
            columns["pos"] = f"CAST({each.format(source['pos'])} AS BIGINT)"
        elif info.layout == "sequence":
            columns["pos"] = f"unnest(range(len({source['rollout_logprob']})))"
        else:
            columns["pos"] = "CAST(NULL AS BIGINT)"
        for name_ in ("rollout_logprob", "train_logprob", "policy_logprob", "floor_logprob"):
            if name_ in source:
                columns[name_] = f"CAST({each.format(source[name_])} AS FLOAT)"
        columns["loss_mask"] = (
            f"CAST({each.format(source['loss_mask'])} AS BOOLEAN)"
            if "loss_mask" in source
            else "TRUE"
        )
        select = ", ".join(f"{value} AS {key}" for key, value in columns.items())
        parts.append(f"SELECT {select} FROM {name}")
    union = " UNION ALL BY NAME ".join(parts)
    view = (
        "SELECT t.*, CAST(t.train_logprob AS DOUBLE) - CAST(t.rollout_logprob AS DOUBLE) AS d "
        f"FROM ({union}) t SEMI JOIN sequences s ON t.step = s.step AND t.seq_id = s.seq_id"
    )
    return tables, view


def catalog(
    table: pa.Table, text: str, dump: Dump | None = None
) -> tuple[dict[str, TableSource], dict[str, str]]:
    """The tables and views query `text` needs: `sequences` (= `table`), and the `tokens`
    view over `dump` when the query reads it.

    Raises:
        QueryError: the query reads another table, or is not one SELECT.
    """
    tables: dict[str, TableSource] = {"sequences": table}
    views: dict[str, str] = {}
    offered = set(TABLES) if dump is not None else {"sequences"}
    if "tokens" in referenced(text, offered):
        more, views["tokens"] = tokens_view(dump)
        tables.update(more)
    return tables, views


FORMATS = {".parquet": "parquet", ".csv": "csv"}
"""The output formats of `write_rows`, by the file's suffix."""


def write_rows(rows: pa.Table | pa.RecordBatchReader, path: str | None) -> int:
    """Write rows as Parquet or CSV (by `path`'s suffix), or as CSV on stdout when `path` is
    None; returns the number of rows. A file appears only when the write succeeds.

    Raises:
        IscoreError: another suffix, or a column CSV cannot hold (lists, structs).
    """
    reader = rows.to_reader() if isinstance(rows, pa.Table) else rows
    if path is None:
        return _write_csv(reader, sys.stdout.buffer, "stdout")
    kind = FORMATS.get(Path(path).suffix.lower())
    if kind is None:
        raise IscoreError(
            f"{path}: expected a .parquet or .csv file name, but got {quote(Path(path).suffix)}"
        )
    with output_path(path) as tmp:
        if kind == "csv":
            with open(tmp, "wb") as sink:
                return _write_csv(reader, sink, path)
        count = 0
        with pq.ParquetWriter(tmp, reader.schema, compression="zstd") as writer:
            for batch in reader:
                writer.write_batch(batch)
                count += batch.num_rows
        return count


def _write_csv(reader: pa.RecordBatchReader, sink: Any, where: str) -> int:
    nested = [f.name for f in reader.schema if pa.types.is_nested(f.type)]
    if nested:
        raise IscoreError(
            f"{where}: column {nested[0]} holds lists or structs, which CSV cannot; "
            "write a .parquet file"
        )
    count = 0
    with pacsv.CSVWriter(sink, reader.schema) as writer:
        for batch in reader:
            writer.write_batch(batch)
            count += batch.num_rows
    return count
