"""The bench dump: simulated (or reused), described, and cut into prefixes of whole steps.

>>> config = SimConfig(REGIME)
>>> 300 < mean_length(config) < 3000
True
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq

from iscore.dump import SimConfig, write_simulated

REGIME = "moe_routing"
"""Simulated regime: bf16-level noise plus routing-flip spans, so every setting acts."""


@contextmanager
def location(path: str | Path | None) -> Iterator[tuple[Path, bool]]:
    """(where the dump is or goes, whether that is a temporary directory deleted on exit)."""
    if path is not None:
        yield Path(path), False
        return
    tmp = Path(tempfile.mkdtemp(prefix="iscore-bench-"))
    try:
        yield tmp / "bench.parquet", True
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(path: Path, tokens: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Reuse `path` if it exists, else simulate ~`tokens` tokens there (token layout, zstd);
    then describe it (the result's `dump`)."""
    generated_s = None
    if not path.exists():
        mean = mean_length(SimConfig(REGIME))
        sequences = int(min(256, max(8, round(tokens / mean))))
        steps = max(1, round(tokens / (sequences * mean)))
        config = SimConfig(REGIME, sequences=sequences, steps=steps, seed=0)
        say(f"simulating {steps} steps x {sequences} sequences ({REGIME}) to {path}")
        start = time.perf_counter()
        write_simulated(path, config, layout="token")
        generated_s = time.perf_counter() - start
    meta = pq.ParquetFile(path).metadata
    lengths = _lengths(path)
    return {
        "path": str(path),
        "layout": "token",
        "compression": "zstd",
        "regime": REGIME,
        "tokens": int(lengths.sum()),
        "sequences": int(lengths.size),
        "steps": meta.num_row_groups,
        "bytes": path.stat().st_size,
        "length_median": float(np.median(lengths)),
        "length_mean": float(lengths.mean()),
        "length_p99": float(np.quantile(lengths, 0.99)),
        "length_max": int(lengths.max()),
        "generated_s": generated_s,
    }


def mean_length(config: SimConfig) -> float:
    """Expected sequence length of `config` (its clipped log-normal), by Monte Carlo."""
    rng = np.random.default_rng(1)
    raw = config.median_len * np.exp(config.length_sigma * rng.standard_normal(200_000))
    return float(np.clip(np.rint(raw), config.min_len, config.max_len).mean())


def subset(path: Path, budget: int, slots: int | None = None) -> tuple[int, int, int]:
    """(steps, tokens, sequences) of the longest prefix of whole steps within `budget`
    tokens and, if given, `slots` padded slots [B, max_len] (at least one step)."""
    table = pq.read_table(path, columns=["step", "seq_id"])
    step = table["step"].to_numpy()
    starts = _starts(step, table["seq_id"].to_numpy())
    lengths = np.diff(np.r_[starts, step.size])
    seq_step = step[starts]
    first = seq_step == seq_step[0]
    best = (1, int(lengths[first].sum()), int(first.sum()))
    for k, s in enumerate(np.unique(seq_step), start=1):
        sel = seq_step <= s
        n, b, longest = int(lengths[sel].sum()), int(sel.sum()), int(lengths[sel].max())
        if k > 1 and (n > budget or (slots is not None and b * longest > slots)):
            break
        best = (k, n, b)
    return best


def _lengths(path: Path) -> np.ndarray:
    """Sequence lengths of a token-layout dump, from its (step, seq_id) runs."""
    table = pq.read_table(path, columns=["step", "seq_id"])
    step = table["step"].to_numpy()
    return np.diff(np.r_[_starts(step, table["seq_id"].to_numpy()), step.size])


def _starts(step: np.ndarray, seq: np.ndarray) -> np.ndarray:
    """Row numbers where a (step, seq_id) run begins."""
    return np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (seq[1:] != seq[:-1])])
