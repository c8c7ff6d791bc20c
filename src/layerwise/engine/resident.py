"""Resident weights: a layer whose compute-dtype weights stay on the device for the run.

Each resident unit has one device buffer, outside the weight schedule, marked stale at the start
and by every update, and refreshed by one H2D copy once its update is done and its previous
reads have run (compute waits at every acquire). So a run copies each resident layer once per
step."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from ..store import HostStore
from .backend import DeviceBackend, Event


class ResidentWeights:
    """One device buffer per resident unit, refreshed from the host once per update."""

    def __init__(self, backend: DeviceBackend, store: HostStore, units: Iterable[str],
                 wait_update: Callable[[str], None], update_done: Callable[[str], bool]):
        self.backend = backend
        self.store = store
        self.wait_update = wait_update
        self.update_done = update_done
        self.buffers = {u: backend.alloc(store[u].copy_source.numel(), store.compute_dtype)
                        for u in units}
        self._stale = set(self.buffers)
        self._ready: dict[str, Event | None] = dict.fromkeys(self.buffers)
        """Unit -> its latest refresh's copy event (compute waits for it before a read)."""
        self._last_read: dict[str, Event | None] = dict.fromkeys(self.buffers)
        """Unit -> an event after the compute that read the buffer last (a refresh waits)."""
        self.refreshes = 0
        """Refresh copies issued so far."""

    def __contains__(self, unit: str) -> bool:
        return unit in self.buffers

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())

    def mark_stale(self) -> None:
        """The host weights may change (the step's updates were submitted): every buffer gets
        its copy source again before its next use."""
        self._stale = set(self.buffers)

    def _refresh(self, unit: str) -> None:
        self._stale.discard(unit)
        src = self.store[unit].copy_source
        self._ready[unit] = self.backend.copy_h2d(self.buffers[unit], src,
                                                  after=[self._last_read[unit]])
        self.refreshes += 1

    def refresh_ready(self) -> None:
        """Start the refresh of every stale buffer whose update is done (never blocks)."""
        for unit in [u for u in self._stale if self.update_done(u)]:
            self._refresh(unit)

    def acquire(self, unit: str) -> torch.Tensor:
        """The unit's device buffer for the op about to be queued (refreshed first if stale:
        waits on the host for this unit's update only)."""
        if unit in self._stale:
            self.wait_update(unit)
            self._refresh(unit)
        self.backend.wait([self._ready[unit]])
        return self.buffers[unit]

    def release(self, unit: str) -> None:
        """The op reading ``unit`` has been queued: a refresh waits until compute passes here."""
        self._last_read[unit] = self.backend.record()

    def reset(self) -> None:
        """A step failed and the lanes are idle: every event has passed."""
        self._ready = dict.fromkeys(self.buffers)
        self._last_read = dict.fromkeys(self.buffers)
