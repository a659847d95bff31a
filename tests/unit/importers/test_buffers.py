"""`read_buffers`: every format read from bytes held in memory (uploads) as from the same
files on disk, without opening or writing any file."""

from __future__ import annotations

import builtins
import io
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from iscore.dump.importers import read, read_buffers
from iscore.errors import DumpError
from tests.unit.importers.conftest import make_seqs, provenance
from tests.unit.importers.test_nemo_rl import write_step
from tests.unit.importers.test_prime_rl import write_rank
from tests.unit.importers.test_skyrl import (
    NEW,
    dump,
    skyrl,  # noqa: F401 (a fixture)
    training_input,
)
from tests.unit.importers.test_slime import write_v2


@contextmanager
def no_files() -> Iterator[None]:
    """Opening any file, to read or to write, fails the test."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"a file was opened: {args[:2]}")

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(builtins, "open", refuse)
        patch.setattr(io, "open", refuse)
        yield


def uploads(*paths: Path) -> list[tuple[str, bytes]]:
    """The files as a browser uploads them: the file's name (no folder) and its bytes."""
    return [(p.name, p.read_bytes()) for p in paths]


def assert_same(table, on_disk, names: list[str]) -> None:
    """The same rows as from disk; the provenance names the uploads."""
    assert table.to_pylist() == on_disk.to_pylist()
    assert provenance(table.schema)["source_files"] == names


def test_nemo_rl(tmp_path):
    files = [write_step(tmp_path, step, make_seqs([3, 5], seed=step)) for step in (2, 10)]
    given = uploads(*files)
    with no_files():
        table = read_buffers(given)
    assert_same(table, read(tmp_path), ["train_data_step2.jsonl", "train_data_step10.jsonl"])
    assert provenance(table.schema)["steps"] == [2, 10]


def test_prime_rl_without_its_folders(tmp_path):
    """An upload is `rank_0.jsonl` with no step folder: the records name step and rank."""
    path = write_rank(tmp_path, 4, 1, make_seqs([2, 3]), stable=False)
    given = uploads(path)
    with no_files():
        table = read_buffers(given)
    assert table.to_pylist() == read(path).to_pylist()
    assert table["seq_id"].to_pylist() == ["1:0", "1:1"]
    # The STABLE marker is looked for beside files on disk only.
    assert "notes" not in provenance(table.schema)
    assert any("STABLE" in note for note in provenance(read(path).schema)["notes"])


def test_slime_pt(tmp_path):
    path = write_v2(tmp_path, 3, make_seqs([4, 2, 5]))
    given = uploads(path)
    with no_files():
        table = read_buffers(given)
    assert table.to_pylist() == read(path).to_pylist()
    assert table["step"].to_pylist() == [3, 3, 3]


def test_skyrl_pkl_only_with_allow_pickle(tmp_path, skyrl):  # noqa: F811
    path = dump(training_input(skyrl(NEW, "reduce"), make_seqs([3, 4])), tmp_path, 6)
    given = uploads(path)
    with no_files():
        with pytest.raises(DumpError, match=r"global_step_6_training_input\.pkl: a pickle"):
            read_buffers(given)
        table = read_buffers(given, allow_pickle=True)
    assert table.to_pylist() == read(path, allow_pickle=True).to_pylist()


def test_every_upload_must_be_read(tmp_path):
    """A file of no known format among uploads is an error naming it, never skipped."""
    path = write_step(tmp_path, 1, make_seqs([2]))
    given = [*uploads(path), ("notes.jsonl", b'{"a": 1}\n')]
    with pytest.raises(DumpError, match=r"^notes.jsonl: does not look like a dump iscore can"):
        read_buffers(given)
    with pytest.raises(DumpError, match=r"^notes.jsonl: no file looks like a dump iscore can"):
        read_buffers(given[1:])
    with pytest.raises(DumpError, match="no files given"):
        read_buffers([])


def test_errors_name_the_upload_and_the_line(tmp_path):
    given = [("train_data_step1.jsonl", b'{"token_loss_mask": [[1]]}\n{oops\n')]
    with pytest.raises(DumpError, match=r"^train_data_step1.jsonl: line 1: missing key"):
        read_buffers(given)
    with pytest.raises(DumpError, match=r"^rank_0.pt: not a file torch.save wrote"):
        read_buffers([("rank_0.pt", b"PAR1 not torch")], fmt="slime")
