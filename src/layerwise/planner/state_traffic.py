"""The NVMe traffic of a plan with optimizer state on NVMe, and the global batch that hides it.

The traffic is fixed per step while compute grows with the batch, so the search picks a batch
where traffic is at most ``HIDE_FRACTION`` of compute and the step within ``STEP_SLACK``. Both,
because reads fall mostly in the next step's forward: a small total can still stall it."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..plan.plan import Plan
from ..plan.shape import ModelShape
from .cost import CostModel
from .hardware import HardwareProfile
from .simulator import SimResult
from .unit_copies import plan_grad_landings, weight_copies

HIDE_FRACTION = 0.8
"""The NVMe traffic of a step hides when it takes at most this fraction of the step's compute."""
STEP_SLACK = 0.10
"""A step is compute-bound when it takes at most this fraction more than its compute."""
MAX_HIDING_BATCH = 1024
"""The largest global batch (sequences) the search grows to for hiding the traffic."""


@dataclass(frozen=True)
class NvmeState:
    """A plan's optimizer state on NVMe and what moving it costs per step."""

    units: int
    """Units whose state is on NVMe (``nvme`` and ``nvme-all``)."""
    state_bytes: int
    """Their state on NVMe (master remainder + moments)."""
    moved_bytes: int
    """Bytes over the NVMe per step: the store's (``moved_by_kind``), and the NVMe-tier
    activations written and read."""
    nvme_s: float
    """NVMe seconds per step for those bytes."""
    compute_s: float
    """Compute seconds of the simulated step."""
    step_s: float
    all_units: int = 0
    """Units whose copy source and gradient are on NVMe too (``nvme-all``)."""
    source_bytes: int = 0
    """Their copy sources on NVMe (the compute-dtype weights)."""
    grad_bytes: int = 0
    """Their gradients on NVMe."""
    moved_by_kind: dict[str, int] = field(default_factory=dict)
    """The store's bytes over the NVMe per step by kind (``cost.TRAFFIC_KINDS``), and
    ``activations`` (NVMe-tier boundaries written and read)."""

    @property
    def hides(self) -> bool:
        """The traffic takes at most ``HIDE_FRACTION`` of the compute."""
        return self.nvme_s <= HIDE_FRACTION * self.compute_s

    @property
    def over_compute(self) -> float:
        """How much longer the simulated step is than its compute (a fraction of the compute)."""
        return self.step_s / self.compute_s - 1.0 if self.compute_s > 0 else float("inf")

    @property
    def compute_bound(self) -> bool:
        return self.over_compute <= STEP_SLACK

    def row(self) -> dict:
        return {"units": self.units, "state_bytes": self.state_bytes, "nvme_all_units": self.all_units,
                "source_bytes": self.source_bytes, "grad_bytes": self.grad_bytes,
                "moved_bytes_per_step": self.moved_bytes, "moved_bytes_by_kind": dict(self.moved_by_kind),
                "nvme_s_per_step": self.nvme_s, "compute_s_per_step": self.compute_s, "step_s": self.step_s,
                "hides": self.hides, "hide_fraction": HIDE_FRACTION, "step_over_compute": self.over_compute,
                "compute_bound": self.compute_bound}


def nvme_state(shape: ModelShape, hw: HardwareProfile, plan: Plan, sim: SimResult) -> NvmeState | None:
    """The NVMe state figures of ``plan`` simulated as ``sim``; None when its state is all in RAM."""
    units = plan.nvme_units(shape.unit_names())
    if not units:
        return None
    cost = CostModel(shape, hw, plan.micro_batch_size, plan.seq_len or 1)
    bf16 = plan.lands_once()
    state = cost.nvme_state_bytes(plan.moments, plan.state_tiers)
    sizes = cost.tier_sizes(plan.moments, plan.state_tiers, bf16)
    traffic = store_traffic(shape, cost, plan)
    acts = plan.num_micro_batches * plan.boundary_tiers.count("nvme") * cost.boundary_bytes
    nvme_s = cost.traffic_s(traffic) + cost.nvme_read_s(acts) + cost.nvme_write_s(acts)
    return NvmeState(len(units), state, sum(traffic.values()) + 2 * acts, nvme_s, sim.busy_s["compute"], sim.step_s,
                     len(plan.nvme_units(shape.unit_names(), source=True)), sum(w for _, _, w, _ in sizes),
                     sum(g for _, _, _, g in sizes), {**traffic, "activations": 2 * acts})


def store_traffic(shape: ModelShape, cost: CostModel, plan: Plan) -> dict[str, int]:
    """The store's bytes over the NVMe in one step of ``plan``, by kind (``CostModel.nvme_traffic``)."""
    copies = weight_copies(plan, shape.tied) if "nvme-all" in (plan.state_tiers or ()) else {}
    return cost.nvme_traffic(plan.moments, plan.state_tiers, plan.lands_once(), copies,
                             plan_grad_landings(plan, shape.tied))


def hiding_batch(shape: ModelShape, hw: HardwareProfile, plan: Plan, sim: SimResult) -> int | None:
    """The smallest global batch at which ``plan``'s NVMe traffic would hide behind its compute,
    scaled from ``sim`` (the state's traffic does not grow with the batch); None when it hides
    already or no batch up to ``MAX_HIDING_BATCH`` would."""
    fig = nvme_state(shape, hw, plan, sim)
    if fig is None or fig.hides:
        return None
    seqs = plan.micro_batch_size * plan.num_micro_batches
    cost = CostModel(shape, hw, plan.micro_batch_size, plan.seq_len or 1)
    # the store's traffic at twice the micro-batches tells its part that grows with them
    m = plan.num_micro_batches
    twice = Plan.from_dict({**plan.to_dict(), "num_micro_batches": 2 * m,
                            "micro_batches_per_load": 2 * m if plan.micro_batches_per_load == m > 1
                            else plan.micro_batches_per_load})
    now_s, twice_s = (cost.traffic_s(store_traffic(shape, cost, p)) for p in (plan, twice))
    fixed_s = 2 * now_s - twice_s
    per_seq_slack = (HIDE_FRACTION * fig.compute_s - (fig.nvme_s - fixed_s)) / seqs
    if per_seq_slack <= 0:
        return None
    mbs = plan.micro_batch_size
    batch = mbs * math.ceil(fixed_s / per_seq_slack / mbs)
    return batch if batch <= MAX_HIDING_BATCH else None
