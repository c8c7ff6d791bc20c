"""Device memory of a plan: the slots the engine allocates once, plus what each op holds.

The engine checks plans with this before training and the planner's cost model and simulator use
the same slots and transients, so all three agree on what fits. In flight (asynchronous device):
only the offloads of the ``OFFLOAD_WINDOW_OPS - 1`` ops before, since compute waits for older
ones. The peak is the largest sum over the ops."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..models.names import EMBED, HEAD, layer_unit
from .plan import Plan
from .program import (BACKWARD_OPS, FETCH_AHEAD, FORWARD_OPS, Op, OpKind, micro_batch_program,
                      resident_units)
from .shape import ModelShape


GRAD_SLOTS = 2
"""Device gradient slots: one being filled by a backward while the other is copied out."""
FETCH_SLOTS = 2
"""Device slots for fetched boundaries: the one in use and the one being fetched ahead."""


def fetch_slot_count(num_offloaded: int, per_load: int = 1) -> int:
    """Fetch slots the engine allocates: ``FETCH_SLOTS`` for one micro-batch at a time; in
    layer-major order each micro-batch of a group may hold one fetched boundary across the ops
    between its fetch and its layer's backward, plus one fetched ahead (none without offloaded
    boundaries)."""
    return min(FETCH_SLOTS + per_load - 1, num_offloaded * per_load)


def grad_slot_itemsize(compute_itemsize: int, per_load: int = 1) -> int:
    """Bytes per element of the device gradient slots: the compute dtype's, or fp32 in
    layer-major order, where a slot sums a unit's gradient over the group's micro-batches."""
    return compute_itemsize if per_load == 1 else 4


OFFLOAD_WINDOW_OPS = 1
"""An op's compute waits for the device-to-host offloads queued this many ops back (and older;
``engine/slots.py`` ``OffloadWindow``). 1: the next op starts once this op's offloads have left,
which is the window the planner already gives them (a forward window lasts at least as long as
its D2H copies), so the bound costs no time in a plan the planner made and no device memory
beyond the op's own transient. Each op more would let a copy lag one more op behind a jittery
copy lane, at the price of one more op's offloads (a host-tier layer's internals are ~20
boundaries) in device memory at every op."""
CUDA_WORKSPACE_BYTES = 64 << 20
"""What a CUDA device holds besides the engine's tensors that the allocator reports: cuBLAS
workspaces and the allocator's rounding of blocks (the CUDA context itself is not reported).
The attention kernel's workspace grows with the shape and is priced apart
(:func:`attention_workspace_bytes`)."""
FLASH_SEQ_ROUND = 128
"""The fused kernels round the sequence of their fp32 buffers up to this (flash-attn's
``seqlen_q_rounded``)."""


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


def attention_workspace_bytes(shape: ModelShape, micro_batch_size: int, seq_len: int,
                              elem_bytes: int, i: int = 0) -> int:
    """Device bytes the attention kernel allocates inside layer ``i``'s CUDA backward beyond what
    the layer saved, for one micro-batch: SDPA priced as flash-attn's backward (``softmax_d``, the
    fp32 ``dq`` accumulator, un-summed ``dk``/``dv`` with grouped heads); an eager family instead
    the score gradient in the compute dtype and twice in fp32. Linear attention: none."""
    c = shape.layer(i)
    if c is not None and not c.pair_flops:
        return 0
    h, d, s, b = shape.num_heads, shape.head_dim, seq_len, micro_batch_size
    if shape.eager_attention:
        return b * h * s * s * (elem_bytes + 8)
    s_r = _round_up(s, FLASH_SEQ_ROUND)
    d_r = _round_up(d, 32) if d <= 192 else 256
    per_row = h * s_r * 4 + s_r * h * d_r * 4
    if shape.num_kv_heads != h:
        per_row += 2 * s * h * d * elem_bytes
    return b * per_row


@dataclass
class MemoryEstimate:
    peak_bytes: int
    peak_op: str
    """The op at which the peak occurs."""
    breakdown: dict[str, int] = field(default_factory=dict)
    """Bytes by category at the peak: weights, activations, transient."""

    def describe(self) -> str:
        return ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in self.breakdown.items())


def layer_workspace_bytes(shape: ModelShape, tokens: int, elem_bytes: int, i: int = 0,
                          seq_len: int = 0) -> int:
    """What autograd keeps for layer ``i``'s backward over ``tokens`` tokens in rows of ``seq_len``:
    per-layer facts where measured (``models/saved_bytes.py``), else the closed-form families'
    tensors counted by hand (``tests/plan/test_module_facts.py`` holds the two equal)."""
    c = shape.layer(i)
    if c is not None:
        return int(tokens * (c.workspace_per_token + c.workspace_per_token_pos * seq_len)
                   * elem_bytes)
    per_token = (6 * shape.hidden_size + 2 + 2 * shape.q_dim + 2 * shape.kv_dim
                 + shape.num_heads + 4 * shape.intermediate_size)
    if shape.qk_norm:
        per_token += 2 * shape.q_dim + 2 * shape.kv_dim + shape.num_heads + shape.num_kv_heads
    return tokens * per_token * elem_bytes


def _widest_bytes(shape: ModelShape, i: int, tokens: int, elem_bytes: int) -> int:
    """The MLP's widest intermediates of a forward without a graph (gate and up)."""
    c = shape.layer(i)
    per_token = c.widest_per_token if c is not None else 2 * shape.intermediate_size
    return tokens * per_token * elem_bytes


