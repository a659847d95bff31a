"""Every core (docs/performance.md#every-core): the streamed analyze in worker processes
(`jobs` = the cores this process may run on, at least 2) against one worker's compute (one
process of one thread on one core) and against one process as a user runs it (torch's
threads); a cold pool (the workers starting: what a command pays) and a warm one (what an
app's or a notebook's later analyses pay); checked to agree with one process."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time

import loky

from iscore.bench.base import Measured, Run, best, row
from iscore.bench.cluster import TOLERANCE, differences
from iscore.passes import analyze
from iscore.utils import WORKER_ENV
from iscore.utils import cores as machine_cores

_ONE_THREAD = """
import json, os, sys, time, torch
if hasattr(os, "sched_setaffinity"):  # one core: its reader thread shares it
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
torch.set_num_threads(1)
from iscore.frameworks import resolve_all
from iscore.passes import analyze
path, settings, chunk, repeats = sys.argv[1:]
specs, chunk, repeats = resolve_all(json.loads(settings)), int(chunk), int(repeats)
fastest = float("inf")
for _ in range(repeats):
    start = time.perf_counter()
    analyze(path, specs, max_tokens=chunk, device="cpu", jobs=1)
    fastest = min(fastest, time.perf_counter() - start)
print(fastest)
"""
"""A fresh process on one core (a worker's environment, torch's one thread, and where the
system allows, pinned to one core: a process's reader thread would use a second one) timing
the analyze in itself, its imports left out."""


def workers(run: Run) -> Measured:
    """One worker's compute, one process, then `jobs` workers cold (the pool made anew) and
    warm (best of `run.repeats`), and the largest relative difference from one process."""
    jobs = max(2, machine_cores())
    run.say(f"timing analyze in {jobs} worker processes, cold and warm, against one thread")

    def analyzed(n: int) -> dict:
        analysis = analyze(run.path, run.specs, max_tokens=run.chunk_tokens, device="cpu", jobs=n)
        return json.loads(json.dumps(analysis.to_dict()))

    one_thread_s = _one_thread(run)
    one_process_s = best(run.repeats, lambda: analyzed(1))
    loky.get_reusable_executor(max_workers=jobs).shutdown(wait=True)  # the next pool is cold
    start = time.perf_counter()
    doc = analyzed(jobs)
    cold_s = time.perf_counter() - start
    warm_s = best(run.repeats, lambda: analyzed(jobs))
    worst = max(differences(analyzed(1), doc), default=0.0)
    return Measured(
        rows=(
            row("cores: one worker's compute (1 core)", one_thread_s, run.tokens),
            row(f"cores: {jobs} workers, warm", warm_s, run.tokens, "workers_vs_one"),
            row(f"cores: {jobs} workers, cold (a command)", cold_s, run.tokens, "workers_cold"),
        ),
        entries={
            "workers": {
                "jobs": jobs,
                "cores": machine_cores(),
                "one_thread_s": one_thread_s,
                "one_process_s": one_process_s,
                "cold_s": cold_s,
                "warm_s": warm_s,
                "max_rel_diff": worst,
                "agrees": worst <= TOLERANCE,
            }
        },
    )


def _one_thread(run: Run) -> float:
    """The analyze in a fresh process of one thread, timed inside it."""
    settings = [spec.to_config() for spec in run.specs]
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            _ONE_THREAD,
            str(run.path),
            json.dumps(settings),
            str(run.chunk_tokens),
            str(max(run.repeats, 1)),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, **WORKER_ENV},
        check=True,
    )
    seconds = float(done.stdout.split()[-1])
    return seconds if math.isfinite(seconds) else math.nan
