"""`iscore validate`: read a whole dump once, list its problems or summarize it."""

from __future__ import annotations

import argparse

from iscore.cli import options
from iscore.utils import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "validate",
        help="check a dump and summarize it",
        description="Read a whole dump (streamed), list every problem or print a summary. "
        "Exit 0 when valid, 1 when it has problems, 2 for bad arguments.",
    )
    options.add_dump_arguments(p)
    p.add_argument("--json", metavar="OUT.json", help="also write the report as JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.passes import validate

    # Every column a command may read, the per-sequence ones (reward, group_id) too: a
    # reward that differs within a sequence is a problem `sequences` and `--where` meet.
    dump = options.open_dump(args, extras=True, outputs=("--json",))
    with options.progress_bar(dump, "validate", args) as bar:
        report = validate(dump, max_tokens=args.chunk_tokens, progress=bar.update)
    if args.json:
        write_json(report.to_dict(), args.json, indent=2)
    print(report.render())
    return 0 if report.ok else 1
