"""The options and steps the commands share: which dump to read and how, where to compute,
the results store, progress bars, and what --drop-invalid dropped."""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from iscore.dump import DEFAULT_CHUNK_TOKENS, FORMATS
from iscore.errors import IscoreError, counted, quote
from iscore.utils import ENGINES, check_output

if TYPE_CHECKING:
    from tqdm import tqdm

    from iscore.dump import Dump, StepRange
    from iscore.packed import TokenBatch
    from iscore.passes import ResultStore


def step_range(text: str) -> StepRange:
    from iscore.dump import StepRange

    try:
        return StepRange.parse(text)
    except IscoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def share(text: str) -> float:
    """A share given as a fraction in [0, 1] (0.01) or a percentage (1%). A bare number above
    1 is refused: `5` for five percent would read as 500% (and `1` as 100%, which `recommend`
    warns about)."""
    body = text.strip()
    percent = body.endswith("%")
    try:
        number = float(body.removesuffix("%"))
    except ValueError:
        number = math.nan
    value = number / 100 if percent else number
    if not 0.0 <= value <= 1.0:
        hint = ""
        if number > 1 and not percent:
            hint = f" (for {number:g} percent write {number:g}% or {number / 100:g})"
        raise argparse.ArgumentTypeError(
            f"expected a fraction in [0, 1] or a percentage, e.g. 0.01 or 1%, but got "
            f"{quote(text[:200])}{hint}"
        )
    return value


def counted_option(name: str) -> Callable[[str], int]:
    """The argparse type of option `name`, a positive integer."""

    def parse(text: str) -> int:
        try:
            return positive_int(name, text)
        except IscoreError:
            raise argparse.ArgumentTypeError(
                f"expected a positive integer, but got {quote(text[:200])}"
            ) from None

    return parse


chunk_tokens = counted_option("--chunk-tokens")


def positive_float(text: str) -> float:
    """An argument that must be a positive finite number."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(
            f"expected a positive number, but got {quote(text[:200])}"
        ) from None
    return value


def positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise IscoreError(f"Expected {name} to be a positive integer, but got {text[:200]}")
    return value


def add_dump_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dump",
        nargs="+",
        help="Parquet file(s), directory or glob; or s3://, gs://, az:// URIs of objects, "
        "prefixes or globs (docs/storage.md)",
    )
    add_dump_options(parser)
    add_quiet(parser)


def add_dump_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options saying which of a dump to read, and how; returns them."""
    return [
        parser.add_argument(
            "--column",
            action="append",
            default=[],
            metavar="CANONICAL=SOURCE",
            help="read canonical column CANONICAL from the file's column SOURCE; CANONICAL= "
            "leaves an optional column out (repeatable)",
        ),
        parser.add_argument(
            "--steps",
            type=step_range,
            default=None,
            metavar="RANGE",
            help="only these training steps: 5, 3:7, 3: or :7 (inclusive)",
        ),
        parser.add_argument(
            "--drop-invalid",
            action="store_true",
            help="drop sequences with NaN, infinite or positive log-probs instead of failing",
        ),
        parser.add_argument(
            "--where",
            metavar="PREDICATE",
            help="only the sequences where this SQL condition on the sequence table holds "
            "(the dump's columns and the mismatch ones, such as length, k3, d_mean), e.g. "
            '"step > 200 AND length > 4000" (see docs/sql.md)',
        ),
        parser.add_argument(
            "--format",
            choices=FORMATS,
            dest="fmt",
            metavar="FORMAT",
            help=f"read a framework's own dump ({', '.join(FORMATS)}); detected when unambiguous",
        ),
        parser.add_argument(
            "--allow-pickle",
            action="store_true",
            help="allow reading pickled dumps (SkyRL .pkl); pickles can run code when loaded",
        ),
        parser.add_argument(
            "--chunk-tokens",
            type=chunk_tokens,
            default=DEFAULT_CHUNK_TOKENS,
            help="tokens per streamed chunk; bounds memory (default %(default)s)",
        ),
    ]


def add_settings(parser: argparse.ArgumentParser) -> None:
    """`--config` and `--preset`, both into `args.settings` (analyze's and diff's)."""
    parser.add_argument(
        "--config",
        action="append",
        default=[],
        dest="settings",
        metavar="CFG.yaml",
        help="a framework config with a top-level `framework:` (repeatable)",
    )
    parser.add_argument(
        "--preset",
        action="append",
        dest="settings",
        metavar="NAME",
        help="a named setting, e.g. verl:decoupled_geo_rs (repeatable)",
    )


