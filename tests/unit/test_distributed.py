"""The Ray engine (`iscore.utils.distributed`): analyze, sequences, recommend and watch on a local
Ray cluster equal one process (every number of analyze's document exactly, on the
bundled samples and a simulated run); a task that fails is named with its file;
RAY_ADDRESS joins a cluster, and without it a local one starts. Skipped where Ray is not
installed (the `ray` extra)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from iscore.advice.recommendation import recommend
from iscore.bench import goals
from iscore.bench.base import Run
from iscore.bench.cluster import ray_engine
from iscore.cli import main
from iscore.dump import Dump, StepRange, load
from iscore.dump.simulate import SimConfig, write_run
from iscore.errors import ConfigError, DumpError, DumpProblems
from iscore.frameworks.resolve import resolve_all
from iscore.passes.analysis import analyze
from iscore.passes.follow import Follower
from iscore.passes.results_store import ResultStore
from iscore.passes.sequences import sequence_table
from iscore.utils.distributed import Ready, check_engine, connect, ordered

ROOT = Path(__file__).resolve().parents[2]
SAMPLES = sorted((ROOT / "data").glob("*.parquet"))
SETTINGS = ["verl:decoupled_geo_rs_token_tis", "skyrl:skyrl_geo_mask", "nemo_rl:nemo_icepop"]
PIECE = 20_000
"""Tokens per task in these tests, so that a sample's steps are cut into several pieces."""


@pytest.fixture(scope="module")
def cluster():
    """A local Ray cluster of 2 CPUs for the module, shut down after it."""
    ray = pytest.importorskip("ray")
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("RAY_ADDRESS", raising=False)
        ray.init(num_cpus=2, include_dashboard=False, logging_level="WARNING")
        try:
            yield ray
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    """A simulated run: 6 steps x 2 ranks, broken sequences from step 4."""
    folder = tmp_path_factory.mktemp("ray") / "run"
    config = SimConfig(
        "moe_routing",
        sequences=24,
        steps=6,
        median_len=300,
        seed=4,
        broken_from=4,
        broken_share=0.2,
    )
    write_run(folder, config, ranks=2)
    return folder


