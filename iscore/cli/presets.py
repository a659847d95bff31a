"""`iscore presets`: the named settings of every framework."""

from __future__ import annotations

import argparse

from iscore.frameworks import NAMES as FRAMEWORKS


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "presets",
        help="list the named settings of every framework",
        description="List each framework's named settings (FRAMEWORK:NAME), which --preset, "
        "--config and the app take; `iscore export --config FRAMEWORK:NAME --to F` prints one "
        "as a config.",
    )
    p.add_argument("--framework", choices=FRAMEWORKS, help="only this framework's presets")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.frameworks import presets

    for key, spec in presets().items():
        if args.framework in (None, spec.framework):
            print(key)
    return 0
