"""Reading one Parquet file row group by row group into chunks of whole sequences (token
and sequence layout), and the value checks every chunk passes: invalid log-probs, masks that
are not 0/1, nulls, duplicate or interleaved sequences, positions out of order, bad expert ids
and turns."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from iscore.dump.columns import EXPERT_COLUMNS, LOGPROB_COLUMNS, PER_SEQUENCE, PER_TOKEN, ColumnMap
from iscore.dump.files import leaf
from iscore.dump.schema import column_label, is_list
from iscore.dump.topk import topk_problems
from iscore.dump.values import DumpFile, Extra, StepRange
from iscore.errors import DumpProblems, Problem, counted, quote

READ_TOKENS = 262_144
"""Tokens per Parquet read (rows in token layout); chunks are assembled from these."""


TOPK_WEIGHT = 0.25
"""What a chunk's token budget counts for each top-k entry of a token, beside the token itself:
its 3 values (12 bytes) and their float64 temporaries weigh about a quarter of a token's share
of an analysis. At k = 20 a chunk holds a sixth of the tokens: on the bench's top-k dump
(docs/performance.md) analyze took 1.7-1.9 s in chunks of about one step against 2.0-2.4 s in
2M-token chunks, since the next chunk's read then overlaps this one's analysis, at a lower
peak memory (1.48 GB against 1.66 GB)."""

_SHOW_ROWS = 5
"""How many offending rows a problem names."""


_INT64_MAX = 2**63 - 1

_INT64_COLUMNS = (
    "step", "pos", "seq_id", "turn", "token_id", "train_token_id", "rollout_topk_ids",
    *EXPERT_COLUMNS,
)  # fmt: skip
"""Integer columns read as int64: a uint64 value above its range is a problem."""


@dataclass(slots=True)
class Chunk:
    """Whole sequences of one file, as flat arrays, before conversion to tensors."""

    file: str
    per_token: dict[str, pa.Array]
    seq_id: pa.Array
    step: np.ndarray
    lengths: np.ndarray
    rows: np.ndarray  # file row of each token (in sequence layout: of its sequence)
    extra: pa.Table | None = None  # the carried `Extra` columns, one row per sequence

    def sequences(self, start: int, stop: int) -> Chunk:
        """Sequences start..stop-1 of this chunk."""
        offsets = np.concatenate([[0], np.cumsum(self.lengths)])
        a, b = int(offsets[start]), int(offsets[stop])
        return Chunk(
            self.file,
            {k: v.slice(a, b - a) for k, v in self.per_token.items()},
            self.seq_id.slice(start, stop - start),
            self.step[start:stop],
            self.lengths[start:stop],
            self.rows[a:b],
            None if self.extra is None else self.extra.slice(start, stop - start),
        )

    def subset(self, keep: np.ndarray) -> Chunk:
        """The sequences where `keep` (bool [B]) is true."""
        keep_token = np.repeat(keep, self.lengths)
        return Chunk(
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
            "rollout": plain(t["rollout_logprob"], pa.float32()).to_numpy(),
            "train": plain(t["train_logprob"], pa.float32()).to_numpy(),
        }
        if "loss_mask" in t:
            out["loss_mask"] = bools(t["loss_mask"])
        return out


INVALID = "invalid log-prob"

_PER_TOKEN_READ = (*PER_TOKEN, "token_id")
"""The per-token columns a chunk holds: `token_id` only where the top-k columns or
`train_token_id` are read."""


def invalid_values(values: pa.Array) -> np.ndarray:
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


def check_values(chunk: Chunk, columns: ColumnMap) -> list[Problem]:
    """Value problems of a chunk: invalid log-probs, loss masks other than 0/1, expert ids
    that are negative, empty or of unequal length on the two sides, a turn that goes back."""
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
                rows, count = _first_rows(mask, token_rows)
                problems.append(
                    Problem(
                        chunk.file,
                        column_label(columns, name),
                        f"{INVALID}: {counted(count, f'{what} value')}",
                        tuple(dict.fromkeys(rows)),
                        count,
                    )
                )
    mask = chunk.per_token.get("loss_mask")
    if mask is not None and not pa.types.is_boolean(mask.type):
        m = mask.to_numpy(zero_copy_only=False)
        bad = (m != 0) & (m != 1)
        if bad.any():
            rows, count = _first_rows(bad, token_rows)
            problems.append(
                Problem(
                    chunk.file,
                    column_label(columns, "loss_mask"),
                    f"expected 0 or 1, found other values ({count:,} tokens)",
                    tuple(dict.fromkeys(rows)),
                    count,
                )
            )
    problems.extend(_expert_problems(chunk, columns))
    problems.extend(topk_problems(chunk.file, chunk.per_token, chunk.rows, columns))
    turn = chunk.per_token.get("turn")
    if turn is not None and len(turn) > 1:
        t = turn.to_numpy(zero_copy_only=False)
        starts = np.cumsum(chunk.lengths)[:-1]
        back = np.concatenate([[False], t[1:] < t[:-1]])
        back[starts[starts < t.size]] = False  # a sequence's first token starts over
        if back.any():
            rows, count = _first_rows(back, token_rows)
            problems.append(
                Problem(
                    chunk.file,
                    column_label(columns, "turn"),
                    f"turn decreases within a sequence ({counted(count, 'token')}); a "
                    "token's turn is the index of its turn in the conversation, which never "
                    "goes back",
                    tuple(dict.fromkeys(rows)),
                    count,
                )
            )
    return problems


def _expert_problems(chunk: Chunk, columns: ColumnMap) -> list[Problem]:
    """Lists of expert ids that are empty, hold a negative id, or differ in length between
    the two sides (nulls are found as read)."""
    if not all(name in chunk.per_token for name in EXPERT_COLUMNS):
        return []
    # (column, bad, the file row of each of bad's values, (noun, plural, the rest))
    found: list[tuple[str, np.ndarray, np.ndarray, tuple[str, str, str]]] = []
    lengths = []
    for name in EXPERT_COLUMNS:
        ids = chunk.per_token[name]
        n = pc.list_value_length(ids).fill_null(0).to_numpy(zero_copy_only=False)
        lengths.append(n)
        found.append(
            (
                name,
                n == 0,
                chunk.rows,
                ("empty list", "empty lists", " of expert ids (a token lists >= 1)"),
            )
        )
        values = pc.list_flatten(ids)
        if pa.types.is_signed_integer(values.type):
            negative = pc.less(values, 0).fill_null(False).to_numpy(zero_copy_only=False)
            found.append(
                (
                    name,
                    negative,
                    np.repeat(chunk.rows, n),
                    ("negative expert id", "negative expert ids", ""),
                )
            )
    a, b = lengths
    found.append(
        (
            "train_experts",
            (a != b) & (a > 0) & (b > 0),
            chunk.rows,
            (
                "token",
                "tokens",
                " whose list of expert ids differs in length from rollout_experts' (each token "
                "lists as many ids on both sides)",
            ),
        )
    )
    problems = []
    for name, bad, rows, what in found:
        if bad.any():
            r, count = _first_rows(bad, rows)
            one, many, rest = what
            message = counted(count, one, many) + rest
            label = column_label(columns, name)
            problems.append(Problem(chunk.file, label, message, tuple(dict.fromkeys(r)), count))
    return problems


def _value_rows(rows: np.ndarray, levels: list[pa.Array]) -> np.ndarray:
    """The file row of each value of a list column flattened `len(levels)` times, from the
    list lengths at each level."""
    for lengths in levels:
        rows = np.repeat(rows, lengths.to_numpy(zero_copy_only=False))
    return rows


def _first_rows(mask: np.ndarray, rows: np.ndarray) -> tuple[tuple[int, ...], int]:
    hits = np.flatnonzero(mask)
    return tuple(int(r) for r in rows[hits[:_SHOW_ROWS]]), int(hits.size)


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
        # Is the sample among the k? Did the trainer score the sampled token?
        wanted = "rollout_topk_ids" in self.source or "train_token_id" in self.source
        if wanted and "token_id" in info.columns:
            self.source["token_id"] = info.columns.source["token_id"]
        self.source.update({e.name: e.source for e in extras})

    def _budget(self, max_tokens: int | None) -> int | None:
        """`max_tokens` less for a file whose tokens list top-k entries (`TOPK_WEIGHT`), k
        read from the footer of its first row group with tokens."""
        if max_tokens is None or "rollout_topk_logprobs" not in self.source:
            return max_tokens
        meta = self.parquet.metadata
        for group in range(meta.num_row_groups):
            tokens = leaf(meta, group, self.source["rollout_logprob"]).num_values
            if tokens:
                entries = leaf(meta, group, self.source["rollout_topk_logprobs"]).num_values
                return max(1, int(max_tokens / (1 + TOPK_WEIGHT * entries / tokens)))
        return max_tokens

    def _row_groups(self) -> list[int]:
        """Row groups that can hold selected steps, judged by their statistics."""
        groups = list(range(self.parquet.num_row_groups))
        if (self.steps.lo is None and self.steps.hi is None) or "step" not in self.source:
            return groups
        keep = []
        for g in groups:
            stats = leaf(self.parquet.metadata, g, self.source["step"]).statistics
            if (
                stats is None
                or not stats.has_min_max
                or self.steps.row_group_may_match(stats.min, stats.max)
            ):
                keep.append(g)
        return keep

    def _read_rows(self, group: int) -> int:
        """Rows per read so that a read holds about `READ_TOKENS` tokens."""
        if self.info.layout == "token":
            return READ_TOKENS
        meta = self.parquet.metadata
        tokens = leaf(meta, group, self.source["rollout_logprob"]).num_values
        mean_length = max(tokens / max(meta.row_group(group).num_rows, 1), 1.0)
        return max(1, int(READ_TOKENS / mean_length))

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
        step = _array(table["step"])
        bounds = pc.min_max(step)  # nulls aside, as `pc.all` of the mask would
        lo, hi = bounds["min"].as_py(), bounds["max"].as_py()
        if lo is not None and self.steps.covers(lo, hi):
            return table, rows  # every step inside the range (a piece's): no mask, no copy
        mask = self.steps.mask(step)
        if pc.all(mask).as_py():
            return table, rows
        return table.filter(mask), rows[mask.to_numpy(zero_copy_only=False)]

    def _read_problems(self, table: pa.Table, rows: np.ndarray) -> list[Problem]:
        """Nulls (inside lists too, at any depth) and steps, positions, turns or expert ids
        int64 cannot hold, as read."""
        problems = []
        carried = {e.name for e in self.extras}  # nulls there are values (no reward yet)
        for name in table.column_names:
            if name in carried:
                continue
            column = _array(table[name])
            label = column_label(self.info.columns, name)
            # Null log-probs of token layout are reported with the invalid values (as NaN),
            # so that --drop-invalid can drop their sequences; so are those inside lists.
            if column.null_count and not (name in LOGPROB_COLUMNS and self.info.layout == "token"):
                nulls = ("null value", "null values")
                problems.append(self._problem(label, nulls, column.is_null(), rows))
            # The file row of each value, found only for a problem (a top-k column holds k
            # values per token).
            values, levels, inside = column, [], "its lists"
            while is_list(values.type):
                levels.append(pc.list_value_length(values).fill_null(0))
                values = pc.list_flatten(values)
                if values.null_count and name not in LOGPROB_COLUMNS:
                    what = (f"null value inside {inside}", f"null values inside {inside}")
                    bad = values.is_null()
                    problems.append(self._problem(label, what, bad, _value_rows(rows, levels)))
                inside = "the lists of its lists"
            if name in _INT64_COLUMNS and values.type == pa.uint64():
                above = pc.greater(values, pa.scalar(_INT64_MAX, pa.uint64()))
                if pc.any(above).as_py():
                    above_max = f"above {_INT64_MAX:,} (2^63 - 1), which int64 cannot hold"
                    what = (f"value {above_max}", f"values {above_max}")
                    problems.append(self._problem(label, what, above, _value_rows(rows, levels)))
        return problems

    def _problem(
        self, label: str, what: tuple[str, str], bad: pa.Array, rows: np.ndarray
    ) -> Problem:
        """A problem at the rows where `bad` is true (`what`: singular, plural); `rows` holds
        the file row of each of `bad`'s values."""
        r, count = _first_rows(bad.fill_null(False).to_numpy(zero_copy_only=False), rows)
        return Problem(self.info.path, label, counted(count, *what), tuple(dict.fromkeys(r)), count)

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
            r, count = _first_rows(differ, rows)
            message = (
                f"{count:,} values differ from the first of their sequence; {extra.name} holds "
                "one value per sequence, repeated on each of its rows in token layout"
            )
            label = column_label(self.info.columns, extra.name)
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
                label = column_label(self.info.columns, "seq_id")
                raise DumpProblems([Problem(self.info.path, label, message, (r,), 1)])
            self._here.add(key)


