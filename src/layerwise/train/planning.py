"""The schedule of a training run: ``plan=auto`` (the planner), the rules, a plan file; and the
step time the planner's simulator predicts for it, on the hardware profile this run resolves.

Which hardware profile (the first that applies):

1. ``profile=PATH``: a profile file written by ``layerwise calibrate`` (a missing file is an
   error);
2. ``RUN/profile.json``: a calibrated profile under the run directory (``layerwise calibrate
   --out RUN/profile.json``);
3. ``hardware=NAME``: a named preset (``h200``, ``h100``, ..., ``cpu``), or a profile file;
4. this machine: on CPU the ``cpu`` preset with this machine's RAM; on CUDA the preset whose
   name matches the GPU's (memory sizes read from the machine), else a quick calibration,
   saved as ``RUN/profile.json`` for the next run (only when a plan needs it: ``plan=auto``).

Whatever the source, the profile's element size follows the run's compute dtype and a
``device_mem_cap_gb`` caps the device memory a plan may use.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..engine.calibrate import calibrate
from ..plan.hardware import PRESETS, HardwareProfile, get_hardware
from ..plan.host_need import layer_grad_bytes
from ..plan.milp import MilpConfig
from ..plan.plan import Plan
from ..plan.search import SearchConfig, search
from ..plan.shape import ModelShape
from ..plan.simulator import simulate
from .options import check_hardware, check_profile

_log = logging.getLogger(__name__)

PROFILE_NAME = "profile.json"
"""A calibrated hardware profile under the run directory, used by ``plan=auto`` when present."""

# (substring of the lower-cased CUDA device name, preset, least device memory in bytes)
CUDA_PRESETS = (("h200", "h200", 0), ("h800", "h800", 0), ("h100", "h100", 0),
                ("a100", "a100-80g", 70 * 10**9), ("3090", "rtx3090", 0), ("4090", "rtx4090", 0))


@dataclass(frozen=True)
class HardwareChoice:
    profile: HardwareProfile
    source: str
    """Where it came from, in words (logged, and kept in ``plan.json``'s ``predicted``)."""


def cuda_preset_for(device_name: str, total_mem_bytes: int) -> str | None:
    """The preset that describes a CUDA device, from its name (None when none does)."""
    name = device_name.lower()
    for key, preset, min_mem in CUDA_PRESETS:
        if key in name and total_mem_bytes >= min_mem:
            return preset
    return None


def _total_ram_bytes() -> int | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _this_machine(device: str, run_dir: Path, may_calibrate: bool) -> HardwareChoice | None:
    ram = _total_ram_bytes()
    if not device.startswith("cuda"):
        hw = PRESETS["cpu"]
        if ram:  # the CPU backend's "device" memory is host memory
            hw = replace(hw, device_mem_bytes=ram, host_mem_bytes=ram,
                         device_reserved_bytes=min(hw.device_reserved_bytes, ram // 8),
                         host_reserved_bytes=min(hw.host_reserved_bytes, ram // 8))
        return HardwareChoice(hw, "the cpu preset (this machine's RAM)")
    index = torch.device(device).index or 0
    props = torch.cuda.get_device_properties(index)
    preset = cuda_preset_for(props.name, props.total_memory)
    if preset is not None:
        hw = replace(PRESETS[preset], device_mem_bytes=props.total_memory)
        if ram:
            hw = replace(hw, host_mem_bytes=ram,
                         host_reserved_bytes=min(hw.host_reserved_bytes, ram // 8))
        return HardwareChoice(hw, f"the {preset} preset (matched to {props.name!r}; this "
                                  "machine's memory)")
    if not may_calibrate:
        return None
    _log.info(f"no hardware preset matches {props.name!r}: calibrating this machine (quick) ...")
    hw = calibrate(quick=True, device=device)
    run_dir.mkdir(parents=True, exist_ok=True)
    hw.save(run_dir / PROFILE_NAME)
    return HardwareChoice(hw, f"this machine, calibrated now (quick; saved to {run_dir / PROFILE_NAME})")


def resolve_hardware(profile: str | None, hardware: str | None, device: str, run_dir: Path,
                     compute_dtype: torch.dtype, device_mem_cap_bytes: int | None = None,
                     may_calibrate: bool = True) -> HardwareChoice | None:
    """The hardware profile the planner uses for this run (module docstring: which one wins).

    None only when nothing was asked for and this machine has no preset and ``may_calibrate``
    is false. Raises ``ValueError`` for a missing or bad profile file or an unknown preset."""
    choice: HardwareChoice | None
    calibrated = Path(profile) if profile else run_dir / PROFILE_NAME
    if profile or calibrated.is_file():
        check_profile(str(calibrated))
        label = f"the {'profile' if profile else 'calibrated profile'} {calibrated}"
        choice = HardwareChoice(HardwareProfile.load(calibrated), label)
        if hardware:
            _log.warning(f"hardware: {label} (hardware={hardware} ignored: a calibrated profile wins)")
    elif hardware:
        check_hardware(hardware)
        choice = HardwareChoice(get_hardware(hardware), f"hardware={hardware}")
    else:
        choice = _this_machine(device, run_dir, may_calibrate)
    if choice is None:
        return None
    hw = choice.profile
    elem = torch.empty((), dtype=compute_dtype).element_size()
    if hw.compute_dtype_bytes != elem and elem in (2, 4):
        hw = replace(hw, compute_dtype_bytes=elem)
    if device_mem_cap_bytes is not None:
        hw = replace(hw, device_mem_bytes=min(hw.device_mem_bytes,
                                              device_mem_cap_bytes + hw.device_reserved_bytes))
    return HardwareChoice(hw, choice.source)


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
