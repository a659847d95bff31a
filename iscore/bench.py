"""`iscore bench`: how fast iscore replays and summarizes a dump, against what it replaces.

`run_bench` simulates a long-tailed dump (or reuses one), then times, on this machine:

- `read`: pyarrow reading the columns iscore needs (the floor any tool pays);
- `load`: `iscore.load` of the whole dump;
- `analyze, streamed`: `iscore.analysis` of the dump from disk with the settings (read,
  replay, every statistic), the headline number;
- `analyze, resident` and `replay only, resident`: the same on chunks already in memory;
- `marginal`: what the second half of the dump's steps adds to `analyze` against what it adds
  to the pyarrow read, in fresh processes (imports and first-chunk costs cancel out);
- `padded baseline` and `pandas baseline`: the same corrections written the way the frameworks
  (float32 tensors padded to [B, max_len], the key statistics) and a dataframe user (groupby,
  every statistic `analyze` reports) would, on a subset of whole steps, beside iscore on the
  same subset; both are checked to agree with iscore (pandas on every overall statistic);
- `tune`: building a `Tuner` on up to 10M tokens and 1000 random threshold queries;
- `app`: the dashboard's interactions through its `Workspace` on up to 10M tokens: opening
  the dump, the mismatch diagnostics, the recommendation, the first setting and each one
  added after it, opening Tune (its statistics and slider grid) and a slider query under
  the framework's loss aggregation;
- `startup`: fresh processes running `iscore --help`, `iscore presets` and `iscore validate`
  of a small dump, and importing the engine;
- peak memory (fresh subprocesses): streaming the whole dump, streaming a quarter of it, and
  loading it whole;
- with CUDA: the replay of the settings on chunks resident on the GPU, and including the
  host-to-device copies.

Each time is the best of `repeats` runs (the machine may be shared). The result is a dict
(JSON-ready); `format_table` renders its table. Ratios compare seconds per token.

>>> result = run_bench(tokens=50_000, repeats=1, memory=False)  # doctest: +SKIP
>>> print(format_table(result))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import math
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import torch

import iscore
from iscore import ops
from iscore.analysis import analyze
from iscore.batch import TokenBatch
from iscore.dump import DEFAULT_CHUNK_TOKENS, Dump, StepRange
from iscore.errors import ConfigError, quote
from iscore.histogram import BINS_PER_DECADE, LOG10_RANGE
from iscore.impact import TRUNCATION_TOLERANCE, aggregation_of
from iscore.mismatch import TOP_K
from iscore.output import output_path
from iscore.recommendation import Targets
from iscore.settings import Setting, resolve
from iscore.simulate import SimConfig, write_simulated
from iscore.tune import Tuner, query
from iscore.workspace import Workspace
from iscore.writer import DumpWriter

SETTINGS = (
    "verl:decoupled_geo_rs_token_tis",
    "skyrl:skyrl_tldr_stack",
    "nemo_rl:nemo_icepop",
    "slime:slime_mis_example",
    "areal:areal_sequence_geo_mask",
    "openrlhf:openrlhf_icepop",
    "trl:trl_default",
    "fireworks:fireworks_default",
)
"""One preset of each of the 8 frameworks: token and sequence truncation, masks, IcePop bands,
rejection sampling and batch normalization between them."""

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
    ),
    "settings": (
        *KEY_STATISTICS,
        *("weight_mean_seq", "token_rejected_fraction"),
        *("truncated_high_fraction", "truncated_low_fraction"),
    ),
}
"""What the pandas baseline is also checked against: every overall statistic it computes."""

REGIME = "moe_routing"
"""Simulated regime: bf16-level noise plus routing-flip spans, so every setting acts."""

TOLERANCE = {"padded": 2e-3, "pandas": 1e-6}
"""Largest relative difference from iscore for a baseline to agree: the padded baseline works
in float32, like the frameworks (a few tokens or sequences at a threshold may flip); the pandas
one in float64, where iscore's weights are float32 (as the frameworks hand them to the loss)."""

GOALS = {
    "e2e_vs_read": 2.0,
    "marginal_vs_read": 2.0,
    "padded_speedup": 5.0,
    "pandas_speedup": 10.0,
    "tune_query_p99_s": 0.05,
    "cuda_resident_tok_s": 1e9,
    "app_add_setting_s": 1.0,
    "app_tune_open_s": 3.0,
    "app_slider_p50_s": 0.05,
    "writer_vs_step": 0.02,
}

_PADDED_SLOTS = 2**26
"""Most [B, max_len] slots the padded baseline allocates (256 MB per float32 tensor)."""

_COLUMNS = ("step", "seq_id", "pos", "rollout_logprob", "train_logprob", "loss_mask")
"""What `Dump` reads of a token-layout dump without policy log-probs."""


