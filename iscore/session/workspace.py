"""The workspace of an interactive front end: dumps held in memory, and one loaded dump with
everything derived from it (summaries, diagnostics, settings, tuners) computed on demand and
cached.

Headless (no streamlit): the app caches `Workspace` objects and calls their methods; every
number it shows comes from here or from the modules these call.

>>> from iscore.frameworks.resolve import presets
>>> ws = open_path("data/dense_bf16.parquet")
>>> round(ws.analysis([presets()["verl:decoupled_geo_rs"]]).settings[0].lr_scale, 3)
1.0
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from iscore.advice import Recommendation, Targets, Trend, Tuner, grid, recommend
from iscore.dump import (
    PROVENANCE_KEY,
    ROWS,
    DropReport,
    Dump,
    Preview,
    StepRange,
    Where,
    describe_runs,
    importers,
    is_framework_dump,
    preview_table,
    resolve_files,
)
from iscore.errors import DumpError, quote
from iscore.frameworks import Spec
from iscore.packed import TokenBatch, ops
from iscore.passes import Analysis, analyze, batch_schema, catalog, sequence_table
from iscore.session.budget import check_paths, check_upload
from iscore.stats import SettingStats, SettingSummary, broken_sequences
from iscore.utils import ROW_LIMIT, TIMEOUT_S, Result, list_files, query, storage

T = TypeVar("T")

# --------------------------------------------------------------------------------------------
# Dumps held in memory (uploads): never written to disk.


def digest(files: Sequence[tuple[str, bytes]]) -> str:
    """sha256 over the files' contents, in order (names do not count).

    >>> digest([("a.parquet", b"x")]) == digest([("b.parquet", b"x")])
    True
    """
    whole = hashlib.sha256()
    for _, data in files:
        whole.update(hashlib.sha256(data).digest())
    return whole.hexdigest()


# --------------------------------------------------------------------------------------------
# One loaded dump and what is derived from it.


def select_steps(batch: TokenBatch, steps: StepRange) -> TokenBatch:
    """The sequences of `batch` whose training step lies in `steps` (the batch itself if all).

    >>> b = TokenBatch(rollout=torch.zeros(3), train=torch.zeros(3),
    ...                cu_seqlens=torch.tensor([0, 2, 3]), step=torch.tensor([4, 5]))
    >>> select_steps(b, StepRange(5, 5)).lengths.tolist()
    [1]
    """
    keep = torch.ones(batch.num_sequences, dtype=torch.bool, device=batch.device)
    if steps.lo is not None:
        keep &= batch.step >= steps.lo
    if steps.hi is not None:
        keep &= batch.step <= steps.hi
    return batch if bool(keep.all()) else batch.select(keep)


def summarize(batch: TokenBatch, bins: int = 40) -> dict[str, Any]:
    """Counts, length quantiles and a pre-binned length histogram (`edges`, `counts`)."""
    lengths = batch.lengths.cpu().numpy()
    counts, edges = np.histogram(lengths, bins=min(bins, max(int(np.ptp(lengths)), 1)))
    return {
        "steps": sorted(int(s) for s in torch.unique(batch.step).tolist()),
        "sequences": batch.num_sequences,
        "tokens": batch.num_tokens,
        "loss_tokens": int(batch.loss_mask.sum()),
        "length": {
            "min": int(lengths.min()),
            **{f"p{q}": round(float(np.quantile(lengths, q / 100))) for q in (10, 50, 90, 99)},
            "max": int(lengths.max()),
        },
        "length_hist": {"edges": edges.tolist(), "counts": counts.tolist()},
    }


def sequence_tokens(batch: TokenBatch, step: int, seq_id: Any) -> dict[str, np.ndarray]:
    """The per-token values of sequence (`step`, `seq_id`): pos, rollout, train, d, loss_mask.

    Raises:
        DumpError: no such sequence in the batch.
    """
    i = _find(batch, step, seq_id)
    a, b = int(batch.cu_seqlens[i]), int(batch.cu_seqlens[i + 1])
    rollout = batch.rollout[a:b].cpu().numpy()
    train = batch.train[a:b].cpu().numpy()
    return {
        "pos": batch.positions()[a:b].cpu().numpy(),
        "rollout": rollout,
        "train": train,
        "d": train.astype(np.float64) - rollout.astype(np.float64),
        "loss_mask": batch.loss_mask[a:b].cpu().numpy(),
    }


def _find(batch: TokenBatch, step: int, seq_id: Any) -> int:
    """The index of sequence (`step`, `seq_id`) in `batch`.

    Raises:
        DumpError: no such sequence in the batch.
    """
    ids = batch.seq_id
    try:
        same_id = pc.equal(ids, pa.scalar(seq_id, type=ids.type)).to_numpy(zero_copy_only=False)
    except (pa.ArrowException, TypeError, ValueError):
        same_id = np.zeros(len(ids), dtype=bool)
    hits = np.flatnonzero(same_id & (batch.step.cpu().numpy() == step))
    if not hits.size:
        raise DumpError(f"no sequence seq_id={quote(seq_id)} step={step} in the loaded dump")
    return int(hits[0])


class _Memo:
    """A small thread-safe LRU of computed values (a workspace of a server-side dump is shared
    by every session that opened it). Two callers may compute the same value at once; the
    second result is kept, both are equal."""

    def __init__(self, size: int):
        self._size = size
        self._items: OrderedDict[Hashable, Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: Hashable, compute: Callable[[], T]) -> T:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        value = compute()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._size:
                self._items.popitem(last=False)
        return value


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a workspace's dump came from, for display.

    Attributes:
        name: a short label (the file name, or how many files).
        files: the files read (paths, or upload names).
        layout: "token" or "sequence".
        columns: canonical column -> the file's column it was read from.
        dropped: what `drop_invalid` left out.
        provenance: for a dump imported from a framework's own files, one line per file
            saying which framework, source files and steps (empty otherwise).
        preview: the first file's columns and first rows (for an imported dump, of the table
            it was converted to).
    """

    name: str
    files: tuple[str, ...]
    layout: str
    columns: tuple[tuple[str, str], ...]
    dropped: DropReport = field(default_factory=DropReport)
    provenance: tuple[str, ...] = ()
    preview: Preview | None = None

    @property
    def unused(self) -> tuple[str, ...]:
        """The first file's columns that look like log-probs but feed no canonical column."""
        if self.preview is None:
            return ()
        return self.preview.unused(source for _, source in self.columns)


