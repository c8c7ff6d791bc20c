"""One pool of host threads for the kernels that split a flat range over cores (they release the
GIL). Chunks come from a shared counter, so a descheduled thread holds up at most one chunk, not
a static share. The caller is one of the threads."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def host_pool(workers: int) -> ThreadPoolExecutor:
    """The shared pool, grown to at least ``workers`` threads."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool._max_workers < workers:
            _pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="layerwise-host")
        return _pool


def run_split(fn: Callable[[int, int], None], n: int, threads: int, min_per_task: int,
              chunks_per_thread: int = 8, align: int = 1) -> None:
    """``fn(lo, hi)`` over ``[0, n)`` cut into chunks (edges multiples of ``align``), on up to
    ``threads`` threads, at least ``min_per_task`` items each; returns when every chunk is
    done (never while a worker still touches the caller's buffers)."""
    tasks = max(1, min(threads, n // max(min_per_task, 1)))
    if tasks == 1:
        fn(0, n)
        return
    chunks = max(tasks, min(n // max(min_per_task, 1), tasks * chunks_per_thread))
    units = -(-n // align)
    edges = sorted({min(n, units * i // chunks * align) for i in range(chunks)} | {n})
    counter = itertools.count()  # next() is atomic under the GIL

    def work() -> None:
        while (i := next(counter)) < len(edges) - 1:
            fn(edges[i], edges[i + 1])

    futures = [host_pool(tasks - 1).submit(work) for _ in range(tasks - 1)]
    try:
        work()
    finally:
        for fut in futures:
            fut.result()
