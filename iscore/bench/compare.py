"""`iscore diff` (docs/compare.md): two arms of up to `ARM_TOKENS` tokens each (consecutive
whole steps of the bench dump) compared through the settings, against one `analyze` of the
first arm."""

from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq

from iscore.bench.base import Measured, Run, best, row
from iscore.bench.data import subset
from iscore.dump import Dump, StepRange
from iscore.passes import analyze, diff

ARM_TOKENS = 10_000_000
"""At most this many tokens (whole steps) in each arm."""


def compared(run: Run) -> Measured:
    """The diff of the first steps against the next as many, and one analyze of the first."""
    steps, tokens, _ = subset(run.path, ARM_TOKENS)
    values = np.unique(pq.read_table(run.path, columns=["step"])["step"].to_numpy())
    if values.size < 2 * steps:
        steps = values.size // 2
    if steps == 0:
        run.say("skipping iscore diff: a dump of one step has no second arm")
        return Measured(entries={"diff": {"skipped": "a dump of one step has no second arm"}})
    first, second = values[:steps], values[steps : 2 * steps]
    arms = (
        StepRange(int(first[0]), int(first[-1])),
        StepRange(int(second[0]), int(second[-1])),
    )
    run.say(f"timing iscore diff of two arms of {steps} steps against one analyze")

    def arm(k: int) -> Dump:
        return Dump(run.path, steps=arms[k])

    analyze_s = best(run.repeats, lambda: analyze(arm(0), run.specs, max_tokens=run.chunk_tokens))
    diff_s = best(run.repeats, lambda: diff(arm(0), arm(1), run.specs, max_tokens=run.chunk_tokens))
    return Measured(
        rows=(
            row("diff: one arm analyzed", analyze_s, tokens),
            row("diff: two arms compared (1,000 resamples)", diff_s, tokens, "diff_vs_analyze"),
        ),
        entries={
            "diff": {"arm_steps": steps, "tokens": tokens, "analyze_s": analyze_s, "diff_s": diff_s}
        },
    )
