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

    The slots are as large as the largest unit moved, so the units up to each size are tried in
    turn (smallest first), the largest of them moved first: a big embedding stays in RAM when
    the layers alone make room. Raises ``ValueError`` (one line) when nothing fits."""
    if ram_need_bytes <= ram_cap_bytes:
        return ["ram"] * len(state_bytes)
    best_need = None
    for limit in sorted({b for b in state_bytes if b > 0}):
        tiers, need = ["ram"] * len(state_bytes), ram_need_bytes + slots * limit
        for k in sorted(range(len(state_bytes)), key=lambda k: -state_bytes[k]):
            if need <= ram_cap_bytes:
                break
            if 0 < state_bytes[k] <= limit:
                tiers[k] = "nvme"
                need -= state_bytes[k]
        if need <= ram_cap_bytes:
            return tiers
        best_need = need if best_need is None else min(best_need, need)
    raise ValueError(
        f"the host store needs {human_bytes(best_need or ram_need_bytes)} of RAM even with every "
        f"unit's optimizer state on NVMe (the copy source and gradients stay in RAM), over the "
        f"{human_bytes(ram_cap_bytes)} allowed: raise host_mem_gb, or use bf16 compute")
