"""Device slots and pinned host rings: the buffers copies write, allocated once.

A slot is reused only after an event the compute lane recorded when its last reader was queued,
and the copy lane waits on that event; so the device holds at most the slots the memory model
counts, however far the host runs ahead. A host ring hands pinned buffers out in turn and takes
them back when the host is done with them.
"""

from __future__ import annotations

import queue
from dataclasses import dataclass

import torch

from .backend import DeviceBackend, Event


@dataclass
class Slot:
    """A device buffer allocated once, and the compute event after which it may be rewritten."""

    buffer: torch.Tensor
    free_after: Event | None = None


class HostRing:
    """Pinned host buffers handed out in turn; a buffer comes back when the host is done with it."""

    def __init__(self, backend: DeviceBackend, count: int, nbytes: int):
        self.nbytes = nbytes
        """Bytes of each buffer."""
        self.buffers = [backend.host_alloc(nbytes, torch.uint8) for _ in range(count)]
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


