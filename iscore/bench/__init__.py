"""`iscore bench`: how fast iscore replays and summarizes a dump, against what it replaces.

`run_bench` simulates a long-tailed dump (or reuses one), then times, on this machine:

- `read`: pyarrow reading the columns iscore needs (the floor any tool pays);
- `load`: `iscore.load` of the whole dump;
- `analyze, streamed`: `iscore.passes.analysis` of the dump from disk with the settings (read,
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
- `runs`: a simulated run of 1,000 small step files analyzed once through an empty results
  store, then again from it; its per-step trend opened from the store; and a new step
  landing in the followed run, against that step's file analyzed alone;
- `store`: the bench dump analyzed with no results store, through an empty one and from the
  filled one, each entry's size against its dump; and a copy whose steps interleave row by
  row against the same sequences sorted by step;
- `cores`: the streamed analyze in worker processes (every core, at least 2), cold and warm,
  against one worker's compute (a process of one thread) and one process;
- `compare`: `iscore diff` of two arms of consecutive whole steps, against one analyze;
- peak memory (fresh subprocesses): streaming the whole dump, streaming a quarter of it, and
  loading it whole;
- with CUDA: the replay of the settings on chunks resident on the GPU, and including the
  host-to-device copies.

Each time is the best of `repeats` runs (the machine may be shared). The result is a dict
(JSON-ready); `format_table` renders its table. Ratios compare seconds per token.
`where_overhead` is a separate run: what `--where` adds to a streamed analyze.

The package, by responsibility:

- `harness`: `run_bench` and the list of measurements it runs, `format_table`;
- `base`: what a measurement is given (`Run`) and returns (`Measured`), rows and timing;
- `data`: the bench dump, simulated or reused, and prefixes of whole steps;
- `throughput`, `interactive`, `processes`, `writer`, `runs`, `store`, `cores`, `compare`: the
  measurements (read, load, analyze, replay, CUDA; Tuner and app latency; marginal cost,
  start-up and peak memory in fresh processes; the dump writer; a run's store, trend and new
  steps; the store on one large dump, and interleaved steps; worker processes);
- `goals`: the goals and how each is judged;
- `baselines`: the padded torch and pandas implementations and their comparison with iscore;
- `where`: the `--where` benchmark.

The engine never imports this package (only the CLI's `bench` command does, when it runs).

>>> result = run_bench(tokens=50_000, repeats=1, memory=False)  # doctest: +SKIP
>>> print(format_table(result))  # doctest: +SKIP

Rule: measures the floors below it through their faces; nothing below imports it.
"""

from iscore.bench.base import SETTINGS
from iscore.bench.goals import GOALS
from iscore.bench.harness import MEASUREMENTS, format_table, run_bench
from iscore.bench.where import WHERE_GOAL, WHERE_PREDICATES, format_where, where_overhead

__all__ = [
    "GOALS",
    "MEASUREMENTS",
    "SETTINGS",
    "WHERE_GOAL",
    "WHERE_PREDICATES",
    "format_table",
    "format_where",
    "run_bench",
    "where_overhead",
]
