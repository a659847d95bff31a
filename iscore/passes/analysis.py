"""`iscore analyze`: one streamed pass over a dump computing the mismatch diagnostics and, for
each correction setting, what it does to the data; as a versioned JSON document or pandas frames.

>>> settings = ["verl:decoupled_seq_is", "skyrl:skyrl_geo_mask"]
>>> result = analyze("data/long_collapse.parquet", settings)  # doctest: +SKIP
>>> [round(s["lr_scale"], 3) for s in result.settings]  # doctest: +SKIP
[0.059, 1.0]

Every field of the JSON document is defined in docs/analysis.md; `SCHEMA_VERSION` changes when a
field changes meaning or disappears.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from iscore.advice.attribution import attribute
from iscore.advice.flags import find_flags
from iscore.advice.health import assess
from iscore.advice.targets import Targets
from iscore.advice.trend import Trend
from iscore.dump import (
    DEFAULT_CHUNK_TOKENS,
    Data,
    DropReport,
    Dump,
    DumpFile,
    Piece,
    StepRange,
    check_unique,
    open_data,
)
from iscore.errors import ConfigError, DumpError, IscoreError
from iscore.frameworks.resolve import Setting, resolve_all
from iscore.frameworks.spec import Spec
from iscore.packed import ops
from iscore.packed.batch import TokenBatch
from iscore.passes.replay import replay
from iscore.passes.results_store import (
    ATTRIBUTION,
    MISMATCH,
    Context,
    FileIdentity,
    ResultStore,
    RunKey,
    StoredFile,
    StoredPart,
    setting_key,
)
from iscore.passes.sequences import SequenceTable
from iscore.stats.attribution import AttributionStats
from iscore.stats.catalogue import BANDS, DEFINITIONS, METRIC_NAMES
from iscore.stats.mismatch import MismatchStats
from iscore.stats.setting import SettingStats
from iscore.utils.distributed import Engine, Ready, check_engine, ordered
from iscore.utils.footer import Passed
from iscore.utils.output import json_ready, write_json

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Analysis:
    """The result of `analyze`: plain dicts and lists, JSON-ready.

    Attributes:
        source: what was read (files, layout, steps, sequences, tokens).
        mismatch: the mismatch diagnostics (see `iscore.stats.mismatch`).
        settings: one dict per setting (see `iscore.stats.setting`), in the order given.
        trend: the per-step table and its events (see `iscore.advice.trend`).
        attribution: where the mismatch comes from (see `iscore.stats.attribution`).
    """

    source: dict[str, Any]
    mismatch: dict[str, Any]
    settings: list[dict[str, Any]]
    trend: Trend
    attribution: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        """The versioned document; NaN and infinities become null (strict JSON)."""
        return json_ready(
            {
                "schema": "iscore.analysis",
                "schema_version": SCHEMA_VERSION,
                "iscore_version": version("iscore"),
                "source": self.source,
                "mismatch": {
                    **self.mismatch,
                    "names": METRIC_NAMES,
                    "definitions": DEFINITIONS,
                    "bands": BANDS,
                },
                "health": assess(self.mismatch).to_dict(),
                "attribution": self.attribution,
                "settings": self.settings,
                "trend": self.trend.to_dict(),
            }
        )

    def write_json(self, path: str | Path) -> None:
        write_json(self.to_dict(), path)

    def frames(self) -> dict[str, pd.DataFrame]:
        """Tidy tables for notebooks: one row per statistic's unit (step, bucket, setting).

        Keys: `mismatch` (one row), `mismatch_by_step`, `mismatch_by_length`, `mismatch_by_prob`,
        `mismatch_by_pos`, `worst_sequences`, `worst_tokens`, `flags`, `settings` (one row per
        setting), `settings_by_step`, `settings_by_length`, `weight_quantiles` (setting x
        quantile x raw/applied).
        """
        m = self.mismatch
        scalars = {k: v for k, v in m.items() if not isinstance(v, list | dict)}
        out = {
            "mismatch": pd.DataFrame([scalars]),
            **{
                f"mismatch_{key}": pd.DataFrame(m[key])
                for key in ("by_step", "by_length", "by_prob", "by_pos")
            },
            "worst_sequences": pd.DataFrame(m["worst_sequences"]),
            "worst_tokens": pd.DataFrame(m["worst_tokens"]),
            "flags": pd.DataFrame(m["flags"], columns=["code", "message"]),
        }
        rows, by_step, by_length, quantiles = [], [], [], []
        for s in self.settings:
            key = {"setting": s["name"], "framework": s["framework"]}
            rows.append(
                {
                    **key,
                    **{
                        k: v
                        for k, v in s.items()
                        if not isinstance(v, list | dict) and k not in key
                    },
                }
            )
            by_step += [{**key, **row} for row in s["by_step"]]
            by_length += [{**key, **row} for row in s["by_length"]]
            for kind in ("weight", "raw"):
                quantiles += [
                    {**key, "of": kind, "quantile": float(q[1:]) / 100, "value": v}
                    for q, v in s[f"{kind}_quantiles"].items()
                ]
        out["settings"] = pd.DataFrame(rows)
        out["settings_by_step"] = pd.DataFrame(by_step)
        out["settings_by_length"] = pd.DataFrame(by_length)
        out["weight_quantiles"] = pd.DataFrame(quantiles)
        return out


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

    >>> a = analyze("data/fp8.parquet", ["verl:decoupled_geo_rs"])
    >>> a.settings[0]["name"], round(a.settings[0]["lr_scale"], 3)
    ('decoupled_geo_rs', 1.0)
    """
    specs = resolve_all(settings)
    device = _device(device, engine)
    mismatch = MismatchStats()
    attribution = AttributionStats()
    stats = [SettingStats(spec) for spec in specs]
    dump = None
    if (
        isinstance(source, list | tuple)
        and source
        and all(isinstance(chunk, TokenBatch) for chunk in source)
    ):
        chunks: Any = list(source)
    elif isinstance(opened := open_data(source, footers=_footers(source, store)), Dump):
        dump = opened
        chunks = dump.batches(max_tokens=max_tokens, whole_steps=True)
    else:
        chunks = [opened]
    files = [] if dump is None else [f.path for f in dump.files]
    where = None if dump is None or dump.where is None else dump.where.text
    owners: list[tuple[str, int]] = []
    if engine == "ray" and dump is None:
        raise ConfigError(
            "the Ray engine reads a dump's files on its workers; a loaded batch is "
            "analyzed here (engine='local')"
        )
    # Read file by file (through the store, or on Ray), the reader sees one file at a time
    # (see check_unique), and a file's lack is not the dump's (see below).
    by_file = dump is not None and (
        engine == "ray" or (store is not None and storable(dump) and sequences is None)
    )
    tick = progress
    kept = store if by_file and storable(dump) and sequences is None else None
    run = None if kept is None else _run_key(dump, device)
    merged = None if run is None else kept.load_merged(run)
    held = None if merged is None else _part_of(merged, specs)
    if held is not None:
        parts: Iterable[Part] = [held]  # no file changed since: their merge, in one entry
    elif engine == "ray":
        parts = _ray_parts(dump, specs, kept, max_tokens, sequences, progress, owners)
        tick = None  # said as each task finishes
    elif by_file:
        parts = _stored_parts(dump, specs, store, device, max_tokens, owners)
    else:
        parts = _fresh_parts(chunks, specs, sequences, device)
    # The accumulators' per-token temporaries are allocated once for the whole pass.
    heap = _HeapGuard()
    tokens = 0
    with ops.reused_buffers():
        for part in parts:
            mismatch.merge(part.mismatch)
            for acc, done in zip(stats, part.settings, strict=True):
                acc.merge(done)
            attribution.merge(part.attribution)
            tokens += part.tokens
            if tick is not None:
                tick(part.tokens)
            heap.check()
    if len({path for path, _ in owners}) > 1:
        seen = mismatch.sequences()
        check_unique(seen["step"], seen["seq_id"], owners)
    numbers = mismatch.sequences()
    broken = mismatch.broken(numbers)
    summary = mismatch.compute(numbers, broken)
    summary["flags"] = find_flags(summary, numbers, broken, mismatch.regression, mismatch.signs)
    if not summary["tokens"]:
        if dump is not None:
            if by_file:
                # Read file by file, a file's lack is not the dump's: read as one, the dump
                # names its problem (nothing in the loss), else it selected no sequence.
                for _ in dump.batches(max_tokens=max_tokens):
                    pass
            raise DumpError(f"{files[0]}: {dump.why_empty()}")
        # Every statistic is a mean over loss tokens: with none, there is nothing to report.
        where = ", ".join(files) or "the batch"
        raise DumpError(
            f"{where}: no token is in the loss (loss_mask false everywhere, or no tokens); "
            "nothing to analyze"
        )
    if run is not None and held is None:
        total = Part(-1, tokens, mismatch, stats, attribution)
        try:
            kept.save_merged(run, _to_store(total, 0, specs, merged))
        except IscoreError as e:
            warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
    settings_done = [acc.compute(broken) for acc in stats]
    result = Analysis(
        source={
            "files": files,
            "where": where,
            "dropped": None if dump is None else dump.dropped.to_dict(),
            "steps": [row["step"] for row in summary["by_step"]],
            "sequences": summary.get("sequences", 0),
            "loss_tokens": summary.get("tokens", 0),
            "device": device.type,
        },
        mismatch=summary,
        settings=settings_done,
        trend=Trend.of(summary, settings_done, specs, targets or Targets()),
        attribution=attribute(attribution.compute(summary, numbers, broken), summary).to_dict(),
    )
    return result


