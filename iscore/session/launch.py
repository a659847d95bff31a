"""How the dashboard is started: the options `iscore app` takes beside Streamlit's own, and the
same options as the app reads them from its script's arguments (`Options`), defined once.

>>> parse_options(["--path", "run.parquet", "--cache-mb", "512"], Path("data")).cache_mb
512
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from iscore.session.budget import CACHE_MB, MAX_PATH_TOKENS, MAX_UPLOAD_TOKENS
from iscore.session.serving import FOLLOW_INTERVAL_S, DataRoots, dump_folder

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


@dataclass(frozen=True, slots=True)
class Options:
    """How the operator started the app: `streamlit run app/serve.py -- [--path DUMP
    [--follow [--interval S]]] [--data-dir DIR ...] [--max-upload-tokens N]
    [--max-path-tokens N] [--cache-mb MB]`, as `iscore app` does.

    Attributes:
        preload: the dump to open on the Data page.
        roots: the folders the server-path box may read: every `--data-dir`, the folder of
            `preload`, the bundled samples.
        max_upload_tokens: the most tokens one session may upload.
        max_path_tokens: the most tokens one session may open from a server path, except
            `preload`, which the operator named.
        cache_mb: memory for the loaded dumps of every session together.
        where: the slice every page starts with (`iscore app --where`).
        follow: `preload` is a run's folder still being written (`iscore app DIR --follow`).
        interval: seconds between looks at it.
    """

    preload: str | None
    roots: DataRoots
    max_upload_tokens: int
    cache_mb: int
    where: str | None = None
    max_path_tokens: int = MAX_PATH_TOKENS
    follow: bool = False
    interval: float = FOLLOW_INTERVAL_S


def parse_options(argv: Sequence[str], samples: Path) -> Options:
    """The app's `Options` from its script's arguments (what `iscore app` passes after `--`),
    the bundled `samples` folder always among the roots; arguments it does not know are left
    to Streamlit."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--path")
    parser.add_argument("--data-dir", action="append", default=[])
    parser.add_argument("--max-upload-tokens", type=int, default=MAX_UPLOAD_TOKENS)
    parser.add_argument("--max-path-tokens", type=int, default=MAX_PATH_TOKENS)
    parser.add_argument("--cache-mb", type=int, default=CACHE_MB)
    parser.add_argument("--where")
    parser.add_argument("--follow", action="store_true")
    parser.add_argument("--interval", type=float, default=FOLLOW_INTERVAL_S)
    args, _ = parser.parse_known_args(argv)
    folders = [samples, *args.data_dir]
    if args.path:
        folders.append(dump_folder(args.path))
    return Options(
        args.path,
        DataRoots(folders),
        args.max_upload_tokens,
        args.cache_mb,
        args.where,
        args.max_path_tokens,
        bool(args.path) and args.follow,
        args.interval,
    )
