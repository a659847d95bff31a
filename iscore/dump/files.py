"""Where a dump's files are and what each holds: paths, directories and globs expanded, one
Parquet file opened and told apart from an empty, truncated or foreign one, a framework's own
dump converted in memory."""

from __future__ import annotations

import glob
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from iscore.dump.columns import resolve_columns
from iscore.dump.schema import check_types, extras_of, is_list, scalar_type
from iscore.dump.values import DumpFile, Layout
from iscore.dump.writer import PROVENANCE_KEY
from iscore.errors import DumpError, DumpProblems, Problem, clip, quote
from iscore.utils import footer, list_files, storage


def resolve_files(source: str | Path | Sequence[str | Path]) -> list[str]:
    """Expand a file, a directory (every `*.parquet` below it) or a glob into sorted paths.

    A path that exists is read as itself, even when its name looks like a glob
    (`run[1].parquet`). See `list_files` for the limits of walks and globs.

    Raises:
        DumpError: nothing matches, or a walk or glob went past its budget.
    """
    if isinstance(source, str | Path):
        sources: Sequence[str | Path] = [source]
    else:
        sources = source
    files: list[str] = []
    for item in sources:
        found = sorted(list_files(item, (".parquet",)))
        if not found:
            if storage.is_uri(item):
                is_dir = storage.is_prefix(str(item))
                holder = "prefix holds"
            else:
                is_dir = Path(item).is_dir()
                holder = "directory holds"
            what = f"{holder} no *.parquet files" if is_dir else "the pattern matches no files"
            raise DumpError(f"{item}: {what}")
        files.extend(found)
    return files


Location = str | bytes
"""Where a file's bytes are: a path on disk, or the bytes themselves (an upload, an import)."""


def open_file(
    path: str,
    mapping: Mapping[str, str],
    data: bytes | None = None,
    passed: footer.Passed | footer.Known | None = None,
) -> tuple[pq.ParquetFile, DumpFile]:
    """Open one file, telling an empty, truncated or non-Parquet file apart.

    Args:
        path: the file's path, or for `data` the name that stands for it in messages.
        mapping: explicit canonical -> source column names.
        data: the file's bytes when it is held in memory.
        passed: footers known to pass `footer.check` (a results store's), not parsed again.
    """
    remote = storage.open_input(path) if data is None and storage.is_uri(path) else None
    if remote is not None:
        size = remote.size()
        head = remote.read_at(4, 0) if size else b""
        tail = remote.read_at(4, max(size - 4, 0)) if size else b""
    elif data is None:
        size = Path(path).stat().st_size
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(max(size - 4, 0))
            tail = f.read(4)
    else:
        size, head, tail = len(data), data[:4], data[-4:]
    if size == 0:
        raise DumpError(f"{path}: empty file (0 bytes)")
    if head != b"PAR1":
        hint = {
            b"{": " (looks like JSON Lines)",
            b"\x80": " (looks like a pickle)",
        }.get(
            head[:1],
            " (looks like a zip archive, e.g. torch.save)" if head[:2] == b"PK" else "",
        )
        raise DumpError(f"{path}: not a Parquet file{hint}; expected the magic bytes PAR1")
    if tail != b"PAR1" or size < 12:
        raise DumpError(
            f"{path}: truncated Parquet file ({size:,} bytes, no footer); "
            "was the write interrupted?"
        )
    end = footer.tail(remote if remote is not None else path) if data is None else data
    digest = footer.check(end, path, passed)  # before pyarrow
    try:
        # Pages written with a CRC are checked against it as they are read (Parquet's
        # checksums are optional: pages without one are read as they are).
        # An object's column chunks are fetched in coalesced, parallel ranged requests
        # (`pre_buffer`, pyarrow's advice for high-latency stores; not measured here, where
        # the only store is a local server), a local file's as before.
        held = remote if remote is not None else path if data is None else pa.BufferReader(data)
        parquet = pq.ParquetFile(
            held, page_checksum_verification=True, pre_buffer=remote is not None
        )
    except (pa.ArrowException, OSError, ValueError) as e:  # a name not UTF-8: ValueError
        raise DumpError(f"{path}: unreadable Parquet footer: {e}") from e
    if parquet.metadata.num_rows == 0:
        raise DumpError(f"{path}: empty file (a Parquet schema but no rows)")
    schema = parquet.schema_arrow
    twice = [name for name, n in Counter(schema.names).items() if n > 1]
    if twice:
        raise DumpProblems(
            [
                Problem(path, clip(name), "appears more than once; a dump names each column once")
                for name in twice
            ]
        )
    provenance = _provenance(path, schema)
    columns = resolve_columns(schema.names, mapping, path, sequence_layout=True)
    rollout_type = schema.field(columns.source["rollout_logprob"]).type
    layout: Layout = "sequence" if is_list(rollout_type) else "token"
    if layout == "token" and "seq_id" not in columns:
        resolve_columns(schema.names, mapping, path)  # raises: seq_id is required here
    check_types(path, schema, columns, layout)
    meta = parquet.metadata
    tokens = meta.num_rows
    if layout == "sequence":
        # The leaf column's value counts are the token counts.
        tokens = sum(
            leaf(meta, g, columns.source["rollout_logprob"]).num_values
            for g in range(meta.num_row_groups)
        )
    seq_id_type = pa.int64()
    if "seq_id" in columns:
        seq_id_type = scalar_type(schema.field(columns.source["seq_id"]).type)
    extras = extras_of(schema, columns, layout)
    info = DumpFile(
        path, layout, columns, meta.num_rows, tokens, extras, seq_id_type, provenance, digest
    )
    return parquet, info


