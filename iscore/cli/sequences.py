"""`iscore sequences`: the per-sequence table, or a DuckDB query over it."""

from __future__ import annotations

import argparse
import sys

from iscore.cli import options


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "sequences",
        help="the per-sequence table, or a DuckDB SQL query over it",
        description="Stream a dump once into its sequence table (one row per sequence: step, "
        "seq_id, the dump's per-sequence columns, length, loss_tokens, mismatch statistics, "
        "and per setting its weight, kept fraction and gradient share; docs/sql.md) and write "
        "it, or the result of --sql over it: a DuckDB SELECT over `sequences` and the "
        "`tokens` view of the dump's tokens. Without --out, CSV on stdout.",
    )
    options.add_dump_arguments(p)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        dest="settings",
        metavar="CFG.yaml",
        help="a setting whose columns the table gets (repeatable)",
    )
    p.add_argument(
        "--preset",
        action="append",
        dest="settings",
        metavar="NAME",
        help="a named setting whose columns the table gets (repeatable)",
    )
    p.add_argument(
        "--sql",
        metavar="QUERY",
        help='a DuckDB SELECT over `sequences` and `tokens`, e.g. "SELECT step, avg(k3) '
        'FROM sequences GROUP BY step"',
    )
    p.add_argument("--out", metavar="OUT.parquet|csv", help="write here (default: CSV on stdout)")
    options.add_engine(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import duckdb

    from iscore.frameworks import resolve
    from iscore.passes import TABLES, catalog, sequence_table, write_rows
    from iscore.utils import QueryError, one_line, open_query, referenced

    specs = [resolve(s) for s in args.settings]
    dump = options.open_dump(args, extras=True, outputs=("--out",))
    if args.sql is not None:  # a bad query fails here, before the dump is read
        referenced(args.sql, set(TABLES))
    with options.progress_bar(dump, "sequences", args) as bar:
        table = sequence_table(
            dump, specs, max_tokens=args.chunk_tokens, progress=bar.update, engine=args.engine
        )
    if args.sql is None:
        count = write_rows(table, args.out)
    else:
        tables, views = catalog(table, args.sql, dump)
        with open_query(tables, args.sql, views=views) as result:
            try:
                count = write_rows(result.to_arrow_reader(65_536), args.out)
            except duckdb.Error as e:
                raise QueryError(f"query: {one_line(e)}") from e
    if args.out:
        what = "sequences" if args.sql is None else "rows"
        print(f"{args.out}: {count:,} {what}", file=sys.stderr)
    options.report_dropped(dump)
    return 0
