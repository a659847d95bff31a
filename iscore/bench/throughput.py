"""Throughput measurements: reading the dump, loading it, analyzing and replaying it on the CPU,
and replaying it on CUDA. Each is a `Run -> Measured` of `iscore.bench.base`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pyarrow.parquet as pq
import torch

import iscore
from iscore.bench.base import COLUMNS, Measured, Run, best, row
from iscore.dump import Dump
from iscore.packed import TokenBatch, ops
from iscore.passes import analyze

READ_ROW = "read (pyarrow, needed columns)"
"""The row every `ratio_vs_read` divides by: the floor any tool pays."""


def read(run: Run) -> Measured:
    """pyarrow reading the columns iscore needs."""
    run.say("timing the pyarrow read")
    seconds = best(run.repeats, lambda: pq.read_table(run.path, columns=list(COLUMNS)))
    return Measured(rows=(row(READ_ROW, seconds, run.tokens),))


def load(run: Run) -> Measured:
    """`iscore.load` of the whole dump."""
    run.say("timing iscore.load")
    seconds = best(run.repeats, lambda: iscore.load(run.path))
    return Measured(rows=(row("load (iscore.load)", seconds, run.tokens),))


def streamed(run: Run) -> Measured:
    """`analyze` of the dump from disk with the settings: read, replay, every statistic."""
    run.say("timing analyze streamed from disk")
    seconds = best(
        run.repeats,
        lambda: analyze(run.path, run.specs, max_tokens=run.chunk_tokens, device="cpu"),
    )
    name = f"analyze, streamed ({len(run.specs)} settings)"
    return Measured(rows=(row(name, seconds, run.tokens, "e2e_vs_read"),))


def resident(run: Run) -> Measured:
    """analyze and the replays alone on the dump's chunks already in memory (no I/O)."""
    run.say("timing analyze and replay on resident chunks")
    chunks = list(Dump(run.path).batches(max_tokens=run.chunk_tokens, whole_steps=True))
    analyze_s = best(run.repeats, lambda: analyze(chunks, run.specs, device="cpu"))
    replay_s = best(run.repeats, replays(chunks, run.specs))
    return Measured(
        rows=(
            row("analyze, resident chunks", analyze_s, run.tokens),
            row("replay only, resident chunks", replay_s, run.tokens),
        )
    )


def replays(chunks: list[TokenBatch], specs: tuple[Any, ...]) -> Callable[[], None]:
    """A function replaying every setting on every chunk (what a chunk shares, computed once)."""

    def run() -> None:
        for chunk in chunks:
            with ops.shared(chunk):
                for spec in specs:
                    spec.replay(chunk)

    return run


def cuda(run: Run) -> Measured:
    """Replay throughput on the GPU: chunks resident, and including host-to-device copies
    (the result's `cuda`; rows only where CUDA ran)."""
    if run.device == "cpu":
        return Measured(
            entries={"cuda": {"available": torch.cuda.is_available(), "skipped": "device='cpu'"}}
        )
    if not torch.cuda.is_available():
        return Measured(entries={"cuda": {"available": False}})
    run.say("timing the CUDA replay")
    out: dict[str, Any] = {"available": True, "device": torch.cuda.get_device_name()}
    rows = []
    try:
        host = list(Dump(run.path).batches(max_tokens=run.chunk_tokens, whole_steps=True))
        n = sum(c.num_tokens for c in host)
        resident = [c.to("cuda") for c in host]

        def on_gpu() -> None:
            replays(resident, run.specs)()
            torch.cuda.synchronize()

        def with_copies() -> None:
            for chunk in host:
                batch = chunk.to("cuda")
                with ops.shared(batch):
                    for spec in run.specs:
                        spec.replay(batch)
            torch.cuda.synchronize()

        on_gpu()  # warm-up: kernels, allocator
        resident_s = best(max(run.repeats, 3), on_gpu)
        copies_s = best(max(run.repeats, 3), with_copies)
        out.update(
            tokens=n,
            resident_s=resident_s,
            resident_tok_s=n / resident_s,
            with_copies_s=copies_s,
            with_copies_tok_s=n / copies_s,
        )
        rows = [
            row("cuda: replay only, resident", resident_s, n, "cuda_resident_tok_s"),
            row("cuda: replay incl. host-to-device", copies_s, n),
        ]
        try:
            analyze_s = best(run.repeats, lambda: _synced(lambda: analyze(resident, run.specs)))
            out["analyze_resident_s"] = analyze_s
            rows.append(row("cuda: analyze, resident", analyze_s, n))
        except Exception as e:  # the statistics on CUDA are reported, never fatal
            out["analyze_error"] = f"{type(e).__name__}: {e}"
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return Measured(rows=tuple(rows), entries={"cuda": out})


def _synced(fn: Callable[[], Any]) -> Any:
    value = fn()
    torch.cuda.synchronize()
    return value
