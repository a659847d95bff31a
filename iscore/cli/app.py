"""`iscore app`: serve the dashboard (Streamlit) on the loopback interface."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from iscore.cli import options
from iscore.errors import IscoreError
from iscore.session import APP_FLAGS, APP_OPTIONS, FOLLOW_INTERVAL_S, LOOPBACK_HOSTS
from iscore.utils import storage


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Add the command to `iscore`'s subcommands."""
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
    p.set_defaults(func=run, app_parser=p)


def run(args: argparse.Namespace) -> int:
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
    package = Path(__file__).resolve().parents[1]  # iscore/
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
            script_args += [name, str(options.positive_int(name, value))]
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
    from iscore.passes import ready_files

    files = [str(p) for p in ready_files(paths[0])] if follow else [paths[0]]
    if files:
        Dump(files, where=predicate)
