"""The linear of a frozen base, with an optional LoRA adapter, as PEFT's ``lora.Linear`` computes.

``frozen_linear``'s backward computes the input's gradient only and saves only the packed weight,
so a kept graph holds no activation for it. Dropout draws the same mask in a micro-batch's
forward, recompute and backward: its generator is seeded per (micro-batch, layer, module) by
:func:`dropout_scope`."""

from __future__ import annotations

import contextlib
import contextvars

import torch
import torch.nn.functional as F
from torch import nn

from .quant import dequantize, is_packed

_DROPOUT_SEED: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "lora_dropout_seed", default=None)


@contextlib.contextmanager
def dropout_scope(seed: int | None, layer: int):
    """Adapter dropout of layer ``layer`` inside is drawn from ``seed`` (None: no dropout, as in
    eval)."""
    token = _DROPOUT_SEED.set(None if seed is None else (seed, layer))
    try:
        yield
    finally:
        _DROPOUT_SEED.reset(token)


def dense_weight(weight: torch.Tensor, fmt: str, shape: tuple[int, ...], dtype: torch.dtype
                 ) -> torch.Tensor:
    """The frozen weight as a ``shape`` tensor in ``dtype`` (``fmt``: ``float`` or a quant format)."""
    if is_packed(fmt):
        return dequantize(fmt, weight, shape, dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


class _FrozenLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, fmt, shape):
        ctx.fmt, ctx.shape = fmt, shape
        ctx.save_for_backward(weight)
        return F.linear(x, dense_weight(weight, fmt, shape, x.dtype), bias)

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        grad_x = grad_out @ dense_weight(weight, ctx.fmt, ctx.shape, grad_out.dtype)
        return grad_x, None, None, None, None


def frozen_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: str,
                  shape: tuple[int, int]) -> torch.Tensor:
    """``F.linear`` with a frozen (possibly packed) weight: only ``x`` gets a gradient."""
    return _FrozenLinear.apply(x, weight, bias, fmt, shape)


class StreamedLinear(nn.Module):
    """Template of one base linear (``out x in``) in a LoRA layer; lives on the meta device."""

    def __init__(self, in_features: int, out_features: int, bias: bool, fmt: str,
                 weight_meta: torch.Tensor, r: int = 0, scaling: float = 1.0,
                 dropout: float = 0.0, module_id: int = 0):
        super().__init__()
        self.shape = (out_features, in_features)
        self.fmt = fmt
        self.register_buffer("weight", weight_meta)
        self.register_buffer("bias", torch.empty(out_features, device="meta") if bias else None)
        self.r, self.scaling, self.dropout, self.module_id = r, scaling, dropout, module_id
        if r:
            with torch.device("meta"):
                self.lora_A = nn.Linear(in_features, r, bias=False)
                self.lora_B = nn.Linear(r, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = frozen_linear(x, self.weight, self.bias, self.fmt, self.shape)
        if not self.r:
            return y
        h = x
        scope = _DROPOUT_SEED.get()
        if self.dropout and scope is not None:
            seed, layer = scope
            g = torch.Generator(device=x.device)
            g.manual_seed((seed * 1_000_003 + layer * 4099 + self.module_id) % (2**63))
            keep = torch.rand(x.shape, generator=g, device=x.device) >= self.dropout
            h = x * keep.to(x.dtype) / (1.0 - self.dropout)
        return y + F.linear(F.linear(h, self.lora_A.weight), self.lora_B.weight) * self.scaling
