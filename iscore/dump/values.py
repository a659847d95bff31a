"""The values a dump is described in: its files, their extra columns, the steps selected and
what was dropped (the problems found, `Problem`, are in `iscore.errors`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from iscore.dump.columns import ColumnMap
from iscore.errors import DumpError, quote

Layout = Literal["token", "sequence"]

DEFAULT_CHUNK_TOKENS = 2_000_000
"""Tokens per streamed chunk: about 300 MB of working memory while a chunk is processed."""


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

    def within(self, lo: int | None, hi: int | None) -> StepRange | None:
        """The steps of this range from `lo` to `hi` (inclusive; None leaves a side as it is),
        or None where none is left.

        >>> StepRange(3, None).within(None, 7), StepRange(3, 5).within(6, None)
        (StepRange(lo=3, hi=7), None)
        """
        low = lo if self.lo is None else self.lo if lo is None else max(lo, self.lo)
        high = hi if self.hi is None else self.hi if hi is None else min(hi, self.hi)
        if low is not None and high is not None and low > high:
            return None
        return StepRange(low, high)

    def row_group_may_match(self, lo: int, hi: int) -> bool:
        """Whether a row group whose steps span [lo, hi] can hold a selected step."""
        return (self.lo is None or hi >= self.lo) and (self.hi is None or lo <= self.hi)

    def covers(self, lo: int, hi: int) -> bool:
        """Whether every step from `lo` to `hi` is selected.

        >>> StepRange(3, 7).covers(3, 7), StepRange(3, None).covers(2, 5)
        (True, False)
        """
        return (self.lo is None or lo >= self.lo) and (self.hi is None or hi <= self.hi)

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
    provenance: dict = field(default_factory=dict)
    """Where an imported file came from (`iscore.provenance`), or {}."""
    footer: str = ""
    """The SHA-256 of the footer checked when it was opened (`iscore.utils.footer.check`)."""


@dataclass(slots=True)
class DropReport:
    """Sequences dropped by `drop_invalid`, accumulated while reading."""

    sequences: int = 0
    tokens: int = 0
    reasons: dict[str, int] = field(default_factory=dict)

    def add(self, other: DropReport) -> None:
        """Count what another read of the same dump dropped (a piece of it, `Dump.piece`)."""
        self.sequences += other.sequences
        self.tokens += other.tokens
        for reason, count in other.reasons.items():
            self.reasons[reason] = self.reasons.get(reason, 0) + count

    def to_dict(self) -> dict[str, Any]:
        """As the analysis document's `source.dropped` has it."""
        return {
            "sequences": self.sequences,
            "tokens": self.tokens,
            "invalid_values": dict(self.reasons),
        }
