"""Pick a backend by device name."""

from __future__ import annotations

import torch

from .backend import CpuBackend, CudaBackend, DeviceBackend
from .backend_async import AsyncCpuBackend


def make_backend(device: str | torch.device, async_seed: int | None = None) -> DeviceBackend:
    """``cpu``, ``cpu-async`` (lanes as threads with seeded delays; ``async_seed``) or ``cuda[:N]``."""
    if str(device) == "cpu-async":
        return AsyncCpuBackend(seed=async_seed)
    dev = torch.device(device)
    if dev.type == "cpu":
        return CpuBackend()
    if dev.type == "cuda":
        return CudaBackend(dev)
    raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cpu-async' or 'cuda[:N]'")
