"""This machine as the planner's hardware rules read it: its RAM and, on CUDA, the GPU."""

from __future__ import annotations

import torch

from .calibrate_host import total_ram_bytes
from .hardware_choice import Machine


def this_machine(device: str) -> Machine:
    """What ``hardware_choice`` needs of the machine behind ``device``: the RAM this
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
