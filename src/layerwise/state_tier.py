"""NvmeStateTier: one kind of units' buffers in files on NVMe, staged through a few RAM slots.

Kinds ``state``, ``source``, ``grad`` are tiers of their own, so each is read and written without
the others. An unstaged unit's tensors are meta placeholders, so a read without staging fails
loudly instead of reading stale bytes. Slots are page-aligned and use ``O_DIRECT``, so the RAM
taken is the slots, never page cache; ``flush`` writes behind, and a slot is reused only once
its write is done. The files are working memory, not a checkpoint: created afresh at start,
removed at ``close``."""

from __future__ import annotations

import errno
import os
import threading
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .util import direct_io
from .util.host_memory import alloc_pinned, page_size

PLACEHOLDER = "meta"
"""The device of an unstaged unit's state tensors."""


def placeholder(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, device=PLACEHOLDER)


class MetaAllocator:
    """A store allocator for a unit on NVMe: placeholders, filed by ``NvmeStateTier.adopt`` as
    zeros (what every ``init_state`` asks its allocator for)."""

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return placeholder((numel,), dtype)


META = MetaAllocator()


@dataclass(frozen=True)
class _Part:
    key: str
    """``master``, ``remainder`` or ``state/<name>``: which ``UnitBuffers`` tensor."""
    offset_bytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * self.dtype.itemsize


@dataclass
class _Unit:
    buf: object
    """The unit's ``UnitBuffers`` (whose tensors the tier binds and unbinds)."""
    path: Path
    fd: int
    direct: bool
    parts: list[_Part] = field(default_factory=list)
    nbytes: int = 0
    """Bytes of the file: the parts, each starting on an I/O block."""


@dataclass
class _Slot:
    raw: torch.Tensor | None = None
    """The page-aligned staging buffer (uint8), grown on demand."""
    unit: str | None = None
    io: Future | None = None
    """The I/O on ``raw`` (or the device copy from it) last submitted: ``raw`` is read into
    again only once it is done."""
    ready: Future | None = None
    """The read that fills ``raw`` with the unit's bytes (or, for a unit staged to be
    overwritten, the I/O that must leave ``raw`` first); staging waits for it alone."""
    pins: int = 0
    dirty: bool = False
    fresh: bool = False
    """Read ahead and not yet staged by anyone: the prefetcher does not evict it."""
    used: int = 0


