"""`iscore replay`: one setting replayed over a dump, one row per token."""

from __future__ import annotations

import argparse

from iscore.cli import options


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "replay",
        help="replay one framework config over a dump, one row per token",
        description="Replay a framework's correction config over a dump and write one row "
        "per input token: seq_id, pos, step, weight (the factor multiplying the token's loss; "
        "0 where zeroed) and keep (the token's loss mask after the correction).",
    )
    options.add_dump_arguments(p)
    p.add_argument(
        "--config",
        required=True,
        metavar="CFG.yaml|PRESET",
        help="the framework's own config plus a top-level `framework:`, or a preset name "
        "(see `iscore presets`)",
    )
    p.add_argument("--out", required=True, metavar="OUT.parquet", help="output Parquet file")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.frameworks import resolve
    from iscore.passes import write_replay

    spec = resolve(args.config)
    dump = options.open_dump(args, extras=options.needs_extras([spec]), outputs=("--out",))
    with options.progress_bar(dump, "replay", args) as bar:
        written = write_replay(
            dump, spec, args.out, max_tokens=args.chunk_tokens, progress=bar.update
        )
    print(
        f"{args.out}: {written.tokens:,} tokens replayed with {spec.name} ({spec.framework}); "
        f"{written.kept:,} kept in the loss, {written.zero:,} of them with weight 0"
    )
    options.report_dropped(dump)
    return 0
