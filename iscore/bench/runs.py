"""A run followed step by step (docs/runs.md): a simulated run of small step files, analyzed
once, then again from the results store; its per-step trend opened from the store; and one
new step landing while it is followed."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

from iscore.bench.base import Measured, Run, best, row
from iscore.dump import Dump, SimConfig, write_run
from iscore.passes import Follower, ResultStore, analyze

SEQUENCES = 8
"""Sequences per step file (median 64 tokens each): small files, where fixed costs show."""


def runs(run: Run) -> Measured:
    """Item by item: the first analyze of `run.run_files` step files (through an empty
    store), the second (every file's parts from the store), opening the per-step trend from
    the store (what the app's Trends page and `iscore watch` open with), and a new step
    landing in a followed run against that step's file analyzed alone (best of `repeats`
    steps landing one after the other: one timing of 40 ms swung from 1.5x to 2.3x its file
    alone on this machine)."""
    n = run.run_files
    run.say(f"timing a run of {n:,} step files: first and second analyze, trend, a new step")
    specs = run.specs
    later = max(run.repeats, 1)
    with tempfile.TemporaryDirectory(prefix="iscore-bench-run-") as tmp:
        staged, folder, cache = Path(tmp) / "staged", Path(tmp) / "run", Path(tmp) / "cache"
        write_run(staged, SimConfig(steps=n + later, sequences=SEQUENCES, median_len=64))
        lasts = [f"step_{i:06d}" for i in range(n, n + later)]
        for last in lasts:  # the steps that land later
            shutil.move(staged / last, Path(tmp) / last)
        shutil.move(staged, folder)
        size = sum(p.stat().st_size for p in folder.rglob("*.parquet"))

        start = time.perf_counter()
        # Opened from its path, as `iscore analyze` opens it (with the store's known footers).
        analyze(folder, specs, store=ResultStore(cache))
        first_s = time.perf_counter() - start
        second_s = best(run.repeats, lambda: analyze(folder, specs, store=ResultStore(cache)))
        Follower(folder, specs, store=ResultStore(cache)).poll()  # keeps the rows in the store
        open_s = best(run.repeats, lambda: Follower(folder, specs, store=ResultStore(cache)).poll())
        follower = Follower(folder, specs, store=ResultStore(cache))
        follower.poll()
        new_s = alone_s = float("inf")
        for last in lasts:  # one at a time; each side the best of them
            shutil.move(Path(tmp) / last, folder / last)
            start = time.perf_counter()
            update = follower.poll()
            new_s = min(new_s, time.perf_counter() - start)
            (path,) = update.files
            start = time.perf_counter()
            analyze(Dump(str(path)), specs)
            alone_s = min(alone_s, time.perf_counter() - start)
    return Measured(
        rows=(
            row(f"run: first analyze ({n:,} step files)", first_s, None),
            row("run: second analyze, from the store", second_s, None, "run_second_vs_first"),
            row("run: open the per-step trend from the store", open_s, None, "run_trend_open_s"),
            row("run: a new step, followed", new_s, None, "run_new_step_vs_alone"),
            row("run: that step file analyzed alone", alone_s, None),
        ),
        entries={
            "runs": {
                "files": n,
                "sequences_per_file": SEQUENCES,
                "bytes": size,
                "first_s": first_s,
                "second_s": second_s,
                "trend_open_s": open_s,
                "new_step_s": new_s,
                "step_alone_s": alone_s,
            }
        },
    )
