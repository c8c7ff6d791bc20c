"""The NVMe tier stays off the page cache: its boundaries, once written, hold no host RAM.

Resident bytes are the kernel's count (``mmap`` + ``mincore``, ``util/direct_io.py``). Where the
spill directory is in RAM (tmpfs, ramfs) a file's pages are its storage, so the tests that need
pages to leave RAM skip there, saying so.

Mutations checked by hand:
- ``write_file`` as a plain buffered write (no ``O_DIRECT``, no sync, no drop: what the tier did
  before) makes ``test_written_boundaries_hold_no_page_cache`` fail for both paths;
- the fallback without ``posix_fadvise(POSIX_FADV_DONTNEED)`` fails its ``buffered`` case;
- ``HostRing`` with the backend's plain ``host_alloc`` (not page-aligned on the CPU backends)
  fails ``test_staging_buffers_are_page_aligned_whole_blocks`` (and the O_DIRECT writes, whose
  alignment check trips).
"""

import errno
import logging
import os

import pytest
import torch

from layerwise.engine.backend import CpuBackend, Ref
from layerwise.engine.backend_async import AsyncCpuBackend
from layerwise.engine.boundary_tiers import BoundaryTiers
from layerwise.util import direct_io
from layerwise.util.host_memory import page_size

SHAPE = (2, 100, 333)
"""A boundary whose byte length (fp32) is not a whole number of pages: the tail is rounded."""


def needs_disk(path):
    if direct_io.in_ram(path):
        pytest.skip(f"{path} is on {direct_io.filesystem_type(path)}: a file there is page cache, "
                    "its pages cannot leave RAM")


def page_cache_is_observable(path) -> bool:
    """A file written through the cache shows resident pages here (else the count means nothing)."""
    probe = os.path.join(path, "probe.bin")
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20))
    resident = direct_io.page_cache_bytes(probe)
    os.unlink(probe)
    return resident >= (1 << 19)


def boundaries(n):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(SHAPE, generator=g) for _ in range(n)]


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-async"])
@pytest.mark.parametrize("direct", [True, False], ids=["o_direct", "buffered"])
def test_written_boundaries_hold_no_page_cache(tmp_path, direct, backend_name):
    needs_disk(tmp_path)
    if not page_cache_is_observable(tmp_path):
        pytest.skip(f"{tmp_path}: a buffered write shows no resident pages (page cache not observable)")
    backend = CpuBackend() if backend_name == "cpu" else AsyncCpuBackend(seed=1)
    tiers = BoundaryTiers(backend, tmp_path, direct_io=direct)
    data = boundaries(3)
    numel = data[0].numel()
    tiers.prepare(numel, torch.float32, num_offloaded=3, num_nvme=3)
    for i, t in enumerate(data):
        tiers.store(i, Ref(t.clone()), SHAPE, "nvme")
    paths = [tiers._entries[i].stored.result()[0] for i in range(3)]  # every write has finished
    written = sum(os.path.getsize(p) for p in paths)
    assert written == 3 * direct_io.round_up(numel * 4, tiers._block)
    assert tiers.page_cache_bytes() <= 3 * page_size(), (
        f"{tiers.page_cache_bytes()} of {written} bytes of NVMe boundaries in the page cache")
    for i, t in enumerate(data):  # and they come back exact, in fetch slots
        tiers.fetch(i)
        backend.synchronize()  # the fetch's copy and the closure that publishes it have run
        assert torch.equal(tiers.on_device[i], t)
        tiers.drop(i)
        backend.synchronize()
    assert not any(p.exists() for p in paths)
    tiers.close()
    if backend_name == "cpu-async":
        backend.close()


def test_a_refused_o_direct_falls_back_to_a_synced_dropped_write(tmp_path, monkeypatch):
    """A filesystem refusing ``O_DIRECT`` (EINVAL at open, as older tmpfs does) gets the
    buffered write + fdatasync + DONTNEED; the tier then stops trying ``O_DIRECT``."""
    real_open = os.open

    def refusing_open(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    tiers = BoundaryTiers(CpuBackend(), tmp_path)
    data = boundaries(2)
    tiers.prepare(data[0].numel(), torch.float32, num_offloaded=2, num_nvme=2)
    for i, t in enumerate(data):
        tiers.store(i, Ref(t.clone()), SHAPE, "nvme")
    assert [tiers._entries[i].stored.result()[1] for i in range(2)] == [False, False]
    assert tiers.direct_io is False
    if not direct_io.in_ram(tmp_path):
        assert tiers.page_cache_bytes() <= 2 * page_size()
    for i, t in enumerate(data):
        tiers.fetch(i)
        assert torch.equal(tiers.on_device[i], t)
        tiers.drop(i)
    tiers.close()


@pytest.mark.parametrize("backend_name", ["cpu", "cpu-async"])
def test_staging_buffers_are_page_aligned_whole_blocks(tmp_path, backend_name):
    backend = CpuBackend() if backend_name == "cpu" else AsyncCpuBackend(seed=None)
    tiers = BoundaryTiers(backend, tmp_path)
    numel = SHAPE[0] * SHAPE[1] * SHAPE[2]
    tiers.prepare(numel, torch.float32, num_offloaded=1, num_nvme=1)
    block = direct_io.io_block_bytes(tmp_path)
    assert tiers._block == block and block % page_size() == 0
    for buf in tiers._staging.buffers:
        assert buf.data_ptr() % page_size() == 0
        assert buf.numel() == direct_io.round_up(numel * 4, block) > numel * 4
    tiers.close()
    if backend_name == "cpu-async":
        backend.close()


def test_page_cache_bytes_counts_what_the_kernel_holds(tmp_path):
    """The count follows the kernel: a buffered write is resident, a synced and dropped one is
    not, reading it back makes it resident again. Mutation checked: counting mapped pages
    instead of resident ones (``mincore``'s low bit ignored) reports the whole file after the drop."""
    needs_disk(tmp_path)
    path = tmp_path / "f.bin"
    data = os.urandom(3 << 20)
    with open(path, "wb") as f:
        f.write(data)
    if direct_io.page_cache_bytes(path) < (1 << 20):
        pytest.skip(f"{tmp_path}: a buffered write shows no resident pages (page cache not observable)")
    assert direct_io.page_cache_bytes(path) >= len(data) - page_size()
    fd = os.open(path, os.O_RDONLY)
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert direct_io.page_cache_bytes(path) <= page_size()
    with open(path, "rb") as f:
        assert f.read(1 << 20) == data[:1 << 20]
    assert (1 << 20) <= direct_io.page_cache_bytes(path) < len(data)


def test_a_spill_directory_in_ram_is_reported(caplog):
    shm = "/dev/shm"
    if not (os.path.isdir(shm) and direct_io.in_ram(shm) and os.access(shm, os.W_OK)):
        pytest.skip("no writable tmpfs at /dev/shm")
    tiers = BoundaryTiers(CpuBackend(), shm)
    with caplog.at_level(logging.WARNING, logger="layerwise.engine.boundary_tiers"):
        tiers.prepare(16, torch.float32, num_offloaded=1, num_nvme=1)
    assert any("host RAM" in r.getMessage() for r in caplog.records)
    tiers.close()
