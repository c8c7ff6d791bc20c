"""Planning: hardware profiles, cost model, MILP, simulator and the Plan the engine obeys."""

from .plan import STORED_TIERS, TIERS, Plan

__all__ = ["Plan", "TIERS", "STORED_TIERS"]
