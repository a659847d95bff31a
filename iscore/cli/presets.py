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
    p.add_argument(
        "--versions",
        action="store_true",
        help="list the versions a config may name with `version:` instead: each framework's "
        "pinned release and the open pull requests' corrections, with their status",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore import frameworks
    from iscore.frameworks import presets

    if args.versions:
        for framework in frameworks.every():
            if args.framework in (None, framework.name):
                print(f"{framework.name}: pinned release {framework.upstream} (version: null)")
                for version in framework.versions:
                    print(f"  {version}")
        return 0
    for key, spec in presets().items():
        if args.framework in (None, spec.framework):
            print(key)
    return 0
