"""The Ray engine (docs/performance.md#ray): starting a local cluster, a task's overhead, and
the streamed analyze on the cluster against one process, checked to agree. Skipped where Ray
is not installed (`pip install 'iscore[ray]'`)."""

from __future__ import annotations

import importlib.util
import json
import math
import time

from iscore.bench.base import Measured, Run, best, row
from iscore.passes import analyze
from iscore.utils import connect, ordered

TASKS = 200
"""Empty tasks timed for the per-task overhead."""

TOLERANCE = 1e-12
"""Relative difference allowed between the two engines' numbers (a worker sums with one
thread)."""


def nothing(task: int) -> int:
    """An empty task (the overhead's yardstick)."""
    return task


def ray_engine(run: Run) -> Measured:
    """Start (or join) the cluster, time `TASKS` empty tasks through `ordered`, then the
    streamed analyze here and on the cluster (best of `run.repeats`, alternated, the cluster
    already up), and how far apart their documents are; a cluster started here is shut down."""
    if importlib.util.find_spec("ray") is None:
        run.say("skipping the Ray engine: Ray is not installed (pip install 'iscore[ray]')")
        return Measured(entries={"ray": {"skipped": "Ray is not installed"}})
    run.say("timing the Ray engine: a local cluster, its tasks, analyze on it")
    import ray  # here: an optional dependency, found above

    started = not ray.is_initialized()  # then shut down after, as found
    try:
        return _measured(run)
    finally:
        if started:
            ray.shutdown()


def _measured(run: Run) -> Measured:
    start = time.perf_counter()
    ray = connect()
    for _ in ordered(nothing, range(2), name=str):  # the workers up and iscore imported
        pass
    start_s = time.perf_counter() - start
    start = time.perf_counter()
    for _ in ordered(nothing, range(TASKS), name=str):
        pass
    task_s = (time.perf_counter() - start) / TASKS

    def run_on(engine: str) -> dict:
        analysis = analyze(
            run.path, run.specs, max_tokens=run.chunk_tokens, device="cpu", engine=engine
        )
        return json.loads(json.dumps(analysis.to_dict()))

    local_doc, ray_doc = run_on("local"), run_on("ray")
    worst = max(differences(local_doc, ray_doc), default=0.0)
    # The engines alternate, so that a slow spell of a shared machine slows both.
    local_s = ray_s = math.inf
    for _ in range(max(run.repeats, 1)):
        local_s = min(local_s, best(1, lambda: run_on("local")))
        ray_s = min(ray_s, best(1, lambda: run_on("ray")))
    cpus = int(ray.cluster_resources().get("CPU", 0))
    return Measured(
        rows=(
            row("ray: start a local cluster, or join one", start_s, None),
            row("ray: an empty task, through the window", task_s, None),
            row("ray: the same analyze, one process", local_s, run.tokens),
            row(
                f"ray: analyze, streamed ({len(run.specs)} settings)",
                ray_s,
                run.tokens,
                "ray_vs_local",
            ),
        ),
        entries={
            "ray": {
                "cpus": cpus,
                "start_s": start_s,
                "task_s": task_s,
                "local_s": local_s,
                "ray_s": ray_s,
                "ratio": ray_s / local_s,
                "max_rel_diff": worst,
                "agrees": worst <= TOLERANCE,
            }
        },
    )


def differences(a: object, b: object) -> list[float]:
    """The relative difference of each pair of numbers of two JSON documents (inf where
    they differ otherwise)."""
    if isinstance(a, dict) and isinstance(b, dict) and a.keys() == b.keys():
        return [d for key in a for d in differences(a[key], b[key])]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for x, y in zip(a, b, strict=True) for d in differences(x, y)]
    if isinstance(a, float) and isinstance(b, float) and a != b and a == a and b == b:
        return [abs(a - b) / max(abs(a), abs(b))]
    return [] if a == b or (a != a and b != b) else [float("inf")]  # NaN == NaN here
