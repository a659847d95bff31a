"""The mismatch by each metadata column of a dump (`weight_version`, `replica`, `rank`, `host`,
`device`: one value per sequence), and the loss tokens the trainer scored as another token
than the engine sampled (`train_token_id` beside `token_id`).

`MetadataStats` keeps each sequence's metadata values beside the mismatch's per-sequence sums
(`MismatchStats.seq`, in the same order), and per sequence the loss tokens whose two ids
differ with the position of the first; `compute` groups the sums by value. A dump read in
chunks, from a results store or by worker processes gives the numbers of the dump read whole.

>>> import torch
>>> from iscore.packed import TokenBatch
>>> b = TokenBatch(rollout=torch.tensor([-1.0, -2.0, -0.5]), train=torch.tensor([-1.0, -2.0, -1.5]),
...                cu_seqlens=torch.tensor([0, 2, 3]), extra=pa.table({"replica": [0, 1]}))
>>> stats = MetadataStats(); stats.update(b)
>>> s = {"T": np.array([2.0, 1.0]), "k3": np.array([0.0, 0.368]), "abs": np.array([0.0, 1.0]),
...      "S": np.array([0.0, -1.0]), "rho": np.array([2.0, 0.368]),
...      "broken": np.array([0.0, 0.0]), "step": np.array([0, 0])}
>>> [(row["value"], row["k3"]) for row in stats.compute(s).by["replica"]]
[(0, 0.0), (1, 0.368)]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from iscore.packed import META_COLUMNS, TokenBatch
from iscore.stats.histogram import checked
from iscore.utils import from_ipc, to_ipc


@dataclass(frozen=True, slots=True)
class TokenIds:
    """The loss tokens whose trainer-side id (`train_token_id`) is not the sampled one.

    Attributes:
        differ: loss tokens whose two ids differ.
        tokens: loss tokens compared.
        first: the first of them in dump order, `{"step", "seq_id", "pos"}`; None if none.
    """

    differ: int
    tokens: int
    first: dict[str, Any] | None

    @property
    def share(self) -> float:
        return self.differ / self.tokens if self.tokens else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "differ": self.differ,
            "tokens": self.tokens,
            "share": self.share,
            "first": self.first,
        }


@dataclass(frozen=True, slots=True)
class MetadataSummary:
    """The mismatch by each metadata column the dump has.

    Attributes:
        by: column -> one row per value (nulls together, value None), in value order: its
            `tokens` (loss tokens), `sequences`, `steps` (distinct steps) and `first_step`,
            `last_step`, `k3`, `k3_stderr` (over sequences), `abs_diff_mean`, `d_mean`,
            `ratio_mean`, `broken_sequences`; the `weight_version` rows also `by_step`, the
            same per step (`step`, `tokens`, `sequences`, `k3`, `k3_stderr`). The statistics are
            None without a loss token.
        sums: column -> per value, float64 [6]: sequences with loss tokens, loss tokens, and
            the sums of k3, k3^2, k3 T and T^2 over its sequences (per-sequence k3 sums):
            what a value is compared with the others on (`iscore.advice.metadata`).
        token_ids: the trainer's token ids against the sampled ones, where the dump has both.
    """

    by: dict[str, tuple[dict[str, Any], ...]]
    sums: dict[str, tuple[np.ndarray, ...]]
    token_ids: TokenIds | None = None

    def to_dict(self) -> dict[str, Any]:
        """The document's `mismatch.by_<column>` keys and `token_ids`, where the dump has them."""
        out: dict[str, Any] = {f"by_{name}": list(rows) for name, rows in self.by.items()}
        if self.token_ids is not None:
            out["token_ids"] = self.token_ids.to_dict()
        return out