def op_transient_bytes(shape: ModelShape, kind: OpKind, i: int, tokens: int, elem_bytes: int,
                       head_chunk_tokens: int, seq_len: int = 0) -> int:
    """Device bytes an op holds only while it runs (inputs, outputs, grads, workspace)."""
    a = tokens * shape.hidden_size * elem_bytes  # one boundary activation
    if kind in (OpKind.EMBED_FWD, OpKind.RECOMPUTE_EMBED):
        return a
    if kind in (OpKind.LAYER_FWD, OpKind.RECOMPUTE_LAYER):
        # input + output + the MLP's widest intermediates (no graph kept)
        return 2 * a + _widest_bytes(shape, i, tokens, elem_bytes)
    if kind == OpKind.LAYER_FWD_KEEP:
        # the saved tensors as they are made (device tier: they stay, as kept internals, after
        # the op; host tier: they leave) + the output + one MLP intermediate not saved
        return (a + _widest_bytes(shape, i, tokens, elem_bytes) // 2
                + layer_workspace_bytes(shape, tokens, elem_bytes, i, seq_len))
    if kind == OpKind.LAYER_BWD_KEPT:
        # the output and input gradients, the residual branches' gradients inside, the weight
        # gradients (fitted to allocations); the kept internals are counted as live
        return 5 * a + shape.trainable_params(layer_unit(i)) * elem_bytes
    if kind == OpKind.HEAD:
        chunk = min(head_chunk_tokens, tokens)
        params = shape.trainable_params(HEAD) + (shape.trainable_params(EMBED) if shape.tied else 0)
        # fp32 accumulators + one chunk's grads; logits in the compute dtype, their fp32 copy
        # (none when that is fp32 already), the log-softmax output and its gradient
        fp32_copy = 0 if elem_bytes == 4 else 4
        # (4 a: the input, its gradient, and the final norm's output and its gradient, measured)
        return 4 * a + params * (4 + elem_bytes) + chunk * shape.vocab_size * (elem_bytes + fp32_copy + 8)
    if kind == OpKind.LAYER_BWD:
        return (3 * a + shape.trainable_params(layer_unit(i)) * elem_bytes
                + layer_workspace_bytes(shape, tokens, elem_bytes, i, seq_len))
    if kind == OpKind.EMBED_BWD:
        return a + shape.trainable_params(EMBED) * elem_bytes
    return 0  # fetch, fetch_internals


def group_embed_bwd_bytes(shape: ModelShape, kind: OpKind, tokens: int, group: int) -> int:
    """In layer-major order ``embed_bwd`` is one backward over the group's tokens, whose boundary
    gradients it joins in fp32 first (the grad slot's dtype): bytes beyond the op's own."""
    return group * tokens * shape.hidden_size * 4 if kind == OpKind.EMBED_BWD and group > 1 else 0


def mask_bytes(shape: ModelShape, micro_batch_size: int, seq_len: int, elem_bytes: int,
               packed: bool = True) -> int:
    """Device bytes of one micro-batch's attention masks, one per masked type (full, sliding):
    ``[b, 1, s, s]`` for packed rows (assumed), ``[1, 1, s, s]`` otherwise; none for SDPA's plain
    causal path or linear attention."""
    kinds: dict[str, bool] = {}  # attention type -> its window is shorter than the row
    for i, w in enumerate(shape.layer_windows):
        c = shape.layer(i)
        if c is not None and not c.pair_flops:
            continue  # linear attention
        kind = "full" if w is None else "sliding"
        kinds[kind] = kinds.get(kind, False) or (w is not None and w < seq_len)
    masked = [k for k, short in kinds.items() if packed or shape.eager_attention or short]
    per_row = seq_len * seq_len * (elem_bytes if shape.eager_attention else 1)
    return len(masked) * per_row * (micro_batch_size if packed else 1)


