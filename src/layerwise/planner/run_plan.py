"""The planner's entry for ``plan=auto``: the hardware profile (``hardware_choice``), then the
plan, with the simulator's prediction in ``plan.predicted``. Imported by name only for
``plan=auto``, so a rule or a plan file never loads the planner."""

from __future__ import annotations

from pathlib import Path

from ..plan.plan import Plan
from ..plan.shape import ModelShape
from .calibrate import calibrate
from .hardware_choice import HardwareChoice, check_spec, resolve_hardware
from .host_need import layer_grad_bytes
from .machine import this_machine
from .milp import MilpConfig
from .presets import PRESETS
from .search import SearchConfig, search

__all__ = ["PROFILE_NAME", "check_spec", "plan_for_run", "run_hardware"]

PROFILE_NAME = "profile.json"
"""A calibrated hardware profile under the run directory, used by ``plan=auto`` when present."""


def run_hardware(hardware: str | None, profile: str | None, out_dir: str | Path, device: str,
                 compute_dtype_bytes: int, device_mem_cap_bytes: int | None = None,
                 may_calibrate: bool = True) -> HardwareChoice | None:
    """The hardware profile a run in ``out_dir`` plans with (``hardware=``, ``profile=``), through
    ``hardware_choice.resolve_hardware``. None only when nothing was asked for, this machine has
    no preset and ``may_calibrate`` is false."""
    return resolve_hardware(
        hardware, profile=profile, calibrated=Path(out_dir) / PROFILE_NAME,
        machine=this_machine(device),
        calibrate=(lambda: calibrate(quick=True, device=device)) if may_calibrate else None,
        compute_dtype_bytes=compute_dtype_bytes, device_mem_cap_bytes=device_mem_cap_bytes)


def plan_for_run(shape: ModelShape, hw: HardwareChoice, seq_len: int, global_batch: int,
                 time_limit_s: float) -> Plan:
    """The planner's schedule for ``global_batch`` sequences of ``seq_len`` per optimizer step:
    boundary tiers, micro-batch split, per-unit moments; ``predicted`` holds its step time and
    whether the profile is a preset (a datasheet, not this machine's measurement)."""
    machine = hw.profile.for_model(layer_grad_bytes(shape, hw.profile))  # the reserve with its ring
    res = search(shape, machine, seq_len,
                 SearchConfig(global_batch=global_batch, milp=MilpConfig(time_limit_s=time_limit_s)))
    res.plan.predicted.update(hardware_source=hw.source, hardware_preset=hw.profile.name in PRESETS)
    return res.plan
