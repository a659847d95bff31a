"""`iscore why`: a metric's change between two steps split, factor by factor, into composition
(the token mix moved) and within (each bin's value moved); `--json` the document
(docs/why.md)."""

from __future__ import annotations

import argparse

from iscore.cli import options
from iscore.errors import IscoreError, clip


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "why",
        help="why a metric rose between two steps: the token mix moved, or each bin's value",
        description="Split a token-mean metric's change between two steps of a dump, for each "
        "factor (the rollout probability, the response length, the position, the turn, a "
        "column of the dump), into composition (the token mix moved across the factor's "
        "bins) and within (each bin's value moved), a shift-share whose two terms add up to "
        "the change exactly; only the two steps are read (docs/why.md).",
    )
    options.add_dump_arguments(p)
    p.add_argument("--from", dest="from_step", type=int, required=True, metavar="STEP")
    p.add_argument("--to", dest="to_step", type=int, required=True, metavar="STEP")
    p.add_argument(
        "--metric",
        default="k3",
        help="the token-mean metric split: k1, k2, k3, k3_reverse, chi2_token, abs_diff_mean, "
        "token_mult_prob_error, ratio_mean or d_mean (default %(default)s)",
    )
    p.add_argument(
        "--by",
        metavar="FACTORS",
        help="comma-separated factors: prob, length, position, turn, or a per-sequence "
        "column of the dump (integers, strings, booleans); default prob,length,position "
        "and turn where the dump has one",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the document")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.passes import why
    from iscore.stats import ORDERED

    if args.steps is not None:
        raise IscoreError("--steps does not apply to why: --from and --to name the two steps")
    by = None if args.by is None else [f.strip() for f in args.by.split(",") if f.strip()]
    # A dump's other columns are read only to split by one.
    extras = any(f not in ORDERED for f in by or ())
    dump = options.open_dump(args, extras=extras, outputs=("--json",))
    result = why(
        dump,
        args.from_step,
        args.to_step,
        metric=args.metric,
        by=by,
        max_tokens=args.chunk_tokens,
    )
    print(result.sentence)
    a, b = result.tokens
    print(f"  {a:,} loss tokens at step {result.steps[0]}, {b:,} at step {result.steps[1]}")
    for s in result.by:
        if result.change:
            print(
                f"  by {clip(s.title)}: composition {s.composition / result.change:.0%}, "
                f"within {s.within / result.change:.0%} ({len(s.bins)} bins)"
            )
    if args.json:
        result.write_json(args.json)
        print(f"wrote {args.json}")
    return 0
