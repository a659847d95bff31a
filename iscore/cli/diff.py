"""`iscore diff`: a candidate dump against a baseline, every metric's ratio with its interval
and a verdict; `--json` the document, `--html` a page of it; `--fail-on worse` for CI
(docs/compare.md)."""

from __future__ import annotations

import argparse
import math

from iscore.cli import options
from iscore.errors import IscoreError, clip


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "diff",
        help="a candidate dump against a baseline: ratios, intervals, verdicts",
        description="Stream two dumps through the same settings and compare every mismatch "
        "metric and every setting's statistics: candidate / baseline with a 95% interval "
        "(a seeded bootstrap over sequences within steps; paired where both hold the same "
        "sequences) and a verdict better, worse or same (docs/compare.md).",
    )
    p.add_argument("baseline", help="the dump compared against: a file, folder, glob or URI")
    p.add_argument("candidate", help="the dump judged, as the baseline")
    options.add_dump_options(p)
    options.add_quiet(p)
    options.add_settings(p)
    p.add_argument(
        "--name",
        action="append",
        default=[],
        metavar="A=LABEL",
        help="label the baseline (A=...) or the candidate (B=...) in the output",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the diff document")
    p.add_argument(
        "--html",
        metavar="OUT.html",
        help="write a self-contained HTML page of the diff (no script, no network)",
    )
    p.add_argument(
        "--fail-on",
        choices=("worse",),
        help="exit 1 when a metric's verdict is worse (CI); 0 otherwise",
    )
    p.add_argument(
        "--resamples",
        type=options.counted_option("--resamples"),
        default=None,
        metavar="N",
        help="bootstrap resamples (default 1000; seeded: a rerun gives the same intervals)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.frameworks import resolve
    from iscore.passes import diff
    from iscore.present import MISMATCH, diff_rows, write_diff_html
    from iscore.stats import RESAMPLES

    names = _names(args.name)
    outputs = ("--json", "--html")
    options.distinct_outputs(args, *outputs)
    specs = [resolve(s) for s in args.settings]
    arms = []
    for path in (args.baseline, args.candidate):
        args.dump = [path]
        arms.append(options.open_dump(args, extras=options.needs_extras(specs), outputs=outputs))
    with options.progress_bar(arms[0], "diff", args) as bar:
        result = diff(
            arms[0],
            arms[1],
            specs,
            names=names,
            resamples=args.resamples or RESAMPLES,
            max_tokens=args.chunk_tokens,
            progress=bar.update,
        )
    written = []
    for path, write in (
        (args.json, result.write_json),
        (args.html, lambda p: write_diff_html(result, p)),
    ):
        if path:
            write(path)
            written.append(path)
    a, b = result.arms
    print(
        f"{clip(b.name)} against {clip(a.name)}: {b.tokens:,} against {a.tokens:,} loss tokens"
        f"{', paired (the same sequences)' if result.paired else ''}; "
        f"{result.level:.0%} intervals of {result.resamples:,} resamples"
    )
    for r in diff_rows(result):
        where = "" if r.group == MISMATCH else f"{clip(r.group)}: "
        print(
            f"  {where}{r.metric}: {r.baseline:.4g} -> {r.candidate:.4g}  "
            f"{r.change_text} {r.interval_text}  {r.verdict}"
        )
    for t in result.trend:
        if t.slope is not None:
            lo, hi = (math.exp(v) for v in t.ci)  # NaN stays NaN: no interval
            print(
                f"  trend of the {t.name} ratio over {t.steps} steps: x{math.exp(t.slope):.3g} "
                f"a step [{lo:.3g}, {hi:.3g}]  {t.direction}"
            )
    for path in written:
        print(f"wrote {path}")
    worse = result.worse()
    if args.fail_on == "worse" and worse:
        print(f"failed: worse on {', '.join(worse)}")
        return 1
    return 0


def _names(given: list[str]) -> tuple[str, str]:
    """The arms' labels from `--name A=... --name B=...`.

    Raises:
        IscoreError: a label that is not A=... or B=....
    """
    names = {"A": "baseline", "B": "candidate"}
    for item in given:
        key, sep, label = item.partition("=")
        if not sep or key not in names or not label:
            raise IscoreError(f"Expected --name to be A=LABEL or B=LABEL, but got {clip(item)}")
        names[key] = label
    return names["A"], names["B"]
