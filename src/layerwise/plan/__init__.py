"""The contract the engine obeys, with no tensors: ``plan`` (the Plan JSON), ``program`` (the
step program every consumer shares), ``shape`` (model shape facts; ``finetune`` a LoRA run's
frozen base, ``family_sizes`` the named sizes), ``memory`` (the device-memory model) and
``owners`` (which rank owns a unit under data parallelism). ``layerwise.planner`` decides a
Plan; nothing here imports it.
"""

from .plan import STORED_TIERS, TIERS, Plan

__all__ = ["Plan", "TIERS", "STORED_TIERS"]
