"""The per-rank, per-step layout: one run from several writers and processes, atomic files,
sampling, dropping when behind, and errors found in the background thread."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest

import iscore
from iscore.cli import main
from iscore.dump.writer import RANK_STRIDE, DumpWriter
from iscore.errors import DumpError
from tests.batches import LIKE, check_dump, expected, make_truth, read_dump

ROOT = Path(__file__).resolve().parents[2]


def _write_rank(run: str, rank: int, steps: int) -> None:
    """One data-parallel rank of a TRL run (a separate process in the multi-process test)."""
    with DumpWriter(run, framework="trl", rank=rank) as writer:
        for step in range(steps):
            writer.add_batch(LIKE["trl"](make_truth(seed=10 * rank + step)), step=step)


def test_several_processes_write_one_run(tmp_path, capsys, monkeypatch) -> None:
    # A spawned process first re-runs the parent's __main__ from its path; after the app's
    # tests (AppTest runs app/main.py as __main__) that is a script that cannot run alone.
    monkeypatch.setitem(sys.modules, "__main__", types.ModuleType("__main__"))
    run = str(tmp_path / "run")
    context = multiprocessing.get_context("spawn")
    workers = [context.Process(target=_write_rank, args=(run, rank, 3)) for rank in range(4)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    files = sorted(p.relative_to(run).as_posix() for p in Path(run).rglob("*"))
    assert files == [
        f"step_{s:06d}" if r is None else f"step_{s:06d}/rank_{r:04d}.parquet"
        for s in range(3)
        for r in (None, 0, 1, 2, 3)
    ]
    table = read_dump(run)
    truth_rows = sum(make_truth(seed=10 * r + s).count for r in range(4) for s in range(3))
    assert table.num_rows == truth_rows
    keys = set(zip(table["step"].to_pylist(), table["seq_id"].to_pylist(), strict=True))
    assert len(keys) == truth_rows, "(step, seq_id) unique across ranks"
    assert {i // RANK_STRIDE for i in table["seq_id"].to_pylist()} == {0, 1, 2, 3}
    batch = iscore.load(run)
    assert batch.num_sequences == truth_rows
    assert main(["validate", run]) == 0
    assert "written     by a trl training loop: 12 files from 4 ranks, steps 0..2" in (
        capsys.readouterr().out
    )
    assert main(["recommend", run, "--framework", "trl"]) == 0
    assert "vllm_importance_sampling" in capsys.readouterr().out


def test_one_step_of_several_calls_is_one_file(tmp_path) -> None:
    truth = make_truth(seed=3)
    blocks = LIKE["openrlhf"](truth)
    with DumpWriter(tmp_path, framework="openrlhf", rank=2) as writer:
        for block in blocks:
            writer.add_batch(block, step=5)
    assert [p.name for p in tmp_path.rglob("*.parquet")] == ["rank_0002.parquet"]
    check_dump(tmp_path, expected("openrlhf", truth), step=5)


def test_sampling_every_and_max_sequences(tmp_path) -> None:
    with DumpWriter(tmp_path, framework="trl", rank=0, every=2, max_sequences=4) as writer:
        for step in range(5):
            writer.add_batch(LIKE["trl"](make_truth(seed=step)), step=step)
            writer.add_batch(LIKE["trl"](make_truth(seed=step)), step=step)  # over the budget
    table = read_dump(tmp_path)
    assert sorted(set(table["step"].to_pylist())) == [0, 2, 4]
    assert table["step"].to_pylist().count(2) == 4
    want = make_truth(seed=2).rollout[:4]
    got = [
        np.asarray(r, np.float32)
        for r in table.filter(table["step"].to_numpy() == 2)["rollout_logprob"].to_pylist()
    ]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g, w)


def test_a_step_is_dropped_not_waited_for_when_the_thread_is_behind(tmp_path, monkeypatch) -> None:
    release = threading.Event()
    writer = DumpWriter(tmp_path, framework="trl", rank=0, max_pending=1)
    build = writer._table

    def slow(job):
        release.wait(10)
        return build(job)

    monkeypatch.setattr(writer._files, "_build", slow)
    started = time.perf_counter()
    for step in range(3):
        writer.add_batch(LIKE["trl"](make_truth(seed=step)), step=step)
    assert time.perf_counter() - started < 1.0, "add_batch never waits for the thread"
    release.set()
    writer.close()
    assert writer.dropped_steps == 2
    assert sorted(set(read_dump(tmp_path)["step"].to_pylist())) == [0]


def test_invalid_values_fail_their_step_only(tmp_path) -> None:
    good, bad = LIKE["trl"](make_truth(seed=0)), LIKE["trl"](make_truth(seed=1))
    bad["completion_mask"] = bad["completion_mask"] * 2  # not 0/1: seen only in the values
    writer = DumpWriter(tmp_path, framework="trl", rank=0)
    writer.add_batch(good, step=0)
    with pytest.warns(RuntimeWarning, match="did not write step 1"):
        writer.add_batch(bad, step=1)
        writer.add_batch(good, step=2)
        with pytest.raises(DumpError, match=r"did not write 1 step; step 1: .*mask.*0/1"):
            writer.close()
    assert sorted(set(read_dump(tmp_path)["step"].to_pylist())) == [0, 2]


def test_shape_errors_are_raised_at_the_call(tmp_path) -> None:
    inputs = LIKE["trl"](make_truth())
    inputs["old_per_token_logps"] = inputs["old_per_token_logps"][:, :-1]
    with (
        DumpWriter(tmp_path, framework="trl", rank=0) as writer,
        pytest.raises(DumpError, match="`train_logprobs` to have shape"),
    ):
        writer.add_batch(inputs, step=0)


def test_a_step_cannot_be_written_twice(tmp_path) -> None:
    with DumpWriter(tmp_path, framework="trl", rank=0) as writer:
        writer.add_batch(LIKE["trl"](make_truth()), step=0)
        writer.add_batch(LIKE["trl"](make_truth()), step=1)
        with pytest.raises(DumpError, match="step 0 was already written by rank 0"):
            writer.add_batch(LIKE["trl"](make_truth()), step=0)


def test_a_folder_needs_a_rank(tmp_path) -> None:
    with pytest.raises(DumpError, match="pass rank="):
        DumpWriter(tmp_path)
    with pytest.raises(DumpError, match="`rank` to be an integer >= 0"):
        DumpWriter(tmp_path, rank=-1)


_KILLED = """
import sys, time, pyarrow.parquet as pq
from iscore.dump.writer import DumpWriter
from tests.batches import LIKE, make_truth

