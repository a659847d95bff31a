"""`iscore analyze`: one streamed pass over a dump computing the mismatch diagnostics and, for
each correction setting, what it does to the data; as a versioned JSON document or pandas frames.

>>> settings = ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"]
>>> result = analyze("data/long_collapse.parquet", settings)  # doctest: +SKIP
>>> [round(s.lr_scale, 3) for s in result.settings]  # doctest: +SKIP
[0.059, 1.0]

Every field of the JSON document is defined in docs/analysis.md; `SCHEMA_VERSION` changes when a
field changes meaning or disappears.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from iscore.advice import (
    Targets,
    Trend,
    assess,
    attribute,
    find_flags,
    metadata_flags,
    signature_flags,
)
from iscore.dump import (
    DEFAULT_CHUNK_TOKENS,
    Data,
    Dump,
    check_unique,
    open_data,
)
from iscore.errors import ConfigError, DumpError, IscoreError
from iscore.frameworks import Setting, Spec, resolve_all
from iscore.packed import TokenBatch, ops
from iscore.passes.document import Analysis
from iscore.passes.parts import StepPart, device_for, fresh_parts, owned_parts, storable
from iscore.passes.results_store import ResultStore, RunKey, StoredPart
from iscore.passes.sequences import SequenceTable
from iscore.passes.stored import known_footers, part_of, run_key, stored_parts, to_store
from iscore.passes.streaming import HeapGuard
from iscore.passes.tasks import FanOut, task_parts
from iscore.stats import AttributionStats, MismatchStats, SettingStats
from iscore.utils import Engine, default_jobs, ordered, ordered_here


def analyze(
    source: Data | Sequence[TokenBatch],
    settings: Setting | Sequence[Setting] = (),
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    progress: Callable[[int], None] | None = None,
    sequences: SequenceTable | None = None,
    targets: Targets | None = None,
    store: ResultStore | None = None,
    engine: Engine = "local",
    jobs: int | None = None,
) -> Analysis:
    """Stream a dump once, computing the mismatch diagnostics and every setting's statistics.

    Args:
        source: a dump path (file, directory, glob), an opened `Dump`, a loaded batch, or
            a list of loaded batches (chunks of whole training steps, analyzed as one dump).
        settings: a setting or a list of them: specs, config mappings, YAML paths or preset
            names (`iscore.frameworks.resolve.resolve_all`).
        max_tokens: tokens per streamed chunk; chunks always hold whole training steps, which
            batch-normalizing settings need.
        device: where to compute; default CUDA when available, else CPU.
        progress: called with the number of tokens of each chunk done.
        sequences: a sequence table to fill in the same pass (its settings are `settings`).
        targets: what the trend's `setting_degrades` events hold each setting to (default
            `Targets()`, those of `iscore recommend`).
        store: a results store (`iscore.passes.results_store`): the parts of the dump it holds are
            read from it, the others computed and written to it; the result is the same to the
            last digit. Not used for a loaded batch, files held in memory, a `where`
            predicate, `drop_invalid` or `sequences` (`storable`).
        engine: "local" computes here; "ray" on a Ray cluster (`iscore.utils.distributed`): a
            task per file or range of a file's steps, on the workers' CPUs, merged here in
            the order one process reads them (the same result, to about 1e-15 relative: a
            worker sums with one thread). For a dump's files on disk only.
        jobs: with the local engine, worker processes for a dump's files on disk, each one
            thread, fed a file's pieces as Ray tasks are (the same result, to about 1e-15
            relative); default every core on a machine of more than two, else one (this
            process). A dump of one piece (`Dump.pieces`), a GPU, loaded batches or files
            held in memory are analyzed in this process (`worker_jobs`).

    >>> a = analyze("data/fp8.parquet", ["verl:decoupled_geo_rs"])
    >>> a.settings[0].name, round(a.settings[0].lr_scale, 3)
    ('decoupled_geo_rs', 1.0)
    """
    specs = resolve_all(settings)
    device = device_for(device, engine)
    done = accumulate(
        source,
        specs,
        max_tokens=max_tokens,
        device=device,
        progress=progress,
        sequences=sequences,
        store=store,
        engine=engine,
        jobs=jobs,
    )
    total, numbers, dump = done.total, done.numbers, done.plan.dump
    broken = total.mismatch.broken(numbers)
    summary = total.mismatch.compute(numbers, broken)
    flags = find_flags(summary, numbers, broken, total.mismatch.regression, total.mismatch.signs)
    flags += tuple(signature_flags(summary.signatures))
    flags += tuple(metadata_flags(summary.metadata))
    settings_done = [acc.compute(broken) for acc in total.settings]
    return Analysis(
        source={
            "files": done.plan.files,
            "where": None if dump is None or dump.where is None else dump.where.text,
            "dropped": None if dump is None else dump.dropped.to_dict(),
            "steps": [row["step"] for row in summary.by_step],
            "sequences": summary.sequences,
            "loss_tokens": summary.tokens,
            "device": device.type,
        },
        mismatch=summary,
        flags=flags,
        health=assess(summary, flags),
        attribution=attribute(total.attribution.compute(summary, numbers, broken), summary, flags),
        settings=settings_done,
        trend=Trend.of(summary, settings_done, specs, targets or Targets()),
    )


@dataclass(frozen=True, slots=True)
class Accumulated:
    """A dump streamed once into its accumulators (`accumulate`), before anything is computed
    of them.

    Attributes:
        plan: where its parts came from (its `dump`, None for loaded batches; its `files`).
        total: every part merged in order (step -1).
        numbers: the mismatch's per-sequence numbers (`MismatchStats.sequences`).
    """

    plan: _Plan
    total: StepPart
    numbers: dict[str, Any]


def accumulate(
    source: Data | Sequence[TokenBatch],
    specs: Sequence[Spec],
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: torch.device,
    progress: Callable[[int], None] | None = None,
    sequences: SequenceTable | None = None,
    store: ResultStore | None = None,
    engine: Engine = "local",
    jobs: int | None = None,
) -> Accumulated:
    """Stream `source` once through `specs` into the accumulators, merged in the order read,
    as `analyze` (which takes the same arguments) computes its document from them; the run's
    merge kept in `store` where it is kept.

    Raises:
        DumpError: no token is in the loss.
    """
    plan = _plan(source, specs, store, sequences, max_tokens, engine, device, jobs)
    owners: list[tuple[str, int]] = []
    if plan.held is not None:
        found: Iterable[StepPart] = [plan.held]  # no file changed since: their merge, in one entry
    elif plan.fan_out is not None:
        found = task_parts(
            plan.fan_out, plan.dump, specs, plan.kept, max_tokens, sequences, progress, owners
        )
        progress = None  # said as each task finishes
    elif plan.by_file:
        found = stored_parts(plan.dump, specs, store, device, max_tokens, owners)
    else:
        found = fresh_parts(plan.chunks, specs, sequences, device)
    total = _merged(found, specs, progress)
    numbers = total.mismatch.sequences()
    if len({path for path, _ in owners}) > 1:
        check_unique(numbers["step"], numbers["seq_id"], owners)
    if not numbers["T"].sum():
        raise _nothing_to_analyze(plan, max_tokens)
    if plan.run is not None and plan.held is None:
        try:
            plan.kept.save_merged(plan.run, to_store(total, 0, specs, plan.merged))
        except IscoreError as e:
            warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
    return Accumulated(plan, total, numbers)


@dataclass(slots=True)
class _Plan:
    """Where an analysis' parts come from.

    Attributes:
        dump: the dump opened (None for loaded batches); chunks: what is read of it, or the
            batches given.
        by_file: read file by file (through the store, or as tasks): the reader sees one
            file at a time (see `check_unique`), and a file's lack is not the dump's.
        fan_out: how its pieces run as tasks (on Ray, or worker processes); None: here.
        kept: the store the merge of every file is kept in (None where it is not kept); run:
            its key there; merged: what the store holds under it; held: that as a part, where
            it holds every setting (no file changed since).
    """

    dump: Dump | None
    chunks: Any
    by_file: bool
    fan_out: FanOut | None
    kept: ResultStore | None
    run: RunKey | None
    merged: StoredPart | None
    held: StepPart | None

    @property
    def files(self) -> list[str]:
        return [] if self.dump is None else [f.path for f in self.dump.files]


def _plan(
    source: Data | Sequence[TokenBatch],
    specs: Sequence[Spec],
    store: ResultStore | None,
    sequences: SequenceTable | None,
    max_tokens: int,
    engine: Engine,
    device: torch.device,
    jobs: int | None,
) -> _Plan:
    """Open `source` and decide how its parts are read (`_Plan`).

    Raises:
        ConfigError: the Ray engine asked for loaded batches.
    """
    dump = None
    if (
        isinstance(source, list | tuple)
        and source
        and all(isinstance(chunk, TokenBatch) for chunk in source)
    ):
        chunks: Any = list(source)
    elif isinstance(opened := open_data(source, footers=known_footers(source, store)), Dump):
        dump = opened
        chunks = dump.batches(max_tokens=max_tokens, whole_steps=True)
    else:
        chunks = [opened]
    if engine == "ray" and dump is None:
        raise ConfigError(
            "the Ray engine reads a dump's files on its workers; a loaded batch is "
            "analyzed here (engine='local')"
        )
    fan_out: FanOut | None = ordered if engine == "ray" else None
    workers = (
        1 if dump is None or engine != "local" else worker_jobs(dump, jobs, device, max_tokens)
    )
    if workers > 1:
        fan_out = functools.partial(ordered_here, jobs=workers)
    by_file = dump is not None and (
        fan_out is not None or (store is not None and storable(dump) and sequences is None)
    )
    kept = store if by_file and storable(dump) and sequences is None else None
    run = None if kept is None else run_key(dump, device)
    merged = None if run is None else kept.load_merged(run)
    held = None if merged is None else part_of(merged, specs)
    return _Plan(dump, chunks, by_file, fan_out, kept, run, merged, held)


def worker_jobs(dump: Dump, jobs: int | None, device: torch.device, max_tokens: int) -> int:
    """Worker processes for a local analysis of `dump`: `jobs` (default `default_jobs()`),
    at most its pieces of `max_tokens` tokens; 1 (this process) for a GPU, or files that
    another process cannot open (held in memory, or imported).

    Raises:
        ConfigError: `jobs` is not a positive int.
    """
    if jobs is not None and (not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1):
        raise ConfigError(f"Expected argument `jobs` to be an int >= 1, but got {jobs!r}")
    jobs = default_jobs() if jobs is None else jobs
    if jobs == 1 or device.type != "cpu" or dump.in_memory or dump.imported:
        return 1
    pieces = sum(len(dump.pieces(i, max_tokens)) for i in range(len(dump.files)))
    return min(jobs, pieces)


def _merged(
    parts: Iterable[StepPart], specs: Sequence[Spec], progress: Callable[[int], None] | None
) -> StepPart:
    """The parts merged in order into one (step -1), `progress` told each part's tokens."""
    total = StepPart(
        -1, 0, MismatchStats(), [SettingStats(spec) for spec in specs], AttributionStats()
    )
    # The accumulators' per-token temporaries are allocated once for the whole pass.
    heap = HeapGuard()
    with ops.reused_buffers():
        for part in parts:
            total.mismatch.merge(part.mismatch)
            for acc, done in zip(total.settings, part.settings, strict=True):
                acc.merge(done)
            total.attribution.merge(part.attribution)
            total.tokens += part.tokens
            if progress is not None:
                progress(part.tokens)
            heap.check()
    return total


