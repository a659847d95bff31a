"""A Parquet file's footer checked before pyarrow reads its column chunks' metadata.

pyarrow (26) aborts the whole process, with no Python exception to catch, on some footers a
damaged or hostile file can hold: a C++ exception thrown where the Python binding does not
expect one (`RowGroupMetaData.column(i)` on a column chunk whose level histograms do not fit
its schema, `ColumnChunkMetaData.statistics` on one whose physical type is not its
column's). A process reading uploads (the app) would die for every session. So the footer is
parsed here first, with a small reader of Thrift's compact protocol bounded in depth and
sizes, and those cases are refused as an unreadable footer.

>>> import io, pyarrow as pa, pyarrow.parquet as pq
>>> sink = io.BytesIO()
>>> pq.write_table(pa.table({"x": [[1.0, 2.0]]}), sink)
>>> len(check(sink.getvalue(), "x.parquet"))  # the footer's SHA-256, in hex
64
>>> check(sink.getvalue()[:-9] + b"\\xff" + sink.getvalue()[-8:], "x.parquet")
Traceback (most recent call last):
iscore.errors.DumpError: x.parquet: unreadable Parquet footer: a value of unknown Thrift type 15
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from iscore.errors import DumpError
from iscore.utils import storage

if TYPE_CHECKING:
    import pyarrow as pa

_STOP, _TRUE, _FALSE, _BYTE, _I16, _I32, _I64, _DOUBLE, _BINARY, _LIST, _SET, _MAP, _STRUCT = range(
    13
)
_NAMES = (
    *("stop", "bool", "bool", "byte", "i16", "i32", "i64", "double", "binary", "list", "set"),
    *("map", "struct"),
)
"""Thrift's type names, for messages."""


def _name(kind: int) -> str:
    return _NAMES[kind] if kind < len(_NAMES) else f"type {kind}"


_BOOLEANS = frozenset({_TRUE, _FALSE})
_INTEGERS = frozenset({_I16, _I32, _I64})
_FIXED = {_BYTE: 1, _DOUBLE: 8}
"""The sizes of the fixed-size values skipped."""

_MAX_DEPTH = 32
"""Nesting of Thrift structs and lists a Parquet footer needs is about 8."""

_OPTIONAL, _REPEATED = 1, 2
"""Parquet's repetition types (REQUIRED is 0)."""


class _Malformed(Exception):
    pass


# What is read of a footer: per struct, {field id: (Thrift type, inner)}, inner being the
# struct's own such map, a list's (item type, item inner), or None. Field ids are
# parquet.thrift's; every other field is skipped.
_SIZES = {2: (_LIST, (_I64, None)), 3: (_LIST, (_I64, None))}  # the level histograms
_COLUMN = {1: (_I32, None), 16: (_STRUCT, _SIZES)}  # ColumnMetaData: type, size_statistics
_CHUNK = {3: (_STRUCT, _COLUMN)}  # ColumnChunk: meta_data
_GROUP = {1: (_LIST, (_STRUCT, _CHUNK))}  # RowGroup: columns
_ELEMENT = {1: (_I32, None), 3: (_I32, None), 5: (_I32, None)}  # type, repetition, children
_FILE = {2: (_LIST, (_STRUCT, _ELEMENT)), 4: (_LIST, (_STRUCT, _GROUP))}  # schema, row groups


