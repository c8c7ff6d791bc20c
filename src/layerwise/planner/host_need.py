"""Host RAM of a plan, per parameter, and the largest model of a family that fits a machine's RAM.

One accounting for ``layerwise plan``'s verdict and the family search: the host store, the
host-tier activations at the simulator's peak, and the host reserve ([HOSTRES] in
``planner/presets.py``), against the machine's RAM (the reserve counts as a need). A family's
largest model is judged by its host floor (8-bit moments, bf16 gradients, state on NVMe where
needed: ``host_fit.choose_state``) and, if asked, a device check."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..models.names import EMBED, HEAD
from .cost import CostModel
from ..plan.family_sizes import family_sizes, flavor_of
from .hardware import HardwareProfile
from .host_fit import PlanInfeasible, choose_state
from ..plan.plan import Plan
from ..plan.shape import ModelShape, load_shape
from .simulator import SimResult


@dataclass(frozen=True)
class HostNeed:
    """Host bytes a run of one model needs on one machine."""

    num_params: int
    store_bytes: int
    activation_bytes: int
    """Host-tier boundaries and internals (pinned) at the simulator's peak."""
    reserve_bytes: int
    """The machine's host reserve with the model's gradient ring."""
    ram_bytes: int
    """The machine's host RAM."""
    bf16_grads: bool
    nvme_state_bytes: int = 0
    """Optimizer state kept on NVMe instead (out of ``store_bytes``, whose staging it adds)."""
    nvme_weight_bytes: int = 0
    """The ``nvme-all`` units' copy sources and gradients, on NVMe too."""
    nvme_all_units: int = 0

    @property
    def total_bytes(self) -> int:
        return self.store_bytes + self.activation_bytes + self.reserve_bytes

    @property
    def store_bytes_per_param(self) -> float:
        return self.store_bytes / self.num_params

    @property
    def bytes_per_param(self) -> float:
        """Everything the run holds on the host, per parameter."""
        return self.total_bytes / self.num_params

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.ram_bytes

    def row(self) -> dict:
        return {"num_params": self.num_params, "store_bytes": self.store_bytes,
                "store_bytes_per_param": round(self.store_bytes_per_param, 3),
                "activation_bytes": self.activation_bytes, "reserve_bytes": self.reserve_bytes,
                "total_bytes": self.total_bytes, "bytes_per_param": round(self.bytes_per_param, 3),
                "ram_bytes": self.ram_bytes, "bf16_grads": self.bf16_grads, "fits_ram": self.fits,
                "nvme_state_bytes": self.nvme_state_bytes, "nvme_weight_bytes": self.nvme_weight_bytes,
                "nvme_all_units": self.nvme_all_units}


def layer_grad_bytes(shape: ModelShape, hw: HardwareProfile) -> int:
    """The largest decoder layer's gradient in the compute dtype (one gradient ring buffer)."""
    layers = [u for u in shape.unit_names() if u not in (EMBED, HEAD)]
    return max(shape.trainable_params(u) for u in layers) * hw.compute_dtype_bytes


def plan_host_need(shape: ModelShape, hw: HardwareProfile, plan: Plan, sim: SimResult) -> HostNeed:
    """The host bytes of ``plan`` on ``hw`` (the profile as given, before ``for_model``)."""
    # bf16 compute and every gradient landing once (a frozen base's adapters keep fp32 ones)
    bf16 = hw.compute_dtype_bytes == 2 and plan.lands_once() and shape.frozen_base is None
    cost = CostModel(shape, hw, 1, 1)
    store = cost.host_store_bytes(plan.moments, bf16, plan.state_tiers)
    reserve = hw.for_model(layer_grad_bytes(shape, hw)).host_reserved_bytes
    return HostNeed(shape.num_params, store, sim.peak_pinned_act_bytes, reserve, hw.host_mem_bytes, bf16,
                    *_on_nvme(cost, plan.moments, plan.state_tiers, bf16))


def host_floor(shape: ModelShape, hw: HardwareProfile) -> HostNeed:
    """The least host RAM any plan of ``shape`` needs on ``hw`` (see the module docstring)."""
    units = shape.unit_names()
    bf16 = hw.compute_dtype_bytes == 2 and shape.frozen_base is None
    cost = CostModel(shape, hw, 1, 1)
    moments, tiers = ["8bit"] * len(units), None
    ring = hw.for_model(layer_grad_bytes(shape, hw))
    try:
        moments, tiers = choose_state(shape, ring, bf16_grads=bf16)
        moments = ["8bit"] * len(units)  # the floor: 8-bit moments in RAM too
    except PlanInfeasible:
        pass  # over the RAM either way: the in-RAM floor says by how much
    store = cost.host_store_bytes(moments, bf16, tiers)
    return HostNeed(shape.num_params, store, 0, ring.host_reserved_bytes, hw.host_mem_bytes, bf16,
                    *_on_nvme(cost, moments, tiers, bf16))


def _on_nvme(cost: CostModel, moments: list[str] | None, tiers: list[str] | None, bf16: bool) -> tuple[int, int, int]:
    """(state bytes, ``nvme-all`` weight and gradient bytes, ``nvme-all`` units) on NVMe."""
    state = cost.nvme_state_bytes(moments, tiers)
    return state, cost.nvme_bytes(moments, tiers, bf16) - state, (tiers or []).count("nvme-all")


def family_of_model(model: str) -> str | None:
    """The family (``models.FAMILIES`` key) of a flavor name or a local model directory."""
    flavor = flavor_of(model)
    if flavor is not None:
        return flavor.family
    cfg = Path(model) / "config.json"
    if cfg.is_file():
        return json.loads(cfg.read_text()).get("model_type")
    return None


def largest_fitting(model: str, hw: HardwareProfile,
                    adapt: Callable[[ModelShape], ModelShape] = lambda s: s,
                    fits_device: Callable[[ModelShape], bool] | None = None) -> tuple[str, HostNeed] | None:
    """The largest size of ``model``'s family (``plan.family_sizes``) that fits ``hw``: its host
    floor within the RAM and, with ``fits_device``, a plan the device holds (None: none fits).
    ``adapt`` makes each size's shape the run's (``ModelShape.with_lora`` for a LoRA run)."""
    sizes = [(name, adapt(load_shape(name))) for name in family_sizes(family_of_model(model))]
    for name, shape in sorted(sizes, key=lambda ns: -ns[1].num_params):
        need = host_floor(shape, hw)
        if need.fits and (fits_device is None or fits_device(shape)):
            return name, need
    return None
