"""Pick a backend by device name; read the machine behind it for the planner's hardware rules."""

from __future__ import annotations

import torch

from ..plan.hardware_choice import Machine
from .backend import CpuBackend, CudaBackend, DeviceBackend
from .backend_async import AsyncCpuBackend
from .calibrate_host import total_ram_bytes


def make_backend(device: str | torch.device, async_seed: int | None = None) -> DeviceBackend:
    """``cpu``, ``cpu-async`` (lanes as threads with seeded delays; ``async_seed``) or ``cuda[:N]``."""
    if str(device) == "cpu-async":
        return AsyncCpuBackend(seed=async_seed)
    dev = torch.device(device)
    if dev.type == "cpu":
        return CpuBackend()
    if dev.type == "cuda":
        return CudaBackend(dev)
    raise ValueError(f"unsupported device {device!r}; use 'cpu', 'cpu-async' or 'cuda[:N]'")


def this_machine(device: str) -> Machine:
    """What ``plan.hardware_choice`` needs of the machine behind ``device``: the RAM this
    process may use and, on CUDA, the GPU's name and memory."""
    ram = total_ram_bytes()
    if not device.startswith("cuda"):
        return Machine(ram)
    props = torch.cuda.get_device_properties(torch.device(device).index or 0)
    return Machine(ram, props.name, props.total_memory)


def this_machine_any() -> Machine:
    """This machine as ``layerwise plan`` without ``--hardware`` plans for it: its first CUDA
    device where there is one, else the CPU backend; its own RAM either way."""
    return this_machine("cuda" if torch.cuda.is_available() else "cpu")
