"""`iscore analyze`: the mismatch diagnostics and what each setting does, as text, JSON, HTML."""

from __future__ import annotations

import argparse
import sys

from iscore.cli import options
from iscore.errors import clip, counted


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "analyze",
        help="mismatch diagnostics and what each correction setting does, as JSON/HTML",
        description="Stream a dump once: mismatch diagnostics, and for every setting its weight "
        "distribution, mask rates, ESS, effective LR scale, per step and per length. Settings "
        "come from framework configs (--config) and presets (--preset; see `iscore presets`).",
    )
    options.add_dump_arguments(p)
    options.add_settings(p)
    p.add_argument("--json", metavar="OUT.json", help="write the analysis document")
    p.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML report")
    p.add_argument(
        "--sequences",
        metavar="OUT.parquet|csv",
        help="also write the sequence table (as `iscore sequences` does), from the same pass",
    )
    options.add_cache_options(p)
    options.add_engine(p, jobs=True)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.advice import whole_distribution
    from iscore.frameworks import resolve
    from iscore.passes import SequenceTable, analyze, read_schema, write_rows
    from iscore.present import metadata_cell, metadata_tables, setting_name, write_html

    options.distinct_outputs(args, "--json", "--html", "--sequences")
    specs = [resolve(s) for s in args.settings]
    store = options.open_store(args)
    dump = options.open_dump(
        args,
        extras=args.sequences is not None or options.needs_extras(specs),
        outputs=("--json", "--html", "--sequences"),
        store=store,
    )
    table = None if args.sequences is None else SequenceTable(read_schema(dump), specs)
    with options.progress_bar(dump, "analyze", args) as bar:
        result = analyze(
            dump,
            specs,
            max_tokens=args.chunk_tokens,
            progress=bar.update,
            sequences=table,
            store=store,
            engine=args.engine,
            jobs=args.jobs,
        )
    written = []
    for path, write in (
        (args.json, result.write_json),
        (args.html, lambda p: write_html(result, p)),
        (args.sequences, lambda p: write_rows(table.compute(), p)),
    ):
        if path:
            write(path)
            written.append(path)
    m = result.mismatch
    print(
        f"{result.source['loss_tokens']:,} loss tokens in {result.source['sequences']:,} "
        f"sequences: k3 {m.k3:.3g}, mean |d| {m.abs_diff_mean:.3g}, "
        f"max |d| {m.abs_diff_max:.3g}"
    )
    print(f"  health: {result.health.summary()}")
    if result.health.floor is not None:
        print(f"  floor: {result.health.floor.sentence()}")
    whole = whole_distribution(m)
    if whole is not None:
        print(f"  distribution: {whole}")
    for column, rows, left in metadata_tables({} if m.metadata is None else m.metadata.to_dict()):
        values = ", ".join(
            f"{clip(metadata_cell(row, 'value', '{}'))}: k3 {metadata_cell(row, 'k3', '{:.3g}')} "
            f"({row['sequences']:,} seq)"
            for row in rows
        )
        print(f"  by {column}: {values}" + (f" (and {left:,} more)" if left else ""))
    for flag in result.flags:
        print(f"  ! {flag.code}: {flag.message}")
    for finding in result.attribution.findings:
        print(f"  from {finding.kind}: {finding.summary} To do: {finding.action}")
    for s in result.settings:
        print(
            f"  {clip(setting_name(s))}: LR scale {s.lr_scale:.4g}, "
            f"mean w {s.weight_mean:.3g}, ESS {s.ess:.1%}, "
            f"tokens masked {s.token_masked_fraction:.2%}, sequences masked "
            f"{s.seq_masked_fraction:.2%}"
        )
    for path in written:
        print(f"wrote {path}")
    if store is not None and (store.reads or store.writes):
        print(
            f"results store {store.folder}: read {counted(store.reads, 'entry', 'entries')}, "
            f"wrote {counted(store.writes, 'entry', 'entries')}",
            file=sys.stderr,
        )
    options.report_dropped(dump)
    return 0
