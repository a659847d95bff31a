"""The `iscore` command line.

Each subcommand is a thin layer over the Python API: parse arguments, call iscore, print.
Errors the user can cause are printed as one clear message each, never as a traceback:
exit 1 for a dump with problems (unreadable files, wrong columns, invalid values), 2 for
bad arguments.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import types
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from iscore.dump.importers import FORMATS
from iscore.dump.values import DEFAULT_CHUNK_TOKENS
from iscore.errors import ConfigError, IscoreError, clip, counted, quote
from iscore.frameworks import NAMES as FRAMEWORKS
from iscore.session.budget import CACHE_MB, MAX_PATH_TOKENS, MAX_UPLOAD_TOKENS
from iscore.session.serving import FOLLOW_INTERVAL_S, LOOPBACK_HOSTS
from iscore.utils import storage
from iscore.utils.distributed import ENGINES
from iscore.utils.output import check_output, output_path, write_json

if TYPE_CHECKING:
    from tqdm import tqdm

    from iscore.dump import Dump, StepRange
    from iscore.packed.batch import TokenBatch
    from iscore.passes.results_store import ResultStore

# The commands import what they use when they run, and torch loads when it is first used:
# `iscore --help`, a mistyped option, `presets` and `validate` answer without it (measured by
# `iscore bench`).


class _Deferred(types.ModuleType):
    """A module whose code runs when an attribute it lacks is first read. `import` statements
    read only the attributes it has (`__spec__`, `__path__`), so they bind it without running
    it. (The standard library's `LazyLoader` runs on any attribute, `__spec__` included, so
    the first `import torch` statement loads it.)"""

    def __getattr__(self, name: str) -> Any:
        self.__class__ = types.ModuleType  # from now on a plain module, loading itself
        try:
            self.__spec__.loader.exec_module(self)
        except BaseException:
            sys.modules.pop(self.__name__, None)  # as a failed import leaves it
            raise
        return getattr(self, name)


def _defer_import(name: str) -> None:
    """Bind `name` in `sys.modules` to a `_Deferred` module unless it is imported already.
    The engine's modules import torch at the top; commands that never compute with it skip
    the 1-2 s of loading it. Only in this process, whose first use of torch is on its main
    thread (analyze's reader thread starts after it); the app runs in a process of its own."""
    if name in sys.modules or (spec := importlib.util.find_spec(name)) is None:
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _Deferred
    sys.modules[name] = module


def _step_range(text: str) -> StepRange:
    from iscore.dump import StepRange

    try:
        return StepRange.parse(text)
    except IscoreError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _share(text: str) -> float:
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


def _chunk_tokens(text: str) -> int:
    try:
        return _positive_int("--chunk-tokens", text)
    except IscoreError:
        raise argparse.ArgumentTypeError(
            f"expected a positive integer, but got {quote(text[:200])}"
        ) from None


def _add_dump_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "dump",
        nargs="+",
        help="Parquet file(s), directory or glob; or s3://, gs://, az:// URIs of objects, "
        "prefixes or globs (docs/storage.md)",
    )
    _add_dump_options(parser)
    _add_quiet(parser)


def _add_dump_options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
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
            type=_step_range,
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
            type=_chunk_tokens,
            default=DEFAULT_CHUNK_TOKENS,
            help="tokens per streamed chunk; bounds memory (default %(default)s)",
        ),
    ]


def _add_engine(parser: argparse.ArgumentParser) -> None:
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


