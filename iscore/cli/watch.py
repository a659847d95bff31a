"""`iscore watch`: follow a run's folder as its step files land: a line per step, events, alerts."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from iscore.cli import options
from iscore.dump import DEFAULT_CHUNK_TOKENS
from iscore.errors import IscoreError, clip


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "watch",
        help="follow a run's folder as step files land: one line per step, events, alerts",
        description="Follow a run that is still writing: analyze each step file as it lands "
        "(whole files only; an empty folder is waited on), print one line per new step with "
        "its key figures and the events found (growth, broken sequences, offset, a setting "
        "that stops meeting the targets, a band that does not follow the mismatch; "
        "docs/runs.md) and the default alerts: the mismatch's growth, or broken sequences "
        "step after step (docs/why.md#a-warning-before-the-damage). Exit 0, 3 for "
        "--exit-on-alert, 130 on Ctrl-C.",
    )
    p.add_argument(
        "folder",
        metavar="DIR",
        help="the run's folder (step files below it), or its s3://, gs:// or az:// prefix",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        dest="settings",
        metavar="CFG.yaml",
        help="a framework config whose per-step figures are followed (repeatable)",
    )
    p.add_argument(
        "--preset",
        action="append",
        dest="settings",
        metavar="NAME",
        help="a named setting whose per-step figures are followed (repeatable)",
    )
    p.add_argument(
        "--alert",
        action="append",
        default=[],
        metavar="RULE",
        help='a DuckDB condition on the per-step table, e.g. "k3 > 1e-3" or '
        '"decoupled_geo_rs_lr_scale < 0.8" (columns: docs/analysis.md#trend): printed with '
        "the first step where it holds (repeatable)",
    )
    p.add_argument(
        "--no-default-alerts",
        dest="default_alerts",
        action="store_false",
        help="only the --alert rules: no alert on the mismatch's growth or on broken "
        "sequences step after step",
    )
    p.add_argument(
        "--exit-on-alert",
        action="store_true",
        help="exit with status 3 once an alert holds (a default one too)",
    )
    p.add_argument("--once", action="store_true", help="read what is there, print, and exit")
    p.add_argument(
        "--interval",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="seconds between looks at the folder (default %(default)s)",
    )
    p.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write each step's figures as TensorBoard event files here, under iscore's "
        "and the frameworks' metric names (needs the tensorboard package)",
    )
    p.add_argument(
        "--column",
        action="append",
        default=[],
        metavar="CANONICAL=SOURCE",
        help="read canonical column CANONICAL from the files' column SOURCE (repeatable)",
    )
    p.add_argument(
        "--chunk-tokens",
        type=options.chunk_tokens,
        default=DEFAULT_CHUNK_TOKENS,
        help="tokens per streamed chunk; bounds memory (default %(default)s)",
    )
    options.add_cache_options(p)
    options.add_engine(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import time

    from iscore.advice import default_alert
    from iscore.dump import parse_mapping
    from iscore.frameworks import resolve
    from iscore.passes import Alert, Follower
    from iscore.present import ScalarWriter

    specs = [resolve(s) for s in args.settings]
    if args.interval <= 0:
        raise IscoreError(f"Expected --interval to be a positive number, but got {args.interval:g}")
    follower = Follower(
        args.folder,
        specs,
        store=options.open_store(args),
        columns=parse_mapping(args.column),
        max_tokens=args.chunk_tokens,
        engine=args.engine,
    )
    alerts = [Alert.compile(rule, follower.trend) for rule in args.alert]
    scalars = None if args.tensorboard is None else ScalarWriter(args.tensorboard)
    fired: set[str] = set()
    warned = not args.default_alerts
    waiting = False
    try:
        while True:
            update = follower.poll()
            for row in update.rows:
                print(_step_line(row, follower.trend))
            for event in update.events:
                print(f"  {event.kind} from step {event.step}: {event.evidence}")
            if scalars is not None and update.rows:
                scalars.write(update.rows, update.by_step)
            table = update.trend.table()
            for alert in alerts:
                step = None if alert.rule in fired else alert.first(table)
                if step is not None:
                    fired.add(alert.rule)
                    print(f"alert: {alert.rule} holds at step {step}", flush=True)
                    if args.exit_on_alert:
                        return 3
            # The rules asked for first: where both hold at one poll, theirs is the line.
            found = None if warned else default_alert(update.trend)
            if found is not None:
                warned = True
                print(
                    f"alert: {found.what} from step {found.step} (a default alert; "
                    "--no-default-alerts turns them off)",
                    flush=True,
                )
                if args.exit_on_alert:
                    return 3
            if args.once:
                return 0
            if not follower.files and not waiting:
                print(f"waiting for step files in {args.folder} (Ctrl-C stops)", file=sys.stderr)
                waiting = True
            sys.stdout.flush()
            time.sleep(args.interval)
    except KeyboardInterrupt:
        print("watch: interrupted", file=sys.stderr)
        return 130
    finally:
        follower.save()
        if scalars is not None:
            scalars.close()


def _step_line(row: dict[str, Any], trend: Any) -> str:
    """One step's key figures on one line: the mismatch, then each setting's."""

    def figure(key: str, pattern: str) -> str:
        value = row.get(key)
        return "-" if value is None or value != value else pattern.format(value)

    line = (
        f"step {row['step']}: k3 {figure('healthy_k3', '{:.3g}')}, "
        f"chi2 {figure('chi2_token', '{:.3g}')}, "
        f"mult {figure('token_mult_prob_error', '{:.4f}')}, "
        f"|d| p99 {figure('abs_diff_p99', '{:.3g}')}, tail {figure('tail_share', '{:.2%}')}, "
        f"broken {figure('broken_sequences', '{:d}')}"
    )
    for name, p in zip(trend.names, trend.settings, strict=True):
        line += (
            f" | {clip(name, 40)}: masked {figure(f'{p}_token_masked_fraction', '{:.2%}')}, "
            f"LR {figure(f'{p}_lr_scale', '{:.4g}')}, ESS {figure(f'{p}_ess', '{:.1%}')}"
        )
    return line
