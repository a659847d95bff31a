"""Measurements in fresh processes, where imports, first-chunk costs or another measurement's
memory would blur them: the marginal cost of analyze over the read, start-up, peak memory.
Each is a `Run -> Measured` of `iscore.bench.base`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from iscore.bench.base import COLUMNS, Measured, Run, best, package_root, row
from iscore.dump import SimConfig, write_simulated
from iscore.packed import kernels

_MARGINAL_SCRIPT = """
import sys, time
import pyarrow.parquet as pq
from iscore.passes.analysis import analyze
from iscore.dump import Dump, StepRange
mode, path, chunk, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
columns, settings = sys.argv[5].split(","), sys.argv[6:]
start = time.perf_counter()
if mode == "read":  # those steps' row groups one at a time, as analyze streams them
    f = pq.ParquetFile(path)
    step = f.schema_arrow.get_field_index("step")
    for g in range(f.num_row_groups):  # a simulated dump has a row group per step
        if f.metadata.row_group(g).column(step).statistics.max < steps:
            f.read_row_group(g, columns=columns)
else:
    analyze(Dump(path, steps=StepRange(0, steps - 1)), settings, max_tokens=chunk, device="cpu")
print(time.perf_counter() - start)
"""


def marginal(run: Run) -> Measured:
    """What the second half of the dump's steps adds to analyze over what it adds to the
    read (the result's `marginal`)."""
    run.say("timing the marginal analyze and read in fresh processes")
    record = time_marginal(run.path, run.names, run.chunk_tokens, run.marginal_repeats)
    return Measured(entries={"marginal": record})


def time_marginal(path: Path, names: list[str], chunk_tokens: int, repeats: int) -> dict[str, Any]:
    """Seconds to read and to analyze the first half of the steps and all of them, each the
    best of `repeats` fresh processes (timed after the imports); the marginal ratio is what
    the second half adds to analyze over what it adds to the read, None where either comes
    out <= 0 (the second half timed no slower than the first: noise, not a cost). The read
    decodes those steps' row groups one at a time and keeps none, as analyze streams them.
    A `filters=` read also filters and copies every row; one read of all the row groups
    builds the whole table (560 MB at 19.5M tokens). What the second half added to either
    swung from 0.3 to 1.3 s between runs, and the ratio from 1.9x to 11x; the streamed
    read's stays within 0.17-0.18 s."""
    step = pq.read_table(path, columns=["step"])["step"].to_numpy()
    steps = int(step.max()) + 1  # the simulated dump's steps are 0, 1, ...
    half = steps // 2
    tokens = {k: int((step < k).sum()) for k in (half, steps)}
    if half == 0:
        return {"steps": steps, "tokens": tokens[steps], "repeats": repeats, "ratio": None}
    seconds: dict[str, dict[int, float]] = {"read": {}, "analyze": {}}
    for mode, k in ((m, k) for m in seconds for k in (half, steps)):
        argv = [sys.executable, "-c", _MARGINAL_SCRIPT, mode, str(path), str(chunk_tokens)]
        argv += [str(k), ",".join(COLUMNS), *names]
        seconds[mode][k] = min(_seconds_in_fresh_process(argv) for _ in range(max(repeats, 1)))
    extra = {mode: seconds[mode][steps] - seconds[mode][half] for mode in seconds}
    return {
        "steps": steps,
        "half_steps": half,
        "tokens": tokens[steps],
        "half_tokens": tokens[half],
        "repeats": repeats,
        "read_s": {"half": seconds["read"][half], "all": seconds["read"][steps]},
        "analyze_s": {"half": seconds["analyze"][half], "all": seconds["analyze"][steps]},
        # A negative difference over a positive one would read as a cost below any goal, and
        # two negative ones as a plausible ratio.
        "ratio": extra["analyze"] / extra["read"] if min(extra.values()) > 0 else None,
    }


def _seconds_in_fresh_process(argv: list[str], env: dict[str, str] | None = None) -> float:
    """The seconds a `-c` script prints."""
    done = subprocess.run(argv, capture_output=True, text=True, env=env or _env(), check=True)
    return float(done.stdout)


def _env() -> dict[str, str]:
    """The environment of a fresh process that imports this `iscore`."""
    path = package_root() + os.pathsep + os.environ.get("PYTHONPATH", "")
    return {**os.environ, "PYTHONPATH": path}


_KERNELS_SCRIPT = """
import time
import numpy as np
import torch
from iscore.stats import noise
start = time.perf_counter()
noise.median_mad(np.arange(5.0))
noise.segment_medians(np.arange(5.0), np.array([5]))
noise.step_noise(np.arange(5.0), np.full(5, -1.0), np.array([5]), np.array([0]))
print(time.perf_counter() - start)
"""


def startup(run: Run) -> Measured:
    """Seconds for fresh processes to answer `iscore --help`, `iscore presets` and `iscore
    validate` of a small dump (100 sequences), to import the engine, and to load numba and the
    compiled kernels (`iscore.packed.kernels`, once compiled; the result's `startup`). The commands
    run as a user's do, the kernels left to start on their own (`kernels.AUTO_TOKENS`)."""
    run.say("timing start-up in fresh processes")
    env = {**_env(), kernels.ENV: "auto"}

    def seconds(*args: str) -> float:
        return best(
            run.repeats,
            lambda: subprocess.run(
                [sys.executable, *args],
                check=True,
                capture_output=True,
                cwd=package_root(),
                env=env,
            ),
        )

    with tempfile.TemporaryDirectory(prefix="iscore-bench-") as tmp:
        small = Path(tmp) / "small.parquet"
        write_simulated(small, SimConfig("dense_bf16", sequences=100, steps=1, seed=0))
        validate_s = seconds("-m", "iscore.cli", "validate", str(small))
    record = {
        "help_s": seconds("-m", "iscore.cli", "--help"),
        "presets_s": seconds("-m", "iscore.cli", "presets"),
        "validate_s": validate_s,
        "import_engine_s": seconds("-c", "import iscore.passes.analysis"),
        "python_s": seconds("-c", "pass"),
    }
    if kernels.available():
        argv = [sys.executable, "-c", _KERNELS_SCRIPT]
        with_kernels = {**env, kernels.ENV: "numba"}
        subprocess.run(argv, check=True, capture_output=True, env=with_kernels)  # compiled
        record["kernels_s"] = min(
            _seconds_in_fresh_process(argv, with_kernels) for _ in range(max(run.repeats, 1))
        )
    rows = (
        row("start-up: iscore --help", record["help_s"], None),
        row("start-up: iscore presets", record["presets_s"], None),
        row("start-up: iscore validate (100 sequences)", record["validate_s"], None),
        row("start-up: import the engine", record["import_engine_s"], None),
        *(
            [row("start-up: load numba and the kernels", record["kernels_s"], None)]
            if "kernels_s" in record
            else []
        ),
    )
    return Measured(rows=rows, entries={"startup": record})


_MEMORY_SCRIPT = """
import json, resource, sys, time
import iscore
from iscore.passes.analysis import analyze
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


def memory(run: Run) -> Measured:
    """Peak RSS (MB) of fresh processes: importing iscore only, streaming the whole dump and
    a quarter of its steps through analyze, and loading the dump whole; and the seconds each
    took after the import (`<mode>_s`: one run, no warm-up, as a user's command meets it).
    The result's `memory`: None where `run.memory` is off."""
    if not run.memory:
        return Measured(entries={"memory": None})
    steps = pq.ParquetFile(run.path).metadata.num_row_groups
    part = max(1, steps // 4)
    out: dict[str, Any] = {"chunk_tokens": run.chunk_tokens, "part_steps": part, "steps": steps}
    for mode in ("import", "stream", "stream_part", "load"):
        run.say(f"measuring peak memory: {mode}")
        argv = [sys.executable, "-c", _MEMORY_SCRIPT, mode, str(run.path), str(run.chunk_tokens)]
        argv += [str(part), *run.names]
        done = subprocess.run(argv, capture_output=True, text=True, env=_env(), check=False)
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
    return Measured(entries={"memory": out})
