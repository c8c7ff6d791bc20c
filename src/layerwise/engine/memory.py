"""Predicted device memory of a plan: walk the step program, add up what each op holds.

Live across ops: weight buffers (the op's units plus ``prefetch_depth`` uses ahead), stored
boundary activations (device tier until their layer's backward; host/NVMe ones from their
fetch; recomputed ones from their recompute). Transient within an op: the op's inputs,
outputs, gradients and autograd workspace. The peak is the largest sum over the ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.adapter import DecoderAdapter
from ..plan.plan import Plan
from .program import micro_batch_program, weight_schedule


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_op: str
    """The op at which the peak occurs."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the peak: weights, activations, transient."""

    def describe(self) -> str:
        return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.breakdown.items())


def layer_workspace_elems_per_token(adapter: DecoderAdapter) -> int:
    """Elements autograd keeps per token for one decoder layer's backward (approximate).

    Norm inputs and outputs, q/k/v before and after rotary, attention output, the o_proj input,
    the MLP gate, up, activation and product.
    """
    cfg = adapter.config
    h = cfg.hidden_size
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or h // heads
    q = heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    f = cfg.intermediate_size
    return 4 * h + 3 * q + 4 * kv + 4 * f


def predict_peak_device_bytes(adapter: DecoderAdapter, plan: Plan, micro_batch_size: int,
                              seq_len: int, elem_bytes: int) -> MemoryEstimate:
    tokens = micro_batch_size * seq_len
    boundary = tokens * adapter.hidden_size * elem_bytes
    unit_bytes = {u.name: u.numel * elem_bytes for u in adapter.units}
    ops = micro_batch_program(plan)
    tied = adapter.tied
    schedule = weight_schedule(ops, tied)
    layer_ws = tokens * layer_workspace_elems_per_token(adapter) * elem_bytes
    chunk = min(plan.head_chunk_tokens, tokens)
    # logits in compute dtype, their fp32 copy and its gradient
    head_ws = chunk * adapter.vocab_size * (elem_bytes + 8)

    stored: set[int] = set()
    cursor = 0  # position in the weight schedule
    best = MemoryEstimate(0, "", {})
    for op in ops:
        units = op.units(tied)
        window = schedule[cursor:cursor + len(units) + plan.prefetch_depth]
        weights = sum(unit_bytes[u] for u in set(window))
        cursor += len(units)
        k, i = op.kind, op.index
        if k == "layer_fwd" and plan.boundaries[i] == "device":
            stored.add(i)
        elif k == "fetch" or k == "recompute_embed":
            stored.add(max(i, 0))
        elif k == "recompute_layer":
            stored.add(i + 1)
        if k in ("embed_fwd", "recompute_embed"):
            transient = boundary
        elif k in ("layer_fwd", "recompute_layer"):
            # input + output + the MLP's widest intermediates (no graph kept)
            transient = 2 * boundary + tokens * 2 * adapter.config.intermediate_size * elem_bytes
        elif k == "head":
            grads = unit_bytes["head"] + (unit_bytes["embed"] if tied else 0)
            transient = 2 * boundary + grads + head_ws
        elif k == "layer_bwd":
            transient = 3 * boundary + unit_bytes[f"layers.{i}"] + layer_ws
        elif k == "embed_bwd":
            transient = boundary + unit_bytes["embed"]
        else:  # fetch
            transient = 0
        acts = len(stored) * boundary
        total = weights + acts + transient
        if total > best.peak_bytes:
            best = MemoryEstimate(total, str(op), {
                "weights": weights, "activations": acts, "transient": transient})
        if k == "layer_bwd":
            stored.discard(i)
    return best
