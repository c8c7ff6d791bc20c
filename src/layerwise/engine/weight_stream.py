"""Weights in: ``prefetch_depth + 1`` device slots sized for the largest streamed unit.

Follows ``plan.program.WeightWindow`` up to ``depth`` uses ahead, never copying a unit whose
update is unfinished (retried at the next op) and never waiting for a unit the op does not need
now. Resident units are not streamed. An NVMe copy source is read ahead and staged. A backend
that reads host memory in place (the CPU backend) copies no unit whose copy source is in the
compute dtype: compute reads it there, and no update writes it while the unit is in use (a
unit's update follows its last use in the step)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..plan.program import WeightWindow
from ..store import HostStore
from .backend import DeviceBackend, Event
from .resident import ResidentWeights
from .slots import Slot


class WeightStreamer:
    """Weight copies into ``depth + 1`` slots, following the plan's :class:`WeightWindow`."""

    def __init__(self, backend: DeviceBackend, store: HostStore, depth: int,
                 wait_update: Callable[[str], None], update_done: Callable[[str], bool],
                 resident: frozenset[str] = frozenset()):
        """``resident``: units whose weights stay on the device (never in the schedule)."""
        self.backend = backend
        self.store = store
        self.depth = depth
        self.wait_update = wait_update
        """Blocks until a unit's host weights are final (its optimizer update is done)."""
        self.update_done = update_done
        self.resident = ResidentWeights(backend, store, sorted(resident), wait_update, update_done)
        reads_host = backend.reads_host and store.source_tier is None
        self.in_place = frozenset(b.name for b in store if reads_host and b.name not in resident
                                  and b.copy_source.dtype == store.compute_dtype)
        """Units whose compute reads the host copy source itself."""
        numel = max((b.copy_source.numel() for b in store
                     if b.name not in resident | self.in_place), default=0)
        self.slots = [Slot(backend.alloc(numel, store.compute_dtype)) for _ in range(depth + 1)]
        self._window: WeightWindow | None = None
        self._ready: dict[str, Event] = {}  # unit -> its copy's event, while it holds a slot
        self.loads = 0
        """Weight copies issued so far (a unit needed again inside the window is not recopied)."""

    def begin(self, schedule: list[str]) -> None:
        assert self.finished(), "previous schedule not finished"
        self._window = WeightWindow(schedule, self.depth)
        if self.store.source_tier is not None:
            self.store.source_tier.prefetch(schedule)
        self._copy(self._window.fill(self.update_done))
        self.resident.refresh_ready()

    def _copy(self, copies: list[tuple[str, int]]) -> None:
        tier = self.store.source_tier
        for unit, slot in copies:
            if unit in self.in_place:
                self._ready[unit] = self.backend.record()
                continue
            staged = tier is not None and tier.holds(unit)
            if staged:
                tier.acquire(unit)
            src = self.store[unit].copy_source
            dst = self.slots[slot].buffer[:src.numel()]
            self._ready[unit] = self.backend.copy_h2d(dst, src, after=[self.slots[slot].free_after])
            if staged:
                tier.release(unit, in_use_until=self._ready[unit])
            self.loads += 1

    def acquire(self, unit: str) -> torch.Tensor:
        """The device copy of ``unit``'s weights for the op about to be queued. Waits (on the
        host) only for this unit's own update; prefetches skip units whose update is running."""
        if unit in self.resident:
            return self.resident.acquire(unit)
        if unit not in self._ready:
            self.wait_update(unit)
        self._copy(self._window.acquire(unit, self.update_done))
        self.backend.wait([self._ready[unit]])  # compute reads the slot after the copy lands
        if unit in self.in_place:
            return self.store[unit].copy_source
        return self.slots[self._window.slot(unit)].buffer[:self.store[unit].copy_source.numel()]

    def release(self, unit: str) -> None:
        """The op using ``unit`` has been queued; its slot is free once compute passes here."""
        if unit in self.resident:
            self.resident.release(unit)
            self.resident.refresh_ready()
            return
        slot = self._window.release(unit)
        if slot is not None:
            del self._ready[unit]
            self.slots[slot].free_after = self.backend.record()
        self._copy(self._window.fill(self.update_done))
        self.resident.refresh_ready()

    def reset(self) -> None:
        """Forget the rest of the schedule (a step failed; the lanes are idle)."""
        self._window = None
        self._ready.clear()
        for s in self.slots:
            s.free_after = None
        self.resident.reset()

    def finished(self) -> bool:
        return self._window is None or self._window.finished()
