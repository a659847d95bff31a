"""The results store: what an analysis computed of each step of each file, kept on disk so that
analyzing a run again reads and computes only what changed (docs/runs.md#the-results-store).

One Arrow IPC file per dump file (`<folder>/iscore-results-v5/<key[:2]>/<key>.arrow`), keyed by
the file's identity (its resolved path, size, modification time and a digest of its Parquet
footer), iscore's version, the column mapping and the device. It holds, for each part of the
file (one step's sequences of a chunk, in the order read), the state of the mismatch's, the
attribution's and each setting's accumulators (`MismatchStats.state`, `AttributionStats.state`,
`SettingStats.state`: plain arrays, one row each, never pickled), and a BLAKE2b checksum of
them all. A setting is known by its config (`framework` and the framework's own keys; the
display name is not part of it).

Beside them, the merge of every part of a dump's files (`RunKey`:
`<folder>/iscore-results-v5/merged/<slot>.arrow`, one per folder, step selection and device,
keyed by the files' own entries), so that a run of thousands of unchanged step files
is read back in one entry; and the footers that passed `iscore.utils.footer.check`
(`<folder>/iscore-results-v5/footers/<version>/`), which are not parsed again.

Nothing read is trusted (but the footers' marks: whoever can write the folder can skip a
footer's check, docs/security.md): an entry of another version, file or mapping, or one whose
checksum fails, is ignored whole, and a state whose arrays do not make an accumulator
(`from_state` refuses it) is left out; what they held is computed again and written anew. Files are
written whole under a temporary name and renamed, so a reader never sees half of one, and
two writers lose at most each other's newest parts, never a file.

>>> store = ResultStore(tmp_path)                                 # doctest: +SKIP
>>> analyze("run/", ["verl:decoupled_geo_rs"], store=store)        # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from iscore.errors import IscoreError
from iscore.frameworks import Spec
from iscore.stats import AttributionStats, MismatchStats, SettingStats
from iscore.utils import Passed, storage

FORMAT = 8
"""The layout of the entries; a store of another format is never read (1 had a SHA-256 per
part's state, checked much more slowly than one checksum per entry; 2 lacked each sequence's
spread against the noise, `iscore.stats.noise.deviations`; 3 held the d-on-rollout regression's
sums as torch's parallel dot products gave them, which a fresh analysis now sums per
sequence: they differ in the last bits; 4 was uncompressed, its checksum over the rows as Python
values, which cost more than the analysis on a large entry; 5 read no `floor_logprob`, so its
entries of a dump with one lack the noise floor; 6 lacked the bug signatures' sums,
`iscore.stats.signatures`; 7 lacked the metadata columns' values and the token-id comparison,
`iscore.stats.metadata`)."""

MISMATCH = "mismatch"
"""The `what` of the mismatch's accumulator (a setting's is its `setting_key`)."""

ATTRIBUTION = "attribution"
"""The `what` of the attribution's accumulator."""

_MAGIC = b"PAR1"
_SCHEMA = pa.schema(
    [
        ("part", pa.int32()),
        ("step", pa.int64()),
        ("run", pa.int32()),
        ("tokens", pa.int64()),
        ("what", pa.string()),
        ("name", pa.string()),
        ("dtype", pa.string()),
        ("shape", pa.list_(pa.int64())),
        ("data", pa.large_binary()),
    ]
)
_DTYPES = frozenset({"|u1", "<i4", "<i8", "<f8"})
"""The array types a state holds; any other in an entry makes it foreign."""


MAX_MB = 2048
"""The store's default size cap, in MB: past it, the least recently used entries go."""

MAX_MB_ENV = "ISCORE_CACHE_MAX_MB"
"""The environment variable that sets the cap (`--cache-max-mb` wins)."""


def default_max_bytes() -> int:
    """The cap `ISCORE_CACHE_MAX_MB` names, else `MAX_MB`, in bytes.

    Raises:
        IscoreError: the variable is not a positive number of MB.
    """
    text = os.environ.get(MAX_MB_ENV)
    if text is None:
        return MAX_MB << 20
    try:
        mb = float(text)
    except ValueError:
        mb = 0.0
    if not (math.isfinite(mb) and mb > 0):
        raise IscoreError(f"Expected {MAX_MB_ENV} to be a positive number of MB, but got {text}")
    return int(mb * (1 << 20))


