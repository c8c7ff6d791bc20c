"""The host optimizer's settings, apart from its kernels: the ``layerwise train`` command reads
them (for ``--help``) without importing torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class AdamWConfig:
    lr: float = 3e-4
    """Peak learning rate (a schedule may scale it per step)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam's decay rates of the first and second moment."""
    eps: float = 1e-8
    """Added to the second moment's root (numerical safety)."""
    weight_decay: float = 0.1
    """Decoupled weight decay, applied to matrices only (not to norms or biases)."""
    max_grad_norm: float | None = 1.0
    """Global L2 clip; None or 0 disables clipping."""

    def check(self, prefix: str = "optimizer.") -> None:
        """Refuse settings no run can use (``ValueError`` naming the key)."""
        if not self.lr > 0:
            raise ValueError(f"{prefix}lr must be > 0, got {self.lr:g}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"{prefix}betas must each be in [0, 1), got {list(self.betas)}")
        if not self.eps > 0:
            raise ValueError(f"{prefix}eps must be > 0, got {self.eps:g}")
        if not self.weight_decay >= 0:
            raise ValueError(f"{prefix}weight_decay must be >= 0, got {self.weight_decay:g}")
        if self.max_grad_norm is not None and not self.max_grad_norm >= 0:
            raise ValueError(f"{prefix}max_grad_norm must be >= 0 or none, got {self.max_grad_norm:g}")
