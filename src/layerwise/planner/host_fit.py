"""What host memory a plan needs beside its store, and the moments and state tiers that make it
fit (``docs/planner.md``, "Optimizer state on NVMe"): the fewest parameters to 8-bit moments
(fp32 is faster), then the fewest units' state on NVMe, then the fewest ``nvme-all`` units; each
step moves more NVMe traffic than the one before, so it is taken only when needed."""

from __future__ import annotations

from typing import Any

from .cost import STATE_NBYTES, CostModel
from .hardware import HardwareProfile
from ..plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS, Plan
from ..store_bytes import ARENA_ALIGN_BYTES
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


def choose_state(shape: ModelShape, hw: HardwareProfile, reserve_bytes: int = 0,
                 bf16_grads: bool = False) -> tuple[list[str], list[str] | None]:
    """(moments, state tiers) of the host store, by the order of the module docstring.
    PlanInfeasible when even every unit ``nvme-all`` does not fit the RAM, or the NVMe cannot hold
    what goes there."""
    try:
        return choose_moments(shape, hw, reserve_bytes, bf16_grads), None
    except PlanInfeasible:
        if hw.nvme_capacity_bytes <= 0:
            raise
    cost = CostModel(shape, hw, 1, 1)
    units = shape.unit_names()
    budget = hw.host_cap_bytes - reserve_bytes
    moments = ["8bit"] * len(units)
    in_ram = cost.host_store_bytes(moments, bf16_grads)
    size = [cost.unit_state_bytes(u) for u in units]
    chosen = _fewest_on_nvme(size, in_ram - budget)
    if chosen is not None:
        tiers = ["nvme" if k in chosen else "ram" for k in range(len(units))]
    elif shape.frozen_base is None:
        tiers = _fewest_all(shape, cost, moments, bf16_grads, in_ram - budget)
        if tiers is None:
            raise _nothing_left(shape, cost, moments, bf16_grads, hw, reserve_bytes)
    else:  # a LoRA store's copy source is its frozen base: it stays in RAM
        raise _weights_exceed(shape, cost, moments, bf16_grads, budget)
    on_nvme = cost.nvme_bytes(moments, tiers, bf16_grads)
    if on_nvme > hw.nvme_capacity_bytes:
        over = on_nvme - hw.nvme_capacity_bytes
        what = (f"{tiers.count('nvme-all')} units' weights, gradients and optimizer state and "
                f"{tiers.count('nvme')} units' optimizer state" if "nvme-all" in tiers
                else f"{tiers.count('nvme')} units' optimizer state")
        raise PlanInfeasible(
            "nvme", over,
            f"host memory binds, and the NVMe cannot take the difference: {what} ({human_bytes(on_nvme)}) would "
            f"have to live on NVMe, {human_bytes(hw.nvme_capacity_bytes)} usable ({human_bytes(over)} over); "
            f"use more RAM (--host-mem) or more NVMe space")
    return moments, tiers


def _fewest_on_nvme(size: list[int], over: int, floor: int = 0) -> set[int] | None:
    """The fewest units whose state off the RAM frees ``over`` bytes beside the staging slots
    (``NVME_STATE_SLOTS`` x the largest, at least ``floor``); None when none do. Later units first
    among equals: updated last, their reads wait least on the next forward."""
    best: tuple[int, int, set[int]] | None = None
    for cap in sorted(set(size), reverse=True):
        order = sorted((k for k in range(len(size)) if size[k] <= cap), key=lambda k: (-size[k], -k))
        chosen: set[int] = set()
        freed = -NVME_STATE_SLOTS * max(size[order[0]] - floor, 0)
        for k in order:
            if freed >= over:
                break
            chosen.add(k)
            freed += size[k]
        if freed >= over:
            key = (len(chosen), sum(size[k] for k in chosen))
            if best is None or key < best[:2]:
                best = (*key, chosen)
    return None if best is None else best[2]


