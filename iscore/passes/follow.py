"""Follow a run that is still being written: its step files are analyzed as they land, and the
trend and its events grow with them (`iscore watch`, the app's `--follow`; docs/runs.md).

A file counts once it is whole (`iscore.passes.results_store.footer_complete`: the Parquet magic at
both ends and a footer that parses); one still being written is skipped until it is. Each `poll`
reads the new files alone (through the results store, where there is one) and recomputes the rows
of the steps they add to, from those steps' parts only (a step written by several ranks
merges its files' parts, in path order): one new step costs that step's analysis, not the
run's, and memory holds the rows, not the run: only the folders whose modification time
changed are listed again, and only the rows of those steps are rebuilt in the trend
(`iscore.advice.trend.GrowingTrend`). A file that changes or disappears after it was read has its
steps recomputed.

With a store, the rows are kept there too, keyed by the run's folder, settings and columns:
opening a run again reads them back and checks each file's size and modification time
instead of reading the files, so a run of a thousand step files opens in well under a second.
Each step's row equals that of `analyze` on the whole folder, to the last digit.

>>> store = ResultStore(default_folder())                           # doctest: +SKIP
>>> run = Follower("run/", ["verl:decoupled_geo_rs"], store=store)   # doctest: +SKIP
>>> update = run.poll()                                              # doctest: +SKIP
>>> [row["step"] for row in update.rows], update.events              # doctest: +SKIP
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch

from iscore.advice import Event, GrowingTrend, Targets, Trend
from iscore.dump import DEFAULT_CHUNK_TOKENS, Dump
from iscore.errors import IscoreError
from iscore.frameworks import Setting, resolve_all
from iscore.passes.analysis import analyze, parts
from iscore.passes.document import Analysis
from iscore.passes.parts import StepPart
from iscore.passes.results_store import Context, ResultStore, footer_complete, setting_key
from iscore.stats import MismatchStats, SettingStats
from iscore.utils import Engine, Predicate, check_engine, json_ready, paths, storage


def ready_files(
    folder: str | Path, known: Mapping[Path, tuple[int, int]] | None = None
) -> dict[Path, tuple[int, int]]:
    """The whole Parquet files below `folder` (every `*.parquet`, as a dump directory is
    read), sorted by path, each with its size and modification time; files still being
    written are left out. A file of `known` with the same size and time is not opened again.

    Raises:
        IscoreError: `folder` is not a directory.
    """
    known = known or {}
    found = _Listing(folder).scan()
    ready = {}
    for name in sorted(found):
        path = _path(name)
        if known.get(path) == found[name] or footer_complete(path):
            ready[path] = found[name]
    return ready


def _path(name: str | Path) -> Path:
    """A local file's Path; an object's URI as it is (a Path would fold its `//`)."""
    return name if storage.is_uri(name) else Path(name)  # type: ignore[return-value]


SETTLED_NS = 2 * 10**9
"""How long a folder's modification time must lie in the past before its listing is kept:
two changes within one tick of the file system's clock leave the time as it was."""


