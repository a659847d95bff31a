"""Writing an output file (`--out`, `--json`, `--html`, `convert`) safely.

A regular file appears whole or not at all: it is written beside the target under a
temporary name and renamed over it at the end, and the temporary file is removed when the
write fails, is interrupted (Ctrl-C) or is terminated (SIGTERM). The file gets the mode any
new file gets from the umask (an existing file keeps its own mode). Anything else that
already exists at the path (a FIFO, a character device, `/dev/stdout`, a symlink to one) is
written directly, never replaced; a directory is refused.

>>> with output_path("report.json") as tmp:      # doctest: +SKIP
...     Path(tmp).write_text("{}")
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import stat
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from iscore.errors import IscoreError, quote

# Paths that reach a process's own descriptors or devices (/dev/stdout -> /proc/self/fd/1,
# which may resolve to the very regular file a shell redirected into): written in place.
_SPECIAL_ROOTS = ("/dev/", "/proc/")


@contextmanager
def output_path(path: str | Path, suffixes: tuple[str, ...] = ()) -> Iterator[str]:
    """The path to write `path`'s content to; on success it becomes `path`.

    Args:
        path: the output file the user named.
        suffixes: the endings a file name must have (any case), e.g. (".parquet",); any
            when empty. A FIFO, a device or another non-regular file may have any name.

    Yields:
        A temporary path in the target's directory for a regular (or new) file, or `path`
        itself for a FIFO, a device or another non-regular file.

    Raises:
        IscoreError: `path` is a directory, its directory does not exist, or its name does
            not end with one of `suffixes`.
    """
    target = Path(path)
    real = Path(os.path.realpath(target))
    st = check_output(path, suffixes)
    if (st is not None and not stat.S_ISREG(st.st_mode)) or str(real).startswith(_SPECIAL_ROOTS):
        yield str(target)
        return
    tmp, fd = _create_beside(real)
    try:
        os.close(fd)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        with _sigterm_raises():
            yield tmp
            # Rename into the resolved path: a symlink to a regular file stays a symlink.
            os.replace(tmp, real)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def check_output(
    path: str | Path, suffixes: tuple[str, ...] = (), inputs: Sequence[str | Path] = ()
) -> os.stat_result | None:
    """Refuse, before any work, an output `output_path` would refuse, or one that is one of
    the `inputs` (the files being read: writing there would destroy them). Returns the
    path's stat, None when it does not exist yet.

    Raises:
        IscoreError: as `output_path`, or `path` names one of `inputs`.
    """
    if not str(path):  # Path("") is the current directory
        raise IscoreError("expected a file name to write, but got an empty path")
    target = Path(path)
    real = Path(os.path.realpath(target))
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise IscoreError(f"{path}: cannot write here: {e.strerror}") from None
    if st is not None and stat.S_ISDIR(st.st_mode):
        raise IscoreError(f"{path}: is a directory; expected a file name to write")
    if st is not None and any(_same(st, source) for source in inputs):
        raise IscoreError(f"{path}: is an input being read; write the output to another file")
    if (st is not None and not stat.S_ISREG(st.st_mode)) or str(real).startswith(_SPECIAL_ROOTS):
        return st
    if suffixes and not target.name.lower().endswith(suffixes):
        raise IscoreError(
            f"{path}: expected a {' or '.join(suffixes)} file name, but got {quote(target.suffix)}"
        )
    if not real.parent.is_dir():
        raise IscoreError(f"{path}: no such directory {real.parent}; create it first")
    return st


def _same(st: os.stat_result, source: str | Path) -> bool:
    """Whether `source` is the file `st` describes (hard and symbolic links included)."""
    try:
        other = os.stat(source)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == (other.st_dev, other.st_ino)


def _create_beside(real: Path) -> tuple[str, int]:
    """A new empty file next to `real`, created with mode 0666 less the umask."""
    while True:
        tmp = str(real.with_name(f".{real.name}.{secrets.token_hex(4)}.tmp"))
        try:
            # Not tempfile.mkstemp: it creates files 0600 whatever the umask says.
            return tmp, os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        except OSError as e:
            raise IscoreError(f"{real}: cannot write here: {e.strerror}") from None


@contextmanager
def _sigterm_raises() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while the block runs, so `finally` clauses clean up.

    Python's default SIGTERM kills the process without unwinding; Ctrl-C already raises
    KeyboardInterrupt. Signal handlers can only be set from the main thread: elsewhere (the
    app's script threads) the process's own handling applies.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be put back; the default is.
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def json_ready(value: Any) -> Any:
    """`value` as strict JSON types: NaN and infinities become None (JSON has no NaN: a
    reader such as `jq` or JavaScript's `JSON.parse` refuses it), numpy scalars Python ones.

    >>> json_ready({"a": float("nan"), "b": [1.5, float("inf")]})
    {'a': None, 'b': [1.5, None]}
    """
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [json_ready(v) for v in value]
    if isinstance(value, float) or hasattr(value, "dtype"):
        number = value.item() if hasattr(value, "item") else value
        if isinstance(number, float) and not math.isfinite(number):
            return None
        return number
    return value


def write_json(value: Any, path: str | Path, indent: int = 1) -> None:
    """Write `value` (`json_ready`) as strict JSON to `path`, whole or not at all."""
    text = json.dumps(json_ready(value), indent=indent, allow_nan=False) + "\n"
    with output_path(path) as tmp:
        Path(tmp).write_text(text)
