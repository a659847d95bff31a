"""Memory budgets of the dashboard: tokens per uploaded dump, bytes for every loaded dump.

An upload is checked against a token budget from its Parquet footer, before a byte of it is
decoded (an 800 KB file can hold 50M tokens). Loaded dumps (`iscore.session.workspace.Workspace`)
live in one `WorkspaceCache` per process: shared by the sessions that opened them, measured after
each use, evicted least recently used past the budget, and dropped as soon as the last session
that used them ends. The CLI streams dumps in chunks and needs none of this.

>>> cache = WorkspaceCache(limit_bytes=1 << 20)
>>> cache.get("a", "session-1", lambda: bytearray(10))
bytearray(b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x00')
>>> cache.release("session-1"); len(cache)
0
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from iscore.dump import SUFFIXES, is_tensor
from iscore.errors import DumpError, clip
from iscore.utils import footer, storage

T = TypeVar("T")

MAX_UPLOAD_TOKENS = 20_000_000
"""Tokens one session may upload (about 1 GB once loaded and analyzed)."""

MAX_PATH_TOKENS = 20_000_000
"""Tokens one session may open from a server path, except the dump the operator named when
starting the app: loading and ranking settings take about 90 bytes a token for a while (1.75 GB
at 20M tokens), whoever's browser asks."""

CACHE_MB = 4096
"""Memory for the loaded dumps of every session together."""


def parquet_tokens(source: bytes | str) -> int | None:
    """The tokens a Parquet file (its bytes, or its path) holds, read from its footer without
    decoding: its longest column in values (a list column counts its elements, so both layouts
    count tokens). None when there is no readable footer (the dump reader then says what the
    file is).
    """
    try:
        footer.check(source if isinstance(source, bytes) else footer.tail(source), "")
        if isinstance(source, bytes):
            meta = pq.read_metadata(pa.BufferReader(source))
        else:
            meta = pq.read_metadata(storage.readable(source))
    except (DumpError, pa.ArrowException, OSError, ValueError):  # a name not UTF-8: ValueError
        return None
    longest = 0
    for j in range(meta.num_columns):
        values = sum(meta.row_group(i).column(j).num_values for i in range(meta.num_row_groups))
        longest = max(longest, values)
    return max(longest, meta.num_rows)


IMPORT_BYTES_PER_TOKEN = 8
"""Bytes of a framework's own dump (JSON Lines, `.pt`, `.pkl`) a session may load per token of
its budget, checked before it is parsed: its tokens are known only once it is read. A token
takes at least 6 bytes of JSON (a mask, a rollout and a trainer log-prob of 2 characters each)
or 8 of tensors, so this bounds what parsing can build (an upload's are counted again once
converted, before it is loaded)."""


def _check(files: Iterable[tuple[str, bytes | str, int]], limit: int, holds: str, flag: str) -> int:
    """The tokens of `files` (name, bytes or path, size in bytes), checked against `limit`
    before decoding: Parquet files from their footers; framework dumps (by their names'
    suffixes) by their size, against `IMPORT_BYTES_PER_TOKEN` bytes per token of `limit`.
    `holds` names the files in the message with its verb ("the upload holds"); the message
    says what to do instead, `flag` being the bound's `iscore app` option."""
    total = imported = 0
    names = []
    for name, source, size in files:
        tokens = parquet_tokens(source)
        if tokens is None and name.endswith(SUFFIXES):
            imported += size
            names.append(name)
        else:
            total += tokens or 0
    hint = (
        "the CLI streams a dump of any size (`iscore analyze PATH`); or ask the operator to "
        f"raise `iscore app {flag}`, or to start the app with this dump (`iscore app PATH`)"
    )
    bound = limit * IMPORT_BYTES_PER_TOKEN
    if imported > bound:
        raise DumpError(
            f"{holds} {imported:,} bytes of framework dumps ({clip(', '.join(names))}), "
            f"more than the {bound:,} bytes ({IMPORT_BYTES_PER_TOKEN} per token of the "
            f"{limit:,} one session may load) they may take before they are read; {hint}"
        )
    if total > limit:
        raise DumpError(
            f"{holds} {total:,} tokens, more than the {limit:,} one session may load; " + hint
        )
    return total


def check_upload(files: Iterable[tuple[str, bytes]], limit: int) -> int:
    """The tokens of uploaded files (name, bytes), checked against `limit` before decoding
    (Parquet files from their footers, framework dumps from their size).

    Raises:
        DumpError: more than `limit` tokens, or framework dumps larger than that bound.

    >>> check_upload([("train_data_step1.jsonl", b"x" * 81)], limit=10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    iscore.errors.DumpError: the upload holds 81 bytes of framework dumps ..., more than the 80 ...
    """
    sizes = ((name, data, len(data)) for name, data in files)
    return _check(sizes, limit, "the upload holds", "--max-upload-tokens")


