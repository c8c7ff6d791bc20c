"""One host store per node: its buffers in shared memory, mapped by every local rank.

Each buffer the store (or an optimizer's ``init_state``) asks for is one file in ``shm_dir``
(tmpfs: ``/dev/shm``), mapped ``MAP_SHARED`` with ``torch.from_file``. Local rank 0 creates
each file (made under a temporary name and renamed, so it appears whole); the other local ranks
map the file of the same name. Every rank asks for the same buffers in the same order (they
run the same code on the same model), so the n-th request names the n-th file.

The files are unlinked by their creator as soon as every local rank has mapped them
(``unlink``, after a barrier): the memory stays until the last process unmaps it, and nothing
is left in ``/dev/shm`` however the run ends. Before that point ``unlink`` also runs on error.
Copy sources are page-locked in place (``cudaHostRegister`` of the mapped region), as the
private store's arena is.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

import torch

from ...util.host_memory import locked_nbytes, page_lock
from ...util.units import human_bytes, tensor_nbytes

_POLL_S = 0.005


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
                        f"{path} did not appear within dist_timeout_s={self.timeout_s:g} s: local "
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
