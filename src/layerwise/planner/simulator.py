"""Discrete-event simulation of training steps under a Plan, with the engine's real dependencies.

Lanes, the op program and the dependency graph are written out in ``docs/planner.md``
("Simulator"). The program is the engine's own (``plan.program``), so the simulator and the
engine cannot disagree on what runs when. Data parallel: one GPU's process is simulated (the
owner with the most parameters, the one the step waits for), on the machine as it sees it while
its node's other GPUs run (``topology.rank_hardware``); host and NVMe bytes are the node's.

The simulated step is the steady-state one: the time between the ends of consecutive steps."""

from __future__ import annotations

from collections import deque
from typing import Any

from .cost import CostModel
from .hardware import HardwareProfile
from ..plan.memory import (GRAD_SLOTS, carried, fetch_slot_count, grad_slot_itemsize, group_embed_bwd_bytes,
                     group_size, kept_internal_bytes, mask_bytes, resident_weight_bytes)
from ..plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS, Plan
from ..plan.program import (COPY_OPS, FETCH_AHEAD, RECOMPUTE_OPS, Op, OpKind, WeightWindow,
                      micro_batch_groups, micro_batch_program, resident_units, weight_schedule)
from ..plan.shape import ModelShape
from ..plan.owners import assign_owners
from .topology import (REDUCE_BYTES_PER_PARAM, Topology, host_reduce_s, inter_allreduce_s,
                       intra_reduce_s, rank_hardware)
from .sim_state import Group as _Group, MicroBatch as _MicroBatch
from .trace import LANES, RESIDENT_SLOT, Alloc, Interval, Lanes, SimResult, peak_bytes
from .unit_copies import plan_copy_order

__all__ = ["LANES", "Alloc", "Interval", "SimResult", "micro_batch_program", "peak_bytes", "simulate"]


def simulate(plan: Plan, shape: ModelShape, hw: HardwareProfile, steps: int = 2,
             keep_trace: bool = True, topology: Topology | None = None) -> SimResult:
    """Simulate ``steps`` consecutive steps; report the last one (steady state when steps >= 2);
    with a ``topology``, one GPU of a data-parallel run on its share of the batch."""
    if plan.num_layers != shape.num_layers:
        raise ValueError(f"plan has {plan.num_layers} boundaries but {shape.name} has "
                         f"{shape.num_layers} layers; make a plan for this model")
    if plan.seq_len is None:
        raise ValueError("the plan has no seq_len; the simulator needs the sequence length")
    tiers = plan.state_tiers or ()
    if any(tiers[1 + i] == "nvme-all" for i in plan.resident_layers if 1 + i < len(tiers)):
        raise ValueError("a resident layer's weights stay on the device: its state_tiers entry cannot be nvme-all")
    topo = topology or Topology()
    topo.check(hw)
    rank_hw = rank_hardware(hw, topo) if topology else hw  # (no topology: the plain one-GPU path)
    sim = _Simulation(plan, shape, hw, rank_hw, topo, keep_trace)
    for step in range(steps):
        sim.step(step)
    return sim.result(steps, keep_trace)


