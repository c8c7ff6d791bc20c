"""Boundary activations by tier: device, pinned host, NVMe, or dropped (recomputed).

NVMe boundaries go through two pinned staging buffers with ``O_DIRECT`` so they hold no page
cache (refused: buffered write, ``fdatasync``, ``POSIX_FADV_DONTNEED``); a tmpfs spill directory
is RAM whatever is done, and is logged."""

from __future__ import annotations

import logging
import math
import os
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..plan.memory import fetch_slot_count
from ..util import direct_io
from .backend import DeviceBackend, Event, HeldRef, Ref
from .slots import HostRing, OffloadWindow, Slot

log = logging.getLogger(__name__)

Key = Hashable
"""What the caller keys a boundary by (the executor: (micro-batch of the step, boundary))."""


def _file_name(key: Key) -> str:
    parts = key if isinstance(key, tuple) else (key,)
    return "boundary-" + "-".join(str(p) for p in parts) + ".bin"


@dataclass
class _Offloaded:
    tier: str
    shape: tuple[int, ...]
    stored: Event | Future
    """Host tier: the D2H copy's event; NVMe tier: the write's future (returns the path and
    whether it was written with ``O_DIRECT``)."""
    fetched: tuple[int, Event] | None = None
    """(fetch slot, H2D event) once the fetch is issued."""
    reading: Future | None = None
    host: torch.Tensor | None = None
    """Host tier: the buffer it was copied to."""


