"""Following a run that is still being written: `iscore.passes.follow.Follower` and `iscore
watch`."""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from iscore.cli import main
from iscore.dump import Dump
from iscore.dump.simulate import SimConfig, write_run
from iscore.errors import IscoreError
from iscore.passes import follow
from iscore.passes.analysis import analyze
from iscore.passes.follow import Follower, ready_files
from iscore.passes.results_store import ResultStore
from iscore.utils.output import json_ready

SETTINGS = ["verl:decoupled_token_is", "skyrl:skyrl_geo_mask"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A finished run, 10 steps x 2 ranks, whose files a test copies in as they 'land'."""
    folder = tmp_path_factory.mktemp("source") / "run"
    config = SimConfig("moe_routing", sequences=16, steps=10, median_len=60, seed=3, grow_from=5)
    write_run(folder, config, ranks=2)
    return folder


def _land(source: Path, run: Path, step: int, ranks=(0, 1)) -> None:
    for rank in ranks:
        name = Path(f"step_{step:06d}") / f"rank_{rank:04d}.parquet"
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source / name, run / name)


def _trend(trend) -> str:
    return json.dumps(json_ready(trend.to_dict()), sort_keys=True)


def _fresh(run: Path) -> str:
    return _trend(analyze(Dump(run), SETTINGS).trend)


@pytest.mark.parametrize("stored", [False, True])
def test_new_steps_are_read_as_they_land_and_equal_a_fresh_analysis(source, tmp_path, stored):
    run = tmp_path / "run"
    run.mkdir()
    store = ResultStore(tmp_path / "cache") if stored else None
    follower = Follower(run, SETTINGS, store=store)
    empty = follower.poll()
    assert (empty.files, empty.rows, empty.trend.rows) == ((), (), ())
    for step in range(4):
        _land(source, run, step)
    first = follower.poll()
    assert [r["step"] for r in first.rows] == [0, 1, 2, 3] and len(first.files) == 8
    _land(source, run, 4)
    _land(source, run, 5, ranks=(0,))  # one rank of step 5 so far
    second = follower.poll()
    assert [r["step"] for r in second.rows] == [4, 5] and len(second.files) == 3
    _land(source, run, 5, ranks=(1,))  # the other rank: step 5 is computed again, whole
    third = follower.poll()
    assert [r["step"] for r in third.rows] == [5] and len(third.files) == 1
    assert follower.poll().files == ()  # nothing new
    assert _trend(follower.trend) == _fresh(run)
    for step in range(6, 10):
        _land(source, run, step)
    last = follower.poll()
    assert "growth" in [e.kind for e in last.events]
    assert _trend(follower.trend) == _fresh(run)


def test_a_file_still_being_written_is_skipped_until_whole(source, tmp_path):
    run = tmp_path / "run"
    _land(source, run, 0)
    name = run / "step_000001" / "rank_0000.parquet"
    data = (source / "step_000001" / "rank_0000.parquet").read_bytes()
    name.parent.mkdir()
    follower = Follower(run, SETTINGS)
    for part in (data[: len(data) // 2], data[:-1]):
        name.write_bytes(part)
        assert [r["step"] for r in follower.poll().rows] in ([0], [])
        assert name not in ready_files(run)
    name.write_bytes(data)
    assert [r["step"] for r in follower.poll().rows] == [1]


def test_kept_listings_still_see_files_that_land_or_change(source, tmp_path, monkeypatch):
    """A folder whose listing is kept (its time settled) is listed again when a file lands
    in it, and a file rewritten in place (its folder's time unchanged) is read again."""
    monkeypatch.setattr(follow, "SETTLED_NS", 0)  # every folder listed is kept
    run = tmp_path / "run"
    for step in range(3):
        _land(source, run, step, ranks=(0,))
    for folder in [run, *run.iterdir()]:
        os.utime(folder, ns=(10**18, 10**18))  # settled long ago
    follower = Follower(run, SETTINGS)
    assert [r["step"] for r in follower.poll().rows] == [0, 1, 2]
    _land(source, run, 1, ranks=(1,))
    assert [r["step"] for r in follower.poll().rows] == [1]
    path = run / "step_000002" / "rank_0000.parquet"
    shutil.copy(source / "step_000002" / "rank_0001.parquet", path)
    os.utime(path.parent, ns=(10**18, 10**18))
    assert [r["step"] for r in follower.poll().rows] == [2]
    assert follower.poll().files == ()
    assert _trend(follower.trend) == _fresh(run)


def test_a_run_opens_again_from_the_stored_rows(source, tmp_path):
    run = tmp_path / "run"
    for step in range(6):
        _land(source, run, step)
    Follower(run, SETTINGS, store=ResultStore(tmp_path / "cache")).poll()
    store = ResultStore(tmp_path / "cache")
    again = Follower(run, SETTINGS, store=store)
    update = again.poll()
    assert (update.files, update.rows, store.writes) == ((), (), 0)  # no file read
    assert _trend(again.trend) == _fresh(run)
    # A file rewritten in place: its step is computed again.
    path = run / "step_000002" / "rank_0001.parquet"
    shutil.copy(source / "step_000003" / "rank_0001.parquet", path)
    with pytest.raises(IscoreError, match="also in"):  # step 3's sequences, twice now
        analyze(Dump(run), SETTINGS, store=ResultStore(tmp_path / "cache"))
    os.remove(path)
    update = Follower(run, SETTINGS, store=ResultStore(tmp_path / "cache")).poll()
    assert [r["step"] for r in update.rows] == [2]
    # Stored rows that do not check out are not used.
    (memo,) = (tmp_path / "cache").rglob("runs/*.json")
    memo.write_text(memo.read_text()[:-20])
    store = ResultStore(tmp_path / "cache")
    assert len(Follower(run, SETTINGS, store=store).poll().rows) == 6


def test_a_missing_folder_is_named(tmp_path):
    with pytest.raises(IscoreError, match="expected a run's folder"):
        Follower(tmp_path / "nowhere").poll()


def _watch(*argv: str, **kwargs) -> subprocess.Popen:
    """`iscore watch` in a child process, with Ctrl-C's default disposition: a shell starts
    background jobs with SIGINT ignored, and children inherit that (the Ctrl-C test hung
    under `bash -c 'bash .ci/run' &`), where an interactive terminal's process has it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(
        [sys.executable, "-m", "iscore", "watch", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        **kwargs,
    )


def test_watch_exits_3_at_the_step_an_alert_first_holds(tmp_path):
    """A job writes a step every 0.3 s; broken sequences appear from step 6."""
    run = tmp_path / "run"
    config = SimConfig(
        sequences=24, steps=9, median_len=80, seed=8, broken_from=6, broken_share=0.1
    )
    watch = _watch(str(run.parent / "run"), "--interval", "0.1", "--no-cache",
                   "--alert", "broken_sequences > 0", "--exit-on-alert")  # fmt: skip
    run.mkdir()
    write_run(run / "job", config, every=0.3)
    out, err = watch.communicate(timeout=120)
    assert watch.returncode == 3, err
    lines = out.splitlines()
    assert lines[-1] == "alert: broken_sequences > 0 holds at step 6"
    steps = [
        int(line.split(":")[0].removeprefix("step ")) for line in lines if line.startswith("step ")
    ]
    assert steps == sorted(set(steps)) and steps[-1] >= 6 and 6 in steps
    assert "  broken_sequences from step 6: " in out


def test_watch_raises_its_default_alert_on_growth_unless_told_not_to(source, capsys):
    """The source run's noise grows from step 5: the growth event is a default alert."""
    assert main(["watch", str(source), "--once", "--no-cache"]) == 0
    out = capsys.readouterr().out
    (alert,) = [line for line in out.splitlines() if line.startswith("alert:")]
    assert alert.startswith("alert: growth of k3 from step ") and "(a default alert;" in alert
    assert main(["watch", str(source), "--once", "--no-cache", "--exit-on-alert"]) == 3
    capsys.readouterr()
    argv = ["watch", str(source), "--once", "--no-cache", "--exit-on-alert", "--no-default-alerts"]
    assert main(argv) == 0
    assert "alert:" not in capsys.readouterr().out


def test_watch_once_prints_a_line_per_step_and_ctrl_c_stops_it(source, tmp_path, capsys):
    run = tmp_path / "run"
    for step in range(3):
        _land(source, run, step)
    assert main(["watch", str(run), "--once", "--preset", "verl:decoupled_token_is"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["step 0", "step 1", "step 2"]
    assert "| decoupled_token_is: masked 0.00%, LR " in lines[0]
    (tmp_path / "empty").mkdir()
    watch = _watch(str(tmp_path / "empty"), "--interval", "0.2")
    # Interrupted once it waits on the empty folder (its first line says so).
    ready, _, _ = select.select([watch.stderr], [], [], 120)
    waiting = watch.stderr.readline() if ready else ""
    watch.send_signal(signal.SIGINT)
    out, err = watch.communicate(timeout=60)
    assert waiting == f"waiting for step files in {tmp_path / 'empty'} (Ctrl-C stops)\n"
    assert watch.returncode == 130 and out == ""
    assert err.splitlines() == ["watch: interrupted"]


def test_a_bad_alert_is_refused_before_anything_is_read(source, tmp_path, capsys):
    assert main(["watch", str(source), "--once", "--alert", "kk3 > 1"]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --alert: no column 'kk3'; the columns are step, tokens")
    assert main(["watch", str(source), "--once", "--alert", "avg(k3) > 1"]) == 2
    assert "judges each step on its own values" in capsys.readouterr().err


def test_watch_writes_tensorboard_scalars_under_the_frameworks_names(source, tmp_path, capsys):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    for step in range(3):
        _land(source, run, step)
    argv = ["watch", str(run), "--once", "--preset", "verl:decoupled_token_is"]
    assert main([*argv, "--tensorboard", str(tmp_path / "tb")]) == 0
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"iscore/k3", "iscore/decoupled_token_is_lr_scale", "verl/rollout_corr/k3_kl"} <= tags
    assert [e.step for e in events.Scalars("verl/rollout_corr/k3_kl")] == [0, 1, 2]
    k3 = [row["k3"] for row in analyze(Dump(run), []).mismatch.by_step]
    assert [e.value for e in events.Scalars("iscore/k3")] == pytest.approx(k3, rel=1e-6)


def test_tensorboard_missing_is_said_in_one_line(source, tmp_path, capsys, monkeypatch):
    for name in [m for m in sys.modules if m.split(".")[0] == "tensorboard"] + ["tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # `import tensorboard...` fails
    assert main(["watch", str(source), "--once", "--tensorboard", str(tmp_path / "tb")]) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line == (
        "error: --tensorboard needs the tensorboard package (TensorFlow is not needed): "
        "pip install 'iscore[tensorboard]'"
    )
