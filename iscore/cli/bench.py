"""`iscore bench`: how fast iscore is, against what it replaces."""

from __future__ import annotations

import argparse

from iscore.cli import options
from iscore.dump import DEFAULT_CHUNK_TOKENS
from iscore.utils import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "bench",
        help="time the engine against pyarrow, a padded torch and a pandas baseline",
        description="Simulate a long-tailed dump (or reuse --dump), then time in one run: the "
        "raw pyarrow read, iscore.load, analyze with 8 settings of 8 frameworks (streamed and "
        "resident), replay alone, a padded [B, max_len] torch and a pandas groupby "
        "implementation of the same corrections (checked to agree), Tuner queries, and peak "
        "memory streaming vs loading whole; CUDA rows when a GPU is present.",
    )
    p.add_argument("--tokens", type=int, default=50_000_000, help="dump size (default 50M)")
    p.add_argument("--dump", metavar="PATH", help="reuse this simulated dump, or write it here")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA rows when present")
    p.add_argument("--chunk-tokens", type=options.chunk_tokens, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--run-files",
        type=options.chunk_tokens,
        default=1000,
        metavar="N",
        help="step files of the simulated run analyzed again and followed (default %(default)s)",
    )
    p.add_argument(
        "--where",
        action="append",
        metavar="PREDICATE",
        help="instead, time what --where PREDICATE adds to a streamed analyze (repeatable; "
        'e.g. --where "k3 >= 0", which keeps every sequence)',
    )
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.bench import format_table, format_where, run_bench, where_overhead

    options.distinct_outputs(args, "--dump", "--json")
    if args.where:
        result = where_overhead(
            args.where,
            tokens=args.tokens,
            chunk_tokens=args.chunk_tokens,
            path=args.dump,
            log=None if args.quiet else lambda line: print(line),
        )
        print(format_where(result))
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}")
        return 0
    result = run_bench(
        tokens=args.tokens,
        chunk_tokens=args.chunk_tokens,
        device=args.device,
        path=args.dump,
        memory=not args.no_memory,
        run_files=args.run_files,
        log=None if args.quiet else lambda line: print(line),
    )
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0
