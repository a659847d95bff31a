"""`run_bench`: prepare the bench dump, run every measurement on it, judge the goals; and the
result as a table (`format_table`) or JSON (`write_json`).

A measurement is a function `Run -> Measured` (`iscore.bench.base`); `MEASUREMENTS` lists them
in the order they run and their rows are printed. To add one, write the function (it says what
it times with `run.say`, and returns its rows, made with `base.row`, and its entries of the
result) and add it to `MEASUREMENTS`; a goal to judge it by is a function of the result in
`iscore.bench.goals.CHECKS`.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from iscore.bench import (
    cluster,
    compare,
    cores,
    data,
    goals,
    interactive,
    processes,
    runs,
    store,
    throughput,
    whole,
)
from iscore.bench.base import SETTINGS, Measurement, Run, loadavg, machine
from iscore.bench.baselines.comparison import baselines
from iscore.bench.writer import writer
from iscore.dump import DEFAULT_CHUNK_TOKENS
from iscore.errors import ConfigError, quote
from iscore.frameworks import Setting, resolve
from iscore.packed import kernels

MEASUREMENTS: tuple[Measurement, ...] = (
    throughput.read,
    throughput.load,
    throughput.streamed,
    processes.marginal,
    throughput.resident,
    baselines,
    interactive.tune,
    interactive.app,
    processes.startup,
    writer,
    runs.runs,
    store.store,
    cores.workers,
    compare.compared,
    whole.topk_cost,
    processes.memory,
    throughput.cuda,
    cluster.ray_engine,  # last: a cluster's processes slow nothing else
)
"""What `run_bench` measures, in order."""


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
    run_files: int = 1000,
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
        run_files: step files of the simulated run followed step by step (`runs`).
        log: called with a line of progress for each stage.

    Returns:
        A JSON-ready dict: `machine`, `dump`, `rows` (the table), `goals`, `agreement`,
        `memory`, `marginal`, `tune`, `app`, `startup`, `writer`, `runs`, `store`,
            `workers`, `diff`, `cuda`, `ray`.

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
    specs = tuple(resolve(s) for s in settings)
    started = time.perf_counter()
    result: dict[str, Any] = {
        "schema": "iscore.bench",
        "schema_version": 1,
        "machine": machine(),
        "settings": [f"{s.framework}:{s.name}" for s in specs],
        "chunk_tokens": chunk_tokens,
        "repeats": repeats,
    }
    with data.location(path) as (dump_path, temporary), _kernels() as mode:
        result["kernels"] = mode
        result["dump"] = data.prepare(dump_path, tokens, say)
        if temporary:
            result["dump"]["path"] = "(temporary, deleted)"
        run = Run(
            path=dump_path,
            tokens=result["dump"]["tokens"],
            specs=specs,
            chunk_tokens=chunk_tokens,
            device=device,
            baseline_tokens=baseline_tokens,
            tune_tokens=tune_tokens,
            queries=queries,
            repeats=repeats,
            marginal_repeats=marginal_repeats,
            memory=memory,
            run_files=run_files,
            say=say,
        )
        rows: list[dict[str, Any]] = []
        for measure in MEASUREMENTS:
            measured = measure(run)
            rows += measured.rows
            result.update(measured.entries)
    read = next(r for r in rows if r["name"] == throughput.READ_ROW)
    read_per_token = read["seconds"] / read["tokens"]
    for r in rows:
        tok = r["tokens"]
        r["ratio_vs_read"] = r["seconds"] / tok / read_per_token if tok and r["seconds"] else None
    result["rows"] = rows
    result["goals"] = goals.evaluate(result)
    met = {goal["id"]: goal["met"] for goal in result["goals"]}
    for r in rows:
        r["met"] = met.get(r.get("goal"))
    result["total_s"] = time.perf_counter() - started
    result["machine"]["loadavg_end"] = loadavg()
    result["machine"]["numba_threading_layer"] = kernels.threading_layer()
    return result


@contextlib.contextmanager
def _kernels() -> Iterator[str]:
    """Inside, `iscore.packed.kernels` run from the first token (`ISCORE_KERNELS=numba`) unless the
    user chose otherwise: the bench times the per-token cost of a long run, where they run;
    its start-up rows time the default (`processes.startup`). Yields the mode."""
    chosen = os.environ.get(kernels.ENV)
    if chosen is not None:
        yield chosen
        return
    os.environ[kernels.ENV] = "numba" if kernels.available() else "reference"
    try:
        yield os.environ[kernels.ENV]
    finally:
        del os.environ[kernels.ENV]


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
        f"{m['loadavg_start']} -> {m['loadavg_end']}; kernels: {result['kernels']} "
        f"({kernels.ENV})"
        + (f", numba threading layer {layer}" if (layer := m.get("numba_threading_layer")) else "")
    )
    return "\n".join(lines)