@dataclass(slots=True)
class Part:
    """What one training step of one chunk adds to an analysis: the accumulators of its
    mismatch and of each setting, merged in order into the dump's (the unit a results store
    keeps, `iscore.passes.results_store`).

    Attributes:
        step: the training step.
        tokens: its tokens (in the loss or not).
        mismatch: its mismatch diagnostics' accumulator.
        settings: each setting's accumulator, in the analysis' order.
        attribution: what the attribution's findings need beyond the mismatch's.
    """

    step: int
    tokens: int
    mismatch: MismatchStats
    settings: list[SettingStats]
    attribution: AttributionStats

    @property
    def sequences(self) -> int:
        return sum(steps.size for steps in self.mismatch.steps)


def parts(
    dump: Dump,
    specs: Sequence[Spec],
    *,
    store: ResultStore | None = None,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    engine: Engine = "local",
) -> Iterator[tuple[str, Part]]:
    """What each run of one step's sequences of `dump` adds to an analysis of `specs`, with
    the file it is in, in the order read: from `store` where it holds them (`storable`),
    else computed (here, or on a Ray cluster: `engine`) and kept there. `analyze` merges
    them; a followed run (`iscore.passes.follow`) merges new ones as they come."""
    device = _device(device, engine)
    owners: list[tuple[str, int]] = []
    kept = store if store is not None and storable(dump) else None
    if engine == "ray":
        found = _ray_parts(dump, specs, kept, max_tokens, None, None, owners)
    elif kept is not None:
        found = _stored_parts(dump, specs, kept, device, max_tokens, owners)
    else:
        found = _owned(dump, specs, device, max_tokens, owners)
    for part in found:
        yield owners[-1][0], part


