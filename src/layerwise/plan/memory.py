"""Device memory of a plan: walk the step program, add up what each op holds.

Live across ops: weight buffers (the op's units plus ``prefetch_depth`` uses ahead, by
:func:`~.program.weight_windows`, the rule the engine's weight streamer follows), stored
boundary activations (device tier until their layer's backward; host/NVMe ones from their
fetch; recomputed ones from their recompute). Transient within an op: the op's inputs,
outputs, gradients and autograd workspace. The peak is the largest sum over the ops.

The engine checks plans with this before training; the planner's cost model and simulator use
the same transients, so both agree on what fits.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.names import EMBED, HEAD, layer_unit
from .plan import Plan
from .program import OpKind, micro_batch_program, weight_windows
from .shape import ModelShape


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_op: str
    """The op at which the peak occurs."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the peak: weights, activations, transient."""

    def describe(self) -> str:
        return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.breakdown.items())


def layer_workspace_bytes(shape: ModelShape, tokens: int, elem_bytes: int) -> int:
    """What autograd keeps for one decoder layer's backward.

    Per token: norm inputs and outputs, q/k/v before and after rotary, attention output, the
    o_proj input, the MLP gate, up, activation and product. Measured with saved_tensors_hooks
    it is within 2% on the CPU benchmark model.
    """
    per_token = (4 * shape.hidden_size + 3 * shape.q_dim + 4 * shape.kv_dim
                 + 4 * shape.intermediate_size)
    return tokens * per_token * elem_bytes


def op_transient_bytes(shape: ModelShape, kind: OpKind, i: int, tokens: int, elem_bytes: int,
                       head_chunk_tokens: int) -> int:
    """Device bytes an op holds only while it runs (inputs, outputs, grads, workspace)."""
    a = tokens * shape.hidden_size * elem_bytes  # one boundary activation
    if kind in (OpKind.EMBED_FWD, OpKind.RECOMPUTE_EMBED):
        return a
    if kind in (OpKind.LAYER_FWD, OpKind.RECOMPUTE_LAYER):
        # input + output + the MLP's widest intermediates (no graph kept)
        return 2 * a + tokens * 2 * shape.intermediate_size * elem_bytes
    if kind == OpKind.HEAD:
        chunk = min(head_chunk_tokens, tokens)
        grads = (shape.unit_params(HEAD) + (shape.unit_params(EMBED) if shape.tied else 0)) * elem_bytes
        # logits in compute dtype, their fp32 copy and its gradient
        return 2 * a + grads + chunk * shape.vocab_size * (elem_bytes + 8)
    if kind == OpKind.LAYER_BWD:
        return (3 * a + shape.unit_params(layer_unit(i)) * elem_bytes
                + layer_workspace_bytes(shape, tokens, elem_bytes))
    if kind == OpKind.EMBED_BWD:
        return a + shape.unit_params(EMBED) * elem_bytes
    return 0  # fetch


def device_bytes_per_op(shape: ModelShape, plan: Plan, micro_batch_size: int, seq_len: int,
                        elem_bytes: int) -> list[MemoryEstimate]:
    """What the device holds at each op of the program (its peak within the op), in program
    order; separate from the peak so each op's weights can be checked against the streamer."""
    tokens = micro_batch_size * seq_len
    boundary = tokens * shape.hidden_size * elem_bytes
    unit_bytes = {u: shape.unit_params(u) * elem_bytes for u in shape.unit_names()}
    ops = micro_batch_program(plan.boundary_tiers)
    windows = weight_windows(ops, shape.tied, plan.prefetch_depth)
    stored: set[int] = set()
    out = []
    for op, window in zip(ops, windows):
        weights = sum(unit_bytes[u] for u in window)
        k, i = op.kind, op.index
        if k == OpKind.LAYER_FWD and plan.boundary_tiers[i] == "device":
            stored.add(i)
        elif k in (OpKind.FETCH, OpKind.RECOMPUTE_EMBED):
            stored.add(max(i, 0))
        elif k == OpKind.RECOMPUTE_LAYER:
            stored.add(i + 1)
        transient = op_transient_bytes(shape, k, i, tokens, elem_bytes, plan.head_chunk_tokens)
        acts = len(stored) * boundary
        out.append(MemoryEstimate(weights + acts + transient, str(op), {
            "weights": weights, "activations": acts, "transient": transient}))
        if k == OpKind.LAYER_BWD:
            stored.discard(i)
    return out


def predict_peak_device_bytes(shape: ModelShape, plan: Plan, micro_batch_size: int,
                              seq_len: int, elem_bytes: int) -> MemoryEstimate:
    """The largest of :func:`device_bytes_per_op` (the first op to reach it)."""
    best = MemoryEstimate(0, "", {})
    for est in device_bytes_per_op(shape, plan, micro_batch_size, seq_len, elem_bytes):
        if est.peak_bytes > best.peak_bytes:
            best = est
    return best
