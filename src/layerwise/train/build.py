"""What a run trains and how: the model's config (RoPE scaling applied), its plan (a rule, a
file, or the planner's), the device-memory check of that plan, then the host store. Everything
that can be refused without allocating is refused before the store is built (minutes for a
large model)."""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from transformers import PretrainedConfig

from ..ckpt.snapshot_fit import margin_bytes
from ..engine.batch import Batch
from ..interop.hf.model_dir import load_config, load_store
from ..models import FLAVORS, DecoderAdapter, family_of, get_flavor
from ..models.families import text_config
from ..models.attention import row_layout
from ..models.structure import layer_facts, model_flops
from ..plan.memory import CUDA_WORKSPACE_BYTES, predict_peak_device_bytes
from ..optim import adamw, adamw8bit
from ..plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS, Plan
from ..plan.shape import ModelShape
from ..plan.state_placement import place_state
from ..state_tier import NvmeStateTier
from ..store import PRIVATE, FlatLayout, HostAllocator, HostStore, init_store, store_footprint
from ..store_bytes import resolve_split_master
from ..util.host_memory import available_host_memory
from . import checks
from .config import TrainConfig
from .lora_run import lora_shape
from .options import FIT_RULES, check_settings, resolve_plan

_log = logging.getLogger(__name__)


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"model.compute_dtype must be auto, float32 or bfloat16, got {name!r}") from None


def check_options(cfg: TrainConfig) -> None:
    """Cheap checks of the run's options and the machine, before the model is built."""
    check_settings(cfg)
    checks.check_device(cfg.device)
    checks.check_report_to(cfg.log.report_to)


def _rope_scaled(config: PretrainedConfig, factor: float | None) -> PretrainedConfig:
    """``config`` with linear RoPE scaling by ``factor`` (transformers 5 names it
    ``rope_parameters``, 4.x ``rope_scaling``)."""
    if factor is None:
        return config
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):
        config.rope_parameters = {**params, "rope_type": "linear", "factor": float(factor)}
    else:
        config.rope_scaling = {"rope_type": "linear", "factor": float(factor)}
    return config


@dataclass
class ModelSource:
    """What ``model=`` names, resolved: a flavor or a local directory, and its config."""

    name: str
    """The flavor, or the local directory (a Hub id resolved to its cached snapshot)."""
    config: PretrainedConfig

    @classmethod
    def resolve(cls, cfg: TrainConfig) -> tuple[ModelSource, str | None]:
        name, line = checks.resolve_model(cfg.model.name)
        checks.check_context(cfg, name)
        config = get_flavor(name).build_config() if name in FLAVORS else load_config(name)
        family_of(config)  # an architecture layerwise cannot train is refused before planning
        return cls(name, _rope_scaled(config, cfg.model.rope_scaling)), line

    def build(self, seed: int, compute_dtype: torch.dtype, alloc: HostAllocator = PRIVATE,
              grad_dtype: torch.dtype = torch.float32, tiers: dict[str, NvmeStateTier] | None = None
              ) -> tuple[DecoderAdapter, HostStore]:
        """Every local rank builds the same weights into the shared store (identical writes), so no
        rank needs to know which wrote them. ``grad_dtype``, ``tiers``: ``HostStore``'s."""
        if self.name in FLAVORS:
            return init_store(self.config, seed=seed, compute_dtype=compute_dtype, alloc=alloc,
                              grad_dtype=grad_dtype, **(tiers or {}))
        return load_store(self.name, compute_dtype=compute_dtype, alloc=alloc, config=self.config,
                          grad_dtype=grad_dtype, **(tiers or {}))


def mem_cap_bytes(cfg: TrainConfig) -> int | None:
    """``device_mem_cap_gb``, else on CUDA the device's memory (a plan predicted to need more
    cannot run), else none."""
    if cfg.device_mem_cap_gb is not None:
        return int(cfg.device_mem_cap_gb * 2**30)
    if cfg.device.startswith("cuda"):
        return int(torch.cuda.get_device_properties(torch.device(cfg.device).index or 0).total_memory)
    return None


PLANNER = "layerwise.planner.run_plan"
"""The planner's entry, imported by name for ``plan=auto`` only: a run with a rule or a plan
file never loads the planner (search, MILP, simulator, hardware profiles)."""