def _owned(
    dump: Dump,
    specs: Sequence[Spec],
    device: torch.device,
    max_tokens: int,
    owners: list[tuple[str, int]],
) -> Iterator[Part]:
    """The parts of `dump` computed here, file by file (each as the results store reads
    it), `owners` getting each one's file and sequences."""
    for index, info in enumerate(dump.files):
        single = dump.piece(index).open()
        batches = single.batches(max_tokens, whole_steps=True, part=True)
        for part in _fresh_parts(batches, specs, None, device):
            owners.append((info.path, part.sequences))
            yield part
        dump.dropped.add(single.dropped)


def _device(device: str | torch.device | None, engine: Engine) -> torch.device:
    """Where to compute: as asked, else CUDA where there is one; on a Ray cluster, the
    workers' CPUs (`check_engine` refuses another device)."""
    check_engine(engine, device)
    if engine == "ray":
        return torch.device("cpu")
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def _run_key(dump: Dump, device: torch.device) -> RunKey | None:
    """The key of the merge of every file of `dump` in the store (None where a file has no
    identity: it is still being written, or cannot be read)."""
    files = []
    for info in dump.files:
        identity = FileIdentity.of(info.path)
        if identity is None:
            return None
        files.append(
            (identity, Context(tuple(sorted(info.columns.source.items())), device.type).key)
        )
    return RunKey.of(files, repr(dump.steps), device.type)


def _footers(source: Data | Sequence[TokenBatch], store: ResultStore | None) -> Passed | None:
    """The footers `store` knows to pass the check, for a dump opened here from its path."""
    return None if store is None or isinstance(source, Dump | TokenBatch) else store.footers


