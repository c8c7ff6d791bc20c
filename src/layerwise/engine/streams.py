"""Moving weights in, gradients out, and activations between tiers, through fixed device slots.

Every device buffer a copy writes is a *slot* allocated once; a slot is reused only after an
event the compute lane recorded when its last reader was queued, and the copy lane waits on that
event. So the device holds at most the slots the memory model counts, however far the host runs
ahead.

- :class:`WeightStreamer`: ``prefetch_depth + 1`` weight slots sized for the largest unit. It
  follows the step's weight schedule up to ``depth`` uses ahead of the op being run, never
  copying a unit whose optimizer update has not finished (it retries at the next op), and never
  waiting for a unit other than the one the op needs now.
- :class:`GradSink`: gradients leave in one copy per unit through two device grad slots and a
  small pinned host ring; a host worker adds each into the unit's fp32 gradient and hands the
  unit to the step reducer once it is final (which takes its squared norm, or reduces it across
  ranks), so the clip factor is known when the backward ends.
- :class:`BoundaryTiers`: boundary activations kept on the device, offloaded to host memory
  or NVMe, fetched back into fetch slots ahead of use, or dropped (recompute).
"""

from __future__ import annotations

import math
import os
import queue
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from ..store import HostStore
from ..plan.memory import FETCH_SLOTS, GRAD_SLOTS
from ..plan.program import WeightWindow
from .backend import DeviceBackend, Event, Ref

HOST_GRAD_RING = 2
"""Pinned host buffers gradients land in before the host adds them up."""


@dataclass
class Slot:
    """A device buffer allocated once, and the compute event after which it may be rewritten."""

    buffer: torch.Tensor
    free_after: Event | None = None


class WeightStreamer:
    """Weight copies into ``depth + 1`` slots, following the plan's :class:`WeightWindow`."""

    def __init__(self, backend: DeviceBackend, store: HostStore, depth: int,
                 wait_update: Callable[[str], None], update_done: Callable[[str], bool]):
        self.backend = backend
        self.store = store
        self.depth = depth
        self.wait_update = wait_update
        """Blocks until a unit's host weights are final (its optimizer update is done)."""
        self.update_done = update_done
        numel = max(b.copy_source.numel() for b in store)
        self.slots = [Slot(backend.alloc(numel, store.compute_dtype)) for _ in range(depth + 1)]
        self._window: WeightWindow | None = None
        self._ready: dict[str, Event] = {}  # unit -> its copy's event, while it holds a slot
        self.loads = 0
        """Weight copies issued so far (a unit needed again inside the window is not recopied)."""

    def begin(self, schedule: list[str]) -> None:
        assert self.finished(), "previous schedule not finished"
        self._window = WeightWindow(schedule, self.depth)
        self._copy(self._window.fill(self.update_done))

    def _copy(self, copies: list[tuple[str, int]]) -> None:
        for unit, slot in copies:
            src = self.store[unit].copy_source
            dst = self.slots[slot].buffer[:src.numel()]
            self._ready[unit] = self.backend.copy_h2d(dst, src, after=[self.slots[slot].free_after])
            self.loads += 1

    def acquire(self, unit: str) -> torch.Tensor:
        """The device copy of ``unit``'s weights for the op about to be queued. Waits (on the
        host) only for this unit's own update; prefetches skip units whose update is running."""
        if unit not in self._ready:
            self.wait_update(unit)
        self._copy(self._window.acquire(unit, self.update_done))
        self.backend.wait([self._ready[unit]])  # compute reads the slot after the copy lands
        return self.slots[self._window.slot(unit)].buffer[:self.store[unit].copy_source.numel()]

    def release(self, unit: str) -> None:
        """The op using ``unit`` has been queued; its slot is free once compute passes here."""
        slot = self._window.release(unit)
        if slot is not None:
            del self._ready[unit]
            self.slots[slot].free_after = self.backend.record()
        self._copy(self._window.fill(self.update_done))

    def reset(self) -> None:
        """Forget the rest of the schedule (a step failed; the lanes are idle)."""
        self._window = None
        self._ready.clear()
        for s in self.slots:
            s.free_after = None

    def finished(self) -> bool:
        return self._window is None or self._window.finished()