def _fewest_all(shape: ModelShape, cost: CostModel, moments: list[str], bf16_grads: bool,
                over: int) -> list[str] | None:
    """State tiers with the fewest ``nvme-all`` units, then the fewest ``nvme`` ones, that free
    ``over`` bytes beside their staging slots; None when every unit ``nvme-all`` does not. Later
    units first among equals (the next forward needs them last)."""
    units = shape.unit_names()
    n = len(units)
    state = [cost.unit_state_bytes(u, m) for u, m in zip(units, moments)]
    source = [cost.unit_source_bytes(u) for u in units]
    grad = [cost.unit_grad_store_bytes(u, bf16_grads) for u in units]
    moved = [s + w + g for s, w, g in zip(state, source, grad)]
    over += ARENA_ALIGN_BYTES * n  # the arena's padding, which moving sources may shift

    def freed(full: list[int], nvme_state: int, max_state: int) -> int:
        """Bytes off the RAM less the staging slots, ``full`` nvme-all, ``nvme_state`` beside."""
        return (sum(moved[k] for k in full) + nvme_state - NVME_STATE_SLOTS * max_state
                - NVME_SOURCE_SLOTS * max(source[k] for k in full) - NVME_GRAD_SLOTS * max(grad[k] for k in full))

    best: tuple[int, int, int, list[str]] | None = None
    for cap in sorted(set(moved), reverse=True):
        order = sorted((k for k in range(n) if moved[k] <= cap), key=lambda k: (-moved[k], -k))
        full: list[int] = []
        for k in order:  # the others at most free their state (every one on NVMe)
            full.append(k)
            others = sum(state) - sum(state[j] for j in full)
            if freed(full, others, max(state)) >= over:
                break
        else:
            continue
        rest = [k for k in range(n) if k not in full]
        tiers = ["nvme-all" if k in full else "ram" for k in range(n)]
        floor = max(state[k] for k in full)
        left = over - freed(full, 0, floor)
        if left > 0:  # the fewest others' state on NVMe: the slots grow past the nvme-all units' state
            chosen = _fewest_on_nvme([state[k] for k in rest], left, floor)
            if chosen is None:
                continue
            for j in chosen:
                tiers[rest[j]] = "nvme"
        key = (tiers.count("nvme-all"), tiers.count("nvme"), cost.nvme_bytes(moments, tiers, bf16_grads))
        if best is None or key < best[:3]:
            best = (*key, tiers)
    return None if best is None else best[3]


def _nothing_left(shape: ModelShape, cost: CostModel, moments: list[str], bf16_grads: bool, hw: HardwareProfile,
                  reserve_bytes: int) -> PlanInfeasible:
    """The refusal where even every unit ``nvme-all`` does not fit: what is left in RAM."""
    tiers = ["nvme-all"] * len(shape.unit_names())
    staging = cost.host_store_bytes(moments, bf16_grads, tiers)
    need = staging + reserve_bytes + hw.host_reserved_bytes
    over = need - hw.host_mem_bytes
    return PlanInfeasible(
        "host", over,
        f"host memory binds: {shape.name} needs {human_bytes(need)} of RAM even with every unit's weights, "
        f"gradients and optimizer state on NVMe (nvme-all): {human_bytes(staging)} of NVMe staging (slots for the "
        f"largest unit's state, copy source and gradient), {human_bytes(reserve_bytes)} of host-tier activations "
        f"and the {human_bytes(hw.host_reserved_bytes)} host reserve, but the RAM is {human_bytes(hw.host_mem_bytes)} "
        f"({human_bytes(over)} over); use a machine with more RAM or --host-mem")


def _weights_exceed(shape: ModelShape, cost: CostModel, moments: list[str], bf16_grads: bool,
                    budget: int) -> PlanInfeasible:
    """The refusal of a LoRA run where even every unit's state on NVMe does not fit: what stays
    in RAM (its copy source is the frozen base, which ``nvme-all`` does not move)."""
    units = shape.unit_names()
    floor = cost.host_store_bytes(moments, bf16_grads, ["nvme"] * len(units))
    fp = cost.store_footprint(moments, bf16_grads)
    dtype = "bf16" if cost.elem_bytes == 2 else f"{8 * cost.elem_bytes}-bit"
    weights = f"the {dtype} weights ({human_bytes(fp.copy_source)}, the copy source the GPU reads)"
    grads = "bf16" if fp.grad < 4 * fp.numel else "fp32"
    if fp.copy_source > budget:
        what = f"{weights} alone exceed the RAM"
    else:
        what = (f"{weights} and the {grads} gradients ({human_bytes(fp.grad)}) alone exceed the RAM, with "
                f"{human_bytes(cost.staging_bytes(moments, ['nvme'] * len(units)))} of NVMe staging")
    return PlanInfeasible(
        "host", floor - budget,
        f"host memory binds: {what}: {shape.name} needs {human_bytes(floor)} of RAM even with every unit's "
        f"optimizer state on NVMe, but {human_bytes(budget)} is usable ({human_bytes(floor - budget)} over); "
        f"a LoRA run keeps its frozen base (the copy source) in RAM: use a machine with more RAM or --host-mem")


def rule_state(shape: ModelShape, hw: HardwareProfile, tiers: list[str], boundary_bytes: int,
               internal: list[str] | None = None, internal_bytes: int = 0, per_load: int = 1,
               bf16_grads: bool = False) -> tuple[list[str], list[str] | None]:
    """(moments, state tiers) for a fixed rule (``choose_state``) with which the store and the
    host memory the rule's own offloaded boundaries and internals need (each of the ``per_load``
    micro-batches of a group's; NVMe staging included) fit; all 8-bit in RAM when nothing does
    (the simulator then reports the plan over host capacity)."""
    staging = NVME_STAGING if "nvme" in tiers else 0
    offloaded = (per_load * (tiers.count("host") * boundary_bytes + (internal or []).count("host") * internal_bytes)
                 + staging * boundary_bytes)
    try:
        return choose_state(shape, hw, offloaded, bf16_grads)
    except PlanInfeasible:
        return ["8bit"] * len(shape.unit_names()), None


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
