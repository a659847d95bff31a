"""What the dashboard's server may do: which Host names it answers, which folders it reads.

Headless (no streamlit), so that the rules are tested without a server; `app/serve.py` and
`app/common.py` apply them. See docs/security.md for the threat model.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from iscore.errors import DumpError
from iscore.utils import storage

LOOPBACK_HOSTS = ("localhost", "127.0.0.1", "::1")
"""The names a browser on the server's own machine uses; the default allowed hosts."""

FOLLOW_INTERVAL_S = 10.0
"""How often `iscore app DIR --follow` looks at the run's folder, unless told (`--interval`)."""

QUOTE = 200
"""At most this many characters of what the user typed are quoted back."""


def host_allowed(host: str | None, allowed: Iterable[str]) -> bool:
    """Whether a Host header (`name[:port]`) names one of `allowed`: exact names, `*.domain`
    for its subdomains, or `*` for any.

    >>> host_allowed("localhost:8501", LOOPBACK_HOSTS), host_allowed("[::1]:8501", LOOPBACK_HOSTS)
    (True, True)
    >>> host_allowed("rebound.example:8501", LOOPBACK_HOSTS), host_allowed("a.b.io", ["*.b.io"])
    (False, True)
    """
    if not host:
        return False
    try:
        parts = urlsplit(f"//{host}")
        name, _ = parts.hostname, parts.port  # .port raises on a malformed port
    except ValueError:
        return False
    if name is None or parts.username is not None or parts.path or parts.query:
        return False
    name = name.rstrip(".")
    for pattern in allowed:
        pattern = pattern.strip().lower().rstrip(".")
        if pattern == "*" or name == pattern:
            return True
        if pattern.startswith("*.") and name.endswith(pattern[1:]):
            return True
    return False


def dump_folder(dump: str | Path) -> Path | str:
    """The folder a dump named on the command line lies in: a directory itself, a file's
    parent, or the fixed part of a glob (`runs/step_*.parquet` -> `runs`); for an
    object-storage URI, the prefix (`s3://bucket/run/step_*.parquet` -> `s3://bucket/run/`)."""
    if storage.is_uri(dump):
        parts = str(dump).split("/")
        fixed = next((i for i, part in enumerate(parts) if glob.has_magic(part)), None)
        if fixed is not None:
            return "/".join(parts[:fixed]) + "/"
        if parts[-1] == "" or storage.is_prefix(str(dump)):
            return str(dump).rstrip("/") + "/"
        return "/".join(parts[:-1]) + "/"
    path = Path(dump)
    if path.is_dir():
        return path
    if path.exists() or not glob.has_magic(str(dump)):
        return path.parent
    return _glob_base(path)[0]


def _glob_base(pattern: Path) -> tuple[Path, tuple[str, ...]]:
    """A glob split into the folder before its first wildcard and the parts after it."""
    parts = pattern.parts
    fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
    return Path(*parts[:fixed]) if fixed else Path("."), parts[fixed:]


def _root(folder: str | Path) -> Path | str:
    """A data root resolved: a local folder's real path, or a prefix ending in `/`."""
    if storage.is_uri(folder):
        return str(folder).rstrip("/") + "/"
    return Path(folder).resolve()


def _prefix(root: str) -> tuple[str, str] | None:
    """(kind, `bucket/prefix/`) of a URI root; None for one that is no valid URI (it holds
    nothing)."""
    try:
        return storage.split(root)
    except DumpError:
        return None


class DataRoots:
    """The folders whose files the dashboard may read by path (its server-path box).

    A path is resolved (symlinks and `..`) before it is checked, the files a directory or a
    glob expands to are checked one by one, and a glob is only evaluated from a folder inside
    the roots, never climbing out of it with `..`. What is missing and what is not allowed
    get the same message, so the box tells nothing about the server's other files.

    A root may be an object-storage prefix (`s3://bucket/run/`): it holds the objects whose
    keys start with it, and a URI with a `.` or `..` component is refused (keys are not
    resolved, so none climbs out of its prefix).

    Args:
        folders: the operator's folders (`iscore app --data-dir`), the folder of the dump
            named on the command line, the bundled samples. Missing folders are left out
            (a prefix is kept unlisted: an empty one holds nothing).
    """

    def __init__(self, folders: Iterable[str | Path]):
        resolved = (_root(f) for f in folders)
        kept = (f for f in resolved if isinstance(f, str) or f.is_dir())
        self.folders: tuple[Path | str, ...] = tuple(dict.fromkeys(kept))

    def __contains__(self, path: str | Path) -> bool:
        if storage.is_uri(path):
            try:
                kind, key = storage.split(str(path))
            except DumpError:
                return False
            prefixes = (_prefix(f) for f in self.folders if isinstance(f, str))
            return any(p is not None and (kind, key[: len(p[1])]) == p for p in prefixes)
        real = Path(path).resolve()
        return any(isinstance(f, Path) and real.is_relative_to(f) for f in self.folders)

    def refusal(self, text: str) -> DumpError:
        """The one error for a path that is missing or outside the roots."""
        shown = text if len(text) <= QUOTE else text[:QUOTE] + "…"
        where = ", ".join(map(str, self.folders)) or "(none)"
        return DumpError(
            f"{shown}: no such file, directory or glob match in the folders this app may "
            f"read: {where} (the operator adds folders with `iscore app --data-dir DIR`)"
        )

    def check(self, text: str) -> str:
        """`text` (a file, directory or glob) if it may be opened, made absolute.

        A path that exists is taken as itself, before any glob interpretation.

        Raises:
            DumpError: missing, outside the roots, or a glob that climbs out with `..`.
        """
        if storage.is_uri(text):
            base = dump_folder(text) if glob.has_magic(text) else text
            if text not in self or base not in self:
                raise self.refusal(text)
            return text
        path = Path(text)
        if os.path.lexists(path):
            if not path.exists() or path not in self:
                raise self.refusal(text)
            return str(path.absolute())
        if not glob.has_magic(text):
            raise self.refusal(text)
        base, rest = _glob_base(path)
        if ".." in rest or not base.is_dir() or base not in self:
            raise self.refusal(text)
        return str(path.absolute())

    def files(
        self, text: str, expand: Callable[[str], Sequence[tuple[str, int, int]]]
    ) -> tuple[tuple[str, int, int], ...]:
        """What `expand` (e.g. `iscore.session.workspace.fingerprint`) makes of a checked `text`,
        every file of it inside the roots.

        Raises:
            DumpError: `check` refuses `text`, or a file it expands to lies outside the roots
                (a symlink out of them).
        """
        found = tuple(expand(self.check(text)))
        if not all(path in self for path, _, _ in found):
            raise self.refusal(text)
        return found
