"""The schedule of a training run: ``plan=auto`` (the planner), the rules, a plan file; and the
step time the planner's simulator predicts for it, on the hardware profile this run resolves.

Which hardware profile: ``plan.hardware_choice`` holds the rules (the same as ``layerwise
plan``'s): ``profile=``, then ``RUN/profile.json``, then ``hardware=``, then this machine's
preset, else (only when a plan needs it: ``plan=auto``) a quick calibration saved as
``RUN/profile.json`` for the next run. The profile's element size follows the run's compute
dtype, and ``device_mem_cap_gb`` caps the device memory a plan may use.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..engine.calibrate import calibrate
from ..engine.devices import this_machine
from ..plan.hardware_choice import HardwareChoice, resolve_hardware
from ..plan.host_need import layer_grad_bytes
from ..plan.milp import MilpConfig
from ..plan.plan import Plan
from ..plan.search import SearchConfig, search
from ..plan.shape import ModelShape
from ..plan.simulator import simulate
from .config import TrainConfig

PROFILE_NAME = "profile.json"
"""A calibrated hardware profile under the run directory, used by ``plan=auto`` when present."""


def run_hardware(cfg: TrainConfig, compute_dtype: torch.dtype, device_mem_cap_bytes: int | None = None,
                 may_calibrate: bool = True) -> HardwareChoice | None:
    """The hardware profile the planner uses for this run: its settings and machine through
    ``plan.hardware_choice.resolve_hardware``. None only when nothing was asked for, this
    machine has no preset and ``may_calibrate`` is false."""
    return resolve_hardware(
        cfg.hardware, profile=cfg.profile, calibrated=Path(cfg.out_dir) / PROFILE_NAME,
        machine=this_machine(cfg.device),
        calibrate=(lambda: calibrate(quick=True, device=cfg.device)) if may_calibrate else None,
        compute_dtype_bytes=compute_dtype.itemsize, device_mem_cap_bytes=device_mem_cap_bytes)


def auto_plan(shape: ModelShape, hw: HardwareChoice, seq_len: int, global_batch: int,
              time_limit_s: float) -> Plan:
    """The planner's schedule for ``global_batch`` sequences of ``seq_len`` per optimizer step:
    boundary tiers, micro-batch split, per-unit moments; ``predicted`` holds its step time."""
    machine = hw.profile.for_model(layer_grad_bytes(shape, hw.profile))  # the reserve with its ring
    res = search(shape, machine, seq_len,
                 SearchConfig(global_batch=global_batch, milp=MilpConfig(time_limit_s=time_limit_s)))
    res.plan.predicted["hardware_source"] = hw.source
    return res.plan


def predict(plan: Plan, shape: ModelShape, hw: HardwareChoice, seq_len: int) -> dict:
    """What the planner's simulator predicts for ``plan`` on ``hw`` at ``seq_len`` (the
    ``predicted`` of a plan the planner emits: ``step_s``, ``tokens_per_s``, peaks, ...)."""
    if plan.seq_len != seq_len:
        d = plan.to_dict()
        d["seq_len"] = seq_len
        plan = Plan.from_dict(d)
    s = simulate(plan, shape, hw.profile, keep_trace=False)
    return {"model": shape.name, "hardware": hw.profile.name, "hardware_source": hw.source,
            "step_s": s.step_s, "tokens_per_s": s.tokens_per_s,
            "achieved_tflops": s.achieved_tflops, "peak_device_bytes": s.peak_device_bytes,
            "device_cap_bytes": s.device_cap_bytes, "peak_host_bytes": s.peak_host_bytes,
            "fits": s.fits}