class _TokenReader(_Reader):
    """Token layout: one row per token; a sequence is a run of rows with one (step, seq_id)."""

    def chunks(self, max_tokens: int | None) -> Iterator[Chunk]:
        max_tokens = self._budget(max_tokens)
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

    def _chunk(self, table: pa.Table, rows: np.ndarray) -> Chunk:
        table = table.combine_chunks()
        starts = _run_starts(table)
        lengths = np.diff(np.append(starts, table.num_rows))
        step = (
            table["step"].to_numpy()[starts]
            if "step" in table.column_names
            else np.zeros(starts.size, dtype=np.int64)
        ).astype(np.int64)
        # As the sequence table types it (int64 or string): files and reads of one dump may
        # store it as any integer or string type.
        seq_id = table["seq_id"].chunk(0).take(pa.array(starts)).cast(self.info.seq_id_type)
        self._mark_seen(step, seq_id, rows[starts])
        extra = self._extra({e.name: table[e.name].chunk(0) for e in self.extras}, lengths, rows)
        per_token = {n: table[n].chunk(0) for n in _PER_TOKEN_READ if n in table.column_names}
        if "pos" in per_token:
            per_token, rows = _order_by_pos(self.info, per_token, lengths, rows)
        return Chunk(self.info.path, per_token, seq_id, step, lengths, rows, extra)


