"""Work spread over a Ray cluster: `--engine ray` (`engine="ray"` in Python) of `analyze`,
`sequences`, `recommend` (its dump read, `Dump.load`) and `watch` (docs/performance.md#ray).

The caller cuts its work into tasks (for a dump: its files, and a large file into ranges of its
steps, `Dump.pieces`); each task runs a module-level function of iscore on a worker and returns
plain values (for an analysis, the accumulators' states of each part, as the results store
keeps them; for a load, the piece's batch). `ordered` hands the results back in the order of
the tasks, so the caller merges them exactly as one process would, and keeps at most a window
of tasks in flight or waiting to be merged: the driver holds a window's results, never a
run's.

A task that fails for the system's sake (its worker or node died, its result was lost) is run
again, `RETRIES` times; one that raises is not (a dump's problem is the same the second
time). Either is reported naming the file of the task, as a dump problem.

Ray is optional (`pip install 'iscore[ray]'`) and imported when a command first asks for it.
`RAY_ADDRESS` names a cluster to join; without it a local one starts (every core, Ray's
default) and serves the process's later calls; a process that started Ray itself
(`ray.init(...)`) keeps its own.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from importlib.metadata import version
from types import ModuleType
from typing import Any, Literal

from iscore.errors import ConfigError, DumpProblems, IscoreError, Problem, clip, counted, quote

ENGINES = ("local", "ray")
"""Where commands compute: in this process, or on a Ray cluster."""

Engine = Literal["local", "ray"]

RETRIES = 3
"""How many times a task whose worker or node failed is run again."""


def check_engine(engine: str, device: object = None) -> None:
    """Refuse an engine that is not one of `ENGINES`, and a device other than the CPU for
    the Ray engine (its workers compute on their CPUs).

    >>> check_engine("spark")
    Traceback (most recent call last):
    iscore.errors.ConfigError: Expected argument `engine` to be 'local' or 'ray', but got 'spark'
    """
    if engine not in ENGINES:
        raise ConfigError(
            f"Expected argument `engine` to be 'local' or 'ray', but got {quote(engine)}"
        )
    if engine == "ray" and device is not None and str(device).partition(":")[0] != "cpu":
        raise ConfigError(
            f"the Ray engine computes on its workers' CPUs, but got device "
            f"{quote(str(device))}; leave the device out, or use engine='local'"
        )


def connect() -> ModuleType:
    """Ray, connected: to the cluster this process already joined, else to `RAY_ADDRESS`,
    else to a local cluster started now.

    Raises:
        ConfigError: Ray is not installed.
        IscoreError: the cluster cannot be reached (one line, naming the address).
    """
    try:
        import ray  # here: Ray is an optional dependency, and takes a second to import
    except ImportError:
        raise ConfigError(
            "the Ray engine needs Ray, which is not installed: pip install 'iscore[ray]'"
        ) from None
    if ray.is_initialized():
        return ray
    address = os.environ.get("RAY_ADDRESS") or "local"
    # "local" always starts a cluster: without an address Ray would join the last one
    # started on this machine, which may be anyone's.
    options: dict[str, Any] = {"include_dashboard": False} if address == "local" else {}
    # A task takes one CPU (`_remote`): its numba one thread. Without this, a cluster
    # started here would inherit the NUMBA_NUM_THREADS that `iscore.packed.kernels` set for this
    # process, and two one-CPU workers on two cores would run at half speed.
    options["runtime_env"] = {"env_vars": {"NUMBA_NUM_THREADS": "1"}}
    _answers(address)
    try:
        ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, **options)
    except (ConnectionError, RuntimeError, ValueError) as e:
        raise IscoreError(f"Ray: cannot connect to {quote(address)}: {_one_line(e)}") from e
    return ray


def _answers(address: str) -> None:
    """Refuse a cluster's `host:port` where nothing answers (Ray would wait for it without
    end); other addresses ("local", "auto", "ray://...") are left to Ray.

    Raises:
        IscoreError: nothing listens there, or the host is unknown.
    """
    host, _, port = address.rpartition(":")
    if not host or "://" in address or not port.isdigit():
        return
    try:
        socket.create_connection((host, int(port)), timeout=10).close()
    except OSError as e:
        raise IscoreError(
            f"Ray: cannot connect to {quote(address)} (RAY_ADDRESS): nothing answers there "
            f"({e.strerror or e}); start the cluster's head (`ray start --head`), or unset "
            "RAY_ADDRESS for a local cluster"
        ) from None


@dataclass(frozen=True, slots=True)
class Ready:
    """A result the driver already has (from the results store), handed back by `ordered`
    in its place among the tasks' results."""

    value: Any


