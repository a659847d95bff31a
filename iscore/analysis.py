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
import json
import os
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from iscore import ops
from iscore.batch import TokenBatch
from iscore.dump import DEFAULT_CHUNK_TOKENS, Dump
from iscore.errors import DumpError
from iscore.impact import SettingStats
from iscore.mismatch import DEFINITIONS, METRIC_NAMES, MismatchStats
from iscore.output import jsonable, output_path
from iscore.sequences import SequenceTable
from iscore.settings import Setting, replay, resolve

SCHEMA_VERSION = 1


@dataclass(slots=True)
class Analysis:
    """The result of `analyze`: plain dicts and lists, JSON-ready.

    Attributes:
        source: what was read (files, layout, steps, sequences, tokens).
        mismatch: the mismatch diagnostics (see `iscore.mismatch`).
        settings: one dict per setting (see `iscore.impact`), in the order given.
    """

    source: dict[str, Any]
    mismatch: dict[str, Any]
    settings: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """The versioned document; NaN and infinities become null (strict JSON)."""
        return jsonable(
            {
                "schema": "iscore.analysis",
                "schema_version": SCHEMA_VERSION,
                "iscore_version": version("iscore"),
                "source": self.source,
                "mismatch": {**self.mismatch, "names": METRIC_NAMES, "definitions": DEFINITIONS},
                "settings": self.settings,
            }
        )

    def write_json(self, path: str | Path) -> None:
        text = json.dumps(self.to_dict(), indent=1, allow_nan=False) + "\n"
        with output_path(path) as tmp:
            Path(tmp).write_text(text)

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
    source: str | Path | Dump | TokenBatch | Sequence[TokenBatch],
    settings: Sequence[Setting] = (),
    *,
    max_tokens: int = DEFAULT_CHUNK_TOKENS,
    device: str | torch.device | None = None,
    progress: Callable[[int], None] | None = None,
    sequences: SequenceTable | None = None,
) -> Analysis:
    """Stream a dump once, computing the mismatch diagnostics and every setting's statistics.

    Args:
        source: a dump path (file, directory, glob), an opened `Dump`, a loaded batch, or
            a list of loaded batches (chunks of whole training steps, analyzed as one dump).
        settings: specs, config mappings, YAML paths or preset names (see `resolve`).
        max_tokens: tokens per streamed chunk; chunks always hold whole training steps, which
            batch-normalizing settings need.
        device: where to compute; default CUDA when available, else CPU.
        progress: called with the number of tokens of each chunk done.
        sequences: a sequence table to fill in the same pass (its settings are `settings`).

    >>> a = analyze("data/fp8.parquet", ["verl:decoupled_geo_rs"])
    >>> a.settings[0]["name"], round(a.settings[0]["lr_scale"], 3)
    ('decoupled_geo_rs', 1.0)
    """
    specs = [resolve(s) for s in settings]
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    mismatch = MismatchStats()
    stats = [SettingStats(spec) for spec in specs]
    where = None
    dump = None
    if isinstance(source, TokenBatch):
        chunks: Any = [source]
        files = []
    elif isinstance(source, list | tuple):
        chunks = list(source)
        files = []
    else:
        dump = source if isinstance(source, Dump) else Dump(source)
        chunks = dump.batches(max_tokens=max_tokens, whole_steps=True)
        files = [f.path for f in dump.files]
        where = None if dump.where is None else dump.where.text
    # The accumulators' per-token temporaries are allocated once for the whole pass.
    heap = _HeapGuard()
    with ops.workspace():
        for chunk in _prefetched(chunks):
            batch = chunk.to(device)
            # d, e^d and the sequence sums every setting needs are computed once per chunk.
            with ops.shared(batch):
                mismatch.update(batch)
                if sequences is not None:
                    sequences.update(batch)
                for i, (spec, acc) in enumerate(zip(specs, stats, strict=True)):
                    replayed = replay(batch, spec)
                    acc.update(batch, replayed)
                    if sequences is not None:
                        sequences.add(i, batch, replayed)
            heap.check()
            if progress is not None:
                progress(batch.num_tokens)
    summary = mismatch.compute()
    if not summary["tokens"]:
        if dump is not None and not summary.get("sequences"):  # none where the dump was read
            raise DumpError(f"{files[0]}: {dump.why_empty()}")
        # Every statistic is a mean over loss tokens: with none, there is nothing to report.
        where = ", ".join(files) or "the batch"
        raise DumpError(
            f"{where}: no token is in the loss (loss_mask false everywhere, or no tokens); "
            "nothing to analyze"
        )
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
        settings=[acc.compute() for acc in stats],
    )
    return result


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
