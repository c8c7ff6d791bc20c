"""Moving weights in, gradients out, and activations between tiers.

- :class:`WeightStreamer` follows the step's weight schedule ``depth`` uses ahead, so the copy
  of the next layer's weights runs while the current layer computes (depth 1 = double buffer).
  A unit needed again inside the window is not copied twice. Which copies to make is decided by
  :class:`layerwise.plan.program.WeightWindow`, the rule the memory model and simulator count.
- :class:`GradSink` sends each unit's flat gradient to the host and accumulates it in fp32;
  once a unit's gradient is final it also takes the unit's squared norm, so the global clip
  factor is known the moment the backward ends.
- :class:`ActivationStore` keeps layer-boundary activations on the tier the plan says.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from ..optim.clip import sq_norm
from ..plan.program import WeightWindow
from ..store import HostStore
from .backend import DeviceBackend, Pending


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class WeightStreamer:
    def __init__(self, backend: DeviceBackend, store: HostStore, depth: int,
                 wait_ready: Callable[[str], None]):
        self.backend = backend
        self.store = store
        self.depth = depth
        self.wait_ready = wait_ready
        """Blocks until a unit's host weights are final (its optimizer update is done)."""
        self._window = WeightWindow([], depth)
        self._buffers: dict[str, tuple[Pending, int]] = {}  # unit -> (device copy, nbytes)

    def begin(self, schedule: list[str]) -> None:
        assert self.finished(), "previous schedule not finished"
        self._window = WeightWindow(schedule, self.depth)
        self._copy_in(self._window.fill())

    def _copy_in(self, units: list[str]) -> None:
        for unit in units:
            self.wait_ready(unit)
            buf = self.store[unit]
            src = buf.compute if buf.compute is not None else buf.master
            nbytes = _nbytes(src)
            self.backend.ledger.add("weights", nbytes)
            self._buffers[unit] = (self.backend.to_device(src), nbytes)

    def acquire(self, unit: str) -> torch.Tensor:
        """The device copy of ``unit``'s weights; starts the next prefetch first."""
        self._copy_in(self._window.acquire(unit))
        return self._buffers[unit][0].wait()

    def release(self, unit: str) -> None:
        if self._window.release(unit):
            _, nbytes = self._buffers.pop(unit)
            self.backend.ledger.sub("weights", nbytes)

    def reset(self) -> None:
        """Forget the rest of the schedule (a step failed); buffers are released."""
        for _, nbytes in self._buffers.values():
            self.backend.ledger.sub("weights", nbytes)
        self._buffers.clear()
        self._window = WeightWindow([], self.depth)

    def finished(self) -> bool:
        return self._window.finished() and not self._buffers


class GradSink:
    def __init__(self, backend: DeviceBackend, store: HostStore):
        self.backend = backend
        self.store = store
        self.inline = backend.device.type == "cpu"
        self._pool = None if self.inline else ThreadPoolExecutor(1, thread_name_prefix="grad-sink")
        self._futures: list[Future] = []
        self.sq_norms: dict[str, float] = {}

    def put(self, unit: str, parts: list[torch.Tensor], final: bool) -> None:
        """Accumulate a unit's gradient, given per parameter in layout order, into the host grad.

        On the CPU each part is added straight into its slice; on a device the parts are joined
        into one contiguous buffer, so the gradient leaves in one copy.
        """
        buf = self.store[unit]
        host_grad = buf.grad
        if self.inline:
            for sl, part in zip(buf.layout.slices(), parts):
                host_grad[sl].add_(part.reshape(-1))
            if final:
                self.sq_norms[unit] = sq_norm(host_grad)
            return
        grad = torch.cat([p.reshape(-1) for p in parts])
        nbytes = _nbytes(grad)
        self.backend.ledger.add("grads", nbytes)
        pending = self.backend.to_host(grad)  # the device buffer lives until the copy lands

        def land() -> None:
            landed = pending.wait()
            self.backend.ledger.sub("grads", nbytes)
            host_grad.add_(landed)
            if final:
                self.sq_norms[unit] = sq_norm(host_grad)

        self._futures.append(self._pool.submit(land))

    def abandon(self) -> None:
        """Wait for copies in flight and forget them (a step failed)."""
        for f in self._futures:
            f.exception()
        self._futures.clear()
        self.sq_norms = {}

    def finish(self) -> dict[str, float]:
        """Wait for every gradient to land; returns the squared norm per unit."""
        for f in self._futures:
            f.result()
        self._futures.clear()
        out, self.sq_norms = self.sq_norms, {}
        return out


