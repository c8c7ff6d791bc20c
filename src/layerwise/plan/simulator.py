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

from typing import Any

from .cost import CostModel
from .hardware import HardwareProfile
from .memory import FETCH_SLOTS, GRAD_SLOTS, OFFLOAD_WINDOW_OPS, kept_internal_bytes, mask_bytes
from .plan import Plan
from .program import (FETCH_AHEAD, RECOMPUTE_OPS, Op, OpKind, WeightWindow, micro_batch_program,
                      weight_schedule)
from .shape import ModelShape
from .topology import (REDUCE_BYTES_PER_PARAM, Topology, assign_owners, host_reduce_s, inter_allreduce_s,
                       intra_reduce_s, rank_hardware)
from .trace import LANES, Alloc, Interval, Lanes, SimResult, peak_bytes

__all__ = ["LANES", "Alloc", "Interval", "SimResult", "micro_batch_program", "peak_bytes", "simulate"]


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
    sim = _Simulation(plan, shape, hw, rank_hw, topo)
    for step in range(steps):
        sim.step(step)
    return sim.result(steps, keep_trace)


class _MicroBatch:
    """Where each boundary and each layer's internals are during one micro-batch."""

    def __init__(self, prev_start: float):
        self.ready: dict[int, float] = {}
        """Boundary -> when it is on the device."""
        self.held: dict[int, Alloc] = {}
        """Boundary -> its device allocation."""
        self.offloaded: dict[int, tuple[float, Alloc]] = {}
        """Host/NVMe boundary -> (when it is in host memory, its host allocation)."""
        self.nvme_written: dict[int, tuple[float, Alloc]] = {}
        self.internals_host: dict[int, tuple[float, Alloc]] = {}
        """Layer with host-tier internals -> (when they are in host memory, their host allocation)."""
        self.internals_ready: dict[int, float] = {}
        self.internals_held: dict[int, Alloc] = {}
        """Layer -> its internals' device allocation."""
        self.prev_start = prev_start
        """When the last compute op started (a boundary's fetch is issued then)."""
        self.issued: list[float] = []
        """Per op: when the compute queued before it has run."""
        self.offload_end: dict[int, float] = {}
        """Op -> when the offloads it queued have left the device."""
        self.offload_wait = 0.0
        """Compute waits for the offloads queued ``OFFLOAD_WINDOW_OPS`` ops back."""
        self.op = 0
        """The op being run (what its offloads are recorded under)."""