@dataclass(frozen=True, slots=True)
class Selection:
    """The sequences the pages look at: training steps, and a slice (a `--where` predicate
    over the sequence table's dump and mismatch columns, `iscore.passes.sequences`) or None.

    >>> Selection(StepRange(3, 7), "length > 4000")
    Selection(steps=StepRange(lo=3, hi=7), where='length > 4000')
    """

    steps: StepRange = field(default_factory=StepRange)
    where: str | None = None


class Workspace:
    """A loaded dump and everything derived from it, computed on first use and memoized.

    Every method takes the sequences to look at: a `Selection` (or just a `StepRange` of
    training steps; None for all); results are memoized per selection (and per setting), so
    moving back to an earlier selection is free.

    Args:
        batch: the whole dump, loaded (with its per-sequence columns in `extra`).
        source: where it came from.
        dump: the opened dump, whose files the `tokens` view of queries reads (None: queries
            see only the sequence table).
    """

    def __init__(self, batch: TokenBatch, source: Origin, dump: Dump | None = None):
        self.source = source
        self.dump = dump
        self.full = batch
        self.steps = sorted(int(s) for s in torch.unique(batch.step).tolist())
        self._batches = _Memo(4)  # selection -> (its batch, the ops.Shared kept for it)
        self._sharing = threading.Lock()  # one replay at a time over a kept ops.Shared
        self._summaries = _Memo(8)
        self._mismatch = _Memo(8)
        self._settings = _Memo(128)
        self._tuners = _Memo(2)
        self._grids = _Memo(16)
        self._other = _Memo(32)

    @classmethod
    def from_dump(cls, dump: Dump, progress: Callable[[float], None] | None = None) -> Workspace:
        """Load `dump` whole; `progress` is called with the share of its tokens read so far."""
        total, done = max(dump.num_tokens, 1), 0

        def read(tokens: int) -> None:
            nonlocal done
            done += tokens
            if progress is not None:
                progress(min(done / total, 1.0))

        batch = dump.load(progress=read)
        files = tuple(f.path for f in dump.files)
        name = Path(files[0]).name if len(files) == 1 else f"{len(files)} files"
        columns = tuple(dump.files[0].columns.source.items())
        provenance = (
            *describe_runs(dump.provenance),
            *(
                f"imported from {p['framework']}: {', '.join(map(str, p.get('source_files', [])))} "
                f"(steps {', '.join(map(str, p.get('steps', [])))})"
                for p in dump.provenance
                if p.get("framework") and "rank" not in p
            ),
        )
        preview = preview_table(files[0], dump.head(ROWS))
        source = Origin(name, files, dump.layout, columns, dump.dropped, provenance, preview)
        return cls(batch, source, dump)

    def selection(self, steps: Selection | StepRange | None) -> Selection:
        """The selection in one canonical form (a step range covering every step is all
        steps): one memo entry per distinct set of sequences asked for the same way."""
        chosen = steps if isinstance(steps, Selection) else Selection(steps or StepRange())
        lo, hi = chosen.steps.lo, chosen.steps.hi
        if (lo is None or lo <= self.steps[0]) and (hi is None or hi >= self.steps[-1]):
            chosen = replace(chosen, steps=StepRange())
        return chosen

    def where(self, text: str) -> Where:
        """A predicate checked against this dump's sequence columns.

        Raises:
            QueryError: not a boolean expression over them, naming the problem.
        """
        return self._other.get(("where", text), lambda: Where.compile(text, self.schema))

    @property
    def schema(self) -> pa.Schema:
        """The sequence table's columns that come from the dump."""
        return batch_schema(self.full)

    def batch(self, steps: Selection | StepRange | None = None) -> TokenBatch:
        """The sequences of the selection.

        Raises:
            DumpError: the slice holds no sequence of the selected steps.
            QueryError: the slice is not a predicate over the sequence columns.
        """
        return self._loaded(self.selection(steps))[0]

    def _loaded(self, chosen: Selection) -> tuple[TokenBatch, ops.Shared]:
        """The selection's batch and the intermediates every setting shares, kept with it:
        d, e^d and the sequence sums are computed for the first setting replayed on it."""

        def compute() -> tuple[TokenBatch, ops.Shared]:
            batch = select_steps(self.full, chosen.steps)
            if chosen.where is not None:
                with self.where(chosen.where).judge() as judge:
                    batch = judge.select(batch)
                if not batch.num_sequences:
                    raise DumpError(
                        f"no sequence of the selected steps where {quote(chosen.where)}"
                    )
            return batch, ops.Shared(batch)

        return self._batches.get(chosen, compute)

    def summary(self, steps: Selection | StepRange | None = None) -> dict[str, Any]:
        """`summarize` of the selected steps."""
        steps = self.selection(steps)
        return self._summaries.get(steps, lambda: summarize(self.batch(steps)))

    def mismatch(self, steps: Selection | StepRange | None = None) -> Analysis:
        """The mismatch diagnostics of the selected steps (an analysis without settings)."""
        steps = self.selection(steps)

        def compute() -> Analysis:
            result = analyze(self.batch(steps), [])
            result.source["files"] = list(self.source.files)
            result.source["where"] = steps.where
            result.source["dropped"] = self.source.dropped.to_dict()
            return result

        return self._mismatch.get(steps, compute)

    def setting(self, spec: Spec, steps: Selection | StepRange | None = None) -> SettingSummary:
        """What one setting does to the selected steps (one entry of `Analysis.settings`)."""

        chosen = self.selection(steps)

        def compute() -> SettingSummary:
            broken = self.broken(chosen)  # outside `_sharing`, which it takes too
            batch, cache = self._loaded(chosen)
            with self._sharing, ops.shared(batch, cache):
                stats = SettingStats(spec)
                stats.update(batch, spec.replay(batch))
                return stats.compute(broken)

        return self._settings.get((chosen, spec), compute)

    def broken(self, steps: Selection | StepRange | None = None) -> np.ndarray:
        """bool [B]: the selected sequences `iscore.stats.noise` calls broken."""
        chosen = self.selection(steps)

        def compute() -> np.ndarray:
            batch, cache = self._loaded(chosen)
            with self._sharing, ops.shared(batch, cache):
                return broken_sequences(batch)

        return self._other.get(("broken", chosen), compute)

    def analysis(
        self, specs: Sequence[Spec], steps: Selection | StepRange | None = None
    ) -> Analysis:
        """The analysis of the selected steps with `specs`, each setting computed once (the
        trend joined again with the settings' per-step rows)."""
        base = self.mismatch(steps)
        settings = [self.setting(spec, steps) for spec in specs]
        trend = Trend.of(base.mismatch, settings, specs, Targets())
        return replace(base, settings=settings, trend=trend)

    def tuner(self, steps: Selection | StepRange | None = None) -> Tuner:
        """The sorted statistics of the selected steps, for threshold queries."""
        chosen = self.selection(steps)

        def compute() -> Tuner:
            batch, cache = self._loaded(chosen)
            with self._sharing, ops.shared(batch, cache):
                return Tuner(batch)

        return self._tuners.get(chosen, compute)

    def grid(
        self, family: str, steps: Selection | StepRange | None = None
    ) -> dict[str, list[float]]:
        """`grid` of the selected steps' tuner: slider values per bound of `family`."""
        steps = self.selection(steps)
        return self._grids.get((family, steps), lambda: grid(self.tuner(steps), family))

    def recommend(
        self, framework: str, targets: Targets, steps: Selection | StepRange | None = None
    ) -> Recommendation:
        """`recommend` on the selected steps: the framework's candidates ranked for `targets`."""
        steps = self.selection(steps)
        return self._other.get(
            ("recommend", framework, targets, steps),
            lambda: recommend(self.batch(steps), framework, targets),
        )

    def sequences(
        self, specs: Sequence[Spec], steps: Selection | StepRange | None = None
    ) -> pa.Table:
        """The sequence table of the selection with the columns of `specs`."""
        chosen = self.selection(steps)
        return self._other.get(
            ("sequences", tuple(specs), chosen),
            lambda: sequence_table(self.batch(chosen), specs),
        )

    def query(
        self,
        text: str,
        specs: Sequence[Spec],
        steps: Selection | StepRange | None = None,
        *,
        limit: int = ROW_LIMIT,
        timeout: float = TIMEOUT_S,
    ) -> Result:
        """A DuckDB SELECT over the selection's `sequences` table (with the columns of
        `specs`) and the `tokens` view of the dump, at most `limit` rows within `timeout`
        seconds.

        Raises:
            QueryError: the query is not valid or not allowed, fails or runs out of time.
        """
        table = self.sequences(specs, steps)
        tables, views = catalog(table, text, self.dump)
        return query(tables, text, views=views, limit=limit, timeout=timeout)

    def sequence_weights(
        self, specs: Sequence[Spec], step: int, seq_id: Any, steps: Selection | StepRange | None
    ) -> dict[Spec, np.ndarray]:
        """float32 per-token weight of sequence (`step`, `seq_id`) under each setting, replayed
        on its step of the selection (settings that normalize over a step see all of it)."""
        chosen = self.selection(steps)

        def compute() -> dict[Spec, np.ndarray]:
            batch = select_steps(self.batch(chosen), StepRange(step, step))
            index = _find(batch, step, seq_id)
            a, b = int(batch.cu_seqlens[index]), int(batch.cu_seqlens[index + 1])
            return {spec: spec.replay(batch).weight[a:b].cpu().numpy() for spec in specs}

        return self._other.get(("weights", tuple(specs), chosen, step, seq_id), compute)

    def cached(self, key: Hashable, compute: Callable[[], T]) -> T:
        """Anything else derived from this dump, memoized with it under `key`."""
        return self._other.get(key, compute)

    def sequence(self, step: int, seq_id: Any) -> dict[str, np.ndarray]:
        """`sequence_tokens` of one sequence of the dump."""
        return sequence_tokens(self.full, step, seq_id)


