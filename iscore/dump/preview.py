"""What a dump's file holds, for choosing its column mapping: its columns and their types, the
first rows as short text, which column iscore finds for each canonical one, and which columns
a mapping leaves unused (those that look like log-probs, above all, are never ignored silently).

Read from the Parquet footer and the first rows only, so a file whose columns iscore cannot
resolve can still be shown and mapped.

>>> p = preview_parquet("fp8.parquet", "data/fp8.parquet")
>>> p.found["train_logprob"], p.columns[:2]
('train_logprob', (('step', 'int64'), ('seq_id', 'int64')))
>>> p.unused(p.found.values())
()
>>> p.unused(["seq_id", "rollout_logprob", "advantage", "reward"])
('train_logprob',)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from iscore.dump.columns import match_columns
from iscore.errors import DumpError, clip
from iscore.utils import storage

ROWS = 5
"""Rows a preview shows."""

_ITEMS = 4
"""Values of a list cell shown before its length."""

_WIDTH = 40
"""Characters of a text cell shown."""

_FLOATS = ("halffloat", "float", "double")
"""Arrow's floating types, as `_type` names them."""

_LOGPROB_NAMES = ("logp", "log_p", "logprob", "log_prob")
"""Parts of a column name that say it holds log-probs, whatever its type."""


@dataclass(frozen=True, slots=True)
class Preview:
    """The first rows and the columns of one file of a dump.

    Attributes:
        name: the file (a path, an upload's name).
        columns: (name, type) of every column, in the file's order.
        rows: the first rows, one text per column, cut short.
        found: canonical name -> the column iscore reads for it without a mapping.
        ambiguous: canonical name -> the columns that could each be it (a mapping must say).
    """

    name: str
    columns: tuple[tuple[str, str], ...]
    rows: tuple[tuple[str, ...], ...]
    found: Mapping[str, str]
    ambiguous: Mapping[str, tuple[str, ...]]

    @property
    def names(self) -> tuple[str, ...]:
        """The columns' names."""
        return tuple(name for name, _ in self.columns)

    def looks_like_logprob(self, name: str) -> bool:
        """Whether column `name` may hold log-probs: floats (or lists of them), or so named."""
        kind = dict(self.columns)[name].removeprefix("list<").removesuffix(">")
        return kind in _FLOATS or any(part in name.lower() for part in _LOGPROB_NAMES)

    def unused(self, used: Iterable[str]) -> tuple[str, ...]:
        """The columns that look like log-probs and are not among `used` (a mapping's sources)."""
        taken = set(used)
        return tuple(n for n in self.names if n not in taken and self.looks_like_logprob(n))


def preview_table(name: str, table: pa.Table) -> Preview:
    """The preview of a table's first `ROWS` rows.

    >>> t = pa.table({"lp_rollout": [[-0.5, -1.0]], "train_logprob": [[-0.5, -0.9]]})
    >>> p = preview_table("t", t)
    >>> p.rows, dict(p.found)
    ((('[-0.5, -1]', '[-0.5, -0.9]'),), {'train_logprob': 'train_logprob'})
    """
    head = table.slice(0, ROWS)
    columns = tuple((field.name, _type(field.type)) for field in table.schema)
    rows = tuple(
        tuple(_cell(head[i][r].as_py()) for i in range(head.num_columns))
        for r in range(head.num_rows)
    )
    found, ambiguous = match_columns(table.column_names)
    return Preview(name, columns, rows, found, ambiguous)


def preview_parquet(name: str, source: str | bytes) -> Preview:
    """The preview of a Parquet file on disk (a path) or in memory (its bytes).

    Raises:
        DumpError: not a readable Parquet file.
    """
    try:
        if isinstance(source, bytes):
            parquet = pq.ParquetFile(pa.BufferReader(source))
        else:
            parquet = pq.ParquetFile(storage.readable(source))
        batch = next(parquet.iter_batches(batch_size=ROWS), None)
    except (pa.ArrowException, OSError) as e:
        raise DumpError(f"{name}: not a readable Parquet file ({e})") from None
    schema = parquet.schema_arrow
    table = pa.Table.from_batches([] if batch is None else [batch], schema=schema)
    return preview_table(name, table)


def _type(kind: pa.DataType) -> str:
    """`list<float>` rather than Arrow's `list<element: float>`."""
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return f"list<{_type(kind.value_type)}>"
    return str(kind)


def _cell(value: object) -> str:
    """A value as short text: a list shows its first values and its length."""
    if isinstance(value, list):
        items = ", ".join(_cell(v) for v in value[:_ITEMS])
        more = f", … ({len(value):,} values)" if len(value) > _ITEMS else ""
        return f"[{items}{more}]"
    if isinstance(value, float):
        return f"{value:.4g}"
    if value is None:
        return "null"
    return clip(str(value), _WIDTH)
