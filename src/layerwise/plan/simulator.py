"""Discrete-event simulation of training steps under a Plan, with the engine's real dependencies.

Lanes (each runs its work in issue order, one item at a time, like a CUDA stream or a worker
thread): ``compute``, ``h2d`` (weights in, offloaded activations back), ``d2h`` (gradients and
activations out), ``host`` (fp32 gradient accumulation), ``nvme`` (the engine's single
activation I/O thread: writes and reads), ``optimizer`` (host AdamW workers), and for a
data-parallel :class:`~.topology.Topology` ``intra`` (gradient reduction inside the node) and
``inter`` (all-reduce between nodes). On a synchronous machine (the CPU backend) copies,
accumulation, reduction and the optimizer share the compute lane.

Dependencies modelled (as ``layerwise.engine`` runs them):

- the op program per micro-batch is the engine's (:func:`micro_batch_program`): forward, head,
  backward in reverse with fetches and segment recomputes from the nearest stored boundary below;
- weights follow the step's weight schedule ``prefetch_depth`` uses ahead, by the engine's own
  rule (:class:`~.program.WeightWindow`): the copy for use ``k + depth`` is issued when use ``k``
  is acquired, which is when the compute lane reaches it (a unit still held by a nearby use is
  not copied again);
- a weight copy of unit ``u`` in step ``s+1`` waits for ``u``'s optimizer update of step ``s``,
  and blocks the copies issued after it (the engine's host thread waits there);
- an op waits for its weights and its input boundary (fetched, recomputed or kept);
- a stored boundary's D2H copy is issued at its ``layer_fwd`` (host-tier internals' at their
  ``layer_fwd_keep``), and compute waits for the offloads queued ``OFFLOAD_WINDOW_OPS`` ops back
  (the engine's ``OffloadWindow``); an NVMe write follows its D2H; the
  NVMe read is issued two ops before its ``fetch``; a host/NVMe boundary's H2D copy is issued when
  the compute op before its ``fetch`` starts;
- each gradient goes D2H when its op ends, then is accumulated in fp32 on the host (the
  synchronous CPU backend adds it in place, without the copy); a unit's first landing of the
  step writes instead of adding;
- the optimizer starts when the last gradient of the step has landed (global clip needs all),
  updating embed, layers 0.., head in order (each update, then its compute copy's refresh into
  the pinned arena), overlapping the next step's forward.

Data parallel (``topology``; :mod:`.topology` says what is shared): one GPU's process is
simulated, on the machine as it sees it while its node's other GPUs run too
(:func:`~.topology.rank_hardware`). After a unit's last gradient of the step is accumulated it is
reduced to its owner (``intra``) and all-reduced between nodes on the owner's NIC (``inter``);
with ``grad_reduce="device"`` every micro-batch's gradient is reduced on the GPUs before its copy
instead, and only the owner copies and accumulates it. The optimizer starts when every unit is
reduced, each owner updating its own units in order on its own lane. The simulated (traced)
process is the owner with the most parameters, the one the step waits for; other owners' lanes
are timed but not traced, and carry only their owner work (their activation copies are not
modelled). Host and NVMe bytes are then the node's: one store, with host-side sums the other
processes' own fp32 gradients, and everyone's offloaded activations.

The simulated step is the steady-state one: the time between the ends of consecutive steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .cost import CostModel
from .shape import ModelShape
from .hardware import HardwareProfile
from .plan import Plan
from .memory import FETCH_SLOTS, GRAD_SLOTS, OFFLOAD_WINDOW_OPS, kept_internal_bytes
from .program import (FETCH_AHEAD, FORWARD_OPS, RECOMPUTE_OPS, OpKind, WeightWindow, micro_batch_program,
                      weight_schedule)
from .topology import (REDUCE_BYTES_PER_PARAM, Topology, assign_owners, host_reduce_s, inter_allreduce_s,
                       intra_reduce_s, rank_hardware)

LANES = ("compute", "h2d", "d2h", "host", "nvme", "optimizer", "intra", "inter")


@dataclass
class Interval:
    lane: str
    start: float
    end: float
    label: str
    step: int


@dataclass
class Alloc:
    tier: str
    """``device``, ``host`` (pinned activations; the store is counted separately) or ``nvme``."""
    start: float
    end: float
    nbytes: int
    label: str


@dataclass
class SimResult:
    plan: Plan
    step_s: float
    tokens_per_step: int
    model_flops_per_step: float
    busy_s: dict[str, float]
    """Busy seconds per lane inside the measured step."""
    peak_device_bytes: int
    device_cap_bytes: int
    peak_pinned_act_bytes: int
    """Peak pinned host bytes held by offloaded activations (and NVMe staging)."""
    host_store_bytes: int
    host_cap_bytes: int
    peak_nvme_bytes: int
    nvme_cap_bytes: int
    recompute_s: float
    """Compute seconds per step spent recomputing dropped boundaries."""
    window: tuple[float, float]
    """(start, end) of the measured step on the simulated clock."""
    intervals: list[Interval] = field(repr=False, default_factory=list)
    allocs: list[Alloc] = field(repr=False, default_factory=list)
    op_log: list[dict[str, Any]] = field(repr=False, default_factory=list)
    """Every compute op: kind, index, micro-batch, step, start, end, needs (weights, boundary)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens_per_step / self.step_s

    @property
    def achieved_tflops(self) -> float:
        return self.model_flops_per_step / self.step_s / 1e12

    @property
    def idle_s(self) -> dict[str, float]:
        return {k: max(0.0, self.step_s - v) for k, v in self.busy_s.items()}

    @property
    def peak_host_bytes(self) -> int:
        return self.host_store_bytes + self.peak_pinned_act_bytes

    def over_capacity(self) -> dict[str, int]:
        """Bytes over capacity per tier (empty when the plan fits)."""
        out = {}
        for tier, used, cap in (("device", self.peak_device_bytes, self.device_cap_bytes),
                                ("host", self.peak_host_bytes, self.host_cap_bytes),
                                ("nvme", self.peak_nvme_bytes, self.nvme_cap_bytes)):
            if used > cap:
                out[tier] = used - cap
        return out

    @property
    def fits(self) -> bool:
        return not self.over_capacity()

    def summary(self) -> dict[str, Any]:
        return {
            "step_s": self.step_s,
            "tokens_per_s": self.tokens_per_s,
            "achieved_tflops": self.achieved_tflops,
            "recompute_s": self.recompute_s,
            "peak_device_bytes": self.peak_device_bytes,
            "device_cap_bytes": self.device_cap_bytes,
            "peak_host_bytes": self.peak_host_bytes,
            "peak_pinned_act_bytes": self.peak_pinned_act_bytes,
            "peak_nvme_bytes": self.peak_nvme_bytes,
            "busy_s": dict(self.busy_s),
            "idle_s": self.idle_s,
            "fits": self.fits,
        }


