"""Gradients out: one copy per unit through device grad slots and a small pinned host ring.

A host worker adds each landed gradient into the unit's fp32 host gradient and hands the unit to
the step reducer once it is final (which takes its squared norm, or reduces it across ranks), so
the clip factor is known when the backward ends.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..plan.memory import GRAD_SLOTS
from ..store import HostStore
from .backend import DeviceBackend, Event, Ref
from .slots import HostRing, Slot

HOST_GRAD_RING = 2
"""Pinned host buffers gradients land in before the host adds them up."""


@dataclass
class GradTicket:
    """One unit's gradient on its way out: where compute writes it, and the host ring buffer."""

    unit: str
    numel: int
    device: torch.Tensor | None = None
    """The grad slot view compute writes (None on the synchronous path)."""
    slot: int = -1


class GradSink:
    def __init__(self, backend: DeviceBackend, store: HostStore, fp32_numel: int,
                 on_final: Callable[[str], None]):
        """``fp32_numel``: the largest gradient sent in fp32 (the head's accumulators).
        ``on_final(unit)``: called where a unit's step gradient is complete on the host (the
        landing worker, or inline): the step reducer's ``unit_landed``, which takes its norm or
        starts reducing it across ranks."""
        self.backend = backend
        self.on_final = on_final
        self.store = store
        self.inline = not backend.asynchronous
        if self.inline:
            return
        dtype = store.compute_dtype
        numel = max(b.copy_source.numel() for b in store)
        self.slots = [Slot(backend.alloc(numel, dtype)) for _ in range(GRAD_SLOTS)]
        self._next_slot = 0
        elem = torch.empty((), dtype=dtype).element_size()
        self._ring = HostRing(backend, HOST_GRAD_RING, max(numel * elem, fp32_numel * 4))
        self._work: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._pending = 0
        self._idle = threading.Condition()
        self._worker = threading.Thread(target=self._land_loop, name="grad-sink", daemon=True)
        self._worker.start()

    # ----- queued from the executor ---------------------------------------------------------

    def begin(self, unit: str) -> GradTicket:
        """Reserve where the backward of ``unit`` writes its joined gradient."""
        numel = self.store[unit].layout.numel
        if self.inline:
            return GradTicket(unit, numel)
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self.slots)
        self.backend.wait([self.slots[slot].free_after])  # its previous gradient has left
        return GradTicket(unit, numel, self.slots[slot].buffer[:numel], slot)

    def deposit(self, ticket: GradTicket, parts: list[torch.Tensor]) -> None:
        """Called on the compute lane with the gradient per parameter, in layout order."""
        if ticket.device is None:  # synchronous: add straight into the host gradient's slices
            host_grad = self.store[ticket.unit].grad
            for sl, part in zip(self.store[ticket.unit].layout.slices(), parts):
                host_grad[sl].add_(part.reshape(-1))
        else:
            torch.cat([p.reshape(-1) for p in parts], out=ticket.device)

    def end(self, ticket: GradTicket, final: bool) -> None:
        """The deposit is queued: send the gradient to the host and add it up there."""
        if ticket.device is None:
            if final:
                self.on_final(ticket.unit)
            return
        ev = self._send(ticket.device, ticket.numel, ticket.device.dtype, ticket.unit, final)
        self.slots[ticket.slot].free_after = ev

    def put_fp32(self, unit: str, grad: Ref, numel: int, final: bool) -> None:
        """Send a flat fp32 gradient a compute closure filled into ``grad`` (the head's)."""
        if self.inline:
            self.store[unit].grad.add_(grad.get())
            if final:
                self.on_final(unit)
            return
        self._send(grad, numel, torch.float32, unit, final)

    def _send(self, src, numel: int, dtype: torch.dtype, unit: str, final: bool) -> Event:
        ring = self._ring.take()  # blocks while both buffers are still being added up
        dst = self._ring.view(ring, numel, dtype)
        ev = self.backend.copy_d2h(dst, src, after=[self.backend.record()])
        with self._idle:
            self._pending += 1
        self._work.put((ev, ring, dst, unit, final))
        return ev

    # ----- the host worker --------------------------------------------------------------------

    def _land_loop(self) -> None:
        while True:
            item = self._work.get()
            if item is None:
                return
            ev, ring, dst, unit, final = item
            try:
                ev.synchronize()  # the copy has landed before the host reads it
                host_grad = self.store[unit].grad
                host_grad.add_(dst)
                if final:
                    self.on_final(unit)
            except BaseException as e:  # noqa: BLE001  (re-raised by finish)
                self._errors.append(e)
            finally:
                self._ring.give_back(ring)
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _drain(self) -> None:
        if self.inline:
            return
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def abandon(self) -> None:
        """Wait for copies in flight and forget them (a step failed)."""
        self._drain()
        if not self.inline:
            self._errors.clear()
            for s in self.slots:
                s.free_after = None

    def finish(self) -> None:
        """Wait for every gradient to land (and its ``on_final`` to have run)."""
        self._drain()
        if not self.inline and self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self) -> None:
        if not self.inline:
            self._work.put(None)
            self._worker.join()
