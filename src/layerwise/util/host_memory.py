"""What this machine's host memory offers: page-locked regions and the RAM still available
(``MemAvailable`` lowered to the cgroup's headroom, so a container's limit counts)."""

from __future__ import annotations

import ctypes
import os
import warnings
import weakref

import torch

from .units import human_bytes, tensor_nbytes


# ----- page-locked regions ----------------------------------------------------------------

def page_size() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # pragma: no cover - not POSIX
        return 4096


def locked_nbytes(nbytes: int) -> int:
    """Bytes page-locked for a region of ``nbytes``: whole pages (``alloc_pinned``)."""
    return -(-nbytes // page_size()) * page_size()


def page_lock(region: torch.Tensor) -> None:
    """Page-lock ``region`` (contiguous, page-aligned, whole pages) in place for CUDA copies,
    until its storage is freed. Raises when the CUDA runtime refuses, with the runtime's error
    state cleared (the caller falls back to other memory and goes on launching kernels)."""
    ptr, nbytes = region.data_ptr(), tensor_nbytes(region)
    cudart = torch.cuda.cudart()
    err = int(cudart.cudaHostRegister(ptr, nbytes, 1))  # 1: cudaHostRegisterPortable
    if err != 0:
        clear_cuda_error(cudart)
        raise RuntimeError(f"cudaHostRegister of {human_bytes(nbytes)} failed with CUDA error {err}")
    # unregister when the storage (kept alive by every view) is freed; not at interpreter exit,
    # when the CUDA context may already be gone (as torch.distributed.checkpoint does)
    weakref.finalize(region.untyped_storage(), _page_unlock, ptr).atexit = False


def clear_cuda_error(cudart=None) -> None:
    """Reset the CUDA runtime's last error, which torch would otherwise raise after an unrelated
    kernel. ``cudart()`` does not bind ``cudaGetLastError``, so the loaded runtime is called via
    ctypes (same library, same per-thread state)."""
    get = getattr(cudart if cudart is not None else torch.cuda.cudart(), "cudaGetLastError", None)
    if get is not None:
        get()
        return
    path = mapped_cudart(_read_text("/proc/self/maps") or "")
    if path is not None:
        ctypes.CDLL(path).cudaGetLastError()
        return
    try:  # a runtime linked into torch: a kernel launch's check reads the error and resets it
        torch.zeros(1, device=torch.device("cuda", torch.cuda.current_device()))
    except RuntimeError:
        pass


def mapped_cudart(maps: str) -> str | None:
    """The CUDA runtime library this process has mapped (from ``/proc/self/maps``), if any."""
    for line in maps.splitlines():
        path = line.split()[-1] if line.split() else ""
        if os.path.basename(path).startswith("libcudart.so"):
            return path
    return None


def _page_unlock(ptr: int) -> None:  # pragma: no cover - CUDA only
    try:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:
        pass


def _pinned_empty(nbytes: int) -> torch.Tensor:  # pragma: no cover - CUDA only
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def alloc_pinned(nbytes: int) -> tuple[torch.Tensor, int]:
    """``nbytes`` of page-locked host memory (uint8, uninitialised) and how many bytes are locked.

    Registered in place (exact size, no copy): torch's pinned allocator rounds up to a power of two
    (a 29.5 GB arena would lock 34.4 GB) and is only the fallback, with a warning."""
    page = page_size()
    size = locked_nbytes(nbytes)
    raw = torch.empty(size + page, dtype=torch.uint8)  # untouched slack pages cost no RAM
    start = (-raw.data_ptr()) % page
    region = raw[start:start + size]
    try:
        page_lock(region)
    except Exception as e:  # pragma: no cover - CUDA only
        warnings.warn(f"page-locking {human_bytes(nbytes)} of host memory in place failed "
                      f"({e}); using torch's pinned allocator, which rounds it up to a power of "
                      "two", RuntimeWarning, stacklevel=3)
        del raw, region
        return _pinned_empty(nbytes), 1 << max(nbytes - 1, 0).bit_length()
    return region[:nbytes], size


# ----- available RAM ----------------------------------------------------------------------

_MEMINFO = "/proc/meminfo"
_CGROUP_ROOT = "/sys/fs/cgroup"
_CGROUP_FILES = (  # limit, usage, stat, reclaimable page-cache key: cgroup v2, then v1
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
     "total_inactive_file"),
)
_NO_LIMIT = 1 << 60  # v1 reports "no limit" as a number near 2**63


def _read_text(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _stat_value(text: str, key: str) -> int | None:
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return None
    return None


def _cgroup_headroom() -> int | None:
    """Bytes the memory cgroup this container sees can still grant (inactive page cache counts
    as reclaimable); None without a limit or without a cgroup."""
    for limit_f, usage_f, stat_f, inactive_key in _CGROUP_FILES:
        limit = _read_text(os.path.join(_CGROUP_ROOT, limit_f))
        usage = _read_text(os.path.join(_CGROUP_ROOT, usage_f))
        if limit is None or usage is None:
            continue
        try:
            if limit.strip() == "max" or int(limit) >= _NO_LIMIT:
                return None
            used = int(usage)
        except ValueError:
            return None
        inactive = _stat_value(_read_text(os.path.join(_CGROUP_ROOT, stat_f)) or "", inactive_key)
        return max(int(limit) - used + (inactive or 0), 0)
    return None


HOST_MEM_ENV = "LAYERWISE_HOST_MEM_AVAILABLE_BYTES"
"""Where set, the bytes of RAM available, in place of what the kernel says: for a machine whose
``MemAvailable`` is not the truth (some GPU machines start far below their documented RAM
and grows as memory is used; the check sets it for the CUDA tests from its host budget)."""


def available_host_memory() -> int | None:
    """Bytes of RAM this process can still take: ``$LAYERWISE_HOST_MEM_AVAILABLE_BYTES`` where
    set, else Linux ``MemAvailable``, lowered to the memory cgroup's headroom in a container;
    None where neither is known (then nothing is checked)."""
    given = os.environ.get(HOST_MEM_ENV, "").strip()
    if given:
        try:
            return max(int(float(given)), 0)
        except ValueError:
            raise ValueError(f"{HOST_MEM_ENV}={given!r} is not a number of bytes; set it to one "
                             "(e.g. 137400000000) or unset it") from None
    avail = None
    for line in (_read_text(_MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):  # "MemAvailable:   22873056 kB"
            try:
                avail = int(line.split()[1]) * 1024
            except (IndexError, ValueError):
                pass
    if avail is None:
        try:
            avail = os.sysconf("SC_AVPHYS_PAGES") * page_size()
        except (AttributeError, ValueError, OSError):
            avail = None
    headroom = _cgroup_headroom()
    if headroom is not None:
        avail = headroom if avail is None else min(avail, headroom)
    return avail