class _Simulation:
    """The engine's dependencies, step by step: one method per kind of op (the engine's own
    ``{OpKind: method}`` dispatch), and per compute op what it leaves behind."""

    def __init__(self, plan: Plan, shape: ModelShape, hw: HardwareProfile, rank_hw: HardwareProfile,
                 topo: Topology):
        self.plan, self.shape, self.hw, self.topo = plan, shape, hw, topo
        cost = self.cost = CostModel(shape, rank_hw, plan.micro_batch_size, plan.seq_len, plan.head_chunk_tokens)
        self.tiers, self.internal = plan.boundary_tiers, plan.internal_tiers
        self.tied = shape.tied
        self.units = shape.unit_names()
        self.moments = plan.moments or ["fp32"] * len(self.units)
        self.a_bytes = cost.boundary_bytes
        self.ops = micro_batch_program(self.tiers, self.internal)
        # per op, what does not change between micro-batches (each runs the whole program)
        self.labels = [str(op) for op in self.ops]
        compute = [op.kind not in (OpKind.FETCH, OpKind.FETCH_INTERNALS) for op in self.ops]
        self.op_units = [op.units(self.tied) if c else [] for op, c in zip(self.ops, compute)]
        self.op_grad_units = [op.grad_units(self.tied) if c else [] for op, c in zip(self.ops, compute)]
        self.op_s = [cost.op_s(op.kind, op.index) if c else 0.0 for op, c in zip(self.ops, compute)]
        # the micro-batch's attention masks live through every op, as the memory model counts them
        mask = mask_bytes(shape, plan.micro_batch_size, plan.seq_len, cost.elem_bytes)
        self.op_transient = [cost.op_transient_bytes(op.kind, op.index) + mask if c else 0
                             for op, c in zip(self.ops, compute)]
        self.weight_copy_s = {u: cost.h2d_s(cost.unit_weight_bytes(u)) for u in self.units}
        self.ws_bytes = cost.layer_workspace_bytes  # one layer's internals as they travel
        self.kept_bytes = [kept_internal_bytes(shape, plan, i, cost.tokens, cost.elem_bytes)
                           for i in range(shape.num_layers)]
        self.forward_at = {op.index: n for n, op in enumerate(self.ops) if op.kind == OpKind.LAYER_FWD_KEEP}
        owners = assign_owners([shape.unit_params(u) for u in self.units], topo.gpus_per_node)
        self.owner = dict(zip(self.units, owners))
        owned = [sum(shape.unit_params(u) for u in self.units if self.owner[u] == r)
                 for r in range(topo.gpus_per_node)]
        self.lanes = Lanes(hw.synchronous, me=max(range(topo.gpus_per_node), key=lambda r: (owned[r], -r)))
        self.last_grad_op = {u: n for n, op in enumerate(self.ops) for u in op.grad_units(self.tied)}  # its final landing
        self.first_grad_op = {u: n for n, op in reversed(list(enumerate(self.ops))) for u in op.grad_units(self.tied)}
        self.allocs: list[Alloc] = []
        self.op_log: list[dict[str, Any]] = []
        self.opt_ready: dict[str, float] = {}
        self.step_done: list[float] = []
        self.recompute_s = 0.0
        self.t_begin = 0.0
        self._allocate_slots()

    def alloc(self, tier: str, start: float, nbytes: int, label: str, end: float | None = None) -> Alloc:
        a = Alloc(tier, start, end if end is not None else float("inf"), int(nbytes), label)
        self.allocs.append(a)
        return a

    def _allocate_slots(self) -> None:
        """Slots the engine allocates once (plan.memory): weights, gradients, fetched boundaries."""
        cost, depth = self.cost, self.plan.prefetch_depth
        self.slot_free_at = [0.0] * (depth + 1)
        self.slot_allocs = [self.alloc("device", 0.0, (depth + 1) * max(cost.unit_weight_bytes(u) for u in self.units),
                                       "weight slots")]
        if not self.hw.synchronous:
            self.slot_allocs.append(self.alloc("device", 0.0, GRAD_SLOTS * max(cost.grad_bytes(u) for u in self.units),
                                               "grad slots"))
        num_offloaded = sum(t in ("host", "nvme") for t in self.tiers)
        if num_offloaded:
            self.slot_allocs.append(self.alloc("device", 0.0, min(FETCH_SLOTS, num_offloaded) * self.a_bytes,
                                               "fetch slots"))

    # ----- one step ------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Every micro-batch of step ``step``, then the optimizer (overlapping the next step)."""
        lanes = self.lanes
        lanes.step = step
        self.window = WeightWindow(weight_schedule(self.ops, self.tied) * self.plan.num_micro_batches,
                                   self.plan.prefetch_depth)
        self.w_landed: dict[str, float] = {}  # unit -> when its copy lands in its slot
        self.host_clock = self.t_begin  # when the engine's host thread may issue the next copy
        self.copy_in(self.window.fill(), self.t_begin)
        self.recompute_this_step = 0.0
        self.last_grad_landed = 0.0
        for mb in range(self.plan.num_micro_batches):
            self.micro_batch(mb, step)
        done = max(lanes.free_at("compute"), self.last_grad_landed)
        self.step_done.append(done)
        self.recompute_s = self.recompute_this_step
        lanes.step = step
        for u, m in zip(self.units, self.moments):  # each owner its own units, in order
            _, upd = lanes.run("optimizer", done, self.cost.optimizer_step_s(u, m), f"update {u}",
                               rank=self.owner[u])
            _, self.opt_ready[u] = lanes.run("optimizer", upd, self.cost.compute_refresh_s(u), f"refresh {u}",
                                             rank=self.owner[u])
        self.t_begin = done

    def copy_in(self, copies: list[tuple[str, int]], t_issue: float) -> None:
        """Time the weight copies the window asks for, issued from the host thread in order;
        each waits for its slot's previous reader (the slot-free event)."""
        t = max(t_issue, self.host_clock)
        for u, slot in copies:
            t = max(t, self.opt_ready.get(u, 0.0))  # wait_ready: the host thread blocks
            _, end = self.lanes.run("h2d", max(t, self.slot_free_at[slot]), self.weight_copy_s[u], f"w {u} @{slot}")
            self.w_landed[u] = end
        self.host_clock = t

    def micro_batch(self, mb: int, step: int) -> None:
        mbs = _MicroBatch(self.lanes.free_at("compute"))
        for n, op in enumerate(self.ops):
            mbs.op = n
            mbs.offload_wait = max(mbs.offload_wait, mbs.offload_end.pop(n - OFFLOAD_WINDOW_OPS, 0.0))
            t_issue = self.lanes.free_at("compute")
            mbs.issued.append(t_issue)
            self._read_ahead(mbs, n, t_issue)
            handler = _BY_KIND.get(op.kind)
            if handler is not None:
                handler(self, mbs, n, op, t_issue)
            else:
                self._compute(mbs, n, op, t_issue, mb, step)
        assert not mbs.held and not mbs.internals_held, \
            f"left on the device: {sorted(mbs.held)}, {sorted(mbs.internals_held)}"

    # ----- ops that move data ----------------------------------------------------------------

    def _read_ahead(self, mbs: _MicroBatch, n: int, t_issue: float) -> None:
        """The engine starts an NVMe read FETCH_AHEAD ops before its fetch (a boundary not yet
        written is skipped, as the engine skips it)."""
        ahead = n + FETCH_AHEAD
        if ahead < len(self.ops):
            op = self.ops[ahead]
            if op.kind == OpKind.FETCH and self.tiers[op.index] == "nvme" and op.index in mbs.nvme_written:
                self._nvme_read(mbs, op.index, t_issue)

    def _nvme_read(self, mbs: _MicroBatch, j: int, t_issue: float) -> None:
        w_end, nv = mbs.nvme_written[j]
        s, e = self.lanes.run("nvme", max(t_issue, w_end), self.cost.nvme_read_s(self.a_bytes), f"nvme read b{j}")
        nv.end = e
        mbs.offloaded[j] = (e, self.alloc("host", s, self.a_bytes, f"nvme staging b{j}"))

    def _fetch(self, mbs: _MicroBatch, n: int, op: Op, t_issue: float) -> None:
        """A host/NVMe boundary back into a fetch slot, issued when the compute op before starts."""
        i = op.index
        if self.tiers[i] == "device":
            return
        if self.tiers[i] == "nvme" and i not in mbs.offloaded:  # not prefetched: read now
            self._nvme_read(mbs, i, t_issue)
        host_ready, host_alloc = mbs.offloaded.pop(i)
        earliest = max(mbs.prev_start, host_ready)
        s, e = self.lanes.run("h2d", earliest, self.cost.h2d_s(self.a_bytes), f"{OpKind.FETCH} b{i}")
        host_alloc.end = e
        mbs.ready[i] = e
        mbs.held[i] = self.alloc("device", s, 0, f"boundary {i} (in a fetch slot)")

    def _fetch_internals(self, mbs: _MicroBatch, n: int, op: Op, t_issue: float) -> None:
        """Host-tier internals back, issued FETCH_AHEAD ops early (not before the layer's forward),
        after the compute queued by then (its memory is fresh from the allocator)."""
        i = op.index
        k = max(n - FETCH_AHEAD, self.forward_at[i] + 1)
        host_ready, host_alloc = mbs.internals_host.pop(i)
        s, e = self.lanes.run("h2d", max(mbs.issued[k], host_ready), self.cost.h2d_s(self.ws_bytes),
                              f"{OpKind.FETCH_INTERNALS} L{i}")
        host_alloc.end = e
        mbs.internals_ready[i] = e
        mbs.internals_held[i] = self.alloc("device", mbs.issued[k], self.kept_bytes[i], f"internals {i} (fetched)")

    # ----- compute ops -------------------------------------------------------------------------

    def _compute(self, mbs: _MicroBatch, n: int, op: Op, t_issue: float, mb: int, step: int) -> None:
        """A compute op: waits for its weights and its input, runs, frees its weight slots, and
        leaves behind what :data:`_AFTER` says; its gradients go out when it ends."""
        kind, i, window = op.kind, op.index, self.window
        need_w = 0.0
        op_units = self.op_units[n]
        for u in op_units:
            self.copy_in(window.acquire(u), t_issue)
            need_w = max(need_w, self.w_landed[u])
        need_b = 0.0
        if kind in (OpKind.LAYER_BWD, OpKind.RECOMPUTE_LAYER):
            need_b = mbs.ready[i]
        elif kind == OpKind.LAYER_BWD_KEPT:
            need_b = mbs.internals_ready.get(i, 0.0)
        dur = self.op_s[n]
        start, end = self.lanes.run("compute", max(t_issue, need_w, need_b, mbs.offload_wait), dur,
                                    self.labels[n])
        mbs.prev_start = start
        if kind in RECOMPUTE_OPS:
            self.recompute_this_step += dur
        self.op_log.append({"kind": kind, "index": i, "mb": mb, "step": step, "start": start, "end": end,
                            "units": list(op_units), "slots": [window.slot(u) for u in op_units]})
        tb = self.op_transient[n]
        if tb:
            self.alloc("device", start, tb, f"transient {self.labels[n]}", end)
        for u in op_units:
            slot = window.release(u)
            if slot is not None:
                self.slot_free_at[slot] = end
        self.copy_in(window.fill(), t_issue)
        effect = _AFTER.get(kind)
        if effect is not None:
            effect(self, mbs, i, start, end)
        for u in self.op_grad_units[n]:
            self._gradient(u, kind, n, end, mb)

    def _embedded(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        mbs.ready[0] = end

    def _store_boundary(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """A layer's forward stores its input boundary per the plan: held on the device, or copied
        out as it runs (NVMe: then written by the I/O thread)."""
        tier = self.tiers[i]
        a_bytes = self.a_bytes
        if tier == "device":
            mbs.ready[i] = start
            mbs.held[i] = self.alloc("device", start, a_bytes, f"boundary {i} (kept)")
        elif tier in ("host", "nvme"):
            s, e = self.lanes.run("d2h", start, self.cost.d2h_s(a_bytes), f"offload b{i}")
            mbs.offload_end[mbs.op] = max(mbs.offload_end.get(mbs.op, 0.0), e)
            if e > end:  # the copy holds the device buffer until it is done
                self.alloc("device", end, a_bytes, f"boundary {i} (in flight)", e)
            host = self.alloc("host", s, a_bytes, f"boundary {i} ({tier})")
            if tier == "host":
                mbs.offloaded[i] = (e, host)
            else:
                ws, we = self.lanes.run("nvme", e, self.cost.nvme_write_s(a_bytes), f"nvme write b{i}")
                host.end = we
                mbs.nvme_written[i] = (we, self.alloc("nvme", ws, a_bytes, f"boundary {i} (nvme)"))

    def _keep_internals(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """A forward that keeps its layer's internals: held on the device, or copied out as the
        forward makes them; then its input boundary is stored like any forward's."""
        if self.internal[i] == "device":
            mbs.internals_held[i] = self.alloc("device", end, self.kept_bytes[i], f"internals {i} (kept)")
        else:
            s, e = self.lanes.run("d2h", start, self.cost.d2h_s(self.ws_bytes), f"offload L{i}")
            mbs.offload_end[mbs.op] = max(mbs.offload_end.get(mbs.op, 0.0), e)
            if e > end:
                self.alloc("device", end, self.ws_bytes, f"internals {i} (in flight)", e)
            mbs.internals_host[i] = (e, self.alloc("host", s, self.ws_bytes, f"internals {i} (host)"))
        self._store_boundary(mbs, i, start, end)

    def _recomputed_embed(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        self._recomputed(mbs, 0, start, end)

    def _recomputed_layer(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        self._recomputed(mbs, i + 1, start, end)

    def _recomputed(self, mbs: _MicroBatch, j: int, start: float, end: float) -> None:
        """Boundary ``j`` made again, held from the start of the op that makes it."""
        mbs.ready[j] = end
        mbs.held[j] = self.alloc("device", start, self.a_bytes, f"boundary {j} (recomputed)")

    def _release_boundary(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        mbs.held.pop(i).end = end

    def _release_internals(self, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """Its internals are freed; its stored boundary, if no recompute above fetched it, is let
        go unread."""
        mbs.internals_held.pop(i).end = end
        for a in (mbs.held.pop(i, None), mbs.offloaded.pop(i, (0, None))[1], mbs.nvme_written.pop(i, (0, None))[1]):
            if a is not None:
                a.end = min(a.end, end)

    def _gradient(self, u: str, kind: OpKind, n: int, end: float, mb: int) -> None:
        """Unit ``u``'s gradient: reduced on the GPUs first (``grad_reduce="device"``), copied
        out, accumulated on the host; after the step's last micro-batch the sum is reduced."""
        lanes, cost, hw, topo = self.lanes, self.cost, self.hw, self.topo
        gb = cost.grad_bytes(u)
        t_out, lander = end, None  # who lands it: every process, or (reduced on the GPUs) its owner
        if topo.grad_reduce == "device":
            _, t_out = lanes.run("intra", end, intra_reduce_s(gb, hw, topo), f"reduce {u}")
            lander = self.owner[u]
        # the synchronous (CPU) backend accumulates the device grad in place: no copy
        s, e = lanes.run("d2h", t_out, 0.0 if hw.synchronous else cost.d2h_s(gb), f"grad {u}", rank=lander)
        if e > end and kind == OpKind.HEAD and lander in (None, lanes.me):  # others leave from a grad slot
            self.alloc("device", end, gb * 4 // cost.elem_bytes, f"grad {u} (fp32, in flight)", e)
        first = mb == 0 and self.first_grad_op[u] == n
        _, landed = lanes.run("host", e, cost.grad_accumulate_s(u, first), f"accumulate {u}", rank=lander)
        if mb == self.plan.num_micro_batches - 1 and self.last_grad_op[u] == n:  # the step's sum: reduce it
            reduce_bytes = self.shape.unit_params(u) * REDUCE_BYTES_PER_PARAM
            if topo.grad_reduce == "host":
                _, landed = lanes.run("intra", landed, host_reduce_s(reduce_bytes, hw, topo), f"reduce {u}")
            _, landed = lanes.run("inter", landed, inter_allreduce_s(reduce_bytes, hw, topo), f"all-reduce {u}",
                                  rank=self.owner[u])
        self.last_grad_landed = max(self.last_grad_landed, landed)

    # ----- the result --------------------------------------------------------------------------

    def result(self, steps: int, keep_trace: bool) -> SimResult:
        """The last step (between the ends of the last two), its lanes' busy seconds and peaks."""
        plan, hw, cost, topo = self.plan, self.hw, self.cost, self.topo
        for a in self.slot_allocs:  # freed when the engine is
            a.end = max(self.step_done[-1], *self.opt_ready.values())
        t0 = self.step_done[-2] if steps >= 2 else 0.0
        t1 = self.step_done[-1]
        busy = {k: 0.0 for k in LANES}
        for iv in self.lanes.intervals:
            lo, hi = max(iv.start, t0), min(iv.end, t1)
            if hi > lo:
                busy[iv.lane] += hi - lo
        if hw.synchronous:
            busy = {k: v for k, v in busy.items() if k in ("compute", "h2d", "d2h", "host", "nvme", "optimizer")}
        g = topo.gpus_per_node
        own_grads = topo.grad_reduce == "host"
        return SimResult(
            plan=plan,
            step_s=t1 - t0,
            tokens_per_step=plan.num_micro_batches * plan.micro_batch_size * plan.seq_len,
            model_flops_per_step=plan.num_micro_batches * cost.model_flops(),
            busy_s=busy,
            peak_device_bytes=peak_bytes(self.allocs, "device"),
            device_cap_bytes=hw.device_cap_bytes,
            peak_pinned_act_bytes=g * peak_bytes(self.allocs, "host"),
            # the node's: one store, the other processes' own fp32 gradients (summed on the host:
            # each keeps its own), everyone's activations
            host_store_bytes=cost.host_store_bytes(plan.moments, bf16_grads=plan.num_micro_batches == 1 and g == 1)
            + (g - 1) * own_grads * cost.store_footprint().grad,
            host_cap_bytes=hw.host_cap_bytes,
            peak_nvme_bytes=g * peak_bytes(self.allocs, "nvme"),
            nvme_cap_bytes=hw.nvme_capacity_bytes,
            recompute_s=self.recompute_s,
            window=(t0, t1),
            intervals=self.lanes.intervals if keep_trace else [],
            allocs=self.allocs if keep_trace else [],
            op_log=self.op_log if keep_trace else [],
        )


# The dispatch tables hold the plain functions, not bound methods: a simulation that held its own
# bound methods would be a reference cycle, kept (with its whole trace) until the cyclic
# collector runs, which then walks every allocation and interval the search has made.
_BY_KIND = {OpKind.FETCH: _Simulation._fetch, OpKind.FETCH_INTERNALS: _Simulation._fetch_internals}
"""Ops that move data; every other kind runs on the compute lane (``_Simulation._compute``)."""
_AFTER = {OpKind.EMBED_FWD: _Simulation._embedded, OpKind.LAYER_FWD: _Simulation._store_boundary,
          OpKind.LAYER_FWD_KEEP: _Simulation._keep_internals, OpKind.RECOMPUTE_EMBED: _Simulation._recomputed_embed,
          OpKind.RECOMPUTE_LAYER: _Simulation._recomputed_layer, OpKind.LAYER_BWD: _Simulation._release_boundary,
          OpKind.LAYER_BWD_KEPT: _Simulation._release_internals}
"""What a compute op leaves behind (a stored, recomputed or released boundary or internals)."""
