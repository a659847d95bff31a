"""The parts of an analysis through a results store (`iscore.passes.results_store`): a file's
parts read back where the store holds them with every setting, else read and computed (what
it holds reused), and the file's entry written anew when it was read whole."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from iscore.dump import (
    Data,
    Dump,
    DumpFile,
    StepRange,
)
from iscore.errors import IscoreError
from iscore.frameworks import Spec
from iscore.packed import TokenBatch
from iscore.passes.parts import StepPart, analyzed, step_runs
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
from iscore.passes.streaming import prefetched
from iscore.utils import Passed


def run_key(dump: Dump, device: torch.device) -> RunKey | None:
    """The key of the merge of every file of `dump` in the store (None where a file has no
    identity: it is still being written, or cannot be read; and for one file, whose own entry
    is read in one piece: its merge would double what the store keeps of it)."""
    if len(dump.files) < 2:
        return None
    files = []
    for info in dump.files:
        identity = FileIdentity.of(info.path)
        if identity is None:
            return None
        files.append(
            (identity, Context(tuple(sorted(info.columns.source.items())), device.type).key)
        )
    return RunKey.of(files, repr(dump.steps), device.type)


def known_footers(source: Data | Sequence[TokenBatch], store: ResultStore | None) -> Passed | None:
    """The footers `store` knows to pass the check, for a dump opened here from its path."""
    return None if store is None or isinstance(source, Dump | TokenBatch) else store.footers


def stored_parts(
    dump: Dump,
    specs: Sequence[Spec],
    store: ResultStore,
    device: torch.device,
    max_tokens: int,
    owners: list[tuple[str, int]],
) -> Iterator[StepPart]:
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
    for kind, index, payload in prefetched(_file_work(dump, plans, store, specs, max_tokens)):
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
            for step, run in step_runs(payload.to(device)):
                runs[step] = runs.get(step, -1) + 1
                stored = held.get((step, runs[step]))
                part = analyzed(run, step, specs, None, stored)
                owners.append((info.path, part.sequences))
                if whole and identity is not None:
                    saved.append(to_store(part, runs[step], specs, stored))
                yield part
        elif whole and identity is not None:  # the end of a file read whole
            try:
                store.save(identity, context, StoredFile(saved, complete=True))
            except IscoreError as e:
                warnings.warn(f"{e}; going on without keeping the results", stacklevel=2)
                whole = False


def to_store(
    part: StepPart, run: int, specs: Sequence[Spec], stored: StoredPart | None
) -> StoredPart:
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
        served = None if stored is None else served_parts(stored, specs, dump.steps)
        if served is not None:
            yield "stored", index, served
            continue
        yield "read", index, stored
        # A file with no token in the loss is one file of the dump, not all of it (`part`).
        for batch in dump.piece(index).open().batches(max_tokens, whole_steps=True, part=True):
            yield "batch", index, batch
        yield "end", index, None


def served_parts(
    stored: StoredFile, specs: Sequence[Spec], steps: StepRange
) -> list[StepPart] | None:
    """The parts of the selected steps from what the store holds of a file, or None where it
    lacks one (a part, or a setting of one)."""
    if not stored.complete:
        return None
    parts = []
    for held in stored.parts:
        if not steps.row_group_may_match(held.step, held.step):
            continue
        part = part_of(held, specs)
        if part is None:
            return None
        parts.append(part)
    return parts


def part_of(held: StoredPart, specs: Sequence[Spec]) -> StepPart | None:
    """A part from its accumulators' states, or None where one of them is missing."""
    mismatch, attribution = held.mismatch(), held.attribution()
    settings = [held.setting(spec) for spec in specs]
    if mismatch is None or attribution is None or any(s is None for s in settings):
        return None
    return StepPart(held.step, held.tokens, mismatch, settings, attribution)