@dataclass(frozen=True, slots=True)
class FileIdentity:
    """What a dump file is, as far as the store is concerned: a file changed in place gets
    another identity.

    An object in object storage is known by its URI, size, the store's modification time
    (an object is replaced whole, never changed in place) and its footer's digest.

    Attributes:
        path: its resolved path, or an object's URI.
        size: its size in bytes.
        mtime_ns: its modification time.
        footer: the SHA-256 of its Parquet footer (hex).
    """

    path: str
    size: int
    mtime_ns: int
    footer: str

    @classmethod
    def of(cls, path: str | Path) -> FileIdentity | None:
        """The identity of a complete Parquet file; None where the file cannot be read or
        its footer is not complete yet (a file still being written: see `footer_complete`).
        """
        if storage.is_uri(path):
            return cls._of_object(str(path))
        real = os.path.realpath(path)
        try:
            with open(real, "rb") as f:
                stat = os.fstat(f.fileno())
                footer = _footer(f, stat.st_size)
        except OSError:
            return None
        if footer is None:
            return None
        return cls(real, stat.st_size, stat.st_mtime_ns, hashlib.sha256(footer).hexdigest())

    @classmethod
    def _of_object(cls, uri: str) -> FileIdentity | None:
        try:
            size, mtime_ns = storage.stat(uri)
            footer = _footer(_Reader(storage.open_input(uri)), size)
        except IscoreError:
            return None
        if footer is None:
            return None
        return cls(uri, size, mtime_ns, hashlib.sha256(footer).hexdigest())

    @property
    def key(self) -> str:
        return _digest(json.dumps([self.path, self.size, self.mtime_ns, self.footer]))


class _Reader:
    """An object's random-access file read as `_footer` reads an open file: by `read` and
    `seek`, each read one ranged request."""

    def __init__(self, f: pa.NativeFile):
        self._f = f
        self._at = 0

    def read(self, n: int) -> bytes:
        data = self._f.read_at(n, self._at)
        self._at += len(data)
        return data

    def seek(self, at: int) -> None:
        self._at = at


def _footer(f: Any, size: int) -> bytes | None:
    """The footer of an open Parquet file (metadata and its length), or None where the magic
    is missing at either end or the length does not fit."""
    if size < 12:
        return None
    if f.read(4) != _MAGIC:
        return None
    f.seek(size - 8)
    tail = f.read(8)
    length = int.from_bytes(tail[:4], "little")
    if tail[4:] != _MAGIC or length <= 0 or length > size - 12:
        return None
    f.seek(size - 8 - length)
    return f.read(length) + tail


def footer_complete(path: str | Path) -> bool:
    """Whether `path` is a whole Parquet file: the magic at both ends and a footer that
    parses (a file a job is still writing, or whose write was cut short, is not)."""
    if FileIdentity.of(path) is None:
        return False
    try:
        pq.read_metadata(storage.readable(str(path)))
    except (OSError, pa.ArrowException, IscoreError):
        return False
    return True


@functools.lru_cache(maxsize=1024)
def setting_key(spec: Spec) -> str:
    """The `what` of a setting: a digest of its config (`framework` and the framework's own
    keys, not its display name), so that two names of one setting share their entries."""
    config = {k: v for k, v in spec.to_config().items() if k != "name"}
    return _digest(json.dumps([spec.framework, config], sort_keys=True, default=str))


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(slots=True)
class StoredPart:
    """One part of a file (one step's sequences of a chunk) as the store holds it.

    Attributes:
        step, run: the step, and how many parts of that step came before it in the file.
        tokens: its tokens.
        states: `what` -> the accumulator's state, checked against its checksum.
    """

    step: int
    run: int
    tokens: int
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    def mismatch(self) -> MismatchStats | None:
        """The mismatch's accumulator, or None where it is missing or its state is foreign."""
        state = self.states.get(MISMATCH)
        if state is None:
            return None
        try:
            return MismatchStats.from_state(state)
        except (ValueError, TypeError):
            return None

    def attribution(self) -> AttributionStats | None:
        """The attribution's accumulator, or None where it is missing or its state is foreign."""
        state = self.states.get(ATTRIBUTION)
        if state is None:
            return None
        try:
            return AttributionStats.from_state(state)
        except (ValueError, TypeError):
            return None

    def setting(self, spec: Spec) -> SettingStats | None:
        """`spec`'s accumulator, or None where it is missing or its state is foreign."""
        state = self.states.get(setting_key(spec))
        if state is None:
            return None
        try:
            return SettingStats.from_state(spec, state)
        except (ValueError, TypeError):
            return None


@dataclass(slots=True)
class StoredFile:
    """What the store holds of one dump file.

    Attributes:
        parts: its parts, in the order read.
        complete: whether `parts` lists every part of the file (it was read whole once), so
            that a selection of steps can be served without reading it.
    """

    parts: list[StoredPart]
    complete: bool


