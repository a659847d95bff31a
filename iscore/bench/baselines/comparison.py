"""iscore beside the padded torch and the pandas baseline: whether they agree, and how fast each is.

>>> TOLERANCE["padded"] > TOLERANCE["pandas"]
True
"""

from __future__ import annotations

import math
from typing import Any

import iscore
from iscore.bench.base import Measured, Run, best, row
from iscore.bench.baselines import dataframe, implements, padded
from iscore.bench.data import subset
from iscore.dump import Dump, StepRange
from iscore.packed import TokenBatch
from iscore.passes import analyze

KEY_STATISTICS = ("weight_mean", "token_masked_fraction", "seq_masked_fraction", "lr_scale", "ess")
"""Per-setting statistics both baselines compute and are checked against."""

MISMATCH_STATISTICS = ("k3", "abs_diff_mean")
"""Mismatch statistics both baselines compute and are checked against."""

PANDAS_STATISTICS = {
    "mismatch": (
        *MISMATCH_STATISTICS,
        *("k3_reverse", "chi2_token", "chi2_seq", "token_mult_prob_error", "js", "ratio_mean"),
        *("ratio_mean_stderr", "d_var", "abs_diff_max", "log_ppl_diff", "log_ppl_abs_diff"),
        *("ppl_ratio", "training_ppl", "rollout_ppl", "d_rollout_correlation", "d_sign_fraction"),
        *("d_median_by_step", "d_spread_by_step", "broken_sequences", "span_sequences"),
    ),
    "settings": (
        *KEY_STATISTICS,
        *("weight_mean_seq", "token_rejected_fraction"),
        *("truncated_high_fraction", "truncated_low_fraction", "broken_gradient_kept"),
    ),
}
"""What the pandas baseline is also checked against: every overall statistic it computes, and
each step's noise (its `by_step` d_median and d_spread, value by value)."""

TOLERANCE = {"padded": 2e-3, "pandas": 1e-6}
"""Largest relative difference from iscore for a baseline to agree: the padded baseline works
in float32, like the frameworks (a few tokens or sequences at a threshold may flip); the pandas
one in float64, where iscore's weights are float32 (as the frameworks hand them to the loss)."""

PADDED_SLOTS = 2**26
"""Most [B, max_len] slots the padded baseline allocates (256 MB per float32 tensor)."""


def check(
    batch: TokenBatch, specs: list[Any], chunks: list[TokenBatch] | None = None
) -> dict[str, dict[str, Any]]:
    """How far each baseline's statistics are from iscore's on `batch`.

    Args:
        batch: the tokens, whole.
        specs: settings the baselines implement (`iscore.bench.baselines.implements`).
        chunks: the same tokens as iscore streams them; None analyzes `batch` whole.

    Returns:
        {"padded": ..., "pandas": ...}, each as `agreement` returns it.
    """
    engine = analyze(chunks or [batch], specs, device="cpu")
    steps = engine.mismatch.by_step
    mismatch = {
        **engine.mismatch.to_dict(),
        "d_median_by_step": [row["d_median"] for row in steps],
        "d_spread_by_step": [row["d_spread"] for row in steps],
        "span_sequences": sum(row["span_sequences"] for row in engine.attribution.by_step),
    }
    reference = {
        "mismatch": {k: mismatch[k] for k in PANDAS_STATISTICS["mismatch"]},
        "settings": [
            {k: s.to_dict()[k] for k in PANDAS_STATISTICS["settings"]} for s in engine.settings
        ],
    }
    return {
        "padded": agreement(
            padded.statistics(padded.pad(batch), specs), reference, TOLERANCE["padded"], specs
        ),
        "pandas": agreement(
            dataframe.statistics(dataframe.frame(batch), specs),
            reference,
            TOLERANCE["pandas"],
            specs,
            PANDAS_STATISTICS,
        ),
    }


def agreement(
    got: dict[str, Any],
    reference: dict[str, Any],
    tolerance: float,
    specs: list[Any],
    statistics: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """Largest relative difference of the `statistics` (default: the key ones) from iscore's;
    a statistic given as a list is compared value by value, one that is None (no broken
    sequences) must be None on both sides."""
    statistics = statistics or {"mismatch": MISMATCH_STATISTICS, "settings": KEY_STATISTICS}
    worst, where = 0.0, ""
    pairs = [
        (f"mismatch.{k}", got["mismatch"][k], reference["mismatch"][k])
        for k in statistics["mismatch"]
    ]
    for spec, g, r in zip(specs, got["settings"], reference["settings"], strict=True):
        name = f"{spec.framework}:{spec.name}"
        pairs += [(f"{name}.{k}", g[k], r[k]) for k in statistics["settings"]]
    named = len(pairs)
    pairs = [
        (f"{name}[{i}]", x, y)
        for name, a, b in pairs
        for i, (x, y) in enumerate(zip(a, b, strict=True) if isinstance(b, list) else [(a, b)])
    ]
    for name, a, b in pairs:
        if a is None or b is None:
            diff = 0.0 if a is b else math.inf
        else:
            a, b = float(a), float(b)
            diff = 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-12)
        if diff > worst or math.isnan(diff):
            worst, where = diff, name
    return {
        "max_rel_diff": worst,
        "worst": where,
        "tolerance": tolerance,
        "agrees": worst <= tolerance,
        "statistics": named,
    }


def baselines(run: Run) -> Measured:
    """iscore, the padded torch and the pandas implementation on the same whole steps (the
    result's `baselines` and `agreement`)."""
    run.say("running the padded and pandas baselines")
    steps, tokens, sequences = subset(run.path, run.baseline_tokens, PADDED_SLOTS)
    selected = StepRange(0, steps - 1)
    batch = iscore.load(run.path, steps=selected)
    chunks = list(
        Dump(run.path, steps=selected).batches(max_tokens=run.chunk_tokens, whole_steps=True)
    )
    supported = [s for s in run.specs if implements(s)]
    info: dict[str, Any] = {
        "note": f"the padded and pandas baselines run on the first {steps} steps ({tokens:,} "
        "tokens), beside iscore on the same chunks; ratios compare seconds per token",
        "steps": steps,
        "tokens": tokens,
        "sequences": sequences,
        "settings": [f"{s.framework}:{s.name}" for s in supported],
        "skipped_settings": [f"{s.framework}:{s.name}" for s in run.specs if s not in supported],
    }
    agreements = check(batch, supported, chunks)
    frame = dataframe.frame(batch)
    # iscore and pandas alternate, so that a slow spell of a shared machine slows both.
    engine_s = pandas_s = math.inf
    for _ in range(max(run.repeats, 1)):
        engine_s = min(engine_s, best(1, lambda: analyze(chunks, supported, device="cpu")))
        pandas_s = min(pandas_s, best(1, lambda: dataframe.statistics(frame, supported)))
    # The padding itself is not timed: a framework's trainer receives padded tensors.
    x = padded.pad(batch)
    padded_s = best(run.repeats, lambda: padded.statistics(x, supported))
    shape = list(x["rollout"].shape)
    info["padded_shape"] = shape
    info["padding_factor"] = shape[0] * shape[1] / max(tokens, 1)
    rows = (
        row(f"iscore on the baseline subset ({len(supported)} settings)", engine_s, tokens),
        {
            **row("padded [B, max_len] torch baseline", padded_s, tokens, "padded_speedup"),
            "speedup": padded_s / engine_s,
        },
        {
            **row("pandas groupby baseline", pandas_s, tokens, "pandas_speedup"),
            "speedup": pandas_s / engine_s,
        },
    )
    return Measured(rows=rows, entries={"baselines": info, "agreement": agreements})
