"""How often a step copies each unit's weights to the device and lands its gradient on the host,
for an ``nvme-all`` unit's NVMe traffic; counted from the engine's own step program and weight
window, so a recompute that finds its unit still held adds no copy."""

from __future__ import annotations

from collections import Counter

from ..plan.plan import Plan
from ..plan.program import Op, WeightWindow, micro_batch_groups, micro_batch_program, resident_units, weight_schedule


def copy_order(ops: list[Op], tied: bool, resident: frozenset[str], groups: int, depth: int) -> list[str]:
    """The units in the order a step copies them to the device: the micro-batch program ``ops``
    run by ``groups`` groups, each op acquiring its units' weights once, ``depth`` uses ahead."""
    window = WeightWindow(weight_schedule(ops, tied, resident) * groups, depth)
    order = [u for u, _ in window.fill()]
    for _ in range(groups):
        for op in ops:
            units = [u for u in op.units(tied) if u not in resident]
            for u in units:
                order += [c for c, _ in window.acquire(u)]
            for u in units:
                window.release(u)
            order += [c for c, _ in window.fill()]
    return order


def plan_copy_order(plan: Plan, tied: bool) -> list[str]:
    """:func:`copy_order` of ``plan``'s step."""
    ops = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    groups = len(micro_batch_groups(plan.num_micro_batches, plan.micro_batches_per_load))
    return copy_order(ops, tied, resident_units(plan.resident_layers), groups, plan.prefetch_depth)


def weight_copies(plan: Plan, tied: bool) -> Counter[str]:
    """Per unit, the weight copies to the device in one step of ``plan``."""
    return Counter(plan_copy_order(plan, tied))


def grad_landings(ops: list[Op], tied: bool, groups: int) -> Counter[str]:
    """Per unit, how often a step lands its gradient on the host: once per group for each op
    that sends it (a tied embedding twice: the head's part and its own)."""
    once = Counter(u for op in ops for u in op.grad_units(tied))
    return Counter({u: n * groups for u, n in once.items()})


def plan_grad_landings(plan: Plan, tied: bool) -> Counter[str]:
    """:func:`grad_landings` of ``plan``'s step."""
    ops = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    return grad_landings(ops, tied, len(micro_batch_groups(plan.num_micro_batches, plan.micro_batches_per_load)))