def _numbers(value, path=""):
    """(path, leaf) of every leaf of a JSON document."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _numbers(item, f"{path}.{key}")
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _numbers(item, f"{path}[{i}]")
    else:
        yield path, value


def _assert_same(a: dict, b: dict) -> None:
    """Every leaf equal, floats exactly (NaN to NaN), though a Ray worker sums
    with one thread and this process with several."""
    left, right = dict(_numbers(a)), dict(_numbers(b))
    assert left.keys() == right.keys()
    for key, x in left.items():
        y = right[key]
        assert x == y or (x != x and y != y), (key, x, y)


def _doc(source, engine="local", **options) -> dict:
    analysis = analyze(source, SETTINGS, max_tokens=PIECE, engine=engine, **options)
    return json.loads(json.dumps(analysis.to_dict()))


def test_a_file_is_cut_between_steps_into_pieces_that_read_what_it_reads(tmp_path):
    """Cuts fall between row groups where every step before is below every step after (a
    step spanning two row groups is never cut); read in order, the pieces read the file."""
    steps = [[0, 0], [0, 1], [1, 1], [2, 2], [3, 3]]  # each row group's steps, a sequence each
    table = pa.table(
        {
            "step": [s for group in steps for s in group for _ in range(3)],
            "seq_id": [i for i in range(10) for _ in range(3)],
            "rollout_logprob": np.full(30, -1.0, np.float32),
            "train_logprob": np.full(30, -1.1, np.float32),
        }
    )
    path = tmp_path / "groups.parquet"
    pq.write_table(table, path, row_group_size=6)
    dump = Dump(path)
    assert [(p.steps, p.tokens) for p in dump.pieces(0, 1)] == [
        (StepRange(None, 1), 18),
        (StepRange(2, 2), 6),
        (StepRange(3, None), 6),
    ]
    assert [p.steps for p in dump.pieces(0, 7)] == [StepRange(None, 1), StepRange(2, None)]
    read = [b for p in dump.pieces(0, 1) for b in p.open().batches(None)]
    assert [b.seq_id.to_pylist() for b in read] == [[0, 1, 2, 3, 4, 5], [6, 7], [8, 9]]
    selected = Dump(path, steps=StepRange(2, 3))
    assert [p.steps for p in selected.pieces(0, 1)] == [StepRange(2, 2), StepRange(3, 3)]
    pq.write_table(table, path, row_group_size=6, write_statistics=False)
    assert [p.steps for p in Dump(path).pieces(0, 1)] == [StepRange()]  # no statistics


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.stem for p in SAMPLES])
def test_analyze_on_ray_equals_one_process_on_the_samples(cluster, sample):
    _assert_same(_doc(Dump(sample), "ray"), _doc(Dump(sample)))


def test_analyze_on_ray_equals_one_process_on_a_run(cluster, run):
    ray_doc = _doc(Dump(run), "ray")
    _assert_same(ray_doc, _doc(Dump(run)))
    assert [e["kind"] for e in ray_doc["trend"]["events"]] == ["broken_sequences"]


def test_expert_ids_and_turns_on_ray_equal_one_process(cluster, tmp_path):
    """The routing and turn-boundary attribution travels through the tasks' parts."""
    folder = tmp_path / "moe"
    config = SimConfig(
        "moe_routing",
        sequences=16,
        steps=3,
        median_len=300,
        seed=5,
        experts=2,
        routing_differ=0.1,
        routing_scale=3.0,
        turns=3,
        turn_scale=3.0,
    )
    write_run(folder, config, ranks=2)
    ray_doc = _doc(Dump(folder), "ray")
    _assert_same(ray_doc, _doc(Dump(folder)))
    assert "routing" in {f["kind"] for f in ray_doc["attribution"]["findings"]}


@pytest.mark.parametrize("layout", ["sequence", "token"])
def test_metadata_columns_on_ray_equal_one_process(cluster, tmp_path, layout):
    """The breakdown by replica and weight version, and the finding that names the noisy
    replica, travel through the tasks' parts in both layouts."""
    folder = tmp_path / layout
    config = SimConfig(
        sequences=32, steps=4, median_len=120, seed=6, replicas=4, noisy_replica=3, noisy_factor=6.0
    )
    write_run(folder, config, ranks=2, layout=layout)
    ray_doc = _doc(Dump(folder), "ray")
    _assert_same(ray_doc, _doc(Dump(folder)))
    assert [row["value"] for row in ray_doc["mismatch"]["by_replica"]] == [0, 1, 2, 3]
    findings = [f["summary"] for f in ray_doc["attribution"]["findings"]]
    assert any(m.startswith("replica 3: k3 ") for m in findings), findings