class ActivationStore:
    """Boundary activations by tier: ``device``, ``host``, ``nvme`` or dropped (``recompute``)."""

    def __init__(self, backend: DeviceBackend, spill_dir: str | Path | None = None):
        self.backend = backend
        self._spill_root = spill_dir
        self._spill_dir: Path | None = None
        self._io = ThreadPoolExecutor(1, thread_name_prefix="nvme-io")
        self._entries: dict[int, tuple[str, object]] = {}
        self._on_device: dict[int, torch.Tensor] = {}
        self.nvme_bytes_written = 0

    def _dir(self) -> Path:
        if self._spill_dir is None:
            if self._spill_root is not None:
                Path(self._spill_root).mkdir(parents=True, exist_ok=True)
            self._spill_dir = Path(tempfile.mkdtemp(prefix="layerwise-spill-", dir=self._spill_root))
        return self._spill_dir

    def _hold(self, i: int, t: torch.Tensor) -> None:
        self._on_device[i] = t
        self.backend.ledger.add("activations", _nbytes(t))

    def store(self, i: int, h: torch.Tensor, tier: str) -> None:
        if tier == "recompute":
            return
        if tier == "device":
            self._hold(i, h)
            return
        pending = self.backend.to_host(h)
        meta = (tuple(h.shape), h.dtype)
        if tier == "host":
            self._entries[i] = ("host", (pending, meta))
        elif tier == "nvme":
            path = self._dir() / f"boundary-{i}.bin"
            self._entries[i] = ("nvme", (self._io.submit(self._write, pending, path), meta))
            self.nvme_bytes_written += _nbytes(h)
        else:
            raise ValueError(f"unknown tier {tier!r}")

    @staticmethod
    def _write(pending: Pending, path: Path) -> Path:
        t = pending.wait()
        with open(path, "wb") as f:
            f.write(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        return path

    def _read(self, path_future: Future, meta) -> torch.Tensor:
        path = path_future.result()
        shape, dtype = meta
        numel = int(np.prod(shape))
        out = self.backend.host_empty(numel, dtype)
        with open(path, "rb") as f:
            f.readinto(out.view(torch.uint8).numpy())
        os.unlink(path)
        return out.view(shape)

    def prefetch(self, i: int) -> None:
        """Start bringing boundary ``i`` back (NVMe: the file read runs in the background)."""
        entry = self._entries.get(i)
        if entry and entry[0] == "nvme":
            fut, meta = entry[1]
            self._entries[i] = ("nvme-reading", (self._io.submit(self._read, fut, meta), meta))

    def fetch(self, i: int) -> None:
        """Make boundary ``i`` present on the device."""
        if i in self._on_device:
            return
        self.prefetch(i)
        tier, (handle, _meta) = self._entries.pop(i)
        if tier == "host":
            host = handle.wait()
        else:
            host = handle.result()
        self._hold(i, self.backend.to_device(host).wait())

    def put_recomputed(self, i: int, h: torch.Tensor) -> None:
        self._hold(i, h)

    def get(self, i: int) -> torch.Tensor:
        return self._on_device[i]

    def drop(self, i: int) -> None:
        t = self._on_device.pop(i, None)
        if t is not None:
            self.backend.ledger.sub("activations", _nbytes(t))

    def clear(self) -> None:
        for i in list(self._on_device):
            self.drop(i)
        self._entries.clear()

    def close(self) -> None:
        self.clear()
        self._io.shutdown(wait=True)
        if self._spill_dir is not None:
            for p in self._spill_dir.glob("*"):
                p.unlink()
            self._spill_dir.rmdir()
            self._spill_dir = None
