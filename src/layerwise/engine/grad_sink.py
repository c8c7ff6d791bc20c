"""Gradients out: device grad slots, a pinned host ring of layer-sized pieces, one landing thread.

The ring costs ``HOST_GRAD_RING`` layer gradients whatever the vocabulary (large gradients go in
pieces). One thread lands, in send order, because the reducer's ``unit_landed`` must come in the
same order on every rank; it hands each final unit to the reducer, so the clip factor is known
when the backward ends. A unit's first landing of a step writes instead of adding, so nothing
zeroes gradients. Layer-major order sums a group on the device in fp32 first.

With ``device_reduce`` each micro-batch's gradient is reduced to its owner on the device, and
only the owner copies it out: per micro-batch, because a step sum would keep every gradient on
the device (the model's size) where the memory model has two grad slots."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from ..models.names import EMBED, HEAD
from ..optim.grad_accum import accumulate
from ..plan.memory import GRAD_SLOTS, grad_slot_itemsize
from ..store import HostStore
from .backend import DeviceBackend, Event, Ref, Source, Work
from .slots import HostRing, Slot

HOST_GRAD_RING = 4
"""Pinned host buffers (each one layer's gradient) that pieces land in. The thread queuing
device work takes one per piece and blocks only when all are still in flight: with four, it
resumes with about two backward ops still queued ahead of the device (one buffer is being
added up, one is being copied into), where two buffers left the device one op of work."""


class DeviceReduce(Protocol):
    """The step reducer's part the sink calls when gradients are reduced on the device."""

    def owns(self, unit: str) -> bool:
        """This rank lands ``unit``'s reduced gradient (and updates it)."""

    def reduce_on_device(self, unit: str, grad: torch.Tensor) -> Work | None:
        """Issue the sum of every rank's ``grad`` into its owner's (async; on the thread of the
        backend's reduction lane) and return its work."""


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
    scratch: torch.Tensor | None = None
    """The synchronous path with a group of several micro-batches: the fp32 sum, landed once."""


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
                 thread_init: Callable[[], None] | None = None,
                 device_reduce: DeviceReduce | None = None, per_load: int = 1):
        """``on_final(unit)``: called once a unit's step gradient is complete on the host.
        ``landing_threads``: threads one landing is split over. ``thread_init``: run first on the
        landing thread. ``device_reduce``: reduce on the device before leaving (None: every rank
        lands its own). ``per_load``: micro-batches a grad slot sums."""
        self.backend = backend
        self.on_final = on_final
        self.store = store
        self.landing_threads = max(1, landing_threads)
        self.device_reduce = device_reduce
        self.inline = not backend.asynchronous and device_reduce is None
        """Gradients are added straight from the compute into the host gradient (no slots)."""
        self._landed: set[str] = set()
        """Units with a gradient sent (or added inline) this step."""
        self._reduced: Event | None = None
        """The step's latest collective (the reduction lane runs them in order)."""
        self.ring_wait_s = 0.0
        """Seconds the thread queuing device work spent waiting for a free ring buffer."""
        self.ring_waits: deque[tuple[float, float]] = deque(maxlen=4096)
        """The latest such waits, ``(start, end)`` in ``perf_counter`` seconds (a benchmark
        intersects them with the device's idle time)."""
        numel = max(b.copy_source.numel() for b in store)
        self._scratch: torch.Tensor | None = None
        if self.inline:
            if per_load > 1:  # the synchronous "device" is host memory: one sum at a time
                self._scratch = torch.empty(numel, dtype=torch.float32)
            return
        elem = torch.empty((), dtype=store.compute_dtype).element_size()
        dtype = torch.float32 if grad_slot_itemsize(elem, per_load) == 4 else store.compute_dtype
        self.slots = [Slot(backend.alloc(numel, dtype)) for _ in range(GRAD_SLOTS)]
        self._next_slot = 0
        self._ring = HostRing(backend, HOST_GRAD_RING, ring_piece_bytes(store))
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

    def begin(self, unit: str, micro_batches: int = 1) -> GradTicket:
        """Reserve where the backward of ``unit`` writes its joined gradient, summed over
        ``micro_batches`` deposits (a layer-major group's)."""
        numel = self.store[unit].layout.numel
        first = self._first(unit)
        if self.inline:
            scratch = self._scratch[:numel] if micro_batches > 1 else None
            return GradTicket(unit, numel, first, scratch=scratch)
        slot = self._next_slot
        self._next_slot = (slot + 1) % len(self.slots)
        self.backend.wait([self.slots[slot].free_after])  # its previous gradient has left
        return GradTicket(unit, numel, first, self.slots[slot].buffer[:numel], slot)

    def deposit(self, ticket: GradTicket, parts: list[torch.Tensor], add: bool = False) -> None:
        """Called on the compute lane with the gradient per parameter, in layout order;
        ``add``: a later micro-batch of the group (summed into the earlier ones')."""
        dst = ticket.device if ticket.device is not None else ticket.scratch
        if dst is None:  # synchronous, one micro-batch: straight into the host gradient's slices
            with self.store.staged_grad(ticket.unit, write=True, overwrite=ticket.first):
                host_grad = self.store[ticket.unit].grad
                for sl, part in zip(self.store[ticket.unit].layout.slices(), parts):
                    accumulate(host_grad[sl], part, ticket.first, self.landing_threads)
        elif add:
            for sl, part in zip(self.store[ticket.unit].layout.slices(), parts):
                dst[sl].add_(part.reshape(-1))
        else:
            torch.cat([p.reshape(-1) for p in parts], out=dst)

    def end(self, ticket: GradTicket, final: bool) -> None:
        """The deposit is queued: send the gradient to the host and add it up there."""
        if ticket.device is None:
            if ticket.scratch is not None:
                with self.store.staged_grad(ticket.unit, write=True, overwrite=ticket.first):
                    accumulate(self.store[ticket.unit].grad, ticket.scratch, ticket.first,
                               self.landing_threads)
            if final:
                self.on_final(ticket.unit)
            return
        ev = self._out(ticket.device, ticket.numel, ticket.device.dtype, ticket.unit,
                       ticket.first, final)
        self.slots[ticket.slot].free_after = ev

    def put_fp32(self, unit: str, grad: Ref, numel: int, final: bool) -> None:
        """Send a flat fp32 gradient a compute closure filled into ``grad`` (the head's)."""
        first = self._first(unit)
        if self.inline:
            with self.store.staged_grad(unit, write=True, overwrite=first):
                accumulate(self.store[unit].grad, grad.get(), first, self.landing_threads)
            if final:
                self.on_final(unit)
            return
        self._out(grad, numel, torch.float32, unit, first, final)

    def _out(self, src: Source, numel: int, dtype: torch.dtype, unit: str, first: bool,
             final: bool) -> Event:
        """Reduce ``src`` to its owner (data parallel on the device), then send it to the host
        where it lands; returns the event after which ``src`` is no longer read."""
        after = self.backend.record()  # behind the compute that fills src
        red = self.device_reduce
        if red is None:
            return self._send(src, numel, dtype, unit, first, final, after)
        mine = red.owns(unit)
        self._reduced = self.backend.collective(
            src, lambda t: red.reduce_on_device(unit, t.view(-1)[:numel]), after=[after],
            release=not mine)
        if not mine:
            return self._reduced  # the owner lands it; this rank's part is spent
        return self._send(src, numel, dtype, unit, first, final, self._reduced)

    def _take(self) -> int:
        t0 = time.perf_counter()
        ring = self._ring.take()  # blocks while every buffer is in flight
        t1 = time.perf_counter()
        self.ring_wait_s += t1 - t0
        self.ring_waits.append((t0, t1))
        return ring

    def _send(self, src: Source, numel: int, dtype: torch.dtype, unit: str, first: bool,
              final: bool, produced: Event) -> Event:
        """D2H copies of ``src`` in ring-sized pieces, after ``produced``; returns the last
        copy's event (the source is read until then)."""
        per_piece = self._ring.nbytes // torch.empty((), dtype=dtype).element_size()
        ev = None
        for lo in range(0, numel, per_piece):
            hi = min(numel, lo + per_piece)
            piece = src[lo:hi] if isinstance(src, torch.Tensor) else _RefPiece(src, lo, hi, hi == numel)
            ring = self._take()
            dst = self._ring.view(ring, hi - lo, dtype)
            ev = self.backend.copy_d2h(dst, piece, after=[produced])
            with self._idle:
                self._pending += 1
            self._work.put((ev, ring, dst, unit, lo, first, final and hi == numel, hi == numel))
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
            ev, ring, dst, unit, lo, first, final, last = item
            tier = self.store.grad_tier
            held = tier is not None and tier.holds(unit)
            try:
                ev.synchronize()  # the copy has landed before the host reads it
                if held and lo == 0:  # staged for the whole landing, its pieces in order
                    tier.acquire(unit, overwrite=first)
                host_grad = self.store[unit].grad
                accumulate(host_grad[lo:lo + dst.numel()], dst, first, self.landing_threads)
                self._ring.give_back(ring)
                ring = None
                if final:
                    self.on_final(unit)
                if held and last:
                    tier.release(unit, write=True, flush=True)
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
        reduced, self._reduced = self._reduced, None
        if reduced is not None:  # a collective whose gradient no copy waits for (not the owner)
            reduced.synchronize()
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def abandon(self) -> None:
        """Wait for copies in flight and forget them (a step failed)."""
        try:
            self._drain()
        except Exception:  # noqa: BLE001  (the step's own error is being raised)
            pass
        self._landed = set()
        if not self.inline:
            self._errors.clear()
            for s in self.slots:
                s.free_after = None

    def finish(self) -> None:
        """Wait for every gradient to land (and its ``on_final`` to have run) and, data parallel
        on the device, for every collective of the step."""
        self._drain()
        if not self.inline and self._errors:
            err = self._errors[0]
            self._errors.clear()
            raise err

    def close(self) -> None:
        if not self.inline:
            self._work.put(None)
            self._worker.join()