class _Listing:
    """Every `*.parquet` file below a folder, with its size and modification time; a folder
    whose modification time has not changed is not listed again (adding, removing or renaming
    a file changes its folder's time; rewriting one in place does not, so every file is
    still stat'ed). A run of a thousand step folders is polled in a few milliseconds.

    Args:
        folder: the run's folder.
    """

    def __init__(self, folder: str | Path):
        self.folder = folder
        self._root = str(Path(folder))
        # folder -> (its modification time, its subfolders, its *.parquet files)
        self._kept: dict[str, tuple[int, list[str], list[str]]] = {}

    def scan(self) -> dict[str, tuple[int, int]]:
        """Path -> (size, mtime_ns) of each file, in no particular order.

        Raises:
            IscoreError: the folder is not a directory.
        """
        if storage.is_uri(self.folder):
            return self._objects()
        if not os.path.isdir(self._root):
            raise IscoreError(
                f"{self.folder}: expected a run's folder (a directory), but found none"
            )
        found: dict[str, tuple[int, int]] = {}
        self._scan(self._root, found, time.time_ns() - SETTLED_NS)
        return found

    def _objects(self) -> dict[str, tuple[int, int]]:
        """The `*.parquet` objects under a URI's prefix: one listing each poll (a store's
        listing has no folder times to skip unchanged folders by)."""
        uri = str(self.folder)
        if not storage.is_prefix(uri):
            raise IscoreError(f"{uri}: expected a run's prefix holding objects, but found none")
        return storage.listing(
            uri, (".parquet",), max_listed=paths.MAX_LISTED, seconds=paths.LIST_SECONDS
        )

    def _scan(self, folder: str, found: dict[str, tuple[int, int]], settled: int) -> None:
        try:
            mtime = os.stat(folder).st_mtime_ns
        except OSError:  # gone since it was listed
            self._kept.pop(folder, None)
            return
        kept = self._kept.get(folder)
        if kept is not None and kept[0] == mtime:
            subfolders, files = kept[1], kept[2]
            for path in files:
                try:
                    stat = os.stat(path)
                except OSError:
                    continue
                found[path] = (stat.st_size, stat.st_mtime_ns)
        else:
            subfolders, files = self._list(folder, found)
            if mtime < settled:
                self._kept[folder] = (mtime, subfolders, files)
            else:
                self._kept.pop(folder, None)
        for sub in subfolders:
            self._scan(sub, found, settled)

    @staticmethod
    def _list(folder: str, found: dict[str, tuple[int, int]]) -> tuple[list[str], list[str]]:
        """A folder's subfolders and `*.parquet` files (those into `found`), by os.scandir."""
        subfolders, files = [], []
        try:
            entries = list(os.scandir(folder))
        except OSError:
            return subfolders, files
        for entry in entries:
            try:
                if entry.is_dir():
                    subfolders.append(entry.path)
                elif entry.name.endswith(".parquet") and entry.is_file():
                    stat = entry.stat()
                    found[entry.path] = (stat.st_size, stat.st_mtime_ns)
                    files.append(entry.path)
            except OSError:
                continue
        return subfolders, files


SAVE_EVERY_S = 30.0
"""The most often a follower rewrites its rows in the store."""


@dataclass(frozen=True, slots=True)
class Update:
    """What one `Follower.poll` found.

    Attributes:
        files: the files read, in order (none when nothing new landed).
        rows: the per-step rows (`Trend.rows`) of the steps those files added to, ascending.
        by_step: the same steps' rows of `mismatch.by_step` (every statistic of the
            analysis document's, docs/analysis.md).
        events: the events that were not there before.
        trend: the run's trend so far.
    """

    files: tuple[Path, ...]
    rows: tuple[dict[str, Any], ...]
    by_step: tuple[dict[str, Any], ...]
    events: tuple[Event, ...]
    trend: Trend


@dataclass(frozen=True, slots=True)
class _Read:
    """A file as the follower read it: its size and modification time, and its steps."""

    size: int
    mtime_ns: int
    steps: tuple[int, ...]