def _array(column: pa.ChunkedArray) -> pa.Array:
    """The column as one array: its only chunk as it is (`combine_chunks` copies even one:
    30 ms for a chunk's 2M int64 values)."""
    return column.chunk(0) if column.num_chunks == 1 else column.combine_chunks()


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
            col = _array(table[name])
            if pa.types.is_integer(col.type) and not col.null_count:
                # numpy's comparison, in place: arrow's writes bits, unpacked again (6x slower).
                values = col.to_numpy()
                change[1:] |= np.not_equal(values[1:], values[:-1], out=np.empty_like(change[1:]))
            else:
                differs = pc.not_equal(col.slice(1), col.slice(0, len(col) - 1))
                change[1:] |= differs.to_numpy(zero_copy_only=False)
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
    # Where a sequence begins, the next token starts over: it need not follow the last one.
    # (The end of an empty sequence is where the next begins: no entry of its own.)
    ends = np.cumsum(lengths)[:-1] - 1
    boundary = np.zeros(max(pos.size - 1, 0), dtype=bool)
    boundary[ends[(ends >= 0) & (ends < boundary.size)]] = True
    # Comparisons, not differences: a difference wraps in narrow or unsigned dtypes (uint64
    # 0 - 1 is 2^64 - 1, "in order"), and a copy to int64 would double a sorted column.
    if not (boundary | (pos[1:] > pos[:-1])).all():
        seq = np.repeat(np.arange(lengths.size), lengths)
        order = np.lexsort((pos, seq))
        index = pa.array(order)
        per_token = {k: v.take(index) for k, v in per_token.items()}
        pos, rows = pos[order], rows[order]
    repeated = ~boundary & (pos[1:] == pos[:-1])
    if repeated.any():
        dup = np.concatenate([[False], repeated])
        r, count = _first_rows(dup, rows)
        message = f"duplicate (seq_id, pos): {count:,} tokens repeat a position of their sequence"
        raise DumpProblems(
            [
                Problem(
                    info.path,
                    column_label(info.columns, "pos"),
                    message,
                    tuple(dict.fromkeys(r)),
                    count,
                )
            ]
        )
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    if (boundary | (pos[1:] == pos[:-1] + 1)).all() and (pos[starts[lengths > 0]] == 0).all():
        del per_token["pos"]
    return per_token, rows


