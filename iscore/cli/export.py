"""`iscore export`: a setting as a config snippet of any framework."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from iscore.cli import options
from iscore.errors import IscoreError
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.utils import check_output, output_path


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "export",
        help="write a setting as a config snippet for any framework",
        description="Print a setting as the target framework's own config (YAML nesting or CLI "
        "flags); with --out, write an iscore config file that `iscore replay --config` reads. "
        "When the target cannot express the setting, its closest equivalent is given with "
        "notes, and with --dump the measured difference on your data.",
    )
    p.add_argument(
        "--config",
        required=True,
        metavar="CFG.yaml|PRESET",
        help="the setting: a framework config file or a preset name",
    )
    p.add_argument("--to", required=True, choices=FRAMEWORKS, help="the target framework")
    p.add_argument(
        "--generation",
        help="verl only: an older config generation "
        "(gen0, gen1/v0.6.0, gen2/v0.6.1/v0.7.0, v0.7.1, ...)",
    )
    p.add_argument("--out", metavar="FILE", help="write an iscore config file instead")
    p.add_argument(
        "--exact",
        action="store_true",
        help="refuse (exit 1, nothing written) when the target cannot express the setting "
        "exactly, instead of giving its closest setting with notes",
    )
    p.add_argument(
        "--dump",
        nargs="+",
        metavar="DUMP",
        help="measure source vs target on this dump (mask rate, LR scale, mean w)",
    )
    p.set_defaults(func=run, dump_options=options.add_dump_options(p))
    options.add_quiet(p)


def run(args: argparse.Namespace) -> int:
    from iscore.advice import export, to_file_text
    from iscore.frameworks import resolve

    if args.dump is None:
        for option in args.dump_options:
            if getattr(args, option.dest) != option.default:
                raise IscoreError(
                    f"{option.option_strings[0]} is an option of --dump; give --dump DUMP with it"
                )
    if args.out:  # not onto the config or the dump being read
        check_output(args.out, inputs=[args.config])
    spec = resolve(args.config)
    batch = options.load_dump(args, outputs=("--out",)) if args.dump else None
    result = export(spec, args.to, generation=args.generation, batch=batch)
    if args.exact and not result.exact:
        # Nothing is written: the translation changes what the setting does.
        print("\n".join(result.header()), file=sys.stderr)
        print(
            f"error: --exact: {args.to} cannot express {spec.name} ({spec.framework}) exactly; "
            "the notes above say what differs",
            file=sys.stderr,
        )
        return 1
    if args.out:
        # The file keeps what the translation lost: its reader may never see this terminal.
        text = "\n".join(result.header()) + "\n" + to_file_text(result.spec)
        with output_path(args.out) as tmp:
            Path(tmp).write_text(text)
        print(f"wrote {args.out} ({args.to}); `iscore replay --config {args.out}` reads it")
        print("\n".join(result.header()), file=sys.stderr)
    else:
        print(result.commented().rstrip())
    return 0