def run_bench(
    tokens: int = 50_000_000,
    settings: Sequence[Setting] = SETTINGS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | None = None,
    path: str | Path | None = None,
    *,
    baseline_tokens: int = 2_000_000,
    tune_tokens: int = 10_000_000,
    queries: int = 1000,
    repeats: int = 2,
    marginal_repeats: int = 5,
    memory: bool = True,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time iscore against pyarrow, a padded torch and a pandas implementation.

    Args:
        tokens: size of the simulated dump (about; whole sequences and steps).
        settings: what to replay (presets, specs, configs); the baselines implement the
            default `SETTINGS` only and skip the others.
        chunk_tokens: tokens per streamed chunk.
        device: "cpu" for CPU only; "cuda" or None add the CUDA rows when CUDA is available.
        path: a dump to reuse if it exists, else where to write the simulated one (kept);
            None writes it to a temporary directory deleted afterwards.
        baseline_tokens: at most this many tokens (whole steps) for the padded and pandas
            baselines and iscore beside them; fewer if [B, max_len] would exceed 2^26 slots.
        tune_tokens: tokens (whole steps) the `Tuner` is built on.
        queries: random Tuner queries timed.
        repeats: runs per timing (the best is kept).
        marginal_repeats: fresh processes per marginal timing (the best is kept).
        memory: measure peak RSS in subprocesses (several extra passes over the dump).
        log: called with a line of progress for each stage.

    Returns:
        A JSON-ready dict: `machine`, `dump`, `rows` (the table), `goals`, `agreement`,
        `memory`, `marginal`, `tune`, `app`, `startup`, `cuda`.

    Raises:
        ConfigError: `tokens` < 1000, or `device` is neither None, "cpu" nor "cuda".
    """
    if tokens < 1000:
        raise ConfigError(f"Expected argument `tokens` to be an int >= 1000, but got {tokens}")
    if device not in (None, "cpu", "cuda"):
        raise ConfigError(
            f"Expected argument `device` to be 'cpu' or 'cuda', but got {quote(device)}"
        )
    say = log or (lambda line: None)
    specs = [resolve(s) for s in settings]
    names = [f"{s.framework}:{s.name}" for s in specs]
    started = time.perf_counter()
    result: dict[str, Any] = {
        "schema": "iscore.bench",
        "schema_version": 1,
        "machine": _machine(),
        "settings": names,
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
    }
    tmp = None
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="iscore-bench-"))
        dump_path = tmp / "bench.parquet"
    else:
        dump_path = Path(path)
    try:
        result["dump"] = _dump(dump_path, tokens, say)
        if tmp is not None:
            result["dump"]["path"] = "(temporary, deleted)"
        rows: list[dict[str, Any]] = []
        n = result["dump"]["tokens"]

        say("timing the pyarrow read")
        read_s = _best(repeats, lambda: pq.read_table(dump_path, columns=list(_COLUMNS)))
        rows.append(_row("read (pyarrow, needed columns)", read_s, n))
        say("timing iscore.load")
        rows.append(_row("load (iscore.load)", _best(repeats, lambda: iscore.load(dump_path)), n))

        say("timing analyze streamed from disk")
        streamed = _best(
            repeats,
            lambda: analyze(dump_path, specs, max_tokens=chunk_tokens, device="cpu"),
        )
        rows.append(_row(f"analyze, streamed ({len(specs)} settings)", streamed, n, "e2e_vs_read"))

        say("timing the marginal analyze and read in fresh processes")
        result["marginal"] = _marginal(dump_path, specs, chunk_tokens, marginal_repeats)

        say("timing analyze and replay on resident chunks")
        rows += _resident(dump_path, specs, chunk_tokens, repeats, n)

        say("running the padded and pandas baselines")
        baselines = _baselines(dump_path, specs, chunk_tokens, baseline_tokens, repeats)
        result["baselines"] = baselines["info"]
        result["agreement"] = baselines["agreement"]
        rows += baselines["rows"]

        say("timing the Tuner")
        result["tune"] = _tune(dump_path, tune_tokens, queries, repeats)
        rows.append(_row("tune: build", result["tune"]["build_s"], result["tune"]["tokens"]))
        rows.append(
            _row(
                "tune: query p99",
                result["tune"]["query_p99_s"],
                None,
                "tune_query_p99_s",
            )
        )

        say("timing the app's interactions through its workspace")
        result["app"] = _app(dump_path, tune_tokens, specs, repeats)
        app = result["app"]
        rows += [
            _row("app: open the dump", app["open_s"], app["tokens"]),
            _row("app: mismatch diagnostics", app["mismatch_s"], app["tokens"]),
            _row("app: recommend (verl)", app["recommend_s"], app["tokens"]),
            _row("app: first setting", app["first_setting_s"], app["tokens"]),
            _row("app: open Tune", app["tune_open_s"], app["tokens"], "app_tune_open_s"),
            _row("app: Tune slider p50", app["slider_p50_s"], None, "app_slider_p50_s"),
        ]
        if app["add_setting_max_s"] is not None:  # with two settings or more
            slowest = app["add_setting_max_s"]
            rows.append(_row("app: add a setting, slowest", slowest, None, "app_add_setting_s"))
        say("timing start-up in fresh processes")
        result["startup"] = _startup(repeats)
        rows += [
            _row("start-up: iscore --help", result["startup"]["help_s"], None),
            _row("start-up: iscore presets", result["startup"]["presets_s"], None),
            _row(
                "start-up: iscore validate (100 sequences)", result["startup"]["validate_s"], None
            ),
            _row("start-up: import the engine", result["startup"]["import_engine_s"], None),
        ]

        say("timing the dump writer inside a training step")
        result["writer"] = _writer_cost(min(tokens, 1_000_000), max(repeats, 3))
        rows += result["writer"].pop("rows")

        result["memory"] = _memory(dump_path, specs, chunk_tokens, say) if memory else None
        result["cuda"] = _cuda(dump_path, specs, chunk_tokens, device, repeats, say)
        rows += result["cuda"].pop("rows", [])
        for row in rows:
            tok = row["tokens"]
            row["ratio_vs_read"] = (
                row["seconds"] / tok / (read_s / n) if tok and row["seconds"] else None
            )
        result["rows"] = rows
        result["goals"] = [*_goals(result), result["writer"].pop("goal")]
        for row in rows:
            row["met"] = next(
                (g["met"] for g in result["goals"] if g["id"] == row.get("goal")), None
            )
        result["total_s"] = time.perf_counter() - started
        result["machine"]["loadavg_end"] = _loadavg()
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def format_table(result: dict[str, Any]) -> str:
    """The bench result as a fixed-width table, then the goals with their gaps."""
    header = f"{'name':44s} {'seconds':>10s} {'Mtok/s':>9s} {'x read':>8s}  {'goal':>10s}  met"
    lines = [header, "-" * len(header)]
    for row in result["rows"]:
        mtok = f"{row['mtok_s']:9.1f}" if row.get("mtok_s") else f"{'':9s}"
        ratio = f"{row['ratio_vs_read']:8.2f}" if row.get("ratio_vs_read") else f"{'':8s}"
        goal = row.get("goal_text") or ""
        met = {True: "yes", False: "NO", None: ""}[row.get("met")]
        lines.append(f"{row['name']:44s} {row['seconds']:10.4f} {mtok} {ratio}  {goal:>10s}  {met}")
    lines.append("")
    for goal in result["goals"]:
        status = {True: "met", False: "NOT met", None: "not measured"}[goal["met"]]
        measured = goal["measured"] if goal["measured"] is not None else "skipped in this run"
        lines.append(f"[{status}] {goal['goal']}: {measured}")
        if goal.get("gap"):
            lines.append(f"    gap: {goal['gap']}")
    for name, agreement in (result.get("agreement") or {}).items():
        lines.append(
            f"agreement {name}: max relative difference {agreement['max_rel_diff']:.2e} "
            f"({agreement['worst']}), tolerance {agreement['tolerance']:g}: "
            f"{'agrees' if agreement['agrees'] else 'DISAGREES'}"
        )
    if result.get("baselines"):
        lines.append(result["baselines"]["note"])
    d = result["dump"]
    lines.append(
        f"dump: {d['tokens']:,} tokens, {d['sequences']:,} sequences, {d['steps']} steps, "
        f"{d['layout']} layout, zstd, {d['bytes'] / 1e6:.0f} MB; lengths median "
        f"{d['length_median']:.0f}, p99 {d['length_p99']:.0f}, max {d['length_max']}"
    )
    m = result["machine"]
    lines.append(
        f"machine: {m['cpus']} CPUs, torch threads {m['torch_threads']}, load average "
        f"{m['loadavg_start']} -> {m['loadavg_end']}"
    )
    return "\n".join(lines)


def write_json(result: dict[str, Any], path: str | Path) -> None:
    """Write the bench result as JSON (NaN and infinities as null)."""
    text = json.dumps(_clean(result), indent=1, allow_nan=False) + "\n"
    with output_path(path) as tmp:
        Path(tmp).write_text(text)


# ---------------------------------------------------------------------------------------------
# Stages


def _dump(path: Path, tokens: int, say: Callable[[str], None]) -> dict[str, Any]:
    """Reuse `path` if it exists, else simulate ~`tokens` tokens there (token layout, zstd)."""
    generated_s = None
    if not path.exists():
        mean = _mean_length(SimConfig(REGIME))
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


def _mean_length(config: SimConfig) -> float:
    """Expected sequence length of `config` (its clipped log-normal), by Monte Carlo."""
    rng = np.random.default_rng(1)
    raw = config.median_len * np.exp(config.length_sigma * rng.standard_normal(200_000))
    return float(np.clip(np.rint(raw), config.min_len, config.max_len).mean())


def _lengths(path: Path) -> np.ndarray:
    """Sequence lengths of a token-layout dump, from its (step, seq_id) runs."""
    table = pq.read_table(path, columns=["step", "seq_id"])
    step = table["step"].to_numpy()
    seq = table["seq_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (seq[1:] != seq[:-1])])
    return np.diff(np.r_[starts, step.size])


def _resident(
    path: Path, specs: list[Any], chunk_tokens: int, repeats: int, n: int
) -> list[dict[str, Any]]:
    """analyze and the replays alone on the dump's chunks already in memory (no I/O)."""
    chunks = list(Dump(path).batches(max_tokens=chunk_tokens, whole_steps=True))
    analyze_s = _best(repeats, lambda: analyze(chunks, specs, device="cpu"))
    replay_s = _best(repeats, _replays(chunks, specs))
    return [
        _row("analyze, resident chunks", analyze_s, n),
        _row("replay only, resident chunks", replay_s, n),
    ]


def _replays(chunks: list[TokenBatch], specs: list[Any]) -> Callable[[], None]:
    def run() -> None:
        for chunk in chunks:
            with ops.shared(chunk):
                for spec in specs:
                    spec.replay(chunk)

    return run


def _baselines(
    path: Path, specs: list[Any], chunk_tokens: int, budget: int, repeats: int
) -> dict[str, Any]:
    """iscore, the padded torch and the pandas implementation on the same whole steps."""
    steps, tokens, sequences = _subset(path, budget, _PADDED_SLOTS)
    selected = StepRange(0, steps - 1)
    batch = iscore.load(path, steps=selected)
    chunks = list(Dump(path, steps=selected).batches(max_tokens=chunk_tokens, whole_steps=True))
    supported = [s for s in specs if f"{s.framework}:{s.name}" in _BASELINES]
    info: dict[str, Any] = {
        "note": f"the padded and pandas baselines run on the first {steps} steps ({tokens:,} "
        "tokens), beside iscore on the same chunks; ratios compare seconds per token",
        "steps": steps,
        "tokens": tokens,
        "sequences": sequences,
        "settings": [f"{s.framework}:{s.name}" for s in supported],
        "skipped_settings": [f"{s.framework}:{s.name}" for s in specs if s not in supported],
    }
    engine = analyze(chunks, supported, device="cpu")
    reference = {
        "mismatch": {k: engine.mismatch[k] for k in PANDAS_STATISTICS["mismatch"]},
        "settings": [{k: s[k] for k in PANDAS_STATISTICS["settings"]} for s in engine.settings],
    }
    frame = _frame(batch)
    pandas_result = _pandas(frame, supported)
    # iscore and pandas alternate, so that a slow spell of a shared machine slows both.
    engine_s = pandas_s = math.inf
    for _ in range(max(repeats, 1)):
        engine_s = min(engine_s, _best(1, lambda: analyze(chunks, supported, device="cpu")))
        pandas_s = min(pandas_s, _best(1, lambda: _pandas(frame, supported)))
    padded_s, padded, shape = _time_padded(batch, supported, repeats)
    info["padded_shape"] = shape
    info["padding_factor"] = shape[0] * shape[1] / max(tokens, 1)
    rows = [
        _row(f"iscore on the baseline subset ({len(supported)} settings)", engine_s, tokens),
        _row("padded [B, max_len] torch baseline", padded_s, tokens, "padded_speedup"),
        _row("pandas groupby baseline", pandas_s, tokens, "pandas_speedup"),
    ]
    rows[1]["speedup"] = padded_s / engine_s
    rows[2]["speedup"] = pandas_s / engine_s
    return {
        "info": info,
        "rows": rows,
        "agreement": {
            "padded": _agreement(padded, reference, TOLERANCE["padded"], supported),
            "pandas": _agreement(
                pandas_result, reference, TOLERANCE["pandas"], supported, PANDAS_STATISTICS
            ),
        },
    }


def _time_padded(
    batch: TokenBatch, specs: list[Any], repeats: int
) -> tuple[float, dict[str, Any], list[int]]:
    """Seconds and statistics of the padded baseline (the padding itself is not timed: a
    framework's trainer receives padded tensors)."""
    padded = _pad(batch)
    seconds = _best(repeats, lambda: _padded(padded, specs))
    return seconds, _padded(padded, specs), list(padded["rollout"].shape)


def _subset(path: Path, budget: int, slots: int | None = None) -> tuple[int, int, int]:
    """(steps, tokens, sequences) of the longest prefix of whole steps within `budget`
    tokens and, if given, `slots` padded slots [B, max_len] (at least one step)."""
    table = pq.read_table(path, columns=["step", "seq_id"])
    step = table["step"].to_numpy()
    seq = table["seq_id"].to_numpy()
    starts = np.flatnonzero(np.r_[True, (step[1:] != step[:-1]) | (seq[1:] != seq[:-1])])
    lengths = np.diff(np.r_[starts, step.size])
    seq_step = step[starts]
    best = (1, int(lengths[seq_step == seq_step[0]].sum()), int((seq_step == seq_step[0]).sum()))
    for k, s in enumerate(np.unique(seq_step), start=1):
        sel = seq_step <= s
        n, b, longest = int(lengths[sel].sum()), int(sel.sum()), int(lengths[sel].max())
        if k > 1 and (n > budget or (slots is not None and b * longest > slots)):
            break
        best = (k, n, b)
    return best


def _tune(path: Path, budget: int, queries: int, repeats: int) -> dict[str, Any]:
    """Build a Tuner on up to `budget` tokens of whole steps, then time random queries."""
    steps, tokens, _ = _subset(path, budget)
    batch = iscore.load(path, steps=StepRange(0, steps - 1))
    build_s = _best(repeats, lambda: Tuner(batch))
    tuner = Tuner(batch)
    rng = np.random.default_rng(0)
    families: list[Callable[[], Any]] = [
        lambda: tuner.token_tis(float(rng.uniform(1.05, 5.0))),
        lambda: tuner.icepop(float(rng.uniform(0.1, 0.9)), float(rng.uniform(1.1, 10.0))),
        lambda: tuner.seq_tis(float(rng.uniform(1.0, 10.0))),
        lambda: tuner.geometric_mask(
            float(rng.uniform(0.99, 0.9999)), float(rng.uniform(1.0001, 1.01))
        ),
        lambda: tuner.product_mask(float(rng.uniform(0.01, 0.9)), float(rng.uniform(1.1, 100))),
        lambda: tuner.k3_mask(float(10 ** rng.uniform(-5, -1))),
    ]
    times = []
    for i in range(queries):
        query = families[i % len(families)]
        start = time.perf_counter()
        query()
        times.append(time.perf_counter() - start)
    t = np.array(times)
    return {
        "tokens": tokens,
        "sequences": batch.num_sequences,
        "build_s": build_s,
        "queries": queries,
        "query_p50_s": float(np.quantile(t, 0.5)),
        "query_p99_s": float(np.quantile(t, 0.99)),
        "query_max_s": float(t.max()),
    }


def _app(path: Path, budget: int, specs: list[Any], repeats: int) -> dict[str, Any]:
    """The dashboard's interactions through a `Workspace` of up to `budget` tokens (whole
    steps), each timed on a fresh workspace `repeats` times (the best kept): a workspace
    memoizes, so only a first call is an interaction's cost."""
    steps, tokens, _ = _subset(path, budget)
    family, framework = "token_tis", "verl"
    best: dict[str, float] = {}
    added: list[float] = []
    for _ in range(max(repeats, 1)):
        times: dict[str, float] = {}

        def timed(key: str, fn: Callable[[], Any], times: dict[str, float] = times) -> Any:
            start = time.perf_counter()
            value = fn()
            times[key] = time.perf_counter() - start
            return value

        dump = Dump(path, steps=StepRange(0, steps - 1), extras=True)
        ws = timed("open_s", lambda dump=dump: Workspace.from_dump(dump))
        timed("mismatch_s", ws.mismatch)
        timed("recommend_s", lambda ws=ws: ws.recommend(framework, Targets()))
        timed("first_setting_s", lambda ws=ws: ws.setting(specs[0]))
        run = []
        for spec in specs[1:]:
            start = time.perf_counter()
            ws.setting(spec)
            run.append(time.perf_counter() - start)
        values = timed("tune_open_s", lambda ws=ws: ws.grid(family))
        tuner = ws.tuner()
        slider = []
        for point in values["upper"]:
            start = time.perf_counter()
            query(tuner, family, [point], framework)
            slider.append(time.perf_counter() - start)
        times["slider_p50_s"] = float(np.median(slider))
        times["slider_max_s"] = float(np.max(slider))
        for key, value in times.items():
            best[key] = min(best.get(key, math.inf), value)
        if not added or max(run) < max(added):
            added = run
    return {
        "tokens": tokens,
        "steps": steps,
        **best,
        "add_setting_p50_s": float(np.median(added)) if added else None,
        "add_setting_max_s": float(np.max(added)) if added else None,
        "settings_added": len(added),
        "slider_points": len(values["upper"]),
    }


_MARGINAL_SCRIPT = """
import sys, time
import pyarrow.parquet as pq
from iscore.analysis import analyze
from iscore.dump import Dump, StepRange
mode, path, chunk, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
columns, settings = sys.argv[5].split(","), sys.argv[6:]
start = time.perf_counter()
if mode == "read":  # the row groups of those steps (a simulated dump has one per step)
    f = pq.ParquetFile(path)
    step = f.schema_arrow.get_field_index("step")
    groups = range(f.num_row_groups)
    f.read_row_groups(
        [g for g in groups if f.metadata.row_group(g).column(step).statistics.max < steps],
        columns=columns,
    )
else:
    analyze(Dump(path, steps=StepRange(0, steps - 1)), settings, max_tokens=chunk, device="cpu")
print(time.perf_counter() - start)
"""


def _marginal(path: Path, specs: list[Any], chunk_tokens: int, repeats: int) -> dict[str, Any]:
    """Seconds to read and to analyze the first half of the steps and all of them, each the
    best of `repeats` fresh processes (timed after the imports); the marginal ratio is what
    the second half adds to analyze over what it adds to the read. The read decodes those
    steps' row groups: a `filters=` read also filters and copies every row, which varied from
    0.3 to 0.8 s between runs at 19.5M tokens and made the ratio anything from 2.6x to 11x."""
    step = pq.read_table(path, columns=["step"])["step"].to_numpy()
    steps = int(step.max()) + 1  # the simulated dump's steps are 0, 1, ...
    half = steps // 2
    tokens = {k: int((step < k).sum()) for k in (half, steps)}
    if half == 0:
        return {"steps": steps, "tokens": tokens[steps], "repeats": repeats, "ratio": None}
    names = [f"{s.framework}:{s.name}" for s in specs]
    env = {
        **os.environ,
        "PYTHONPATH": _package_root() + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    seconds: dict[str, dict[int, float]] = {"read": {}, "analyze": {}}
    for mode, k in ((m, k) for m in seconds for k in (half, steps)):
        argv = [sys.executable, "-c", _MARGINAL_SCRIPT, mode, str(path), str(chunk_tokens)]
        argv += [str(k), ",".join(_COLUMNS), *names]
        runs = [
            float(subprocess.run(argv, capture_output=True, text=True, env=env, check=True).stdout)
            for _ in range(max(repeats, 1))
        ]
        seconds[mode][k] = min(runs)
    extra = {mode: seconds[mode][steps] - seconds[mode][half] for mode in seconds}
    return {
        "steps": steps,
        "half_steps": half,
        "tokens": tokens[steps],
        "half_tokens": tokens[half],
        "repeats": repeats,
        "read_s": {"half": seconds["read"][half], "all": seconds["read"][steps]},
        "analyze_s": {"half": seconds["analyze"][half], "all": seconds["analyze"][steps]},
        "ratio": extra["analyze"] / extra["read"] if extra["read"] > 0 else None,
    }


def _startup(repeats: int) -> dict[str, float]:
    """Seconds for fresh processes to answer `iscore --help`, `iscore presets` and `iscore
    validate` of a small dump (100 sequences), and to import the engine."""

    def run(*args: str) -> float:
        return _best(
            repeats,
            lambda: subprocess.run(
                [sys.executable, *args], check=True, capture_output=True, cwd=_package_root()
            ),
        )

    with tempfile.TemporaryDirectory(prefix="iscore-bench-") as tmp:
        small = Path(tmp) / "small.parquet"
        write_simulated(small, SimConfig("dense_bf16", sequences=100, steps=1, seed=0))
        validate_s = run("-m", "iscore.cli", "validate", str(small))
    return {
        "help_s": run("-m", "iscore.cli", "--help"),
        "presets_s": run("-m", "iscore.cli", "presets"),
        "validate_s": validate_s,
        "import_engine_s": run("-c", "import iscore.analysis"),
        "python_s": run("-c", "pass"),
    }


_MEMORY_SCRIPT = """
import json, resource, sys, time
import iscore
from iscore.analysis import analyze
from iscore.dump import Dump, StepRange
mode, path, chunk, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
settings = sys.argv[5:]
largest = [0]
def progress(tokens):
    largest[0] = max(largest[0], tokens)
start = time.perf_counter()
if mode == "stream":
    analyze(path, settings, max_tokens=chunk, device="cpu", progress=progress)
elif mode == "stream_part":
    source = Dump(path, steps=StepRange(0, steps - 1))
    analyze(source, settings, max_tokens=chunk, device="cpu", progress=progress)
elif mode == "load":
    iscore.load(path)
seconds = time.perf_counter() - start
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
try:  # VmHWM: this process's own peak (ru_maxrss may keep the forking parent's size)
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    peak = int(line.split()[1]) / 1024
except (OSError, StopIteration):
    pass
print(json.dumps({"maxrss_mb": peak, "largest_chunk": largest[0], "seconds": seconds}))
"""


def _memory(
    path: Path, specs: list[Any], chunk_tokens: int, say: Callable[[str], None]
) -> dict[str, Any]:
    """Peak RSS (MB) of fresh processes: importing iscore only, streaming the whole dump and
    a quarter of its steps through analyze, and loading the dump whole; and the seconds each
    took after the import (`<mode>_s`: one run, no warm-up, as a user's command meets it)."""
    steps = pq.ParquetFile(path).metadata.num_row_groups
    part = max(1, steps // 4)
    names = [f"{s.framework}:{s.name}" for s in specs]
    env = {
        **os.environ,
        "PYTHONPATH": _package_root() + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    out: dict[str, Any] = {"chunk_tokens": chunk_tokens, "part_steps": part, "steps": steps}
    for mode in ("import", "stream", "stream_part", "load"):
        say(f"measuring peak memory: {mode}")
        argv = [sys.executable, "-c", _MEMORY_SCRIPT, mode, str(path), str(chunk_tokens)]
        argv += [str(part), *names]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
        if done.returncode != 0:
            out[f"{mode}_error"] = done.stderr.strip().splitlines()[-1:] or ["failed"]
            continue
        measured = json.loads(done.stdout.strip().splitlines()[-1])
        out[f"{mode}_mb"] = measured["maxrss_mb"]
        if mode != "import":  # the work after the import, in a fresh process
            out[f"{mode}_s"] = measured["seconds"]
        if measured["largest_chunk"]:
            out[f"{mode}_largest_chunk_tokens"] = measured["largest_chunk"]
    if "stream_mb" in out and "import_mb" in out and out.get("stream_largest_chunk_tokens"):
        out["stream_mb_per_million_chunk_tokens"] = (
            (out["stream_mb"] - out["import_mb"]) / out["stream_largest_chunk_tokens"] * 1e6
        )
    return out


def _cuda(
    path: Path,
    specs: list[Any],
    chunk_tokens: int,
    device: str | None,
    repeats: int,
    say: Callable[[str], None],
) -> dict[str, Any]:
    """Replay throughput on the GPU: chunks resident, and including host-to-device copies."""
    if device == "cpu":
        return {"available": torch.cuda.is_available(), "skipped": "device='cpu'"}
    if not torch.cuda.is_available():
        return {"available": False}
    say("timing the CUDA replay")
    out: dict[str, Any] = {"available": True, "device": torch.cuda.get_device_name()}
    try:
        host = list(Dump(path).batches(max_tokens=chunk_tokens, whole_steps=True))
        n = sum(c.num_tokens for c in host)
        resident = [c.to("cuda") for c in host]

        def on_gpu() -> None:
            _replays(resident, specs)()
            torch.cuda.synchronize()

        def with_copies() -> None:
            for chunk in host:
                batch = chunk.to("cuda")
                with ops.shared(batch):
                    for spec in specs:
                        spec.replay(batch)
            torch.cuda.synchronize()

        on_gpu()  # warm-up: kernels, allocator
        resident_s = _best(max(repeats, 3), on_gpu)
        copies_s = _best(max(repeats, 3), with_copies)
        out.update(
            tokens=n,
            resident_s=resident_s,
            resident_tok_s=n / resident_s,
            with_copies_s=copies_s,
            with_copies_tok_s=n / copies_s,
        )
        rows = [
            _row("cuda: replay only, resident", resident_s, n, "cuda_resident_tok_s"),
            _row("cuda: replay incl. host-to-device", copies_s, n),
        ]
        try:
            analyze_s = _best(repeats, lambda: _synced(lambda: analyze(resident, specs)))
            out["analyze_resident_s"] = analyze_s
            rows.append(_row("cuda: analyze, resident", analyze_s, n))
        except Exception as e:  # the statistics on CUDA are reported, never fatal
            out["analyze_error"] = f"{type(e).__name__}: {e}"
        out["rows"] = rows
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


def _synced(fn: Callable[[], Any]) -> Any:
    value = fn()
    torch.cuda.synchronize()
    return value


# ---------------------------------------------------------------------------------------------
# Goals


def _goals(result: dict[str, Any]) -> list[dict[str, Any]]:
    rows = {row["name"]: row for row in result["rows"]}
    read = next(r for name, r in rows.items() if name.startswith("read"))
    streamed = next(r for name, r in rows.items() if name.startswith("analyze, streamed"))
    resident = rows["analyze, resident chunks"]
    replay = rows["replay only, resident chunks"]
    goals = []
    ratio = streamed["seconds"] / read["seconds"]
    goals.append(
        {
            "id": "e2e_vs_read",
            "goal": f"{len(result['settings'])} settings end to end <= "
            f"{GOALS['e2e_vs_read']:g}x the pyarrow read",
            "measured": f"{ratio:.2f}x ({streamed['seconds']:.2f} s vs {read['seconds']:.2f} s)",
            "met": ratio <= GOALS["e2e_vs_read"],
            "gap": None
            if ratio <= GOALS["e2e_vs_read"]
            else f"{streamed['seconds'] - GOALS['e2e_vs_read'] * read['seconds']:.2f} s over; "
            f"of the streamed time, {replay['seconds']:.2f} s is the frameworks' replays and "
            f"{resident['seconds'] - replay['seconds']:.2f} s the statistics (resident "
            "chunks, no I/O)",
        }
    )
    marginal = result["marginal"]
    ratio = marginal["ratio"]
    goals.append(
        {
            "id": "marginal_vs_read",
            "goal": f"marginal analyze <= {GOALS['marginal_vs_read']:g}x the marginal pyarrow "
            f"read (the second half of the steps, fresh processes, best of "
            f"{marginal['repeats']})",
            "measured": "not measurable: a dump of one step, or one so small that reading "
            "all of it took no longer than reading half"
            if ratio is None
            else f"{ratio:.2f}x (analyze {marginal['analyze_s']['half']:.2f} -> "
            f"{marginal['analyze_s']['all']:.2f} s, read {marginal['read_s']['half']:.2f} -> "
            f"{marginal['read_s']['all']:.2f} s)",
            "met": None if ratio is None else ratio <= GOALS["marginal_vs_read"],
        }
    )
    for key, name in (("padded_speedup", "padded"), ("pandas_speedup", "pandas")):
        row = next((r for r in result["rows"] if r.get("goal") == key), None)
        speedup = None if row is None else row["speedup"]
        goals.append(
            {
                "id": key,
                "goal": f">= {GOALS[key]:g}x faster than the {name} baseline",
                "measured": None if speedup is None else f"{speedup:.1f}x",
                "met": None if speedup is None else speedup >= GOALS[key],
            }
        )
    memory = result.get("memory")
    if memory and "stream_mb" in memory and "stream_part_mb" in memory:
        # The dump grows 4x from the part to the whole; a peak bounded by the chunk size
        # grows only as much as the largest chunk (whole steps) and the allocator's slack.
        growth = memory["stream_mb"] / memory["stream_part_mb"]
        per_chunk = memory.get("stream_mb_per_million_chunk_tokens")
        goals.append(
            {
                "id": "bounded_memory",
                "goal": "streaming peak memory bounded by the chunk size, not the dump size "
                "(peak for the whole dump <= 1.25x the peak for a quarter of it)",
                "measured": f"peak RSS streaming all {memory['steps']} steps "
                f"{memory['stream_mb']:.0f} MB, {memory['part_steps']} steps "
                f"{memory['stream_part_mb']:.0f} MB ({growth:.2f}x); import alone "
                f"{memory.get('import_mb', float('nan')):.0f} MB, loading whole "
                f"{memory.get('load_mb', float('nan')):.0f} MB (in "
                f"{memory.get('load_s', float('nan')):.2f} s, a fresh process)"
                + (
                    f"; {per_chunk:.0f} MB per million tokens of the largest chunk "
                    f"({memory['stream_largest_chunk_tokens']:,} tokens)"
                    if per_chunk
                    else ""
                ),
                "met": growth <= 1.25,
            }
        )
    else:
        goals.append(
            {
                "id": "bounded_memory",
                "goal": "streaming peak memory bounded by the chunk size",
                "measured": None,
                "met": None,
            }
        )
    tune = result["tune"]
    goals.append(
        {
            "id": "tune_query_p99_s",
            "goal": f"Tune query p99 < {GOALS['tune_query_p99_s'] * 1e3:g} ms at "
            f"{tune['tokens'] / 1e6:.1f}M tokens",
            "measured": f"p50 {tune['query_p50_s'] * 1e3:.3f} ms, p99 "
            f"{tune['query_p99_s'] * 1e3:.3f} ms (build {tune['build_s']:.2f} s)",
            "met": tune["query_p99_s"] < GOALS["tune_query_p99_s"],
        }
    )
    app = result["app"]
    at = f"at {app['tokens'] / 1e6:.1f}M tokens"
    goals += [
        {
            "id": "app_add_setting_s",
            "goal": f"adding a setting <= {GOALS['app_add_setting_s']:g} s {at}",
            "measured": None
            if app["add_setting_max_s"] is None
            else f"slowest {app['add_setting_max_s']:.2f} s, median "
            f"{app['add_setting_p50_s']:.2f} s over {app['settings_added']} settings (the "
            f"first, which computes what they share, {app['first_setting_s']:.2f} s)",
            "met": None
            if app["add_setting_max_s"] is None
            else app["add_setting_max_s"] <= GOALS["app_add_setting_s"],
        },
        {
            "id": "app_tune_open_s",
            "goal": f"opening Tune cold <= {GOALS['app_tune_open_s']:g} s {at}",
            "measured": f"{app['tune_open_s']:.2f} s (warm: memoized)",
            "met": app["tune_open_s"] <= GOALS["app_tune_open_s"],
        },
        {
            "id": "app_slider_p50_s",
            "goal": f"Tune slider p50 < {GOALS['app_slider_p50_s'] * 1e3:g} ms {at}",
            "measured": f"p50 {app['slider_p50_s'] * 1e3:.2f} ms, max "
            f"{app['slider_max_s'] * 1e3:.2f} ms over {app['slider_points']} slider positions",
            "met": app["slider_p50_s"] < GOALS["app_slider_p50_s"],
        },
    ]
    cuda = result["cuda"]
    if cuda.get("resident_tok_s"):
        goals.append(
            {
                "id": "cuda_resident_tok_s",
                "goal": ">= 1e9 tokens/s for the replay on CUDA, data resident",
                "measured": f"{cuda['resident_tok_s']:.3g} tok/s resident, "
                f"{cuda['with_copies_tok_s']:.3g} tok/s with host-to-device copies",
                "met": cuda["resident_tok_s"] >= GOALS["cuda_resident_tok_s"],
            }
        )
    else:
        goals.append(
            {
                "id": "cuda_resident_tok_s",
                "goal": ">= 1e9 tokens/s for the replay on CUDA, data resident",
                "measured": cuda.get("error") or "no CUDA device",
                "met": None,
            }
        )
    return goals


# ---------------------------------------------------------------------------------------------
# Baselines: the same corrections written the frameworks' way (padded float32) and with pandas.


def _pad(batch: TokenBatch) -> dict[str, torch.Tensor]:
    """[B, max_len] float32 log-probs (0 in padding), the loss mask (false in padding), and
    each sequence's step: what a framework's trainer holds."""
    lengths = batch.lengths
    b, longest = batch.num_sequences, int(lengths.max())
    valid = torch.arange(longest)[None, :] < lengths[:, None]
    out = {}
    for name in ("rollout", "train"):
        padded = torch.zeros(b, longest, dtype=torch.float32)
        padded[valid] = getattr(batch, name)
        out[name] = padded
    mask = torch.zeros(b, longest, dtype=torch.bool)
    mask[valid] = batch.loss_mask
    out["mask"] = mask
    out["step"] = batch.step
    return out


def _padded(x: dict[str, torch.Tensor], specs: list[Any]) -> dict[str, Any]:
    """The settings' weights and key statistics on padded float32 tensors."""
    mask = x["mask"]
    m = mask.float()
    d = x["train"] - x["rollout"]
    n = m.sum()
    count = m.sum(dim=1)
    has = count > 0
    out = {
        "mismatch": {
            "k3": float(((torch.expm1(d) - d) * m).sum() / n),
            "abs_diff_mean": float((d.abs() * m).sum() / n),
        },
        "settings": [],
    }
    for spec in specs:
        weight, kept = _BASELINES[f"{spec.framework}:{spec.name}"][0](d, mask, count, x["step"])
        w = weight * m
        total, squares = w.sum(), (w * w).sum()
        nonzero = (w > 0) & mask
        agg = aggregation_of(spec)
        if agg.mode == "seq-mean-token-mean":
            lr = float((w.sum(dim=1)[has] / count[has]).mean())
        elif agg.shrinks:
            lr = float(total / (kept & mask).float().sum())
        else:
            lr = float(total / n)
        out["settings"].append(
            {
                "weight_mean": float(total / n),
                "token_masked_fraction": float(1 - nonzero.float().sum() / n),
                "seq_masked_fraction": float((~nonzero.any(dim=1))[has].float().mean()),
                "lr_scale": lr,
                "ess": float(total * total / (n * squares)),
            }
        )
    return out


def _seq_mean(x: torch.Tensor, m: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return (x * m).sum(dim=1) / count.clamp(min=1.0)


def _padded_verl(d, mask, count, step):
    m = mask.float()
    k1_mean = _seq_mean(-d.clamp(-20, 20), m, count)
    keep = ((k1_mean >= math.log(0.999)) & (k1_mean <= math.log(1.001)))[:, None] & mask
    weight = torch.exp(d.clamp(-20, 20)).clamp(max=2.0)
    return weight * keep, keep


def _padded_skyrl(d, mask, count, step):
    rho = torch.exp(d.clamp(-20, 20))
    outlier = ((rho < 1e-4) | (rho > 100.0)) & mask
    keep = mask & ~outlier.any(dim=1, keepdim=True)
    keep = keep & (rho >= 0.5) & (rho <= 2.0)
    k = keep.float()
    geo = torch.exp(((d * k).sum(dim=1) / k.sum(dim=1).clamp(min=1.0)).clamp(-20, 20))
    keep = keep & ((geo >= 0.99) & (geo <= 1.01))[:, None]
    return rho.clamp(max=2.0) * keep, keep


def _padded_nemo(d, mask, count, step):
    rho = torch.nan_to_num(torch.exp(d), nan=0.0, posinf=0.0, neginf=0.0)
    return torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0), mask


def _padded_slime(d, mask, count, step):
    m = mask.float()
    ratio = torch.exp(d.clamp(-20, 20))
    weight = ratio.clamp(0.0, 2.0)
    veto = math.log(np.float32(1e-4))
    # Token RS within the TIS bounds [0.5, 2], then the veto of whole sequences.
    keep = mask & (ratio >= 0.5) & (ratio <= 2.0)
    keep = keep & ~((d < veto) & mask).any(dim=1, keepdim=True)
    # Batch normalization over each step's mask tokens (the RS-rejected ones included).
    _, group = torch.unique(step, return_inverse=True)
    num = torch.zeros(int(group.max()) + 1).index_add_(0, group, (weight * m).sum(dim=1))
    den = torch.zeros_like(num).index_add_(0, group, count)
    mean = num / den.clamp(min=1.0)
    mean = torch.where(mean > 1e-8, mean, 1.0)[group]
    return weight / mean[:, None] * keep, keep


def _padded_areal(d, mask, count, step):
    d = torch.where(torch.isfinite(d), d, 0.0)
    ratio = torch.exp(_seq_mean(d, mask.float(), count))
    keep = mask & (ratio <= 5.0)[:, None]
    return ratio[:, None] * keep, keep


def _padded_openrlhf(d, mask, count, step):
    rho = torch.exp(d)
    return torch.where((rho >= 0.5) & (rho <= 5.0), rho, 0.0), mask


def _padded_trl(d, mask, count, step):
    ratio = torch.exp((d * mask.float()).sum(dim=1))
    keep = ratio <= 3.0
    return torch.where(keep, ratio, 0.0)[:, None].expand_as(d) * mask, mask


def _padded_fireworks(d, mask, count, step):
    return torch.exp(d.clamp(-20, 20)).clamp(0.0, 5.0), mask


def _frame(batch: TokenBatch) -> pd.DataFrame:
    """One row per token: sequence, step, log-probs (float64) and loss mask."""
    return pd.DataFrame(
        {
            "seq": np.repeat(np.arange(batch.num_sequences), batch.lengths.numpy()),
            "step": np.repeat(batch.step.numpy(), batch.lengths.numpy()),
            "rollout": batch.rollout.numpy().astype(np.float64),
            "train": batch.train.numpy().astype(np.float64),
            "mask": batch.loss_mask.numpy(),
        }
    )


def _pandas(df: pd.DataFrame, specs: list[Any]) -> dict[str, Any]:
    """The settings' weights and the statistics with pandas: per-sequence sums by groupby.

    Beside the key statistics (checked against iscore), it computes what else `analyze`
    reports, so the workloads match: the other mismatch estimators (token and sequence
    level, overall and per step), per-probability, per-position and per-length tables, the
    histograms of |d|, of signed d and of (rollout, train) log-probs, the correlation and
    sign balance of d, the worst tokens and sequences; per setting the truncated and rejected
    fractions, per-step and per-length tables, and the histograms of the weights and raw
    ratios beside their quantiles (exact, where iscore reads them off the histograms).
    """
    d = df["train"] - df["rollout"]
    m = df["mask"]
    dm = d.where(m, 0.0)
    rho = np.exp(d).where(m, 0.0)
    mid = np.logaddexp(df["train"], df["rollout"]) - math.log(2.0)
    a, b = df["train"] - mid, df["rollout"] - mid
    frame = pd.DataFrame(
        {
            "seq": df["seq"],
            "m": m.astype(float),
            "d": dm,
            "abs": dm.abs(),
            "d2": dm * dm,
            "k3": (np.expm1(dm) - dm),
            "k3r": (np.expm1(-dm) + dm),
            "chi": np.exp(2 * d.clip(-20, 20)).where(m, 0.0),
            "mult": np.exp(d.abs()).where(m, 0.0),
            "js": (0.5 * (np.expm1(a) - a + np.expm1(b) - b)).where(m, 0.0),
            "rho": rho,
            "rho2": rho * rho,
            "train": df["train"].where(m, 0.0),
            "rollout": df["rollout"].where(m, 0.0),
        }
    )
    grouped = frame.groupby("seq")
    per_seq = grouped.sum()
    per_seq["max_abs"] = grouped["abs"].max()
    per_seq["step"] = df.groupby("seq")["step"].first()
    per_seq = per_seq[per_seq["m"] > 0]
    n = per_seq["m"].sum()
    token = per_seq.drop(columns=["step", "max_abs"]).sum() / n
    G = per_seq["d"] / per_seq["m"]
    sequence = pd.DataFrame(
        {
            "step": per_seq["step"],
            "chi2_seq": np.exp(2 * per_seq["d"].clip(-20, 20)),
            "log_ppl_diff": -G,
            "log_ppl_abs_diff": G.abs(),
            "ppl_ratio": np.exp(-G),
            "training_ppl": np.exp(-per_seq["train"] / per_seq["m"]),
            "rollout_ppl": np.exp(-per_seq["rollout"] / per_seq["m"]),
        }
    )
    loss = d[m]
    abs_loss = loss.abs()
    columns = ["m", "abs", "k3", "d"]
    mismatch = {
        "k3": token["k3"],
        "k3_reverse": token["k3r"],
        "chi2_token": token["chi"] - 1,
        "token_mult_prob_error": token["mult"],
        "js": token["js"],
        "ratio_mean": token["rho"],
        "ratio_mean_stderr": np.sqrt((token["rho2"] - token["rho"] ** 2) / n),
        "d_var": token["d2"] - token["d"] ** 2,
        "abs_diff_mean": token["abs"],
        "abs_diff_max": per_seq["max_abs"].max(),
        **sequence.drop(columns=["step"]).mean(),
        "chi2_seq": sequence["chi2_seq"].mean() - 1,
        "by_step": frame.groupby(df["step"]).sum(),
        "by_step_sequences": sequence.groupby("step").agg(["mean", "max", "min"]),
        "by_prob": frame.groupby(pd.cut(np.exp(df["rollout"]), [0, 0.01, 0.1, 0.5, 0.9, 0.99, 1]))[
            columns
        ].sum(),
        "by_pos": frame.groupby(np.floor(np.log2(df.groupby("seq").cumcount() + 1)))[columns].sum(),
        "by_length": pd.DataFrame({"S": per_seq["d"], "G": G, "T": per_seq["m"]})
        .groupby(np.floor(np.log2(per_seq["m"])))
        .quantile([0.1, 0.5, 0.9]),
        "abs_quantiles": abs_loss.quantile([0.5, 0.9, 0.99, 0.999]),
        "abs_hist": _log_histogram(abs_loss),
        "neg_hist": _log_histogram(abs_loss[loss < 0]),
        "joint_hist": np.histogram2d(
            df["rollout"][m].clip(-20, 0), df["train"][m].clip(-20, 0), 80, [(-20, 0), (-20, 0)]
        )[0],
        "d_rollout_correlation": np.corrcoef(df["rollout"][m], loss)[0, 1],
        "d_sign_fraction": max((loss < 0).sum(), (loss > 0).sum()) / max((loss != 0).sum(), 1),
        "worst_tokens": df.loc[abs_loss.nlargest(TOP_K).index],
        "worst_sequences": per_seq.nlargest(TOP_K, "k3"),
    }
    out = {"mismatch": mismatch, "settings": []}
    count = grouped["m"].transform("sum")
    for spec in specs:
        weight, kept, raw, pre = _BASELINES[f"{spec.framework}:{spec.name}"][1](
            df, d, m, grouped, count
        )
        w = weight.where(m, 0.0)
        kept = kept & m
        changed = kept & (pre > 0)
        sums = pd.DataFrame(
            {
                "seq": df["seq"],
                "w": w,
                "w2": w * w,
                "nz": ((w > 0) & m),
                "kept": kept,
                "high": changed & (pre < raw * (1 - TRUNCATION_TOLERANCE)),
                "low": changed & (pre > raw * (1 + TRUNCATION_TOLERANCE)),
                "log_raw": np.log(raw.clip(lower=1e-300)).where(m, 0.0),
            }
        )
        s = sums.groupby("seq").sum()
        s["T"] = per_seq["m"]
        s = s[s["T"] > 0]
        s["step"] = per_seq["step"]
        s["seq_weight"] = s["w"] / s["T"]
        s["seq_raw"] = s["log_raw"] / s["T"]
        total, squares = s["w"].sum(), s["w2"].sum()
        agg = aggregation_of(spec)
        if agg.mode == "seq-mean-token-mean":
            lr = s["seq_weight"].mean()
        elif agg.shrinks:
            lr = total / s["kept"].sum()
        else:
            lr = total / n
        tables = ["w", "w2", "nz", "kept", "high", "low", "T"]
        length = s.groupby(np.floor(np.log2(s["T"])))
        quantiles = [0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999]
        out["settings"].append(
            {
                "weight_mean": total / n,
                "weight_mean_seq": s["seq_weight"].mean(),
                "token_masked_fraction": 1 - s["nz"].sum() / n,
                "token_rejected_fraction": 1 - s["kept"].sum() / n,
                "truncated_high_fraction": s["high"].sum() / n,
                "truncated_low_fraction": s["low"].sum() / n,
                "seq_masked_fraction": (s["nz"] == 0).mean(),
                "lr_scale": lr,
                "ess": total * total / (n * squares),
                "by_step": s.groupby("step")[tables].sum(),
                "by_length": length[tables].sum(),
                "by_length_quantiles": length["seq_weight"].quantile([0.1, 0.5, 0.9]),
                "by_length_medians": length[["T", "seq_raw"]].median(),
                "weight_quantiles": w[m].quantile(quantiles),
                "raw_quantiles": raw[m].quantile(quantiles),
                "weight_hist": _log_histogram(w[m]),
                "raw_hist": _log_histogram(raw[m]),
            }
        )
    return out


def _log_histogram(x: pd.Series) -> dict[str, Any]:
    """The counts of `LogHistogram` (log-spaced bins, zeros, tails, extremes) with numpy."""
    values = x.to_numpy()
    logs = np.log10(values[values > 0])
    lo, hi = LOG10_RANGE
    counts, _ = np.histogram(logs, bins=int((hi - lo) * BINS_PER_DECADE), range=(lo, hi))
    return {
        "counts": counts,
        "zeros": int((values == 0).sum()),
        "underflow": int((logs < lo).sum()),
        "overflow": int((logs >= hi).sum()),
        "min": values.min(initial=np.inf),
        "max": values.max(initial=-np.inf),
    }


def _pandas_verl(df, d, m, grouped, count):
    k1 = (-d.clip(-20, 20)).where(m, 0.0)
    mean = k1.groupby(df["seq"]).transform("sum") / count.clip(lower=1.0)
    keep = (mean >= math.log(0.999)) & (mean <= math.log(1.001)) & m
    raw = np.exp(d.clip(-20, 20))
    weight = raw.clip(upper=2.0).where(keep, 0.0)
    return weight, keep, raw, weight


def _pandas_skyrl(df, d, m, grouped, count):
    rho = np.exp(d.clip(-20, 20))
    outlier = (((rho < 1e-4) | (rho > 100.0)) & m).groupby(df["seq"]).transform("any")
    keep = m & ~outlier & (rho >= 0.5) & (rho <= 2.0)
    k = keep.astype(float)
    num = (d * k).groupby(df["seq"]).transform("sum")
    den = k.groupby(df["seq"]).transform("sum").clip(lower=1.0)
    geo = np.exp((num / den).clip(-20, 20))
    keep = keep & (geo >= 0.99) & (geo <= 1.01)
    weight = rho.clip(upper=2.0).where(keep, 0.0)
    return weight, keep, rho, weight


def _pandas_nemo(df, d, m, grouped, count):
    rho = np.exp(d)
    rho = rho.where(np.isfinite(rho.astype(np.float32)), 0.0)
    weight = rho.where((rho >= 0.5) & (rho <= 5.0), 0.0)
    return weight, m, rho, weight


def _pandas_slime(df, d, m, grouped, count):
    ratio = np.exp(d.clip(-20, 20))
    weight = ratio.clip(0.0, 2.0)
    veto = math.log(np.float32(1e-4))
    vetoed = ((d < veto) & m).groupby(df["seq"]).transform("any")
    keep = m & (ratio >= 0.5) & (ratio <= 2.0) & ~vetoed
    wm = weight.where(m, 0.0)
    step_sum = wm.groupby(df["step"]).transform("sum")
    step_count = m.astype(float).groupby(df["step"]).transform("sum").clip(lower=1.0)
    mean = step_sum / step_count
    mean = mean.where(mean > 1e-8, 1.0)
    return (weight / mean).where(keep, 0.0), keep, ratio, weight


def _pandas_areal(df, d, m, grouped, count):
    d = d.where(np.isfinite(d), 0.0)
    mean = d.where(m, 0.0).groupby(df["seq"]).transform("sum") / count.clip(lower=1.0)
    ratio = np.exp(mean)
    keep = m & (ratio <= 5.0)
    weight = ratio.where(keep, 0.0)
    return weight, keep, ratio, weight


def _pandas_openrlhf(df, d, m, grouped, count):
    rho = np.exp(d)
    weight = rho.where((rho >= 0.5) & (rho <= 5.0), 0.0)
    return weight, m, rho, weight


def _pandas_trl(df, d, m, grouped, count):
    total = d.where(m, 0.0).groupby(df["seq"]).transform("sum")
    ratio = np.exp(total).astype(np.float32).astype(np.float64)
    weight = ratio.where(ratio <= 3.0, 0.0)
    return weight, m, ratio, weight


def _pandas_fireworks(df, d, m, grouped, count):
    raw = np.exp(d.clip(-20, 20))
    weight = raw.clip(0.0, 5.0)
    return weight, m, raw, weight


_BASELINES: dict[str, tuple[Callable[..., Any], Callable[..., Any]]] = {
    "verl:decoupled_geo_rs_token_tis": (_padded_verl, _pandas_verl),
    "skyrl:skyrl_tldr_stack": (_padded_skyrl, _pandas_skyrl),
    "nemo_rl:nemo_icepop": (_padded_nemo, _pandas_nemo),
    "slime:slime_mis_example": (_padded_slime, _pandas_slime),
    "areal:areal_sequence_geo_mask": (_padded_areal, _pandas_areal),
    "openrlhf:openrlhf_icepop": (_padded_openrlhf, _pandas_openrlhf),
    "trl:trl_default": (_padded_trl, _pandas_trl),
    "fireworks:fireworks_default": (_padded_fireworks, _pandas_fireworks),
}
"""(padded torch, pandas) implementation of each default setting, from its formulas; the pandas
one returns (weight, kept, raw ratio, weight before batch normalization) per token."""


def _agreement(
    got: dict[str, Any],
    reference: dict[str, Any],
    tolerance: float,
    specs: list[Any],
    statistics: dict[str, tuple[str, ...]] | None = None,
) -> dict[str, Any]:
    """Largest relative difference of the `statistics` (default: the key ones) from iscore's."""
    statistics = statistics or {"mismatch": MISMATCH_STATISTICS, "settings": KEY_STATISTICS}
    worst, where = 0.0, ""
    pairs = [
        (f"mismatch.{k}", got["mismatch"][k], reference["mismatch"][k])
        for k in statistics["mismatch"]
    ]
    for spec, g, r in zip(specs, got["settings"], reference["settings"], strict=True):
        name = f"{spec.framework}:{spec.name}"
        pairs += [(f"{name}.{k}", g[k], r[k]) for k in statistics["settings"]]
    for name, a, b in pairs:
        a, b = float(a), float(b)
        diff = 0.0 if a == b else abs(a - b) / max(abs(a), abs(b), 1e-12)
        if diff > worst or math.isnan(diff):
            worst, where = diff, name
    return {
        "max_rel_diff": worst,
        "worst": where,
        "tolerance": tolerance,
        "agrees": worst <= tolerance,
        "statistics": len(pairs),
    }


# ---------------------------------------------------------------------------------------------
# Helpers


def _writer_cost(tokens: int, steps: int) -> dict[str, Any]:
    """What `DumpWriter.add_batch` costs a training loop per step, against a step that moves
    the same tensors: TRL's GRPO loss inputs at `tokens` tokens ([B, T] padded, half full),
    and as the step, TRL's clipped loss with its importance-sampling ratio over them, forward
    and backward. The writer's per-rank layout holds the loop only while it takes references;
    its background thread converts and writes (timed too, as a single-file write)."""
    rng = np.random.default_rng(0)
    count = 512
    width = max(2 * tokens // count, 2)
    lengths = torch.from_numpy(rng.integers(1, width + 1, count))
    mask = torch.arange(width)[None, :] < lengths[:, None]
    rollout = -torch.from_numpy(rng.exponential(0.7, (count, width)).astype(np.float32))
    inputs = {
        "sampling_per_token_logps": rollout,
        "old_per_token_logps": rollout + 0.01 * torch.randn(count, width),
        "completion_mask": mask.long(),
        "completion_ids": torch.randint(0, 150_000, (count, width)),
        "advantages": torch.randn(count),
    }

    def step() -> None:
        new = inputs["old_per_token_logps"].clone().requires_grad_()
        ratio = torch.exp(new - inputs["old_per_token_logps"])
        adv = inputs["advantages"][:, None]
        per_token = -torch.min(ratio * adv, ratio.clamp(0.8, 1.28) * adv)
        sampling = inputs["old_per_token_logps"] - inputs["sampling_per_token_logps"]
        per_token = per_token * sampling.exp().clamp(max=3.0)
        mask_f = inputs["completion_mask"].float()
        ((per_token * mask_f).sum() / mask_f.sum()).backward()

    step_s = _best(steps, step)
    blocked = []
    with tempfile.TemporaryDirectory(prefix="iscore-bench-writer-") as run:
        writer = DumpWriter(run, framework="trl", rank=0)
        for i in range(steps):
            start = time.perf_counter()
            writer.add_batch(inputs, step=i)
            blocked.append(time.perf_counter() - start)
        writer.close()
        written = int(mask.sum())

        def write_one() -> None:
            with DumpWriter(Path(run) / "one.parquet", framework="trl") as single:
                single.add_batch(inputs, step=0)

        background_s = _best(2, write_one)
    add_s = float(np.median(blocked))
    ratio = add_s / step_s
    at = f"{written / 1e6:.2f}M tokens"
    return {
        "tokens": written,
        "step_s": step_s,
        "add_batch_s": add_s,
        "background_s": background_s,
        "rows": [
            _row("writer: a step's loss over the same tensors", step_s, written),
            _row("writer: add_batch, time the step waits", add_s, written, "writer_vs_step"),
            _row("writer: background conversion and write", background_s, written),
        ],
        "goal": {
            "id": "writer_vs_step",
            "goal": f"DumpWriter.add_batch < {GOALS['writer_vs_step']:.0%} of a step that "
            f"moves the same tensors ({at})",
            "measured": f"{ratio:.2%} ({add_s * 1e3:.3f} ms vs {step_s * 1e3:.1f} ms; the "
            f"background thread then takes {background_s * 1e3:.0f} ms)",
            "met": ratio < GOALS["writer_vs_step"],
        },
    }


def _best(repeats: int, fn: Callable[[], Any]) -> float:
    """The fastest of `repeats` runs of fn(), in seconds."""
    best = math.inf
    for _ in range(max(repeats, 1)):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


_GOAL_TEXT = {
    "e2e_vs_read": "<= 2x read",
    "padded_speedup": ">= 5x",
    "pandas_speedup": ">= 10x",
    "tune_query_p99_s": "< 50 ms",
    "cuda_resident_tok_s": ">= 1e9/s",
    "app_add_setting_s": "<= 1 s",
    "app_tune_open_s": "<= 3 s",
    "app_slider_p50_s": "< 50 ms",
    "writer_vs_step": "< 2% step",
}


def _row(name: str, seconds: float, tokens: int | None, goal: str | None = None) -> dict[str, Any]:
    return {
        "name": name,
        "seconds": seconds,
        "tokens": tokens,
        "mtok_s": tokens / seconds / 1e6 if tokens and seconds else None,
        "goal": goal,
        "goal_text": _GOAL_TEXT.get(goal or ""),
    }


def _machine() -> dict[str, Any]:
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "numpy": np.__version__,
        "pyarrow": pa.__version__,
        "pandas": pd.__version__,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "loadavg_start": _loadavg(),
        "maxrss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }


def _loadavg() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def _package_root() -> str:
    return str(Path(iscore.__file__).resolve().parent.parent)


def _clean(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if isinstance(value, float | np.floating):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.integer | np.bool_):
        return value.item()
    return value


# ---------------------------------------------------------------------------------------------
# What `--where` adds (a separate run: `iscore bench --where P`)

WHERE_PREDICATES = (
    "length > 0",
    "reward IS NOT NULL",
    "k3 >= 0 AND abs_diff_max >= 0",
)
"""Predicates that keep every sequence, so that analyze does the same work with and without
them and the difference is the predicate's own cost: one on a length (no token math), one on
a dump column (read and carried), one on the mismatch statistics (d computed per chunk)."""

WHERE_GOAL = 0.2
"""`--where` may add at most this share to a streamed analyze."""


def where_overhead(
    predicates: Sequence[str] = WHERE_PREDICATES,
    tokens: int = 50_000_000,
    settings: Sequence[Setting] = SETTINGS,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
    path: str | Path | None = None,
    *,
    repeats: int = 2,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Time a streamed analyze of the bench dump without and with each `--where` predicate
    (on CPU, the best of `repeats` runs each); the goal is at most `WHERE_GOAL` more time.

    Args: as `run_bench`; `predicates` are judged as `--where` would.

    Returns:
        A JSON-ready dict: `machine`, `dump`, `rows` (seconds, sequences kept, overhead
        against the run without a predicate) and `goal`.
    """
    say = log or (lambda line: None)
    specs = [resolve(s) for s in settings]
    tmp = None
    if path is None:
        tmp = Path(tempfile.mkdtemp(prefix="iscore-bench-"))
        dump_path = tmp / "bench.parquet"
    else:
        dump_path = Path(path)
    try:
        result: dict[str, Any] = {
            "schema": "iscore.bench_where",
            "schema_version": 1,
            "machine": _machine(),
            "settings": [f"{s.framework}:{s.name}" for s in specs],
            "chunk_tokens": chunk_tokens,
            "repeats": repeats,
            "dump": _dump(dump_path, tokens, say),
        }
        if tmp is not None:
            result["dump"]["path"] = "(temporary, deleted)"
        n = result["dump"]["tokens"]
        rows = []
        for predicate in (None, *predicates):
            say(f"timing analyze, streamed, {'no --where' if predicate is None else predicate}")
            kept: list[int] = []

            def run(where: str | None = predicate, kept: list[int] = kept) -> None:
                dump = Dump(dump_path, where=where)
                a = analyze(dump, specs, max_tokens=chunk_tokens, device="cpu")
                kept.append(a.source["sequences"])

            row = _row(
                "analyze, streamed" + ("" if predicate is None else f", --where {predicate}"),
                _best(repeats, run),
                n,
            )
            row["where"], row["sequences"] = predicate, kept[-1]
            row["overhead"] = row["seconds"] / rows[0]["seconds"] - 1 if rows else 0.0
            rows.append(row)
        worst = max(rows, key=lambda r: r["overhead"])
        result["rows"] = rows
        result["goal"] = {
            "goal": f"--where adds at most {WHERE_GOAL:.0%} to a streamed analyze",
            "measured": f"{worst['overhead']:+.1%} ({worst['name']})",
            "met": worst["overhead"] <= WHERE_GOAL,
        }
        result["machine"]["loadavg_end"] = _loadavg()
        return result
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def format_where(result: dict[str, Any]) -> str:
    """The `where_overhead` result as a fixed-width table and its goal."""
    header = f"{'name':60s} {'seconds':>9s} {'Mtok/s':>7s} {'sequences':>10s} {'overhead':>9s}"
    lines = [header, "-" * len(header)]
    for row in result["rows"]:
        lines.append(
            f"{row['name']:60s} {row['seconds']:9.2f} {row['mtok_s']:7.2f} "
            f"{row['sequences']:10,d} {row['overhead']:+9.1%}"
        )
    goal = result["goal"]
    lines.append(f"\n[{'met' if goal['met'] else 'NOT met'}] {goal['goal']}: {goal['measured']}")
    d, m = result["dump"], result["machine"]
    lines.append(
        f"dump: {d['tokens']:,} tokens, {d['sequences']:,} sequences, {d['steps']} steps; "
        f"machine: {m['cpus']} CPUs, load average {m['loadavg_start']} -> {m['loadavg_end']}"
    )
    return "\n".join(lines)
