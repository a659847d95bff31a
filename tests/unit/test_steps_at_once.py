"""`analysis.STEP_THREADS`: runs of steps computed two at a time in threads give the
analysis, byte for byte, that one at a time gives, straight from the dump and through a
results store, on both kernel paths; parts come in the dump's order; a failing step raises
what it raises one at a time, the first failing step's error first."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from iscore import analysis, kernels
from iscore.analysis import analyze, parts
from iscore.bench.base import SETTINGS
from iscore.dump import Dump
from iscore.settings import resolve
from iscore.simulate import SimConfig, write_simulated
from iscore.store import ResultStore


@pytest.fixture(scope="module")
def dump(tmp_path_factory):
    path = tmp_path_factory.mktemp("steps") / "run.parquet"
    config = SimConfig("moe_routing", sequences=16, steps=9, median_len=300, seed=11)
    write_simulated(path, config, layout="token")
    return path


@pytest.fixture(autouse=True)
def _two_torch_threads():
    """Steps go to threads only where torch has more than one (not in a Ray task)."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _document(source, store=None) -> str:
    specs = [resolve(s) for s in SETTINGS]
    return json.dumps(analyze(source, specs, store=store).to_dict(), sort_keys=True)


@pytest.mark.parametrize("mode", ["numba", "reference"])
def test_two_steps_at_a_time_give_what_one_at_a_time_gives(dump, mode, monkeypatch, tmp_path):
    if mode == "numba" and not kernels.available():
        pytest.skip("numba is not installed")
    monkeypatch.setenv(kernels.ENV, mode)
    at_once = _document(str(dump))
    stored = _document(str(dump), ResultStore(tmp_path / "a"))
    again = _document(str(dump), ResultStore(tmp_path / "a"))  # from what the store kept
    monkeypatch.setattr(analysis, "STEP_THREADS", 1)
    alone = _document(str(dump))
    alone_stored = _document(str(dump), ResultStore(tmp_path / "b"))
    assert at_once == alone
    assert stored == alone_stored == again == alone


def test_parts_come_in_the_order_of_the_dump(dump, monkeypatch):
    """Later steps finishing first (the first step slowed down) are handed back after it;
    no more than `STEP_THREADS` steps beyond the last handed back are started (memory)."""
    analyzed = analysis._analyzed
    started: list[int] = []

    def slow_first(run, step, *args):
        started.append(step)
        if step == 0:
            time.sleep(0.2)
        return analyzed(run, step, *args)

    monkeypatch.setattr(analysis, "_analyzed", slow_first)
    steps = []
    for _, part in parts(Dump(str(dump)), [resolve(SETTINGS[0])]):
        steps.append(part.step)
        assert max(started) <= part.step + analysis.STEP_THREADS
    assert steps == list(range(9))


def test_the_first_failing_step_raises_first(dump, monkeypatch):
    """Steps 3 and 4 fail, 4 at once and 3 late: step 3's error is raised, as it is one at
    a time, and no thread is left running."""
    analyzed = analysis._analyzed

    def failing(run, step, *args):
        if step == 3:
            time.sleep(0.2)
        if step in (3, 4):
            raise ValueError(f"step {step} failed")
        return analyzed(run, step, *args)

    monkeypatch.setattr(analysis, "_analyzed", failing)
    with pytest.raises(ValueError, match="step 3 failed"):
        analyze(str(dump), SETTINGS[:1])
    time.sleep(0.05)
    assert not [t for t in threading.enumerate() if t.name.startswith("iscore-step")]


def test_one_torch_thread_or_a_sequence_table_computes_one_step_at_a_time(monkeypatch):
    """A Ray task (torch on one thread) gains nothing from a second thread, and a sequence
    table fills in the order the steps come."""

    def threads(device: str, alone: bool = False) -> bool:
        with analysis._Ahead(torch.device(device), alone) as ahead:
            return ahead.pool is not None

    assert threads("cpu")
    assert not threads("cpu", alone=True)
    assert not threads("meta")
    torch.set_num_threads(1)
    assert not threads("cpu")
