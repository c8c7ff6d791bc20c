"""Which units' state goes on NVMe (``Plan.state_tiers``): the fewest units whose state, moved
to files, brings what stays in RAM (plus the staging slots it then needs) within the RAM cap;
where even every unit's state on NVMe leaves too much, the fewest units whose copy source and
gradient move too (``nvme-all``). Torch-free: the planner and a run with a rule plan share it."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..util.units import human_bytes
from .plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS


def place_state(state_bytes: Sequence[int], ram_need_bytes: int, ram_cap_bytes: int,
                source_bytes: Sequence[int] | None = None,
                grad_bytes: Sequence[int] | None = None) -> list[str]:
    """Per unit ``ram``, ``nvme`` or ``nvme-all``. ``state_bytes``: each unit's state that can
    move (master remainder or plain master, and moments); ``source_bytes``, ``grad_bytes``: its
    copy source and gradient (None: they stay in RAM); ``ram_need_bytes``: the whole store in RAM.
    Raises ``ValueError`` (one line) when nothing fits."""
    n = len(state_bytes)
    if ram_need_bytes <= ram_cap_bytes:
        return ["ram"] * n
    moved = _fewest(state_bytes, ram_need_bytes, ram_cap_bytes, lambda k: NVME_STATE_SLOTS * k)
    if moved is not None:
        return ["nvme" if m else "ram" for m in moved]
    need = ram_need_bytes - sum(state_bytes) + NVME_STATE_SLOTS * max(state_bytes)
    if source_bytes is not None and grad_bytes is not None:
        both = [s + g for s, g in zip(source_bytes, grad_bytes)]

        def staging(limit: int) -> int:  # the units of up to ``limit`` bytes (equal layers: exact)
            ks = [k for k in range(n) if both[k] <= limit]
            return (NVME_SOURCE_SLOTS * max(source_bytes[k] for k in ks)
                    + NVME_GRAD_SLOTS * max(grad_bytes[k] for k in ks))
        moved = _fewest(both, need, ram_cap_bytes, staging)
        if moved is not None:
            return ["nvme-all" if m else "nvme" for m in moved]
        need = need - sum(both) + staging(max(both))
    raise ValueError(
        f"the host store needs {human_bytes(need)} of RAM even with every unit's "
        + ("state, weights and gradients" if source_bytes is not None else "optimizer state")
        + f" on NVMe, over the {human_bytes(ram_cap_bytes)} allowed: raise host_mem_gb")


def _fewest(sizes: Sequence[int], need: int, cap: int, staging: Callable[[int], int]
            ) -> list[bool] | None:
    """Which units to move so that ``need`` less what they free plus ``staging(largest moved)``
    is within ``cap``: the units up to each size in turn (smallest first, so a big embedding
    stays when the layers make room), the largest of them first; None if none does."""
    for limit in sorted({b for b in sizes if b > 0}):
        moved, left = [False] * len(sizes), need + staging(limit)
        for k in sorted(range(len(sizes)), key=lambda k: -sizes[k]):
            if left <= cap:
                break
            if 0 < sizes[k] <= limit:
                moved[k] = True
                left -= sizes[k]
        if left <= cap:
            return moved
    return None
