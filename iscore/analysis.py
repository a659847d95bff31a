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
import pyarrow.compute as pc
import torch

from iscore import ops
from iscore.attribution import AttributionStats
from iscore.batch import TokenBatch
from iscore.dump import (
    DEFAULT_CHUNK_TOKENS,
    Data,
    Dump,
    DumpFile,
    DumpProblems,
    StepRange,
    open_data,
)
from iscore.errors import DumpError, IscoreError
from iscore.health import assess
from iscore.impact import SettingStats
from iscore.mismatch import BANDS, DEFINITIONS, METRIC_NAMES, MismatchStats
from iscore.output import json_ready, write_json
from iscore.recommendation import Targets
from iscore.sequences import SequenceTable
from iscore.settings import Setting, replay, resolve_all
from iscore.spec import Spec
from iscore.store import (
    ATTRIBUTION,
    MISMATCH,
    Context,
    FileIdentity,
    ResultStore,
    StoredFile,
    StoredPart,
    setting_key,
)
from iscore.trend import Trend

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Analysis:
    """The result of `analyze`: plain dicts and lists, JSON-ready.

    Attributes:
        source: what was read (files, layout, steps, sequences, tokens).
        mismatch: the mismatch diagnostics (see `iscore.mismatch`).
        settings: one dict per setting (see `iscore.impact`), in the order given.
        trend: the per-step table and its events (see `iscore.trend`).
        attribution: where the mismatch comes from (see `iscore.attribution`).
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
) -> Analysis:
    """Stream a dump once, computing the mismatch diagnostics and every setting's statistics.

    Args:
        source: a dump path (file, directory, glob), an opened `Dump`, a loaded batch, or
            a list of loaded batches (chunks of whole training steps, analyzed as one dump).
        settings: a setting or a list of them: specs, config mappings, YAML paths or preset
            names (`iscore.settings.resolve_all`).
        max_tokens: tokens per streamed chunk; chunks always hold whole training steps, which
            batch-normalizing settings need.
        device: where to compute; default CUDA when available, else CPU.
        progress: called with the number of tokens of each chunk done.
        sequences: a sequence table to fill in the same pass (its settings are `settings`).
        targets: what the trend's `setting_degrades` events hold each setting to (default
            `Targets()`, those of `iscore recommend`).
        store: a results store (`iscore.store`): the parts of the dump it holds are read
            from it, the others computed and written to it; the result is the same to the
            last digit. Not used for a loaded batch, files held in memory, a `where`
            predicate, `drop_invalid` or `sequences` (`storable`).

    >>> a = analyze("data/fp8.parquet", ["verl:decoupled_geo_rs"])
    >>> a.settings[0]["name"], round(a.settings[0]["lr_scale"], 3)
    ('decoupled_geo_rs', 1.0)
    """
    specs = resolve_all(settings)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
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
    elif isinstance(opened := open_data(source), Dump):
        dump = opened
        chunks = dump.batches(max_tokens=max_tokens, whole_steps=True)
    else:
        chunks = [opened]
    files = [] if dump is None else [f.path for f in dump.files]
    where = None if dump is None or dump.where is None else dump.where.text
    owners: list[tuple[str, int]] = []
    by_file = dump is not None and store is not None and storable(dump) and sequences is None
    if by_file:
        parts = _stored_parts(dump, specs, store, device, max_tokens, owners)
    else:
        parts = _fresh_parts(chunks, specs, sequences, device)
    # The accumulators' per-token temporaries are allocated once for the whole pass.
    heap = _HeapGuard()
    with ops.reused_buffers():
        for part in parts:
            mismatch.merge(part.mismatch)
            for acc, done in zip(stats, part.settings, strict=True):
                acc.merge(done)
            attribution.merge(part.attribution)
            if progress is not None:
                progress(part.tokens)
            heap.check()
    if len({path for path, _ in owners}) > 1:
        _check_unique(mismatch, owners)
    summary = mismatch.compute()
    broken = mismatch.broken()
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
        attribution=attribution.compute(summary, mismatch.sequences(), broken).to_dict(),
    )
    return result


@dataclass(slots=True)
class Part:
    """What one training step of one chunk adds to an analysis: the accumulators of its
    mismatch and of each setting, merged in order into the dump's (the unit a results store
    keeps, `iscore.store`).

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
) -> Iterator[Part]:
    """What each run of one step's sequences of `dump` adds to an analysis of `specs`, in
    the order read: from `store` where it holds them (`storable`), else computed (and kept
    there). `analyze` merges them; a followed run (`iscore.follow`) merges new ones as they
    come."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if store is not None and storable(dump):
        return _stored_parts(dump, specs, store, device, max_tokens, [])
    return _fresh_parts(dump.batches(max_tokens, whole_steps=True), specs, None, device)


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
    for index, (info, identity, context) in enumerate(plans):
        stored = None if identity is None else store.load(identity, context)
        served = None if stored is None else _served(stored, specs, dump.steps)
        if served is not None:
            yield "stored", index, served
            continue
        yield "read", index, stored
        single = Dump(info.path, columns=dump.columns, steps=dump.steps)
        sequences = tokens = in_loss = 0
        try:
            for batch in single.batches(max_tokens=max_tokens, whole_steps=True):
                sequences += batch.num_sequences
                tokens += batch.num_tokens
                in_loss += int(batch.loss_mask.sum())
                yield "batch", index, batch
        except DumpProblems as e:
            # A file with no token in the loss is one file of the dump, not all of it.
            if in_loss or e.problems != (single.nothing_in_loss(sequences, tokens),):
                raise
        yield "end", index, None


def _served(stored: StoredFile, specs: Sequence[Spec], steps: StepRange) -> list[Part] | None:
    """The parts of the selected steps from what the store holds of a file, or None where it
    lacks one (a part, or a setting of one)."""
    if not stored.complete:
        return None
    parts = []
    for held in stored.parts:
        if not steps.row_group_may_match(held.step, held.step):
            continue
        mismatch, attribution = held.mismatch(), held.attribution()
        settings = [held.setting(spec) for spec in specs]
        if mismatch is None or attribution is None or any(s is None for s in settings):
            return None
        parts.append(Part(held.step, held.tokens, mismatch, settings, attribution))
    return parts


def _check_unique(mismatch: MismatchStats, owners: Sequence[tuple[str, int]]) -> None:
    """Refuse a sequence (step, seq_id) found in two files: a dump read through the store is
    read file by file, so the reader's own check sees one file at a time.

    Raises:
        DumpError: naming the sequence and both files.
    """
    s = mismatch.sequences()
    table = pa.table({"step": s["step"], "seq_id": s["seq_id"]})
    counts = table.group_by(["step", "seq_id"]).aggregate([("step", "count")])
    repeated = counts.filter(pc.greater(counts["step_count"], 1))
    if not repeated.num_rows:
        return
    step, sid = repeated["step"][0].as_py(), repeated["seq_id"][0]
    where = np.flatnonzero(
        (s["step"] == step) & pc.equal(s["seq_id"], sid).to_numpy(zero_copy_only=False)
    )
    file_of = np.repeat([path for path, _ in owners], [n for _, n in owners])
    first, second = file_of[where[0]], file_of[where[1]]
    raise DumpError(
        f"{second}: sequence (step {step}, seq_id {sid.as_py()!r}) is also in {first}; a "
        "sequence's rows belong in one file"
    )


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
