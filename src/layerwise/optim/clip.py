"""Exact global-norm gradient clipping, folded into the update (no scaling pass over grads), with
``clip_grad_norm_``'s formula over per-unit squared norms."""

from __future__ import annotations

import math

import torch


def sq_norm(grad: torch.Tensor) -> float:
    """Squared L2 norm of a flat gradient, accumulated in fp32 (fp64 for the final sum)."""
    return float(torch.linalg.vector_norm(grad, dtype=torch.float32).double() ** 2)


def global_norm(sq_norms: list[float]) -> float:
    return math.sqrt(sum(sq_norms))


def clip_coefficient(total_norm: float, max_norm: float | None) -> float:
    """The factor grads are multiplied by; 1.0 when no clipping applies."""
    if max_norm is None or max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))


def clip_or_skip(total_norm: float, max_norm: float | None) -> float | None:
    """The clip coefficient, or None when ``total_norm`` is not finite: skip the step then.

    (``clip_coefficient`` alone turns a NaN norm into 1.0, which would apply NaN gradients.)"""
    if not math.isfinite(total_norm):
        return None
    return clip_coefficient(total_norm, max_norm)
