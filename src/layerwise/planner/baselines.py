"""Fixed rules the planner must beat, evaluated in the same simulator: ``every-K`` (MegaTrain's
rule), ``keep-all-device``, ``recompute-all``, and with an internals tier ``internals-device``
and ``internals-host`` (their boundaries all dropped: a layer keeping its internals never reads
its boundary), so the MILP is never measured against rules that cannot use that tier.
``keep-all-host`` is a warm start for the MILP, not a rule to beat."""

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
