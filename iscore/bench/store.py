"""The results store on one large dump (docs/runs.md#the-results-store): what it costs the
first analyze, what it saves the second, and how large its entry is against the dump; and a
dump whose steps interleave row by row against the same dump sorted by step.

The interleaved dump is the issue users met: a concatenation of ranks' outputs, or any writer
that does not sort by step. It is made of whole steps of the bench dump (up to
`INTERLEAVED_TOKENS` tokens), each sequence's step renumbered `k % INTERLEAVED_STEPS` (k its
place in the file) and its rows left contiguous; the sorted copy holds the same sequences
sorted by that step, written the same way.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from iscore.bench.base import COLUMNS, Measured, Run, best, row
from iscore.bench.data import subset
from iscore.passes import ResultStore, analyze

INTERLEAVED_STEPS = 8
"""Steps of the interleaved dump (`step = k % 8`, as the user's dump that met it)."""

INTERLEAVED_TOKENS = 8_000_000
"""At most this many tokens (whole steps of the bench dump) in the interleaved dump."""

ROW_GROUP_ROWS = 1 << 20
"""Rows per row group of both copies (the same for each, so that only the order differs)."""


def store(run: Run) -> Measured:
    """Analyze with no store, through an empty one (first) and from the filled one
    (second), on the bench dump; then the interleaved and sorted copies with no store, and
    each one's entry against its size."""
    run.say("timing the results store: first and second analyze, its entries' size")

    def analyzed(path: Path, cache: Path | None) -> None:
        store = None if cache is None else ResultStore(cache)
        analyze(path, run.specs, max_tokens=run.chunk_tokens, device="cpu", store=store)

    with tempfile.TemporaryDirectory(prefix="iscore-bench-store-") as tmp:
        root = Path(tmp)
        none_s = best(run.repeats, lambda: analyzed(run.path, None))
        first_s = best(run.repeats, lambda: analyzed(run.path, _empty(root / "first")))
        analyzed(run.path, root / "kept")
        second_s = best(run.repeats, lambda: analyzed(run.path, root / "kept"))
        sorted_path, interleaved_path, tokens = _copies(run.path, root)
        sorted_s = best(run.repeats, lambda: analyzed(sorted_path, None))
        interleaved_s = best(run.repeats, lambda: analyzed(interleaved_path, None))
        sizes = {}
        for name, path in (("bench", run.path), ("interleaved", interleaved_path)):
            cache = _empty(root / f"size-{name}")
            analyzed(path, cache)
            sizes[name] = {"dump": path.stat().st_size, "entries": ResultStore(cache).size()}
    return Measured(
        rows=(
            row("store: analyze, no store", none_s, run.tokens),
            row("store: first analyze, empty store", first_s, run.tokens, "store_first_vs_none"),
            row("store: second analyze, from it", second_s, run.tokens, "store_second_vs_first"),
            row("interleaved steps: analyze", interleaved_s, tokens, "interleaved_vs_sorted"),
            row("the same sorted by step: analyze", sorted_s, tokens),
        ),
        entries={
            "store": {
                "none_s": none_s,
                "first_s": first_s,
                "second_s": second_s,
                "sorted_s": sorted_s,
                "interleaved_s": interleaved_s,
                "interleaved_tokens": tokens,
                "interleaved_steps": INTERLEAVED_STEPS,
                "sizes": sizes,
            }
        },
    )


def _empty(folder: Path) -> Path:
    """`folder`, emptied of a store (each timing of a first analyze starts from none)."""
    ResultStore(folder).clear()
    return folder


def _copies(path: Path, root: Path) -> tuple[Path, Path, int]:
    """The sorted and the interleaved copy of whole steps of `path` (see the module
    docstring), written under `root`, and their tokens."""
    steps, tokens, _ = subset(path, INTERLEAVED_TOKENS)
    table = pq.read_table(path, columns=list(COLUMNS))
    table = table.filter(
        pc.is_in(table["step"], pa.array(np.unique(table["step"].to_numpy())[:steps]))
    )
    step = table["step"].to_numpy()
    seq = table["seq_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (seq[1:] != seq[:-1])])
    lengths = np.diff(np.r_[starts, step.size])
    renumbered = np.arange(starts.size) % INTERLEAVED_STEPS
    table = table.set_column(0, "step", pa.array(np.repeat(renumbered, lengths)))
    # Each sequence its own id: a renumbered step may gather two of one id from two steps.
    ids = pa.array(np.repeat(np.arange(starts.size), lengths)).cast(
        table.schema.field("seq_id").type
    )
    table = table.set_column(1, "seq_id", ids)
    # The sorted copy: the same sequences, each step's in their order in the file.
    order = np.argsort(renumbered, kind="stable")
    rows = np.concatenate([np.arange(starts[k], starts[k] + lengths[k]) for k in order])
    out = root / "sorted.parquet", root / "interleaved.parquet"
    pq.write_table(table.take(rows), out[0], row_group_size=ROW_GROUP_ROWS, compression="zstd")
    pq.write_table(table, out[1], row_group_size=ROW_GROUP_ROWS, compression="zstd")
    return out[0], out[1], tokens