class NvmeStateTier:
    """One kind of units' buffers in ``directory`` (a file per unit), ``slots`` staged at once."""

    def __init__(self, directory: str | Path, units: Iterable[str], slots: int = 3,
                 io_threads: int = 2, kind: str = "state", pinned: bool = False):
        """``kind``: the files' suffix (``state``, ``source``, ``grad``); ``pinned``: page-lock
        the slots (a device copies from them without waiting)."""
        if slots < 2:
            raise ValueError(f"an NVMe state tier needs at least 2 slots (one read ahead), got {slots}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        if direct_io.in_ram(self.directory):
            raise ValueError(f"state directory {self.directory} is on "
                             f"{direct_io.filesystem_type(self.directory)}, which lives in RAM: "
                             "give a directory on an NVMe drive (train key state_dir)")
        self.names = frozenset(units)
        self.kind, self.pinned = kind, pinned
        self.block = direct_io.io_block_bytes(self.directory)
        self._units: dict[str, _Unit] = {}
        self._slots = [_Slot() for _ in range(slots)]
        self._slot_of: dict[str, _Slot] = {}
        self._writing: dict[str, Future] = {}
        """Each unit's latest write-back: a read of the unit waits for it."""
        self._ahead: deque[str] = deque()
        self._cv = threading.Condition()
        self._clock = 0
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="nvme-state")
        self._count_lock = threading.Lock()  # the I/O threads never take ``_cv``: it may wait on them
        self.read_bytes = 0
        self.written_bytes = 0
        """Bytes moved since the tier was made, counted as the I/O completes."""

    def holds(self, unit: str) -> bool:
        return unit in self.names

    def staged_units(self) -> frozenset[str]:
        """The units in a slot now (real tensors; the others are placeholders)."""
        with self._cv:
            return frozenset(self._slot_of)

    @property
    def slot_count(self) -> int:
        return len(self._slots)

    @property
    def direct(self) -> bool:
        """Are all its files read and written with ``O_DIRECT`` (else: buffered, each transfer
        synced and dropped from the page cache)?"""
        return all(u.direct for u in self._units.values())

    def nbytes(self) -> int:
        """Bytes of state on NVMe (the files' lengths)."""
        return sum(u.nbytes for u in self._units.values())

    def staging_nbytes(self) -> int:
        """RAM the staging slots hold now."""
        return sum(s.raw.numel() for s in self._slots if s.raw is not None)

    # ----- filing a unit's tensors -----------------------------------------------------------

    def add(self, buf, parts: dict[str, torch.Tensor]) -> None:
        """File unit ``buf``'s tensors ``parts`` (key -> placeholder or zeros) in a new file of
        zeros and bind placeholders; ``state/<name>`` keys go to ``buf.state``."""
        name = buf.name
        with self._cv:
            unit = self._units.get(name)
            if unit is None:
                path = self.directory / f"{name}.{self.kind}"
                fd, direct = _open(path)
                unit = self._units[name] = _Unit(buf, path, fd, direct)
            slot = self._slot_of.get(name)
        if slot is not None:  # growing a staged unit: write it back, then file the new parts
            self._evict_now(name)
        with self._cv:
            for key, t in parts.items():
                unit.parts.append(_Part(key, unit.nbytes, tuple(t.shape), t.dtype))
                unit.nbytes = direct_io.round_up(unit.nbytes + unit.parts[-1].nbytes, self.block)
            os.ftruncate(unit.fd, unit.nbytes)  # the new parts read as zeros
            self._unbind(unit)

    def adopt_state(self, buf) -> None:
        """File ``buf.state`` as ``init_state`` made it through ``META`` (placeholders: zeros)."""
        for k, t in buf.state.items():
            if t.device.type != PLACEHOLDER:
                raise ValueError(f"{buf.name}: optimizer state {k!r} was allocated in RAM; an "
                                 "NVMe unit's init_state must allocate through buf.alloc")
        self.add(buf, {f"state/{k}": t for k, t in buf.state.items()})

    # ----- staging ----------------------------------------------------------------------------

    @contextmanager
    def staged(self, unit: str, write: bool = False, flush: bool = False) -> Iterator[None]:
        """Unit ``unit``'s tensors are real inside; ``write``: they are written; ``flush``:
        write them back at once on the way out (else when the slot is needed)."""
        self.acquire(unit)
        try:
            yield
        finally:
            self.release(unit, write, flush)

    def prefetch(self, units: Iterable[str]) -> None:
        """Read ``units`` ahead, in this order, as slots free up."""
        with self._cv:
            self._ahead.extend(u for u in units if u in self.names)
            self._advance()

    def acquire(self, name: str, overwrite: bool = False) -> None:
        """Stage unit ``name`` (waiting for its read) and hold it until ``release``.
        ``overwrite``: the holder writes every byte of it, so a unit not staged is not read."""
        with self._cv:
            while True:
                slot = self._slot_of.get(name)
                if slot is not None:
                    break
                victim = self._victim(allow_fresh=True)
                if victim is not None:
                    slot = self._load(name, victim, read=not overwrite)
                    break
                self._cv.wait()
            slot.pins += 1
            slot.fresh = False
            self._clock += 1
            slot.used = self._clock
            ready = slot.ready
        if ready is not None:
            ready.result()

    def release(self, name: str, write: bool = False, flush: bool = False,
                in_use_until=None) -> None:
        """End a hold of ``acquire``. ``in_use_until``: an event (``synchronize()``) after which
        the slot's bytes are no longer read (a device copy from it in flight): the slot is not
        read into before it."""
        with self._cv:
            slot = self._slot_of[name]
            slot.pins -= 1
            slot.dirty |= write
            if in_use_until is not None:
                slot.io = self._io.submit(_after, [f for f in (slot.io,) if f is not None],
                                          in_use_until)
            if flush and slot.dirty and slot.pins == 0:
                self._write_back(slot)
            self._advance()
            self._cv.notify_all()

    # ----- under the lock ---------------------------------------------------------------------

    def _victim(self, allow_fresh: bool) -> _Slot | None:
        """An unpinned slot to reuse: an empty one, else the one whose unit is needed last by
        the reads ahead (never, first), the least recently used among equals; a slot read ahead
        and not yet staged only when ``allow_fresh``."""
        free = [s for s in self._slots if s.unit is None]
        if free:
            return free[0]
        idle = [s for s in self._slots if s.pins == 0 and (allow_fresh or not s.fresh)]
        if not idle:
            return None
        ahead = list(self._ahead)

        def next_use(s: _Slot) -> int:
            return ahead.index(s.unit) if s.unit in ahead else len(ahead)
        return max(idle, key=lambda s: (not s.fresh, next_use(s), -s.used))

    def _load(self, name: str, slot: _Slot, read: bool = True) -> _Slot:
        """Give ``slot`` to unit ``name``: write its unit back if dirty, then read ``name``
        (unless not ``read``: its holder overwrites it)."""
        if slot.unit is not None:
            if slot.dirty:
                self._write_back(slot)
            self._unbind(self._units[slot.unit])
            del self._slot_of[slot.unit]
        unit = self._units[name]
        if slot.raw is None or slot.raw.numel() < unit.nbytes:
            if slot.io is not None:  # the old buffer's last write must finish before it goes
                slot.io.result()
            slot.raw = _aligned(max(unit.nbytes, max(u.nbytes for u in self._units.values())),
                                self.pinned)
        if read:
            after = [f for f in (slot.io, self._writing.get(name)) if f is not None]
            slot.io = slot.ready = self._io.submit(self._read, after, unit, slot.raw)
        else:
            slot.ready = slot.io  # the buffer's last I/O must leave it before it is written
        slot.unit, slot.dirty, slot.fresh = name, False, False
        self._slot_of[name] = slot
        self._bind(unit, slot.raw)
        return slot

    def _write_back(self, slot: _Slot) -> None:
        unit = self._units[slot.unit]
        # behind the unit's previous write too: the file ends with the newest bytes
        after = [f for f in (slot.io, self._writing.get(slot.unit)) if f is not None]
        slot.io = self._writing[slot.unit] = self._io.submit(self._write, after, unit, slot.raw)
        slot.dirty = False

    def _advance(self) -> None:
        """Start the reads ahead that have a slot (one not read ahead and not in use)."""
        while self._ahead:
            name = self._ahead[0]
            if name in self._slot_of:
                self._ahead.popleft()
                continue
            victim = self._victim(allow_fresh=False)
            if victim is None:
                return
            self._ahead.popleft()
            self._load(name, victim).fresh = True

    def _bind(self, unit: _Unit, raw: torch.Tensor) -> None:
        for p in unit.parts:
            _set(unit.buf, p.key, raw[p.offset_bytes:p.offset_bytes + p.nbytes]
                 .view(p.dtype).view(p.shape))

    def _unbind(self, unit: _Unit) -> None:
        for p in unit.parts:
            _set(unit.buf, p.key, placeholder(p.shape, p.dtype))

    def _evict_now(self, name: str) -> None:
        with self._cv:
            slot = self._slot_of[name]
            if slot.pins:
                raise RuntimeError(f"{name}: its state is in use and cannot be re-filed")
            if slot.dirty:
                self._write_back(slot)
            self._unbind(self._units[name])
            del self._slot_of[name]
            slot.unit, slot.fresh = None, False
            io = slot.io
        if io is not None:
            io.result()

    # ----- on the I/O threads -----------------------------------------------------------------

    def _read(self, after: list[Future], unit: _Unit, raw: torch.Tensor) -> None:
        for f in after:
            f.result()
        _transfer(os.preadv, unit, raw)
        with self._count_lock:
            self.read_bytes += unit.nbytes

    def _write(self, after: list[Future], unit: _Unit, raw: torch.Tensor) -> None:
        for f in after:
            f.result()
        _transfer(os.pwritev, unit, raw)
        with self._count_lock:
            self.written_bytes += unit.nbytes

    # ----- the end ----------------------------------------------------------------------------

    def page_cache_bytes(self) -> int:
        """Bytes of the state files the page cache holds now, as the kernel reports them."""
        return sum(direct_io.page_cache_bytes(u.path) for u in self._units.values())

    def drain(self) -> None:
        """Wait for every read and write in flight."""
        with self._cv:
            ios = [s.io for s in self._slots if s.io is not None]
        for f in ios:
            f.result()

    def close(self) -> None:
        """Finish the I/O and remove the files (working memory: the checkpoints hold the state).
        Idempotent; the store's NVMe units cannot be read afterwards."""
        if not self._units:
            return
        self.drain()
        self._io.shutdown(wait=True)
        for u in self._units.values():
            os.close(u.fd)
            u.path.unlink(missing_ok=True)
        self._units.clear()
        try:
            self.directory.rmdir()  # made for the run; kept when it holds anything else
        except OSError:
            pass