def peak_bytes(allocs: list[Alloc], tier: str) -> int:
    """Largest sum of live ``tier`` allocations at any instant ([start, end) intervals)."""
    events = []
    for a in allocs:
        if a.tier == tier and a.nbytes and a.end > a.start:
            events.append((a.start, 1, a.nbytes))
            events.append((a.end, 0, -a.nbytes))
    events.sort()  # frees (0) before allocations (1) at the same instant
    cur = best = 0
    for _, _, d in events:
        cur += d
        best = max(best, cur)
    return best


class _Lanes:
    def __init__(self, synchronous: bool, me: int = 0):
        self.free: dict[str, float] = {}
        self.map = {k: k for k in LANES}
        if synchronous:
            for k in ("h2d", "d2h", "host", "optimizer", "intra", "inter"):
                self.map[k] = "compute"
        self.me = me
        """The simulated process (local rank); other ranks' lanes are timed, not traced."""
        self.intervals: list[Interval] = []
        self.step = 0

    def run(self, lane: str, earliest: float, dur: float, label: str, rank: int | None = None) -> tuple[float, float]:
        """Run on the simulated process's ``lane``, or on another local ``rank``'s own one."""
        mine = rank is None or rank == self.me
        physical = self.map[lane] if mine else f"{lane}@{rank}"
        start = max(self.free.get(physical, 0.0), earliest)
        end = start + dur
        self.free[physical] = end
        if dur > 0 and mine:
            self.intervals.append(Interval(lane, start, end, label, self.step))
        return start, end

    def free_at(self, lane: str) -> float:
        return self.free.get(self.map[lane], 0.0)


