"""What the simulator holds while a group of micro-batches runs: each micro-batch's boundaries
and internals, and what the group's op runs share (the compute queue's history, the offload
window)."""

from __future__ import annotations

from ..plan.memory import OFFLOAD_WINDOW_OPS
from .trace import Alloc


class MicroBatch:
    """Where each boundary and each layer's internals are during one micro-batch."""

    def __init__(self) -> None:
        self.ready: dict[int, float] = {}
        """Boundary -> when it is on the device."""
        self.held: dict[int, Alloc] = {}
        """Boundary -> its device allocation."""
        self.offloaded: dict[int, tuple[float, Alloc]] = {}
        """Host/NVMe boundary -> (when it is in host memory, its host allocation)."""
        self.nvme_written: dict[int, tuple[float, Alloc]] = {}
        self.internals_host: dict[int, tuple[float, Alloc]] = {}
        """Layer with host-tier internals -> (when they are in host memory, their host allocation)."""
        self.internals_ready: dict[int, float] = {}
        self.internals_held: dict[int, Alloc] = {}
        """Layer -> its internals' device allocation."""


class Group:
    """What the micro-batches of one group share as they run each op in turn: the compute
    queue's history and the offload window, counted in op runs (one op for one micro-batch)."""

    def __init__(self, index: int, micro_batches: tuple[int, ...], prev_start: float):
        self.index = index
        self.mbs = {mb: MicroBatch() for mb in micro_batches}
        self.prev_start = prev_start
        """When the last compute op started (a boundary's fetch is issued then)."""
        self.issued: list[float] = []
        """Per op of the program: when the compute queued before its first run has run."""
        self.offload_end: dict[int, float] = {}
        """Op run -> when the offloads it queued have left the device."""
        self.offload_wait = 0.0
        """Compute waits for the offloads queued ``OFFLOAD_WINDOW_OPS`` op runs back."""
        self.run = -1
        """The op run in progress (what its offloads are recorded under)."""

    def begin_run(self) -> None:
        self.run += 1
        self.offload_wait = max(self.offload_wait, self.offload_end.pop(self.run - OFFLOAD_WINDOW_OPS, 0.0))
