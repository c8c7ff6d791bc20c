"""What the engine obeys and how it is chosen, with no tensors.

Contracts first: ``plan`` (the Plan JSON), ``program`` (the step program every consumer shares),
``shape`` (model shape facts), ``memory`` (the device-memory model). Then the planner on top of
them: ``hardware`` profiles, the ``cost`` model, the linear ``step_model``, the MILP
(``formulation`` written over named ``columns``, solved by ``milp``), the outer ``search``, the
discrete-event ``simulator`` and its ``trace``, the ``check``er and ``timeline`` drawing, the
data-parallel ``topology`` and ``scaling`` prediction, and ``cli``.
"""

from .plan import STORED_TIERS, TIERS, Plan

__all__ = ["Plan", "TIERS", "STORED_TIERS"]