class _SequenceReader(_Reader):
    """Sequence layout: one row per sequence, per-token values in equal-length lists."""

    def chunks(self, max_tokens: int | None) -> Iterator[Chunk]:
        max_tokens = self._budget(max_tokens)
        pending: list[Chunk] = []
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
                rest = chunk.sequences(cut, chunk.lengths.size)
                pending = [rest] if rest.lengths.size else []  # none: the next read not copied
                count = int(rest.lengths.sum())
        pending = [c for c in pending if c.lengths.size]
        if pending:
            yield _concat_chunks(pending)

    def _chunk(self, table: pa.Table, rows: np.ndarray) -> Chunk:
        problems = self._read_problems(table, rows)
        if problems:
            raise DumpProblems(problems)
        lists = {n: _array(table[n]) for n in _PER_TOKEN_READ if n in table.column_names}
        lengths = pc.list_value_length(lists["rollout_logprob"]).to_numpy(zero_copy_only=False)
        for name, values in lists.items():
            other = pc.list_value_length(values).to_numpy(zero_copy_only=False)
            differ = other != lengths
            if name != "rollout_logprob" and differ.any():
                r, count = _first_rows(differ, rows)
                example = f"{int(other[differ][0])} vs {int(lengths[differ][0])}"
                message = f"list lengths differ from rollout_logprob's (e.g. {example})"
                raise DumpProblems(
                    [
                        Problem(
                            self.info.path, column_label(self.info.columns, name), message, r, count
                        )
                    ]
                )
        per_token = {n: pc.list_flatten(v) for n, v in lists.items()}
        seq_id = (
            _array(table["seq_id"]).cast(self.info.seq_id_type)
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
        extra = self._extra({e.name: _array(table[e.name]) for e in self.extras})
        if "pos" in per_token:
            per_token, token_rows = _order_by_pos(self.info, per_token, lengths, token_rows)
        return Chunk(self.info.path, per_token, seq_id, step, lengths, token_rows, extra)


def open_reader(
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


def _concat_chunks(chunks: list[Chunk]) -> Chunk:
    if len(chunks) == 1:
        return chunks[0]
    names = dict.fromkeys(name for c in chunks for name in c.per_token)
    return Chunk(
        chunks[0].file,
        {k: pa.concat_arrays([_token_values(c, k) for c in chunks]) for k in names},
        pa.concat_arrays([c.seq_id for c in chunks]),
        np.concatenate([c.step for c in chunks]),
        np.concatenate([c.lengths for c in chunks]),
        np.concatenate([c.rows for c in chunks]),
        None if chunks[0].extra is None else pa.concat_tables([c.extra for c in chunks]),
    )


def _token_values(chunk: Chunk, name: str) -> pa.Array:
    """A chunk's per-token column, to be joined with other chunks': `pos` as int64, and
    0..T-1 where `_order_by_pos` dropped it as just that (another read may keep it)."""
    if name != "pos":
        return chunk.per_token[name]
    if "pos" in chunk.per_token:
        return chunk.per_token["pos"].cast(pa.int64())
    starts = np.repeat(np.cumsum(chunk.lengths) - chunk.lengths, chunk.lengths)
    return pa.array(np.arange(int(chunk.lengths.sum()), dtype=np.int64) - starts)


def plain(values: pa.Array, dtype: pa.DataType) -> pa.Array:
    """`values` as `dtype` (cast only when needed), nulls as 0."""
    if values.type != dtype:
        values = pc.cast(values, dtype)
    if values.null_count:
        values = pc.fill_null(values, 0)
    return values


def bools(values: pa.Array) -> np.ndarray:
    """A boolean column as numpy (nulls as false)."""
    return values.to_numpy(zero_copy_only=False).astype(bool)
