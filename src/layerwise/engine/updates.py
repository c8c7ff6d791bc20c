"""The host side of a step's end: per-unit optimizer updates on worker threads.

Submitted after the backward (embed first: the next forward needs it first), overlapping the next
forward; the streamer asks ``wait``/``done`` before copying a unit. No update zeroes a gradient:
the next step's first landing overwrites it. ``times`` keeps each update's start and end for the
overlap tests and benchmarks read."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from ..optim.adamw import UnitOptimizer
from ..store import HostStore
from .reduce import StepReducer


class HostUpdates:
    def __init__(self, store: HostStore, optimizers: dict[str, UnitOptimizer],
                 reducer: StepReducer, threads: int, initializer: Callable[[], None] | None = None):
        """``initializer``: run by each worker thread as it starts (its CPU mask)."""
        self.store = store
        self.optimizers = optimizers
        self.reducer = reducer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="optim", initializer=initializer)
        self.times: dict[str, tuple[float, float]] = {}
        """Unit -> (start, end) of its latest update, ``time.perf_counter()`` seconds."""
        self._pending: dict[str, Future] = {}
        """This process's updates not yet waited on, by unit."""

    def submit(self, lr: float, coef: float) -> None:
        """Start the step's updates with clip factor ``coef``. The caller guarantees every
        weight copy of the step has completed (the host weights may be overwritten)."""
        self.reducer.begin_updates()
        # embed first: the next forward needs it first; frozen units (a LoRA run's embedding and
        # head) have nothing to update; another owner's are reduced there, this rank's part spent
        mine = [b.name for b in self.store if self.reducer.owns(b.name) and b.layout.numel]
        if self.store.state_tier is not None:
            self.store.state_tier.prefetch(mine)
        for unit in mine:
            self._pending[unit] = self._pool.submit(self._update, unit, lr, coef)

    def _update(self, unit: str, lr: float, coef: float) -> None:
        t0 = time.perf_counter()
        buf = self.store[unit]
        with self.store.staged(unit, write=True, flush=True):
            self.optimizers[unit].step_unit(buf, lr, coef)
            buf.refresh_compute()
        self.times[unit] = (t0, time.perf_counter())
        self.reducer.published(unit)

    def _elsewhere(self, unit: str) -> bool:
        """Is ``unit`` updated by another rank? (A frozen unit is updated by none: its owner
        never publishes.)"""
        return not self.reducer.owns(unit) and bool(self.store[unit].layout.numel)

    def wait(self, unit: str) -> None:
        """Block until ``unit``'s host weights are final (raises what its update raised)."""
        if self._elsewhere(unit):
            self.reducer.update_done(unit, wait=True)
            return
        fut = self._pending.pop(unit, None)
        if fut is not None:
            fut.result()

    def done(self, unit: str) -> bool:
        """Are ``unit``'s host weights final? (Never blocks, but raises a finished update's error.)"""
        if self._elsewhere(unit):
            return self.reducer.update_done(unit, wait=False)
        fut = self._pending.get(unit)
        if fut is None:
            return True
        if not fut.done():
            return False
        self.wait(unit)  # surfaces an error the update raised
        return True

    def wait_all(self) -> None:
        """Every unit's update, this process's and (data parallel) the other owners'."""
        self.wait_own()
        for buf in self.store:
            self.wait(buf.name)

    def wait_own(self) -> None:
        """This process's updates only: on the way out of a failed step or at close, another
        rank's update may never come (that rank is why we are failing)."""
        for unit in list(self._pending):
            self._pending.pop(unit).result()

    def close(self) -> None:
        self.wait_own()
        self._pool.shutdown(wait=True)