def open_path(
    source: str | Sequence[str],
    *,
    columns: Mapping[str, str | None] | None = None,
    drop_invalid: bool = False,
    allow_pickle: bool = False,
    max_tokens: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> Workspace:
    """Load a dump on this machine: a file, a directory, a glob, or a list of those; Parquet,
    or a framework's own dump (imported in memory, see `iscore.dump.importers`).

    Args:
        source: where the dump is.
        columns: canonical -> source column names, winning over the aliases (None leaves an
            optional column out).
        drop_invalid: drop sequences with invalid log-probs instead of failing.
        allow_pickle: read pickled files (`.pt`, `.pkl`) named in `source`; refused without.
        max_tokens: the most tokens the dump may hold, checked before anything is decoded
            (`iscore.session.budget.check_paths`).
        progress: called with the share of the dump's tokens read so far.

    Raises:
        DumpProblems: the dump has problems (all listed).
        DumpError: nothing matches `source`, too many tokens, or a pickled file without
            `allow_pickle`.
    """
    names = [source] if isinstance(source, str) else list(source)
    _refuse_pickles(names, allow_pickle)
    if max_tokens is not None:
        check_paths([path for name in names for path, _, _ in fingerprint(name)], max_tokens)
    return Workspace.from_dump(
        Dump(
            source,
            columns=columns,
            drop_invalid=drop_invalid,
            allow_pickle=allow_pickle,
            extras=True,
        ),
        progress,
    )


def open_uploads(
    files: Sequence[tuple[str, bytes]],
    *,
    columns: Mapping[str, str | None] | None = None,
    drop_invalid: bool = False,
    allow_pickle: bool = False,
    max_tokens: int | None = None,
    progress: Callable[[float], None] | None = None,
) -> Workspace:
    """Load a dump from (name, bytes) pairs held in memory, never written to disk: Parquet
    files, and a framework's own dump (JSON Lines, `.pt`, `.pkl`, told by the names'
    suffixes), imported in memory by `iscore.dump.importers.read_buffers`.

    Args:
        files: the uploads.
        columns, drop_invalid, allow_pickle, progress: as `open_path`.
        max_tokens: the most tokens the dump may hold, checked before anything is decoded
            (`iscore.session.budget.check_upload`), and for a framework dump again once it is
            converted, before it is loaded.

    Raises:
        DumpProblems: the files have problems (all listed).
        DumpError: too many tokens, a pickled file without `allow_pickle`, or a framework
            dump that cannot be imported.
    """
    _refuse_pickles([name for name, _ in files], allow_pickle)
    if max_tokens is not None:
        check_upload(files, max_tokens)
    buffers = [(name, data) for name, data in files if not name.endswith(importers.SUFFIXES)]
    framework = [(name, data) for name, data in files if name.endswith(importers.SUFFIXES)]
    if framework:
        table = importers.read_buffers(framework, allow_pickle=allow_pickle)
        fmt = json.loads(table.schema.metadata[PROVENANCE_KEY])["framework"]
        label = framework[0][0] if len(framework) == 1 else f"{len(framework)} files"
        sink = pa.BufferOutputStream()
        pq.write_table(table, sink)
        buffers.append((f"{label} ({fmt})", sink.getvalue().to_pybytes()))
        if max_tokens is not None:
            check_upload(buffers, max_tokens)
    dump = Dump.from_buffers(buffers, columns=columns, drop_invalid=drop_invalid, extras=True)
    return Workspace.from_dump(dump, progress)


def _refuse_pickles(names: Sequence[str | Path], allow_pickle: bool) -> None:
    """Raise for the first pickled file among `names` unless `allow_pickle`."""
    if allow_pickle:
        return
    for name in names:
        if str(name).endswith(importers.PICKLED):
            raise DumpError(
                f"{name}: a pickled file; loading one can run code from it, so iscore reads it "
                "only with allow_pickle=True, for files you trust"
            )


def fingerprint(source: str) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of every file a path or glob names: changes when they do.

    Raises:
        DumpError: nothing matches.
    """
    if is_framework_dump(source):  # JSONL / .pt / .pkl files, imported when opened
        paths = sorted(list_files(source, ("",)))
    else:
        paths = resolve_files(source)
    out = []
    for path in paths:
        if storage.is_uri(path):
            out.append((path, *storage.stat(path)))
            continue
        stat = Path(path).stat()
        out.append((str(Path(path).resolve()), stat.st_size, stat.st_mtime_ns))
    return tuple(out)


def worst_sequences_sql(step: int | None = None) -> str:
    """The query of `Workspace.query` that lists the worst sequences, of one step or of all,
    ranked as the mismatch diagnostics rank them (`worst_sequences`): by summed k3, not the
    mean.

    >>> print(worst_sequences_sql(3))
    SELECT step, seq_id, length, k3 * loss_tokens AS k3_sum, abs_diff_max, d_sum
    FROM sequences WHERE step = 3 ORDER BY k3_sum DESC LIMIT 50
    """
    where = "" if step is None else f"WHERE step = {int(step)} "
    return (
        "SELECT step, seq_id, length, k3 * loss_tokens AS k3_sum, abs_diff_max, d_sum\n"
        f"FROM sequences {where}ORDER BY k3_sum DESC LIMIT 50"
    )