_PROVENANCE_TYPES = {"framework": (str, type(None)), "source_files": list, "steps": list}
"""The provenance fields shown to users, and their JSON types."""


def _provenance(path: str, schema: pa.Schema) -> dict:
    """The file's `iscore.provenance` record ({} when it has none), checked to be what an
    importer writes: a JSON object whose shown fields have their types."""
    raw = (schema.metadata or {}).get(PROVENANCE_KEY)
    if raw is None:
        return {}
    try:
        record = json.loads(raw)
    except (ValueError, RecursionError):
        record = None
    expected = (
        "a JSON object with framework (a string), source_files and steps (lists), as iscore's "
        "importers write it; rewrite the file without this metadata key to read its data"
    )
    what = f"metadata {PROVENANCE_KEY.decode()}"
    if not isinstance(record, dict):
        found = "not JSON" if record is None else f"a JSON {type(record).__name__}"
        raise DumpProblems([Problem(path, None, f"{what}: expected {expected}; found {found}")])
    for key, types in _PROVENANCE_TYPES.items():
        if key in record and not isinstance(record[key], types):
            found = f"{key} {quote(record[key], 60)}"
            raise DumpProblems([Problem(path, None, f"{what}: expected {expected}; found {found}")])
    return record


def is_framework_dump(item: str | Path) -> bool:
    """Whether `item` is a framework's own dump (JSONL, .pt, .pkl) rather than Parquet (an
    object-storage URI is read as Parquet)."""
    if storage.is_uri(item):
        return False
    path = Path(item)
    if path.is_dir():
        return not any(list_files(path, (".parquet",)))
    if glob.has_magic(str(item)) and not path.exists():
        return False
    return path.suffix in (".jsonl", ".pt", ".pkl")


def import_framework_dump(
    item: str | Path, fmt: str | None, allow_pickle: bool
) -> tuple[str, bytes]:
    """A framework dump converted in memory to canonical Parquet bytes, named for messages."""
    from iscore.dump import importers  # torch.load and JSON parsing, only when needed

    fmt = fmt or importers.detect(item)
    table = importers.read(item, fmt, allow_pickle=allow_pickle)
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return f"{item} ({fmt})", sink.getvalue().to_pybytes()


def leaf(meta: pq.FileMetaData, group: int, source: str) -> pq.ColumnChunkMetaData:
    """The column chunk of row group `group` holding a (list) column's leaf values, found by
    the schema's paths (a chunk's own `path_in_schema` is not checked to be UTF-8)."""
    for i in range(meta.num_columns):
        if meta.schema.column(i).path.split(".")[0] == source:
            return meta.row_group(group).column(i)
    raise KeyError(source)