def ordered(
    fn: Callable[[Any], Any],
    work: Iterable[Any],
    *,
    name: Callable[[Any], str],
    done: Callable[[Any, Any], None] | None = None,
    window: int | None = None,
    retries: int = RETRIES,
) -> Iterator[tuple[Any, Any]]:
    """Run `fn(task)` on the cluster for each task of `work`, yielding `(task, result)` in
    the order of `work` (a `Ready` item is yielded as `(item, item.value)` in its place).

    Args:
        fn: a module-level function of iscore (workers import it by name), one CPU each.
        work: the tasks, taken lazily: only as many as the window has room for.
        name: the file a task reads, for messages.
        done: called with `(task, result)` as each task finishes, in the order they finish
            (progress).
        window: the most tasks in flight or waiting to be yielded; default twice the
            cluster's CPUs.
        retries: runs again of a task whose worker or node failed.

    Raises:
        IscoreError: a task raised one (the dump's problem, as one process raises it).
        DumpProblems: a task raised anything else, or failed `retries` + 1 times, naming
            its file.
    """
    ray = connect()
    remote = _remote(ray, retries)
    if window is None:
        window = max(2, 2 * int(ray.cluster_resources().get("CPU", 1)))
    expected = _version()
    queue: deque[_Slot] = deque()
    running: dict[Any, _Slot] = {}
    items = iter(work)
    more = True
    try:
        while True:
            while more and len(queue) < window:
                item = next(items, _END)
                if item is _END:
                    more = False
                    break
                slot = _Slot(item)
                if isinstance(item, Ready):
                    slot.value, slot.done = item.value, True
                else:
                    running[remote.remote(fn, expected, item)] = slot
                queue.append(slot)
            if not queue:
                return
            while not queue[0].done:
                finished, _ = ray.wait(list(running), num_returns=1)
                for ref in finished:
                    slot = running.pop(ref)
                    slot.value, slot.done = _fetch(ray, ref, name(slot.item), retries), True
                    if done is not None:
                        done(slot.item, slot.value)
            slot = queue.popleft()
            yield slot.item, slot.value
    finally:
        for ref in running:  # after a failure or an interrupt: no work left running
            ray.cancel(ref)


_END = object()


class _Slot:
    """A task's place in `ordered`'s window: its result once it is done."""

    __slots__ = ("done", "item", "value")

    def __init__(self, item: Any):
        self.item = item
        self.value: Any = None
        self.done = False


@functools.cache
def _version() -> str:
    return version("iscore")


def _run(fn: Callable[[Any], Any], expected: str, task: Any) -> Any:
    """A task, on a worker: `fn(task)`, by a worker that runs the driver's iscore."""
    here = _version()
    if here != expected:
        raise IscoreError(
            f"the Ray worker on {socket.gethostname()} runs iscore {here}, the driver "
            f"{expected}; install the same iscore on every node"
        )
    return fn(task)


@functools.cache
def _remote(ray: ModuleType, retries: int) -> Any:
    return ray.remote(num_cpus=1, max_retries=retries, retry_exceptions=False)(_run)


def _fetch(ray: ModuleType, ref: Any, name: str, retries: int) -> Any:
    """A finished task's result, or its failure as iscore reports dump problems."""
    try:
        return ray.get(ref)
    except ray.exceptions.RayTaskError as e:
        if isinstance(e.cause, IscoreError):
            raise e.cause from None
        what = f"the Ray task reading it failed: {type(e.cause).__name__}: {_one_line(e.cause)}"
    except ray.exceptions.RayError as e:  # the worker or node died, the result was lost
        what = (
            f"the Ray task reading it failed {counted(retries + 1, 'time')}: "
            f"{type(e).__name__}: {_one_line(e)}"
        )
    raise DumpProblems([Problem(name, None, what)])


def _one_line(error: BaseException) -> str:
    """The first line of an error's message, clipped (Ray's run to dozens of lines)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return clip(lines[0] if lines else type(error).__name__, 300)
