"""Host copies of live training state as the blobs store them, and a pool of reused host buffers
(fresh pages cost more than the copy). One thread at a time uses the pool."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping

import torch

from .provider import PARAM, StateProvider, group_tensors


def stored_nbytes(key: str, t: torch.Tensor) -> int:
    """Bytes ``t`` takes in a blob under ``key`` (``stored_dtype``)."""
    return t.numel() * stored_dtype(key, t).itemsize


def stored_dtype(key: str, t: torch.Tensor) -> torch.dtype:
    """The dtype ``t`` has in a blob under ``key``: floating optimizer state is stored as fp32."""
    return torch.float32 if not key.startswith(PARAM) and t.is_floating_point() else t.dtype


def as_blob_tensor(t: torch.Tensor, key: str, flat: bool = False) -> torch.Tensor:
    """``t`` as the blob stores it, without a copy when it already is: a contiguous host tensor,
    optimizer state fp32; ``step/`` scalars 0-d, or every tensor 1-D when ``flat`` (a shard)."""
    t = t.detach()
    if flat:
        t = t.reshape(-1)
    elif key.startswith("step/"):
        t = t.reshape(())
    if t.dtype != stored_dtype(key, t):
        t = t.float()
    if t.device.type != "cpu" or not t.is_contiguous():
        t = t.to("cpu").contiguous()
    return t


class HostBufferPool:
    """Host buffers by (shape, dtype, pinned), handed out for copies and taken back for reuse."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def copy(self, t: torch.Tensor, key: str) -> torch.Tensor:
        """A contiguous host copy of ``t`` in its blob form (optimizer state fp32, weights in
        their dtype). From a device, the copy goes to pinned memory without waiting: call
        ``synchronize_if_pinned`` before reading it (``copy_group`` does)."""
        t = t.detach()
        if key.startswith("step/"):
            t = t.reshape(())
        shape, dtype, pinned = slot = _slot(t, key)
        free = self._free.get(slot)
        if free:
            out = free.pop()
        else:
            out = torch.empty(shape, dtype=dtype, pin_memory=pinned)
        out.copy_(t, non_blocking=pinned)
        return out

    def fresh_nbytes(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Bytes ``copy`` would allocate for these (key, tensor) pairs: those no free buffer
        of the pool takes (a buffer serves one tensor). A pinned buffer counts as torch's
        caching host allocator takes it: rounded up to a power of two."""
        taken: dict[tuple, int] = {}
        fresh = 0
        for key, t in tensors:
            slot = _slot(t.reshape(()) if key.startswith("step/") else t, key)
            n = taken.get(slot, 0)
            if n < len(self._free.get(slot, ())):
                taken[slot] = n + 1
            else:
                n = stored_nbytes(key, t)
                fresh += 1 << max(n - 1, 0).bit_length() if slot[2] else n
        return fresh

    def copy_group(self, tensors: Mapping[str, torch.Tensor],
                   prefix: str = "") -> dict[str, torch.Tensor]:
        """Host copies of one group's tensors, complete on return; ``prefix + key`` is each
        one's blob key (``PARAM`` for weights by name)."""
        out = {k: self.copy(t, prefix + k) for k, t in tensors.items()}
        synchronize_if_pinned(out.values())
        return out

    def recycle(self, tensors: Iterable[torch.Tensor]) -> None:
        """Take buffers back; the caller no longer reads them."""
        for t in tensors:
            self._free.setdefault((tuple(t.shape), t.dtype, t.is_pinned()), []).append(t)


def _slot(t: torch.Tensor, key: str) -> tuple[tuple[int, ...], torch.dtype, bool]:
    """The pool's key of ``t``'s copy: its shape, its blob dtype, pinned when from a device."""
    return tuple(t.shape), stored_dtype(key, t), t.device.type != "cpu"


def synchronize_if_pinned(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the device copies into pinned buffers among ``tensors`` (none on the CPU)."""
    if any(t.is_pinned() for t in tensors):
        torch.cuda.synchronize()


class GroupsOnDemand(Mapping):
    """The chosen groups of a save that does not copy, each read from the provider when used, so an
    importing provider holds one group at a time, not every chosen one."""

    def __init__(self, provider: StateProvider, groups: list[str]):
        self.provider, self.groups = provider, groups

    def __getitem__(self, group: str) -> dict[str, torch.Tensor]:
        if group not in self.groups:
            raise KeyError(group)
        return {k: as_blob_tensor(t, k) for k, t in group_tensors(self.provider, group).items()}

    def __contains__(self, group: object) -> bool:  # Mapping's would read the group
        return group in self.groups

    def __iter__(self) -> Iterator[str]:
        return iter(self.groups)

    def __len__(self) -> int:
        return len(self.groups)