@dataclass(slots=True)
class MetadataStats:
    """Streaming accumulator of the metadata values and the token-id comparison (`update`,
    `merge`, `state`, `from_state`, `compute`)."""

    # Per chunk: the metadata columns, one row per sequence.
    values: list[pa.Table] = field(default_factory=list)
    # Per chunk, int64 [2, B]: each sequence's loss tokens whose ids differ, the position of
    # the first (-1 for none).
    token_ids: list[np.ndarray] = field(default_factory=list)
    # Per chunk, int64 [B]: each sequence's loss tokens compared (with `token_ids`).
    compared: list[np.ndarray] = field(default_factory=list)

    def update(self, batch: TokenBatch) -> None:
        """Add one chunk of whole sequences."""
        extra = batch.extra
        names = [] if extra is None else [n for n in META_COLUMNS if n in extra.column_names]
        if names:
            self.values.append(extra.select(names))
        if batch.train_token_id is not None and batch.token_id is not None:
            self.token_ids.append(_differ(batch))
            loss = batch.loss_mask.to(torch.int64).cpu()
            self.compared.append(
                np.bincount(
                    batch.seq_index.cpu().numpy(), loss.numpy(), minlength=batch.num_sequences
                ).astype(np.int64)
            )

    def merge(self, other: MetadataStats) -> None:
        """Add another accumulator's chunks after these (order is kept)."""
        self.values.extend(other.values)
        self.token_ids.extend(other.token_ids)
        self.compared.extend(other.compared)

    def _table(self) -> pa.Table | None:
        return pa.concat_tables(self.values).combine_chunks() if self.values else None

    def state(self) -> dict[str, np.ndarray]:
        """Each metadata column as Arrow IPC bytes (`values.<name>`), and the token-id counts
        (`token_ids` [2, B], `compared` [B]) where the dump has them."""
        out: dict[str, np.ndarray] = {}
        table = self._table()
        if table is not None:
            out |= {f"values.{n}": to_ipc(table[n].combine_chunks()) for n in table.column_names}
        if self.token_ids:
            out["token_ids"] = np.concatenate(self.token_ids, axis=1)
            out["compared"] = np.concatenate(self.compared)
        return out

    @classmethod
    def from_state(cls, state: dict[str, np.ndarray], b: int) -> MetadataStats:
        """The accumulator `state` describes, of `b` sequences.

        Raises:
            ValueError: an array missing or of another length than `b`, ids that do not decode.
        """
        stats = cls()
        columns = {}
        for name in META_COLUMNS:
            if f"values.{name}" in state:
                columns[name] = from_ipc(checked(state, f"values.{name}", "u", (-1,)))
                if len(columns[name]) != b:
                    raise ValueError(f"values.{name}: expected {b} values")
        if columns:
            stats.values = [pa.table(columns)]
        if "token_ids" in state:
            stats.token_ids = [checked(state, "token_ids", "i", (2, b)).astype(np.int64)]
            stats.compared = [checked(state, "compared", "i", (b,)).astype(np.int64)]
        return stats

    def compute(self, s: dict[str, np.ndarray]) -> MetadataSummary | None:
        """The breakdown over the mismatch's per-sequence numbers `s` (`MismatchStats.sequences`
        with `broken`, in the order these values were added); None where the dump has no
        metadata column and no `train_token_id`."""
        table = self._table()
        if table is None and not self.token_ids:
            return None
        by: dict[str, tuple[dict[str, Any], ...]] = {}
        sums: dict[str, tuple[np.ndarray, ...]] = {}
        for name in [] if table is None else table.column_names:
            codes, values = _codes(table[name].combine_chunks())
            rows, found = [], []
            for code, value in enumerate(values):
                sel = codes == code
                row = {"value": value, **_row(s, sel)}
                if name == "weight_version":
                    row["by_step"] = [
                        {"step": int(step), **_group(s, sel & (s["step"] == step))}
                        for step in np.unique(s["step"][sel])
                    ]
                rows.append(row)
                found.append(_sums(s, sel))
            by[name], sums[name] = tuple(rows), tuple(found)
        return MetadataSummary(by, sums, self._token_ids(s) if self.token_ids else None)

    def _token_ids(self, s: dict[str, np.ndarray]) -> TokenIds:
        counts = np.concatenate(self.token_ids, axis=1)
        having = np.flatnonzero(counts[0])
        first = None
        if having.size:
            i = int(having[0])
            seq_id = s["seq_id"][i].as_py()
            first = {"step": int(s["step"][i]), "seq_id": seq_id, "pos": int(counts[1, i])}
        compared = int(np.concatenate(self.compared).sum())
        return TokenIds(int(counts[0].sum()), compared, first)


def _differ(batch: TokenBatch) -> np.ndarray:
    """int64 [2, B]: each sequence's loss tokens whose trainer-side id is not the sampled one,
    and the position of the first (-1 where none is)."""
    differ = (batch.token_id != batch.train_token_id) & batch.loss_mask
    hits = torch.nonzero(differ).flatten()
    seq = batch.seq_index[hits].cpu().numpy()
    out = np.zeros((2, batch.num_sequences), dtype=np.int64)
    out[1] = -1
    if seq.size:
        np.add.at(out[0], seq, 1)
        first, at = np.unique(seq, return_index=True)  # hits are in token order
        out[1, first] = batch.positions()[hits].cpu().numpy()[at]
    return out


def _codes(column: pa.Array) -> tuple[np.ndarray, list[Any]]:
    """Each sequence's value as a code into the sorted distinct values (nulls, None, last)."""
    items = column.to_pylist()
    values: list[Any] = sorted({v for v in items if v is not None})
    if len(values) < len(set(items)):
        values.append(None)
    index = {v: i for i, v in enumerate(values)}
    return np.array([index[v] for v in items], dtype=np.int64), values


def _group(s: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, Any]:
    """A group of sequences' loss tokens, sequences and k3 with its standard error."""
    T, k3 = s["T"][sel], s["k3"][sel]
    n = float(T.sum())
    mean = float(k3.sum()) / n if n else None
    return {
        "tokens": int(n),
        "sequences": int(np.count_nonzero(T)),
        "k3": mean,
        "k3_stderr": None if mean is None else _stderr(k3, T, mean),
    }


def _row(s: dict[str, np.ndarray], sel: np.ndarray) -> dict[str, Any]:
    """A value's row: `_group`, its steps, and its mean |d|, d and e^d and broken sequences."""
    group = _group(s, sel)
    n = float(group["tokens"])
    steps = np.unique(s["step"][sel])

    def mean(name: str) -> float | None:
        return float(s[name][sel].sum()) / n if n else None

    return {
        **group,
        "steps": int(steps.size),
        "first_step": int(steps[0]) if steps.size else None,
        "last_step": int(steps[-1]) if steps.size else None,
        "abs_diff_mean": mean("abs"),
        "d_mean": mean("S"),
        "ratio_mean": mean("rho"),
        "broken_sequences": int(s["broken"][sel].sum()) if "broken" in s else 0,
    }


def _stderr(k3: np.ndarray, T: np.ndarray, mean: float) -> float:
    """The standard error of a token mean over sequences (the ratio estimator's, from each
    sequence's sum `k3` over its `T` tokens)."""
    n = float(T.sum())
    return math.sqrt(float(((k3 - mean * T) ** 2).sum())) / n


def _sums(s: dict[str, np.ndarray], sel: np.ndarray) -> np.ndarray:
    """float64 [6]: sequences with loss tokens, loss tokens, sum k3, k3^2, k3 T, T^2."""
    T, k3 = s["T"][sel], s["k3"][sel]
    return np.array(
        [np.count_nonzero(T), T.sum(), k3.sum(), (k3 * k3).sum(), (k3 * T).sum(), (T * T).sum()],
        dtype=np.float64,
    )
