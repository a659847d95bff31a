r"""Read the dumps RL frameworks write into iscore's canonical sequence-layout table.

One module per source format, each reading exactly what that framework writes:

- `nemo_rl`: NeMo-RL's `train_data_step{N}.jsonl`, written every GRPO step by default.
- `prime_rl`: prime-rl's `token_exports/step_{N}/rank_{R}.jsonl` (`trainer.enable_token_export`).
- `slime`: slime's `--save-debug-train-data` / `--dump-details` `.pt` files, format_version 2
  and the older per-rank layout.
- `skyrl`: SkyRL's `global_step_{N}_training_input.pkl` (`trainer.dump_data_batch`), read
  only with `allow_pickle=True`, by a restricted unpickler.

`read` takes files on disk; `read_buffers` the same files held in memory (uploads, as
(name, bytes) pairs), read from memory and never written anywhere.

Every importer keeps the tokens the framework's own mask marks as response tokens, in order,
and never infers anything from padding values. The result has one row per sequence: `step`,
`seq_id`, `rollout_logprob` and `train_logprob` (list<float32>), and, where the source has
them, `loss_mask`, `advantage` (float32 per sequence or list<float32> per token), `token_id`
(list<int32>), `reward` (float32), `group_id` and `entropy`. Its schema metadata holds the
provenance as JSON under `iscore.provenance`: `framework`, `source_files`, `steps`, and
`format_version` and `notes` where there are any.

>>> import json, pathlib, tempfile
>>> logs = pathlib.Path(tempfile.mkdtemp())
>>> line = {"token_loss_mask": [[0, 1, 1]], "generation_logprobs": [[0.0, -0.5, -0.25]],
...         "prev_logprobs": [[-2.0, -0.5, -0.375]]}
>>> _ = (logs / "train_data_step3.jsonl").write_text(json.dumps(line) + "\n")
>>> detect(logs)
'nemo_rl'
>>> read(logs)["train_logprob"].to_pylist()
[[-0.5, -0.375]]
>>> report = convert(logs, logs / "run.parquet")
>>> report.files, report.steps, report.sequences, report.tokens
(1, 1, 1, 2)
>>> upload = ("train_data_step3.jsonl", json.dumps(line).encode())
>>> read_buffers([upload])["rollout_logprob"].to_pylist()
[[-0.5, -0.25]]
"""

from __future__ import annotations

import importlib
import io
import json
import math
import re
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path, PurePosixPath
from types import ModuleType
from typing import BinaryIO

import numpy as np
import pyarrow as pa

from iscore.dump.writer import PROVENANCE_KEY, DumpWriter, schema_mismatch
from iscore.errors import DumpError, DumpProblems, Problem, quote
from iscore.utils import list_files, output_path

__all__ = [
    "FORMATS",
    "PICKLED",
    "SUFFIXES",
    "Buffer",
    "ConvertReport",
    "ConvertedFile",
    "convert",
    "detect",
    "read",
    "read_buffers",
]

FORMATS = ("nemo_rl", "prime_rl", "slime", "skyrl")
"""The source formats, by the name `fmt` takes."""

SUFFIXES = (".jsonl", ".pt", ".pkl")
"""File types any format reads; a directory's other files are never opened."""

PICKLED = (".pt", ".pkl")
"""File types that are pickles (torch.save writes one inside a zip archive)."""


@dataclass(frozen=True, slots=True)
class Buffer:
    """A file held in memory (an upload), read where a format reads a file on disk.

    Only the name-based parts of `pathlib.Path` it needs (`name`, `suffix`, `as_posix`): it
    has no parent folder, so nothing beside it (prime-rl's `STABLE` marker, slime's rollout
    dump) is looked for, and no `__fspath__`, so nothing can open it from disk by mistake.

    Attributes:
        path: its name (an upload's file name), standing for a path in messages.
        data: its bytes.
    """

    path: str
    data: bytes

    @property
    def name(self) -> str:
        return PurePosixPath(self.path).name

    @property
    def suffix(self) -> str:
        return PurePosixPath(self.path).suffix

    def as_posix(self) -> str:
        return self.path

    def __str__(self) -> str:
        return self.path


File = Path | Buffer
"""A source file: on disk, or held in memory."""


def open_binary(file: File) -> BinaryIO:
    """`file` opened for reading bytes, from disk or from memory."""
    return io.BytesIO(file.data) if isinstance(file, Buffer) else open(file, "rb")


