"""How a long pass streams: the next chunk read in a background thread while this one is
analyzed (`prefetched`), and the resident memory kept near that of the first chunks
(`HeapGuard`)."""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Iterable, Iterator

from iscore.packed import TokenBatch


class HeapGuard:
    """Keeps a long stream's resident memory near that of its first chunks.

    Each chunk frees hundreds of MB of temporaries around the few small arrays the
    accumulators keep; glibc's heap then fragments and the resident size creeps up (~10 MB
    per million tokens streamed, none of it live). When it exceeds 1.2x what it was after the
    first chunks, `malloc_trim` hands the free pages back (a few ms; doing it every chunk
    would cost 15% in page faults). A no-op where glibc or /proc is missing.
    """

    def __init__(self) -> None:
        self.chunks = 0
        self.baseline = 0
        try:
            self.trim = ctypes.CDLL("libc.so.6").malloc_trim
            self.page = os.sysconf("SC_PAGE_SIZE")
        except (OSError, AttributeError, ValueError):
            self.trim = None

    def resident(self) -> int:
        with open("/proc/self/statm") as statm:
            return int(statm.read().split()[1]) * self.page

    def check(self) -> None:
        if self.trim is None:
            return
        self.chunks += 1
        try:
            rss = self.resident()
        except OSError:
            self.trim = None
            return
        if self.chunks <= 3:
            self.baseline = max(self.baseline, rss)
        elif rss > 1.2 * self.baseline:
            self.trim(0)


def prefetched(chunks: Iterable[TokenBatch]) -> Iterator[TokenBatch]:
    """The chunks, read one ahead in a background thread: Parquet decoding (which releases
    the GIL) overlaps the replay of the previous chunk. Errors are raised in the caller."""
    if isinstance(chunks, list):
        yield from chunks
        return
    ready: queue.Queue = queue.Queue(maxsize=1)
    stop = threading.Event()
    done = object()

    def read() -> None:
        try:
            for chunk in chunks:
                while not stop.is_set():
                    try:
                        ready.put((chunk, None), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            ready.put((done, None))
        except BaseException as e:  # handed to the consumer, which re-raises it
            ready.put((done, e))

    thread = threading.Thread(target=read, name="iscore-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            chunk, error = ready.get()
            if error is not None:
                raise error
            if chunk is done:
                return
            yield chunk
    finally:
        stop.set()
        while thread.is_alive():
            try:  # unblock a producer waiting on a full queue
                ready.get_nowait()
            except queue.Empty:
                thread.join(timeout=0.1)
