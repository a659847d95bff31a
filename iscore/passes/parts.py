"""What each step of a chunk adds to an analysis (`StepPart`: its accumulators),
computed here: every run analyzed on its own, so that what a step adds does not depend on the steps
that share its chunk; `analyze` merges them, a followed run merges new ones as they land."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from iscore.dump import (
    Dump,
)
from iscore.frameworks import Spec
from iscore.packed import TokenBatch, kernels, ops
from iscore.passes.replay import replay
from iscore.passes.results_store import (
    StoredPart,
)
from iscore.passes.sequences import SequenceTable
from iscore.passes.streaming import prefetched
from iscore.stats import AttributionStats, MismatchStats, SettingStats
from iscore.utils import Engine, check_engine


@dataclass(slots=True)
class StepPart:
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


def owned_parts(
    dump: Dump,
    specs: Sequence[Spec],
    device: torch.device,
    max_tokens: int,
    owners: list[tuple[str, int]],
) -> Iterator[StepPart]:
    """The parts of `dump` computed here, file by file (each as the results store reads
    it), `owners` getting each one's file and sequences."""
    for index, info in enumerate(dump.files):
        single = dump.piece(index).open()
        batches = single.batches(max_tokens, whole_steps=True, part=True)
        for part in fresh_parts(batches, specs, None, device):
            owners.append((info.path, part.sequences))
            yield part
        dump.dropped.add(single.dropped)


def device_for(device: str | torch.device | None, engine: Engine) -> torch.device:
    """Where to compute: as asked, else CUDA where there is one; on a Ray cluster, the
    workers' CPUs (`check_engine` refuses another device)."""
    check_engine(engine, device)
    if engine == "ray":
        return torch.device("cpu")
    return torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))


def storable(dump: Dump) -> bool:
    """Whether an analysis of `dump` can go through a results store: its files are on disk
    and every sequence read is analyzed (a `where` predicate and `drop_invalid` choose
    sequences chunk by chunk, which the store does not record)."""
    return not (dump.in_memory or dump.imported or dump.where is not None or dump.drop_invalid)


def step_runs(batch: TokenBatch) -> Iterator[tuple[int, TokenBatch]]:
    """(step, its sequences) for each step of a chunk: one part per step, whatever the rows'
    order. A chunk whose steps each come in one run of rows (a dump written step by step)
    yields those runs, in order, viewing the chunk; where the steps interleave (ranks'
    outputs concatenated, `step = seq_id % 8`), each step's sequences are gathered, in the
    order of the steps' first rows, so that what a step adds never depends on how its rows
    are mixed with others' (one run a sequence cost about 7 ms each, and a stored part each).

    >>> b = TokenBatch(rollout=torch.zeros(4), train=torch.zeros(4),
    ...                cu_seqlens=torch.arange(5), step=torch.tensor([1, 0, 1, 0]))
    >>> [(step, run.seq_id.to_pylist()) for step, run in step_runs(b)]
    [(1, [0, 2]), (0, [1, 3])]
    """
    steps = batch.step.cpu().numpy()
    if not steps.size:
        return
    starts = np.flatnonzero(np.r_[True, steps[1:] != steps[:-1]])
    if np.unique(steps[starts]).size == starts.size:  # each step in one run
        ends = [*starts[1:], steps.size]
        for a, b in zip(starts, ends, strict=True):
            yield int(steps[a]), batch if b - a == steps.size else batch.slice(int(a), int(b))
        return
    # The sequences grouped by step (steps in the order of their first rows, each step's
    # sequences in file order), gathered once; then one view per step.
    _, first, inverse = np.unique(steps, return_index=True, return_inverse=True)
    rank = np.argsort(np.argsort(first))[inverse]
    order = np.argsort(rank, kind="stable")
    grouped = batch.take(torch.from_numpy(order), kernels.gather_runs)
    counts = np.bincount(rank)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    for k in range(counts.size):
        yield int(steps[order[bounds[k]]]), grouped.slice(int(bounds[k]), int(bounds[k + 1]))


def fresh_parts(
    chunks: Iterable[TokenBatch],
    specs: Sequence[Spec],
    sequences: SequenceTable | None,
    device: torch.device,
) -> Iterator[StepPart]:
    """The parts of the chunks, each step of a chunk analyzed on its own, so that what a
    step adds does not depend on which steps share its chunk."""
    for chunk in prefetched(chunks):
        for step, run in step_runs(chunk.to(device)):
            yield analyzed(run, step, specs, sequences)


def analyzed(
    run: TokenBatch,
    step: int,
    specs: Sequence[Spec],
    sequences: SequenceTable | None,
    stored: StoredPart | None = None,
) -> StepPart:
    """The part of one step's sequences of a chunk: what `stored` holds of it, the rest
    computed."""
    mismatch = None if stored is None else stored.mismatch()
    attribution = None if stored is None else stored.attribution()
    settings = [None if stored is None else stored.setting(spec) for spec in specs]
    if mismatch is not None and attribution is not None and all(s is not None for s in settings):
        return StepPart(step, run.num_tokens, mismatch, settings, attribution)
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
    return StepPart(step, run.num_tokens, mismatch, settings, attribution)