class _Simulation:
    """The engine's dependencies, step by step: one method per kind of op (the engine's own
    ``{OpKind: method}`` dispatch), and per compute op what it leaves behind."""

    def __init__(self, plan: Plan, shape: ModelShape, hw: HardwareProfile, rank_hw: HardwareProfile,
                 topo: Topology, keep_trace: bool):
        self.plan, self.shape, self.hw, self.topo = plan, shape, hw, topo
        self.keep_trace = keep_trace
        """Log every compute op (``op_log``); off, a screening simulation skips a dict per op."""
        cost = self.cost = CostModel(shape, rank_hw, plan.micro_batch_size, plan.seq_len, plan.head_chunk_tokens,
                                     group_size(plan))
        self.tiers, self.internal = plan.boundary_tiers, plan.internal_tiers
        self.tied = shape.tied
        self.units = shape.unit_names()
        self.resident = resident_units(plan.resident_layers)
        self.moments = plan.moments or ["fp32"] * len(self.units)
        self.a_bytes = cost.boundary_bytes
        self.ops = micro_batch_program(self.tiers, self.internal)
        self.groups = micro_batch_groups(plan.num_micro_batches, plan.micro_batches_per_load)
        self.group = group_size(plan)
        # per op, what does not change between micro-batches (each runs the whole program)
        self.labels = [str(op) for op in self.ops]
        compute = [op.kind not in COPY_OPS for op in self.ops]
        units = [op.units(self.tied) if c else () for op, c in zip(self.ops, compute)]
        self.op_units = [[u for u in us if u not in self.resident] for us in units]
        self.op_resident = [[u for u in us if u in self.resident] for us in units]
        self.op_grad_units = [op.grad_units(self.tied) if c else [] for op, c in zip(self.ops, compute)]
        self.op_s = [cost.op_s(op.kind, op.index) if c else 0.0 for op, c in zip(self.ops, compute)]
        # the micro-batch's attention masks live through every op, as the memory model counts them
        mask = self.mask = mask_bytes(shape, plan.micro_batch_size, plan.seq_len, cost.elem_bytes)
        self.op_transient = [cost.op_transient_bytes(op.kind, op.index) + mask if c else 0
                             for op, c in zip(self.ops, compute)]
        self.weight_copy_s = {u: cost.h2d_s(cost.unit_weight_bytes(u)) for u in self.units}
        # the host thread issues a resident unit's refresh in the order of first use, before the
        # copy of the first streamed unit used after it
        self.first_use = {u: n for n, us in reversed(list(enumerate(units))) for u in us}
        self.refresh_order = sorted(self.resident, key=lambda u: self.first_use[u])
        self.grad_itemsize = grad_slot_itemsize(cost.elem_bytes, self.group)
        # per unit: its gradient's bytes on the wire, and its host accumulation (first landing, later)
        self.grad_out_bytes = {u: cost.grad_bytes(u) * self.grad_itemsize // cost.elem_bytes for u in self.units}
        self.accumulate_s = {u: (cost.grad_accumulate_s(u, False, self.grad_itemsize),
                                 cost.grad_accumulate_s(u, True, self.grad_itemsize)) for u in self.units}
        self.ws_bytes = cost.layer_workspace_bytes  # one layer's internals as they travel
        self.kept_bytes = [kept_internal_bytes(shape, plan, i, cost.tokens, cost.elem_bytes,
                                               cost.seq_len)
                           for i in range(shape.num_layers)]
        self.forward_at = {op.index: n for n, op in enumerate(self.ops) if op.kind == OpKind.LAYER_FWD_KEEP}
        owners = assign_owners([shape.unit_params(u) for u in self.units], topo.gpus_per_node)
        self.owner = dict(zip(self.units, owners))
        owned = [sum(shape.unit_params(u) for u in self.units if self.owner[u] == r)
                 for r in range(topo.gpus_per_node)]
        self.lanes = Lanes(hw.synchronous, me=max(range(topo.gpus_per_node), key=lambda r: (owned[r], -r)))
        self.last_grad_op = {u: n for n, op in enumerate(self.ops) for u in op.grad_units(self.tied)}  # its final landing
        self.first_grad_op = {u: n for n, op in reversed(list(enumerate(self.ops))) for u in op.grad_units(self.tied)}
        self._state_on_nvme(plan.state_tiers or ["ram"] * len(self.units))
        self.allocs: list[Alloc] = []
        self.op_log: list[dict[str, Any]] = []
        self.opt_ready: dict[str, float] = {}
        self.step_done: list[float] = []
        self.recompute_s = 0.0
        self.t_begin = 0.0
        self._allocate_slots()

    def _state_on_nvme(self, tiers: list[str]) -> None:
        """The units off the RAM: their state's reads and writes around the update; an
        ``nvme-all`` unit's copy-source reads before its copies, its gradient's writes."""
        cost, bf16 = self.cost, self.plan.lands_once()
        self.state_seq = [u for u, t in zip(self.units, tiers) if t != "ram"]
        """Units whose state is on NVMe, in update order."""
        self.state_slots = min(NVME_STATE_SLOTS, len(self.state_seq))
        self.all_units = frozenset(u for u, t in zip(self.units, tiers) if t == "nvme-all")
        """Units whose copy source and gradient are on NVMe too."""
        self.src_read_s = {u: cost.nvme_read_s(cost.unit_source_bytes(u)) for u in self.all_units}
        self.grad_io_s = {u: (cost.nvme_read_s(cost.unit_grad_store_bytes(u, bf16)),
                              cost.nvme_write_s(cost.unit_grad_store_bytes(u, bf16))) for u in self.all_units}
        # the update reads its state (and an nvme-all unit's source and gradient), then writes
        # the state (and the source) back
        self.state_io_s = {u: (cost.state_read_s(u, m) + (self.src_read_s[u] + self.grad_io_s[u][0]
                                                          if u in self.all_units else 0.0),
                               cost.state_write_s(u, m) + (cost.nvme_write_s(cost.unit_source_bytes(u))
                                                           if u in self.all_units else 0.0))
                           for u, m, t in zip(self.units, self.moments, tiers) if t != "ram"}
        self.state_write_end: list[float] = []
        """When each NVMe state write so far ended (every step's, in order)."""
        self.state_read_end: dict[str, float] = {}
        """This step's NVMe state reads: unit -> when it is staged in RAM."""
        self.src_order = [u for u in plan_copy_order(self.plan, self.tied) if u in self.all_units] \
            if self.all_units else []
        """The ``nvme-all`` units' weight copies of a step, in order."""
        self.src_write_end: dict[str, float] = {}
        """Unit -> when its update last wrote its copy source back."""
        self.grad_write_end: list[float] = []
        """When each ``nvme-all`` gradient write so far ended (in order)."""

    def alloc(self, tier: str, start: float, nbytes: int, label: str, end: float | None = None) -> Alloc:
        a = Alloc(tier, start, end if end is not None else float("inf"), int(nbytes), label)
        self.allocs.append(a)
        return a

    def _allocate_slots(self) -> None:
        """What the engine allocates once (plan.memory): weight slots for the largest streamed
        unit, the resident layers' weights, gradient slots, fetch slots for a group."""
        cost, depth = self.cost, self.plan.prefetch_depth
        self.slot_free_at = [0.0] * (depth + 1)
        largest = max(cost.unit_weight_bytes(u) for u in self.units if u not in self.resident)
        self.slot_allocs = [self.alloc("device", 0.0, (depth + 1) * largest, "weight slots")]
        if self.resident:
            self.slot_allocs.append(self.alloc("device", 0.0, resident_weight_bytes(
                self.shape, self.plan, cost.elem_bytes), "resident weights"))
        if not self.hw.synchronous:
            grad = max(cost.grad_bytes(u) for u in self.units) * self.grad_itemsize // cost.elem_bytes
            self.slot_allocs.append(self.alloc("device", 0.0, GRAD_SLOTS * grad, "grad slots"))
        num_offloaded = sum(t in ("host", "nvme") for t in self.tiers)
        if num_offloaded:
            self.slot_allocs.append(self.alloc("device", 0.0, fetch_slot_count(num_offloaded, self.group)
                                               * self.a_bytes, "fetch slots"))

    # ----- one step ------------------------------------------------------------------------

    def step(self, step: int) -> None:
        """Every group of micro-batches of step ``step``, then the optimizer (overlapping the
        next step)."""
        lanes = self.lanes
        lanes.step = step
        # one use of each streamed unit per op of each group: its micro-batches share the copy
        self.window = WeightWindow(weight_schedule(self.ops, self.tied, self.resident) * len(self.groups),
                                   self.plan.prefetch_depth)
        self.w_landed: dict[str, float] = {}  # unit -> when its copy lands in its slot
        self.resident_ready: dict[str, float] = {}  # resident unit -> when this step's refresh lands
        self.pending = deque(self.refresh_order)  # resident units not yet refreshed this step
        self.host_clock = self.t_begin  # when the engine's host thread may issue the next copy
        self.src_read_end: list[float] = []  # this step's nvme-all copies: their sources staged
        self.src_copy_end: list[float] = []  # ... and their copies done (the slot free)
        self._read_sources()
        self.copy_in(self.window.fill(), self.t_begin)
        self.recompute_this_step = 0.0
        self.last_grad_landed = 0.0
        self.state_read_end = {}
        for index, mbs in enumerate(self.groups):
            self.run_group(_Group(index, mbs, lanes.free_at("compute")), step)
        done = max(lanes.free_at("compute"), self.last_grad_landed)
        self.step_done.append(done)
        self.recompute_s = self.recompute_this_step
        lanes.step = step
        for u, m in zip(self.units, self.moments):  # each owner its own units, in order
            ready = done
            if u in self.state_io_s:  # the reads its slot allows, then its own
                self._read_state(done, self.state_seq.index(u) + self.state_slots)
                ready = max(done, self.state_read_end[u])
            _, upd = lanes.run("optimizer", ready, self.cost.optimizer_step_s(u, m), f"update {u}",
                               rank=self.owner[u])
            _, self.opt_ready[u] = lanes.run("optimizer", upd, self.cost.compute_refresh_s(u), f"refresh {u}",
                                             rank=self.owner[u])
            if u in self.state_io_s:
                _, end = lanes.run("nvme", self.opt_ready[u], self.state_io_s[u][1], f"nvme state write {u}")
                self.state_write_end.append(end)
                if u in self.all_units:
                    self.src_write_end[u] = end
        self.t_begin = done

    def _read_state(self, t_issue: float, upto: int) -> None:
        """Issue this step's NVMe state reads before the ``upto``-th (in update order), each once
        the write ``state_slots`` units before it has freed its staging slot."""
        m, done = len(self.state_seq), len(self.state_read_end)
        base = len(self.state_write_end) - (len(self.state_write_end) % m if m else 0)  # this step's first
        for j in range(done, min(upto, m)):
            g = base + j - self.state_slots  # the write whose slot it takes
            slot_free = self.state_write_end[g] if g >= 0 else 0.0
            u = self.state_seq[j]
            _, self.state_read_end[u] = self.lanes.run("nvme", max(t_issue, slot_free), self.state_io_s[u][0],
                                                      f"nvme state read {u}")

    def copy_in(self, copies: list[tuple[str, int]], t_issue: float) -> None:
        """Time the weight copies the window asks for, issued from the host thread in order;
        each waits for its slot's previous reader (the slot-free event), an ``nvme-all`` unit's
        for its source read too. Resident units' refreshes used before a copy's unit go first."""
        t = max(t_issue, self.host_clock)
        for u, slot in copies:
            while self.pending and self.first_use[self.pending[0]] < self.first_use[u]:
                t = self._refresh(self.pending.popleft(), t)
            t = max(t, self.opt_ready.get(u, 0.0))  # wait_ready: the host thread blocks
            if u in self.all_units:  # ... and for the source staged in RAM
                t = max(t, self.src_read_end[len(self.src_copy_end)])
            _, end = self.lanes.run("h2d", max(t, self.slot_free_at[slot]), self.weight_copy_s[u], f"w {u} @{slot}")
            self.w_landed[u] = end
            if u in self.all_units:
                self.src_copy_end.append(end)
                self._read_sources()
        self.host_clock = t

    def _read_sources(self) -> None:
        """Issue this step's copy-source reads as far as the staging slots allow: read ``j`` takes
        the slot of copy ``j - (NVME_SOURCE_SLOTS - 1)``, free once that copy is done, and waits
        for the unit's last update to write its source back."""
        ahead = NVME_SOURCE_SLOTS - 1
        for j in range(len(self.src_read_end), min(len(self.src_copy_end) + ahead, len(self.src_order))):
            u = self.src_order[j]
            free = self.src_copy_end[j - ahead] if j >= ahead else self.t_begin
            earliest = max(free, self.t_begin, self.src_write_end.get(u, 0.0))
            _, end = self.lanes.fill("nvme", earliest, self.src_read_s[u], f"nvme source read {u}")
            self.src_read_end.append(end)

    def refresh_resident(self, unit: str, t_issue: float) -> None:
        """Refresh the resident units up to ``unit`` (in order of first use) if not yet done."""
        t = max(t_issue, self.host_clock)
        while unit not in self.resident_ready:
            t = self._refresh(self.pending.popleft(), t)
        self.host_clock = t

    def _refresh(self, u: str, t: float) -> float:
        """Once per step, a resident unit's buffer gets its updated weights (after its update of
        the last step, which follows that step's last read); returns the host thread's clock."""
        t = max(t, self.opt_ready.get(u, 0.0))
        _, self.resident_ready[u] = self.lanes.run("h2d", t, self.weight_copy_s[u], f"w {u} @{RESIDENT_SLOT}")
        return t

    def run_group(self, grp: _Group, step: int) -> None:
        """Each op of the program for every micro-batch of the group in turn."""
        for n, op in enumerate(self.ops):
            t_issue = self.lanes.free_at("compute")
            grp.issued.append(t_issue)
            handler = _BY_KIND.get(op.kind)
            if handler is None:
                self._compute(grp, n, op, step)
                continue
            for mbs in grp.mbs.values():
                handler(self, grp, mbs, n, op, self._begin_run(grp, mbs, n))
        for mbs in grp.mbs.values():
            assert not mbs.held and not mbs.internals_held, \
                f"left on the device: {sorted(mbs.held)}, {sorted(mbs.internals_held)}"

    def _begin_run(self, grp: _Group, mbs: _MicroBatch, n: int) -> float:
        """Start op ``n`` for one micro-batch: the offload window, the NVMe read ahead; returns
        when it is issued."""
        grp.begin_run()
        t_issue = self.lanes.free_at("compute")
        self._read_ahead(mbs, n, t_issue)
        return t_issue

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

    def _fetch(self, grp: _Group, mbs: _MicroBatch, n: int, op: Op, t_issue: float) -> None:
        """A host/NVMe boundary back into a fetch slot, issued when the compute op before starts."""
        i = op.index
        if self.tiers[i] == "device":
            return
        if self.tiers[i] == "nvme" and i not in mbs.offloaded:  # not prefetched: read now
            self._nvme_read(mbs, i, t_issue)
        host_ready, host_alloc = mbs.offloaded.pop(i)
        earliest = max(grp.prev_start, host_ready)
        s, e = self.lanes.run("h2d", earliest, self.cost.h2d_s(self.a_bytes), f"{OpKind.FETCH} b{i}")
        host_alloc.end = e
        mbs.ready[i] = e
        mbs.held[i] = self.alloc("device", s, 0, f"boundary {i} (in a fetch slot)")

    def _fetch_internals(self, grp: _Group, mbs: _MicroBatch, n: int, op: Op, t_issue: float) -> None:
        """Host-tier internals back, issued FETCH_AHEAD ops early (not before the layer's forward),
        after the compute queued by then (its memory is fresh from the allocator)."""
        i = op.index
        k = max(n - FETCH_AHEAD, self.forward_at[i] + 1)
        host_ready, host_alloc = mbs.internals_host.pop(i)
        s, e = self.lanes.run("h2d", max(grp.issued[k], host_ready), self.cost.internals_h2d_s,
                              f"{OpKind.FETCH_INTERNALS} L{i}")
        host_alloc.end = e
        mbs.internals_ready[i] = e
        mbs.internals_held[i] = self.alloc("device", grp.issued[k], self.kept_bytes[i], f"internals {i} (fetched)")

    # ----- compute ops -------------------------------------------------------------------------

    def _compute(self, grp: _Group, n: int, op: Op, step: int) -> None:
        """A compute op for every micro-batch of the group: its streamed weights acquired once,
        each run waits for them and its input, the slots freed after the last run; each run
        leaves behind what :data:`_AFTER` says; the group's gradients go out after the last."""
        kind, i, window = op.kind, op.index, self.window
        t_op = grp.issued[n]
        for u in self.op_resident[n]:
            self.refresh_resident(u, t_op)
        need_w = max((self.resident_ready[u] for u in self.op_resident[n]), default=0.0)
        op_units = self.op_units[n]
        for u in op_units:
            self.copy_in(window.acquire(u), t_op)
            need_w = max(need_w, self.w_landed[u])
        slots = [window.slot(u) for u in op_units] if self.keep_trace else []
        last = len(grp.mbs) - 1
        for k, (mb, mbs) in enumerate(grp.mbs.items()):
            t_issue = self._begin_run(grp, mbs, n)
            need_b = 0.0
            if kind in (OpKind.LAYER_BWD, OpKind.RECOMPUTE_LAYER):
                need_b = mbs.ready[i]
            elif kind == OpKind.LAYER_BWD_KEPT:
                need_b = mbs.internals_ready.get(i, 0.0)
            dur = self.op_s[n]
            start, end = self.lanes.run("compute", max(t_issue, need_w, need_b, grp.offload_wait), dur,
                                        self.labels[n])
            grp.prev_start = start
            if kind == OpKind.HEAD and k == 0 and grp.index == len(self.groups) - 1 and self.state_seq:
                self._read_state(start, NVME_STATE_SLOTS - 1)  # the step's last backward begins
            if kind in RECOMPUTE_OPS:
                self.recompute_this_step += dur
            if self.keep_trace:
                self.op_log.append({"kind": kind, "index": i, "mb": mb, "step": step, "start": start, "end": end,
                                    "units": list(op_units), "slots": slots, "resident": list(self.op_resident[n])})
            tb = self.op_transient[n]
            if tb and last:  # the group's other micro-batches: their masks, their carried state
                tb += (carried(kind, k, last + 1) * self.a_bytes + last * self.mask
                       + group_embed_bwd_bytes(self.shape, kind, self.cost.tokens, last + 1))
            if tb:
                self.alloc("device", start, tb, f"transient {self.labels[n]}", end)
            if k == last:
                for u in op_units:
                    slot = window.release(u)
                    if slot is not None:
                        self.slot_free_at[slot] = end
                self.copy_in(window.fill(), t_op)
            effect = _AFTER.get(kind)
            if effect is not None:
                effect(self, grp, mbs, i, start, end)
        for u in self.op_grad_units[n]:
            self._gradient(u, kind, n, end, grp.index)

    def _embedded(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        mbs.ready[0] = end

    def _store_boundary(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """A layer's forward stores its input boundary per the plan: held on the device, or copied
        out as it runs (NVMe: then written by the I/O thread)."""
        tier = self.tiers[i]
        a_bytes = self.a_bytes
        if tier == "device":
            mbs.ready[i] = start
            mbs.held[i] = self.alloc("device", start, a_bytes, f"boundary {i} (kept)")
        elif tier in ("host", "nvme"):
            s, e = self._offload(grp, start, end, a_bytes, self.cost.d2h_s(a_bytes), f"b{i}", f"boundary {i}")
            host = self.alloc("host", s, a_bytes, f"boundary {i} ({tier})")
            if tier == "host":
                mbs.offloaded[i] = (e, host)
            else:
                ws, we = self.lanes.run("nvme", e, self.cost.nvme_write_s(a_bytes), f"nvme write b{i}")
                host.end = we
                mbs.nvme_written[i] = (we, self.alloc("nvme", ws, a_bytes, f"boundary {i} (nvme)"))

    def _keep_internals(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """A forward that keeps its layer's internals: held on the device, or copied out as the
        forward makes them; then its input boundary is stored like any forward's."""
        if self.internal[i] == "device":
            mbs.internals_held[i] = self.alloc("device", end, self.kept_bytes[i], f"internals {i} (kept)")
        else:
            s, e = self._offload(grp, start, end, self.ws_bytes, self.cost.internals_d2h_s, f"L{i}", f"internals {i}")
            mbs.internals_host[i] = (e, self.alloc("host", s, self.ws_bytes, f"internals {i} (host)"))
        self._store_boundary(grp, mbs, i, start, end)

    def _offload(self, grp: _Group, start: float, end: float, nbytes: int, dur_s: float, what: str,
                 held: str) -> tuple[float, float]:
        """Copy ``nbytes`` out as the op that made them runs, in the group's offload window; the
        copy holds the device buffer until it is done."""
        s, e = self.lanes.run("d2h", start, dur_s, f"offload {what}")
        grp.offload_end[grp.run] = max(grp.offload_end.get(grp.run, 0.0), e)
        if e > end:
            self.alloc("device", end, nbytes, f"{held} (in flight)", e)
        return s, e

    def _recomputed_embed(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        self._recomputed(mbs, 0, start, end)

    def _recomputed_layer(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        self._recomputed(mbs, i + 1, start, end)

    def _recomputed(self, mbs: _MicroBatch, j: int, start: float, end: float) -> None:
        """Boundary ``j`` made again, held from the start of the op that makes it."""
        mbs.ready[j] = end
        mbs.held[j] = self.alloc("device", start, self.a_bytes, f"boundary {j} (recomputed)")

    def _release_boundary(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        mbs.held.pop(i).end = end

    def _release_internals(self, grp: _Group, mbs: _MicroBatch, i: int, start: float, end: float) -> None:
        """Its internals are freed; its stored boundary, if no recompute above fetched it, is let
        go unread."""
        mbs.internals_held.pop(i).end = end
        for a in (mbs.held.pop(i, None), mbs.offloaded.pop(i, (0, None))[1], mbs.nvme_written.pop(i, (0, None))[1]):
            if a is not None:
                a.end = min(a.end, end)

    def _gradient(self, u: str, kind: OpKind, n: int, end: float, group: int) -> None:
        """Unit ``u``'s gradient of op ``n`` for one group (summed over its micro-batches on the
        device, fp32 when they are more than one): reduced on the GPUs first
        (``grad_reduce="device"``), copied out, accumulated on the host; after the step's last
        group the sum is reduced."""
        lanes, cost, hw, topo = self.lanes, self.cost, self.hw, self.topo
        gb = self.grad_out_bytes[u]
        t_out, lander = end, None  # who lands it: every process, or (reduced on the GPUs) its owner
        if topo.grad_reduce == "device":
            _, t_out = lanes.run("intra", end, intra_reduce_s(gb, hw, topo), f"reduce {u}")
            lander = self.owner[u]
        # the synchronous (CPU) backend accumulates the device grad in place: no copy
        s, e = lanes.run("d2h", t_out, 0.0 if hw.synchronous else cost.d2h_s(gb), f"grad {u}", rank=lander)
        if e > end and kind == OpKind.HEAD and lander in (None, lanes.me):  # others leave from a grad slot
            self.alloc("device", end, cost.grad_bytes(u) * 4 // cost.elem_bytes, f"grad {u} (fp32, in flight)", e)
        first = group == 0 and self.first_grad_op[u] == n
        on_nvme = u in self.all_units
        if on_nvme and len(self.grad_write_end) >= NVME_GRAD_SLOTS:  # a staging slot to land in
            e = max(e, self.grad_write_end[-NVME_GRAD_SLOTS])
        if on_nvme and not first:  # a later landing adds to the partial sum: read it back first
            _, e = lanes.fill("nvme", e, self.grad_io_s[u][0], f"nvme grad read {u}")
        _, landed = lanes.run("host", e, self.accumulate_s[u][first], f"accumulate {u}", rank=lander)
        if on_nvme:  # written to its file as it lands
            _, written = lanes.fill("nvme", landed, self.grad_io_s[u][1], f"nvme grad write {u}")
            self.grad_write_end.append(written)
        if group == len(self.groups) - 1 and self.last_grad_op[u] == n:  # the step's sum: reduce it
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
        for lane, start, end, _, _ in self.lanes.spans:
            lo, hi = max(start, t0), min(end, t1)
            if hi > lo:
                busy[lane] += hi - lo
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
            host_store_bytes=cost.host_store_bytes(plan.moments, plan.lands_once() and g == 1, plan.state_tiers)
            + (g - 1) * own_grads * cost.store_footprint().grad,
            host_cap_bytes=hw.host_cap_bytes,
            # the node's one store keeps its NVMe state once
            peak_nvme_bytes=g * peak_bytes(self.allocs, "nvme") + cost.nvme_bytes(plan.moments, plan.state_tiers,
                                                                                 plan.lands_once() and g == 1),
            nvme_cap_bytes=hw.nvme_capacity_bytes,
            recompute_s=self.recompute_s,
            window=(t0, t1),
            intervals=self.lanes.intervals() if keep_trace else [],
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