def simulate(plan: Plan, shape: ModelShape, hw: HardwareProfile, steps: int = 2,
             keep_trace: bool = True, topology: Topology | None = None) -> SimResult:
    """Simulate ``steps`` consecutive steps; report the last one (steady state when steps >= 2).

    With a ``topology``, one GPU of a data-parallel run running ``plan`` on its share of the batch.
    """
    if plan.num_layers != shape.num_layers:
        raise ValueError(f"plan has {plan.num_layers} boundaries but {shape.name} has "
                         f"{shape.num_layers} layers; make a plan for this model")
    if plan.seq_len is None:
        raise ValueError("the plan has no seq_len; the simulator needs the sequence length")
    topo = topology or Topology()
    topo.check(hw)
    rank_hw = rank_hardware(hw, topo) if topology else hw  # (no topology: the plain one-GPU path)
    cost = CostModel(shape, rank_hw, plan.micro_batch_size, plan.seq_len, plan.head_chunk_tokens)
    tiers = plan.boundary_tiers
    tied = shape.tied
    depth = plan.prefetch_depth
    units = shape.unit_names()
    moments = plan.moments or ["fp32"] * len(units)
    a_bytes = cost.boundary_bytes
    accum_s = cost.grad_accumulate_s
    internal = plan.internal_tiers
    ops = micro_batch_program(tiers, internal)
    ws_bytes = cost.layer_workspace_bytes  # one layer's internals as they travel
    kept_bytes = [kept_internal_bytes(shape, plan, i, cost.tokens, cost.elem_bytes) for i in range(shape.num_layers)]
    forward_at = {op.index: n for n, op in enumerate(ops) if op.kind == OpKind.LAYER_FWD_KEEP}
    owners = assign_owners([shape.unit_params(u) for u in units], topo.gpus_per_node)
    owner = dict(zip(units, owners))
    owned = [sum(shape.unit_params(u) for u in units if owner[u] == r) for r in range(topo.gpus_per_node)]
    lanes = _Lanes(hw.synchronous, me=max(range(topo.gpus_per_node), key=lambda r: (owned[r], -r)))
    last_grad_op = {u: n for n, op in enumerate(ops) for u in op.grad_units(tied)}  # its final landing
    first_grad_op = {u: n for n, op in reversed(list(enumerate(ops))) for u in op.grad_units(tied)}

    def reduce_bytes(u: str) -> int:
        return shape.unit_params(u) * REDUCE_BYTES_PER_PARAM

    allocs: list[Alloc] = []
    op_log: list[dict[str, Any]] = []
    opt_ready: dict[str, float] = {}
    step_done: list[float] = []
    recompute_s = 0.0
    t_begin = 0.0

    def alloc(tier: str, start: float, nbytes: int, label: str, end: float | None = None) -> Alloc:
        a = Alloc(tier, start, end if end is not None else float("inf"), int(nbytes), label)
        allocs.append(a)
        return a

    # Slots the engine allocates once (plan.memory): weights, gradients, fetched boundaries.
    slot_free_at = [0.0] * (depth + 1)
    slot_allocs = [alloc("device", 0.0, (depth + 1) * max(cost.unit_weight_bytes(u) for u in units),
                         "weight slots")]
    if not hw.synchronous:
        slot_allocs.append(alloc("device", 0.0, GRAD_SLOTS * max(cost.grad_bytes(u) for u in units),
                                 "grad slots"))
    num_offloaded = sum(t in ("host", "nvme") for t in tiers)
    if num_offloaded:
        slot_allocs.append(alloc("device", 0.0, min(FETCH_SLOTS, num_offloaded) * a_bytes, "fetch slots"))
    for step in range(steps):
        lanes.step = step
        window = WeightWindow(weight_schedule(ops, tied) * plan.num_micro_batches, depth)
        w_landed: dict[str, float] = {}  # unit -> when its copy lands in its slot
        host_clock = t_begin  # when the engine's host thread may issue the next copy

        def copy_in(copies: list[tuple[str, int]], t_issue: float) -> None:
            """Time the weight copies the window asks for, issued from the host thread in order;
            each waits for its slot's previous reader (the slot-free event)."""
            nonlocal host_clock
            t = max(t_issue, host_clock)
            for u, slot in copies:
                t = max(t, opt_ready.get(u, 0.0))  # wait_ready: the host thread blocks
                _, end = lanes.run("h2d", max(t, slot_free_at[slot]), cost.h2d_s(cost.unit_weight_bytes(u)),
                                   f"w {u} @{slot}")
                w_landed[u] = end
            host_clock = t

        copy_in(window.fill(), t_begin)
        recompute_this_step = 0.0
        last_grad_landed = 0.0
        for mb in range(plan.num_micro_batches):
            ready: dict[int, float] = {}  # boundary -> when it is on the device
            held: dict[int, Alloc] = {}  # boundary -> its device allocation
            offloaded: dict[int, tuple[float, Alloc]] = {}  # host/nvme boundary -> (host ready, host alloc)
            nvme_written: dict[int, tuple[float, Alloc]] = {}
            internals_host: dict[int, tuple[float, Alloc]] = {}  # host-tier internals -> (host ready, host alloc)
            internals_ready: dict[int, float] = {}
            internals_held: dict[int, Alloc] = {}  # layer -> its internals' device allocation
            prev_start = lanes.free_at("compute")
            issued: list[float] = []  # per op: when the compute queued before it has run
            offload_end: dict[int, float] = {}  # op -> when the offloads it queued have left
            offload_wait = 0.0  # compute waits for the offloads OFFLOAD_WINDOW_OPS ops back
            for n, op in enumerate(ops):
                offload_wait = max(offload_wait, offload_end.pop(n - OFFLOAD_WINDOW_OPS, 0.0))
                t_issue = lanes.free_at("compute")
                kind, i = op.kind, op.index
                issued.append(t_issue)
                ahead = n + FETCH_AHEAD  # the engine starts an NVMe read this far ahead
                if (ahead < len(ops) and ops[ahead].kind == OpKind.FETCH and tiers[ops[ahead].index] == "nvme"
                        and ops[ahead].index in nvme_written):  # not yet written: the engine skips it too
                    j = ops[ahead].index
                    w_end, nv = nvme_written[j]
                    s, e = lanes.run("nvme", max(t_issue, w_end), cost.nvme_read_s(a_bytes), f"nvme read b{j}")
                    nv.end = e
                    offloaded[j] = (e, alloc("host", s, a_bytes, f"nvme staging b{j}"))
                if kind == OpKind.FETCH_INTERNALS:
                    # issued FETCH_AHEAD ops early (not before the layer's forward), after the
                    # compute queued by then (its memory is fresh from the allocator)
                    k = max(n - FETCH_AHEAD, forward_at[i] + 1)
                    host_ready, host_alloc = internals_host.pop(i)
                    s, e = lanes.run("h2d", max(issued[k], host_ready), cost.h2d_s(ws_bytes),
                                     f"{OpKind.FETCH_INTERNALS} L{i}")
                    host_alloc.end = e
                    internals_ready[i] = e
                    internals_held[i] = alloc("device", issued[k], kept_bytes[i], f"internals {i} (fetched)")
                    continue
                if kind == OpKind.FETCH:
                    if tiers[i] == "device":
                        continue
                    if tiers[i] == "nvme" and i not in offloaded:  # not prefetched: read now
                        w_end, nv = nvme_written[i]
                        s, e = lanes.run("nvme", max(t_issue, w_end), cost.nvme_read_s(a_bytes), f"nvme read b{i}")
                        nv.end = e
                        offloaded[i] = (e, alloc("host", s, a_bytes, f"nvme staging b{i}"))
                    host_ready, host_alloc = offloaded.pop(i)
                    earliest = max(prev_start, host_ready)
                    s, e = lanes.run("h2d", earliest, cost.h2d_s(a_bytes), f"{OpKind.FETCH} b{i}")
                    host_alloc.end = e
                    ready[i] = e
                    held[i] = alloc("device", s, 0, f"boundary {i} (in a fetch slot)")
                    continue
                need_w = 0.0
                op_units = op.units(tied)
                for u in op_units:
                    copy_in(window.acquire(u), t_issue)
                    need_w = max(need_w, w_landed[u])
                need_b = 0.0
                if kind in (OpKind.LAYER_BWD, OpKind.RECOMPUTE_LAYER):
                    need_b = ready[i]
                elif kind == OpKind.LAYER_BWD_KEPT:
                    need_b = internals_ready.get(i, 0.0)
                dur = cost.op_s(kind, i)
                start, end = lanes.run("compute", max(t_issue, need_w, need_b, offload_wait), dur, str(op))
                prev_start = start
                if kind in RECOMPUTE_OPS:
                    recompute_this_step += dur
                op_log.append({"kind": kind, "index": i, "mb": mb, "step": step, "start": start, "end": end,
                               "units": op_units, "slots": [window.slot(u) for u in op_units]})
                tb = cost.op_transient_bytes(kind, i)
                if tb:
                    alloc("device", start, tb, f"transient {op}", end)
                for u in op_units:
                    slot = window.release(u)
                    if slot is not None:
                        slot_free_at[slot] = end
                copy_in(window.fill(), t_issue)
                if kind == OpKind.LAYER_FWD_KEEP:
                    if internal[i] == "device":
                        internals_held[i] = alloc("device", end, kept_bytes[i], f"internals {i} (kept)")
                    else:  # copied out as the forward makes them
                        s, e = lanes.run("d2h", start, cost.d2h_s(ws_bytes), f"offload L{i}")
                        offload_end[n] = max(offload_end.get(n, 0.0), e)
                        if e > end:
                            alloc("device", end, ws_bytes, f"internals {i} (in flight)", e)
                        internals_host[i] = (e, alloc("host", s, ws_bytes, f"internals {i} (host)"))
                if kind == OpKind.EMBED_FWD:
                    ready[0] = end
                elif kind in FORWARD_OPS:
                    tier = tiers[i]
                    if tier == "device":
                        ready[i] = start
                        held[i] = alloc("device", start, a_bytes, f"boundary {i} (kept)")
                    elif tier in ("host", "nvme"):
                        s, e = lanes.run("d2h", start, cost.d2h_s(a_bytes), f"offload b{i}")
                        offload_end[n] = max(offload_end.get(n, 0.0), e)
                        if e > end:  # the copy holds the device buffer until it is done
                            alloc("device", end, a_bytes, f"boundary {i} (in flight)", e)
                        host = alloc("host", s, a_bytes, f"boundary {i} ({tier})")
                        if tier == "host":
                            offloaded[i] = (e, host)
                        else:
                            ws, we = lanes.run("nvme", e, cost.nvme_write_s(a_bytes), f"nvme write b{i}")
                            host.end = we
                            nvme_written[i] = (we, alloc("nvme", ws, a_bytes, f"boundary {i} (nvme)"))
                elif kind == OpKind.RECOMPUTE_EMBED:
                    ready[0] = end
                    held[0] = alloc("device", start, a_bytes, "boundary 0 (recomputed)")
                elif kind == OpKind.RECOMPUTE_LAYER:
                    ready[i + 1] = end
                    held[i + 1] = alloc("device", start, a_bytes, f"boundary {i + 1} (recomputed)")
                elif kind == OpKind.LAYER_BWD:
                    held.pop(i).end = end
                elif kind == OpKind.LAYER_BWD_KEPT:
                    internals_held.pop(i).end = end
                    # its stored boundary, if no recompute above fetched it, is let go unread
                    for a in (held.pop(i, None), offloaded.pop(i, (0, None))[1], nvme_written.pop(i, (0, None))[1]):
                        if a is not None:
                            a.end = min(a.end, end)
                for u in op.grad_units(tied):
                    gb = cost.grad_bytes(u)
                    t_out, lander = end, None  # who lands it: every process, or (reduced on the GPUs) its owner
                    if topo.grad_reduce == "device":
                        _, t_out = lanes.run("intra", end, intra_reduce_s(gb, hw, topo), f"reduce {u}")
                        lander = owner[u]
                    # the synchronous (CPU) backend accumulates the device grad in place: no copy
                    s, e = lanes.run("d2h", t_out, 0.0 if hw.synchronous else cost.d2h_s(gb), f"grad {u}", rank=lander)
                    if e > end and kind == OpKind.HEAD and lander in (None, lanes.me):  # others leave from a grad slot
                        alloc("device", end, gb * 4 // cost.elem_bytes, f"grad {u} (fp32, in flight)", e)
                    first = mb == 0 and first_grad_op[u] == n
                    _, landed = lanes.run("host", e, accum_s(u, first), f"accumulate {u}", rank=lander)
                    if mb == plan.num_micro_batches - 1 and last_grad_op[u] == n:  # the step's sum: reduce it
                        if topo.grad_reduce == "host":
                            _, landed = lanes.run("intra", landed, host_reduce_s(reduce_bytes(u), hw, topo),
                                                  f"reduce {u}")
                        _, landed = lanes.run("inter", landed, inter_allreduce_s(reduce_bytes(u), hw, topo),
                                              f"all-reduce {u}", rank=owner[u])
                    last_grad_landed = max(last_grad_landed, landed)
            assert not held and not internals_held, f"left on the device: {sorted(held)}, {sorted(internals_held)}"
        done = max(lanes.free_at("compute"), last_grad_landed)
        step_done.append(done)
        recompute_s = recompute_this_step
        lanes.step = step
        for u, m in zip(units, moments):  # each owner its own units, in order
            _, upd = lanes.run("optimizer", done, cost.optimizer_step_s(u, m), f"update {u}", rank=owner[u])
            _, opt_ready[u] = lanes.run("optimizer", upd, cost.compute_refresh_s(u), f"refresh {u}", rank=owner[u])
        t_begin = done

    for a in slot_allocs:  # freed when the engine is
        a.end = max(step_done[-1], *opt_ready.values())
    t0 = step_done[-2] if steps >= 2 else 0.0
    t1 = step_done[-1]
    step_s = t1 - t0
    busy = {k: 0.0 for k in LANES}
    for iv in lanes.intervals:
        lo, hi = max(iv.start, t0), min(iv.end, t1)
        if hi > lo:
            busy[iv.lane] += hi - lo
    if hw.synchronous:
        busy = {k: v for k, v in busy.items() if k in ("compute", "h2d", "d2h", "host", "nvme", "optimizer")}
    tokens = plan.num_micro_batches * plan.micro_batch_size * plan.seq_len
    g = topo.gpus_per_node
    own_grads = topo.grad_reduce == "host"
    return SimResult(
        plan=plan,
        step_s=step_s,
        tokens_per_step=tokens,
        model_flops_per_step=plan.num_micro_batches * cost.model_flops(),
        busy_s=busy,
        peak_device_bytes=peak_bytes(allocs, "device"),
        device_cap_bytes=hw.device_cap_bytes,
        peak_pinned_act_bytes=g * peak_bytes(allocs, "host"),
        # the node's: one store, the other processes' own fp32 gradients (summed on the host: each
        # keeps its own), everyone's activations
        host_store_bytes=cost.host_store_bytes(plan.moments) + (g - 1) * own_grads * cost.store_footprint().grad,
        host_cap_bytes=hw.host_cap_bytes,
        peak_nvme_bytes=g * peak_bytes(allocs, "nvme"),
        nvme_cap_bytes=hw.nvme_capacity_bytes,
        recompute_s=recompute_s,
        window=(t0, t1),
        intervals=lanes.intervals if keep_trace else [],
        allocs=allocs if keep_trace else [],
        op_log=op_log if keep_trace else [],
    )
