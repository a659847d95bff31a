"""The cost of the whole distribution (docs/distribution.md): the analysis of a simulated dump
with the engine's top-k columns at k = `K` against the same dump without them."""

from __future__ import annotations

import tempfile
from pathlib import Path

from iscore.bench.base import Measured, Run, best, row
from iscore.dump import SimConfig, write_simulated
from iscore.passes import analyze

K = 20
"""Top-k ids per token: vLLM's default cap on `logprobs` (`max_logprobs`)."""

TOKENS = 2_000_000
"""At most this many tokens in each copy."""

VOCAB = 32
"""The simulator's candidates per position: more than `K`."""


def topk_cost(run: Run) -> Measured:
    """Both copies (the same seed: every other column is the same) analyzed through the run's
    settings, the results store off."""
    tokens = min(run.tokens, TOKENS)
    run.say(f"timing the analysis with top-{K} columns against without, {tokens:,} tokens")
    config = {"sequences": 256, "median_len": 1000, "length_sigma": 0.5, "vocab": VOCAB}
    config["steps"] = max(1, tokens // 300_000)
    with tempfile.TemporaryDirectory(prefix="iscore-bench-") as tmp:
        plain, whole = Path(tmp) / "plain.parquet", Path(tmp) / "topk.parquet"
        truth = write_simulated(plain, SimConfig(**config))
        write_simulated(whole, SimConfig(**config, topk=K))

        def timed(path: Path) -> float:
            return best(
                run.repeats, lambda: analyze(str(path), run.specs, max_tokens=run.chunk_tokens)
            )

        plain_s, whole_s = timed(plain), timed(whole)
    return Measured(
        rows=(
            row("whole distribution: without top-k columns", plain_s, truth.tokens),
            row(
                f"whole distribution: with top-{K} columns", whole_s, truth.tokens, "topk_vs_plain"
            ),
        ),
        entries={"topk": {"k": K, "tokens": truth.tokens, "plain_s": plain_s, "topk_s": whole_s}},
    )