class _Thrift:
    """Reads Thrift's compact protocol: the fields a shape names, skipping the others."""

    def __init__(self, data: bytes):
        self.data = data
        self.at = 0
        self.depth = 0

    def byte(self) -> int:
        try:
            b = self.data[self.at]
        except IndexError:
            raise _Malformed("it ends inside a value") from None
        self.at += 1
        return b

    def varint(self) -> int:
        data, at = self.data, self.at  # locals: a footer holds a varint per few bytes
        value = shift = 0
        try:
            while (b := data[at]) & 0x80:
                value |= (b & 0x7F) << shift
                at += 1
                shift += 7
                if shift > 63:
                    raise _Malformed("a varint longer than 10 bytes")
        except IndexError:
            raise _Malformed("it ends inside a value") from None
        self.at = at + 1
        return value | (b << shift)

    def zigzag(self) -> int:
        n = self.varint()
        return (n >> 1) ^ -(n & 1)

    def size(self, n: int) -> int:
        """`n` items or bytes, at most what is left (every item takes a byte at least)."""
        if n > len(self.data) - self.at:
            raise _Malformed(f"a size of {n:,} beyond its {len(self.data):,} bytes")
        return n

    def enter(self) -> None:
        self.depth += 1
        if self.depth > _MAX_DEPTH:
            raise _Malformed(f"values nested deeper than {_MAX_DEPTH}")

    def read(self, kind: int, inner: object) -> object:
        if kind == _STRUCT:
            return self.struct(inner)
        if kind == _LIST:
            return self.list(*inner)
        return self.zigzag()  # the integers read are all i32 or i64

    def struct(self, shape: dict) -> dict[int, object]:
        self.enter()
        fields: dict[int, object] = {}
        last = 0
        data = self.data
        while True:
            if self.at >= len(data):  # self.byte(), inline: a footer holds hundreds of fields
                raise _Malformed("it ends inside a value")
            head = data[self.at]
            self.at += 1
            if head == _STOP:
                break
            kind, delta = head & 0x0F, head >> 4
            last = last + delta if delta else self.zigzag()
            wanted = shape.get(last)
            if wanted is None:
                if kind in _INTEGERS:  # most of what is skipped: read inline
                    self.varint()
                elif kind not in _BOOLEANS:
                    self.skip(kind)
                continue
            # A reader skips a field of another type as if absent: pyarrow would then read
            # another footer than this one.
            if kind != wanted[0]:
                found, belongs = _name(kind), _name(wanted[0])
                raise _Malformed(f"field {last} is a Thrift {found} where {belongs} belongs")
            fields[last] = self.read(*wanted)
        self.depth -= 1
        return fields

    def list(self, kind: int, inner: object) -> list[object]:
        self.enter()
        n, found = self.list_head()
        if n and found != kind:
            raise _Malformed(f"a list of Thrift {_name(found)} where {_name(kind)} belong")
        items = [self.read(kind, inner) for _ in range(n)]
        self.depth -= 1
        return items

    def list_head(self) -> tuple[int, int]:
        head = self.byte()
        n, kind = head >> 4, head & 0x0F
        return self.size(self.varint() if n == 15 else n), kind

    def skip(self, kind: int) -> None:
        if kind in _BOOLEANS:
            return
        if kind in _INTEGERS:
            self.varint()
        elif kind in (_BYTE, _DOUBLE, _BINARY):
            n = _FIXED.get(kind) or self.varint()
            self.at += self.size(n)
        elif kind in (_LIST, _SET):
            n, item = self.list_head()
            if item in (_TRUE, _FALSE):  # a list's booleans are a byte each
                self.at += n
            else:
                self.skip_all(item, n)
        elif kind == _MAP:
            n = self.size(self.varint())
            kinds = self.byte() if n else 0
            self.skip_all(kinds >> 4, n, kinds & 0x0F)
        elif kind == _STRUCT:
            self.skip_struct()
        else:
            raise _Malformed(f"a value of unknown Thrift type {kind}")

    def skip_struct(self) -> None:
        """`struct({})` without keeping anything: most structs of a footer are skipped."""
        self.enter()
        data = self.data
        while True:
            if self.at >= len(data):
                raise _Malformed("it ends inside a value")
            head = data[self.at]
            self.at += 1
            if head == _STOP:
                break
            if not head >> 4:  # the field id in full, not as a delta
                self.zigzag()
            kind = head & 0x0F
            if kind in _INTEGERS:
                self.varint()
            elif kind not in _BOOLEANS:
                self.skip(kind)
        self.depth -= 1

    def skip_all(self, kind: int, n: int, then: int | None = None) -> None:
        self.enter()
        for _ in range(n):
            self.skip(kind)
            if then is not None:
                self.skip(then)
        self.depth -= 1


@dataclass(frozen=True, slots=True)
class _Leaf:
    """A column of the schema: its physical type and maximum levels."""

    physical: object
    max_definition: int
    max_repetition: int


def _leaves(schema: list[dict]) -> list[_Leaf]:
    """The schema's columns, depth first, from its flattened elements (`num_children`)."""
    leaves: list[_Leaf] = []
    # (children of this group still to visit, its definition and repetition levels)
    stack = [(_children(schema[0]), 0, 0)] if schema else []
    index = 1
    while stack:
        left, definition, repetition = stack.pop()
        if not left:
            continue
        stack.append((left - 1, definition, repetition))
        if index >= len(schema):
            raise _Malformed("the schema lists fewer elements than its groups hold")
        element = schema[index]
        index += 1
        kind = element.get(3)
        level = (definition + (kind in (_OPTIONAL, _REPEATED)), repetition + (kind == _REPEATED))
        if _children(element):
            stack.append((_children(element), *level))
        else:
            leaves.append(_Leaf(element.get(1), *level))
    return leaves


def _children(element: dict) -> int:
    n = element.get(5, 0)
    if n < 0:
        raise _Malformed(f"a schema element with {n} children")
    return n


