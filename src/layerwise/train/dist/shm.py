"""One host store per node: its buffers in shared memory, mapped by every local rank.

Each buffer is one file in ``shm_dir`` made by local rank 0 (renamed into place, so it appears
whole) and mapped by the others; every rank asks in the same order, so the n-th request names
the n-th file. Files are unlinked once all have mapped them, so nothing is left in ``/dev/shm``
however the run ends. Free space is checked first: a full tmpfs is a SIGBUS at the first write
past its size (Docker's default is 64 MB), not a Python error."""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ...adapters.lora_adapter import LoraAdapter
from ...adapters.lora_store import lora_footprint
from ...models.adapter import DecoderAdapter
from ...optim import adamw, adamw8bit
from ...store import FlatLayout, StoreFootprint
from ...util.host_memory import locked_nbytes, page_lock, page_size
from ...util.units import human_bytes, tensor_nbytes

_POLL_S = 0.005
_FILES_PER_UNIT = 8
"""Files a unit maps at most (master, optimizer state tensors): each rounds up to a page."""


def shared_store_nbytes(model: PretrainedConfig | DecoderAdapter | LoraAdapter,
                        compute_dtype: torch.dtype, moments: list[str] | None) -> int:
    """Bytes a node's shared store maps (masters, copy-source arena, optimizer state, in whole
    pages, plus the update counters; gradients are private), computed on the meta device."""
    adapter = model if isinstance(model, (DecoderAdapter, LoraAdapter)) else DecoderAdapter(model)
    numels = [FlatLayout.of(u).numel for u in adapter.units]
    kinds = moments or ["fp32"] * len(numels)
    state_nbytes = {"fp32": adamw.state_nbytes, "8bit": adamw8bit.state_nbytes}
    state = sum(state_nbytes[k](n) for n, k in zip(numels, kinds))
    fp = (lora_footprint(adapter, compute_dtype, pin=False, state_nbytes=state)
          if isinstance(adapter, LoraAdapter)
          else StoreFootprint.of_numels(numels, compute_dtype.itemsize, state_nbytes=state))
    return fp.total - fp.grad + (_FILES_PER_UNIT * len(numels) + 2) * page_size()


def shm_free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged process may still write in the filesystem holding ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def shm_space_problem(shm_dir: str | Path, need_bytes: int,
                      free_bytes: Callable[[Path], int] = shm_free_bytes) -> str | None:
    """What is wrong when ``shm_dir`` cannot hold ``need_bytes`` (None: it can, or it is not a
    directory, which the allocator reports)."""
    path = Path(shm_dir)
    if not path.is_dir():
        return None
    free = free_bytes(path)
    if free >= need_bytes:
        return None
    return (f"dist.shm_dir {str(path)!r} has {human_bytes(free)} free, but the node's shared host "
            f"store needs {human_bytes(need_bytes)} there (masters, copy sources and optimizer "
            "state); past its size a tmpfs write ends the process with SIGBUS. Enlarge it "
            "(docker run --shm-size=..., or `mount -o remount,size=... /dev/shm`), point "
            "dist.shm_dir at a tmpfs with room, or use 8-bit optimizer moments (plan=auto picks "
            "them when memory binds)")


class SharedAllocator:
    """``HostAllocator`` mapping each buffer from a file shared by the ranks of a node."""

    def __init__(self, shm_dir: str | Path, prefix: str, creator: bool, timeout_s: float):
        self.dir, self.prefix, self.creator, self.timeout_s = Path(shm_dir), prefix, creator, timeout_s
        if creator and not self.dir.is_dir():
            raise ValueError(f"dist_shm_dir {str(self.dir)!r} is not a directory; point it at a "
                             "tmpfs (e.g. /dev/shm) with room for the host store")
        self._count = 0
        self.created: list[Path] = []
        self.mapped_nbytes = 0
        """Bytes of all files this process mapped (whole pages)."""

    def _map(self, nbytes: int) -> torch.Tensor:
        path = self.dir / f"{self.prefix}-{self._count}"
        self._count += 1
        size = locked_nbytes(max(nbytes, 1))
        if self.creator:
            tmp = path.with_name(path.name + ".tmp")
            fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                os.ftruncate(fd, size)  # tmpfs: zero pages, allocated when first touched
            finally:
                os.close(fd)
            os.rename(tmp, path)
            self.created.append(path)
        else:
            self._wait_for(path, size)
        self.mapped_nbytes += size
        return torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)

    def _wait_for(self, path: Path, size: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                have = path.stat().st_size
            except FileNotFoundError:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"{path} did not appear within dist.timeout_s={self.timeout_s:g} s: local "
                        "rank 0, which creates the node's shared host store, died or stalled") from None
                time.sleep(_POLL_S)
                continue
            if have != size:
                raise RuntimeError(f"{path} holds {human_bytes(have)}, this rank expected "
                                   f"{human_bytes(size)}: the local ranks built different models")
            return

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        return self._map(nbytes)[:nbytes].view(dtype)

    def arena(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, int]:
        raw = self._map(nbytes)
        if not pin:
            return raw[:nbytes], 0
        try:
            page_lock(raw)  # the mapping is page-aligned and whole pages
        except Exception as e:  # pragma: no cover - CUDA only
            warnings.warn(f"page-locking the shared {human_bytes(nbytes)} copy-source arena failed "
                          f"({e}); weights will be copied from pageable memory", RuntimeWarning,
                          stacklevel=2)
            return raw[:nbytes], 0
        return raw[:nbytes], tensor_nbytes(raw)

    def unlink(self) -> None:
        """Remove the files this process created (mappings stay valid)."""
        for path in self.created:
            for p in (path, path.with_name(path.name + ".tmp")):
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
        self.created.clear()
