"""Work spread over this machine's cores (`--engine local --jobs N`): worker processes, each
computing with one thread, fed tasks the way `iscore.utils.distributed` feeds a Ray cluster
and handing their results back in the order of the tasks.

A worker is a fresh Python process, loky's (joblib's process pool): spawned, not forked (a
fork of a process that ran torch's or numba's thread pools may hang), and without running the
caller's script again (a script needs no `if __name__ == "__main__":` guard). Its environment
says, before it imports torch, numba or Arrow, to use one thread each, so that N workers use N
cores and no more (docs/performance.md#every-core). The pool is made on first use and kept for
`IDLE_S` seconds after its last task (an app's analyses pay its start once); a pool a worker's
death broke is made anew by the next call.

>>> list(ordered_here(abs, [-1, Ready(5), -3], name=str, jobs=2))  # doctest: +SKIP
[(-1, 1), (Ready(value=5), 5), (-3, 3)]
"""

from __future__ import annotations

import concurrent.futures as cf
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import loky

from iscore.errors import DumpProblems, IscoreError, Problem, clip
from iscore.utils.distributed import Ready

WORKER_ENV = {
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    # loky restarts a worker that grew 300 MB since it started, taking it for a leak; a
    # worker holds a chunk of up to `max_tokens` tokens and its accumulators, bounded by the
    # analysis itself.
    "LOKY_MAX_MEMORY_LEAK_SIZE": str(1 << 62),
}
"""A worker's environment from its start, before it imports anything that starts threads:
one thread each."""

IDLE_S = 300
"""Seconds an idle pool's workers wait for the next task before they exit."""


def cores() -> int:
    """The cores this process may run on (its affinity, where the system tells it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def default_jobs() -> int:
    """Workers a local analysis uses by default: every core on a machine of more than two,
    else none (one process: on two cores its torch threads already use both)."""
    n = cores()
    return n if n > 2 else 1


def _one_thread() -> None:
    """A worker's start: one thread for torch and Arrow (its environment, `WORKER_ENV`, said
    so to numba, OpenMP and BLAS)."""
    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)


def pool(jobs: int) -> cf.Executor:
    """The pool of `jobs` workers: the one kept, made anew where it has another size or
    broke."""
    return loky.get_reusable_executor(
        max_workers=jobs, timeout=IDLE_S, initializer=_one_thread, env=WORKER_ENV
    )


def ordered_here(
    fn: Callable[[Any], Any],
    work: Iterable[Any],
    *,
    name: Callable[[Any], str],
    jobs: int,
    done: Callable[[Any, Any], None] | None = None,
    window: int | None = None,
) -> Iterator[tuple[Any, Any]]:
    """Run `fn(task)` in `jobs` worker processes for each task of `work`, yielding
    `(task, result)` in the order of `work` (a `Ready` item as `(item, item.value)` in its
    place), as `iscore.utils.distributed.ordered` does on a cluster. While the workers start,
    this process runs the first tasks itself.

    Args:
        fn: a module-level function of iscore (workers import it by name).
        work: the tasks, taken lazily: only as many as the window has room for.
        name: the file a task reads, for messages.
        jobs: worker processes.
        done: called with `(task, result)` as each task finishes (progress).
        window: the most tasks in flight or waiting to be yielded; default twice `jobs`.

    Raises:
        IscoreError: a task raised one (the dump's problem, as one process raises it).
        DumpProblems: a task raised anything else, or its worker died, naming its file.
    """
    executor = pool(jobs)
    window = window or 2 * jobs
    queue: deque[tuple[Any, cf.Future | None]] = deque()
    told: set[cf.Future] = set()  # the finished tasks `done` was called with

    def tell(item: Any, future: cf.Future) -> None:
        told.add(future)
        if done is not None and future.exception() is None:
            done(item, future.result())

    items = iter(work)
    # Until a worker is up (a cold one imports torch: seconds), this process takes the tasks.
    starting = [executor.submit(os.getpid) for _ in range(jobs)]
    cf.wait(starting, timeout=0.1, return_when=cf.FIRST_COMPLETED)
    while not any(f.done() for f in starting):
        item = next(items, _END)
        if item is _END:
            return
        if isinstance(item, Ready):
            yield item, item.value
            continue
        value = _here(fn, item, name(item))
        if done is not None:
            done(item, value)
        yield item, value
    more = True
    try:
        while True:
            while more and len(queue) < window:
                item = next(items, _END)
                if item is _END:
                    more = False
                    break
                queue.append((item, None if isinstance(item, Ready) else executor.submit(fn, item)))
            if not queue:
                return
            item, future = queue.popleft()
            if future is None:
                yield item, item.value
                continue
            while not future.done():
                running = {f: i for i, f in [(item, future), *queue] if f and f not in told}
                finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for f in finished:
                    tell(running[f], f)
            if future not in told:
                tell(item, future)
            told.discard(future)
            yield item, _result(future, name(item))
    finally:
        for _, future in queue:  # after a failure or an interrupt: no work left running
            if future is not None:
                future.cancel()


_END = object()


def _here(fn: Callable[[Any], Any], task: Any, name: str) -> Any:
    """`fn(task)` run in this process, failing as a worker's task does (`_result`)."""
    try:
        return fn(task)
    except IscoreError:
        raise
    except Exception as e:
        what = f"the worker reading it failed: {type(e).__name__}: {clip(str(e), 300)}"
        raise DumpProblems([Problem(name, None, what)]) from e


def _result(future: cf.Future, name: str) -> Any:
    """A finished task's result, or its failure as iscore reports dump problems."""
    try:
        return future.result()
    except IscoreError:
        raise
    except (loky.process_executor.BrokenProcessPool, cf.BrokenExecutor) as e:
        what = f"the worker process reading it died ({clip(str(e), 200)})"
    except Exception as e:  # what a task raised, carried back from its worker
        what = f"the worker reading it failed: {type(e).__name__}: {clip(str(e), 300)}"
    raise DumpProblems([Problem(name, None, what)])
