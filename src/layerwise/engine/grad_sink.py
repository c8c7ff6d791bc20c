"""Gradients out: device grad slots, a pinned host ring of layer-sized pieces, one landing thread.

The backward writes a unit's joined gradient into a grad slot; it leaves in D2H copies of at
most one ring buffer each (a layer's gradient is one piece, the embedding's or the head's fp32
one several), so the pinned ring costs ``HOST_GRAD_RING`` layer gradients whatever the
vocabulary. The landing thread waits for each piece's copy, adds it into the unit's fp32 host
gradient with the fused kernel (``optim.grad_accum``: no fp32 temporary, split over
``landing_threads`` threads), and hands the unit to the step reducer once it is final (which
takes its squared norm, or reduces it across ranks), so the clip factor is known when the
backward ends. One thread lands, in the order the gradients were sent: the reducer's
``unit_landed`` must come in the same order on every rank.

The first landing of a unit in a step *writes* its host gradient (``accumulate(first=True)``)
instead of adding, so nothing zeroes gradients between steps: between steps ``store[u].grad``
is spent (the optimizer may have clobbered it) and no one reads it.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..models.names import EMBED, HEAD
from ..optim.grad_accum import accumulate
from ..plan.memory import GRAD_SLOTS
from ..store import HostStore
from .backend import DeviceBackend, Event, Ref, Source
from .slots import HostRing, Slot

HOST_GRAD_RING = 4
"""Pinned host buffers (each one layer's gradient) that pieces land in. The thread queuing
device work takes one per piece and blocks only when all are still in flight: with four, it
resumes with about two backward ops still queued ahead of the device (one buffer is being
added up, one is being copied into), where two buffers left the device one op of work."""


@dataclass
class GradTicket:
    """One unit's gradient on its way out: where compute writes it, and the host ring buffer."""

    unit: str
    numel: int
    first: bool
    """The unit's first gradient of the step: it overwrites the host gradient."""
    device: torch.Tensor | None = None
    """The grad slot view compute writes (None on the synchronous path)."""
    slot: int = -1


class _RefPiece(Ref):
    """Elements ``[lo, hi)`` of a tensor a compute closure fills into ``ref``; the last piece
    takes the tensor (so its device memory goes once copied)."""

    __slots__ = ("ref", "lo", "hi", "last")

    def __init__(self, ref: Ref, lo: int, hi: int, last: bool):
        super().__init__()
        self.ref, self.lo, self.hi, self.last = ref, lo, hi, last

    def get(self) -> torch.Tensor:
        return self.ref.get().view(-1)[self.lo:self.hi]

    def take(self) -> torch.Tensor:
        t = self.get()
        if self.last:
            self.ref.take()
        return t


def ring_piece_bytes(store: HostStore) -> int:
    """Bytes of one ring buffer: the largest decoder layer's gradient in the compute dtype (the
    largest unit's when the model has only ends)."""
    elem = torch.empty((), dtype=store.compute_dtype).element_size()
    layers = [b.layout.numel for b in store if b.name not in (EMBED, HEAD)]
    return max(layers or [b.layout.numel for b in store]) * elem


class GradSink:
    def __init__(self, backend: DeviceBackend, store: HostStore,
                 on_final: Callable[[str], None], landing_threads: int = 1,
                 ring_buffers: int = HOST_GRAD_RING, thread_init: Callable[[], None] | None = None):
        """``on_final(unit)``: called where a unit's step gradient is complete on the host (the
        landing thread, or inline): the step reducer's ``unit_landed``, which takes its norm or
        starts reducing it across ranks. ``landing_threads``: threads one landing is split
        over (the landing thread is one of them). ``thread_init``: run first on the landing
        thread (its CPU mask, inherited by the threads it starts)."""
        self.backend = backend
        self.on_final = on_final
        self.store = store
        self.landing_threads = max(1, landing_threads)
        self.inline = not backend.asynchronous
        self._landed: set[str] = set()
        """Units with a gradient sent (or added inline) this step."""
        self.ring_wait_s = 0.0
        """Seconds the thread queuing device work spent waiting for a free ring buffer."""
        self.ring_waits: deque[tuple[float, float]] = deque(maxlen=4096)
        """The latest such waits, ``(start, end)`` in ``perf_counter`` seconds (a benchmark
        intersects them with the device's idle time)."""
        if self.inline:
            return
        dtype = store.compute_dtype
        numel = max(b.copy_source.numel() for b in store)
        self.slots = [Slot(backend.alloc(numel, dtype)) for _ in range(GRAD_SLOTS)]
        self._next_slot = 0
        self._ring = HostRing(backend, ring_buffers, ring_piece_bytes(store))
        self._work: queue.Queue = queue.Queue()
        self._errors: list[BaseException] = []
        self._pending = 0
        self._idle = threading.Condition()
        self._thread_init = thread_init
        self._worker = threading.Thread(target=self._land_loop, name="grad-sink", daemon=True)
        self._worker.start()

    # ----- queued from the executor ---------------------------------------------------------

    def begin_step(self) -> None:
        """A step starts: each unit's next gradient is its first."""
        self._landed = set()

    def landed(self) -> frozenset[str]:
        """Units that received a gradient this step."""
        return frozenset(self._landed)

    def _first(self, unit: str) -> bool:
        first = unit not in self._landed
        self._landed.add(unit)
        return first

    def begin(self, unit: str) -> GradTicket:
        """Reserve where the backward of ``unit`` writes its joined gradient."""
        numel = self.store[unit].layout.numel
        first = self._first(unit)
        if self.inline:
            return GradTicket(unit, numel, first)
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self.slots)
        self.backend.wait([self.slots[slot].free_after])  # its previous gradient has left
        return GradTicket(unit, numel, first, self.slots[slot].buffer[:numel], slot)

    def deposit(self, ticket: GradTicket, parts: list[torch.Tensor]) -> None:
        """Called on the compute lane with the gradient per parameter, in layout order."""
        if ticket.device is None:  # synchronous: straight into the host gradient's slices
            host_grad = self.store[ticket.unit].grad
            for sl, part in zip(self.store[ticket.unit].layout.slices(), parts):
                accumulate(host_grad[sl], part, ticket.first, self.landing_threads)
        else:
            torch.cat([p.reshape(-1) for p in parts], out=ticket.device)

    def end(self, ticket: GradTicket, final: bool) -> None:
        """The deposit is queued: send the gradient to the host and add it up there."""
        if ticket.device is None:
            if final:
                self.on_final(ticket.unit)
            return
        ev = self._send(ticket.device, ticket.numel, ticket.device.dtype, ticket.unit,
                        ticket.first, final)
        self.slots[ticket.slot].free_after = ev

    def put_fp32(self, unit: str, grad: Ref, numel: int, final: bool) -> None:
        """Send a flat fp32 gradient a compute closure filled into ``grad`` (the head's)."""
        first = self._first(unit)
        if self.inline:
            accumulate(self.store[unit].grad, grad.get(), first, self.landing_threads)
            if final:
                self.on_final(unit)
            return
        self._send(grad, numel, torch.float32, unit, first, final)

    def _take(self) -> int:
        t0 = time.perf_counter()
        ring = self._ring.take()  # blocks while every buffer is in flight
        t1 = time.perf_counter()
        self.ring_wait_s += t1 - t0
        self.ring_waits.append((t0, t1))
        return ring

    def _send(self, src: Source, numel: int, dtype: torch.dtype, unit: str, first: bool,
              final: bool) -> Event:
        """D2H copies of ``src`` in ring-sized pieces; returns the last copy's event (the
        source is read until then)."""
        per_piece = self._ring.nbytes // torch.empty((), dtype=dtype).element_size()
        produced = self.backend.record()  # behind the compute that fills src
        ev = None
        for lo in range(0, numel, per_piece):
            hi = min(numel, lo + per_piece)
            piece = src[lo:hi] if isinstance(src, torch.Tensor) else _RefPiece(src, lo, hi, hi == numel)
            ring = self._take()
            dst = self._ring.view(ring, hi - lo, dtype)
            ev = self.backend.copy_d2h(dst, piece, after=[produced])
            with self._idle:
                self._pending += 1
            self._work.put((ev, ring, dst, unit, lo, first, final and hi == numel))
        assert ev is not None, f"{unit}: an empty gradient"
        return ev

    # ----- the landing thread -------------------------------------------------------------------

    def _land_loop(self) -> None:
        if self._thread_init is not None:
            self._thread_init()
        while True:
            item = self._work.get()
            if item is None:
                return
            ev, ring, dst, unit, lo, first, final = item
            try:
                ev.synchronize()  # the copy has landed before the host reads it
                host_grad = self.store[unit].grad
                accumulate(host_grad[lo:lo + dst.numel()], dst, first, self.landing_threads)
                self._ring.give_back(ring)
                ring = None
                if final:
                    self.on_final(unit)
            except BaseException as e:  # noqa: BLE001  (re-raised by finish)
                self._errors.append(e)
            finally:
                if ring is not None:
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
        self._landed = set()
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
