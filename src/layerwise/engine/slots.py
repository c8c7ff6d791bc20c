"""Device slots, pinned host rings and the offload window: the bounds on what copies hold
(``docs/design-notes.md``, "Engine"). A slot is reused only after the compute lane's event for
its last reader, so the device holds what the memory model counts however far the host runs
ahead."""

from __future__ import annotations

import queue
import threading
from collections import deque
from dataclasses import dataclass

import torch

from ..plan.memory import OFFLOAD_WINDOW_OPS
from ..util.host_memory import page_size
from .backend import DeviceBackend, Event, HeldRef


@dataclass
class Slot:
    """A device buffer allocated once, and the compute event after which it may be rewritten."""

    buffer: torch.Tensor
    free_after: Event | None = None


def aligned_host_alloc(backend: DeviceBackend, nbytes: int, align: int) -> torch.Tensor:
    """``nbytes`` of the backend's host memory (pinned on CUDA) starting on an ``align``-byte
    boundary (a power of two, at most a page: what ``O_DIRECT`` file I/O needs). The CUDA pinned
    allocator hands out whole pages already; a CPU allocation is over-allocated and sliced."""
    buf = backend.host_alloc(nbytes, torch.uint8)
    if buf.data_ptr() % align == 0:
        return buf
    raw = backend.host_alloc(nbytes + align, torch.uint8)
    start = (-raw.data_ptr()) % align
    return raw[start:start + nbytes]


class HostRing:
    """Pinned host buffers handed out in turn; a buffer comes back when the host is done with it.
    Each starts on a page boundary (file I/O may read and write them with ``O_DIRECT``)."""

    def __init__(self, backend: DeviceBackend, count: int, nbytes: int):
        self.nbytes = nbytes
        """Bytes of each buffer."""
        self.buffers = [aligned_host_alloc(backend, nbytes, page_size()) for _ in range(count)]
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(count):
            self._free.put(i)

    def take(self) -> int:
        return self._free.get()

    def give_back(self, i: int) -> None:
        self._free.put(i)

    def view(self, i: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        return self.buffers[i][:nbytes].view(dtype)


class EventGroup:
    """Events (and held copy sources) a compute closure adds as it runs, seen as one event: the
    host can make the compute lane wait for offloads it has not seen queued yet. Waited on by the
    compute lane after the closure that fills it (CUDA: ``Stream.wait_event`` calls ``wait``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self._holds: list[HeldRef] = []
        self._released = False
        self._lock = threading.Lock()  # the closure adds while the host may release

    def add(self, event: Event, hold: HeldRef | None = None) -> None:
        self.events.append(event)
        if hold is not None:
            with self._lock:
                if not self._released:
                    self._holds.append(hold)
                    return
            hold.release()  # the host has waited already (it ran ahead of this closure)

    def synchronize(self) -> None:
        for ev in self.events:
            ev.synchronize()

    def query(self) -> bool:
        return all(ev.query() for ev in self.events)

    def wait(self, stream) -> None:  # pragma: no cover - CUDA only
        for ev in self.events:
            stream.wait_event(ev)

    def release(self) -> None:
        with self._lock:
            self._released, holds, self._holds = True, self._holds, []
        for h in holds:
            h.release()


class OffloadWindow:
    """D2H offloads in flight by the op that queued them: before an op's compute, the lane waits for
    those ``ops`` or more ops back and lets their sources go. ``ops=1`` is the window the planner
    times and the memory model counts (``plan.memory.OFFLOAD_WINDOW_OPS``)."""

    def __init__(self, backend: DeviceBackend, ops: int = OFFLOAD_WINDOW_OPS):
        assert ops >= 1
        self.backend = backend
        self.ops = ops
        self._by_op: deque[list[tuple[Event, HeldRef | EventGroup | None]]] = deque([[]])

    def add(self, event: Event, hold: HeldRef | EventGroup | None = None) -> None:
        """An offload the current op queued; ``hold`` is released once the compute lane waits."""
        self._by_op[-1].append((event, hold))

    def next_op(self) -> None:
        """Host side, before the next op is queued: its compute waits for the old offloads."""
        self._by_op.append([])
        while len(self._by_op) > self.ops:
            old = self._by_op.popleft()
            if old:
                self.backend.wait([ev for ev, _ in old])
                for _, hold in old:
                    if hold is not None:
                        hold.release()

    def in_flight(self) -> int:
        """Offloads not yet waited for (those of the last ``ops`` ops)."""
        return sum(len(op) for op in self._by_op)

    def clear(self) -> None:
        """After a step (or a failed one): the lanes are idle; let every source go."""
        for op in self._by_op:
            for _, hold in op:
                if hold is not None:
                    hold.release()
        self._by_op = deque([[]])