class ResultStore:
    """The per-step results of analyses, in a folder (see the module docstring).

    Args:
        folder: where the entries live (made when first written; `paths.default_folder()` is the
            user's cache).

    Attributes:
        reads, writes: entries read (that checked out) and written (the bench and tests
            count them).
        footers: the footers of the files analyzed through it that passed `footer.check`
            (for this version of iscore), which a `Dump` opened with them does not parse
            again.
    """

    def __init__(self, folder: str | Path, max_bytes: int | None = None):
        self.folder = Path(folder)
        self.root = self.folder / f"iscore-results-v{FORMAT}"
        self.footers = Passed(self.root / "footers" / _version())
        self.max_bytes = default_max_bytes() if max_bytes is None else max_bytes
        self.reads = 0
        self.writes = 0
        self.evicted = 0
        self._sizes: dict[Path, int] | None = None  # the entries on disk, once listed

    def entries(self) -> list[tuple[Path, int, int]]:
        """(path, size in bytes, last use in ns) of every entry of every format in the
        folder (the files' and the runs' entries, the merges and the footers' marks), least
        recently used first: what `evict` removes first."""
        found = [e for root in self.folder.glob("iscore-results-v*") for e in _listing(root)]
        return sorted(found, key=lambda e: (e[2], str(e[0])))

    def size(self) -> int:
        """The bytes the store's entries take on disk."""
        return sum(size for _, size, _ in self.entries())

    def clear(self) -> int:
        """Remove every entry of every format (nothing else of the folder); returns the bytes
        freed."""
        freed = 0
        for root in sorted(self.folder.glob("iscore-results-v*")):
            freed += sum(size for _, size, _ in _listing(root))
            shutil.rmtree(root, ignore_errors=True)
        self._sizes = None
        return freed

    def _used(self, path: Path) -> None:
        """Mark an entry as just used (its modification time): the last to be evicted."""
        with contextlib.suppress(OSError):
            os.utime(path)

    def _written(self, path: Path) -> None:
        """Count a new entry against `max_bytes`, evicting the least recently used entries
        past it (the store is listed once per process, then followed as it is written)."""
        if self._sizes is None:
            self._sizes = {p: size for p, size, _ in self.entries()}
        with contextlib.suppress(OSError):
            self._sizes[path] = path.stat().st_size
        if sum(self._sizes.values()) > self.max_bytes:
            self.evict(keep=path)

    def evict(self, keep: Path | None = None) -> int:
        """Remove the least recently used entries until the store fits in `max_bytes` (never
        `keep`, the entry just written); returns how many were removed."""
        entries = self.entries()
        total = sum(size for _, size, _ in entries)
        removed = 0
        for path, size, _ in entries:
            if total <= self.max_bytes:
                break
            if path == keep:
                continue
            with contextlib.suppress(OSError):
                path.unlink()
                total -= size
                removed += 1
        self._sizes = {p: size for p, size, _ in self.entries()}
        self.evicted += removed
        return removed

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.arrow"

    def load(self, file: FileIdentity, context: str) -> StoredFile | None:
        """What the store holds of `file` analyzed in `context` (`Context.key`); None where
        it holds nothing that checks out."""
        key = _entry_key(file, context)
        return self._load(self._path(key), key)

    def load_merged(self, run: RunKey) -> StoredPart | None:
        """The merge of every part of a dump's files (`RunKey`) that `save_merged` kept, or
        None where the store holds none that checks out for exactly those files."""
        stored = self._load(self._merged_path(run), run.key)
        return stored.parts[0] if stored is not None and len(stored.parts) == 1 else None

    def _merged_path(self, run: RunKey) -> Path:
        return self.root / "merged" / f"{run.slot}.arrow"

    def _load(self, path: Path, key: str) -> StoredFile | None:
        """The entry at `path` if it is the entry of `key` and checks out."""
        try:
            # Read whole, in one call: Arrow's many small reads each give up the GIL, and
            # wait for it, while the analysis' main thread merges what was read before.
            data = path.read_bytes()
            table = pa.ipc.open_file(pa.py_buffer(data)).read_all()
        except (OSError, pa.ArrowException):
            return None
        meta = (table.schema.metadata or {}).get(b"iscore.store")
        try:
            header = json.loads(meta) if meta else None
        except ValueError:
            header = None
        if not isinstance(header, dict) or header.get("key") != key:
            return None
        if not table.schema.remove_metadata().equals(_SCHEMA):
            return None
        complete = header.get("complete") is True
        table = table.combine_chunks()
        if header.get("checksum") != _checksum(key, complete, table):
            return None
        stored = _parts(table, complete)
        if stored is not None:
            self.reads += 1
            self._used(path)
        return stored

    def save(self, file: FileIdentity, context: str, stored: StoredFile) -> None:
        """Write what is known of `file` in `context`, replacing the entry whole.

        Raises:
            IscoreError: the folder cannot be written (named, with the reason).
        """
        key = _entry_key(file, context)
        self._save(self._path(key), key, stored)

    def save_merged(self, run: RunKey, merged: StoredPart) -> None:
        """Keep the merge of every part of a dump's files (`RunKey`), replacing the one kept
        for an earlier state of the same folders.

        Raises:
            IscoreError: the folder cannot be written.
        """
        self._save(self._merged_path(run), run.key, StoredFile([merged], complete=True))

    def _save(self, path: Path, key: str, stored: StoredFile) -> None:
        """Write `stored` as the entry of `key` at `path`, replacing what was there whole."""
        table = _table(stored)
        checksum = _checksum(key, stored.complete, table)
        header = json.dumps(
            {"key": key, "complete": stored.complete, "format": FORMAT, "checksum": checksum}
        )
        table = table.replace_schema_metadata({"iscore.store": header})
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _beside(path) as tmp:
                # zstd: a histogram's bins are mostly empty, and shrink tenfold.
                options = pa.ipc.IpcWriteOptions(compression="zstd")
                with pa.ipc.new_file(tmp, table.schema, options=options) as writer:
                    writer.write_table(table)
        except OSError as e:
            raise IscoreError(f"results store {self.folder}: cannot write: {e}") from e
        self.writes += 1
        self._written(path)

    def _run_path(self, key: str) -> Path:
        return self.root / "runs" / f"{key}.json"

    def load_run(self, key: str) -> dict[str, Any] | None:
        """The document `save_run` kept under `key`, or None where there is none, or it is
        not one (its checksum fails, or it is not JSON)."""
        try:
            lines = self._run_path(key).read_text(encoding="utf-8").split("\n", 1)
            checksum, text = lines
            payload = json.loads(text) if _digest(key + text) == checksum else None
        except (OSError, ValueError):
            return None
        if not isinstance(payload, dict):
            return None
        self.reads += 1
        self._used(self._run_path(key))
        return payload

    def save_run(self, key: str, payload: dict[str, Any]) -> None:
        """Keep a followed run's per-step rows (a JSON document, strict: no NaN) under `key`,
        replacing what was there: its SHA-256 on the first line, the document on the second.

        Raises:
            IscoreError: the folder cannot be written.
        """
        text = json.dumps(payload, allow_nan=False)
        path = self._run_path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with _beside(path) as tmp:
                Path(tmp).write_text(f"{_digest(key + text)}\n{text}", encoding="utf-8")
        except OSError as e:
            raise IscoreError(f"results store {self.folder}: cannot write: {e}") from e
        self.writes += 1
        self._written(path)