def _add_quiet(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bar")


def _distinct_outputs(args: argparse.Namespace, *flags: str) -> None:
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


def _open_dump(
    args: argparse.Namespace,
    *,
    extras: bool = False,
    outputs: tuple[str, ...] = (),
    store: ResultStore | None = None,
) -> Dump:
    """The dump the arguments name, opened (the footers `store` knows to be sound not
    parsed again); each output option of `outputs` is checked before any work (a missing
    folder, a directory, a file of the dump itself)."""
    from iscore.dump import Dump
    from iscore.dump.columns import parse_mapping

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


def _dropped(dump: Dump) -> None:
    """Say on stderr what --drop-invalid dropped: the results leave those sequences out."""
    dropped = dump.dropped
    if dropped.sequences:
        reasons = ", ".join(f"{k}: {counted(v, 'value')}" for k, v in dropped.reasons.items())
        print(
            f"note: --drop-invalid left out {counted(dropped.sequences, 'sequence')} "
            f"({counted(dropped.tokens, 'token')}) with invalid log-probs ({reasons})",
            file=sys.stderr,
        )


def _progress(dump: Dump, desc: str, args: argparse.Namespace) -> tqdm:
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


def _load(
    args: argparse.Namespace, outputs: tuple[str, ...] = (), engine: str = "local"
) -> TokenBatch:
    """The whole dump the arguments name (read here, or by Ray tasks with `--engine ray`),
    with a progress bar while it is read."""
    dump = _open_dump(args, outputs=outputs)
    with _progress(dump, "load", args) as bar:
        batch = dump.load(progress=bar.update, engine=engine)
    _dropped(dump)
    return batch


def _cmd_validate(args: argparse.Namespace) -> int:
    from iscore.passes.validation import validate

    # Every column a command may read, the per-sequence ones (reward, group_id) too: a
    # reward that differs within a sequence is a problem `sequences` and `--where` meet.
    dump = _open_dump(args, extras=True, outputs=("--json",))
    with _progress(dump, "validate", args) as bar:
        report = validate(dump, max_tokens=args.chunk_tokens, progress=bar.update)
    if args.json:
        write_json(report.to_dict(), args.json, indent=2)
    print(report.render())
    return 0 if report.ok else 1


def _cmd_replay(args: argparse.Namespace) -> int:
    from iscore.frameworks.resolve import resolve
    from iscore.passes.replay import write_replay

    spec = resolve(args.config)
    dump = _open_dump(args, outputs=("--out",))
    with _progress(dump, "replay", args) as bar:
        written = write_replay(
            dump, spec, args.out, max_tokens=args.chunk_tokens, progress=bar.update
        )
    print(
        f"{args.out}: {written.tokens:,} tokens replayed with {spec.name} ({spec.framework}); "
        f"{written.kept:,} kept in the loss, {written.zero:,} of them with weight 0"
    )
    _dropped(dump)
    return 0


def _cmd_analyze(args: argparse.Namespace) -> int:
    from iscore.advice.health import assess
    from iscore.frameworks.resolve import resolve
    from iscore.passes.analysis import analyze
    from iscore.passes.sequences import SequenceTable, read_schema, write_rows
    from iscore.present.figures import setting_name
    from iscore.present.report import write_html

    _distinct_outputs(args, "--json", "--html", "--sequences")
    specs = [resolve(s) for s in args.settings]
    store = _store(args)
    dump = _open_dump(
        args,
        extras=args.sequences is not None,
        outputs=("--json", "--html", "--sequences"),
        store=store,
    )
    table = None if args.sequences is None else SequenceTable(read_schema(dump), specs)
    with _progress(dump, "analyze", args) as bar:
        result = analyze(
            dump,
            specs,
            max_tokens=args.chunk_tokens,
            progress=bar.update,
            sequences=table,
            store=store,
            engine=args.engine,
        )
    written = []
    for path, write in (
        (args.json, result.write_json),
        (args.html, lambda p: write_html(result, p)),
        (args.sequences, lambda p: write_rows(table.compute(), p)),
    ):
        if path:
            write(path)
            written.append(path)
    m = result.mismatch
    nan = float("nan")
    print(
        f"{result.source['loss_tokens']:,} loss tokens in {result.source['sequences']:,} "
        f"sequences: k3 {m.get('k3', nan):.3g}, mean |d| {m.get('abs_diff_mean', nan):.3g}, "
        f"max |d| {m.get('abs_diff_max', nan):.3g}"
    )
    print(f"  health: {assess(m).summary()}")
    for flag in m.get("flags", []):
        print(f"  ! {flag['code']}: {flag['message']}")
    for finding in result.attribution.get("findings", []):
        print(f"  from {finding['kind']}: {finding['summary']} To do: {finding['action']}")
    for s in result.settings:
        print(
            f"  {clip(setting_name(s))}: LR scale {s.get('lr_scale', nan):.4g}, "
            f"mean w {s.get('weight_mean', nan):.3g}, ESS {s.get('ess', nan):.1%}, "
            f"tokens masked {s.get('token_masked_fraction', nan):.2%}, sequences masked "
            f"{s.get('seq_masked_fraction', nan):.2%}"
        )
    for path in written:
        print(f"wrote {path}")
    if store is not None and (store.reads or store.writes):
        print(
            f"results store {store.folder}: read {counted(store.reads, 'entry', 'entries')}, "
            f"wrote {counted(store.writes, 'entry', 'entries')}",
            file=sys.stderr,
        )
    _dropped(dump)
    return 0


def _store(args: argparse.Namespace) -> ResultStore | None:
    """The results store the arguments name: --cache-dir, else the user's cache; none with
    --no-cache."""
    from iscore.passes.results_store import ResultStore
    from iscore.utils.paths import default_folder

    if args.no_cache:
        return None
    return ResultStore(args.cache_dir or default_folder())


def _add_cache_options(parser: argparse.ArgumentParser) -> None:
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


def _cmd_watch(args: argparse.Namespace) -> int:
    import time

    from iscore.dump.columns import parse_mapping
    from iscore.frameworks.resolve import resolve
    from iscore.passes.follow import Alert, Follower
    from iscore.present.scalars import ScalarWriter

    specs = [resolve(s) for s in args.settings]
    if args.interval <= 0:
        raise IscoreError(f"Expected --interval to be a positive number, but got {args.interval:g}")
    follower = Follower(
        args.folder,
        specs,
        store=_store(args),
        columns=parse_mapping(args.column),
        max_tokens=args.chunk_tokens,
        engine=args.engine,
    )
    alerts = [Alert.compile(rule, follower.trend) for rule in args.alert]
    scalars = None if args.tensorboard is None else ScalarWriter(args.tensorboard)
    fired: set[str] = set()
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


def _cmd_sequences(args: argparse.Namespace) -> int:
    import duckdb

    from iscore.frameworks.resolve import resolve
    from iscore.passes.sequences import TABLES, catalog, sequence_table, write_rows
    from iscore.utils.sql import QueryError, one_line, open_query, referenced

    specs = [resolve(s) for s in args.settings]
    dump = _open_dump(args, extras=True, outputs=("--out",))
    if args.sql is not None:  # a bad query fails here, before the dump is read
        referenced(args.sql, set(TABLES))
    with _progress(dump, "sequences", args) as bar:
        table = sequence_table(
            dump, specs, max_tokens=args.chunk_tokens, progress=bar.update, engine=args.engine
        )
    if args.sql is None:
        count = write_rows(table, args.out)
    else:
        tables, views = catalog(table, args.sql, dump)
        with open_query(tables, args.sql, views=views) as result:
            try:
                count = write_rows(result.to_arrow_reader(65_536), args.out)
            except duckdb.Error as e:
                raise QueryError(f"query: {one_line(e)}") from e
    if args.out:
        what = "sequences" if args.sql is None else "rows"
        print(f"{args.out}: {count:,} {what}", file=sys.stderr)
    _dropped(dump)
    return 0


def _cmd_recommend(args: argparse.Namespace) -> int:
    from dataclasses import fields

    from tqdm import tqdm

    from iscore.advice.candidates import RULE_SYMBOLS
    from iscore.advice.conversion import snippet
    from iscore.advice.recommendation import recommend
    from iscore.advice.targets import Targets
    from iscore.frameworks.resolve import resolve

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
    batch = _load(args, outputs=("--json",), engine=args.engine)
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


def _cmd_convert(args: argparse.Namespace) -> int:
    from iscore.dump.importers import convert

    report = convert(args.source, args.out, args.fmt, allow_pickle=args.allow_pickle)
    print(
        f"{args.out}: {report.tokens:,} tokens in {report.sequences:,} sequences, "
        f"{report.steps} steps, from {report.files} {report.framework} file(s)"
    )
    for note in report.notes:
        print(f"  note: {note}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from iscore.advice.conversion import convert, to_file_text
    from iscore.frameworks.resolve import resolve

    if args.dump is None:
        for option in args.dump_options:
            if getattr(args, option.dest) != option.default:
                raise IscoreError(
                    f"{option.option_strings[0]} is an option of --dump; give --dump DUMP with it"
                )
    if args.out:  # not onto the config or the dump being read
        check_output(args.out, inputs=[args.config])
    spec = resolve(args.config)
    batch = _load(args, outputs=("--out",)) if args.dump else None
    result = convert(spec, args.to, generation=args.generation, batch=batch)
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


def _cmd_bench(args: argparse.Namespace) -> int:
    from iscore.bench import format_table, format_where, run_bench, where_overhead

    _distinct_outputs(args, "--dump", "--json")
    if args.where:
        result = where_overhead(
            args.where,
            tokens=args.tokens,
            chunk_tokens=args.chunk_tokens,
            path=args.dump,
            log=None if args.quiet else lambda line: print(line),
        )
        print(format_where(result))
        if args.json:
            write_json(result, args.json)
            print(f"wrote {args.json}")
        return 0
    result = run_bench(
        tokens=args.tokens,
        chunk_tokens=args.chunk_tokens,
        device=args.device,
        path=args.dump,
        memory=not args.no_memory,
        run_files=args.run_files,
        log=None if args.quiet else lambda line: print(line),
    )
    print(format_table(result))
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    return 0


def _cmd_presets(args: argparse.Namespace) -> int:
    from iscore.frameworks.resolve import presets

    for key, spec in presets().items():
        if args.framework in (None, spec.framework):
            print(key)
    return 0


def _cmd_simulate(args: argparse.Namespace) -> int:
    from iscore.dump.simulate import (
        BROKEN_FROM_SHARE,
        REGIMES,
        SimConfig,
        write_run,
        write_simulated,
    )

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
    )
    overrides = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
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
        ranks = 1 if args.ranks is None else _positive_int("--ranks", str(args.ranks))
        truth = write_run(args.out, config, ranks=ranks, layout=args.layout, every=args.every or 0)
        where = f"{args.out}: a run of {counted(config.steps, 'step')} x {counted(ranks, 'rank')}"
    else:
        truth = write_simulated(args.out, config, layout=args.layout)
        where = args.out
    print(f"{where}: {truth.tokens:,} tokens in {truth.sequences:,} sequences ({args.regime})")
    return 0


APP_OPTIONS = {
    "--data-dir": "a folder, or an object-storage prefix (s3://bucket/run/), whose dumps the "
    "server-path box may open (repeatable; the DUMP's "
    "folder and the bundled samples always may be)",
    "--allowed-host": "a Host name the server answers besides the loopback names, e.g. the "
    "name a proxy serves it under (repeatable; `*` for any)",
    "--max-upload-tokens": "the most tokens one session may upload "
    f"(default {MAX_UPLOAD_TOKENS:,})",
    "--max-path-tokens": "the most tokens one session may open from a server path; the DUMP "
    f"named here may hold more (default {MAX_PATH_TOKENS:,})",
    "--cache-mb": f"memory for loaded dumps, shared by all sessions (default {CACHE_MB:,} MB)",
    "--where": "a slice applied to every page from the start: an SQL condition on the "
    "sequence table (its dump and mismatch columns, docs/sql.md), as Explore's 'apply as "
    "slice'",
    "--interval": "with --follow: seconds between looks at the run's folder (default "
    f"{FOLLOW_INTERVAL_S:g})",
}
"""iscore's own options of `iscore app`; every other `--section.option` goes to Streamlit."""

APP_FLAGS = {
    "--follow": "DUMP is a run's folder still being written: the Data and Trends pages pick "
    "up its step files as they land (a file still being written is skipped until it is "
    "whole; an empty folder is waited on)",
}
"""iscore's own flags of `iscore app` (without a value)."""


def _cmd_app(args: argparse.Namespace) -> int:
    """Serve the dashboard: `streamlit run app/serve.py`, from the installed package (a wheel)
    or the checkout (an editable install), so that `app/.streamlit/config.toml` applies (under
    STREAMLIT_* variables and --server.* flags). It listens on 127.0.0.1 unless given an
    address, and answers loopback names only unless given allowed hosts."""
    if {"-h", "--help"} & set(args.args):
        args.app_parser.print_help()
        print("\niscore's options:")
        for name, text in APP_OPTIONS.items():
            print(f"  {name} VALUE\n      {text}")
        for name, text in APP_FLAGS.items():
            print(f"  {name}\n      {text}")
        return 0
    paths, flags = [], []
    own: dict[str, list[str]] = {name: [] for name in APP_OPTIONS}
    follow = False
    items = iter(args.args)
    for item in items:
        if not item.startswith("--"):
            paths.append(item)
            continue
        if item == "--follow":
            follow = True
            continue
        name, has_value, value = item.partition("=")
        if name not in own and "." not in name:
            raise IscoreError(
                f"Expected {', '.join([*APP_OPTIONS, *APP_FLAGS])} or Streamlit's "
                f"--section.option flags after `iscore app` (e.g. --server.port 8600), but got "
                f"{item}"
            )
        if not has_value:
            value = next(items, None)
            if value is None:
                raise IscoreError(f"Expected a value after {item}")
        if name in own:
            own[name].append(value)
        else:
            flags += [name, value]
    if len(paths) > 1:
        raise IscoreError(
            f"Expected one dump (a file, a directory or a quoted glob), but got {len(paths)}: "
            + " ".join(paths)
        )
    # A wheel holds the app inside the package (pyproject.toml maps app/ to iscore/app/); an
    # editable install runs it from the checkout, beside the package.
    package = Path(__file__).resolve().parent
    candidates = [package / "app" / "serve.py", package.parent / "app" / "serve.py"]
    main = next((path for path in candidates if path.is_file()), None)
    if main is None:
        raise IscoreError(
            f"the dashboard is not installed: expected {candidates[0]} (a wheel) or "
            f"{candidates[1]} (a checkout); reinstall iscore"
        )
    if importlib.util.find_spec("streamlit") is None:
        raise IscoreError("the dashboard needs streamlit: pip install streamlit")
    script_args = []
    following = _follow_args(paths, own["--interval"]) if follow else []
    if own["--interval"] and not follow:
        raise IscoreError("--interval is how often --follow looks at the folder: add --follow")
    if paths:
        from iscore.dump import resolve_files

        if not follow:  # a run's folder may be empty yet
            resolve_files(paths[0])  # a typo fails here, not later in the browser
        where = paths[0] if storage.is_uri(paths[0]) else str(Path(paths[0]).absolute())
        script_args += ["--path", where, *following]
    for predicate in own["--where"][-1:]:
        _check_where(paths, predicate, follow)
        script_args += ["--where", predicate]
    for folder in own["--data-dir"]:
        if storage.is_uri(folder):
            storage.split(folder)  # a prefix with `..` is refused here
            script_args += ["--data-dir", folder]
            continue
        if not Path(folder).is_dir():
            raise IscoreError(f"Expected --data-dir to be a directory, but got {folder}")
        script_args += ["--data-dir", str(Path(folder).absolute())]
    for name in ("--max-upload-tokens", "--max-path-tokens", "--cache-mb"):
        for value in own[name]:
            script_args += [name, str(_positive_int(name, value))]
    # Loopback only unless told otherwise, whatever Streamlit's own default (every interface).
    if "--server.address" not in flags and "STREAMLIT_SERVER_ADDRESS" not in os.environ:
        flags += ["--server.address", "127.0.0.1"]
    if own["--allowed-host"]:
        for host in (*LOOPBACK_HOSTS, *own["--allowed-host"]):
            flags += ["--server.allowedHosts", host]
    # Streamlit replaces this process, so that signals (Ctrl-C, `docker stop`, kill) reach it
    # directly and no server is left behind. It reads the config beside the script it runs,
    # and stays in this directory, where relative paths typed on the Data page start.
    command = [sys.executable, "-m", "streamlit", "run", str(main), *flags]
    if script_args:
        command += ["--", *script_args]
    os.execv(sys.executable, command)


def _follow_args(paths: Sequence[str], intervals: Sequence[str]) -> list[str]:
    """The app's arguments of `--follow [--interval S]`: DUMP must be a folder.

    Raises:
        IscoreError: no DUMP, not a folder, or an interval that is not a positive number.
    """
    if not paths or not (
        storage.is_prefix(paths[0]) if storage.is_uri(paths[0]) else Path(paths[0]).is_dir()
    ):
        found = f"got {paths[0]}" if paths else "got none"
        raise IscoreError(f"Expected a run's folder (a directory) with --follow, but {found}")
    interval = FOLLOW_INTERVAL_S
    for text in intervals:
        try:
            interval = float(text)
        except ValueError:
            interval = math.nan
        if not math.isfinite(interval) or interval <= 0:
            raise IscoreError(f"Expected --interval to be a positive number, but got {text}")
    return ["--follow", "--interval", f"{interval:g}"]


def _check_where(paths: Sequence[str], predicate: str, follow: bool) -> None:
    """Check `--where` against the dump's columns here, not later in the browser: those of
    its whole files, with --follow (none yet: the app checks it once there are).

    Raises:
        QueryError: not a predicate over the dump's sequence columns.
    """
    if not paths:
        return
    from iscore.dump import Dump
    from iscore.passes.follow import ready_files

    files = [str(p) for p in ready_files(paths[0])] if follow else [paths[0]]
    if files:
        Dump(files, where=predicate)


def _positive_int(name: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise IscoreError(f"Expected {name} to be a positive integer, but got {text[:200]}")
    return value


class _Version(argparse.Action):
    """`--version`: the installed iscore's version, read from its metadata only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *args: object) -> None:
        from importlib.metadata import version

        print(f"{parser.prog} {version('iscore')}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the `iscore` command."""
    parser = argparse.ArgumentParser(
        prog="iscore",
        description="Replay rollout/trainer logprob dumps through RL frameworks' "
        "importance-sampling corrections.",
    )
    parser.add_argument("--version", action=_Version, help="print the version and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser(
        "validate",
        help="check a dump and summarize it",
        description="Read a whole dump (streamed), list every problem or print a summary. "
        "Exit 0 when valid, 1 when it has problems, 2 for bad arguments.",
    )
    _add_dump_arguments(p)
    p.add_argument("--json", metavar="OUT.json", help="also write the report as JSON")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser(
        "replay",
        help="replay one framework config over a dump, one row per token",
        description="Replay a framework's correction config over a dump and write one row "
        "per input token: seq_id, pos, step, weight (the factor multiplying the token's loss; "
        "0 where zeroed) and keep (the token's loss mask after the correction).",
    )
    _add_dump_arguments(p)
    p.add_argument(
        "--config",
        required=True,
        metavar="CFG.yaml|PRESET",
        help="the framework's own config plus a top-level `framework:`, or a preset name "
        "(see `iscore presets`)",
    )
    p.add_argument("--out", required=True, metavar="OUT.parquet", help="output Parquet file")
    p.set_defaults(func=_cmd_replay)

    p = sub.add_parser(
        "analyze",
        help="mismatch diagnostics and what each correction setting does, as JSON/HTML",
        description="Stream a dump once: mismatch diagnostics, and for every setting its weight "
        "distribution, mask rates, ESS, effective LR scale, per step and per length. Settings "
        "come from framework configs (--config) and presets (--preset; see `iscore presets`).",
    )
    _add_dump_arguments(p)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        dest="settings",
        metavar="CFG.yaml",
        help="a framework config with a top-level `framework:` (repeatable)",
    )
    p.add_argument(
        "--preset",
        action="append",
        dest="settings",
        metavar="NAME",
        help="a named setting, e.g. verl:decoupled_geo_rs (repeatable)",
    )
    p.add_argument("--json", metavar="OUT.json", help="write the analysis document")
    p.add_argument("--html", metavar="OUT.html", help="write a self-contained HTML report")
    p.add_argument(
        "--sequences",
        metavar="OUT.parquet|csv",
        help="also write the sequence table (as `iscore sequences` does), from the same pass",
    )
    _add_cache_options(p)
    _add_engine(p)
    p.set_defaults(func=_cmd_analyze)

    p = sub.add_parser(
        "watch",
        help="follow a run's folder as step files land: one line per step, events, alerts",
        description="Follow a run that is still writing: analyze each step file as it lands "
        "(whole files only; an empty folder is waited on), print one line per new step with "
        "its key figures and the events found (growth, broken sequences, offset, a setting "
        "that stops meeting the targets; docs/runs.md). Exit 0, 3 for --exit-on-alert, 130 "
        "on Ctrl-C.",
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
        "--exit-on-alert", action="store_true", help="exit with status 3 once an alert holds"
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
        type=_chunk_tokens,
        default=DEFAULT_CHUNK_TOKENS,
        help="tokens per streamed chunk; bounds memory (default %(default)s)",
    )
    _add_cache_options(p)
    _add_engine(p)
    p.set_defaults(func=_cmd_watch)

    p = sub.add_parser(
        "sequences",
        help="the per-sequence table, or a DuckDB SQL query over it",
        description="Stream a dump once into its sequence table (one row per sequence: step, "
        "seq_id, the dump's per-sequence columns, length, loss_tokens, mismatch statistics, "
        "and per setting its weight, kept fraction and gradient share; docs/sql.md) and write "
        "it, or the result of --sql over it: a DuckDB SELECT over `sequences` and the "
        "`tokens` view of the dump's tokens. Without --out, CSV on stdout.",
    )
    _add_dump_arguments(p)
    p.add_argument(
        "--config",
        action="append",
        default=[],
        dest="settings",
        metavar="CFG.yaml",
        help="a setting whose columns the table gets (repeatable)",
    )
    p.add_argument(
        "--preset",
        action="append",
        dest="settings",
        metavar="NAME",
        help="a named setting whose columns the table gets (repeatable)",
    )
    p.add_argument(
        "--sql",
        metavar="QUERY",
        help='a DuckDB SELECT over `sequences` and `tokens`, e.g. "SELECT step, avg(k3) '
        'FROM sequences GROUP BY step"',
    )
    p.add_argument("--out", metavar="OUT.parquet|csv", help="write here (default: CSV on stdout)")
    _add_engine(p)
    p.set_defaults(func=_cmd_sequences)

    p = sub.add_parser(
        "recommend",
        help="rank your framework's settings on your dump against targets",
        description="Replay your framework's candidate settings, with thresholds derived from "
        "the dump, rank them against the targets and print the best as a config snippet. "
        "With --engine ray, Ray tasks read the dump and the candidates are replayed here on "
        "the whole of it (their thresholds are medians over every token).",
    )
    _add_dump_arguments(p)
    p.add_argument(
        "--framework",
        required=True,
        choices=FRAMEWORKS,
        help="the framework whose settings are ranked (candidates of each kind it can express: "
        "docs/recommend.md)",
    )
    p.add_argument(
        "--max-token-drop",
        type=_share,
        default=0.01,
        metavar="SHARE",
        help="largest share of tokens that may lose their gradient: a fraction (0.01) or a "
        "percentage (1%%); default 1%%",
    )
    p.add_argument(
        "--max-seq-drop",
        type=_share,
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
        type=_share,
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
    _add_engine(p)
    p.set_defaults(func=_cmd_recommend)

    p = sub.add_parser(
        "convert",
        help="convert a framework's own dump to canonical Parquet",
        description="Read a framework's dump (NeMo-RL train_data_step*.jsonl, prime-rl token "
        "exports, slime .pt debug dumps, SkyRL .pkl training inputs) and write canonical "
        "Parquet, one row group per source file, with the provenance in its metadata.",
    )
    p.add_argument("source", help="a file, a directory or a glob of the framework's dump")
    p.add_argument("--from", dest="fmt", choices=FORMATS, help="the format (default: detected)")
    p.add_argument("--out", required=True, metavar="DUMP.parquet")
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help="allow reading pickled dumps (SkyRL .pkl); pickles can run code",
    )
    p.set_defaults(func=_cmd_convert)

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
    p.set_defaults(func=_cmd_export, dump_options=_add_dump_options(p))
    _add_quiet(p)

    p = sub.add_parser(
        "bench",
        help="time the engine against pyarrow, a padded torch and a pandas baseline",
        description="Simulate a long-tailed dump (or reuse --dump), then time in one run: the "
        "raw pyarrow read, iscore.load, analyze with 8 settings of 8 frameworks (streamed and "
        "resident), replay alone, a padded [B, max_len] torch and a pandas groupby "
        "implementation of the same corrections (checked to agree), Tuner queries, and peak "
        "memory streaming vs loading whole; CUDA rows when a GPU is present.",
    )
    p.add_argument("--tokens", type=int, default=50_000_000, help="dump size (default 50M)")
    p.add_argument("--dump", metavar="PATH", help="reuse this simulated dump, or write it here")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA rows when present")
    p.add_argument("--chunk-tokens", type=_chunk_tokens, default=DEFAULT_CHUNK_TOKENS)
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory subprocesses")
    p.add_argument(
        "--run-files",
        type=_chunk_tokens,
        default=1000,
        metavar="N",
        help="step files of the simulated run analyzed again and followed (default %(default)s)",
    )
    p.add_argument(
        "--where",
        action="append",
        metavar="PREDICATE",
        help="instead, time what --where PREDICATE adds to a streamed analyze (repeatable; "
        'e.g. --where "k3 >= 0", which keeps every sequence)',
    )
    p.add_argument("--json", metavar="OUT.json", help="also write the results as JSON")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    p.set_defaults(func=_cmd_bench)

    p = sub.add_parser(
        "presets",
        help="list the named settings of every framework",
        description="List each framework's named settings (FRAMEWORK:NAME), which --preset, "
        "--config and the app take; `iscore export --config FRAMEWORK:NAME --to F` prints one "
        "as a config.",
    )
    p.add_argument("--framework", choices=FRAMEWORKS, help="only this framework's presets")
    p.set_defaults(func=_cmd_presets)

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
    p.add_argument("--list-regimes", action="store_true", help="list the regimes and exit")
    p.set_defaults(func=_cmd_simulate)

    # `+` as the option prefix hands every `--server.port 8600` on to Streamlit untouched.
    p = sub.add_parser(
        "app",
        help="serve the dashboard in a browser",
        description="Serve the dashboard (Streamlit), opening on the Data page with DUMP loaded. "
        "Streamlit's own configuration applies: iscore's settings (app/.streamlit/config.toml), "
        "STREAMLIT_* environment variables and --section.option flags passed here, e.g. "
        "`iscore app runs/ --server.port 8600`. It listens on 127.0.0.1 unless given "
        "--server.address; see docs/security.md before serving it to others.",
        usage="iscore app [DUMP] [--follow [--interval S]] [--data-dir DIR ...] "
        "[--allowed-host NAME ...] [--max-upload-tokens N] [--max-path-tokens N] [--cache-mb MB] "
        "[--server.OPTION VALUE ...]",
        prefix_chars="+",
        add_help=False,
    )
    p.add_argument("args", nargs="*", metavar="[DUMP] [--section.option VALUE ...]")
    p.set_defaults(func=_cmd_app, app_parser=p)
    return parser


def _show_warning(message: Warning | str, *args: object, **kwargs: object) -> None:
    """A warning as one line, `warning: ...`, without the source line it was raised from."""
    print(f"warning: {message}", file=sys.stderr)


def _empty_path(args: argparse.Namespace) -> str | None:
    """The argument given an empty path, if any: `Path("")` is the current directory, so an
    empty `--out` was refused as "is a directory" and an empty DUMP read the whole folder."""
    for dest in ("dump", "source", "out", "json", "html", "sequences"):
        value = getattr(args, dest, None)
        if value == "" or (isinstance(value, list) and "" in value):
            return "the dump" if dest in ("dump", "source") else f"--{dest}"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `iscore` command; returns the exit status (130 after Ctrl-C, as shells do)."""
    args = build_parser().parse_args(argv)
    if (empty := _empty_path(args)) is not None:
        print(f"error: expected a path for {empty}, but got an empty string", file=sys.stderr)
        return 2
    _defer_import("torch")
    try:
        with warnings.catch_warnings():
            warnings.showwarning = _show_warning
            return args.func(args)
    except IscoreError as e:
        if problems := getattr(e, "problems", None):  # a DumpProblems: every one listed
            print(f"{len(problems)} problem{'s' * (len(problems) > 1)}:", file=sys.stderr)
            for problem in problems:
                print(f"  - {problem}", file=sys.stderr)
            return 1
        # One line, whatever the message holds, so scripts can grep and log it.
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"error: {message}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # Output piped into `head` and the like: stop quietly, as Unix tools do.
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        # Ctrl-C: outputs are written to a temporary file, removed as this unwinds, so no
        # partial file is left; one line, not a traceback.
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
