"""`iscore simulate`: a realistic dump with known ground truth."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from iscore.cli import options
from iscore.errors import ConfigError, IscoreError, counted


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
    p = sub.add_parser(
        "simulate",
        help="write a realistic dump with known ground truth",
        description="Write a simulated paired logprob dump; see `iscore simulate --list-regimes`.",
    )
    p.add_argument(
        "out",
        nargs="?",
        help="output Parquet file, or a new folder (a name without a suffix) for a run of "
        "step files, OUT_DIR/step_000123/rank_0000.parquet, as a training loop writes them",
    )
    p.add_argument("--regime", default="dense_bf16", help="mismatch regime (default %(default)s)")
    p.add_argument("--layout", choices=("sequence", "token"), default="sequence")
    p.add_argument("--sequences", type=int, help="sequences per step")
    p.add_argument("--steps", type=int, help="training steps")
    p.add_argument("--seed", type=int, help="the same seed writes the same dump")
    p.add_argument("--min-len", type=int, help="shortest sequence length")
    p.add_argument("--max-len", type=int, help="longest sequence length")
    p.add_argument("--median-len", type=int, help="median sequence length (default: the regime's)")
    p.add_argument(
        "--broken-share",
        type=float,
        help="share of each step's sequences scored by a stale replica (every token's train "
        "log-prob 1 nat above the rollout's); default 0",
    )
    p.add_argument(
        "--policy-sigma",
        type=float,
        help="logit noise (nats) between the trainer and the current policy: adds a "
        "policy_logprob column, for bypass and current-policy settings; default 0 (none)",
    )
    p.add_argument(
        "--grow-from",
        type=int,
        metavar="STEP",
        help="from this step on, the trainer noise grows by --growth per step (the mismatch "
        "begins to grow); recorded in each file's metadata",
    )
    p.add_argument(
        "--growth", type=float, help="the factor --grow-from grows the noise by per step (1.5)"
    )
    p.add_argument(
        "--broken-from",
        type=int,
        metavar="STEP",
        help="broken sequences (--broken-share of each step, 4%% if not given) from this step on",
    )
    p.add_argument("--ranks", type=int, help="a run folder's files per step (default 1)")
    p.add_argument(
        "--every",
        type=float,
        metavar="SECONDS",
        help="a run folder: wait this long before each step, as a job still writing",
    )
    p.add_argument(
        "--policy-growth",
        type=float,
        help="factor by which --policy-sigma grows per step (a policy lagging further behind "
        "each step); default 1",
    )
    p.add_argument(
        "--experts",
        type=int,
        metavar="K",
        help="expert ids per token (a router's top-k of 64): adds rollout_experts and "
        "train_experts columns; default 0 (none)",
    )
    p.add_argument(
        "--routing-differ",
        type=float,
        metavar="SHARE",
        help="share of tokens whose routing differs between the two sides; default 0",
    )
    p.add_argument(
        "--routing-scale",
        type=float,
        help="the trainer noise's multiplier on those tokens (1: a disagreement that carries "
        "no extra mismatch); default 1",
    )
    p.add_argument(
        "--turns",
        type=int,
        help="turns per sequence: adds a turn column; default 0 (none)",
    )
    p.add_argument(
        "--turn-scale",
        type=float,
        help="the trainer noise's multiplier on the first 4 tokens of each turn after the "
        "first (a re-tokenized transcript); default 1",
    )
    p.add_argument(
        "--floor",
        type=float,
        metavar="SIGMA",
        dest="floor_sigma",
        help="logit noise (nats) between the trainer and a second recompute of it: adds a "
        "floor_logprob column, the trainer's own noise floor; default 0 (none)",
    )
    p.add_argument(
        "--topk",
        type=int,
        metavar="K",
        help="the engine's K most likely candidates at each token, their log-probs and the "
        "trainer's: adds the top-k columns (the whole distribution, docs/distribution.md); "
        "default 0 (none)",
    )
    _add_metadata_options(p)
    p.add_argument("--list-regimes", action="store_true", help="list the regimes and exit")
    p.set_defaults(func=run)


def _add_metadata_options(p: argparse.ArgumentParser) -> None:
    """The metadata columns' options (docs/why.md#the-metadata-breakdown)."""
    p.add_argument(
        "--replicas",
        type=int,
        metavar="N",
        help="engine replicas sampling the prompt groups in turn: adds replica and "
        "weight_version columns (the mismatch by each, docs/why.md); default 0 (none)",
    )
    p.add_argument(
        "--noisy-replica",
        metavar="R:FACTOR",
        help="replica R's trainer noise FACTOR times the others' (e.g. 3:4)",
    )
    p.add_argument(
        "--stale-share",
        type=float,
        metavar="SHARE",
        help="share of each step's sequences sampled with the previous step's weights (their "
        "weight_version is the step minus 1); default 0",
    )
    p.add_argument(
        "--fixed-version",
        action="store_const",
        const=True,
        help="every sequence's weight_version is 0 (a learning rate of 0): with --grow-from, "
        "the engine drifts while the policy stays",
    )
    p.add_argument(
        "--retokenized",
        type=float,
        metavar="SHARE",
        help="share of sequences the trainer scored re-tokenized: adds a train_token_id column "
        "with another id at the middle token of each; default 0 (none)",
    )