def storable(dump: Dump) -> bool:
    """Whether an analysis of `dump` can go through a results store: its files are on disk
    and every sequence read is analyzed (a `where` predicate and `drop_invalid` choose
    sequences chunk by chunk, which the store does not record)."""
    return not (dump.in_memory or dump.imported or dump.where is not None or dump.drop_invalid)


def _runs(batch: TokenBatch) -> Iterator[tuple[int, TokenBatch]]:
    """(step, its sequences) for each run of sequences of one step of a chunk, in order."""
    steps = batch.step.cpu().numpy()
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]]) if steps.size else []
    ends = [*starts[1:], steps.size]
    for a, b in zip(starts, ends, strict=True):
        yield int(steps[a]), batch if b - a == steps.size else batch.slice(int(a), int(b))


def _fresh_parts(
    chunks: Iterable[TokenBatch],
    specs: Sequence[Spec],
    sequences: SequenceTable | None,
    device: torch.device,
) -> Iterator[Part]:
    """The parts of the chunks, each run of one step analyzed on its own, so that what a
    step adds does not depend on which steps share its chunk."""
    for chunk in _prefetched(chunks):
        for step, run in _runs(chunk.to(device)):
            yield _analyzed(run, step, specs, sequences)


def _analyzed(
    run: TokenBatch,
    step: int,
    specs: Sequence[Spec],
    sequences: SequenceTable | None,
    stored: StoredPart | None = None,
) -> Part:
    """The part of one step's run of sequences: what `stored` holds of it, the rest computed."""
    mismatch = None if stored is None else stored.mismatch()
    attribution = None if stored is None else stored.attribution()
    settings = [None if stored is None else stored.setting(spec) for spec in specs]
    if mismatch is not None and attribution is not None and all(s is not None for s in settings):
        return Part(step, run.num_tokens, mismatch, settings, attribution)
    # d, e^d and the sequence sums every setting needs are computed once per run.
    with ops.shared(run):
        if mismatch is None:
            mismatch = MismatchStats()
            mismatch.update(run)
        if attribution is None:
            attribution = AttributionStats()
            attribution.update(run)
        if sequences is not None:
            sequences.update(run)
        for i, spec in enumerate(specs):
            if settings[i] is not None:
                continue
            replayed = replay(run, spec)
            settings[i] = acc = SettingStats(spec)
            acc.update(run, replayed)
            if sequences is not None:
                sequences.add(i, run, replayed)
    return Part(step, run.num_tokens, mismatch, settings, attribution)


def _stored_parts(
    dump: Dump,
    specs: Sequence[Spec],
    store: ResultStore,
    device: torch.device,
    max_tokens: int,
    owners: list[tuple[str, int]],
) -> Iterator[Part]:
    """The parts of `dump`, file by file: from `store` where it holds every part of the
    selected steps with every setting, else read and computed (what the store holds of the
    file reused), and the file's entry written anew when it was read whole. `owners` gets the
    file and number of sequences of each part, in order."""
    whole = dump.steps == StepRange()
    plans = [
        (
            info,
            FileIdentity.of(info.path),
            Context(tuple(sorted(info.columns.source.items())), device.type).key,
        )
        for info in dump.files
    ]
    held: dict[tuple[int, int], StoredPart] = {}  # what the store holds of the file read
    saved: list[StoredPart] = []
    runs: dict[int, int] = {}
    for kind, index, payload in _prefetched(_file_work(dump, plans, store, specs, max_tokens)):
        info, identity, context = plans[index]
        if kind == "stored":
            for part in payload:
                owners.append((info.path, part.sequences))
                yield part
        elif kind == "read":
            # Parts are matched by (step, run): only a file read whole numbers them as stored.
            held = {(p.step, p.run): p for p in payload.parts} if payload and whole else {}
            saved, runs = [], {}
        elif kind == "batch":
            for step, run in _runs(payload.to(device)):
                runs[step] = runs.get(step, -1) + 1
                stored = held.get((step, runs[step]))
                part = _analyzed(run, step, specs, None, stored)
                owners.append((info.path, part.sequences))
                if whole and identity is not None:
                    saved.append(_to_store(part, runs[step], specs, stored))
                yield part
        elif whole and identity is not None:  # the end of a file read whole
            try:
                store.save(identity, context, StoredFile(saved, complete=True))
            except IscoreError as e:
                warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
                whole = False