def choose_plan(cfg: TrainConfig, model: PretrainedConfig, compute_dtype: torch.dtype
                ) -> tuple[Plan, Any]:
    """The run's plan, and for ``plan=auto`` the hardware profile it was planned on (its
    ``predicted["step_s"]`` the simulator's step time); a rule or a plan file has no profile."""
    num_layers = text_config(model).num_hidden_layers
    if cfg.plan == "fit":
        return fit_plan(cfg, model, compute_dtype), None
    if cfg.plan != "auto":
        return resolve_plan(cfg.plan, num_layers, cfg), None
    planner = importlib.import_module(PLANNER)
    hw = planner.run_hardware(cfg.hardware, cfg.profile, cfg.out_dir, cfg.device,
                              compute_dtype.itemsize, mem_cap_bytes(cfg))
    shape = lora_shape(cfg, ModelShape.from_config(model, name=Path(cfg.model.name).name))
    return planner.plan_for_run(shape, hw, cfg.seq_len, cfg.micro_batch_size * cfg.grad_accum,
                                cfg.plan_time_limit_s), hw


STATE_NBYTES = {"fp32": adamw.state_nbytes, "8bit": adamw8bit.state_nbytes}


def place_run_state(cfg: TrainConfig, model: PretrainedConfig, plan: Plan,
                    compute_dtype: torch.dtype, grad_dtype: torch.dtype) -> Plan:
    """``host_mem_gb``: the plan with the units whose state (and, where that is not enough, copy
    source and gradient) goes on NVMe so that the store fits (``plan.state_placement``); a plan
    that places its state itself is kept."""
    if cfg.host_mem_gb is None or plan.state_tiers is not None:
        return plan
    if cfg.lora.enabled:
        raise ValueError("host_mem_gb places a full fine-tune's state on NVMe; a LoRA run keeps "
                         "its frozen base and adapters in RAM: drop host_mem_gb")
    adapter = DecoderAdapter(model)
    numels = [FlatLayout.of(u).numel for u in adapter.units]
    moments = [STATE_NBYTES[k](n) for n, k in zip(numels, plan.moments or ["fp32"] * len(numels))]
    separate = compute_dtype != torch.float32
    master_itemsize = 2 if resolve_split_master(compute_dtype, None) else 4 if separate else 0
    need = store_footprint(adapter, compute_dtype, pin=False, state_nbytes=sum(moments),
                           grad_dtype=grad_dtype).total
    try:
        tiers = place_state([master_itemsize * n + m for n, m in zip(numels, moments)], need,
                            int(cfg.host_mem_gb * 1e9),
                            source_bytes=[compute_dtype.itemsize * n for n in numels],
                            grad_bytes=[grad_dtype.itemsize * n for n in numels])
    except ValueError as e:
        raise ValueError(f"host_mem_gb={cfg.host_mem_gb:g}: {e}") from None
    if tiers.count("ram") < len(tiers):
        everything = tiers.count("nvme-all")
        _log.info(f"host_mem_gb={cfg.host_mem_gb:g}: the optimizer state of "
                  f"{len(tiers) - tiers.count('ram')} of {len(tiers)} units goes on NVMe"
                  + (f", the weights and gradients of {everything} too" if everything else "")
                  + f" ({cfg.state_dir or 'out_dir/nvme-state'})")
    return replace(plan, state_tiers=tiers)


def make_state_tiers(cfg: TrainConfig, plan: Plan, unit_names: list[str], out_dir: Path,
                     distributed: bool, pinned: bool) -> dict[str, NvmeStateTier]:
    """The run's NVMe tiers (``state_tier``, ``source_tier``, ``grad_tier``: the store's
    keywords) for the units the plan puts there; none when it puts none."""
    units, everything = plan.nvme_units(unit_names), plan.nvme_units(unit_names, source=True)
    if not units:
        return {}
    if distributed:
        raise ValueError("optimizer state on NVMe (plan.state_tiers, host_mem_gb) runs in one "
                         "process: drop host_mem_gb or launch without torchrun")
    if cfg.lora.enabled:
        raise ValueError("optimizer state on NVMe is for full fine-tuning (a LoRA run's state is "
                         "small): drop host_mem_gb or plan.state_tiers")
    where = Path(cfg.state_dir) if cfg.state_dir else out_dir / "nvme-state"
    tiers = {"state_tier": NvmeStateTier(where, units, NVME_STATE_SLOTS)}
    if everything:
        tiers["source_tier"] = NvmeStateTier(where, everything, NVME_SOURCE_SLOTS, kind="source",
                                             pinned=pinned)
        tiers["grad_tier"] = NvmeStateTier(where, everything, NVME_GRAD_SLOTS, kind="grad")
    return tiers


