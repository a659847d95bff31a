"""What the dashboard's server may do: Host names answered, folders read."""

from __future__ import annotations

from pathlib import Path

import pytest

from iscore.errors import DumpError
from iscore.session.serving import LOOPBACK_HOSTS, DataRoots, dump_folder, host_allowed
from iscore.session.workspace import fingerprint


@pytest.mark.parametrize(
    ("host", "allowed", "expected"),
    [
        ("localhost:8501", LOOPBACK_HOSTS, True),
        ("LOCALHOST", LOOPBACK_HOSTS, True),
        ("127.0.0.1:8501", LOOPBACK_HOSTS, True),
        ("[::1]:8501", LOOPBACK_HOSTS, True),
        ("localhost.:8501", LOOPBACK_HOSTS, True),
        ("rebound.attacker.example:8501", LOOPBACK_HOSTS, False),
        ("localhost.attacker.example", LOOPBACK_HOSTS, False),
        ("127.0.0.1.nip.io", LOOPBACK_HOSTS, False),
        ("user@localhost", LOOPBACK_HOSTS, False),
        ("localhost:port", LOOPBACK_HOSTS, False),
        ("localhost/path", LOOPBACK_HOSTS, False),
        ("", LOOPBACK_HOSTS, False),
        (None, LOOPBACK_HOSTS, False),
        ("iscore.example.org", ["iscore.example.org"], True),
        ("a.example.org", ["*.example.org"], True),
        ("example.org", ["*.example.org"], False),
        ("anything:1", ["*"], True),
    ],
)
def test_host_allowed(host: str | None, allowed: tuple[str, ...], expected: bool) -> None:
    assert host_allowed(host, allowed) is expected


def test_the_dump_folder_of_a_file_a_directory_and_a_glob(tmp_path: Path) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "a.parquet").touch()
    assert dump_folder(tmp_path / "runs" / "a.parquet") == tmp_path / "runs"
    assert dump_folder(tmp_path / "runs") == tmp_path / "runs"
    assert dump_folder(f"{tmp_path}/runs/step_*/*.parquet") == tmp_path / "runs"


def test_roots_refuse_alike_what_is_missing_and_what_is_outside(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    roots = DataRoots([root, tmp_path / "missing-folder"])
    assert roots.folders == (root.resolve(),)
    messages = set()
    for text in ("/etc/passwd", "/etc/nothing", f"{root}/nothing.parquet", "/etc/*.conf"):
        with pytest.raises(DumpError) as caught:
            roots.check(text)
        messages.add(str(caught.value).split(": ", 1)[1])
    assert len(messages) == 1
    with pytest.raises(DumpError, match=r"^x{200}…: no such file"):
        roots.check("x" * 10_000)


def test_an_existing_name_with_glob_characters_is_itself(tmp_path: Path) -> None:
    (tmp_path / "run[1].parquet").write_bytes(b"PAR1")
    roots = DataRoots([tmp_path])
    assert roots.check(str(tmp_path / "run[1].parquet")) == str(tmp_path / "run[1].parquet")


def test_files_a_glob_reaches_through_a_symlink_are_refused(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (outside / "secret.parquet").write_bytes(b"PAR1")
    (root / "mine.parquet").write_bytes(b"PAR1")
    roots = DataRoots([root])
    assert [Path(p).name for p, _, _ in roots.files(f"{root}/*.parquet", fingerprint)] == [
        "mine.parquet"
    ]
    (root / "z.parquet").symlink_to(outside / "secret.parquet")
    with pytest.raises(DumpError, match="folders this app may read"):
        roots.files(f"{root}/*.parquet", fingerprint)
