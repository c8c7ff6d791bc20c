"""How the ranks of a data-parallel step combine their work: the engine's only seam for it, so
the engine stays free of ``torch.distributed`` (``LocalReducer`` for one process: one code path)."""

from __future__ import annotations

from typing import Protocol

import torch

from ..optim.clip import sq_norm
from ..store import HostStore
from .backend import Work


class StepReducer(Protocol):
    on_device: bool
    """Each unit's gradient is reduced on the device, per micro-batch, before it leaves
    (``reduce_on_device``), and only its owner lands it; False: every rank lands its own and
    ``unit_landed`` combines them on the host."""

    def global_tokens(self, local_tokens: int) -> int:
        """The step's target tokens over all ranks (the loss and gradient are divided by it, so
        N ranks x B rows equal 1 rank x N*B rows). Called once per step, before the forward."""

    def unit_landed(self, unit: str) -> None:
        """``unit``'s step gradient is complete in ``store[unit].grad``; called in finishing order,
        the same on every rank, on the landing thread. May start reducing it while the backward goes
        on."""

    def reduce_on_device(self, unit: str, grad: torch.Tensor) -> Work | None:
        """``on_device``: issue (async) the sum of every rank's ``grad`` of ``unit`` (a device
        tensor: one micro-batch's gradient) into its owner's; called on the backend's reduction
        lane, behind the backward that wrote ``grad``, in the same order on every rank."""

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


class LocalReducer:
    """``StepReducer`` of one process: owns every unit and only takes each unit's squared norm once
    final, so the clip factor is known when the backward ends."""

    on_device = False

    def __init__(self, store: HostStore):
        self.store = store
        self._sq_norms: dict[str, float] = {}

    def global_tokens(self, local_tokens: int) -> int:
        self._sq_norms = {}  # a step starts: forget the norms of one that failed
        return local_tokens

    def unit_landed(self, unit: str) -> None:
        with self.store.staged_grad(unit):
            self._sq_norms[unit] = sq_norm(self.store[unit].grad)

    def reduce_on_device(self, unit: str, grad: torch.Tensor) -> Work | None:
        raise AssertionError("one process has nothing to reduce")

    def finish(self, loss: float) -> tuple[dict[str, float], float]:
        out, self._sq_norms = self._sq_norms, {}
        return out, loss

    def owns(self, unit: str) -> bool:
        return True

    def begin_updates(self) -> None:
        pass

    def published(self, unit: str) -> None:
        pass

    def update_done(self, unit: str, wait: bool) -> bool:
        raise AssertionError(f"{unit} is this process's own: its update is waited on locally")
