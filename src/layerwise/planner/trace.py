"""What a simulated step records: the lanes' clocks, lane intervals, allocations with their
lifetimes, and the result (step time, busy seconds, peaks) that ``check`` and ``timeline`` read."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan.plan import Plan

LANES = ("compute", "h2d", "d2h", "host", "nvme", "optimizer", "intra", "inter")
RESIDENT_SLOT = "resident"
"""The slot name of a resident layer's weight refresh in its copy's label (``w layers.3 @resident``):
its own buffer, not one of the weight slots."""


@dataclass(slots=True)
class Interval:
    lane: str
    start: float
    end: float
    label: str
    step: int


@dataclass(slots=True)
class Alloc:
    tier: str
    """``device``, ``host`` (pinned activations; the store is counted separately) or ``nvme``."""
    start: float
    end: float
    nbytes: int
    label: str


@dataclass
class SimResult:
    plan: Plan
    step_s: float
    tokens_per_step: int
    model_flops_per_step: float
    busy_s: dict[str, float]
    """Busy seconds per lane inside the measured step."""
    peak_device_bytes: int
    device_cap_bytes: int
    peak_pinned_act_bytes: int
    """Peak pinned host bytes held by offloaded activations (and NVMe staging)."""
    host_store_bytes: int
    host_cap_bytes: int
    peak_nvme_bytes: int
    nvme_cap_bytes: int
    recompute_s: float
    """Compute seconds per step spent recomputing dropped boundaries."""
    window: tuple[float, float]
    """(start, end) of the measured step on the simulated clock."""
    intervals: list[Interval] = field(repr=False, default_factory=list)
    allocs: list[Alloc] = field(repr=False, default_factory=list)
    op_log: list[dict[str, Any]] = field(repr=False, default_factory=list)
    """Every compute op: kind, index, micro-batch, step, start, end, needs (weights, boundary)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def achieved_tflops(self) -> float:
        return self.model_flops_per_step / self.step_s / 1e12

    @property
    def idle_s(self) -> dict[str, float]:
        return {k: max(0.0, self.step_s - v) for k, v in self.busy_s.items()}

    @property
    def peak_host_bytes(self) -> int:
        return self.host_store_bytes + self.peak_pinned_act_bytes

    def over_capacity(self) -> dict[str, int]:
        """Bytes over capacity per tier (empty when the plan fits)."""
        out = {}
        for tier, used, cap in (("device", self.peak_device_bytes, self.device_cap_bytes),
                                ("host", self.peak_host_bytes, self.host_cap_bytes),
                                ("nvme", self.peak_nvme_bytes, self.nvme_cap_bytes)):
            if used > cap:
                out[tier] = used - cap
        return out

    @property
    def fits(self) -> bool:
        return not self.over_capacity()

    def summary(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "achieved_tflops": self.achieved_tflops,
            "recompute_s": self.recompute_s,
            "peak_device_bytes": self.peak_device_bytes,
            "device_cap_bytes": self.device_cap_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "peak_pinned_act_bytes": self.peak_pinned_act_bytes,
            "peak_nvme_bytes": self.peak_nvme_bytes,
            "busy_s": dict(self.busy_s),
            "idle_s": self.idle_s,
            "fits": self.fits,
        }


def peak_bytes(allocs: list[Alloc], tier: str) -> int:
    """Largest sum of live ``tier`` allocations at any instant ([start, end) intervals)."""
    live = [a for a in allocs if a.tier == tier and a.nbytes and a.end > a.start]
    if not live:
        return 0
    n = len(live)
    times = np.fromiter((t for a in live for t in (a.start, a.end)), dtype=np.float64, count=2 * n)
    nbytes = np.fromiter((a.nbytes for a in live), dtype=np.int64, count=n)
    deltas = np.stack([nbytes, -nbytes], axis=1).ravel()  # exact: integer sums
    frees_first = np.tile(np.array([1, 0], dtype=np.int8), n)  # frees before allocations at one instant
    held = np.cumsum(deltas[np.lexsort((frees_first, times))])
    return max(0, int(held.max()))


GAP_LANES = ("nvme",)
"""Lanes whose busy intervals are kept, so that work issued late in the simulator's order but
early in time (``Lanes.fill``) can run in an idle gap."""


class Lanes:
    """Each lane's clock: work runs in issue order, one item at a time; on a synchronous machine
    the copy, host and optimizer lanes are the compute lane."""

    def __init__(self, synchronous: bool, me: int = 0):
        self.free: dict[str, float] = {}
        self.busy: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in GAP_LANES}
        """Per ``GAP_LANES`` lane: the (starts, ends) of its work, in time order."""
        self.map = {k: k for k in LANES}
        if synchronous:
            for k in ("h2d", "d2h", "host", "optimizer", "intra", "inter"):
                self.map[k] = "compute"
        self.me = me
        """The simulated process (local rank); other ranks' lanes are timed, not traced."""
        self.spans: list[tuple[str, float, float, str, int]] = []
        """The simulated process's work: (lane, start, end, label, step), as :class:`Interval`'s
        fields (tuples: the search's simulations make ~10^6 of them)."""
        self.step = 0

    def run(self, lane: str, earliest: float, dur: float, label: str, rank: int | None = None) -> tuple[float, float]:
        """Run on the simulated process's ``lane``, or on another local ``rank``'s own one."""
        mine = rank is None or rank == self.me
        physical = self.map[lane] if mine else f"{lane}@{rank}"
        free = self.free.get(physical, 0.0)
        start = earliest if earliest > free else free
        end = start + dur
        self.free[physical] = end
        if physical in self.busy and dur > 0:
            starts, ends = self.busy[physical]
            starts.append(start)
            ends.append(end)
        if dur > 0 and mine:
            self.spans.append((lane, start, end, label, self.step))
        return start, end

    def fill(self, lane: str, earliest: float, dur: float, label: str) -> tuple[float, float]:
        """Run on a ``GAP_LANES`` lane in its first idle gap from ``earliest`` long enough: work
        the engine issues as soon as it may (the next step's copy-source reads, read ahead while
        the optimizer's state traffic is queued) though the simulator reaches it later."""
        if dur <= 0:
            return earliest, earliest
        starts, ends = self.busy[lane]
        k = bisect.bisect_right(ends, earliest)
        t = earliest
        while k < len(starts) and starts[k] < t + dur:
            t = max(t, ends[k])
            k += 1
        starts.insert(k, t)
        ends.insert(k, t + dur)
        self.free[lane] = max(self.free.get(lane, 0.0), t + dur)
        self.spans.append((lane, t, t + dur, label, self.step))
        return t, t + dur

    def intervals(self) -> list[Interval]:
        return [Interval(*s) for s in self.spans]

    def free_at(self, lane: str) -> float:
        return self.free.get(self.map[lane], 0.0)
