"""Which hardware profile a command plans on: one set of rules for ``layerwise train``,
``layerwise plan`` and ``layerwise calibrate``, so the same spec gives the same profile.

The first that applies: ``profile`` (a calibrated file; missing is an error), ``calibrated``
(``RUN/profile.json`` when it exists), ``hardware`` (a preset or a file), ``machine`` (this
machine's preset, else ``calibrate()`` saved for the next run). Then memory overrides, the
compute dtype's element size and the device-memory cap. ``plan/`` reads no device: the layers
above read the machine and inject the calibration."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .hardware import HardwareProfile

from .presets import PRESETS, get_hardware

_log = logging.getLogger(__name__)

# (substring of the lower-cased CUDA device name, preset, least device memory in bytes)
CUDA_PRESETS = (("h200", "h200", 0), ("h800", "h800", 0), ("h100", "h100", 0),
                ("a100", "a100-80g", 70 * 10**9), ("3090", "rtx3090", 0), ("4090", "rtx4090", 0))


@dataclass(frozen=True)
class HardwareChoice:
    profile: HardwareProfile
    source: str
    """Where it came from, in words (logged, and kept in ``plan.json``'s ``predicted``)."""


@dataclass(frozen=True)
class Machine:
    """This machine as the layers above read it off the device."""
    ram_bytes: int
    """Host RAM this process may use."""
    gpu_name: str | None = None
    """The CUDA device's name; None: the CPU backend, whose "device" memory is host memory."""
    gpu_mem_bytes: int = 0
    """The CUDA device's memory."""


def cuda_preset_for(device_name: str, total_mem_bytes: int) -> str | None:
    """The preset that describes a CUDA device, from its name (None when none does)."""
    name = device_name.lower()
    for key, preset, min_mem in CUDA_PRESETS:
        if key in name and total_mem_bytes >= min_mem:
            return preset
    return None


def machine_preset(machine: Machine) -> HardwareChoice | None:
    """This machine's preset with its memory (None: a GPU no preset matches)."""
    ram = machine.ram_bytes
    if machine.gpu_name is None:
        hw = PRESETS["cpu"]
        hw = replace(hw, device_mem_bytes=ram, host_mem_bytes=ram,
                     device_reserved_bytes=min(hw.device_reserved_bytes, ram // 8),
                     host_reserved_bytes=min(hw.host_reserved_bytes, ram // 8))
        return HardwareChoice(hw, "the cpu preset (this machine's RAM)")
    preset = cuda_preset_for(machine.gpu_name, machine.gpu_mem_bytes)
    if preset is None:
        return None
    hw = replace(PRESETS[preset], device_mem_bytes=machine.gpu_mem_bytes, host_mem_bytes=ram,
                 host_reserved_bytes=min(PRESETS[preset].host_reserved_bytes, ram // 8))
    return HardwareChoice(hw, f"the {preset} preset (matched to {machine.gpu_name!r}; this "
                              "machine's memory)")


def check_spec(hardware: str | None, profile: str | None = None) -> None:
    """Refuse a ``profile=`` that names no file or a bad one, and an unknown ``hardware``
    (before any work: each is checked even where another source would win)."""
    if profile:
        _load_profile(profile)
    if hardware:
        get_hardware(hardware)


def _load_profile(profile: str) -> HardwareProfile:
    if not Path(profile).is_file():
        raise ValueError(f"profile={profile}: no such file; write one with `layerwise calibrate "
                         f"--out {profile}`, or leave profile unset")
    return HardwareProfile.load(profile)


def _choose(hardware: str | None, profile: str | None, calibrated: Path | None,
            machine: Machine | None, calibrate: Callable[[], HardwareProfile] | None
            ) -> HardwareChoice | None:
    """Steps 1-4 of the module docstring."""
    if profile or (calibrated is not None and calibrated.is_file()):
        path = profile or str(calibrated)
        label = f"the {'profile' if profile else 'calibrated profile'} {path}"
        if hardware:
            _log.warning(f"hardware: {label} (hardware={hardware} ignored: a calibrated profile wins)")
        return HardwareChoice(_load_profile(path), label)
    if hardware:
        return HardwareChoice(get_hardware(hardware), f"hardware={hardware}")
    if machine is None:
        return None
    choice = machine_preset(machine)
    if choice is not None or calibrate is None:
        return choice
    _log.info(f"no hardware preset matches {machine.gpu_name!r}: calibrating this machine ...")
    hw = calibrate()
    if calibrated is None:
        return HardwareChoice(hw, "this machine, calibrated now")
    calibrated.parent.mkdir(parents=True, exist_ok=True)
    hw.save(calibrated)
    return HardwareChoice(hw, f"this machine, calibrated now (saved to {calibrated})")


def resolve_hardware(hardware: str | None = None, *, profile: str | None = None,
                     calibrated: Path | None = None, machine: Machine | None = None,
                     calibrate: Callable[[], HardwareProfile] | None = None,
                     gpu_mem_gb: float | None = None, host_mem_gb: float | None = None,
                     compute_dtype_bytes: int | None = None,
                     device_mem_cap_bytes: int | None = None) -> HardwareChoice | None:
    """The hardware profile to plan on (see the module docstring), or None when no source applies.
    Raises a one-line ``ValueError`` for a missing or bad profile file or an unknown preset."""
    choice = _choose(hardware, profile, calibrated, machine, calibrate)
    if choice is None:
        return None
    hw = choice.profile.with_memory(gpu_mem_gb, host_mem_gb)
    if compute_dtype_bytes is not None and compute_dtype_bytes != hw.compute_dtype_bytes:
        hw = replace(hw, compute_dtype_bytes=compute_dtype_bytes)
    if device_mem_cap_bytes is not None:
        hw = replace(hw, device_mem_bytes=min(hw.device_mem_bytes,
                                              device_mem_cap_bytes + hw.device_reserved_bytes))
    return HardwareChoice(hw, choice.source)
