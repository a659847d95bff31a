"""Object storage: `s3://`, `gs://` and `az://` URIs read through pyarrow's filesystems
(docs/storage.md). The one place a URI becomes a filesystem and a path, an object's size and
time, a random-access file, or the objects a prefix or glob names; local paths never come
here (`is_uri`).

S3 takes the standard credential chain (environment, `~/.aws`, instance roles) and, since
pyarrow's S3 filesystem does not read it, `AWS_ENDPOINT_URL_S3` or `AWS_ENDPOINT_URL` as its
endpoint (MinIO, moto, a cloud's S3 API). Connections and requests time out after
`TIMEOUT_S` and are tried `ATTEMPTS` times, so a dead endpoint fails within a minute.

>>> is_uri("s3://bucket/run/"), is_uri("run/"), is_uri("gs://bucket/step_1.parquet")
(True, False, True)
>>> split("s3://bucket/run/step_*.parquet")
('s3', 'bucket/run/step_*.parquet')
"""

from __future__ import annotations

import datetime
import fnmatch
import functools
import glob
import os
import time
from urllib.parse import urlsplit

import pyarrow as pa
import pyarrow.fs as pafs

from iscore.errors import DumpError, clip

SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "az": "az", "abfs": "az", "abfss": "az"}
"""The URI schemes read, each to the filesystem that reads it."""

TIMEOUT_S = 10.0
"""Seconds a connection or a request to an object store may take before it fails."""

ATTEMPTS = 3
"""How often a failed request to S3 is tried in all."""


def is_uri(item: object) -> bool:
    """Whether `item` is an object-storage URI (`s3://`, `gs://`, `gcs://`, `az://`,
    `abfs://`, `abfss://`), not a local path."""
    if not isinstance(item, str) or "://" not in item:
        return False
    return item.split("://", 1)[0].lower() in SCHEMES


def split(uri: str) -> tuple[str, str]:
    """(scheme, `bucket/key`) of a URI, the key's components checked: a `.` or `..` component
    or an empty bucket is refused, so that no URI names an object outside its prefix by
    climbing out of it (docs/security.md).

    Raises:
        DumpError: not such a URI, or one with those components.
    """
    scheme, _, rest = uri.partition("://")
    kind = SCHEMES.get(scheme.lower())
    if kind is None:
        raise DumpError(f"{clip(uri)}: expected a URI of {', '.join(sorted(SCHEMES))}")
    parts = rest.split("/")
    if not parts[0] or any(p in (".", "..") for p in parts):
        raise DumpError(
            f"{clip(uri)}: expected {scheme}://BUCKET/KEY without `.` or `..` components"
        )
    return kind, rest


def filesystem(kind: str) -> pafs.FileSystem:
    """The filesystem of a scheme's kind (`s3`, `gs`, `az`), made once per process and
    environment: a change of `AWS_ENDPOINT_URL`, the region, the access key or the profile
    makes another (the credential chain is resolved when one is made)."""
    if kind == "s3":
        env = os.environ.get
        endpoint = env("AWS_ENDPOINT_URL_S3") or env("AWS_ENDPOINT_URL")
        region = env("AWS_REGION") or env("AWS_DEFAULT_REGION")
        return _s3(endpoint, region, (env("AWS_ACCESS_KEY_ID"), env("AWS_PROFILE")))
    if kind == "gs":
        return _gcs()
    return _azure(os.environ.get("AZURE_STORAGE_ACCOUNT_NAME") or "")


@functools.lru_cache(maxsize=8)
def _s3(endpoint: str | None, region: str | None, _who: tuple) -> pafs.FileSystem:
    options: dict = {
        "connect_timeout": TIMEOUT_S,
        "request_timeout": TIMEOUT_S,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=ATTEMPTS),
    }
    if region:
        options["region"] = region
    if endpoint:
        parts = urlsplit(endpoint if "://" in endpoint else f"https://{endpoint}")
        options["scheme"] = parts.scheme
        options["endpoint_override"] = parts.netloc + parts.path.rstrip("/")
    return pafs.S3FileSystem(**options)


@functools.lru_cache(maxsize=1)
def _gcs() -> pafs.FileSystem:
    return pafs.GcsFileSystem(retry_time_limit=datetime.timedelta(seconds=TIMEOUT_S))


@functools.lru_cache(maxsize=4)
def _azure(account: str) -> pafs.FileSystem:
    if not account:
        raise DumpError("az:// URIs: expected the storage account in AZURE_STORAGE_ACCOUNT_NAME")
    return pafs.AzureFileSystem(account)


def locate(uri: str) -> tuple[pafs.FileSystem, str]:
    """(filesystem, `bucket/key`) of a URI, for what pyarrow opens by filesystem and path (a
    dataset): pyarrow's own URI resolution would not read `AWS_ENDPOINT_URL`.

    Raises:
        DumpError: as `split`.
    """
    kind, path = split(uri)
    return filesystem(kind), path


