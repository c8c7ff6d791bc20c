"""Which local rank owns each unit under data parallelism: it reduces the unit's gradient, runs
its optimizer and writes its checkpoint group."""

from __future__ import annotations


def assign_owners(unit_params: list[int], gpus: int) -> list[int]:
    """The local rank that owns each unit: largest first, each to the least-loaded rank (ties: the
    lower rank), so owners' parameters, and with them their optimizer and reduction work, balance."""
    load = [0] * gpus
    owner = [0] * len(unit_params)
    for k in sorted(range(len(unit_params)), key=lambda k: (-unit_params[k], k)):
        r = min(range(gpus), key=lambda r: (load[r], r))
        owner[k] = r
        load[r] += unit_params[k]
    return owner