def run(args: argparse.Namespace) -> int:
    from iscore.dump import BROKEN_FROM_SHARE, REGIMES, SimConfig, write_run, write_simulated

    if args.list_regimes:
        for name, regime in REGIMES.items():
            print(f"{name:16s} {regime.description}")
        return 0
    if args.out is None:
        raise IscoreError(
            "simulate needs an output path: iscore simulate OUT.parquet (one file) or OUT_DIR "
            "(a run folder of step files)"
        )
    names = (
        "sequences",
        "steps",
        "seed",
        "min_len",
        "max_len",
        "median_len",
        "broken_share",
        "policy_sigma",
        "broken_from",
        "grow_from",
        "growth",
        "policy_growth",
        "experts",
        "routing_differ",
        "routing_scale",
        "turns",
        "turn_scale",
        "floor_sigma",
        "topk",
        "replicas",
        "stale_share",
        "fixed_version",
        "retokenized",
    )
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    if args.noisy_replica is not None:
        overrides |= _noisy_replica(args.noisy_replica)
    if args.broken_from is not None and args.broken_share is None:
        overrides["broken_share"] = BROKEN_FROM_SHARE
    run = not Path(args.out).suffix and not os.path.exists(args.out)
    if os.path.isdir(args.out):
        raise IscoreError(
            f"{args.out}: is a directory; expected a file name to write, or the name of a new "
            "folder for a run of step files"
        )
    for flag in ("ranks", "every"):
        if not run and getattr(args, flag) is not None:
            raise IscoreError(
                f"--{flag} is an option of a run folder (a new OUT_DIR, a name without a suffix)"
            )
    try:
        config = SimConfig(regime=args.regime, **overrides)
    except ConfigError as e:  # name the flags, not SimConfig's fields
        message = str(e)
        for name in ("regime", *names):
            flag = "--" + name.replace("_", "-")
            message = message.replace(f"argument `{name}`", flag).replace(f"{name}=", f"{flag} ")
        raise ConfigError(message) from None
    if run:
        ranks = 1 if args.ranks is None else options.positive_int("--ranks", str(args.ranks))
        truth = write_run(args.out, config, ranks=ranks, layout=args.layout, every=args.every or 0)
        where = f"{args.out}: a run of {counted(config.steps, 'step')} x {counted(ranks, 'rank')}"
    else:
        truth = write_simulated(args.out, config, layout=args.layout)
        where = args.out
    print(f"{where}: {truth.tokens:,} tokens in {truth.sequences:,} sequences ({args.regime})")
    return 0


def _noisy_replica(text: str) -> dict[str, float]:
    """`--noisy-replica R:FACTOR` as `SimConfig`'s fields.

    >>> _noisy_replica("3:4")
    {'noisy_replica': 3, 'noisy_factor': 4.0}
    """
    replica, _, factor = text.partition(":")
    try:
        return {"noisy_replica": int(replica), "noisy_factor": float(factor)}
    except ValueError:
        raise ConfigError(
            f"Expected --noisy-replica R:FACTOR (a replica and a noise factor, e.g. 3:4), but "
            f"got {text!r}"
        ) from None
