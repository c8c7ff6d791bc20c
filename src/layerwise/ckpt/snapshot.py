"""Deferred snapshots: a save's statistics and copies taken on a helper thread while the loop
runs forward and backward, the next update held back until they are taken. Where the provider
cannot hold updates back, or the state is off the CPU, ``capture`` returns None (take it sync)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from typing import Any, TypeVar

from .provider import StateProvider
from .tracker import LiveGroup

SNAPSHOT_MODES = ("auto", "sync", "deferred")

T = TypeVar("T")


class UpdateGate:
    """Holds the next update of the live state back while a helper thread still reads it."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._readers: list[Callable[[float], None]] = []

    def enter(self, on_stall: Callable[[float], None]) -> Callable[[], None]:
        """A reader starts; ``on_stall(seconds)`` is told how long an update waited for it.
        Returns the call that ends the read."""
        with self._cv:
            self._readers.append(on_stall)

        def leave() -> None:
            with self._cv:
                self._readers.remove(on_stall)
                self._cv.notify_all()
        return leave

    def wait(self) -> None:
        """Called before an update: returns once no reader is left; the wait is charged to the
        newest reader (a save queued after an observation waits for both)."""
        with self._cv:
            if not self._readers:
                return
            charge, t0 = self._readers[-1], time.perf_counter()
            while self._readers:
                self._cv.wait()
        charge(time.perf_counter() - t0)


class DeferredStats(Mapping):
    """``observe``'s statistics while the helper thread takes them; reading waits for them."""

    def __init__(self, future: Future):
        self._future = future

    def __getitem__(self, group: str) -> dict[str, float]:
        return self._future.result()[group]

    def __iter__(self) -> Iterator[str]:
        return iter(self._future.result())

    def __len__(self) -> int:
        return len(self._future.result())


class DeferredSnapshots:
    """The helper thread and the update hook that waits for it. ``mode``: ``"sync"`` never defers,
    ``"auto"`` where it can, ``"deferred"`` refuses a setup where it cannot."""

    def __init__(self, provider: StateProvider, groups: list[str], mode: str, async_save: bool,
                 world_size: int):
        if mode not in SNAPSHOT_MODES:
            raise ValueError(f"snapshot must be one of {SNAPSHOT_MODES} (got {mode!r})")
        if mode == "deferred" and world_size > 1:
            raise ValueError("snapshot='deferred' is for saves written by one process; with "
                             "several writers (exchange=) use snapshot='auto' or 'sync'")
        self.provider, self.groups, self.mode = provider, groups, mode
        self._gate = UpdateGate()
        self._reads: list[Future] = []  # deferred observations in flight
        register = getattr(provider, "register_update_hook", None)
        self._hook: Any = None
        if mode != "sync" and async_save and register is not None and world_size == 1:
            self._hook = register(self._gate.wait)
        if self._hook is None and mode == "deferred":
            raise ValueError(
                "snapshot='deferred' needs async_save=True and a provider that can hold the "
                "next update back (a model with its torch optimizer); use snapshot='sync'")
        self._helper = (ThreadPoolExecutor(1, thread_name_prefix="ckpt-snapshot")
                        if self._hook is not None else None)

    def capture(self, grads: bool) -> dict[str, LiveGroup] | None:
        """References to every group's live tensors (and their versions) for a deferred read,
        or None when this read must be synchronous (no helper, or state off the CPU)."""
        if self._helper is None:
            return None
        live = {g: LiveGroup.capture(self.provider, g, grads) for g in self.groups}
        if all(t.device.type == "cpu" for lv in live.values()
               for ts in (lv.params, lv.grads, lv.optim) for t in ts.values()):
            return live
        if self.mode == "deferred":
            raise ValueError("snapshot='deferred' needs the model and optimizer state on the CPU "
                             "(a CUDA snapshot is copied inside save); use snapshot='auto'")
        return None

    def submit(self, read: Callable[[], T], on_stall: Callable[[float], None]) -> Future[T]:
        """Run ``read`` on the helper thread; until it returns, the next update waits for it
        (``on_stall`` is told how long). Only after ``capture`` returned the live state."""
        assert self._helper is not None
        leave = self._gate.enter(on_stall)

        def run() -> T:
            try:
                return read()
            finally:
                leave()
        return self._helper.submit(run)

    def observe(self, read: Callable[[], dict[str, dict[str, float]]],
                on_stall: Callable[[float], None]) -> DeferredStats:
        """``submit`` an observation; kept until it is done, for ``drain``/``wait_reads``."""
        self._reads = [f for f in self._reads if not f.done() or f.exception() is not None]
        fut = self.submit(read, on_stall)
        self._reads.append(fut)
        return DeferredStats(fut)

    def drain(self) -> None:
        """Wait for the deferred observations in flight (they use the tracker)."""
        if self._reads:
            wait_all(self._reads)

    def wait_reads(self) -> None:
        """Wait for the deferred observations and re-raise the first error among them."""
        reads, self._reads = self._reads, []
        for f in reads:
            f.result()

    def close(self) -> None:
        """Remove the update hook and stop the helper thread (after its work)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if self._helper is not None:
            self._helper.shutdown(wait=True)
