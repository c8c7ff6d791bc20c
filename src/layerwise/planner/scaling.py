"""Predicted data-parallel scaling at a fixed global batch: the same plan simulated on one GPU
and split over G x N GPUs (:func:`split_plan`) by the one simulator, so the prediction moves
with every cost the single-GPU planner prices."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .hardware import HardwareProfile
from ..plan.plan import Plan
from ..plan.shape import ModelShape
from .simulator import SimResult, simulate
from .topology import Topology

RESOURCES = {
    "compute": ("compute",),
    "PCIe": ("h2d", "d2h"),
    "host accumulation": ("host",),
    "host optimizer": ("optimizer",),
    "NVMe": ("nvme",),
    "interconnect": ("intra", "inter"),
}
"""What can bound a step, by the simulator lanes that use it."""


@dataclass
class ScalingPoint:
    topology: Topology
    plan: Plan
    """What each GPU runs: its share of the global batch."""
    sim: SimResult
    """One GPU's simulated step (the busiest owner's)."""
    single_step_s: float
    """The step of 1 GPU running the whole global batch with the same plan."""

    @property
    def step_s(self) -> float:
        return self.sim.step_s

    @property
    def tokens_per_s(self) -> float:
        """All GPUs together."""
        return self.topology.world_size * self.sim.tokens_per_step / self.sim.step_s

    @property
    def speedup(self) -> float:
        """Against 1 GPU on the same global batch (can be < 1)."""
        return self.single_step_s / self.sim.step_s

    @property
    def efficiency(self) -> float:
        return self.speedup / self.topology.world_size

    def busy_fractions(self) -> dict[str, float]:
        """Per resource: its busiest lane's share of the step."""
        busy = self.sim.busy_s
        return {name: max(busy.get(lane, 0.0) for lane in lanes) / self.sim.step_s
                for name, lanes in RESOURCES.items()}

    @property
    def bound(self) -> str:
        """The resource busiest in the step: the first one a faster machine needs more of."""
        fractions = self.busy_fractions()
        return max(fractions, key=lambda k: fractions[k])

    def row(self) -> dict[str, Any]:
        return {"gpus_per_node": self.topology.gpus_per_node, "nodes": self.topology.nodes,
                "gpus": self.topology.world_size, "micro_batch_size": self.plan.micro_batch_size,
                "num_micro_batches": self.plan.num_micro_batches, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "speedup": self.speedup, "efficiency": self.efficiency,
                "bound": self.bound, "busy_fraction": self.busy_fractions(), "fits": self.sim.fits}


def split_plan(plan: Plan, global_batch: int, world_size: int) -> Plan:
    """``plan`` for one of ``world_size`` GPUs sharing ``global_batch`` sequences: the same tiers and
    moments, the largest micro-batch up to the plan's that divides the GPU's share."""
    if global_batch < 1:
        raise ValueError(f"the global batch must be >= 1 sequence, got {global_batch}")
    if global_batch % world_size:
        raise ValueError(f"a global batch of {global_batch} sequences does not split over {world_size} GPUs; "
                         f"use a multiple of {world_size}")
    share = global_batch // world_size
    mbs = max(d for d in range(1, min(plan.micro_batch_size, share) + 1) if share % d == 0)
    d = plan.to_dict()
    d.update(micro_batch_size=mbs, num_micro_batches=share // mbs, predicted={})
    return Plan.from_dict(d)


def predict_scaling(shape: ModelShape, hw: HardwareProfile, plan: Plan, global_batch: int,
                    topologies: list[Topology]) -> list[ScalingPoint]:
    """The predicted step of each topology on ``global_batch`` sequences, and its speedup over 1 GPU."""
    for topo in topologies:
        topo.check(hw)  # refuse before simulating anything
    single = simulate(split_plan(plan, global_batch, 1), shape, hw, keep_trace=False)
    out = []
    for topo in topologies:
        share = split_plan(plan, global_batch, topo.world_size)
        sim = simulate(share, shape, hw, keep_trace=False, topology=topo)
        out.append(ScalingPoint(topo, share, sim, single.step_s))
    return out


def ladder(gpus_per_node: int, nodes: int, grad_reduce: str = "host") -> list[Topology]:
    """1, 2, 4, ... GPUs on one node up to ``gpus_per_node``, then that many on ``nodes`` nodes."""
    counts = sorted({1 << k for k in range(gpus_per_node.bit_length())} | {gpus_per_node})
    out = [Topology(g, 1, grad_reduce) for g in counts]
    if nodes > 1:
        out.append(Topology(gpus_per_node, nodes, grad_reduce))
    return out
