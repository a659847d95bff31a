"""The local parallel engine (`iscore.utils.workers`, `analyze(jobs=N)`, `--jobs N`): worker
processes of one thread each, fed a file's pieces as Ray tasks are; the results equal one
process's exactly, in the order of the work; a task's failure is named with its file; a script
without a main guard runs (no worker runs the caller's script again)."""

from __future__ import annotations

import json
import operator
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_run
from iscore.errors import ConfigError, DumpProblems, Problem
from iscore.frameworks import resolve_all
from iscore.passes.analysis import analyze, parts, worker_jobs
from iscore.utils.distributed import Ready
from iscore.utils.workers import default_jobs, ordered_here, pool

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ["verl:decoupled_geo_rs_token_tis", "skyrl:skyrl_geo_mask", "nemo_rl:nemo_icepop"]
PIECE = 20_000
"""Tokens per task, so that a file's steps are cut into several pieces."""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A simulated run: 6 steps x 2 ranks, broken sequences from step 4."""
    folder = tmp_path_factory.mktemp("workers") / "run"
    config = SimConfig("moe_routing", sequences=24, steps=6, median_len=300, seed=5, broken_from=4)
    write_run(folder, config, ranks=2)
    return folder


def _doc(source, **options) -> str:
    analysis = analyze(source, SETTINGS, max_tokens=PIECE, device="cpu", **options)
    return json.dumps(analysis.to_dict(), sort_keys=True)


def refuse(task):
    raise DumpProblems([Problem(task, "train_logprob", f"is not a float (in {os.getpid()})")])


def test_the_results_come_back_in_the_order_of_the_work():
    work = [-3, Ready("held"), -1, -7, Ready(None), -2]
    finished = []
    got = list(ordered_here(abs, work, name=str, jobs=2, done=lambda t, r: finished.append(t)))
    assert got == [(-3, 3), (work[1], "held"), (-1, 1), (-7, 7), (work[4], None), (-2, 2)]
    assert sorted(finished) == [-7, -3, -2, -1]  # each task told once, Ready items never


def test_a_task_raising_a_dump_problem_raises_it_as_one_process_would():
    pool(2).submit(os.getpid).result()  # the workers up: the tasks go to them
    with pytest.raises(DumpProblems) as raised:
        list(ordered_here(refuse, ["a.parquet", "b.parquet"], name=str, jobs=2))
    (problem,) = raised.value.problems  # made again from its problems in this process
    assert (problem.file, problem.column) == ("a.parquet", "train_logprob")
    pid = int(problem.message.removeprefix("is not a float (in ").removesuffix(")"))
    assert pid != os.getpid()


def test_another_failure_names_the_file_of_its_task():
    with pytest.raises(DumpProblems, match=r"x\.parquet: the worker reading it failed: "):
        list(ordered_here(operator.truediv, ["x.parquet"], name=str, jobs=2))


def test_analyze_with_workers_equals_one_process(run):
    """Exactly: every number of the document (a worker sums with one thread)."""
    assert _doc(run, jobs=2) == _doc(run, jobs=1)
    sample = ROOT / "data" / "long_collapse.parquet"
    assert _doc(sample, jobs=2) == _doc(sample, jobs=1)


def test_a_followed_runs_parts_with_workers_equal_one_process(run):
    def listed(jobs):
        found = parts(Dump(run), resolve_all(SETTINGS), max_tokens=PIECE, jobs=jobs, device="cpu")
        return [(path, p.step, p.tokens, p.mismatch.compute().tokens) for path, p in found]

    assert listed(2) == listed(1)


def test_the_workers_are_as_many_as_asked_and_the_pieces_allow(run):
    cpu = torch.device("cpu")
    dump = Dump(run)
    pieces = sum(len(dump.pieces(i, PIECE)) for i in range(len(dump.files)))
    assert pieces > 4
    assert worker_jobs(dump, 4, cpu, PIECE) == 4
    assert worker_jobs(dump, 10_000, cpu, PIECE) == pieces
    assert worker_jobs(dump, 1, cpu, PIECE) == 1
    assert worker_jobs(dump, None, cpu, PIECE) == min(default_jobs(), pieces)
    assert worker_jobs(dump, 4, torch.device("cuda"), PIECE) == 1  # the GPU is this process'
    assert worker_jobs(dump, 32, cpu, 10**9) == len(dump.files)  # one piece a file
    one = Dump(ROOT / "data" / "long_collapse.parquet")
    assert worker_jobs(one, 4, cpu, 10**9) == 1  # one piece: no worker to wait for
    upload = [("upload.parquet", (run / "step_000000" / "rank_0000.parquet").read_bytes())]
    memory = Dump.from_buffers(upload * 2)
    assert memory.in_memory and worker_jobs(memory, 4, cpu, PIECE) == 1  # no worker reads it
    for bad in (0, -2, 1.5, True, "2"):
        with pytest.raises(ConfigError, match="Expected argument `jobs` to be an int >= 1"):
            analyze(run, SETTINGS, jobs=bad)


def test_the_cli_takes_jobs_and_refuses_a_count_that_is_not_one(run, tmp_path, capsys):
    out = tmp_path / "a.json"
    args = [str(run), "--preset", "verl:decoupled_geo_rs", "--chunk-tokens", str(PIECE)]
    assert main(["analyze", *args, "--jobs", "2", "--json", str(out), "-q", "--no-cache"]) == 0
    alone = tmp_path / "b.json"
    assert main(["analyze", *args, "--jobs", "1", "--json", str(alone), "-q", "--no-cache"]) == 0
    assert json.loads(out.read_text())["settings"] == json.loads(alone.read_text())["settings"]
    with pytest.raises(SystemExit):
        main(["analyze", *args, "--jobs", "0"])
    assert "--jobs: expected a positive integer, but got '0'" in capsys.readouterr().err


def test_a_script_without_a_main_guard_analyzes_with_workers(run, tmp_path):
    script = tmp_path / "plain.py"
    script.write_text(
        "from iscore import analyze\n"
        "print('body')\n"
        f"a = analyze({str(run)!r}, ['verl:decoupled_geo_rs'], max_tokens={PIECE}, jobs=2)\n"
        "print(round(a.settings[0].lr_scale, 6))\n"
    )
    done = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.split()
    assert lines[0] == "body" and lines.count("body") == 1  # the body ran once, here
    expected = analyze(run, ["verl:decoupled_geo_rs"], max_tokens=PIECE, jobs=1)
    assert float(lines[1]) == round(expected.settings[0].lr_scale, 6)


def test_a_file_a_worker_cannot_read_is_named_as_one_process_names_it(run, tmp_path):
    good = run / "step_000000" / "rank_0000.parquet"
    data = bytearray(good.read_bytes())
    data[len(data) // 4 : len(data) // 2] = b"U" * (len(data) // 2 - len(data) // 4)
    bad = tmp_path / "bad.parquet"  # its footer whole, its pages not
    bad.write_bytes(bytes(data))
    messages = []
    for jobs in (1, 2):
        with pytest.raises(DumpProblems) as raised:
            analyze([bad, good], SETTINGS, max_tokens=PIECE, jobs=jobs)
        messages.append(str(raised.value))
    assert messages[0] == messages[1]
    assert messages[0].startswith(f"{bad}: corrupt data in row group 0")


def test_a_piece_does_not_parse_again_the_footer_its_dump_checked(run, tmp_path, monkeypatch):
    """A worker opening a piece is told the SHA-256 of the footer the driver checked; a file
    replaced since has another footer, which is checked."""
    from iscore.utils import footer

    path = tmp_path / "f.parquet"
    path.write_bytes((run / "step_000000" / "rank_0000.parquet").read_bytes())
    (piece,) = Dump(path).pieces(0, 10**9)
    assert len(piece.footer) == 64
    parsed = []
    real = footer._check
    monkeypatch.setattr(footer, "_check", lambda meta: parsed.append(1) or real(meta))
    assert piece.open().files[0].footer == piece.footer and parsed == []
    path.write_bytes((run / "step_000001" / "rank_0000.parquet").read_bytes())
    assert piece.open().files[0].footer != piece.footer and parsed == [1]