def _set(buf, key: str, t: torch.Tensor) -> None:
    if key.startswith("state/"):
        buf.state[key[len("state/"):]] = t
    else:
        setattr(buf, key, t)


def _after(after: list[Future], event) -> None:
    for f in after:
        f.result()
    event.synchronize()


def _aligned(nbytes: int, pinned: bool) -> torch.Tensor:
    """``nbytes`` of uint8 starting on a page (``O_DIRECT`` buffers must), page-locked when
    ``pinned``."""
    if pinned:
        return alloc_pinned(nbytes)[0]
    page = page_size()
    raw = torch.empty(nbytes + page, dtype=torch.uint8)
    start = (-raw.data_ptr()) % page
    return raw[start:start + nbytes]


def _open(path: Path) -> tuple[int, bool]:
    """A fresh, empty file at ``path`` open for direct reads and writes (buffered, each transfer
    synced and dropped from the cache, where the filesystem refuses ``O_DIRECT``)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_TRUNC
    try:
        return os.open(path, flags | os.O_DIRECT, 0o600), True
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise
    return os.open(path, flags, 0o600), False


def _transfer(op, unit: _Unit, raw: torch.Tensor) -> None:
    """The whole file to or from ``raw`` (``os.preadv`` or ``os.pwritev``)."""
    view = memoryview(raw.numpy())[:unit.nbytes]
    done = 0
    while done < unit.nbytes:
        n = op(unit.fd, [view[done:]], done)
        if n == 0:
            raise OSError(errno.EIO, f"{unit.path} ended after {done} of {unit.nbytes} bytes")
        done += n
    if not unit.direct:
        if op is os.pwritev:
            os.fdatasync(unit.fd)  # clean pages can be dropped
        os.posix_fadvise(unit.fd, 0, 0, os.POSIX_FADV_DONTNEED)
