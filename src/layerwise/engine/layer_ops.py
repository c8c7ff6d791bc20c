"""A decoder layer's backward as the engine runs it: forward with a graph from the stored input
boundary, then gradients w.r.t. the input and the layer's parameters as leaf views of its flat
device buffer."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..models.adapter import DecoderAdapter, LayerContext
from ..store import FlatLayout


def trained(params: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The leaves of ``params`` that get gradients (in layout order)."""
    return [p for p in params.values() if p.requires_grad]


def layer_backward(adapter: DecoderAdapter, index: int, layout: FlatLayout, flat_w: torch.Tensor,
                   x: torch.Tensor, grad_out: torch.Tensor, ctx: LayerContext,
                   saved_tensors_hooks=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """(grad w.r.t. ``x``, grads of the layer's trained parameters in layout order; a frozen
    tensor the layout binds, e.g. a LoRA run's base, is not a leaf and gets none). An MoE
    layer's router logits take the aux loss's gradient from ``ctx`` on the way
    (``models/moe.py``)."""
    x = x.detach().requires_grad_()
    params = layout.leaves(flat_w)
    hooks = (torch.autograd.graph.saved_tensors_hooks(*saved_tensors_hooks)
             if saved_tensors_hooks is not None else nullcontext())
    with hooks:
        y = adapter.layer(index, params, x, ctx)
    # a parameter the layer reads only without grad (a routing bias) gets zeros, as it would
    # accumulate none in autograd
    gx, *gw = torch.autograd.grad(y, (x, *trained(params)), grad_out, allow_unused=True,
                                  materialize_grads=True)
    return gx, gw
