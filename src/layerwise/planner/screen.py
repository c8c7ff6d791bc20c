"""The search's screening simulations: each plan simulated once per kind, long accumulations
extrapolated from a few groups of micro-batches (the emitted plan is simulated in full)."""

from __future__ import annotations

import copy
from typing import Any

from .hardware import HardwareProfile
from ..plan.plan import Plan
from ..plan.shape import ModelShape
from .simulator import SimResult, simulate

__all__ = ["Sims", "extrapolated", "simulate_fast"]


def simulate_fast(plan: Plan, shape: ModelShape, hw: HardwareProfile) -> SimResult:
    """The simulator, with long accumulations extrapolated from 3 and 4 groups of micro-batches.

    Groups repeat identically, so the step grows linearly in their number. Memory peaks usually do
    not, except when a copy lane falls behind compute (qwen-27b on a 70 GB h800: 65 GB at 3 groups,
    137 GB at 64): a peak that grows from 3 to 4 is extrapolated too. For screening only; the
    emitted plan is simulated in full."""
    if not extrapolated(plan):
        return simulate(plan, shape, hw, keep_trace=False)
    per = plan.micro_batches_per_load
    m = plan.num_micro_batches
    short = []
    for k in (3, 4):
        d = plan.to_dict()
        d["num_micro_batches"] = k * per
        short.append(simulate(Plan.from_dict(d), shape, hw, keep_trace=False))
    a, b = short
    groups = m // per
    res = b
    res.plan = plan
    res.step_s = b.step_s + (groups - 4) * (b.step_s - a.step_s)
    res.busy_s = {k: v + (groups - 4) * (v - a.busy_s[k]) for k, v in b.busy_s.items()}
    res.tokens_per_step = b.tokens_per_step // (4 * per) * m
    res.model_flops_per_step = b.model_flops_per_step / (4 * per) * m
    res.recompute_s = b.recompute_s / (4 * per) * m
    for f in ("peak_device_bytes", "peak_pinned_act_bytes", "peak_nvme_bytes"):
        grow = getattr(b, f) - getattr(a, f)
        if grow > 0:  # a fixed allocation is there from the first group: this is a backlog
            setattr(res, f, getattr(b, f) + (groups - 4) * grow)
    return res


def extrapolated(plan: Plan) -> bool:
    """Whether :func:`simulate_fast` extrapolates ``plan`` (more than 4 groups of micro-batches)."""
    per = plan.micro_batches_per_load
    return plan.num_micro_batches > 4 * per and plan.num_micro_batches % per == 0


class Sims:
    """The simulations of one search, each plan run once per kind (screening, full): the search
    meets the same plan again (every-1 is keep-all-device, the MILP may return its warm start,
    the polish and the per-rule pick re-screen what was screened), ~15% of its simulations."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile):
        self.shape, self.hw = shape, hw
        self._done: dict[tuple[Any, ...], SimResult] = {}

    def fast(self, plan: Plan) -> SimResult:
        """:func:`simulate_fast` of ``plan`` (the full simulation where that does not extrapolate)."""
        return self._run(plan, extrapolated(plan))

    def full(self, plan: Plan) -> SimResult:
        """``plan`` simulated in full, without the trace."""
        return self._run(plan, False)

    def _run(self, plan: Plan, fast: bool) -> SimResult:
        key = (fast, *(tuple(v) if isinstance(v, list) else v for k, v in vars(plan).items()
                       if k not in ("source", "predicted")))
        res = self._done.get(key)
        if res is None:
            res = self._done[key] = (simulate_fast(plan, self.shape, self.hw) if fast
                                     else simulate(plan, self.shape, self.hw, keep_trace=False))
        res = copy.copy(res)  # the same numbers, about this plan (its name)
        res.plan = plan
        return res
