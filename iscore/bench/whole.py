"""The cost of the whole distribution (docs/distribution.md): the analysis of a simulated dump
with the engine's top-k columns at k = `K` against the same dump without them, and against that
plus pyarrow's read of the three columns alone (60 values a token, 30x the bytes of the two
log-probs): what no analysis of them can save."""

from __future__ import annotations

import math
import os
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

from iscore.bench.base import Measured, Run, row
from iscore.dump import TOPK_COLUMNS, SimConfig, write_simulated
from iscore.passes import analyze

K = 20
"""Top-k ids per token: vLLM's default cap on `logprobs` (`max_logprobs`)."""

TOKENS = 2_000_000
"""At most this many tokens in each copy."""

VOCAB = 32
"""The simulator's candidates per position: more than `K`."""


def topk_cost(run: Run) -> Measured:
    """Both copies (the same seed: every other column is the same) analyzed through the run's
    settings, the results store off, and the top-k columns read alone; the three timed in
    turn, each the best of `run.repeats` rounds, so that a slow spell slows all three."""
    tokens = min(run.tokens, TOKENS)
    run.say(f"timing the analysis with top-{K} columns against without, {tokens:,} tokens")
    config = {"sequences": 256, "median_len": 1000, "length_sigma": 0.5, "vocab": VOCAB}
    config["steps"] = max(1, tokens // 300_000)
    with tempfile.TemporaryDirectory(prefix="iscore-bench-") as tmp:
        plain, whole = Path(tmp) / "plain.parquet", Path(tmp) / "topk.parquet"
        truth = write_simulated(plain, SimConfig(**config))
        write_simulated(whole, SimConfig(**config, topk=K))
        os.sync()  # their pages written out: not timed with the reads

        def read() -> None:  # row group by row group: the fastest of pyarrow's reads here
            f = pq.ParquetFile(whole)
            for group in range(f.num_row_groups):
                f.read_row_group(group, columns=list(TOPK_COLUMNS))

        timed = {
            "plain_s": lambda: analyze(str(plain), run.specs, max_tokens=run.chunk_tokens),
            "topk_s": lambda: analyze(str(whole), run.specs, max_tokens=run.chunk_tokens),
            "columns_read_s": read,
        }
        fastest = dict.fromkeys(timed, math.inf)
        for _ in range(max(run.repeats, 1)):
            for name, fn in timed.items():
                start = time.perf_counter()
                fn()
                fastest[name] = min(fastest[name], time.perf_counter() - start)
    return Measured(
        rows=(
            row("whole distribution: without top-k columns", fastest["plain_s"], truth.tokens),
            row(
                f"whole distribution: with top-{K} columns",
                fastest["topk_s"],
                truth.tokens,
                "topk_vs_plain",
            ),
            row(
                f"whole distribution: the top-{K} columns read alone (pyarrow)",
                fastest["columns_read_s"],
                truth.tokens,
            ),
        ),
        entries={"topk": {"k": K, "tokens": truth.tokens, **fastest}},
    )
