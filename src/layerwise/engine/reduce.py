"""How the ranks of a data-parallel step combine their work: the engine's only seam for it.

The engine stays free of ``torch.distributed``: ``layerwise.train.dist`` implements
``StepReducer`` with collectives; without one (``None``) a step is one process's, as before.
"""

from __future__ import annotations

from typing import Protocol


class StepReducer(Protocol):
    def global_tokens(self, local_tokens: int) -> int:
        """The step's target tokens over all ranks (the loss and gradient are divided by it, so
        N ranks x B rows equal 1 rank x N*B rows). Called once per step, before the forward."""

    def unit_landed(self, unit: str) -> None:
        """``unit``'s gradient for the step is complete in ``store[unit].grad`` (its last
        micro-batch landed); called in the order units finish, the same on every rank. May start
        reducing it while the backward goes on."""

    def finish(self, loss: float) -> tuple[dict[str, float], float]:
        """After every unit landed: wait for the reductions. Returns every unit's squared norm of
        the step's summed gradient (the same on every rank) and the step's loss over all ranks."""

    def owns(self, unit: str) -> bool:
        """This rank runs ``unit``'s optimizer update (its reduced gradient is here)."""

    def begin_updates(self) -> None:
        """The step's updates are about to be submitted on every rank (not for a skipped step)."""

    def published(self, unit: str) -> None:
        """Owner: its update of ``unit`` is applied to the shared weights."""

    def update_done(self, unit: str, wait: bool) -> bool:
        """Not the owner: has the owner applied its latest update of ``unit``? ``wait``: block
        until it has (raises when the owner does not within the collective timeout)."""