def _nothing_to_analyze(plan: _Plan, max_tokens: int) -> DumpError:
    """The error of a dump with no token in the loss: every statistic is a mean over loss
    tokens, so there is nothing to report."""
    dump = plan.dump
    if dump is not None:
        if plan.by_file:
            # Read file by file, a file's lack is not the dump's: read as one, the dump
            # names its problem (nothing in the loss), else it selected no sequence.
            for _ in dump.batches(max_tokens=max_tokens):
                pass
        return DumpError(f"{plan.files[0]}: {dump.why_empty()}")
    return DumpError(
        "the batch: no token is in the loss (loss_mask false everywhere, or no tokens); "
        "nothing to analyze"
    )


def parts(
    dump: Dump,
    specs: Sequence[Spec],
    *,
    store: ResultStore | None = None,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    engine: Engine = "local",
    jobs: int | None = None,
) -> Iterator[tuple[str, StepPart]]:
    """What each step of each chunk of `dump` adds to an analysis of `specs`, with
    the file it is in, in the order read: from `store` where it holds them (`storable`),
    else computed (here, in worker processes: `jobs`, or on a Ray cluster: `engine`) and
    kept there. `analyze` merges
    them; a followed run (`iscore.passes.follow`) merges new ones as they come."""
    device = device_for(device, engine)
    owners: list[tuple[str, int]] = []
    kept = store if store is not None and storable(dump) else None
    workers = worker_jobs(dump, jobs, device, max_tokens) if engine == "local" else 1
    if engine == "ray" or workers > 1:
        fan_out = ordered if engine == "ray" else functools.partial(ordered_here, jobs=workers)
        found = task_parts(fan_out, dump, specs, kept, max_tokens, None, None, owners)
    elif kept is not None:
        found = stored_parts(dump, specs, kept, device, max_tokens, owners)
    else:
        found = owned_parts(dump, specs, device, max_tokens, owners)
    for part in found:
        yield owners[-1][0], part
