"""`python -m testbed sweep`: train every regime's candidate settings and print the table;
`python -m testbed leadtime`: the lead time of watch's default alerts on the mid-run regimes."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from iscore import frameworks
from iscore.errors import IscoreError
from iscore.frameworks.resolve import load_config_text, parse_config, resolve
from testbed import leadtime
from testbed.engine import MIDRUN, NOISES, REGIMES
from testbed.sweep import Cache, Candidate, Sweep, candidates, train_regime
from testbed.table import markdown, summarize, to_json
from testbed.training import Training


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m testbed",
        description="Proof by training: a tiny policy trained with each correction setting.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    sweep = commands.add_parser(
        "sweep", help="train every regime's candidates over several seeds; print the table"
    )
    sweep.add_argument("--framework", default="verl", choices=frameworks.NAMES)
    sweep.add_argument(
        "--regimes", default=",".join(REGIMES), help=f"comma separated, of {', '.join(REGIMES)}"
    )
    sweep.add_argument(
        "--noise",
        choices=NOISES,
        help="how every regime's engine draws its noise (default: the regime's own)",
    )
    sweep.add_argument("--seeds", type=int, default=8, help="seeds 0..N-1 (default 8)")
    sweep.add_argument("--steps", type=int, default=Training().steps, help="updates per run")
    sweep.add_argument(
        "--setting",
        action="append",
        default=[],
        metavar="LABEL=SETTING",
        help="a setting of the framework to try too, repeatable: a preset (verl:decoupled_geo_rs), "
        "a config file, or a config as inline YAML",
    )
    sweep.add_argument(
        "--only", help="comma separated labels: train only these candidates (default all)"
    )
    sweep.add_argument("--out", type=Path, help="write the Markdown table here too")
    sweep.add_argument("--json", type=Path, help="write the results as JSON here")
    sweep.add_argument(
        "--cache",
        type=Path,
        default=Path(".testbed/cache.json"),
        help="JSON file of finished runs, read and extended (default .testbed/cache.json)",
    )
    sweep.add_argument("--no-cache", action="store_true", help="neither read nor write a cache")
    sweep.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    lead = commands.add_parser(
        "leadtime",
        help="when watch's default alerts fire on the mid-run regimes, against the damage",
    )
    lead.add_argument(
        "--regimes",
        default=",".join([*MIDRUN, "bf16"]),
        help=f"comma separated, of {', '.join([*MIDRUN, *REGIMES])} (default %(default)s: "
        "bf16, without a change, is where an alert is a false one)",
    )
    lead.add_argument(
        "--seeds",
        default=f"{leadtime.TUNE_SEEDS[0]}-{leadtime.TUNE_SEEDS[-1]}",
        help="seeds FIRST-LAST (default %(default)s, those the default alerts were chosen on)",
    )
    lead.add_argument("--steps", type=int, default=leadtime.STEPS, help="updates per run")
    lead.add_argument("--out", type=Path, help="write the Markdown table here too")
    args = parser.parse_args(argv)
    if args.command == "leadtime":
        return _leadtime(parser, args, argv)
    names = [n for n in args.regimes.split(",") if n]
    unknown = [n for n in names if n not in REGIMES]
    if unknown or not names or args.seeds < 2 or args.steps < Training().final_window:
        parser.error(
            f"expected --regimes of {', '.join(REGIMES)}, --seeds >= 2 and --steps >= "
            f"{Training().final_window}; got {args.regimes!r}, {args.seeds}, {args.steps}"
        )
    try:
        extra = tuple(_setting(text, args.framework) for text in args.setting)
    except (ValueError, IscoreError) as e:
        parser.error(str(e))
    only = None if args.only is None else set(args.only.split(","))
    torch.set_num_threads(args.threads)
    config = Sweep(
        framework=args.framework,
        regimes=tuple(replace(REGIMES[n], noise=args.noise or REGIMES[n].noise) for n in names),
        seeds=tuple(range(args.seeds)),
        training=Training(steps=args.steps),
        extra=extra,
    )
    cache = Cache(None if args.no_cache else args.cache)
    start = time.perf_counter()
    tables = []
    total = len(names) * (config.training.steps + config.dump_steps[1])
    with tqdm(total=total, desc="sweep", unit="step", file=sys.stderr) as bar:
        for regime in config.regimes:
            bar.set_postfix_str(regime.name)
            found, dump = candidates(config, regime)
            if only is not None:
                found = [c for c in found if only & {c.label, *c.aliases}]
            bar.update(config.dump_steps[1])
            runs = train_regime(config, regime, found, cache, bar.update)
            tables.append(summarize(regime, dump, found, runs))
    minutes = (time.perf_counter() - start) / 60
    command = shlex.join(["python", "-m", "testbed", *(sys.argv[1:] if argv is None else argv)])
    made = f"Made by `{command}` in {minutes:.1f} min ({torch.get_num_threads()} thread)."
    text = markdown(tables, config, made)
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    if args.json is not None:
        args.json.write_text(json.dumps(to_json(tables, config), indent=1) + "\n")
    return 0


def _leadtime(
    parser: argparse.ArgumentParser, args: argparse.Namespace, argv: list[str] | None
) -> int:
    """The `leadtime` command: measure each regime and print the table."""
    known = {**MIDRUN, **REGIMES}
    names = [n for n in args.regimes.split(",") if n]
    first, _, last = args.seeds.partition("-")
    if not names or any(n not in known for n in names) or not (first + last).isdigit():
        parser.error(f"expected --regimes of {', '.join(known)} and --seeds FIRST-LAST")
    seeds = list(range(int(first), int(last) + 1))
    torch.set_num_threads(1)
    start = time.perf_counter()
    training = Training(steps=args.steps, curve_every=1)
    lines = [leadtime.measure(known[n], seeds, training) for n in names]
    minutes = (time.perf_counter() - start) / 60
    command = shlex.join(["python", "-m", "testbed", *(sys.argv[1:] if argv is None else argv)])
    text = leadtime.markdown(lines, f"Made by `{command}` in {minutes:.1f} min (1 thread).")
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


def _setting(text: str, framework: str) -> Candidate:
    """A `--setting LABEL=SETTING` as a candidate of `framework`."""
    label, equals, setting = text.partition("=")
    if not equals or not label or not setting:
        raise ValueError(f"expected --setting LABEL=SETTING, but got {text!r}")
    loaded = load_config_text(setting, f"--setting {label}")
    spec = parse_config(loaded) if isinstance(loaded, Mapping) else resolve(setting)
    if frameworks.of(spec).name != framework:
        raise ValueError(f"--setting {label} is a {spec.framework} setting, not {framework}'s")
    return Candidate(label, spec, setting)


if __name__ == "__main__":
    sys.exit(main())
