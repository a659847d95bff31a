"""The `iscore` command line.

Each subcommand is a thin layer over the Python API: parse arguments, call iscore, print.
Errors the user can cause are printed as one clear message each, never as a traceback:
exit 1 for a dump with problems (unreadable files, wrong columns, invalid values), 2 for
bad arguments.

Rule: a module per command (its `add_parser` and `run`), over the floors below it and the
options they share (`options`); nothing but `python -m iscore` imports it.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import types
import warnings
from collections.abc import Sequence
from typing import Any

from iscore.cli import (
    analyze,
    app,
    bench,
    cache,
    convert,
    diff,
    export,
    gate,
    presets,
    recommend,
    replay,
    sequences,
    simulate,
    validate,
    watch,
    why,
)
from iscore.errors import IscoreError


class _Deferred(types.ModuleType):
    """A module whose code runs when an attribute it lacks is first read. `import` statements
    read only the attributes it has (`__spec__`, `__path__`), so they bind it without running
    it. (The standard library's `LazyLoader` runs on any attribute, `__spec__` included, so
    the first `import torch` statement loads it.)"""

    def __getattr__(self, name: str) -> Any:
        self.__class__ = types.ModuleType  # from now on a plain module, loading itself
        try:
            self.__spec__.loader.exec_module(self)
        except BaseException:
            sys.modules.pop(self.__name__, None)  # as a failed import leaves it
            raise
        return getattr(self, name)


def _defer_import(name: str) -> None:
    """Bind `name` in `sys.modules` to a `_Deferred` module unless it is imported already.
    The engine's modules import torch at the top; commands that never compute with it skip
    the 1-2 s of loading it. Only in this process, whose first use of torch is on its main
    thread (analyze's reader thread starts after it); the app runs in a process of its own."""
    if name in sys.modules or (spec := importlib.util.find_spec(name)) is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module


class _Version(argparse.Action):
    """`--version`: the installed iscore's version, read from its metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib.metadata import version

        print(f"{parser.prog} {version('iscore')}")
        parser.exit()


COMMANDS = (
    validate,
    replay,
    analyze,
    diff,
    why,
    gate,
    watch,
    sequences,
    recommend,
    convert,
    export,
    bench,
    presets,
    simulate,
    cache,
    app,
)
"""The commands, in the order `iscore --help` lists them: each module's `add_parser` adds it,
its `run(args)` runs it."""


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `iscore` command."""
    """The argument parser of the `iscore` command."""
    parser = argparse.ArgumentParser(
        prog="iscore",
        description="Replay rollout/trainer logprob dumps through RL frameworks' "
        "importance-sampling corrections.",
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _show_warning(message: Warning | str, *args: object, **kwargs: object) -> None:
    """A warning as one line, `warning: ...`, without the source line it was raised from."""
    print(f"warning: {message}", file=sys.stderr)


def _empty_path(args: argparse.Namespace) -> str | None:
    """The argument given an empty path, if any: `Path("")` is the current directory, so an
    empty `--out` was refused as "is a directory" and an empty DUMP read the whole folder."""
    for dest in ("dump", "source", "out", "json", "html", "sequences"):
        value = getattr(args, dest, None)
        if value == "" or (isinstance(value, list) and "" in value):
            return "the dump" if dest in ("dump", "source") else f"--{dest}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `iscore` command; returns the exit status (130 after Ctrl-C, as shells do)."""
    args = build_parser().parse_args(argv)
    if (empty := _empty_path(args)) is not None:
        print(f"error: expected a path for {empty}, but got an empty string", file=sys.stderr)
        return 2
    _defer_import("torch")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except IscoreError as e:
        if problems := getattr(e, "problems", None):  # a DumpProblems: every one listed
            print(f"{len(problems)} problem{'s' * (len(problems) > 1)}:", file=sys.stderr)
            for problem in problems:
                print(f"  - {problem}", file=sys.stderr)
            return 1
        # One line, whatever the message holds, so scripts can grep and log it.
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as Unix tools do.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        # Ctrl-C: outputs are written to a temporary file, removed as this unwinds, so no
        # partial file is left; one line, not a traceback.
        print("interrupted", file=sys.stderr)
        return 130