def tail(path: str | pa.NativeFile) -> bytes:
    """The end of the Parquet file at `path` from its footer on (all of it if that is
    shorter than the footer claims), without reading the rest. `path` may be an object's
    URI, or a random-access file already open (an object's, `iscore.utils.storage.open_input`)."""
    if not isinstance(path, str) or storage.is_uri(path):
        f = storage.open_input(path) if isinstance(path, str) else path
        size = f.size()
        length = int.from_bytes(f.read_at(8, max(size - 8, 0))[:4], "little")
        start = max(size - 8 - length, 0)
        return f.read_at(size - start, start)
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        f.seek(max(size - 8, 0))
        length = int.from_bytes(f.read(8)[:4], "little")
        f.seek(max(size - 8 - length, 0))
        return f.read()


def check(data: bytes, name: str, passed: Passed | Known | None = None) -> str:
    """Raise unless the footer of the Parquet file `data` (the whole file, or its tail from
    the footer on) is one pyarrow reads without aborting: every row group holds a column
    chunk per schema column, with metadata of the column's physical type, and level
    histograms (where it has them) the size its schema's levels give. Stricter than that
    where a field has another Thrift type than its own (only damage does that). A footer
    `passed` holds is not parsed again; one that passes is added to it. Returns the footer's
    SHA-256 (hex), which another process reading the file can be told (`Known`).

    Raises:
        DumpError: "NAME: unreadable Parquet footer: ...", saying what does not fit.
    """
    length = int.from_bytes(data[-8:-4], "little")
    try:
        if len(data) < 8 + length or data[-4:] != b"PAR1":
            raise _Malformed("it claims more bytes than the file has")
        footer = data[-8 - length :]
        if passed is not None and footer in passed:
            return _sha256(footer)
        _check(_Thrift(footer[:-8]).struct(_FILE))
    except _Malformed as e:
        raise DumpError(f"{name}: unreadable Parquet footer: {e}") from None
    if passed is not None:
        passed.add(footer)
    return _sha256(footer)


def _sha256(footer: bytes) -> str:
    return hashlib.sha256(footer).hexdigest()


class Known:
    """Footers another process of this run checked, by their SHA-256 (`check` returns it): a
    worker opening a piece of a file the driver opened does not parse its footer again. A
    footer that changed since has another digest, and is checked.

    >>> known = Known(["ab" * 32])
    >>> b"a footer" in known
    False
    """

    def __init__(self, digests: Iterable[str]):
        self.digests = set(digests)

    def __contains__(self, footer: bytes) -> bool:
        return _sha256(footer) in self.digests

    def add(self, footer: bytes) -> None:
        self.digests.add(_sha256(footer))


class Passed:
    """Footers that passed `check`, each an empty file in `folder` named by the SHA-256 of
    the footer (its metadata and last 8 bytes, as `iscore.passes.results_store.FileIdentity` digests
    it): a results store keeps them, so that a run analyzed again does not parse every file's
    footer again (the parse is most of what opening a small step file costs).

    Whoever can write `folder` can make a footer pass unchecked, as they can make the
    store's results say anything: a store is trusted as the user's own files are
    (docs/security.md). A folder that cannot be written checks every footer each time.
    """

    def __init__(self, folder: str | Path):
        self.folder = Path(folder)

    def _marker(self, footer: bytes) -> Path:
        digest = _sha256(footer)
        return self.folder / digest[:2] / digest

    def __contains__(self, footer: bytes) -> bool:
        return self._marker(footer).is_file()

    def add(self, footer: bytes) -> None:
        marker = self._marker(footer)
        try:
            marker.parent.mkdir(parents=True, exist_ok=True)
            marker.touch()
        except OSError:
            pass  # not kept: checked again next time


def _check(meta: dict[int, object]) -> None:
    leaves = _leaves(meta.get(2, []))
    for g, group in enumerate(meta.get(4, [])):
        chunks = group.get(1, [])
        if len(chunks) != len(leaves):
            raise _Malformed(f"row group {g} has {len(chunks)} column chunks for {len(leaves)}")
        for c, (chunk, leaf) in enumerate(zip(chunks, leaves, strict=True)):
            where = f"row group {g}, column chunk {c}"
            column = chunk.get(3)
            if column is None:
                raise _Malformed(f"{where} has no metadata (an encrypted file is not read)")
            if column.get(1) != leaf.physical:
                raise _Malformed(f"{where} is of another physical type than its column")
            sizes = column.get(16, {})
            for field, levels, what in (
                (2, leaf.max_repetition, "repetition"),
                (3, leaf.max_definition, "definition"),
            ):
                if len(sizes.get(field, [])) not in (0, levels + 1):
                    raise _Malformed(f"{where} has a {what} level histogram that misfits it")
