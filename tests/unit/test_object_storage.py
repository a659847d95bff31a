"""Object storage: s3:// URIs read through a local S3 server (moto's, started here, never a
cloud) give what the same files on disk give; URI errors are one line; an app's URI root
confines reads to its prefix. gs:// and az:// are parsed, not served (no local server)."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from iscore.cli import main
from iscore.errors import DumpError
from iscore.passes.results_store import FileIdentity, ResultStore
from iscore.session.serving import DataRoots, dump_folder
from iscore.utils import storage

DATA = Path(__file__).resolve().parents[2] / "data"
BUCKET = "iscore-runs"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A moto S3 server on a free loopback port, holding the samples (`data/`) and a
    simulated run of step files, uploaded under `s3://iscore-runs/`; yields the local run."""
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    served = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    served.start()
    host, port = served.get_host_and_port()
    env = {
        "AWS_ENDPOINT_URL": f"http://{host}:{port}",
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("AWS_ENDPOINT_URL_S3", raising=False)
        mp.delenv("AWS_PROFILE", raising=False)
        for name, value in env.items():
            mp.setenv(name, value)
        run = tmp_path_factory.mktemp("s3") / "run"
        assert main(["simulate", str(run), "--steps", "3", "--sequences", "16", "--seed", "3"]) == 0
        client = boto3.client("s3")
        client.create_bucket(Bucket=BUCKET)
        for path in (*DATA.glob("*.parquet"), DATA / "README.md"):
            client.upload_file(str(path), BUCKET, f"data/{path.name}")
        for path in run.rglob("*.parquet"):
            client.upload_file(str(path), BUCKET, f"run/{path.relative_to(run).as_posix()}")
        yield run
    served.stop()


def _json(argv: list[str], out: Path, local: str, uri: str) -> dict:
    """The JSON a command writes, the URI written as the local path, timings left out."""
    assert main([*argv, "-q", "--json", str(out)]) in (0, 1)
    return _same_paths(json.loads(out.read_text()), local, uri)


def _same_paths(value, local: str, uri: str):
    if isinstance(value, dict):
        return {
            k: _same_paths(v, local, uri)
            for k, v in value.items()
            if "second" not in k and "elapsed" not in k
        }
    if isinstance(value, list):
        return [_same_paths(v, local, uri) for v in value]
    if isinstance(value, str):
        return value.replace(uri, local)
    return value


@pytest.mark.parametrize("command", ["analyze", "validate", "recommend"])
def test_a_sample_read_from_s3_equals_the_local_file(server, tmp_path, command):
    local, uri = str(DATA / "drift.parquet"), f"s3://{BUCKET}/data/drift.parquet"
    extra = {"analyze": ["--no-cache"], "recommend": ["--framework", "verl"]}.get(command, [])
    a = _json([command, local, *extra], tmp_path / "a.json", local, uri)
    b = _json([command, uri, *extra], tmp_path / "b.json", local, uri)
    assert b == a


def test_a_query_over_the_tokens_of_s3_objects_equals_the_local_files(server, tmp_path):
    sql = "SELECT step, count(*) AS n, sum(d) AS d FROM tokens GROUP BY step ORDER BY step"
    tables = []
    for source in (str(server), f"s3://{BUCKET}/run/"):
        out = tmp_path / f"{len(tables)}.parquet"
        assert main(["sequences", source, "-q", "--sql", sql, "--out", str(out)]) == 0
        tables.append(pq.read_table(out))
    assert tables[1].equals(tables[0]) and tables[0].num_rows == 3


def test_replay_and_export_read_from_s3_equal_the_local_files(server, tmp_path, capsys):
    local, uri = str(server), f"s3://{BUCKET}/run/"
    tables, told = [], []
    for source in (local, uri):
        out = tmp_path / f"{len(tables)}.parquet"
        preset = ["--config", "verl:decoupled_token_is"]
        assert main(["replay", source, "-q", *preset, "--out", str(out)]) == 0
        tables.append(pq.read_table(out))
        capsys.readouterr()
        assert main(["export", *preset, "--to", "skyrl", "--dump", source, "-q"]) == 0
        told.append(capsys.readouterr().out.replace(source, "DUMP"))
    assert tables[1].equals(tables[0])
    assert told[1] == told[0]


def test_a_sequence_table_read_from_s3_equals_the_local_files(server, tmp_path):
    tables = []
    for source in (str(server), f"s3://{BUCKET}/run/"):
        out = tmp_path / f"{len(tables)}.parquet"
        assert main(["sequences", source, "-q", "--out", str(out)]) == 0
        tables.append(pq.read_table(out))
    assert tables[1].equals(tables[0])


@pytest.mark.parametrize("suffix", ["", "/", "/**/*.parquet", "/step_00000[12]/*.parquet"])
def test_a_run_read_by_prefix_or_glob_equals_the_local_folder(server, tmp_path, suffix):
    uri = f"s3://{BUCKET}/run{suffix}"
    local = str(server) + suffix
    argv = ["analyze", "--no-cache", "--preset", "verl:decoupled_token_is"]
    a = _json([*argv, local], tmp_path / "a.json", str(server), f"s3://{BUCKET}/run")
    b = _json([*argv, uri], tmp_path / "b.json", str(server), f"s3://{BUCKET}/run")
    assert b == a


def test_the_store_reads_an_unchanged_object_back(server, tmp_path):
    uri = f"s3://{BUCKET}/run/"
    argv = ["analyze", uri, "-q", "--cache-dir", str(tmp_path / "c")]
    assert main([*argv, "--json", str(tmp_path / "1.json")]) in (0, 1)
    assert main([*argv, "--json", str(tmp_path / "2.json")]) in (0, 1)
    first, second = (json.loads((tmp_path / n).read_text()) for n in ("1.json", "2.json"))
    assert _same_paths(second, "", "") == _same_paths(first, "", "")
    from iscore.dump import Dump
    from iscore.passes.analysis import analyze

    store = ResultStore(tmp_path / "c")
    analyze(Dump(uri), [], store=store)
    assert store.reads > 0 and store.writes == 0
    objects = sorted(storage.listing(uri, (".parquet",), max_listed=100, seconds=10))
    identity = FileIdentity.of(objects[0])
    assert identity is not None and identity.path == objects[0]
    assert identity.size == (server / objects[0].split("/run/", 1)[1]).stat().st_size


def test_watch_once_on_a_prefix(server, capsys):
    local, uri = str(server), f"s3://{BUCKET}/run/"
    assert (
        main(["watch", local, "--once", "--no-cache", "--preset", "verl:decoupled_token_is"]) == 0
    )
    a = capsys.readouterr().out
    assert main(["watch", uri, "--once", "--no-cache", "--preset", "verl:decoupled_token_is"]) == 0
    b = capsys.readouterr().out
    assert b.replace(uri.rstrip("/"), local) == a


@pytest.mark.parametrize(
    ("uri", "expected"),
    [
        ("s3://no-such-bucket/run/step.parquet", "no such bucket"),
        (f"s3://{BUCKET}/run/no-such-key.parquet", "no such object or prefix"),
        (f"s3://{BUCKET}/run/no_such_*.parquet", "the pattern matches no files"),
        (f"s3://{BUCKET}/data/../run/", "without `.` or `..` components"),
    ],
)
def test_what_is_missing_is_one_line(server, capsys, uri, expected):
    assert main(["validate", uri, "-q"]) == 2
    err = capsys.readouterr().err
    assert expected in err and uri in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_an_object_that_is_no_parquet_is_told_as_a_local_file_is(server, capsys):
    local, uri = str(DATA / "README.md"), f"s3://{BUCKET}/data/README.md"
    told = []
    for source in (local, uri):
        assert main(["validate", source, "-q"]) == 1
        out = capsys.readouterr()
        told.append((out.out + out.err).replace(source, "FILE"))
    assert told[1] == told[0] and "not a Parquet file" in told[0]


def test_credentials_the_server_refuses_are_one_line(server, monkeypatch, capsys):
    settings = pytest.importorskip("moto.settings")
    monkeypatch.setattr(settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAWRONGWRONGWRONG0")
    uri = f"s3://{BUCKET}/run/"
    assert main(["validate", uri, "-q"]) == 2
    err = capsys.readouterr().err
    assert "access denied" in err and uri in err and len(err.strip().splitlines()) == 1


def test_a_dead_endpoint_fails_within_its_timeouts(server, monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    assert main(["validate", f"s3://{BUCKET}/run/", "-q"]) == 2
    assert time.monotonic() - start < 60
    err = capsys.readouterr().err
    assert "does not answer" in err and len(err.strip().splitlines()) == 1


def test_an_app_root_on_s3_holds_its_prefix_only(server):
    roots = DataRoots([f"s3://{BUCKET}/run/"])
    assert f"s3://{BUCKET}/run/step_000001/rank_0000.parquet" in roots
    for outside in (
        f"s3://{BUCKET}/run/../data/drift.parquet",
        f"s3://{BUCKET}/run/./../data/drift.parquet",
        f"s3://{BUCKET}/running/x.parquet",
        f"s3://{BUCKET}/data/drift.parquet",
        "s3://other-bucket/run/x.parquet",
        f"gs://{BUCKET}/run/x.parquet",
        str(DATA / "drift.parquet"),
    ):
        assert outside not in roots
        with pytest.raises(DumpError, match="folders this app may read"):
            roots.check(outside)
    with pytest.raises(DumpError, match="folders this app may read"):
        roots.check(f"s3://{BUCKET}/*/drift.parquet")
    from iscore.session.workspace import fingerprint

    files = roots.files(f"s3://{BUCKET}/run/", fingerprint)
    assert len(files) == len(list(server.rglob("*.parquet")))
    assert dump_folder(f"s3://{BUCKET}/run/step_*/*.parquet") == f"s3://{BUCKET}/run/"
    assert dump_folder(f"s3://{BUCKET}/run") == f"s3://{BUCKET}/run/"
    assert dump_folder(f"s3://{BUCKET}/data/drift.parquet") == f"s3://{BUCKET}/data/"


def test_the_server_path_opens_a_prefix_within_its_token_bound(server):
    from iscore.session.workspace import fingerprint, open_path

    roots = DataRoots([f"s3://{BUCKET}/run/"])
    files = [path for path, _, _ in roots.files(f"s3://{BUCKET}/run/**/*.parquet", fingerprint)]
    remote = open_path(files, max_tokens=10**8)
    local = open_path(str(server), max_tokens=10**8)
    assert remote.summary() == local.summary() and remote.batch().num_tokens > 0
    with pytest.raises(DumpError, match="more than the 10 one session may load"):
        open_path(files, max_tokens=10)


def test_a_local_root_does_not_hold_a_uri(tmp_path):
    roots = DataRoots([tmp_path])
    assert "s3://bucket/x.parquet" not in roots


@pytest.mark.parametrize(
    ("uri", "kind", "path"),
    [
        ("gs://bucket/run/step.parquet", "gs", "bucket/run/step.parquet"),
        ("gcs://bucket/run/", "gs", "bucket/run/"),
        ("az://container/run/*.parquet", "az", "container/run/*.parquet"),
        ("abfss://container/run/", "az", "container/run/"),
        ("S3://bucket/key", "s3", "bucket/key"),
    ],
)
def test_gs_and_az_uris_are_parsed(uri, kind, path):
    assert storage.is_uri(uri)
    assert storage.split(uri) == (kind, path)


def test_local_paths_and_other_schemes_are_no_uris():
    assert not storage.is_uri("run/step.parquet")
    assert not storage.is_uri("http://example.org/x.parquet")
    assert not storage.is_uri(Path("s3:/bucket"))


@pytest.mark.parametrize("bad", ["s3:///key", "s3://bucket/a/../b", "s3://bucket/./b"])
def test_a_uri_that_could_climb_is_refused(bad):
    with pytest.raises(DumpError, match=r"without `\.` or `\.\.`"):
        storage.split(bad)


def test_the_gcs_filesystem_is_made_and_azure_asks_for_its_account(monkeypatch):
    import pyarrow.fs as pafs

    assert isinstance(storage.filesystem("gs"), pafs.GcsFileSystem)
    monkeypatch.delenv("AZURE_STORAGE_ACCOUNT_NAME", raising=False)
    with pytest.raises(DumpError, match="AZURE_STORAGE_ACCOUNT_NAME"):
        storage.filesystem("az")
    monkeypatch.setenv("AZURE_STORAGE_ACCOUNT_NAME", "iscoreaccount")
    assert isinstance(storage.filesystem("az"), pafs.AzureFileSystem)


def test_the_s3_endpoint_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "http://127.0.0.1:19000")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    fs = storage.filesystem("s3")
    assert fs.region == "eu-west-1"
    assert "127.0.0.1:19000" in repr(fs.__reduce__())  # what pickles to Ray's workers


def test_ray_tasks_reopen_the_objects_on_their_workers(server, tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")  # env as set here
    try:
        uri, argv = f"s3://{BUCKET}/run/", ["analyze", "--no-cache", "--engine", "ray"]
        local = _json([*argv, str(server)], tmp_path / "a.json", str(server), uri.rstrip("/"))
        remote = _json([*argv, uri], tmp_path / "b.json", str(server), uri.rstrip("/"))
    finally:
        ray.shutdown()
    assert remote == local


def test_the_app_takes_a_followed_prefix_and_a_uri_data_root(server, monkeypatch, capsys):
    seen: dict = {}
    monkeypatch.setattr("os.execv", lambda path, argv: seen.setdefault("argv", argv))
    run, data = f"s3://{BUCKET}/run/", f"s3://{BUCKET}/data/"
    main(["app", run, "--follow", "--data-dir", data])
    argv = seen["argv"]
    assert argv[argv.index("--") :] == [
        "--", "--path", run, "--follow", "--interval", "10", "--data-dir", data,
    ]  # fmt: skip
    assert main(["app", "--data-dir", f"s3://{BUCKET}/data/../run/"]) == 2
    assert "without `.` or `..` components" in capsys.readouterr().err
    assert main(["app", f"s3://{BUCKET}/nothing-here/", "--follow"]) == 2
    assert "expected a run's folder" in capsys.readouterr().err.lower()


def test_a_followed_prefix_reads_a_new_step_object_once(server, tmp_path):
    boto3 = pytest.importorskip("boto3")
    from iscore.frameworks.resolve import resolve
    from iscore.passes.follow import Follower

    client = boto3.client("s3")
    first = sorted(server.rglob("*.parquet"))
    for path in first[:2]:
        client.upload_file(str(path), BUCKET, f"growing/{path.relative_to(server).as_posix()}")
    follower = Follower(f"s3://{BUCKET}/growing/", [resolve("verl:decoupled_token_is")])
    assert len(follower.poll().files) == 2
    assert follower.poll().files == ()
    last = first[2].relative_to(server).as_posix()
    client.upload_file(str(first[2]), BUCKET, f"growing/{last}")
    assert follower.poll().files == (f"s3://{BUCKET}/growing/{last}",)


def test_hostile_files_read_from_s3_are_told_as_the_local_ones(server, tmp_path, capsys):
    """The footer's check runs on an object's footer too (a footer pyarrow aborts on would
    end this process), and every answer is the local file's."""
    boto3 = pytest.importorskip("boto3")
    from tests.unit.hostile import dumps

    client = boto3.client("s3")
    checked = 0
    for name, write in dumps().items():
        (tmp_path / name).mkdir()
        path = write(tmp_path / name)
        if not path.is_file() or path.suffix != ".parquet":
            continue
        uri = f"s3://{BUCKET}/hostile/{name}/{path.name}"
        client.upload_file(str(path), BUCKET, uri.split(f"{BUCKET}/", 1)[1])
        told = []
        for source in (str(path), uri):
            code = main(["validate", source, "-q"])
            out = capsys.readouterr()
            told.append((code, (out.out + out.err).replace(source, "FILE")))
        assert told[1] == told[0], name
        checked += 1
    assert checked > 20
