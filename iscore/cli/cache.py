"""`iscore cache`: where the results store is, how big, and emptying it."""

from __future__ import annotations

import argparse

from iscore.errors import counted


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "cache",
        help="the results store: where it is and how big (info), or empty it (clear)",
        description="The results store keeps each step's results of `analyze` and `watch` so "
        "that a run analyzed again reads only what changed (docs/runs.md#the-results-store). "
        "`info` says where it is, how much it holds and its cap; `clear` removes every entry "
        "(nothing else of the folder: numba's compiled kernels stay).",
    )
    p.add_argument("action", choices=("info", "clear"))
    p.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="the store's folder (default: $XDG_CACHE_HOME/iscore, else ~/.cache/iscore)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.passes import ResultStore
    from iscore.utils import default_folder

    store = ResultStore(args.cache_dir or default_folder())
    if args.action == "clear":
        freed = store.clear()
        print(f"results store {store.folder}: cleared, {_mb(freed)} freed")
        return 0
    entries = store.entries()
    size = sum(size for _, size, _ in entries)
    print(
        f"results store {store.folder}: {counted(len(entries), 'entry', 'entries')}, "
        f"{_mb(size)} of at most {_mb(store.max_bytes)}"
    )
    return 0


def _mb(size: int) -> str:
    return f"{size / (1 << 20):,.1f} MB"