@dataclass(frozen=True, slots=True)
class ConvertedFile:
    """One source file, converted.

    Attributes:
        path: the source file.
        table: its canonical sequence-layout table; None when it holds no sequences.
        format_version: the version the file states, if any.
        notes: what the reader left out or noticed, for the report and the provenance.
    """

    path: str
    table: pa.Table | None
    format_version: int | str | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ConvertReport:
    """What `convert` wrote.

    Attributes:
        framework: the source format.
        out: the Parquet file written.
        files: source files read.
        steps: distinct training steps.
        sequences: sequences (rows) written.
        tokens: tokens written.
        notes: what was left out or noticed (e.g. fields that need `allow_pickle`).
    """

    framework: str
    out: str
    files: int
    steps: int
    sequences: int
    tokens: int
    notes: tuple[str, ...] = ()


def _module(fmt: str) -> ModuleType:
    # Imported on demand: the format modules import this package's helpers.
    if fmt not in FORMATS:
        raise DumpError(f"Unknown dump format {quote(fmt)}; expected one of {', '.join(FORMATS)}")
    return importlib.import_module(f"iscore.dump.importers.{fmt}")


def _natural_key(path: File) -> list:
    """Sort step_2 before step_10."""
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.as_posix())]


def _expand(source: str | Path) -> tuple[list[Path], bool]:
    """The files under `source`, and whether it named one file explicitly."""
    path = Path(source)
    if path.is_file():
        return [path], True
    found = [Path(p) for p in list_files(source, SUFFIXES)]
    if not found and not path.is_dir():
        raise DumpError(f"{source}: the pattern matches no files")
    return sorted(found, key=_natural_key), False


def _claims(files: Sequence[File]) -> dict[str, list[File]]:
    """Each format's files among `files` (by name, else by a cheap look at the content)."""
    return {fmt: [f for f in files if _module(fmt).claims(f)] for fmt in FORMATS}


def _plan(source: str | Path, fmt: str | None, flag: str = "--format") -> tuple[str, list[File]]:
    """The format and the files to read, in step order."""
    files, explicit = _expand(source)
    return _choose(str(source), files, fmt, explicit, flag)


def _choose(
    source: str, files: list[File], fmt: str | None, explicit: bool, flag: str = "--format"
) -> tuple[str, list[File]]:
    """The format of `files` and those of them it reads.

    Args:
        source: what the files stand for, in messages.
        files: the candidates.
        fmt: the format named, or None to detect it.
        explicit: whether every file was named on purpose (a file, uploads): then each must
            be read, never skipped as another kind of file in a directory would be.
        flag: the command-line option that names the format, in messages.
    """
    if fmt is not None:
        module = _module(fmt)
        if explicit:
            return fmt, files
        chosen = [f for f in files if module.claims(f)]
        if not chosen:
            raise DumpError(f"{source}: no {module.DESCRIPTION} files found")
        return fmt, chosen
    claimed = {name: found for name, found in _claims(files).items() if found}
    expected = "; ".join(f"{name}: {_module(name).DESCRIPTION}" for name in FORMATS)
    if not claimed:
        raise DumpError(
            f"{source}: no file looks like a dump iscore can import (expected {expected}); "
            f"name the format ({flag}; fmt= in Python)"
        )
    if explicit:
        known = {id(f) for found in claimed.values() for f in found}
        for file in files:
            if id(file) not in known:
                raise DumpError(
                    f"{file}: does not look like a dump iscore can import (expected {expected})"
                )
    if len(claimed) == 1:
        ((name, found),) = claimed.items()
        return name, found
    candidates = "; ".join(
        f"{name} ({len(found)} file{'s' if len(found) > 1 else ''}, e.g. {found[0]})"
        for name, found in claimed.items()
    )
    raise DumpError(
        f"{source}: the files look like more than one format: {candidates}; "
        f"name the format ({flag}; fmt= in Python) or point at one format's files"
    )


def detect(source: str | Path) -> str:
    """The format of the dump at `source` (a file, a directory or a glob).

    Decided by file names (`train_data_step{N}.jsonl`, `step_{N}/rank_{R}.jsonl`,
    `global_step_{N}_training_input.pkl`) and otherwise by content: a JSON Lines record's
    keys (`generation_logprobs`/`prev_logprobs`: nemo_rl; `inference_logprobs`/
    `trainer_logprobs`: prime_rl), a `.pt` file's pickled key names (`format_version` or
    `rollout_data`: slime; read without unpickling), a `.pkl` file's SkyRL class names.

    Raises:
        DumpError: no file matches any format, or files match several (all are listed).

    >>> detect("logs/train_data_step3.jsonl")  # doctest: +SKIP
    'nemo_rl'
    """
    return _plan(source, None)[0]


