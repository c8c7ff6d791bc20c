"""Device backends: how bytes move between host and device, and what the device holds.

The engine is written once against :class:`DeviceBackend`. :class:`CudaBackend` overlaps copies
with compute (a host-to-device stream, a device-to-host stream, events, pinned memory,
non-blocking copies, ``record_stream`` so the caching allocator never reuses a buffer that
another stream still reads). :class:`CpuBackend` does the same copies synchronously, so every
code path of the engine runs, and is tested, on a machine without a GPU.

Both backends keep a ledger of the device bytes the engine holds (weights, activations,
gradients in flight), so the peak is reported the same way on both; on CUDA the allocator's own
peak is reported too.
"""

from __future__ import annotations

import threading
from typing import Protocol

import torch


class Pending(Protocol):
    """A copy that may still be in flight."""

    def wait(self) -> torch.Tensor:
        """For H2D: make the compute stream wait, return the device tensor.
        For D2H: block the calling host thread until the bytes have landed, return them."""


class Done:
    """A copy that has already completed (CPU backend)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def wait(self) -> torch.Tensor:
        return self.tensor


class Ledger:
    """Live and peak device bytes the engine holds, by category."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.live_bytes = 0
        self.peak_bytes = 0
        self.by_kind: dict[str, int] = {}

    def add(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.live_bytes += nbytes
            self.by_kind[kind] = self.by_kind.get(kind, 0) + nbytes
            self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def sub(self, kind: str, nbytes: int) -> None:
        with self._lock:
            self.live_bytes -= nbytes
            self.by_kind[kind] -= nbytes
            assert self.live_bytes >= 0 and self.by_kind[kind] >= 0, "ledger went negative"

    def peak_with(self, transient_bytes: int) -> None:
        """Record a transient (e.g. autograd workspace) on top of what is live now."""
        with self._lock:
            self.peak_bytes = max(self.peak_bytes, self.live_bytes + transient_bytes)

    def reset_peak(self) -> None:
        with self._lock:
            self.peak_bytes = self.live_bytes


class DeviceBackend(Protocol):
    device: torch.device
    ledger: Ledger

    def to_device(self, host: torch.Tensor) -> Pending:
        """Start copying a host tensor to a new device tensor (same dtype)."""

    def to_host(self, dev: torch.Tensor) -> Pending:
        """Start copying a device tensor (produced on the compute stream) to host memory."""

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """Host memory suitable as a copy source/target (pinned on CUDA)."""

    def synchronize(self) -> None: ...

    def allocator_peak_bytes(self) -> int | None:
        """The device allocator's peak since the last reset, if the device has one."""

    def reset_allocator_peak(self) -> None: ...


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class CpuBackend:
    """Synchronous backend: the "device" is host memory; copies are real, completed at once."""

    def __init__(self) -> None:
        self.device = torch.device("cpu")
        self.ledger = Ledger()

    def to_device(self, host: torch.Tensor) -> Pending:
        return Done(host.clone())

    def to_host(self, dev: torch.Tensor) -> Pending:
        return Done(dev.clone())

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype)

    def synchronize(self) -> None:
        pass

    def allocator_peak_bytes(self) -> int | None:
        return None

    def reset_allocator_peak(self) -> None:
        pass


class _CudaH2D:
    def __init__(self, dst: torch.Tensor, event: torch.cuda.Event):
        self.dst, self.event = dst, event

    def wait(self) -> torch.Tensor:
        compute = torch.cuda.current_stream(self.dst.device)
        compute.wait_event(self.event)
        # dst was allocated on the copy stream; tell the allocator compute uses it too.
        self.dst.record_stream(compute)
        return self.dst


class _CudaD2H:
    def __init__(self, dst: torch.Tensor, event: torch.cuda.Event):
        self.dst, self.event = dst, event

    def wait(self) -> torch.Tensor:
        self.event.synchronize()
        return self.dst


class CudaBackend:
    """Copies on their own streams so transfers overlap compute."""

    def __init__(self, device: str | torch.device = "cuda"):
        if not torch.cuda.is_available():
            raise ValueError("CUDA backend requested but torch.cuda.is_available() is False; use device='cpu'")
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.h2d_stream = torch.cuda.Stream(self.device)
        self.d2h_stream = torch.cuda.Stream(self.device)
        self.ledger = Ledger()

    def to_device(self, host: torch.Tensor) -> Pending:
        assert host.device.type == "cpu"
        with torch.cuda.stream(self.h2d_stream):
            dst = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            dst.copy_(host, non_blocking=host.is_pinned())
            event = torch.cuda.Event()
            event.record(self.h2d_stream)
        return _CudaH2D(dst, event)

    def to_host(self, dev: torch.Tensor) -> Pending:
        compute = torch.cuda.current_stream(self.device)
        ready = torch.cuda.Event()
        ready.record(compute)
        dst = torch.empty(dev.shape, dtype=dev.dtype, pin_memory=True)
        with torch.cuda.stream(self.d2h_stream):
            self.d2h_stream.wait_event(ready)
            dst.copy_(dev, non_blocking=True)
            dev.record_stream(self.d2h_stream)
            done = torch.cuda.Event()
            done.record(self.d2h_stream)
        return _CudaD2H(dst, done)

    def host_empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(numel, dtype=dtype, pin_memory=True)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def allocator_peak_bytes(self) -> int | None:
        return int(torch.cuda.max_memory_allocated(self.device))

    def reset_allocator_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)


def make_backend(device: str | torch.device) -> DeviceBackend:
    dev = torch.device(device)
    if dev.type == "cpu":
        return CpuBackend()
    if dev.type == "cuda":
        return CudaBackend(dev)
    raise ValueError(f"unsupported device {device!r}; use 'cpu' or 'cuda[:N]'")
