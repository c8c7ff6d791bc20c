"""fp32 AdamW over the HostStore, one unit (flat buffer) at a time.

The clip coefficient is folded into the update through the fused kernel's ``grad_scale``
(grads are divided by it), so clipping costs no extra pass. ``step_unit`` touches only that
unit's buffers, so different units may be updated on different worker threads.
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..store import UnitBuffers
from .config import AdamWConfig

__all__ = ["AdamWConfig", "HostAdamW", "UnitOptimizer", "state_nbytes"]


def state_nbytes(numel: int) -> int:
    """Host bytes of ``HostAdamW``'s state for ``numel`` parameters: two fp32 moments + step."""
    return 8 * numel + 4


class UnitOptimizer(Protocol):
    """Updates one unit's master weights in place from its accumulated gradient."""

    def init_state(self, buf: UnitBuffers) -> None:
        """Create ``buf.state`` (called once per unit before the first step)."""

    def step_unit(self, buf: UnitBuffers, lr: float, clip_coef: float) -> None:
        """One AdamW step of ``buf`` with gradient ``buf.grad * clip_coef``; may clobber ``buf.grad``."""


class HostAdamW:
    """fp32 moments; matches ``torch.optim.AdamW`` (+ ``clip_grad_norm_``) to round-off."""

    def __init__(self, config: AdamWConfig):
        self.config = config

    def init_state(self, buf: UnitBuffers) -> None:
        # pageable: only the copy sources are pinned (see layerwise.store)
        # through the store's allocator: shared by the local ranks of a node under torchrun
        n, zeros = buf.layout.numel, buf.alloc.zeros
        buf.state = {
            "exp_avg": zeros(n, torch.float32),
            "exp_avg_sq": zeros(n, torch.float32),
            "step": zeros(1, torch.float32).view(()),
        }

    @staticmethod
    def state_nbytes(numel: int) -> int:
        """Bytes ``init_state`` allocates for a unit of ``numel`` parameters."""
        return state_nbytes(numel)

    def step_unit(self, buf: UnitBuffers, lr: float, clip_coef: float) -> None:
        c = self.config
        s = buf.state
        s["step"] += 1
        split = buf.layout.decay_numel
        scale = torch.tensor(1.0 / clip_coef) if clip_coef != 1.0 else None
        for lo, hi, wd in ((0, split, c.weight_decay), (split, buf.layout.numel, 0.0)):
            if hi <= lo:
                continue
            torch._fused_adamw_(
                [buf.master[lo:hi]], [buf.grad[lo:hi]],
                [s["exp_avg"][lo:hi]], [s["exp_avg_sq"][lo:hi]], [], [s["step"]],
                lr=lr, beta1=c.betas[0], beta2=c.betas[1], weight_decay=wd, eps=c.eps,
                amsgrad=False, maximize=False, grad_scale=scale, found_inf=None,
            )