def read(source: str | Path, fmt: str | None = None, *, allow_pickle: bool = False) -> pa.Table:
    """Read a framework's dump into one canonical sequence-layout table, in memory.

    Args:
        source: a file, a directory or a glob.
        fmt: one of `FORMATS`; detected when None (see `detect`).
        allow_pickle: allow pickle-based sources (SkyRL's `.pkl`, slime's rollout dump),
            still read by restricted loaders that rebuild tensors and plain containers only.

    Raises:
        DumpError: the format cannot be told, or a file is malformed (the message names the
            file and the field, and the line or sample).

    >>> table = read("runs/token_exports", fmt="prime_rl")  # doctest: +SKIP
    """
    fmt, files = _plan(source, fmt)
    return _table(str(source), fmt, files, allow_pickle)


def read_buffers(
    files: Sequence[tuple[str, bytes]], fmt: str | None = None, *, allow_pickle: bool = False
) -> pa.Table:
    """`read` for files held in memory, e.g. uploads: (name, bytes) pairs, in step order.

    The names stand for paths: in messages, and for the formats that take the step from the
    file name (`train_data_step{N}.jsonl`, `global_step_{N}_training_input.pkl`). Every file
    must be of the one format; nothing is written anywhere.

    Raises:
        DumpError: as `read`; also a file that is no dump of a known format.

    >>> read_buffers([("rank_0.jsonl", b'{"step": 2, "rank": 0, "loss_mask": [1], '
    ...     b'"inference_logprobs": [-1.0], "trainer_logprobs": [-0.5]}')])["seq_id"].to_pylist()
    ['0:0']
    """
    if not files:
        raise DumpError("no files given")
    buffers: list[File] = [Buffer(name, data) for name, data in files]
    source = ", ".join(str(b) for b in buffers)
    fmt, chosen = _choose(source, buffers, fmt, explicit=True)
    return _table(source, fmt, chosen, allow_pickle)


def _table(source: str, fmt: str, files: list[File], allow_pickle: bool) -> pa.Table:
    """The format's files read into one table, with their provenance in its metadata."""
    parts = list(_parts(fmt, files, allow_pickle))
    tables = [part.table for part in parts if part.table is not None]
    if not tables:
        raise file_problem(source, f"no sequences in {len(files)} {fmt} file(s)")
    table = pa.concat_tables(tables)
    steps = np.unique(table["step"].to_numpy()).tolist()
    record = {"framework": fmt, "source_files": [str(f) for f in files], "steps": steps}
    record.update(_summary(parts))
    return table.replace_schema_metadata({PROVENANCE_KEY: json.dumps(record)})


def convert(
    source: str | Path, out: str | Path, fmt: str | None = None, *, allow_pickle: bool = False
) -> ConvertReport:
    """Convert a framework's dump to canonical Parquet, one source file at a time.

    Each source file becomes one row group (zstd), so a dump larger than memory converts
    in the memory of its largest file. The provenance goes into the Parquet footer. `out`
    appears only when the whole conversion succeeds.

    Args:
        source: a file, a directory or a glob.
        out: the Parquet file to write.
        fmt: one of `FORMATS`; detected when None.
        allow_pickle: see `read`.

    Raises:
        DumpError: as `read`, or the files disagree on their columns.

    >>> convert("dumped_data/", "skyrl.parquet", allow_pickle=True)  # doctest: +SKIP
    ConvertReport(framework='skyrl', out='skyrl.parquet', files=3, steps=3, ...)
    """
    fmt, files = _plan(source, fmt, flag="--from")
    parts: list[ConvertedFile] = []
    with output_path(out) as tmp:
        writer = DumpWriter(tmp, framework=fmt)
        try:
            for part in _parts(fmt, files, allow_pickle):
                if part.table is not None:
                    writer.write_table(part.table)
                parts.append(replace(part, table=None))  # keep the notes, not the data
            if not writer.sequences:
                raise file_problem(source, f"no sequences in {len(files)} {fmt} file(s)")
            summary = _summary(parts)
            writer.close({"source_files": [str(f) for f in files], **summary})
        finally:
            writer.close()
    return ConvertReport(
        framework=fmt,
        out=str(out),
        files=len(files),
        steps=len(writer.steps),
        sequences=writer.sequences,
        tokens=writer.tokens,
        notes=tuple(summary.get("notes", ())),
    )