@dataclass(frozen=True, slots=True)
class Context:
    """What, besides the file, an entry's numbers depend on.

    Attributes:
        columns: the file's resolved columns (canonical -> its column), as read.
        device: "cpu" or "cuda" (their float sums may differ in the last digit).
    """

    columns: tuple[tuple[str, str], ...]
    device: str

    @property
    def key(self) -> str:
        return _digest(json.dumps([_version(), FORMAT, self.columns, self.device]))


@dataclass(frozen=True, slots=True)
class RunKey:
    """Where the store keeps the merge of every part of a dump's files, and what it must be
    the merge of: a dump of unchanged files is then read back in one entry, not one per file
    (docs/runs.md#the-results-store).

    Attributes:
        slot: the entry's place, one per folder (the files' deepest common one), step
            selection and device: a run that grows replaces its merge, it does not pile
            them up.
        key: the files' own entries' keys (their identities and contexts), in order, and the
            step selection.
    """

    slot: str
    key: str

    @classmethod
    def of(cls, files: Sequence[tuple[FileIdentity, str]], steps: str, device: str) -> RunKey:
        """The key of the files (`FileIdentity`, `Context.key`), in the order read, with the
        steps selected (as text) and the device."""
        folder = os.path.commonpath([os.path.dirname(file.path) for file, _ in files])
        entries = [_entry_key(file, context) for file, context in files]
        return cls(
            _digest(json.dumps(["merged", folder, steps, device])),
            _digest(json.dumps(["merged", entries, steps])),
        )


@functools.cache
def _version() -> str:
    return version("iscore")


def _entry_key(file: FileIdentity, context: str) -> str:
    return _digest(file.key + context)