def check_paths(paths: Sequence[str], limit: int) -> int:
    """The tokens of the dump files `paths`, checked against `limit` as `check_upload` checks
    an upload, before anything is decoded: a session may open no larger dump from a server
    path than the operator allows (`iscore app --max-path-tokens`).

    Raises:
        DumpError: more than `limit` tokens, or framework dumps larger than that bound.
    """
    holds = f"{paths[0]} holds" if len(paths) == 1 else f"the dump's {len(paths):,} files hold"
    sizes = ((p, p, storage.stat(p)[0] if storage.is_uri(p) else os.path.getsize(p)) for p in paths)
    return _check(sizes, limit, holds, "--max-path-tokens")


def footprint(value: Any) -> int:
    """Bytes of the tensors, arrays and Arrow data reachable from `value` (each storage
    counted once); Python scalars and strings are left out, being small next to them."""
    seen: set[int] = set()
    total = 0
    stack = [value]
    while stack:
        item = stack.pop()
        if id(item) in seen or item is None or isinstance(item, str | bytes | int | float):
            continue
        seen.add(id(item))
        if is_tensor(item):
            storage = item.untyped_storage()
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
        elif isinstance(item, np.ndarray | pa.Array | pa.ChunkedArray | pa.Table | pa.RecordBatch):
            total += item.nbytes
        elif isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list | tuple | set | frozenset):
            stack.extend(item)
        else:
            stack.extend(getattr(item, "__dict__", {}).values())
            for slot in getattr(type(item), "__slots__", ()):
                stack.append(getattr(item, slot, None))
    return total


@dataclass
class _Entry:
    value: Any
    owners: set[str] = field(default_factory=set)
    nbytes: int = 0


class WorkspaceCache:
    """Loaded dumps, kept for the sessions that use them within `limit_bytes`.

    Every value is measured with `footprint` after each `get` (a workspace grows as its
    analyses are memoized); past the budget the least recently used entries are dropped,
    never the one just asked for. An entry is dropped as soon as every session that used it
    has been `release`d. Thread-safe: Streamlit runs each session's script in its own thread.

    Args:
        limit_bytes: the budget.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self._entries: OrderedDict[Hashable, _Entry] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: Hashable, owner: str, build: Callable[[], T]) -> T:
        """The value under `key` for session `owner`, built (outside the lock) if missing.

        Two sessions may build the same value at once; the second is kept, both are equal.
        """
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
                entry.owners.add(owner)
        if entry is None:
            entry = _Entry(build(), {owner})
            with self._lock:
                self._entries[key] = entry
        entry.nbytes = footprint(entry.value)
        self._trim(keep=key)
        return entry.value

    def nbytes(self) -> int:
        """The bytes held, as last measured."""
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def _trim(self, keep: Hashable) -> None:
        with self._lock:
            total = sum(e.nbytes for e in self._entries.values())
            over = [key for key in self._entries if key != keep]
            dropped = False
            while total > self.limit_bytes and over:
                total -= self._entries.pop(over.pop(0)).nbytes
                dropped = True
        if dropped:
            _return_freed_memory()

    def discard(self, owner: str, keep: Callable[[Hashable], bool]) -> None:
        """Stop holding, for `owner`, every entry whose key `keep` rejects (e.g. the
        session's previous upload, when it uploads another)."""
        self._drop(owner, lambda key: not keep(key))

    def release(self, owner: str) -> None:
        """Session `owner` ended: drop what only it used."""
        self._drop(owner, lambda key: True)

    def _drop(self, owner: str, which: Callable[[Hashable], bool]) -> None:
        with self._lock:
            dropped = False
            for key, entry in list(self._entries.items()):
                if owner in entry.owners and which(key):
                    entry.owners.discard(owner)
                    if not entry.owners:
                        del self._entries[key]
                        dropped = True
        if dropped:
            _return_freed_memory()


def _return_freed_memory() -> None:
    """Hand freed memory back to the system. Arrow's allocator and glibc's malloc both keep
    freed blocks for reuse: measured on a 2M-token dump, ~200 MB of an analysis's scratch
    memory stays resident after the workspace is gone unless trimmed."""
    pa.default_memory_pool().release_unused()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None  # glibc only (not musl, macOS)


_LIBC = _glibc()