def kept_internal_bytes(shape: ModelShape, plan: Plan, i: int, tokens: int, elem_bytes: int,
                        seq_len: int = 0) -> int:
    """Device bytes of layer ``i``'s kept internals once its forward is done (0: recomputed).
    The input boundary is among them, so when the plan also keeps that boundary on the device
    the two share it."""
    if plan.internal_tiers[i] == "recompute":
        return 0
    shared = tokens * shape.hidden_size * elem_bytes if (
        plan.internal_tiers[i] == "device" and plan.boundary_tiers[i] == "device") else 0
    return layer_workspace_bytes(shape, tokens, elem_bytes, i, seq_len) - shared


def group_size(plan: Plan) -> int:
    """Micro-batches that run each op together (one group of the step program)."""
    return max(1, min(plan.micro_batches_per_load, plan.num_micro_batches))


def resident_weight_bytes(shape: ModelShape, plan: Plan, elem_bytes: int) -> int:
    """Device bytes of the resident layers' weights (one buffer each, held for the run)."""
    return sum(shape.unit_weight_bytes(layer_unit(i), elem_bytes) for i in plan.resident_layers)


def slot_bytes(shape: ModelShape, plan: Plan, micro_batch_size: int, seq_len: int, elem_bytes: int,
               grad_slots: bool = True) -> dict[str, int]:
    """Device bytes of the engine's allocations made once, by kind (``grad_slots``: an
    asynchronous device): weight slots for the largest streamed unit, the resident layers'
    weights, gradient slots (fp32 in layer-major order) and fetch slots for a group."""
    resident = resident_units(plan.resident_layers)
    streamed = [u for u in shape.unit_names() if u not in resident]
    largest_streamed = max((shape.unit_weight_bytes(u, elem_bytes) for u in streamed), default=0)
    largest_unit = max(shape.unit_weight_bytes(u, elem_bytes) for u in shape.unit_names())
    per_load = group_size(plan)
    boundary = micro_batch_size * seq_len * shape.hidden_size * elem_bytes
    offloaded = sum(t in ("host", "nvme") for t in plan.boundary_tiers)
    grad = GRAD_SLOTS * largest_unit * grad_slot_itemsize(elem_bytes, per_load) // elem_bytes
    return {
        "weight_slots": (plan.prefetch_depth + 1) * largest_streamed,
        "resident_weights": resident_weight_bytes(shape, plan, elem_bytes),
        "grad_slots": grad if grad_slots else 0,
        "fetch_slots": fetch_slot_count(offloaded, per_load) * boundary,
    }


def offload_bytes(shape: ModelShape, plan: Plan, op: Op, tokens: int, elem_bytes: int,
                  seq_len: int = 0) -> int:
    """Device bytes ``op`` copies to the host (its input boundary, its host-tier internals)."""
    if op.kind not in FORWARD_OPS:
        return 0
    out = tokens * shape.hidden_size * elem_bytes if plan.boundary_tiers[op.index] in ("host", "nvme") else 0
    if op.kind == OpKind.LAYER_FWD_KEEP and plan.internal_tiers[op.index] == "host":
        out += layer_workspace_bytes(shape, tokens, elem_bytes, op.index, seq_len)
    return out


class _Live:
    """What one micro-batch of the group holds on the device across ops."""

    def __init__(self) -> None:
        self.stored: set[int] = set()
        """Boundaries on the device (kept or recomputed; fetched ones are in the fetch slots)."""
        self.kept: dict[int, int] = {}
        """Layer -> bytes of its internals on the device."""
        self.forwarded: set[int] = set()
        """Layers whose forward has run (their host-tier internals can be fetched)."""