def _table(stored: StoredFile) -> pa.Table:
    """The rows of an entry (`_SCHEMA`): one per array of each state of each part, the
    arrays' bytes laid end to end in one buffer."""
    names = [f.name for f in _SCHEMA if f.name != "data"]
    columns: dict[str, list[Any]] = {name: [] for name in names}
    blobs: list[bytes] = []
    for index, part in enumerate(stored.parts):
        for what, state in sorted(part.states.items()):
            for name, array in sorted(state.items()):
                array = np.ascontiguousarray(array)
                row = (index, part.step, part.run, part.tokens, what, name, array.dtype.str)
                for column, value in zip(names, (*row, list(array.shape)), strict=True):
                    columns[column].append(value)
                blobs.append(array.tobytes())
    offsets = np.zeros(len(blobs) + 1, dtype=np.int64)
    np.cumsum([len(b) for b in blobs], out=offsets[1:])
    data = pa.LargeBinaryArray.from_buffers(
        pa.large_binary(), len(blobs), [None, pa.py_buffer(offsets), pa.py_buffer(b"".join(blobs))]
    )
    arrays = [pa.array(columns[name], _SCHEMA.field(name).type) for name in names]
    return pa.Table.from_arrays([*arrays, data], schema=_SCHEMA)


def _checksum(key: str, complete: bool, table: pa.Table) -> str | None:
    """The BLAKE2b of an entry's key, whether it is complete and its columns' values, read
    from their Arrow buffers (one chunk each); None where a value is missing."""
    digest = hashlib.blake2b(json.dumps([key, complete]).encode(), digest_size=32)
    for column in table.columns:
        array = column.chunk(0) if column.num_chunks == 1 else None
        if array is None or array.null_count:
            return None
        for view in _values(array):
            digest.update(view)
    return digest.hexdigest()


def _values(array: pa.Array) -> list[np.ndarray]:
    """The values of one column as numpy views of its buffers: a fixed-width column's
    values; a list column's offsets (from 0) and the values they span; a string or binary
    column's offsets (from 0) and the bytes they span."""
    if pa.types.is_list(array.type):
        offsets = array.offsets.to_numpy()
        return [offsets - offsets[0], array.flatten().to_numpy(zero_copy_only=True)]
    if not (pa.types.is_string(array.type) or pa.types.is_large_binary(array.type)):
        return [array.to_numpy(zero_copy_only=True)]
    offsets, values = _binary(array)
    return [offsets - offsets[0], values[offsets[0] : offsets[-1]]]


def _binary(array: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """A string or binary array's offsets and bytes, as numpy views of its buffers."""
    kind = np.int64 if pa.types.is_large_binary(array.type) else np.int32
    _, offsets, values = array.buffers()
    count = len(array) + 1
    offsets = np.frombuffer(offsets, kind, count, array.offset * np.dtype(kind).itemsize)
    return offsets, np.frombuffer(values, np.uint8)


def _parts(table: pa.Table, complete: bool) -> StoredFile | None:
    """The parts an entry's rows (checked against its checksum) describe, each array a view
    of the entry's buffer; None where they do not describe any."""
    offsets, buffer = _binary(table.column("data").chunk(0))
    meta = [table.column(name).to_pylist() for name in _SCHEMA.names if name != "data"]
    parts: list[StoredPart] = []
    for row, (index, step, run, tokens, what, name, dtype, shape) in enumerate(
        zip(*meta, strict=True)
    ):
        if index < 0 or index > len(parts):
            return None
        if index == len(parts):
            parts.append(StoredPart(step, run, tokens))
        if dtype not in _DTYPES:
            return None
        kind = np.dtype(dtype)
        size = int(offsets[row + 1] - offsets[row])
        if size % kind.itemsize or math.prod(shape) * kind.itemsize != size:
            return None
        array = buffer[offsets[row] : offsets[row + 1]].view(kind)
        if not array.flags.aligned:  # after an odd-length array: compiled kernels want aligned
            array = array.copy()
        parts[index].states.setdefault(what, {})[name] = array.reshape(shape)
    return StoredFile(parts, complete)


@contextlib.contextmanager
def _beside(path: Path) -> Iterator[str]:
    """A temporary file beside `path` that becomes `path` when the block succeeds."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _listing(root: Path) -> list[tuple[Path, int, int]]:
    """(path, size, modification time in ns) of every file below `root`."""
    out = []
    for path in root.rglob("*"):
        with contextlib.suppress(OSError):
            if path.is_file():
                st = path.stat()
                out.append((path, st.st_size, st.st_mtime_ns))
    return out
