"""`iscore recommend`: a framework's settings ranked on the dump against targets."""

from __future__ import annotations

import argparse
import warnings

from iscore.cli import options
from iscore.errors import ConfigError, IscoreError, clip, quote
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.utils import write_json


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "recommend",
        help="rank your framework's settings on your dump against targets",
        description="Replay your framework's candidate settings, with thresholds derived from "
        "the dump, rank them against the targets and print the best as a config snippet. "
        "With --engine ray, Ray tasks read the dump and the candidates are replayed here on "
        "the whole of it (their thresholds are medians over every token).",
    )
    options.add_dump_arguments(p)
    p.add_argument(
        "--framework",
        required=True,
        choices=FRAMEWORKS,
        help="the framework whose settings are ranked (candidates of each kind it can express: "
        "docs/recommend.md)",
    )
    p.add_argument(
        "--max-token-drop",
        type=options.share,
        default=0.01,
        metavar="SHARE",
        help="largest share of tokens that may lose their gradient: a fraction (0.01) or a "
        "percentage (1%%); default 1%%",
    )
    p.add_argument(
        "--max-seq-drop",
        type=options.share,
        default=0.05,
        metavar="SHARE",
        help="largest share of sequences that may be dropped: a fraction (0.05) or a "
        "percentage (5%%); default 5%%",
    )
    p.add_argument(
        "--lr-scale",
        default="0.8:1.25",
        metavar="LO:HI",
        help="allowed effective learning-rate scale (default 0.8:1.25)",
    )
    p.add_argument(
        "--min-ess",
        type=options.share,
        default=0.5,
        metavar="SHARE",
        help="smallest effective sample size, a share of the tokens: a fraction (0.5) or a "
        "percentage (50%%); default 50%%",
    )
    p.add_argument(
        "--config",
        metavar="CFG.yaml|PRESET",
        help="your current setting, the one to beat (default: the framework's default): "
        "replayed and ranked beside the candidates, and kept where none does better",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the ranking as JSON")
    options.add_engine(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from tqdm import tqdm

    from iscore.advice import RULE_SYMBOLS, Targets, recommend, snippet
    from iscore.frameworks import get as framework_of
    from iscore.frameworks import resolve

    lo, _, hi = args.lr_scale.partition(":")
    try:
        lr_scale = (float(lo), float(hi))
    except ValueError:
        raise IscoreError(
            f"Expected --lr-scale LO:HI, e.g. 0.8:1.25, but got {quote(args.lr_scale)}"
        ) from None
    for flag in ("--max-token-drop", "--max-seq-drop"):
        if getattr(args, flag.removeprefix("--").replace("-", "_")) == 1.0:
            warnings.warn(
                f"{flag} 1 lets every one be dropped (100%); for one percent write 0.01 or 1%",
                stacklevel=1,
            )
    try:
        targets = Targets(args.max_token_drop, args.max_seq_drop, lr_scale, args.min_ess)
    except ConfigError as e:
        message = str(e)
        for field in fields(Targets):
            message = message.replace(f"`{field.name}`", "--" + field.name.replace("_", "-"))
        raise ConfigError(message) from None
    own = None if args.config is None else resolve(args.config)
    if own is not None and own.framework != args.framework:
        raise ConfigError(
            f"--config is a {own.framework} setting; --framework {args.framework} ranks "
            f"{args.framework} settings against one of its own (or leave --config out for "
            "its default)"
        )
    # A framework whose settings read the advantage (prime-rl's DPPO) gets it where the dump
    # has it: its candidates include that loss.
    presets = framework_of(args.framework).presets().values()
    extras = options.needs_extras([*presets, *([] if own is None else [own])])
    batch = options.load_dump(args, outputs=("--json",), engine=args.engine, extras=extras)
    with tqdm(desc="recommend", unit="setting", disable=args.quiet or None, leave=False) as bar:

        def replayed(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        rec = recommend(batch, args.framework, targets, progress=replayed, default=own)
    print(
        f"{args.framework}: {len(rec.candidates)} candidate settings replayed on "
        f"{batch.num_tokens:,} tokens, best first"
    )
    for regime in rec.regimes:
        print(f"  found: {regime}")
    for i, candidate in enumerate(rec.candidates, 1):
        mark = "ok " if candidate.passes else "-- "
        print(f"{i:2d}. {mark}{candidate.reason}")
    for warning in rec.warnings:
        print(f"  ! {warning}")
    print(f"  why: {clip(rec.pick, 1000)}")
    if args.json:
        write_json(rec.to_dict(), args.json)
    default = rec.default
    print(f"\nbest: {clip(rec.best.title)}")
    print(f"  rule: {rec.best.rule}")
    if default is not rec.best:
        print(f"default: {clip(default.title)} (ranked {rec.candidates.index(default) + 1})")
        print(f"  rule: {default.rule}")
    print(f"  ({RULE_SYMBOLS})")
    print(snippet(rec.best.spec).rstrip())
    return 0
