"""How many host threads land gradients and run the optimizer, and on which CPUs.

On a GPU the launching thread sets the device's pace (a layer is hundreds of launches), so one
CPU is left to it and the landing and optimizer threads (and all they start) run on the other
``W = C - 1``: a landing split over ``min(W, MAX_LANDING_THREADS)`` threads (the bus saturates
first), ``optimizer_threads`` units at once with ``W // optimizer_threads`` intra-op threads
each. Landing and updates are busy at different times, so they share the ``W`` CPUs. On the CPU
backends compute needs every core: nothing is pinned."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

MAX_LANDING_THREADS = 8
"""Most threads one gradient landing is split over."""


@dataclass(frozen=True)
class HostThreads:
    landing: int
    """Threads one gradient landing is split over (the landing thread is one of them)."""
    optimizer_intra: int | None
    """Intra-op threads of each optimizer update (None: torch's setting is left alone)."""
    worker_cpus: frozenset[int] | None
    """CPUs the host workers run on (None: wherever the OS puts them)."""

    def pin_current_thread(self) -> None:
        """Run by each host worker thread as it starts (threads it starts inherit the mask)."""
        if self.worker_cpus is not None:
            os.sched_setaffinity(0, self.worker_cpus)  # Linux: pid 0 is the calling thread

    @property
    def initializer(self) -> Callable[[], None]:
        return self.pin_current_thread


def process_cpus() -> frozenset[int] | None:
    """The CPUs this process may run on (None where the OS does not say)."""
    getter = getattr(os, "sched_getaffinity", None)
    return frozenset(getter(0)) if getter is not None else None


def plan_host_threads(device_type: str, optimizer_threads: int,
                      cpus: frozenset[int] | None = None) -> HostThreads:
    """The host thread layout for a device type (``cuda``: one CPU left to the launcher)."""
    if device_type != "cuda":
        return HostThreads(landing=1, optimizer_intra=None, worker_cpus=None)
    cpus = process_cpus() if cpus is None else cpus
    count = len(cpus) if cpus else (os.cpu_count() or 1)
    if cpus is not None and count >= 2:
        worker_cpus = frozenset(sorted(cpus)[:-1])  # the last CPU is left to the launcher
        workers = count - 1
    else:  # one CPU (or unknown): nothing to leave free
        worker_cpus, workers = None, count
    return HostThreads(landing=max(1, min(workers, MAX_LANDING_THREADS)),
                       optimizer_intra=max(1, workers // max(1, optimizer_threads)),
                       worker_cpus=worker_cpus)