def _to_store(part: Part, run: int, specs: Sequence[Spec], stored: StoredPart | None) -> StoredPart:
    """A part as the store keeps it, with the settings the store held of it beside it."""
    states = {} if stored is None else dict(stored.states)
    states[MISMATCH] = part.mismatch.state()
    states[ATTRIBUTION] = part.attribution.state()
    for spec, acc in zip(specs, part.settings, strict=True):
        states[setting_key(spec)] = acc.state()
    return StoredPart(part.step, run, part.tokens, states)


def _file_work(
    dump: Dump,
    plans: Sequence[tuple[DumpFile, FileIdentity | None, str]],
    store: ResultStore,
    specs: Sequence[Spec],
    max_tokens: int,
) -> Iterator[tuple[str, int, Any]]:
    """For each file in order: ("stored", i, its parts) where the store serves it, else
    ("read", i, what the store holds of it or None), ("batch", i, chunk) for each chunk read
    and ("end", i, None)."""
    for index, (_, identity, context) in enumerate(plans):
        stored = None if identity is None else store.load(identity, context)
        served = None if stored is None else _served(stored, specs, dump.steps)
        if served is not None:
            yield "stored", index, served
            continue
        yield "read", index, stored
        # A file with no token in the loss is one file of the dump, not all of it (`part`).
        for batch in dump.piece(index).open().batches(max_tokens, whole_steps=True, part=True):
            yield "batch", index, batch
        yield "end", index, None


@dataclass(frozen=True, slots=True)
class _PieceTask:
    """What a Ray task analyzes (`_analyze_piece`): a piece of a dump's file, with what the
    results store holds of it (parts to take settings from), and the sequence table's
    columns where one is filled in the same pass.

    Attributes:
        index: the file's index in its dump; last: whether it is the file's last piece (the
            driver's bookkeeping).
    """

    index: int
    last: bool
    piece: Piece
    specs: tuple[Spec, ...]
    max_tokens: int
    held: tuple[StoredPart, ...] = ()
    table: pa.Schema | None = None


@dataclass(slots=True)
class _PieceDone:
    """What a Ray task hands back: its parts as the store keeps them (plain arrays), the
    tokens read, the sequences `drop_invalid` dropped and its rows of the sequence table."""

    parts: list[StoredPart]
    tokens: int
    dropped: DropReport
    table: SequenceTable | None


def _analyze_piece(task: _PieceTask) -> _PieceDone:
    """A piece analyzed on a Ray worker (on its CPU), as `_stored_parts` analyzes a file."""
    dump = task.piece.open()
    held = {(p.step, p.run): p for p in task.held}
    table = None if task.table is None else SequenceTable(task.table, task.specs)
    runs: dict[int, int] = {}
    done: list[StoredPart] = []
    tokens = 0
    chunks = dump.batches(task.max_tokens, whole_steps=True, part=True)
    with ops.reused_buffers():
        for chunk in _prefetched(chunks):
            tokens += chunk.num_tokens
            for step, run in _runs(chunk):
                runs[step] = runs.get(step, -1) + 1
                stored = held.get((step, runs[step]))
                part = _analyzed(run, step, task.specs, table, stored)
                done.append(_to_store(part, runs[step], task.specs, stored))
    return _PieceDone(done, tokens, dump.dropped, table)