def add_engine(parser: argparse.ArgumentParser, jobs: bool = False) -> None:
    """`--engine`, and with `jobs` the local engine's `--jobs`."""
    if jobs:
        parser.add_argument(
            "--jobs",
            type=counted_option("--jobs"),
            metavar="N",
            help="with the local engine, worker processes of one thread each, fed a file's "
            "pieces as Ray tasks are, with the same results (default: every core on a machine "
            "of more than two, else 1: this process; a dump of one piece or a GPU analysis runs "
            "here; docs/performance.md#every-core)",
        )
    parser.add_argument(
        "--engine",
        choices=ENGINES,
        default="local",
        help="where to compute: in this process (local, the default), or on a Ray cluster "
        "(ray: the one RAY_ADDRESS names, else a local one started for the command), a task "
        "per file or range of a file's steps on the workers' CPUs, with the same results "
        "(recommend: the tasks read the dump, the candidates are replayed here); needs pip "
        "install 'iscore[ray]' (docs/performance.md#ray)",
    )


def add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def add_cache_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument(
        "--cache-dir",
        metavar="DIR",
        help="keep each step's results here and read back those of files that have not "
        "changed (default: $XDG_CACHE_HOME/iscore, else ~/.cache/iscore; docs/runs.md)",
    )
    group.add_argument(
        "--no-cache", action="store_true", help="read and compute everything; keep nothing"
    )
    parser.add_argument(
        "--cache-max-mb",
        type=positive_float,
        metavar="MB",
        help="the most the results store may take on disk: past it, the least recently used "
        "entries go (default: $ISCORE_CACHE_MAX_MB, else 2048)",
    )


def open_store(args: argparse.Namespace) -> ResultStore | None:
    """The results store the arguments name: --cache-dir, else the user's cache; none with
    --no-cache."""
    from iscore.passes import ResultStore
    from iscore.utils import default_folder

    if args.no_cache:
        return None
    cap = None if args.cache_max_mb is None else int(args.cache_max_mb * (1 << 20))
    return ResultStore(args.cache_dir or default_folder(), max_bytes=cap)


def distinct_outputs(args: argparse.Namespace, *flags: str) -> None:
    """Refuse two of the output options `flags` naming one file: the last would replace it."""
    seen: dict[str, str] = {}
    for flag in flags:
        path = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if path is None:
            continue
        key = os.path.realpath(path)
        if key in seen:
            raise IscoreError(
                f"{seen[key]} and {flag} both name {path}; give each output a file of its own"
            )
        seen[key] = flag


def needs_extras(specs: Sequence[Any]) -> bool:
    """Whether a setting reads a per-sequence column the dump carries only when opened with
    its extras (prime-rl's default loss: the advantage's sign)."""
    return any(getattr(spec, "needs_advantage", False) for spec in specs)


def open_dump(
    args: argparse.Namespace,
    *,
    extras: bool = False,
    outputs: tuple[str, ...] = (),
    store: ResultStore | None = None,
) -> Dump:
    """The dump the arguments name, opened (the footers `store` knows to be sound not
    parsed again); each output option of `outputs` is checked before any work (a missing
    folder, a directory, a file of the dump itself)."""
    from iscore.dump import Dump, parse_mapping

    dump = Dump(
        args.dump,
        columns=parse_mapping(args.column),
        steps=args.steps,
        drop_invalid=args.drop_invalid,
        fmt=args.fmt,
        allow_pickle=args.allow_pickle,
        where=args.where,
        extras=extras,
        footers=None if store is None else store.footers,
    )
    inputs = [f.path for f in dump.files]
    for flag in outputs:
        path = getattr(args, flag.removeprefix("--").replace("-", "_"))
        if path is not None:
            check_output(path, inputs=inputs)
    return dump


def report_dropped(dump: Dump) -> None:
    """Say on stderr what --drop-invalid dropped: the results leave those sequences out."""
    dropped = dump.dropped
    if dropped.sequences:
        reasons = ", ".join(f"{k}: {counted(v, 'value')}" for k, v in dropped.reasons.items())
        print(
            f"note: --drop-invalid left out {counted(dropped.sequences, 'sequence')} "
            f"({counted(dropped.tokens, 'token')}) with invalid log-probs ({reasons})",
            file=sys.stderr,
        )


def progress_bar(dump: Dump, desc: str, args: argparse.Namespace) -> tqdm:
    """A progress bar over the dump's tokens (hidden with -q or when not on a terminal)."""
    from tqdm import tqdm

    return tqdm(
        total=dump.num_tokens,
        unit="tok",
        unit_scale=True,
        desc=desc,
        disable=args.quiet or None,
        leave=False,
    )


def load_dump(
    args: argparse.Namespace,
    outputs: tuple[str, ...] = (),
    engine: str = "local",
    extras: bool = False,
) -> TokenBatch:
    """The whole dump the arguments name (read here, or by Ray tasks with `--engine ray`),
    with a progress bar while it is read; with `extras`, its per-sequence columns too."""
    dump = open_dump(args, outputs=outputs, extras=extras)
    with progress_bar(dump, "load", args) as bar:
        batch = dump.load(progress=bar.update, engine=engine)
    report_dropped(dump)
    return batch
