"""What autograd keeps for a decoder layer's backward, measured by running the layer.

Rather than a formula per family, the layer runs as the engine runs it under
``saved_tensors_hooks`` over 256 and 512 tokens (separating linear from quadratic growth), and
the distinct saved storages are counted, less weights and shared tensors. On the CPU, not meta,
because a routed MoE picks experts by data; weights are zero-stride views and products are not
computed, so it costs no memory and does not depend on a draw."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

PROBE_SEQ_LENS = (256, 512)
"""The two sequence lengths (one row each) the layer runs at: multiples of the chunk lengths of
chunked kernels (the gated delta rule's 64, Mamba-2's 256), which pad a shorter row to a chunk."""


@dataclass(frozen=True)
class SavedBytes:
    per_token: float
    """Bytes per token (fp32 compute) the layer's forward saves for its backward."""
    per_token_pos: float
    """Bytes per token per position of its row (attention probabilities; 0 for kernels that
    save none, as SDPA's flash kernels)."""
    tensors: int = 0
    """Saved tensors (weights' views and shared tensors too): each one a call of the engine's
    pack hook in a kept forward and of its unpack hook in the backward."""
    storages: int = 0
    """Distinct activation storages among them: what the host tier copies out and back, one copy
    each. A routed layer's as the probe routes (every token alike: top-k experts hit)."""


_GEMMS = frozenset({torch.ops.aten.mm.default, torch.ops.aten.addmm.default,
                    torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default,
                    torch.ops.aten._grouped_mm.default})


class _ShapeOnlyGemms(TorchDispatchMode):
    """Matrix products return zeros of their output's shape, uncomputed: below autograd, so what
    the graph saves is unchanged, and a layer of a 100B model is measured in milliseconds."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func not in _GEMMS:
            return func(*args, **kwargs)
        grouped = func is torch.ops.aten._grouped_mm.default  # its meta kernel takes bf16 only

        def on_meta(t: torch.Tensor) -> torch.Tensor:
            dtype = torch.bfloat16 if grouped and t.is_floating_point() else t.dtype
            return torch.empty(t.shape, dtype=dtype, device="meta")

        meta_args, meta_kwargs = tree_map_only(torch.Tensor, on_meta, (args, kwargs))
        shape = func(*meta_args, **meta_kwargs).shape
        return torch.zeros(shape, dtype=args[0].dtype)


def _constant_params(adapter, index: int) -> dict[str, torch.Tensor]:
    """Layer ``index``'s parameters as leaves viewing one constant fp32 element (no memory)."""
    one = torch.full((1,), 0.02)
    out = {}
    for spec in adapter.layer_units[index].params:
        v = one.view((1,) * len(spec.shape)).expand(spec.shape) if spec.shape else one[0]
        out[spec.local] = v.requires_grad_(spec.trainable)
    return out


def _saved_once(adapter, index: int, seq_len: int) -> tuple[int, int, int]:
    """(bytes, saved tensors, activation storages) of layer ``index`` over one row of ``seq_len``."""
    params = _constant_params(adapter, index)
    rotary = adapter.new_rotary("cpu")
    ctx = adapter.layer_context((1, seq_len), "cpu", torch.float32, rotary)
    skip = {t.untyped_storage().data_ptr() for t in ctx.shared_tensors()}
    skip |= {p.untyped_storage().data_ptr() for p in params.values()}
    saved: dict[int, torch.Tensor] = {}  # held, so no later tensor reuses an address
    calls = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        calls[0] += 1
        ptr = t.untyped_storage().data_ptr()
        if ptr not in skip and t.device.type == "cpu" and t.numel():
            saved.setdefault(ptr, t)
        return t

    hidden = torch.randn(1, seq_len, adapter.config.hidden_size,
                         generator=torch.Generator().manual_seed(0)).requires_grad_()
    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            _ShapeOnlyGemms():
        adapter.layer(index, params, hidden, ctx)
    return sum(t.untyped_storage().nbytes() for t in saved.values()), calls[0], len(saved)


def layer_saved_bytes(adapter, index: int) -> SavedBytes:
    """Layer ``index``'s saved bytes, fitted ``a * s + b * s**2`` at :data:`PROBE_SEQ_LENS` (or half
    and all of the model's positions where fewer), with the longer probe's tensors and storages."""
    s1, s2 = PROBE_SEQ_LENS
    longest = next((v for k in ("max_position_embeddings", "n_positions", "n_ctx")
                    if isinstance(v := getattr(adapter.config, k, None), int) and v > 1), s2)
    if longest < s2:  # learned positions or a fixed causal mask of fewer (a tiny config)
        s1, s2 = longest // 2, longest
    (b1, *_), (b2, tensors, storages) = (_saved_once(adapter, index, s) for s in (s1, s2))
    quad = (b2 * s1 - b1 * s2) / (s1 * s2 * (s2 - s1))
    lin = b1 / s1 - quad * s1
    if quad < 0 or lin < 0:  # not of that form (a fixed term): the shorter probe per token
        return SavedBytes(b1 / s1, 0.0, tensors, storages)
    return SavedBytes(lin, quad, tensors, storages)


def saved_bytes_by_layer(adapter) -> tuple[SavedBytes, ...]:
    """:func:`layer_saved_bytes` of every decoder layer, measured once per structure (template)."""
    measured: dict[int, SavedBytes] = {}
    out = []
    for unit in adapter.layer_units:
        key = id(adapter.layer_template(unit.index))
        if key not in measured:
            measured[key] = layer_saved_bytes(adapter, unit.index)
        out.append(measured[key])
    return tuple(out)