def device_bytes_per_op(shape: ModelShape, plan: Plan, micro_batch_size: int, seq_len: int,
                        elem_bytes: int, grad_slots: bool = True, workspace_bytes: int = 0,
                        offload_window_ops: int = OFFLOAD_WINDOW_OPS,
                        attention_workspace: bool = False) -> list[MemoryEstimate]:
    """What the device holds at each op of one group's step program (its peak over the group's
    micro-batches), in program order; slots and resident weights at every op. ``grad_slots``: an
    asynchronous device (offloads may be in flight from ``offload_window_ops - 1`` runs before)."""
    tokens = micro_batch_size * seq_len
    boundary = tokens * shape.hidden_size * elem_bytes
    slots = sum(slot_bytes(shape, plan, micro_batch_size, seq_len, elem_bytes, grad_slots).values())
    slots += workspace_bytes
    group = group_size(plan)
    mask = mask_bytes(shape, micro_batch_size, seq_len, elem_bytes)
    ops = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    live = [_Live() for _ in range(group)]
    lag = offload_window_ops - 1 if grad_slots else 0
    offloads = [offload_bytes(shape, plan, op, tokens, elem_bytes, seq_len) for op in ops]
    runs: list[int] = []  # offload bytes of each op run so far, in the order they ran
    out = []
    for n, op in enumerate(ops):
        k, i = op.kind, op.index
        for mb in live:  # host-tier internals arrive when fetched ahead, for every micro-batch
            for ahead in ops[n:n + 1 + FETCH_AHEAD]:
                if ahead.kind == OpKind.FETCH_INTERNALS and ahead.index in mb.forwarded:
                    mb.kept[ahead.index] = kept_internal_bytes(shape, plan, ahead.index, tokens,
                                                               elem_bytes, seq_len)
        transient = op_transient_bytes(shape, k, i, tokens, elem_bytes, plan.head_chunk_tokens,
                                       seq_len)
        transient += group_embed_bwd_bytes(shape, k, tokens, group)
        if attention_workspace and k in (OpKind.LAYER_BWD, OpKind.LAYER_BWD_KEPT):
            transient += attention_workspace_bytes(shape, micro_batch_size, seq_len, elem_bytes, i)
        best: MemoryEstimate | None = None
        for j, mb in enumerate(live):
            # the window runs on across micro-batches: the previous one's last ops offload nothing
            in_flight = sum(runs[max(0, len(runs) - lag):]) if lag else 0
            _store(plan, mb, k, i)
            acts = (sum(len(m.stored) for m in live) + carried(k, j, group)) * boundary
            internals = sum(sum(m.kept.values()) for m in live)
            est = MemoryEstimate(slots + acts + internals + transient + group * mask + in_flight, str(op), {
                "slots": slots, "activations": acts, "internals": internals,
                "transient": transient + group * mask, "offloads_in_flight": in_flight})
            if best is None or est.peak_bytes > best.peak_bytes:
                best = est
            _release(shape, plan, mb, k, i, tokens, elem_bytes, seq_len)
            runs.append(offloads[n])
        assert best is not None
        out.append(best)
    return out


def carried(kind: OpKind, j: int, group: int) -> int:
    """Boundary-sized tensors the group's other micro-batches carry between ops while the op
    runs for its ``j``-th: each one's hidden state in the forward, or its gradient in the
    backward (none before its embedding ran, none after its embedding's backward)."""
    if kind == OpKind.EMBED_FWD:
        return j
    if kind == OpKind.EMBED_BWD:
        return group - 1 - j
    return group - 1


def _store(plan: Plan, mb: _Live, kind: OpKind, i: int) -> None:
    """What an op holds from its start: its stored input boundary, a recomputed one."""
    if kind in FORWARD_OPS and plan.boundary_tiers[i] == "device":
        mb.stored.add(i)
    elif kind == OpKind.RECOMPUTE_EMBED:
        mb.stored.add(0)
    elif kind == OpKind.RECOMPUTE_LAYER:
        mb.stored.add(i + 1)


def _release(shape: ModelShape, plan: Plan, mb: _Live, kind: OpKind, i: int, tokens: int,
             elem_bytes: int, seq_len: int) -> None:
    """What an op lets go of (a backward: its boundary, its internals) or keeps after it ends."""
    if kind in BACKWARD_OPS:
        mb.stored.discard(i)
        mb.kept.pop(i, None)
    elif kind == OpKind.LAYER_FWD_KEEP:
        mb.forwarded.add(i)
        if plan.internal_tiers[i] == "device":
            mb.kept[i] = kept_internal_bytes(shape, plan, i, tokens, elem_bytes, seq_len)


def predict_peak_device_bytes(shape: ModelShape, plan: Plan, micro_batch_size: int,
                              seq_len: int, elem_bytes: int, grad_slots: bool = True,
                              workspace_bytes: int = 0,
                              offload_window_ops: int = OFFLOAD_WINDOW_OPS,
                              attention_workspace: bool = False) -> MemoryEstimate:
    """The largest of :func:`device_bytes_per_op` (the first op to reach it)."""
    return max(device_bytes_per_op(shape, plan, micro_batch_size, seq_len, elem_bytes, grad_slots,
                                   workspace_bytes, offload_window_ops, attention_workspace),
               key=lambda est: est.peak_bytes)