class BoundaryTiers:
    """Boundary activations by tier: ``device``, ``host``, ``nvme`` or dropped (``recompute``).

    ``on_device`` (key -> tensor) is touched only by compute closures."""

    def __init__(self, backend: DeviceBackend, spill_dir: str | Path | None = None,
                 direct_io: bool = True):
        """``direct_io``: write NVMe boundaries with ``O_DIRECT`` (False: always the buffered
        write + ``fdatasync`` + ``POSIX_FADV_DONTNEED`` fallback)."""
        self.backend = backend
        self.direct_io = direct_io
        self._spill_root = spill_dir
        self._spill_dir: Path | None = None
        self._block = 0  # O_DIRECT lengths are rounded up to this (the spill filesystem's block)
        self._io = ThreadPoolExecutor(1, thread_name_prefix="nvme-io",
                                      initializer=backend.bind_thread)  # it syncs device events
        self._host_bufs: dict[Hashable, torch.Tensor] = {}
        """Place (``store``'s) -> host buffer (host tier), kept across steps."""
        self._staging: HostRing | None = None  # NVMe writes and reads pass through these
        self._staging_numel = 0
        self.slots: list[Slot] = []
        self._free_slots: list[int] = []
        self._entries: dict[Key, _Offloaded] = {}
        self.on_device: dict[Key, torch.Tensor] = {}
        self.offloads = OffloadWindow(backend)
        """The D2H copies of stored boundaries, waited for by compute ``OFFLOAD_WINDOW_OPS`` ops
        later (``next_op``)."""
        self.nvme_bytes_written = 0

    def _dir(self) -> Path:
        if self._spill_dir is None:
            if self._spill_root is not None:
                Path(self._spill_root).mkdir(parents=True, exist_ok=True)
            self._spill_dir = Path(tempfile.mkdtemp(prefix="layerwise-spill-", dir=self._spill_root))
            self._block = direct_io.io_block_bytes(self._spill_dir)
            if direct_io.in_ram(self._spill_dir):
                log.warning("the NVMe tier's spill directory %s is on %s: its boundaries stay in "
                            "host RAM; give a spill_dir on a disk", self._spill_dir,
                            direct_io.filesystem_type(self._spill_dir))
        return self._spill_dir

    def prepare(self, numel: int, dtype: torch.dtype, num_offloaded: int, num_nvme: int,
                per_load: int = 1) -> None:
        """Allocate fetch slots (``plan.memory.fetch_slot_count``) and NVMe staging for
        boundaries of ``numel`` elements, once; ``per_load``: micro-batches of a group."""
        count = fetch_slot_count(num_offloaded, per_load)
        if count and (len(self.slots) != count or self.slots[0].buffer.numel() < numel):
            self.slots = [Slot(self.backend.alloc(numel, dtype)) for _ in range(count)]
            self._free_slots = list(range(count))
            self._host_bufs.clear()
        if num_nvme and (self._staging is None or self._staging_numel < numel):
            elem = torch.empty((), dtype=dtype).element_size()
            self._dir()  # the filesystem's block sizes the buffers
            self._staging = HostRing(self.backend, 2, direct_io.round_up(numel * elem, self._block))
            self._staging_numel = numel
        self._dtype = dtype

    # ----- forward: store -----------------------------------------------------------------

    def store(self, i: Key, h: Ref, shape: tuple[int, ...], tier: str,
              place: Hashable | None = None) -> None:
        """Keep boundary ``i`` per its tier. ``place``: the host buffer a host-tier boundary reuses
        (default ``i``), one whose previous boundary has been fetched."""
        if tier == "recompute":
            return
        if tier == "device":
            self.backend.launch(lambda: self.on_device.__setitem__(i, h.get()))
            return
        numel = math.prod(shape)
        after = [self.backend.record()]
        src = HeldRef(h)  # let go once compute waits for the copy (OffloadWindow), not before
        if tier == "host":
            place = i if place is None else place
            buf = self._host_bufs.get(place)
            if buf is None or buf.numel() < numel:
                buf = self._host_bufs[place] = self.backend.host_alloc(numel, self._dtype)
            ev = self.backend.copy_d2h(buf[:numel], src, after=after)
            self._entries[i] = _Offloaded("host", shape, ev, host=buf)
        elif tier == "nvme":
            ring = self._staging.take()
            dst = self._staging.view(ring, numel, self._dtype)
            ev = self.backend.copy_d2h(dst, src, after=after)
            path = self._dir() / _file_name(i)
            nbytes = numel * dst.element_size()
            self._entries[i] = _Offloaded("nvme", shape, self._io.submit(self._write, ev, ring, nbytes, path))
            self.nvme_bytes_written += nbytes
        else:
            raise ValueError(f"unknown tier {tier!r}")
        self.offloads.add(ev, src)

    def _write(self, ev: Event, ring: int, nbytes: int, path: Path) -> tuple[Path, bool]:
        try:
            ev.synchronize()  # the D2H copy has landed in the staging buffer
            buf = memoryview(self._staging.buffers[ring].numpy())
            direct = direct_io.write_file(path, buf, nbytes, self._block, self.direct_io)
            if self.direct_io and not direct:
                log.info("the filesystem of %s refuses O_DIRECT: NVMe boundaries are written "
                         "through the page cache, then synced and dropped from it", path.parent)
                self.direct_io = False
        finally:
            self._staging.give_back(ring)
        return path, direct

    def _read(self, written: Future, numel: int) -> tuple[int, torch.Tensor]:
        path, direct = written.result()
        ring = self._staging.take()
        dst = self._staging.view(ring, numel, self._dtype)
        direct_io.read_file(path, memoryview(self._staging.buffers[ring].numpy()),
                            dst.numel() * dst.element_size(), self._block, direct)
        os.unlink(path)
        return ring, dst

    def page_cache_bytes(self) -> int:
        """Bytes of the NVMe boundaries on disk now that the page cache holds (the kernel's
        count, ``direct_io.page_cache_bytes``); ~0 unless the spill directory is in RAM."""
        if self._spill_dir is None:
            return 0
        total = 0
        for p in self._spill_dir.glob("boundary-*.bin"):
            try:
                total += direct_io.page_cache_bytes(p)
            except FileNotFoundError:  # read back and removed meanwhile
                pass
        return total

    # ----- backward: fetch ------------------------------------------------------------------

    def unfetched(self, i: Key) -> bool:
        """Boundary ``i`` is offloaded and its fetch not issued yet (it will need a slot)."""
        e = self._entries.get(i)
        return e is not None and e.fetched is None

    def prefetch(self, i: Key, keep_free: int = 0) -> None:
        """Start bringing boundary ``i`` back early: the NVMe read, then the copy into a slot,
        leaving ``keep_free`` slots for fetches due before it."""
        e = self._entries.get(i)
        if e is None or e.fetched is not None:
            return
        if e.tier == "nvme" and e.reading is None:
            e.reading = self._io.submit(self._read, e.stored, math.prod(e.shape))
        if len(self._free_slots) > keep_free and (e.tier == "host" or e.reading.done()):
            self._issue_fetch(i, e)

    def _issue_fetch(self, i: Key, e: _Offloaded) -> None:
        slot = self._free_slots.pop(0)
        numel = math.prod(e.shape)
        dst = self.slots[slot].buffer[:numel]
        if e.tier == "host":
            # the copy lane waits for the offload to land; the host does not
            ev = self.backend.copy_h2d(dst, e.host[:numel],
                                       after=[self.slots[slot].free_after, e.stored])
        else:
            ring, src = e.reading.result()  # the file read (host work) must be done first
            ev = self.backend.copy_h2d(dst, src, after=[self.slots[slot].free_after])
            threading.Thread(target=self._return_staging, args=(ev, ring), daemon=True).start()
        e.fetched = (slot, ev)

    def _return_staging(self, ev: Event, ring: int) -> None:
        self.backend.bind_thread()
        ev.synchronize()
        self._staging.give_back(ring)

    def fetch(self, i: Key) -> None:
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

    def put_recomputed(self, i: Key, h: Ref) -> None:
        self.backend.launch(lambda: self.on_device.__setitem__(i, h.get()))

    def drop(self, i: Key) -> None:
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
        self.offloads.clear()

    def close(self) -> None:
        self.clear()
        self._io.shutdown(wait=True)
        if self._spill_dir is not None:
            for p in self._spill_dir.glob("*"):
                p.unlink()
            self._spill_dir.rmdir()
            self._spill_dir = None