def fit_plan(cfg: TrainConfig, model: PretrainedConfig, compute_dtype: torch.dtype) -> Plan:
    """``plan=fit``: the rule of ``FIT_RULES`` that recomputes least and whose predicted device
    peak fits the device (on the CPU: the RAM the store leaves); the last rule when none fits
    (``check_fits`` then says what to lower)."""
    num_layers = text_config(model).num_hidden_layers
    cap = fit_cap_bytes(cfg, model, compute_dtype)
    for rule in FIT_RULES:
        plan = resolve_plan(rule, num_layers, cfg)
        if cap is None or _peak(cfg, model, plan, compute_dtype).peak_bytes <= cap:
            break
    _log.info(f"plan=fit: {plan.source} (" + ("nothing caps device memory" if cap is None else
              f"the rule that recomputes least whose predicted peak fits {cap / 2**30:.1f} GiB")
              + ")")
    return plan


def fit_cap_bytes(cfg: TrainConfig, model: PretrainedConfig, compute_dtype: torch.dtype) -> int | None:
    """What ``plan=fit`` fits a plan's device peak in: ``mem_cap_bytes``; on the CPU, whose
    device memory is the host's, the RAM available less the store (fp32 moments: the most it
    takes; with ``host_mem_gb``, that budget) and a margin; None where the RAM is not known."""
    cap = mem_cap_bytes(cfg)
    if cap is not None or cfg.device.startswith("cuda"):
        return cap
    avail = available_host_memory()
    if avail is None:
        return None
    params = ModelShape.from_config(model).num_params
    extra = 0 if compute_dtype == torch.float32 else compute_dtype.itemsize  # the copy source
    store = params * (compute_dtype.itemsize if cfg.lora.enabled else 16 + extra)
    if cfg.host_mem_gb is not None:
        store = min(store, int(cfg.host_mem_gb * 1e9))
    return max(avail - store - margin_bytes(avail), 0)


def _peak(cfg: TrainConfig, model: PretrainedConfig, plan: Plan, compute_dtype: torch.dtype):
    """The memory model's device peak of ``plan`` for this run."""
    cuda = cfg.device.startswith("cuda")
    return predict_peak_device_bytes(lora_shape(cfg, ModelShape.from_config(model)), plan,
                                     plan.micro_batch_size, cfg.seq_len, compute_dtype.itemsize,
                                     workspace_bytes=CUDA_WORKSPACE_BYTES if cuda else 0,
                                     attention_workspace=cuda)


def check_fits(cfg: TrainConfig, model: PretrainedConfig, plan: Plan,
               compute_dtype: torch.dtype) -> None:
    """Refuse a micro-batch whose predicted device peak is over the cap, before the store is
    built (the engine checks the same again with the store in hand)."""
    cap = mem_cap_bytes(cfg)
    if cap is None:
        return
    est = _peak(cfg, model, plan, compute_dtype)
    if est.peak_bytes > cap:
        raise ValueError(
            f"a micro-batch of {plan.micro_batch_size} x {cfg.seq_len} tokens with plan "
            f"{plan.source} needs {est.peak_bytes / 2**20:.0f} MiB of device memory (peak at "
            f"'{est.peak_op}'), over the {cap / 2**20:.0f} MiB there is; lower micro_batch_size "
            "or seq_len (raise grad_accum to keep the batch), or use plan=auto")


class FlopCounter:
    """Model FLOPs of a step (forward + backward, no recompute), per layer as the layers are, each
    packed example's attention over its own span only; a LoRA run adds its adapters'."""

    def __init__(self, adapter: DecoderAdapter, shape: ModelShape | None = None):
        self.adapter, self.facts, self._per_shape = adapter, layer_facts(adapter), {}
        fb = shape.frozen_base if shape is not None else None
        self._adapter_flops_per_token = (0.0 if fb is None else
                                         3.0 * adapter.num_layers * fb.adapter_flops_per_token)

    def __call__(self, micro: list[Batch]) -> float:
        total = 0.0
        for mb in micro:
            shape = tuple(mb.input_ids.shape)
            if mb.segment_ids is None and shape in self._per_shape:
                total += self._per_shape[shape]
                continue
            flops = model_flops(self.facts, self.adapter.hidden_size, self.adapter.vocab_size,
                                row_layout(shape, mb.segment_ids))
            flops += self._adapter_flops_per_token * shape[0] * shape[1]
            if mb.segment_ids is None:
                self._per_shape[shape] = flops
            total += flops
        return total
