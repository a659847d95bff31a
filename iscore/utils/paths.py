"""Listing the files a path names: the file itself, the files under a directory, or a glob's
matches, within a budget of directory entries and time, never through a symlinked directory;
and the folder iscore keeps its caches in (`default_folder`).

>>> sorted(list_files("data", (".md",)))
['data/README.md']
"""

from __future__ import annotations

import fnmatch
import glob
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from iscore.errors import DumpError
from iscore.utils import storage

MAX_LISTED = 100_000
"""The most directory entries one directory walk or glob looks at before it stops."""

LIST_SECONDS = 10.0
"""The longest one directory walk or glob runs before it stops."""


def list_files(
    item: str | Path,
    suffixes: tuple[str, ...],
    *,
    max_listed: int | None = None,
    seconds: float | None = None,
) -> Iterator[str]:
    """The files `item` names: itself if it exists, else the files under a directory whose
    names end with one of `suffixes`, else the files a glob (`*`, `?`, `[...]`, `**`) matches.

    Walks and globs never enter a symlinked directory (a link to a file is a file), so a
    link cycle (`/proc`, a link to `..`) cannot make them loop, and they stop with an error
    after looking at `max_listed` directory entries or running `seconds` (by default
    `MAX_LISTED` and `LIST_SECONDS`, read when called).

    An object-storage URI (`s3://bucket/run/`, `s3://bucket/run/step_*.parquet`) is listed
    by `iscore.utils.storage.listing`, within the same budget.

    Raises:
        DumpError: `item` does not exist and is no glob, or the budget ran out.
    """
    max_listed = MAX_LISTED if max_listed is None else max_listed
    seconds = LIST_SECONDS if seconds is None else seconds
    if storage.is_uri(item):
        yield from storage.listing(str(item), suffixes, max_listed=max_listed, seconds=seconds)
        return
    path = Path(item)
    if path.is_file():
        yield str(path)
    elif path.is_dir():
        # Hidden names included, as Path.rglob did here before.
        budget = _Budget(str(item), max_listed, seconds, hidden=True)
        for found in _match(budget, str(path), ("**", "*")):
            if found.endswith(suffixes):
                yield found
    elif glob.has_magic(str(item)):
        # Hidden names need a pattern that names them (`.*`), as in glob.glob.
        budget = _Budget(str(item), max_listed, seconds, hidden=False)
        parts = path.parts
        literal = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        root = str(Path(*parts[:literal])) if literal else ""
        yield from dict.fromkeys(_match(budget, root, parts[literal:]))  # `**/**` repeats
    else:
        raise DumpError(f"{item}: no such file or directory")


@dataclass(slots=True)
class _Budget:
    """What a walk or glob may still look at, and whether `*` and `**` see hidden names."""

    item: str
    max_listed: int
    seconds: float
    hidden: bool
    listed: int = 0
    start: float = field(default_factory=time.monotonic)

    def scan(self, directory: str, head: str) -> Iterator[tuple[str, os.DirEntry]]:
        """(path, entry) of the entries of `directory` that `head` may match, counted.

        A directory that cannot be listed (unreadable, vanished) has no entries, as in glob.
        """
        try:
            with os.scandir(directory or ".") as it:
                entries = list(it)
        except OSError:
            return
        self.listed += len(entries)
        if self.listed > self.max_listed:
            raise DumpError(
                f"{self.item}: stopped after looking at {self.max_listed:,} directory entries; "
                "name the files more narrowly"
            )
        if time.monotonic() - self.start > self.seconds:
            raise DumpError(
                f"{self.item}: stopped after {self.seconds:g} s of listing directories; "
                "name the files more narrowly"
            )
        # As in glob.glob, hidden names match only a pattern that starts with a dot.
        hidden = self.hidden or head.startswith(".")
        for e in entries:
            if hidden or not e.name.startswith("."):
                yield os.path.join(directory, e.name), e


def _is_dir(entry: os.DirEntry) -> bool:
    """A directory that is not a symlink (one that cannot be examined is not entered)."""
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_file(entry: os.DirEntry) -> bool:
    """A regular file, or a symlink to one."""
    try:
        return entry.is_file()
    except OSError:
        return False


def _match(budget: _Budget, directory: str, parts: tuple[str, ...]) -> Iterator[str]:
    """Files under `directory` matching the path components `parts` (`**`: any depth)."""
    head, rest = parts[0], parts[1:]
    if head == "**":
        if rest:
            yield from _match(budget, directory, rest)  # `**` matching no directory at all
        for path, entry in budget.scan(directory, head):
            if _is_dir(entry):
                yield from _match(budget, path, parts)
            elif not rest and _is_file(entry):
                yield path
        return
    for path, entry in budget.scan(directory, head):
        if not fnmatch.fnmatchcase(entry.name, head):
            continue
        if rest:
            if _is_dir(entry):
                yield from _match(budget, path, rest)
        elif _is_file(entry):
            yield path


def default_folder() -> Path:
    """Where iscore keeps its caches (the results store, the compiled kernels) unless told:
    `$XDG_CACHE_HOME/iscore`, else `~/.cache/iscore`."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "iscore"