def _ray_parts(
    dump: Dump,
    specs: Sequence[Spec],
    store: ResultStore | None,
    max_tokens: int,
    sequences: SequenceTable | None,
    progress: Callable[[int], None] | None,
    owners: list[tuple[str, int]],
) -> Iterator[Part]:
    """The parts of `dump`, in the order one process reads them: from `store` where it
    holds a file, else analyzed by Ray tasks (a file's pieces of at least `max_tokens`
    tokens, `Dump.pieces`) and kept in the store. `sequences` gets the tasks' rows, the
    dump's `dropped` what they dropped, `progress` each file's tokens as it is done and
    `owners` the file and sequences of each part.

    Raises:
        IscoreError: as one process would raise it, or a task that failed, naming its file.
    """
    whole = dump.steps == StepRange()
    keys: dict[int, tuple[FileIdentity | None, str]] = {}
    saved: list[StoredPart] = []

    def work() -> Iterator[Any]:
        for index, info in enumerate(dump.files):
            stored = None
            if store is not None:
                identity = FileIdentity.of(info.path)
                context = Context(tuple(sorted(info.columns.source.items())), "cpu").key
                keys[index] = identity, context
                stored = None if identity is None else store.load(identity, context)
                served = None if stored is None else _served(stored, specs, dump.steps)
                if served is not None:
                    yield Ready((index, served))
                    continue
            pieces = dump.pieces(index, max_tokens)
            for k, piece in enumerate(pieces):
                held = () if stored is None or not whole else tuple(stored.parts)
                yield _PieceTask(
                    index,
                    k == len(pieces) - 1,
                    piece,
                    tuple(specs),
                    max_tokens,
                    tuple(p for p in held if piece.steps.row_group_may_match(p.step, p.step)),
                    None if sequences is None else sequences.schema,
                )

    def finished(task: _PieceTask, result: _PieceDone) -> None:
        if progress is not None:
            progress(result.tokens)

    tasks = ordered(_analyze_piece, work(), name=lambda task: task.piece.path, done=finished)
    for item, result in tasks:
        if isinstance(item, Ready):
            index, served = result
            for part in served:
                owners.append((dump.files[index].path, part.sequences))
                if progress is not None:
                    progress(part.tokens)
                yield part
            continue
        path = item.piece.path
        dump.dropped.add(result.dropped)
        if sequences is not None:
            sequences.extend(result.table)
        for held in result.parts:
            part = _part_of(held, specs)
            if part is None:
                raise IscoreError(f"{path}: the Ray task's results do not make accumulators")
            owners.append((path, part.sequences))
            yield part
        saved += result.parts
        if item.last:
            identity, context = keys.get(item.index, (None, ""))
            if whole and store is not None and identity is not None:
                try:
                    store.save(identity, context, StoredFile(saved, complete=True))
                except IscoreError as e:
                    warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
                    store = None
            saved = []


def _served(stored: StoredFile, specs: Sequence[Spec], steps: StepRange) -> list[Part] | None:
    """The parts of the selected steps from what the store holds of a file, or None where it
    lacks one (a part, or a setting of one)."""
    if not stored.complete:
        return None
    parts = []
    for held in stored.parts:
        if not steps.row_group_may_match(held.step, held.step):
            continue
        part = _part_of(held, specs)
        if part is None:
            return None
        parts.append(part)
    return parts


def _part_of(held: StoredPart, specs: Sequence[Spec]) -> Part | None:
    """A part from its accumulators' states, or None where one of them is missing."""
    mismatch, attribution = held.mismatch(), held.attribution()
    settings = [held.setting(spec) for spec in specs]
    if mismatch is None or attribution is None or any(s is None for s in settings):
        return None
    return Part(held.step, held.tokens, mismatch, settings, attribution)


class _HeapGuard:
    """Keeps a long stream's resident memory near that of its first chunks.

    Each chunk frees hundreds of MB of temporaries around the few small arrays the
    accumulators keep; glibc's heap then fragments and the resident size creeps up (~10 MB
    per million tokens streamed, none of it live). When it exceeds 1.2x what it was after the
    first chunks, `malloc_trim` hands the free pages back (a few ms; doing it every chunk
    would cost 15% in page faults). A no-op where glibc or /proc is missing.
    """

    def __init__(self) -> None:
        self.chunks = 0
        self.baseline = 0
        try:
            self.trim = ctypes.CDLL("libc.so.6").malloc_trim
            self.page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            self.trim = None

    def resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def check(self) -> None:
        if self.trim is None:
            return
        self.chunks += 1
        try:
            rss = self.resident()
        except OSError:
            self.trim = None
            return
        if self.chunks <= 3:
            self.baseline = max(self.baseline, rss)
        elif rss > 1.2 * self.baseline:
            self.trim(0)


def _prefetched(chunks: Iterable[TokenBatch]) -> Iterator[TokenBatch]:
    """The chunks, read one ahead in a background thread: Parquet decoding (which releases
    the GIL) overlaps the replay of the previous chunk. Errors are raised in the caller."""
    if isinstance(chunks, list):
        yield from chunks
        return
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    done = object()

    def read() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        ready.put((chunk, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put((done, None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            ready.put((done, e))

    thread = threading.Thread(target=read, name="iscore-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            chunk, error = ready.get()
            if error is not None:
                raise error
            if chunk is done:
                return
            yield chunk
    finally:
        stop.set()
        while thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)
