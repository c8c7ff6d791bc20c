"""Which units' optimizer-side state goes on NVMe (``Plan.state_tiers``): the fewest units whose
state, moved to files, brings what stays in RAM (plus the staging slots it then needs) within
the RAM cap; the units with the most state first. Torch-free: the planner and a run with a rule
plan share it."""

from __future__ import annotations

from collections.abc import Sequence

from ..util.units import human_bytes
from .plan import NVME_STATE_SLOTS


def place_state(state_bytes: Sequence[int], ram_need_bytes: int, ram_cap_bytes: int,
                slots: int = NVME_STATE_SLOTS) -> list[str]:
    """Per unit ``ram`` or ``nvme``. ``state_bytes``: each unit's state that can move (master
    remainder or plain master, and moments); ``ram_need_bytes``: the whole store in RAM.
    Raises ``ValueError`` (one line) when even every unit's state on NVMe leaves too much."""
    tiers = ["ram"] * len(state_bytes)
    need = ram_need_bytes
    order = sorted(range(len(state_bytes)), key=lambda k: -state_bytes[k])
    largest = 0
    for k in order:
        if need + slots * largest <= ram_cap_bytes:
            return tiers
        if state_bytes[k] == 0:
            break
        tiers[k] = "nvme"
        need -= state_bytes[k]
        largest = max(largest, state_bytes[k])
    if need + slots * largest <= ram_cap_bytes:
        return tiers
    raise ValueError(
        f"the host store needs {human_bytes(need + slots * largest)} of RAM even with every unit's "
        f"optimizer state on NVMe (the copy source and gradients stay in RAM), over the "
        f"{human_bytes(ram_cap_bytes)} allowed: raise host_mem_gb, or use bf16 compute")
