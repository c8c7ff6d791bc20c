"""The router's auxiliary load-balancing loss, exactly as Hugging Face computes it, across a
layer-by-layer forward and backward.

Its statistics span every MoE layer, so it is known only after the last one: each layer's
forward records its router logits (:class:`RouterSpec`), the head computes the aux loss and its
gradient per layer, and :class:`LayerTail` (an identity) adds that gradient in each layer's
backward, so every plan gets it with no change to the engine. ``LayerTail`` also gives frozen
tensors an exact zero gradient. Several micro-batches are weighted by their share of target
tokens (HF's Trainer adds them unweighted: k times the weight)."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn


@dataclass(frozen=True)
class RouterSpec:
    """Where a model's router logits come from and how its aux loss is formed."""

    router_class: type
    output_index: int
    aux_fn: Callable[..., torch.Tensor]
    """The family's ``load_balancing_loss_func``."""
    num_experts: int
    top_k: int
    coef: float

    @classmethod
    def of(cls, causal_lm: nn.Module, config: Any) -> RouterSpec | None:
        """The spec of a (meta) HF causal LM whose forward adds the aux loss when
        ``config.output_router_logits`` is set; None when it does not or it is not set."""
        if not getattr(config, "output_router_logits", False):
            return None
        coef = getattr(causal_lm, "router_aux_loss_coef", None)
        aux_fn = getattr(sys.modules[type(causal_lm).__module__], "load_balancing_loss_func", None)
        recorders = getattr(type(causal_lm.model), "_can_record_outputs", None) or {}
        rec = recorders.get("router_logits")
        if coef is None or aux_fn is None or rec is None or not hasattr(rec, "target_class"):
            return None  # a family without HF's aux loss (e.g. DeepSeek-V3: bias-balanced)
        return cls(rec.target_class, int(rec.index or 0), aux_fn, int(causal_lm.num_experts),
                   int(causal_lm.num_experts_per_tok), float(coef))

    def routers(self, layer: nn.Module) -> list[nn.Module]:
        return [m for m in layer.modules() if isinstance(m, self.router_class)]


@dataclass
class RouterState:
    """One micro-batch's router logits (per MoE layer) and, once the head has run, the aux
    loss's gradient w.r.t. each."""

    attention_mask: torch.Tensor | None = None
    """``[b, s]``: 1 for a real token, 0 for padding (None: all real), as HF's aux loss takes it."""
    logits: dict[int, torch.Tensor] = field(default_factory=dict)
    grads: dict[int, torch.Tensor] = field(default_factory=dict)

    def aux_loss(self, spec: RouterSpec, weight: float) -> torch.Tensor:
        """``weight * coef * aux`` over the kept logits (layer order); fills ``grads``."""
        layers = sorted(self.logits)
        leaves = [self.logits[i].detach().requires_grad_() for i in layers]
        with torch.enable_grad():
            aux = spec.aux_fn(tuple(leaves), spec.num_experts, spec.top_k, self.attention_mask)
            total = spec.coef * aux * weight
        grads = torch.autograd.grad(total, leaves)
        self.grads = dict(zip(layers, grads))
        return total.detach()


class RouterRecorder:
    """Forward hooks on the routers of the layer templates: what one layer call's routers
    returned (one call per example run when a layer runs example by example). The engine runs
    layers on one compute thread, one at a time."""

    def __init__(self, spec: RouterSpec):
        self.spec = spec
        self._calls: list[torch.Tensor] | None = None

    def __deepcopy__(self, memo) -> RouterRecorder:
        # a copied template (a LoRA run's, its linears swapped) records into the same recorder
        return self

    def attach(self, layer: nn.Module) -> bool:
        """Hook ``layer``'s routers; whether it has any."""
        routers = self.spec.routers(layer)
        for m in routers:
            m.register_forward_hook(self._hook)
        return bool(routers)

    def _hook(self, _module: nn.Module, _inputs: Any, output: Any) -> None:
        if self._calls is not None:
            self._calls.append(output[self.spec.output_index] if isinstance(output, tuple) else output)

    def start(self) -> None:
        self._calls = []

    def stop(self) -> torch.Tensor:
        calls, self._calls = self._calls, None
        assert calls, "an MoE layer ran without its router"
        return calls[0] if len(calls) == 1 else torch.cat([c.reshape(-1, c.shape[-1]) for c in calls])


class LayerTail(torch.autograd.Function):
    """Identity on a layer's output whose backward also returns the aux loss's gradient for the
    layer's router logits (read from the micro-batch's :class:`RouterState` when the backward
    runs, after the head filled it) and zeros for the unit's frozen tensors."""

    @staticmethod
    def forward(ctx, y, state, index, router_logits, *frozen):  # noqa: D102
        ctx.state, ctx.index = state, index
        ctx.frozen = [(f.shape, f.dtype, f.device) for f in frozen]
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad_y):  # noqa: D102
        g_router = None
        if ctx.state is not None:
            assert ctx.index in ctx.state.grads, "a layer's backward ran before the head's aux loss"
            g_router = ctx.state.grads[ctx.index]
        zeros = [torch.zeros(s, dtype=d, device=dev) for s, d, dev in ctx.frozen]
        return (grad_y, None, None, g_router, *zeros)
