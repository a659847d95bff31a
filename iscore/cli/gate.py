"""`iscore gate`: a dump's mismatch held to bounds (given, or published tables), and to a
baseline with `--against`; exit 0 when every check passes, 1 when one fails; a JUnit report
for CI (docs/compare.md#gates)."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from xml.etree import ElementTree

from iscore.cli import options
from iscore.errors import ConfigError, clip


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "gate",
        help="hold a dump's mismatch to bounds and published bars (CI: exit 1, JUnit)",
        description="Analyze a dump and hold its mismatch metrics to bounds: --max/--min, the "
        "published bars (--table; --list-tables lists them with their sources) or a YAML table "
        "of your own, and with --against a baseline dump (a check fails where `iscore diff` "
        "says worse). Exit 0 when every check passes, 1 when one fails, 2 for a bad argument.",
    )
    p.add_argument("dump", nargs="*", help="the dump: a file, folder, glob or URI")
    options.add_dump_options(p)
    options.add_quiet(p)
    p.add_argument("--max", action="append", default=[], metavar="METRIC=VALUE")
    p.add_argument("--min", action="append", default=[], metavar="METRIC=VALUE")
    p.add_argument(
        "--table",
        action="append",
        default=[],
        metavar="NAME|FILE.yaml",
        help="a shipped table of bars (--list-tables) or a YAML table of your own (repeatable)",
    )
    p.add_argument(
        "--against", metavar="BASELINE", help="also fail where the dump is worse than this one"
    )
    p.add_argument("--junit", metavar="OUT.xml", help="write a JUnit report, a test per check")
    p.add_argument("--json", metavar="OUT.json", help="write the checks as JSON")
    p.add_argument("--list-tables", action="store_true", help="list the shipped tables, and exit")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from iscore.advice import TABLES, parse_bound

    if args.list_tables:
        _list(TABLES)
        return 0
    if not args.dump:
        raise ConfigError("Expected a dump to gate (or --list-tables)")
    options.distinct_outputs(args, "--junit", "--json")
    bounds = [parse_bound(text, "--max") for text in args.max]
    bounds += [parse_bound(text, "--min") for text in args.min]
    tables = [_table(name, TABLES) for name in args.table]
    if not bounds and not tables and args.against is None:
        raise ConfigError("nothing to check: give --max, --min, --table or --against")
    dump = options.open_dump(args, outputs=("--junit", "--json"))
    checks = _checks(args, dump, bounds, tables)
    failed = [c for c in checks if not c.passed]
    if args.junit:
        _write_junit(checks, args.junit, ", ".join(args.dump))
    if args.json:
        from iscore.utils import write_json

        doc = {"schema": "iscore.gate", "schema_version": 1, "dump": list(args.dump)}
        doc |= {"passed": not failed, "checks": [c.to_dict() for c in checks]}
        write_json(doc, args.json)
    for c in checks:
        value = "no value in this dump" if math.isnan(c.value) else f"{c.value:.4g}"
        print(f"  {'pass' if c.passed else 'FAIL'}  {c.check}: {value}  ({clip(c.table)})")
    print(f"{len(checks) - len(failed)} of {len(checks)} checks pass")
    for path in (args.junit, args.json):
        if path:
            print(f"wrote {path}")
    return 1 if failed else 0


def _checks(args: argparse.Namespace, dump, bounds, tables) -> list:
    """Every check: the bounds given, each table's, and against the baseline."""
    from iscore.advice import Check, gated_values, judge
    from iscore.passes import analyze, diff

    with options.progress_bar(dump, "gate", args) as bar:
        analysis = analyze(dump, [], max_tokens=args.chunk_tokens, progress=bar.update)
    values = gated_values(analysis.mismatch)
    checks = judge(values, bounds, "command line")
    for table in tables:
        checks += judge(values, table.bounds, table.name)
    if args.against is not None:
        args.dump = [args.against]
        baseline = options.open_dump(args)
        compared = diff(baseline, dump, max_tokens=args.chunk_tokens)
        gated = {b.metric for b in bounds} | {b.metric for t in tables for b in t.bounds}
        for m in compared.metrics:
            if gated and m.name not in gated:
                continue
            ratio = math.nan if m.ratio is None else m.ratio
            check = f"{m.name} not worse than {args.against} (ratio of badness {_ci(m)})"
            checks.append(Check(m.name, check, ratio, m.verdict != "worse", "against"))
    return checks


def _ci(m) -> str:
    lo, hi = m.ci
    return "none" if math.isnan(lo) else f"[{lo:.3g}, {hi:.3g}]"


def _table(name: str, tables: dict):
    """A shipped table by name, else a YAML table of the user's."""
    from iscore.advice import read_table

    if name in tables:
        return tables[name]
    if Path(name).suffix in (".yaml", ".yml", ".json") or Path(name).exists():
        return read_table(name)
    raise ConfigError(
        f"Expected --table to be one of {', '.join(tables)} or a YAML file, but got {clip(name)}"
    )


def _list(tables: dict) -> None:
    for table in tables.values():
        print(f"{table.name} (v{table.version}): {table.about}")
        for bound in table.bounds:
            source = "" if bound.source is None else f"  [{bound.source}]"
            print(f"  {bound.describe()}{source}")
            if bound.note:
                print(f"    {bound.note}")


def _write_junit(checks, path: str, dump: str) -> None:
    """A JUnit XML report: a test suite, a test case per check, a failure element for each
    that fails (its value, the bar and the bar's source)."""
    from iscore.utils import output_path

    failures = sum(not c.passed for c in checks)
    suite = ElementTree.Element(
        "testsuite", name="iscore gate", tests=str(len(checks)), failures=str(failures)
    )
    suite.set("errors", "0")
    for c in checks:
        case = ElementTree.SubElement(suite, "testcase", classname=c.table, name=c.check)
        if not c.passed:
            source = "" if c.source is None else f"; source: {c.source}"
            failure = ElementTree.SubElement(
                case, "failure", message=f"{c.metric} = {c.value:.6g}, expected {c.check}"
            )
            failure.text = f"{dump}: {c.metric} = {c.value!r}, expected {c.check}{source}"
    text = ElementTree.tostring(ElementTree.ElementTree(suite).getroot(), encoding="unicode")
    with output_path(path) as tmp:
        Path(tmp).write_text('<?xml version="1.0" encoding="utf-8"?>\n' + text + "\n")
