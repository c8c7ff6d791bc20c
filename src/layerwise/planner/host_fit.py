"""What host memory a plan needs beside its store, and the optimizer moments that make it fit:
the fewest parameters switched to 8-bit moments (fp32 keeps the host optimizer faster), with
the store's gradients in bf16 where every unit's gradient lands once per step."""

from __future__ import annotations

from typing import Any

from .cost import STATE_NBYTES, CostModel
from .hardware import HardwareProfile
from ..plan.plan import Plan
from ..plan.shape import ModelShape
from .simulator import simulate
from .step_model import NVME_STAGING


class PlanInfeasible(ValueError):
    """No plan fits: ``resource`` is the binding one, ``over_bytes`` by how much."""

    def __init__(self, resource: str, over_bytes: int, detail: str):
        self.resource, self.over_bytes = resource, over_bytes
        super().__init__(detail)


def choose_moments(shape: ModelShape, hw: HardwareProfile, reserve_bytes: int = 0,
                   bf16_grads: bool = False) -> list[str]:
    """fp32 moments unless the host store would not fit; then the fewest 8-bit parameters.
    ``bf16_grads``: the store of a plan whose gradients land once per step (bf16 compute)."""
    cost = CostModel(shape, hw, 1, 1)
    units = shape.unit_names()
    budget = hw.host_cap_bytes - reserve_bytes
    moments = ["fp32"] * len(units)
    over = cost.host_store_bytes(moments, bf16_grads) - budget
    if over <= 0:
        return moments

    def saving(k: int) -> int:  # exact bytes 8-bit moments free on unit k
        n = shape.trainable_params(units[k])  # a frozen base's units: the adapters' state
        return STATE_NBYTES["fp32"](n) - STATE_NBYTES["8bit"](n)

    all8 = cost.host_store_bytes(["8bit"] * len(units), bf16_grads)
    if all8 > budget:
        lean = " and bf16 gradients (one landing per step)" if bf16_grads and hw.compute_dtype_bytes == 2 else ""
        raise PlanInfeasible(
            "host", all8 - budget,
            f"host memory binds: the host store of {shape.name} needs {human_bytes(all8)} even with "
            f"8-bit optimizer moments everywhere{lean}, but {human_bytes(budget)} is usable "
            f"({human_bytes(all8 - budget)} over); use a machine with more RAM or --host-mem")
    # largest units first, then drop any that is not needed (fewest 8-bit parameters, greedily)
    order = sorted(range(len(units)), key=lambda k: -shape.trainable_params(units[k]))
    chosen: list[int] = []
    freed = 0
    for k in order:
        if freed >= over:
            break
        chosen.append(k)
        freed += saving(k)
    for k in sorted(chosen, key=lambda k: shape.trainable_params(units[k])):
        if freed - saving(k) >= over:
            chosen.remove(k)
            freed -= saving(k)
    for k in chosen:
        moments[k] = "8bit"
    return moments


def rule_moments(shape: ModelShape, hw: HardwareProfile, tiers: list[str], boundary_bytes: int,
                 internal: list[str] | None = None, internal_bytes: int = 0, per_load: int = 1,
                 bf16_grads: bool = False) -> list[str]:
    """Moments for a fixed rule: the fewest 8-bit parameters with which the store and the host
    memory the rule's own offloaded boundaries and internals need (each of the ``per_load``
    micro-batches of a group's; NVMe staging included) fit; all 8-bit when nothing does (the
    simulator then reports the plan over host capacity)."""
    staging = NVME_STAGING if "nvme" in tiers else 0
    offloaded = (per_load * (tiers.count("host") * boundary_bytes + (internal or []).count("host") * internal_bytes)
                 + staging * boundary_bytes)
    try:
        return choose_moments(shape, hw, offloaded, bf16_grads)
    except PlanInfeasible:
        return ["8bit"] * len(shape.unit_names())


def human_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= 0.1 * scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def infeasible(shape: ModelShape, hw: HardwareProfile, seq_len: int, failure: Any) -> PlanInfeasible:
    """The error for a search where nothing fits: the binding tier, with what the least
    device-hungry plan (or ``failure``, a candidate of the search) needs and what is usable."""
    # the least device-hungry plan: every boundary offloaded, one sequence per micro-batch
    plan = Plan(["host"] * shape.num_layers, micro_batch_size=1, seq_len=seq_len)
    sims = [simulate(plan, shape, hw, keep_trace=False)] + ([failure.sim] if failure else [])
    sim = next((x for x in sims if x.over_capacity()), None)
    if sim is None:
        return PlanInfeasible("unknown", 0, "no candidate plan fits; try a smaller sequence length")
    tier, nbytes = max(sim.over_capacity().items(), key=lambda kv: kv[1])
    used = {"device": sim.peak_device_bytes, "host": sim.peak_host_bytes, "nvme": sim.peak_nvme_bytes}[tier]
    cap = {"device": sim.device_cap_bytes, "host": sim.host_cap_bytes, "nvme": sim.nvme_cap_bytes}[tier]
    p = sim.plan
    what = (f"one sequence of {seq_len} tokens per micro-batch with every boundary offloaded" if p is plan
            else f"the leanest candidate ({p.source}, micro-batch {p.micro_batch_size} x {seq_len} tokens)")
    hint = {"device": "a shorter sequence, a smaller model or a GPU with more memory (--gpu-mem)",
            "host": "more host RAM (--host-mem)", "nvme": "more NVMe space"}[tier]
    return PlanInfeasible(
        tier, nbytes,
        f"nothing fits: {tier} memory binds. Even {what} needs {human_bytes(used)} of {tier} memory, {human_bytes(cap)} usable "
        f"({human_bytes(nbytes)} over); needs {hint}")