def _parts(fmt: str, files: list[File], allow_pickle: bool) -> Iterator[ConvertedFile]:
    """The format's parts, checked to share the first table's columns (a file has one schema).

    What is wrong with a file is a problem of the dump, naming the file, as a Parquet file's
    are (`DumpProblems`: the CLI exits 1).
    """
    first: ConvertedFile | None = None
    parts = iter(_module(fmt).read_parts(files, allow_pickle=allow_pickle))
    for file in files:  # each format yields one part per file, in their order
        try:
            part = next(parts)
        except DumpProblems:
            raise
        except DumpError as e:
            raise file_problem(file, str(e)) from None
        if part.table is not None:
            if first is None:
                first = part
            else:
                why = schema_mismatch(first.table.schema, part.table.schema)
                if why:
                    raise file_problem(file, f"{why} compared with {first.path}")
        yield part


def file_problem(file: File | str, message: str) -> DumpProblems:
    """`message` as the one problem of `file` (its leading `file: ` left out)."""
    return DumpProblems([Problem(str(file), None, message.removeprefix(f"{file}: "))])


def _summary(parts: list[ConvertedFile]) -> dict[str, object]:
    """The provenance fields the files themselves contribute: format_version and notes."""
    record: dict[str, object] = {}
    versions = sorted({p.format_version for p in parts if p.format_version is not None}, key=str)
    if versions:
        record["format_version"] = versions[0] if len(versions) == 1 else versions
    notes = list(dict.fromkeys(n for p in parts for n in p.notes))
    if notes:
        record["notes"] = notes
    return record


# Helpers shared by the format modules.