class Follower:
    """A run's folder followed as it grows.

    Args:
        folder: the run's folder (step files anywhere below it).
        settings: the settings whose per-step statistics the trend holds.
        store: a results store: files it holds are not read again, and the rows are kept
            in it; without one, each file's parts are kept in memory.
        columns: explicit canonical -> source column names, as `Dump` takes them.
        targets: what `setting_degrades` events hold each setting to.
        max_tokens: tokens per streamed chunk.
        device: where to compute.
        engine: "local" computes here; "ray" reads each poll's new files in Ray tasks
            (`iscore.utils.distributed`), on the workers' CPUs.
    """

    def __init__(
        self,
        folder: str | Path,
        settings: Setting | Sequence[Setting] = (),
        *,
        store: ResultStore | None = None,
        columns: Mapping[str, str | None] | None = None,
        targets: Targets | None = None,
        max_tokens: int = DEFAULT_CHUNK_TOKENS,
        device: str | torch.device | None = None,
        engine: Engine = "local",
    ):
        self.folder = _path(folder)
        self.specs = resolve_all(settings)
        self.store = store
        self._footers = None if store is None else store.footers
        self.columns = dict(columns or {})
        self.targets = targets or Targets()
        self.max_tokens = max_tokens
        check_engine(engine, device)
        self.engine = engine
        default = "cuda" if torch.cuda.is_available() and engine == "local" else "cpu"
        self.device = torch.device(device or default)
        self._listing = _Listing(folder)
        self._read: dict[str, _Read] = {}
        self._mismatch: dict[int, dict[str, Any]] = {}
        self._settings: list[dict[int, dict[str, Any]]] = [{} for _ in self.specs]
        self._parts: dict[str, list[StepPart]] = {}  # without a store: each file's parts
        self._growing = GrowingTrend(self.specs, [spec.name for spec in self.specs], self.targets)
        # The store keeps the rows under the run's folder, settings, columns, iscore's
        # version and the device: what they depend on besides the files.
        context = Context(tuple(sorted(self.columns.items())), self.device.type).key
        where = str(folder) if storage.is_uri(folder) else os.path.realpath(folder)
        key = [context, where, [setting_key(spec) for spec in self.specs]]
        self._key = hashlib.sha256(json.dumps(key).encode()).hexdigest()
        self._trend = self._growing.trend()
        self._restored = False
        self._unsaved = False
        self._saved_at = -math.inf

    @property
    def trend(self) -> Trend:
        """The trend of the files read so far."""
        return self._trend

    @property
    def files(self) -> list[Path]:
        """The files read so far, by path."""
        return [_path(p) for p in sorted(self._read)]

    def poll(self) -> Update:
        """Read the files that landed (or changed) since the last poll: all of them the first
        time, or those the store's rows of the run do not cover.

        Raises:
            IscoreError: the folder is gone, or a new file is not a dump (`DumpError`,
                naming it).
        """
        if not self._restored:
            self._restore()
        found = self._listing.scan()
        gone = [p for p, r in self._read.items() if found.get(p) != (r.size, r.mtime_ns)]
        touched = {step for p in gone for step in self._read[p].steps}
        for path in gone:
            del self._read[path]
            self._parts.pop(path, None)
        new = sorted(p for p in found if p not in self._read and footer_complete(p))
        before = {_identity(e) for e in self._trend.events}
        fresh: dict[int, list[tuple[str, StepPart]]] = {}
        steps: dict[str, list[int]] = {path: [] for path in new}
        for path, part in self._parts_of(new, self.engine):
            fresh.setdefault(part.step, []).append((path, part))
            steps[path].append(part.step)
        for path in new:
            size, mtime_ns = found[path]
            self._read[path] = _Read(size, mtime_ns, tuple(dict.fromkeys(steps[path])))
        touched |= set(fresh)
        if touched:
            self._rows(touched, fresh)
            self._trend = self._growing.trend()
            self._unsaved = True
            # Keeping the rows rewrites them all: at most every SAVE_EVERY_S, so that a new
            # step costs its own analysis, not the run's.
            if time.monotonic() - self._saved_at >= SAVE_EVERY_S:
                self.save()
        rows = tuple(r for r in self._trend.rows if r["step"] in touched)
        by_step = tuple(self._mismatch[s] for s in sorted(touched) if s in self._mismatch)
        events = tuple(e for e in self._trend.events if _identity(e) not in before)
        return Update(tuple(_path(p) for p in new), rows, by_step, events, self._trend)

    def _parts_of(self, paths: Sequence[str], engine: Engine) -> Iterator[tuple[str, StepPart]]:
        """The parts of files, each with its file, through the store (kept in memory
        without one)."""
        if not paths:
            return
        dump = Dump(list(paths), columns=self.columns, footers=self._footers)
        found = parts(
            dump,
            self.specs,
            store=self.store,
            max_tokens=self.max_tokens,
            device=self.device,
            engine=engine,
        )
        for path, part in found:
            if self.store is None:
                self._parts.setdefault(path, []).append(part)
            yield path, part

    def _rows(self, steps: set[int], fresh: dict[int, list[tuple[str, StepPart]]]) -> None:
        """Recompute the rows of `steps`: each from the parts of its files, in path order
        (those read before from the store or memory, the new ones as just read)."""
        for step in sorted(steps):
            new = {path for path, _ in fresh.get(step, ())}
            earlier = [p for p, r in self._read.items() if step in r.steps and p not in new]
            held = [(p, part) for p in earlier for part in self._stored(p, step)]
            merged = sorted(held + fresh.get(step, []), key=lambda item: item[0])
            self._mismatch.pop(step, None)
            for rows in self._settings:
                rows.pop(step, None)
            if not merged:  # its files are gone
                self._growing.set(step, None, [None] * len(self.specs))
                continue
            mismatch = MismatchStats()
            settings = [SettingStats(spec, histograms=False) for spec in self.specs]
            for _, part in merged:
                mismatch.merge(part.mismatch)
                for acc, done in zip(settings, part.settings, strict=True):
                    acc.merge(done)
            for row in mismatch.by_step():
                self._mismatch[row["step"]] = json_ready(row)
            for acc, rows in zip(settings, self._settings, strict=True):
                for row in acc.by_step():
                    rows[row["step"]] = json_ready(row)
            self._set(step)

    def _stored(self, path: str, step: int) -> list[StepPart]:
        """The parts of `step` of a file read before."""
        if self.store is None:
            return [p for p in self._parts.get(path, []) if p.step == step]
        # From the store, here: a file read before is held there.
        return [p for _, p in self._parts_of([path], "local") if p.step == step]

    def _set(self, step: int) -> None:
        """Make the trend's row of `step` that of its rows now."""
        settings = [rows.get(step) for rows in self._settings]
        self._growing.set(step, self._mismatch.get(step), settings)

    def save(self) -> None:
        """Keep the rows in the store now (`poll` keeps them at most every `SAVE_EVERY_S`:
        call this before letting go of a follower; rows not kept are only computed again,
        from the store, when the run is next opened)."""
        if self.store is None or not self._unsaved:
            return
        self._unsaved, self._saved_at = False, time.monotonic()
        payload = {
            "files": [[p, r.size, r.mtime_ns, list(r.steps)] for p, r in self._read.items()],
            "mismatch": list(self._mismatch.values()),
            "settings": [list(rows.values()) for rows in self._settings],
        }
        self.store.save_run(self._key, payload)

    def _restore(self) -> None:
        """Take the rows the store kept of this run, where they check out."""
        self._restored = True
        if self.store is None:
            return
        payload = self.store.load_run(self._key)
        try:
            read = {
                str(path): _Read(int(size), int(mtime), tuple(int(s) for s in steps))
                for path, size, mtime, steps in payload["files"]
            }
            mismatch = {int(row["step"]): dict(row) for row in payload["mismatch"]}
            settings = [
                {int(row["step"]): dict(row) for row in rows} for rows in payload["settings"]
            ]
        except (TypeError, KeyError, ValueError):
            return
        if len(settings) != len(self.specs):
            return
        self._read, self._mismatch, self._settings = read, mismatch, settings
        for step in {*mismatch, *(s for rows in settings for s in rows)}:
            self._set(step)
        self._trend = self._growing.trend()
        self._saved_at = time.monotonic()  # the store holds these rows as of now

    def analysis(self) -> Analysis:
        """The whole analysis of the files read so far (`iscore.passes.analysis.analyze`'s result,
        through the store), for the pages that show more than the trend.

        Raises:
            IscoreError: no file has been read yet.
        """
        if not self._read:
            raise IscoreError(f"{self.folder}: no whole step file yet")
        dump = Dump(sorted(self._read), columns=self.columns, footers=self._footers)
        return analyze(
            dump,
            self.specs,
            max_tokens=self.max_tokens,
            device=self.device,
            targets=self.targets,
            store=self.store,
            engine=self.engine,
        )


def _identity(event: Event) -> tuple[str, int, str | None]:
    """An event as one poll and the next know it (its evidence grows with the run)."""
    return event.kind, event.step, event.setting


@dataclass(frozen=True, slots=True)
class Alert:
    """A condition on the per-step table (`Trend.table`) to watch for, e.g. `k3 > 1e-3` or
    `decoupled_geo_rs_lr_scale < 0.8`: a DuckDB boolean expression over one row, checked
    against the table's columns once (`iscore.utils.sql.Predicate`).

    Attributes:
        rule: the condition as given.
        predicate: it, checked.
    """

    rule: str
    predicate: Predicate

    @classmethod
    def compile(cls, rule: str, trend: Trend) -> Alert:
        """Check `rule` against the columns of `trend`'s table (an empty trend has them).

        Raises:
            QueryError: not one boolean expression over those columns (one line).
        """
        schema = trend.table().schema
        return cls(rule, Predicate.compile(rule, schema, flag="--alert", unit="step"))

    def first(self, table: pa.Table) -> int | None:
        """The first step of `table` where the rule holds, or None."""
        if not table.num_rows:
            return None
        hits = self.predicate.mask(table).nonzero()[0]
        return int(table["step"][int(hits[0])].as_py()) if hits.size else None
