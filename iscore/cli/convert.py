"""`iscore convert`: a framework's own dump as canonical Parquet."""

from __future__ import annotations

import argparse

from iscore.dump import FORMATS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "convert",
        help="convert a framework's own dump to canonical Parquet",
        description="Read a framework's dump (NeMo-RL train_data_step*.jsonl, prime-rl token "
        "exports, slime .pt debug dumps, SkyRL .pkl training inputs) and write canonical "
        "Parquet, one row group per source file, with the provenance in its metadata.",
    )
    p.add_argument("source", help="a file, a directory or a glob of the framework's dump")
    p.add_argument("--from", dest="fmt", choices=FORMATS, help="the format (default: detected)")
    p.add_argument("--out", required=True, metavar="DUMP.parquet")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow reading pickled dumps (SkyRL .pkl); pickles can run code",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.dump import convert

    report = convert(args.source, args.out, args.fmt, allow_pickle=args.allow_pickle)
    print(
        f"{args.out}: {report.tokens:,} tokens in {report.sequences:,} sequences, "
        f"{report.steps} steps, from {report.files} {report.framework} file(s)"
    )
    for note in report.notes:
        print(f"  note: {note}")
    return 0