ready = sys.argv[2]
write = pq.ParquetWriter.write_table

def stall(self, table, *args, **kwargs):
    if (table["step"][0].as_py() == 1):
        write(self, table, *args, **kwargs)  # part of the file is on disk
        open(ready, "w").close()
        time.sleep(60)
    return write(self, table, *args, **kwargs)

pq.ParquetWriter.write_table = stall
writer = DumpWriter(sys.argv[1], framework="trl", rank=0)
writer.add_batch(LIKE["trl"](make_truth(seed=0)), step=0)
writer.add_batch(LIKE["trl"](make_truth(seed=1)), step=1)
writer.add_batch(LIKE["trl"](make_truth(seed=2)), step=2)  # ends step 1: its file is written
time.sleep(60)
"""


def test_a_writer_killed_mid_step_loses_only_that_step(tmp_path) -> None:
    run, ready = tmp_path / "run", tmp_path / "ready"
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(_KILLED), str(run), str(ready)], cwd=ROOT
    )
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert child.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(child.pid, signal.SIGKILL)  # in the middle of writing step 1's file
    finally:
        child.wait(10)
    left = sorted(p.relative_to(run).as_posix() for p in run.rglob("*") if p.is_file())
    assert left[0] == "step_000000/rank_0000.parquet"
    assert len(left) == 2 and left[1].startswith("step_000001/.rank_0000.parquet.")
    assert left[1].endswith(".partial")
    check_dump(run, expected("trl", make_truth(seed=0)), step=0)
    assert main(["validate", str(run)]) == 0