def _fail(uri: str, e: Exception) -> DumpError:
    """One line for what went wrong reading `uri`: no such bucket or object, access denied,
    no credentials, an endpoint that does not answer, else the store's message on one line."""
    text = str(e)
    upper = text.upper()
    if "NO_SUCH_BUCKET" in upper or "NOSUCHBUCKET" in upper:
        what = "no such bucket"
    elif isinstance(e, FileNotFoundError) or "NO_SUCH_KEY" in upper or "NOT FOUND" in upper:
        what = "no such object or prefix"
    elif "CREDENTIALS" in upper and ("NO " in upper or "UNABLE" in upper):
        what = (
            "no credentials found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or a profile)"
        )
    elif any(
        k in upper
        for k in (
            "ACCESS_DENIED",
            "ACCESSDENIED",
            "INVALID_ACCESS_KEY",
            "INVALIDACCESSKEY",
            "SIGNATURE",
            "FORBIDDEN",
            "403",
        )
    ):
        what = "access denied (check the credentials and the bucket's policy)"
    elif any(k in upper for k in ("CURL", "NETWORK", "CONNECT", "TIMEOUT", "TIMED OUT")):
        endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
        where = f" at {endpoint}" if endpoint and uri.startswith("s3") else ""
        what = f"the object store{where} does not answer"
    else:
        what = clip(" ".join(text.split()), 300)
    return DumpError(f"{clip(uri)}: {what}")


def info(uri: str) -> pafs.FileInfo:
    """What the store says of the object or prefix `uri` (its type, size and time).

    Raises:
        DumpError: the store cannot be reached or refuses (one line, naming `uri`).
    """
    fs, path = locate(uri)
    try:
        return fs.get_file_info(path)
    except (OSError, pa.ArrowException) as e:
        raise _fail(uri, e) from None


def open_input(uri: str) -> pa.NativeFile:
    """The object `uri` as a random-access file (its size known, reads by range).

    Raises:
        DumpError: missing, or the store cannot be reached or refuses.
    """
    fs, path = locate(uri)
    try:
        return fs.open_input_file(path)
    except (OSError, pa.ArrowException) as e:
        raise _fail(uri, e) from None


def readable(path: str) -> str | pa.NativeFile:
    """What pyarrow opens for `path`: a local path as it is, an object as its open file."""
    return open_input(path) if is_uri(path) else path


def stat(uri: str) -> tuple[int, int]:
    """(size, mtime_ns) of the object `uri`.

    Raises:
        DumpError: not an object, or the store cannot be reached or refuses.
    """
    found = info(uri)
    if found.type != pafs.FileType.File:
        raise DumpError(f"{clip(uri)}: no such object")
    return found.size, found.mtime_ns or 0


def is_prefix(uri: str) -> bool:
    """Whether `uri` names a prefix ("folder") holding objects."""
    return info(uri).type == pafs.FileType.Directory


def listing(
    uri: str, suffixes: tuple[str, ...], *, max_listed: int, seconds: float
) -> dict[str, tuple[int, int]]:
    """URI -> (size, mtime_ns) of the objects `uri` names: itself if it is an object, else the
    objects under the prefix whose names end with one of `suffixes`, else those a glob
    (`*`, `?`, `[...]`, `**`, matched by path component) matches below its fixed part.

    Raises:
        DumpError: nothing by that name and no glob, more than `max_listed` objects listed or
            `seconds` spent, or the store cannot be reached or refuses.
    """
    scheme = uri.split("://", 1)[0]
    kind, path = split(uri)
    found = info(uri)
    if found.type == pafs.FileType.File:
        return {uri: (found.size, found.mtime_ns or 0)}
    pattern: tuple[str, ...] | None = None
    if found.type != pafs.FileType.Directory:
        bucket = f"{scheme}://{path.split('/')[0]}"
        if info(bucket).type == pafs.FileType.NotFound:
            raise DumpError(f"{clip(uri)}: no such bucket")
        if not glob.has_magic(path):
            raise DumpError(f"{clip(uri)}: no such object or prefix")
        parts = path.split("/")
        fixed = next(i for i, part in enumerate(parts) if glob.has_magic(part))
        if fixed == 0:
            raise DumpError(f"{clip(uri)}: expected a bucket without wildcards")
        pattern = tuple(parts[fixed:])
        path = "/".join(parts[:fixed])
    start = time.monotonic()
    selector = pafs.FileSelector(path.rstrip("/"), recursive=True, allow_not_found=True)
    try:
        entries = filesystem(kind).get_file_info(selector)
    except (OSError, pa.ArrowException) as e:
        raise _fail(uri, e) from None
    if len(entries) > max_listed or time.monotonic() - start > seconds:
        raise DumpError(
            f"{clip(uri)}: listed {len(entries):,} objects in {time.monotonic() - start:.1f} s, "
            f"more than the {max_listed:,} or {seconds:g} s allowed; name the objects more narrowly"
        )
    base = path.rstrip("/") + "/"
    files = {}
    for entry in entries:
        if entry.type != pafs.FileType.File:
            continue
        if pattern is None:
            if not entry.path.endswith(suffixes):
                continue
        elif not _matches(tuple(entry.path[len(base) :].split("/")), pattern):
            continue
        files[f"{scheme}://{entry.path}"] = (entry.size, entry.mtime_ns or 0)
    return files


def _matches(parts: tuple[str, ...], pattern: tuple[str, ...]) -> bool:
    """Whether the key components `parts` match the glob's components (`**`: any depth;
    hidden names only where the pattern names them, as in glob.glob)."""
    if not pattern:
        return not parts
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        if _matches(parts, rest):
            return True
        return bool(parts) and not parts[0].startswith(".") and _matches(parts[1:], pattern)
    if not parts:
        return False
    if parts[0].startswith(".") and not head.startswith("."):
        return False
    return fnmatch.fnmatchcase(parts[0], head) and _matches(parts[1:], rest)
