"""The contract the engine obeys, with no tensors; ``layerwise.planner`` decides a Plan and
nothing here imports it."""

from .plan import STORED_TIERS, TIERS, Plan

__all__ = ["Plan", "TIERS", "STORED_TIERS"]