class _HostRing:
    """Pinned host buffers handed out in turn; a buffer comes back when the host is done with it."""

    def __init__(self, backend: DeviceBackend, count: int, nbytes: int):
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
        self._ring = _HostRing(backend, HOST_GRAD_RING, max(numel * elem, fp32_numel * 4))
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


@dataclass
class _Offloaded:
    tier: str
    shape: tuple[int, ...]
    stored: Event | Future
    """Host tier: the D2H copy's event; NVMe tier: the write's future (returns the path)."""
    fetched: tuple[int, Event] | None = None
    """(fetch slot, H2D event) once the fetch is issued."""
    reading: Future | None = None


class BoundaryTiers:
    """Boundary activations by tier: ``device``, ``host``, ``nvme`` or dropped (``recompute``).

    ``on_device`` (boundary -> tensor) is touched only by compute closures.
    """

    def __init__(self, backend: DeviceBackend, spill_dir: str | Path | None = None):
        self.backend = backend
        self._spill_root = spill_dir
        self._spill_dir: Path | None = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="nvme-io")
        self._host_bufs: dict[int, torch.Tensor] = {}  # boundary -> host buffer (host tier), kept
        self._staging: _HostRing | None = None  # NVMe writes and reads pass through these
        self._staging_numel = 0
        self.slots: list[Slot] = []
        self._free_slots: list[int] = []
        self._entries: dict[int, _Offloaded] = {}
        self.on_device: dict[int, torch.Tensor] = {}
        self.nvme_bytes_written = 0

    def _dir(self) -> Path:
        if self._spill_dir is None:
            if self._spill_root is not None:
                Path(self._spill_root).mkdir(parents=True, exist_ok=True)
            self._spill_dir = Path(tempfile.mkdtemp(prefix="layerwise-spill-", dir=self._spill_root))
        return self._spill_dir

    def prepare(self, numel: int, dtype: torch.dtype, num_offloaded: int, num_nvme: int) -> None:
        """Allocate fetch slots (and NVMe staging) for boundaries of ``numel`` elements, once."""
        if num_offloaded and (not self.slots or self.slots[0].buffer.numel() < numel):
            count = min(FETCH_SLOTS, num_offloaded)
            self.slots = [Slot(self.backend.alloc(numel, dtype)) for _ in range(count)]
            self._free_slots = list(range(count))
            self._host_bufs.clear()
        if num_nvme and (self._staging is None or self._staging_numel < numel):
            elem = torch.empty((), dtype=dtype).element_size()
            self._staging = _HostRing(self.backend, 2, numel * elem)
            self._staging_numel = numel
        self._dtype = dtype

    # ----- forward: store -----------------------------------------------------------------

    def store(self, i: int, h: Ref, shape: tuple[int, ...], tier: str) -> None:
        """Keep boundary ``i`` (``h`` is filled by the compute queued just before) per its tier."""
        if tier == "recompute":
            return
        if tier == "device":
            self.backend.launch(lambda: self.on_device.__setitem__(i, h.get()))
            return
        numel = math.prod(shape)
        after = [self.backend.record()]
        if tier == "host":
            buf = self._host_bufs.get(i)
            if buf is None or buf.numel() < numel:
                buf = self._host_bufs[i] = self.backend.host_alloc(numel, self._dtype)
            ev = self.backend.copy_d2h(buf[:numel], h, after=after)
            self._entries[i] = _Offloaded("host", shape, ev)
        elif tier == "nvme":
            ring = self._staging.take()
            dst = self._staging.view(ring, numel, self._dtype)
            ev = self.backend.copy_d2h(dst, h, after=after)
            path = self._dir() / f"boundary-{i}.bin"
            self._entries[i] = _Offloaded("nvme", shape, self._io.submit(self._write, ev, dst, ring, path))
            self.nvme_bytes_written += numel * dst.element_size()
        else:
            raise ValueError(f"unknown tier {tier!r}")

    def _write(self, ev: Event, src: torch.Tensor, ring: int, path: Path) -> Path:
        try:
            ev.synchronize()  # the D2H copy has landed in the staging buffer
            with open(path, "wb") as f:
                f.write(memoryview(src.view(torch.uint8).numpy()))
        finally:
            self._staging.give_back(ring)
        return path

    def _read(self, written: Future, numel: int) -> tuple[int, torch.Tensor]:
        path = written.result()
        ring = self._staging.take()
        dst = self._staging.view(ring, numel, self._dtype)
        with open(path, "rb") as f:
            f.readinto(memoryview(dst.view(torch.uint8).numpy()))
        os.unlink(path)
        return ring, dst

    # ----- backward: fetch ------------------------------------------------------------------

    def prefetch(self, i: int) -> None:
        """Start bringing boundary ``i`` back early: the NVMe read, then the copy into a slot."""
        e = self._entries.get(i)
        if e is None or e.fetched is not None:
            return
        if e.tier == "nvme" and e.reading is None:
            e.reading = self._io.submit(self._read, e.stored, math.prod(e.shape))
        if self._free_slots and (e.tier == "host" or e.reading.done()):
            self._issue_fetch(i, e)

    def _issue_fetch(self, i: int, e: _Offloaded) -> None:
        slot = self._free_slots.pop(0)
        numel = math.prod(e.shape)
        dst = self.slots[slot].buffer[:numel]
        if e.tier == "host":
            # the copy lane waits for the offload to land; the host does not
            ev = self.backend.copy_h2d(dst, self._host_bufs[i][:numel],
                                       after=[self.slots[slot].free_after, e.stored])
        else:
            ring, src = e.reading.result()  # the file read (host work) must be done first
            ev = self.backend.copy_h2d(dst, src, after=[self.slots[slot].free_after])
            threading.Thread(target=self._return_staging, args=(ev, ring), daemon=True).start()
        e.fetched = (slot, ev)

    def _return_staging(self, ev: Event, ring: int) -> None:
        ev.synchronize()
        self._staging.give_back(ring)

    def fetch(self, i: int) -> None:
        """Queue: boundary ``i`` is present on the device for the compute that follows."""
        e = self._entries.get(i)
        if e is None:
            return  # kept on the device (or recomputed)
        if e.fetched is None:
            if e.tier == "nvme" and e.reading is None:
                e.reading = self._io.submit(self._read, e.stored, math.prod(e.shape))
            assert self._free_slots, "no free fetch slot: more boundaries fetched than slots"
            self._issue_fetch(i, e)
        slot, ev = e.fetched
        self.backend.wait([ev])
        view = self.slots[slot].buffer[:math.prod(e.shape)].view(e.shape)
        self.backend.launch(lambda: self.on_device.__setitem__(i, view))

    def put_recomputed(self, i: int, h: Ref) -> None:
        self.backend.launch(lambda: self.on_device.__setitem__(i, h.get()))

    def drop(self, i: int) -> None:
        """Queue: boundary ``i``'s last reader has been queued."""
        self.backend.launch(lambda: self.on_device.pop(i, None))
        e = self._entries.pop(i, None)
        if e is not None and e.fetched is not None:
            slot, _ = e.fetched
            self.slots[slot].free_after = self.backend.record()
            self._free_slots.append(slot)
            self._free_slots.sort()

    def clear(self) -> None:
        """After a step (or a failed one): forget every boundary; the lanes are idle."""
        for e in self._entries.values():
            if e.fetched is not None:
                self._free_slots.append(e.fetched[0])
            if e.tier == "nvme":
                try:
                    e.stored.result()
                except BaseException:  # noqa: BLE001  (the step already failed)
                    pass
        self._free_slots = sorted(set(self._free_slots))
        for s in self.slots:
            s.free_after = None
        self._entries.clear()
        self.on_device.clear()

    def close(self) -> None:
        self.clear()
        self._io.shutdown(wait=True)
        if self._spill_dir is not None:
            for p in self._spill_dir.glob("*"):
                p.unlink()
            self._spill_dir.rmdir()
            self._spill_dir = None