def jsonl_records(path: File) -> Iterator[tuple[int, dict]]:
    """Yield (1-based line number, object) for every non-blank line of a JSON Lines file.

    Raises:
        DumpError: a line is not JSON or not an object (the message names the line).
    """
    with open_binary(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                why = f"{e.msg} at column {e.colno}" if isinstance(e, json.JSONDecodeError) else e
                cut = "" if line.endswith(b"\n") else "; the file ends mid-line: was it cut off?"
                raise DumpError(f"{path}: line {number}: not valid JSON ({why}){cut}") from None
            except RecursionError:
                raise DumpError(
                    f"{path}: line {number}: nests too deeply to parse; a record is an object "
                    "of numbers and flat lists"
                ) from None
            if not isinstance(record, dict):
                raise DumpError(
                    f"{path}: line {number}: expected a JSON object, found {type(record).__name__}"
                )
            yield number, record


def first_record(path: File) -> dict | None:
    """The first JSON object of a JSON Lines file, or None if it has none or is not JSON."""
    try:
        with open_binary(path) as f:
            for line in f:
                if line.strip():
                    record = json.loads(line)
                    return record if isinstance(record, dict) else None
    except (OSError, ValueError, RecursionError):
        return None
    return None


def _flat(values: object, where: str, key: str, what: str, ok: Callable[[object], bool]) -> None:
    """Raise unless `values` is a list whose every item is `ok` (`what`, in the message),
    quoting the first item that is not (or `values` itself, when it is no list)."""
    bad = next((v for v in values if not ok(v)), _NONE) if isinstance(values, list) else values
    if bad is not _NONE:
        raise DumpError(
            f"{where}: {quote(key)} must be a flat list of {what}, found {quote(bad, 60)}"
        )


_NONE = object()
"""No bad item: `_flat`'s sentinel (None is an item a list can hold)."""


def _real(value: object) -> float:
    """A JSON number as a float: null is NaN, an integer beyond float64's range infinite (as
    JSON's 1e400 is); either is an invalid log-prob `iscore validate` reports."""
    if value is None:
        return math.nan
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def as_number(value: object, where: str, key: str) -> float:
    """One JSON number (not a boolean) as a float; an integer beyond float64's range is
    infinite, as JSON's 1e400 is."""
    if type(value) not in (int, float):
        raise DumpError(f"{where}: {quote(key)} must be a number, found {quote(value, 60)}")
    return _real(value)


def _numpy_kind(values: np.ndarray, where: str, key: str, kinds: str, what: str) -> np.ndarray:
    if values.ndim != 1 or (values.size and values.dtype.kind not in kinds):
        found = f"shape {list(values.shape)}" if values.ndim != 1 else str(values.dtype)
        raise DumpError(f"{where}: {quote(key)} must be a flat array of {what}, found {found}")
    return values


def as_floats(values: object, where: str, key: str) -> np.ndarray:
    """A 1-D float64 array of a list of numbers or nulls (NaN, for `iscore validate` to
    report), or of a numpy array of real numbers. Booleans, strings and complex numbers are
    refused, never converted."""
    if isinstance(values, np.ndarray):
        return _numpy_kind(values, where, key, "iuf", "real numbers").astype(np.float64)
    _flat(values, where, key, "numbers", lambda v: v is None or type(v) in (int, float))
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        return np.array([_real(v) for v in values], dtype=np.float64)


def as_mask(values: object, where: str, key: str) -> np.ndarray:
    """A 1-D bool array from booleans or 0/1 (a list, or a numpy array)."""
    if not isinstance(values, np.ndarray):
        _flat(values, where, key, "booleans or 0/1", lambda v: type(v) in _MASK and v in (0, 1))
        return np.array(values, dtype=bool)
    array = _numpy_kind(values, where, key, "biuf", "booleans or 0/1")
    odd = array[(array != 0) & (array != 1)]
    if odd.size:
        raise DumpError(f"{where}: {quote(key)} must hold booleans or 0/1, found {odd[0].item()}")
    return array != 0


_MASK = (bool, int, float)


def as_ints(values: object, where: str, key: str, dtype: type = np.int64) -> np.ndarray:
    """A 1-D array of `dtype` from a list of integers or a numpy integer array, refusing
    values `dtype` cannot hold (a token id of 2^40 would wrap in int32)."""
    if isinstance(values, np.ndarray):
        _numpy_kind(values, where, key, "iu", "integers")
    else:
        _flat(values, where, key, "integers", lambda v: type(v) is int)
    if len(values):
        info = np.iinfo(dtype)
        lo, hi = min(values), max(values)
        if lo < info.min or hi > info.max:
            bad = lo if lo < info.min else hi
            raise DumpError(
                f"{where}: {quote(key)} holds {bad}, outside the {np.dtype(dtype)} range "
                f"({info.min:,} to {info.max:,})"
            )
    return np.asarray(values, dtype=dtype)


_INT64_MAX = 2**63 - 1


def as_index(value: object, where: str, key: str) -> int:
    """One integer from 0 to 2^63 - 1 (a step, an index, a length): a JSON integer, a numpy
    integer or an integer array of one element."""
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iu":
        value = value.item()
    elif isinstance(value, np.integer):
        value = int(value)
    if type(value) is not int or not 0 <= value <= _INT64_MAX:
        raise DumpError(
            f"{where}: {quote(key)} must be an integer from 0 to 2^63 - 1, found {quote(value, 60)}"
        )
    return value


def require_lengths(where: str, arrays: dict[str, np.ndarray], reference: str) -> None:
    """Raise unless every per-token array has as many values as `arrays[reference]`."""
    n = arrays[reference].size
    for key, array in arrays.items():
        if array.size != n:
            raise DumpError(
                f"{where}: {quote(key)} has {array.size} values but {quote(reference)} has {n}; "
                "per-token fields must align"
            )


def load_weights_only(file: BinaryIO, allowed: Sequence = ()) -> object:
    """`torch.load(file, weights_only=True, map_location="cpu")`, with the `allowed` globals
    besides torch's own, and without torch's warnings about the file (its pickle protocol,
    say): whether it loads is what matters, and a refusal says why."""
    import torch  # here: only the pickled formats need it, and it takes seconds to import

    with warnings.catch_warnings(), torch.serialization.safe_globals(list(allowed)):
        warnings.simplefilter("ignore")
        return torch.load(file, weights_only=True, map_location="cpu")


def _refused_global(error: Exception) -> str | None:
    """The global torch's weights-only unpickler refused, if that is why it failed."""
    # "Unsupported global: GLOBAL a.b was not ..." or "unsupported GLOBAL a.b whose module ..."
    match = re.search(r"unsupported global:? (?:GLOBAL )?([\w.]+)", str(error), re.IGNORECASE)
    return match[1] if match else None


def unpickling_detail(error: Exception) -> str:
    """One line saying why `torch.load(weights_only=True)` failed."""
    name = _refused_global(error)
    if name is not None:
        return f"it needs {name}, which is not allowed"
    # torch's message opens with a generic paragraph; the reason follows it.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    reason = [line for line in lines[1:] if not line.startswith(("Check the doc", "Please file"))]
    return (reason or lines or [type(error).__name__])[0].removeprefix("WeightsUnpickler error: ")
