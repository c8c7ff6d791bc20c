"""Fixed rules the planner must beat, evaluated in the same simulator.

- ``every-K`` (MegaTrain's rule): keep every K-th boundary on the device, recompute the rest;
- ``keep-all-device``: no recompute, no transfers (only where it fits);
- ``recompute-all``: keep nothing, recompute every boundary from the embedding.

``keep-all-host`` is not a fixed rule to beat but a useful warm start for the MILP.

With a tier for a layer's internals, two more fixed rules, so that the MILP is not
measured against rules that cannot use the new tier:

- ``internals-device``: every layer's internals kept on the device (no recompute, no copies:
  the fastest plan wherever it fits);
- ``internals-host``: every layer's internals offloaded to host memory and fetched back.

Their boundaries are all dropped: a layer that keeps its internals never reads its boundary.
"""

from __future__ import annotations

from ..plan.plan import Plan

EVERY_K = (1, 2, 4, 8)


def baseline_tiers(num_layers: int) -> dict[str, list[str]]:
    """Name -> boundary tiers of every baseline."""
    out = {}
    for k in EVERY_K:
        out[f"every-{k}"] = Plan.every_k(num_layers, k).boundary_tiers
    out["keep-all-device"] = ["device"] * num_layers
    out["recompute-all"] = ["recompute"] * num_layers
    return out


def rules(num_layers: int) -> dict[str, tuple[list[str], list[str] | None]]:
    """Name -> (boundary tiers, internal tiers or None) of every fixed rule and of
    ``keep-all-host`` (a warm start for the MILP)."""
    out: dict[str, tuple[list[str], list[str] | None]] = {
        name: (tiers, None) for name, tiers in baseline_tiers(num_layers).items()}
    out["keep-all-host"] = (["host"] * num_layers, None)
    for t in ("device", "host"):
        out[f"internals-{t}"] = (["recompute"] * num_layers, [t] * num_layers)
    return out