def test_a_selection_and_dropped_sequences_equal_one_process(cluster, run, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    victim = sorted(bad.rglob("*.parquet"))[3]
    table = pq.read_table(victim)
    rollout = table["rollout_logprob"].combine_chunks().to_pylist()
    rollout[0][5] = float("nan")
    table = table.set_column(
        table.schema.get_field_index("rollout_logprob"),
        "rollout_logprob",
        pa.array(rollout, table.schema.field("rollout_logprob").type),
    )
    pq.write_table(table, victim)
    options = {"steps": StepRange(1, 4), "where": "length > 200", "drop_invalid": True}
    here, there = Dump(bad, **options), Dump(bad, **options)
    _assert_same(_doc(there, "ray"), _doc(here))
    assert there.dropped == here.dropped and here.dropped.sequences == 1


def test_the_store_is_filled_by_ray_and_serves_both_engines(cluster, run, tmp_path):
    fresh = _doc(Dump(run))
    store = ResultStore(tmp_path / "cache")
    _assert_same(_doc(Dump(run), "ray", store=store), fresh)
    assert (store.reads, store.writes) == (0, 13)  # 6 steps x 2 ranks, and their merge
    # Served here from what Ray kept (computed on CPUs: the key's device): their merge, and
    # without it, each file's entry.
    again = ResultStore(tmp_path / "cache")
    served = _doc(Dump(run), store=again, device="cpu")
    assert served == _doc(Dump(run), "ray", store=ResultStore(again.folder))
    assert (again.reads, again.writes) == (1, 0)
    shutil.rmtree(again.root / "merged")
    files = ResultStore(tmp_path / "cache")
    assert _doc(Dump(run), store=files, device="cpu") == served
    assert (files.reads, files.writes) == (12, 1)
    # A setting added: each file's entry is read, and only the new setting computed on Ray.
    more = ResultStore(tmp_path / "cache")
    specs = [*SETTINGS, "trl:trl_default"]
    analysis = analyze(Dump(run), specs, max_tokens=PIECE, engine="ray", store=more)
    _assert_same(analysis.to_dict(), analyze(Dump(run), specs).to_dict())
    assert (more.reads, more.writes) == (13, 13)  # the merge, lacking the setting, too


def test_sequences_on_ray_equal_one_process(cluster, run):
    dump = Dump(run, where="k3 > 0", extras=True)
    local = sequence_table(Dump(run, where="k3 > 0", extras=True), SETTINGS, max_tokens=PIECE)
    table = sequence_table(dump, SETTINGS, max_tokens=PIECE, engine="ray")
    assert table.schema == local.schema and table.num_rows == local.num_rows > 0
    for name in table.column_names:
        a, b = table[name].to_numpy(zero_copy_only=False), local[name].to_numpy(False)
        if a.dtype.kind == "f":
            np.testing.assert_array_equal(a, b)
        else:
            assert (a == b).all(), name


@pytest.mark.parametrize("stored", [False, True])
def test_a_run_followed_on_ray_equals_one_process(cluster, run, tmp_path, stored):
    def store(name: str) -> ResultStore | None:
        return ResultStore(tmp_path / name) if stored else None

    here = Follower(run, SETTINGS, store=store("here")).poll()
    there = Follower(run, SETTINGS, store=store("there"), engine="ray").poll()
    assert there.files == here.files and len(there.rows) == 6
    _assert_same({"rows": list(there.rows)}, {"rows": list(here.rows)})


def test_the_cli_analyzes_queries_sequences_and_watches_on_ray(cluster, run, tmp_path, capsys):
    docs, counts, watched = {}, {}, {}
    for engine in ("local", "ray"):
        watch = ["watch", str(run), "--preset", SETTINGS[0], "--once", "--no-cache"]
        assert main([*watch, "--engine", engine]) == 0
        watched[engine] = capsys.readouterr().out
        out = tmp_path / f"{engine}.json"
        args = ["analyze", str(run), "--preset", SETTINGS[0], "--json", str(out), "-q"]
        assert main([*args, "--no-cache", "--engine", engine]) == 0
        docs[engine] = json.loads(out.read_text())
        capsys.readouterr()
        sql = "SELECT count(*) AS n, sum(length) AS t FROM sequences"
        assert main(["sequences", str(run), "--sql", sql, "--engine", engine, "-q"]) == 0
        counts[engine] = capsys.readouterr().out
    _assert_same(docs["ray"], docs["local"])
    assert counts["ray"] == counts["local"] and counts["ray"].startswith('"n","t"\n144,')
    assert watched["ray"] == watched["local"] and "step" in watched["ray"]


def test_a_dump_loaded_by_ray_tasks_is_the_same_batch_and_a_sequence_in_two_files_refused(
    cluster, run, tmp_path
):
    options = {"steps": StepRange(2, 5), "where": "length > 200"}
    assert Dump(run, **options).load(engine="ray").equal(Dump(run, **options).load())
    twice = tmp_path / "twice"
    shutil.copytree(run, twice)
    first = twice / "step_000003" / "rank_0000.parquet"
    shutil.copy(first, twice / "step_000003" / "rank_0002.parquet")
    for read in (
        lambda: Dump(twice).load(engine="ray"),
        lambda: sequence_table(Dump(twice), engine="ray"),
        lambda: analyze(Dump(twice), SETTINGS, engine="ray"),
    ):
        with pytest.raises(DumpError, match=r"rank_0002.parquet: sequence \(step 3, seq_id"):
            read()


def test_recommend_on_ray_equals_one_process(cluster, run, capsys):
    there = recommend(Dump(run), "skyrl", engine="ray")
    assert there.to_dict() == recommend(Dump(run), "skyrl").to_dict()
    outs = []
    for engine in ("local", "ray"):
        assert main(["recommend", str(run), "--framework", "verl", "-q", "--engine", engine]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and "best:" in outs[0]
    with pytest.raises(ConfigError, match="a loaded batch is used as it is"):
        recommend(load(SAMPLES[0]), "verl", engine="ray")


def test_the_bench_entry_times_both_engines_and_checks_they_agree(cluster):
    sample = SAMPLES[0]
    run = Run(sample, Dump(sample).num_tokens, tuple(resolve_all(SETTINGS)), PIECE, repeats=1)
    entry = ray_engine(run).entries["ray"]
    assert entry["agrees"] and entry["cpus"] == 2 and entry["task_s"] > 0
    (goal,) = goals.ray_vs_local({"ray": entry})
    assert goal["met"] == (entry["ratio"] <= 1.3)


def test_a_task_that_fails_is_named_with_its_file(cluster, run, tmp_path, capsys):
    """A file spoiled after the dump was opened (its footer read) fails in its task, and
    one with an invalid value: each error names the file as one process does, and the CLI
    lists it and exits as for any dump problem."""
    bad = tmp_path / "bad"
    shutil.copytree(run, bad)
    spoiled, invalid = sorted(bad.rglob("*.parquet"))[4:6]
    dump = Dump(bad)
    spoiled.write_bytes(b"PAR1 not a Parquet file any more PAR1")
    with pytest.raises(DumpProblems) as info:
        analyze(dump, SETTINGS, engine="ray")
    (problem,) = info.value.problems
    assert problem.file == str(spoiled)
    shutil.copy(run / spoiled.relative_to(bad), spoiled)
    table = pq.read_table(invalid)
    column = table.schema.get_field_index("rollout_logprob")
    rollout = table[column].combine_chunks().to_pylist()
    rollout[1][0] = 0.5
    table = table.set_column(
        column, table.field(column), pa.array(rollout, table.field(column).type)
    )
    pq.write_table(table, invalid)
    for engine in ("local", "ray"):
        assert main(["analyze", str(bad), "--no-cache", "-q", "--engine", engine]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[0] == err[2] == "1 problem:" and err[1] == err[3]
    assert str(invalid) in err[1] and "positive" in err[1]


def _crash_once(marker: str) -> str:
    """A task whose worker dies the first time it runs (a system failure, retried)."""
    if not os.path.exists(marker):
        Path(marker).touch()
        os._exit(1)
    return "done"


def _crash(_: str) -> str:
    os._exit(1)


def _raise(_: str) -> str:
    raise ZeroDivisionError("a bug")


def test_a_crashed_worker_is_retried_then_named(cluster, tmp_path):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    marker = str(tmp_path / "crashed")
    results = list(ordered(_crash_once, [marker, Ready("stored")], name=str, retries=1))
    assert results == [(marker, "done"), (Ready("stored"), "stored")]
    with pytest.raises(DumpProblems) as info:
        list(ordered(_crash, ["run/step_1.parquet"], name=str, retries=0))
    (problem,) = info.value.problems
    assert problem.file == "run/step_1.parquet"
    assert problem.message.startswith("the Ray task reading it failed 1 time: WorkerCrashed")
    with pytest.raises(DumpProblems) as info:
        list(ordered(_raise, ["run/step_2.parquet"], name=str))
    assert str(info.value) == (
        "run/step_2.parquet: the Ray task reading it failed: ZeroDivisionError: a bug"
    )


def test_what_the_ray_engine_refuses(tmp_path, monkeypatch):
    batch = load(SAMPLES[0])
    with pytest.raises(ConfigError, match="Expected argument `engine`"):
        analyze(batch, SETTINGS, engine="spark")
    with pytest.raises(ConfigError, match="a loaded batch is analyzed here"):
        analyze(batch, SETTINGS, engine="ray")
    with pytest.raises(ConfigError, match="workers' CPUs, but got device 'cuda'"):
        check_engine("ray", "cuda")
    monkeypatch.setitem(sys.modules, "ray", None)  # as where Ray is not installed
    with pytest.raises(ConfigError, match=r"pip install 'iscore\[ray\]'"):
        connect()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_ADDRESS = (
    "import os\n"
    "from iscore.utils.distributed import connect\n"
    "ray = connect()\n"
    "threads = ray.remote(lambda: os.environ.get('NUMBA_NUM_THREADS'))\n"
    "print(ray.get(threads.remote()), ray.get_runtime_context().gcs_address)\n"
)


@pytest.mark.slow
def test_ray_address_joins_a_cluster_and_without_it_a_local_one_starts():
    """In fresh processes (this one may hold a cluster): with RAY_ADDRESS where nothing
    answers, `connect` says so at once (Ray would wait without end); with RAY_ADDRESS, it
    joins the head it names; without it, it starts a cluster of its own, even beside a head
    running on this machine (which Ray itself would join). Either way a task's numba takes
    one thread (a task takes one CPU), whatever this process's NUMBA_NUM_THREADS."""
    pytest.importorskip("ray")
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    # The head and its clients agree without a token (Ray's default is a token for a head
    # started beside one in ~/.ray, and none for a client that joins it).
    env["RAY_AUTH_MODE"] = "disabled"
    env["NUMBA_NUM_THREADS"] = "2"  # as `iscore.packed.kernels` sets it in a process of 2 threads
    code = [sys.executable, "-c", _ADDRESS]
    nobody = subprocess.run(
        code, env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}, capture_output=True, text=True
    )
    assert nobody.returncode == 1
    assert f"Ray: cannot connect to '127.0.0.1:{port}' (RAY_ADDRESS)" in nobody.stderr
    # Ray's sockets live under its temp dir, and a socket's path holds 107 bytes at most:
    # pytest's tmp_path is too deep.
    temp = tempfile.mkdtemp(prefix="iscore-ray-")
    ray_bin = Path(sys.executable).with_name("ray")
    start = [str(ray_bin), "start", "--head", "--block", f"--port={port}", "--num-cpus=1"]
    head = subprocess.Popen(
        [*start, "--include-dashboard=false", f"--temp-dir={temp}"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its processes in a group of their own, stopped below
    )
    try:
        for _ in range(600):  # until the head listens (a minute at most)
            assert head.poll() is None, "ray start --head exited"
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.1)
        joined = subprocess.run(
            code,
            env={**env, "RAY_ADDRESS": f"127.0.0.1:{port}"},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert joined.returncode == 0, joined.stderr
        assert joined.stdout.split()[-2:][0] == "1"
        assert joined.stdout.split()[-1].endswith(f":{port}")
        alone = subprocess.run(code, env=env, capture_output=True, text=True, timeout=120)
        assert alone.returncode == 0, alone.stderr
        assert alone.stdout.split()[-2:][0] == "1"
        assert not alone.stdout.split()[-1].endswith(f":{port}")
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        head.wait(timeout=60)
        shutil.rmtree(temp, ignore_errors=True)
