"""Per-layer sizes and FLOPs, read off the adapter's (meta) modules: what a layer streams, what
one token costs in it, and what its token mixer costs per attention pair.

Layers differ (dense/MoE, full/sliding/linear/latent attention): a layer's bytes are all its
tensors, its FLOPs only what a token runs through (routed experts at ``top_k / num_experts``).
FLOP conventions are ``planner/cost.py``'s; a linear-attention layer costs
``4 * v_heads * k_head_dim * v_head_dim`` per token instead of pairs. Model FLOPs of a step are
3x the forward."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .attention import RowLayout
from .families import LINEAR_ATTENTION


@dataclass(frozen=True)
class LayerFacts:
    index: int
    token_mixer: str
    """``full_attention``, ``sliding_attention`` or ``linear_attention``."""
    window: int | None
    """Sliding window (None: full causal, or no attention pairs)."""
    params: int
    """Every tensor of the unit (its streamed and stored size), frozen ones included."""
    active_matmul_params: int
    """Weights one token multiplies through (routed experts: ``top_k`` of them)."""
    pair_flops: float
    """Forward FLOPs per causal (query, key) pair, all heads (0 for linear attention)."""
    token_mixer_flops_per_token: float
    """Forward FLOPs per token of a recurrent token mixer's state (0 for attention)."""
    num_experts: int = 0
    """Routed experts (0: a dense layer)."""
    experts_per_token: int = 0
    routed_expert_params: int = 0
    """Parameters of all routed experts together (the part of ``params`` top-k reads from)."""
    mlp_active_matmul_params: int = 0
    """Of ``active_matmul_params``, the MLP's (``mlp.*``: routed experts at top-k, shared ones,
    the router); the rest is the token mixer's."""

    def forward_flops(self, tokens: int, pairs: int) -> float:
        """Forward FLOPs over ``tokens`` tokens whose attention scores ``pairs`` pairs."""
        return (2.0 * self.active_matmul_params * tokens + self.pair_flops * pairs
                + self.token_mixer_flops_per_token * tokens)


def _experts(layer: nn.Module) -> tuple[dict[int, int], int]:
    """(id of each routed-expert parameter -> its experts count, top-k), for a layer's MoE."""
    top_k = max((int(getattr(m, "top_k")) for m in layer.modules()
                 if isinstance(getattr(m, "top_k", None), int)), default=0)
    out: dict[int, int] = {}
    for m in layer.modules():
        n = getattr(m, "num_experts", None)
        if not isinstance(n, int) or n < 2 or getattr(m, "top_k", None) is not None:
            continue  # a router (it has top_k) holds no expert weights
        for p in m.parameters(recurse=False):
            if p.dim() >= 2 and p.shape[0] == n:
                out[id(p)] = n
    return out, top_k


def _pair_flops(layer: nn.Module, config) -> float:
    attn = getattr(layer, "self_attn", None) or next(  # GPT-2's attn, GPT-NeoX's attention
        (m for n, m in layer.named_children() if "attn" in n or "attention" in n), None)
    heads = getattr(config, "num_attention_heads", None)
    if attn is None or not heads:
        return 0.0
    heads = int(heads)
    head_dim = getattr(attn, "head_dim", None) or config.hidden_size // heads
    qk = getattr(attn, "qk_head_dim", None) or head_dim
    v = getattr(attn, "v_head_dim", None) or head_dim
    return 2.0 * heads * (qk + v)


def _recurrent_flops(layer: nn.Module) -> float:
    mixer = getattr(layer, "linear_attn", None)
    if mixer is None:
        return 0.0
    heads = getattr(mixer, "num_v_heads", 0)
    return 4.0 * heads * getattr(mixer, "head_k_dim", 0) * getattr(mixer, "head_v_dim", 0)


def layer_facts(adapter) -> tuple[LayerFacts, ...]:
    """The facts of every decoder layer of a :class:`~layerwise.models.adapter.DecoderAdapter`."""
    out = []
    for unit in adapter.layer_units:
        i = unit.index
        layer = adapter.layer_module(i)
        experts, top_k = _experts(layer)
        active = routed = mlp = 0
        for name, p in layer.named_parameters():
            if p.dim() < 2:
                continue
            n = experts.get(id(p))
            if n is None:
                used = p.numel()
            else:
                routed += p.numel()
                used = p.numel() * top_k // n
            active += used
            mlp += used if name.startswith("mlp.") else 0
        kind = adapter.layer_types[i]
        out.append(LayerFacts(
            i, kind, adapter.layer_windows[i], unit.numel, active,
            0.0 if kind == LINEAR_ATTENTION else _pair_flops(layer, adapter.config),
            _recurrent_flops(layer), max(experts.values(), default=0), top_k if experts else 0,
            routed, mlp))
    return tuple(out)


def attention_pairs(seq_len: int, window: int | None) -> int:
    """(query, key) pairs a causal (windowed) attention scores over ``seq_len`` positions."""
    if window is None or window >= seq_len:
        return seq_len * (seq_len + 1) // 2
    return window * (window + 1) // 2 + (seq_len - window) * window


def model_flops(facts: tuple[LayerFacts, ...], hidden_size: int, vocab_size: int,
                layout: RowLayout) -> float:
    """Forward + backward FLOPs of one micro-batch (no recompute): the layers' with attention
    over the spans the masks allow (each example of a packed row on its own), and the head's."""
    b, s = layout.shape
    spans = [e - a for _, a, e in layout.runs] if layout.packed else [s] * b
    tokens = b * s
    fwd = 2.0 * hidden_size * vocab_size * tokens
    for f in facts:
        pairs = 0 if f.pair_flops == 0 else sum(attention_pairs(n, f.window) for n in spans)
        fwd += f.forward_flops(tokens, pairs)
    return 3.0 * fwd
