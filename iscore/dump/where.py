"""`--where`: a condition on a dump's sequence columns, judged on each streamed chunk.

A predicate reads the sequence table's dump columns (step, seq_id, the dump's own per-sequence
columns, length, loss_tokens) and its mismatch columns (`d_sum`, `d_mean`, `k1`,
`abs_diff_mean`, `abs_diff_max`, `k3`, `geo_ratio`; defined in `iscore.passes.sequences`).
`sequence_rows` computes those columns for a batch's sequences, and `Judge` keeps the
sequences where the predicate holds, chunk by chunk, so a filtered stream never holds more
than a chunk. The sequence table builds its dump columns with the same `sequence_rows`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.dump.columns import COMPUTED, MISMATCH
from iscore.packed import TokenBatch, ops
from iscore.utils import Evaluator, Predicate


class _Statistics:
    """The per-sequence sums of one batch, each computed on first use (inside `ops.shared`,
    d and its sums are shared with the diagnostics)."""

    def __init__(self, batch: TokenBatch):
        self.batch = batch
        self.mask = batch.loss_mask
        self._cache: dict[str, Any] = {}

    def _get(self, name: str, compute: Callable[[], Any]) -> Any:
        if name not in self._cache:
            self._cache[name] = compute()
        return self._cache[name]

    def loss_tokens(self) -> np.ndarray:
        """int64 [B] loss tokens of each sequence."""
        return self._get(
            "T", lambda: ops.segment_count(self.batch, self.mask).cpu().numpy().astype(np.int64)
        )

    def _sum(self, name: str, values: Callable[[], torch.Tensor]) -> np.ndarray:
        return self._get(
            name, lambda: ops.segment_sum(values(), self.batch, self.mask).cpu().numpy()
        )

    def _abs(self) -> torch.Tensor:
        return self._get("abs", lambda: torch.abs(ops.log_ratio(self.batch)))

    def column(self, name: str) -> np.ndarray:
        """float64 [B] `name` of `MISMATCH` (NaN where a sequence has no loss token)."""
        T = self.loss_tokens().astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            if name == "d_sum":
                values = self._sum("S", lambda: ops.log_ratio(self.batch)).copy()
            elif name in ("d_mean", "k1", "geo_ratio"):
                mean = self._sum("S", lambda: ops.log_ratio(self.batch)) / T
                values = {"d_mean": mean, "k1": -mean, "geo_ratio": np.exp(mean)}[name]
            elif name == "abs_diff_mean":
                values = self._sum("A", self._abs) / T
            elif name == "abs_diff_max":
                values = ops.segment_max(self._abs(), self.batch, self.mask).cpu().numpy()
            else:  # k3
                values = self._sum("K", lambda: ops.k3(ops.log_ratio(self.batch))) / T
        values[T == 0] = np.nan
        return values


def sequence_rows(
    batch: TokenBatch, schema: pa.Schema, columns: Collection[str] | None = None
) -> pa.Table:
    """The dump columns of the sequence table for each sequence of `batch` [B rows].

    Args:
        batch: whole sequences, with their `extra` columns as the table needs them.
        schema: the table's dump columns (`dump_schema`).
        columns: only these (in schema order); None for all.

    >>> b = TokenBatch(rollout=torch.tensor([-1.0, -2.0, -0.5]),
    ...                train=torch.tensor([-1.5, -2.0, -0.5]), cu_seqlens=torch.tensor([0, 2, 3]))
    >>> from iscore.dump.columns import dump_schema
    >>> schema = dump_schema(pa.int64(), pa.schema([]))
    >>> sequence_rows(b, schema, ["length", "d_sum", "abs_diff_max"]).to_pydict()
    {'length': [2, 1], 'abs_diff_max': [0.5, 0.0], 'd_sum': [-0.5, 0.0]}
    """
    stats = _Statistics(batch)
    wanted = schema.names if columns is None else [n for n in schema.names if n in columns]
    arrays = []
    for name in wanted:
        kind = schema.field(name).type
        if name == "step":
            arrays.append(pa.array(batch.step.cpu().numpy().astype(np.int64)))
        elif name == "seq_id":
            arrays.append(batch.seq_id.cast(kind))
        elif name == "length":
            arrays.append(pa.array(batch.lengths.cpu().numpy().astype(np.int64)))
        elif name == "loss_tokens":
            arrays.append(pa.array(stats.loss_tokens()))
        elif name in MISMATCH:
            arrays.append(pa.array(stats.column(name), mask=stats.loss_tokens() == 0))
        else:
            arrays.append(batch.extra[name].combine_chunks())
    return pa.table(arrays, schema=pa.schema([schema.field(n) for n in wanted]))


@dataclass(frozen=True, slots=True)
class Where:
    """A `--where` predicate checked against a dump's sequence columns, judging batches.

    Attributes:
        predicate: the checked SQL expression.
        extras: the dump's own columns it reads beyond step and seq_id (to be carried
            through reading).
    """

    predicate: Predicate
    extras: frozenset[str]

    @classmethod
    def compile(cls, text: str, schema: pa.Schema) -> Where:
        """Check `text` against the dump columns `schema` (`dump_schema`).

        Raises:
            QueryError: not one boolean expression over those columns, naming the problem.
        """
        hint = "; per-setting columns are not available to --where"
        predicate = Predicate.compile(text, schema, hint=hint)
        own = set(schema.names) - {"step", "seq_id", *COMPUTED}
        return cls(predicate, frozenset(predicate.columns & own))

    @property
    def text(self) -> str:
        return self.predicate.text

    def judge(self) -> Judge:
        """A judge of many batches in one thread (it holds one DuckDB connection): close it
        when done, or use it as a context manager."""
        return Judge(self.predicate.evaluator())


@dataclass(slots=True)
class Judge:
    """Applies a `Where` to batches: see `Where.judge`."""

    evaluator: Evaluator

    def __enter__(self) -> Judge:
        return self

    def __exit__(self, *exc: object) -> None:
        self.evaluator.close()

    def keep(self, batch: TokenBatch) -> np.ndarray:
        """bool [B]: whether the predicate holds for each sequence of `batch` (only the
        columns it reads are computed)."""
        predicate = self.evaluator.predicate
        return self.evaluator.mask(sequence_rows(batch, predicate.schema, predicate.columns))

    def select(self, batch: TokenBatch) -> TokenBatch:
        """The sequences of `batch` where the predicate holds."""
        keep = self.keep(batch)
        return batch if keep.all() else batch.select(torch.from_numpy(keep))
