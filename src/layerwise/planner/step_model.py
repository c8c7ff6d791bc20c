"""The linear step model: the MILP's constants for one (model, machine, micro-batch shape), and
the step time of a fixed assignment under it (an upper bound on the MILP's value for it, for
warm starts and screening). Constants come from the simulator's ``CostModel``."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ..models.names import EMBED, layer_unit
from .cost import STATE_NBYTES, CostModel
from .hardware import HardwareProfile
from ..plan.memory import GRAD_SLOTS, fetch_slot_count, grad_slot_itemsize, mask_bytes
from ..plan.plan import NVME_STATE_SLOTS
from ..plan.program import Op, OpKind, micro_batch_program
from ..plan.shape import ModelShape
from .unit_copies import copy_order, grad_landings

NVME_STAGING = 2
"""Host buffers NVMe traffic holds: one boundary waiting for its write, one read back ahead of
its fetch. Only a plan with an NVMe boundary needs them (the simulator allocates them then)."""


@dataclass
class ModelEval:
    step_s: float
    feasible: bool
    violations: dict[str, float] = field(default_factory=dict)
    """Constraint -> amount over (bytes or seconds), for infeasible assignments."""
    f: list[float] = field(default_factory=list, repr=False)
    b: list[float] = field(default_factory=list, repr=False)
    run: list[int] = field(default_factory=list, repr=False)
    needed: list[float] = field(default_factory=list, repr=False)
    """Per boundary: 1 when the backward needs it (its layer recomputes its internals, or the
    boundary above is needed and dropped)."""
    recomputed: list[float] = field(default_factory=list, repr=False)
    stall: float = 0.0
    resident: list[float] = field(default_factory=list, repr=False)
    """Per layer: 1 when its weights stay on the device."""


class StepModel:
    """Constants of the linear step model for one (model, machine, micro-batch shape)."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, micro_batch_size: int, seq_len: int,
                 num_micro_batches: int = 1, prefetch_depth: int = 1, head_chunk_tokens: int = 1024,
                 moments: list[str] | None = None, device_reserve_bytes: int = 0, host_reserve_bytes: int = 0,
                 per_load: int = 1, state_tiers: list[str] | None = None):
        """``*_reserve_bytes``: capacity held back for what the linear model does not see (set from
        the simulator's overflow). ``state_tiers``: units with state on NVMe (fixed). ``per_load``:
        micro-batches sharing each weight load; windows stay per micro-batch, each paying ``1/P``.
        """
        self.shape, self.hw = shape, hw
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.num_micro_batches = num_micro_batches
        self.prefetch_depth = prefetch_depth
        P = self.per_load = max(1, min(per_load, num_micro_batches))
        self.lands_once = num_micro_batches <= P
        self.head_chunk_tokens = head_chunk_tokens
        self.moments = moments
        cost = self.cost = CostModel(shape, hw, micro_batch_size, seq_len, head_chunk_tokens, P)
        L = self.L = shape.num_layers
        a = self.a_bytes = cost.boundary_bytes
        lw = [cost.unit_weight_bytes(layer_unit(i)) for i in range(L)]
        self.c_fwd = [cost.layer_fwd_s(i) for i in range(L)]
        self.w_copy = [cost.h2d_s(b) for b in lw]
        """A layer's whole weight copy (its refresh, when resident)."""
        self.w_in = [w / P for w in self.w_copy]
        """A micro-batch's share of one weight copy."""
        self.w_refresh = [w / num_micro_batches for w in self.w_copy]
        """A micro-batch's share of a resident layer's one refresh per step."""
        self.resident_ratio = [b / a for b in lw]
        """A layer's weights in boundaries (what keeping them resident holds at every op)."""
        g_item = grad_slot_itemsize(cost.elem_bytes, P)
        g_bytes = [cost.grad_bytes(layer_unit(i)) * g_item // cost.elem_bytes for i in range(L)]
        self.a_out = cost.d2h_s(a)
        self.a_in = cost.h2d_s(a)
        units = self.units = shape.unit_names()
        self._state_on_nvme(state_tiers)
        # window lower bounds that do not depend on the choice
        self.f_lb = [max(self.c_fwd[i], self.w_in[i], self.src_in[i]) for i in range(L)]
        self.b_lb = [max(cost.layer_bwd_s(i), self.w_in[i], cost.d2h_s(g_bytes[i]) / P, self.src_in[i] + self.grad_nv[i])
                     for i in range(L)]
        # a layer with kept internals: forward with a graph, backward without the forward; its
        # internals (ws bytes) copied out in its forward window and back in its backward window
        # on the host tier
        self.c_fwd_keep = [cost.layer_fwd_keep_s(i) for i in range(L)]
        self.c_bwd = [cost.layer_bwd_s(i) for i in range(L)]
        self.c_bwd_kept = [cost.layer_bwd_kept_s(i) for i in range(L)]
        self.grad_out = [cost.d2h_s(b) / P for b in g_bytes]
        ws = cost.layer_workspace_bytes
        self.ws_ratio = ws / a
        """One layer's internals in boundaries (the unit of the capacity rows)."""
        self.ws_out = cost.internals_d2h_s
        self.ws_in = cost.internals_h2d_s
        # the host accumulation lane queues: it only has to keep up over a whole micro-batch
        landed = sum(cost.grad_accumulate_s(u, landed_itemsize=g_item) for u in shape.unit_names()) + (
            cost.grad_accumulate_s(EMBED, landed_itemsize=g_item) if shape.tied else 0.0)
        self.accumulate = landed / P
        emb_w = cost.unit_weight_bytes(EMBED)
        head_w = sum(cost.unit_weight_bytes(u) for u in Op(OpKind.HEAD).units(shape.tied))
        self.e_fwd = max(cost.embed_s, cost.h2d_s(emb_w) / P)
        self.head = max(cost.head_s, cost.h2d_s(head_w) / P, cost.d2h_s(head_w * g_item // cost.elem_bytes) / P)
        self.e_bwd = max(cost.embed_s, cost.h2d_s(emb_w) / P, cost.d2h_s(emb_w * g_item // cost.elem_bytes) / P)
        # a dropped boundary k costs the forward of layer k-1 (boundary 0: the embedding) again,
        # with that layer's weights streamed again (and, on nvme-all, their source read again)
        self.src_recompute = [self.src_embed] + self.src_in[:L - 1]
        """Per boundary: the NVMe seconds its recompute's copy-source read adds (a micro-batch's share)."""
        self.recompute = [max(self.e_fwd, self.src_embed)] + [max(self.c_fwd[k - 1], self.w_in[k - 1], self.src_in[k - 1])
                                                               for k in range(1, L)]
        # after the last backward: the last gradient lands, then the optimizer starts
        self.tail = cost.d2h_s(emb_w) + cost.grad_accumulate_s(EMBED)
        self.emb_w_in = cost.h2d_s(emb_w)
        # per unit: optimizer seconds with fp32 and with 8-bit moments, and the host bytes 8-bit
        # moments free (the MILP may switch any unit; ``moments`` is the fixed choice evaluated)
        self.opt_fp32 = [cost.optimizer_s(u, "fp32") for u in units]
        self.opt_8bit = [cost.optimizer_s(u, "8bit") for u in units]
        self.saving_8bit = [0 if nv else STATE_NBYTES["fp32"](n) - STATE_NBYTES["8bit"](n)
                            for n, nv in zip((shape.unit_params(u) for u in units), self.on_nvme)]
        self._capacities(g_item, moments, device_reserve_bytes, host_reserve_bytes)

    def _state_on_nvme(self, state_tiers: list[str] | None) -> None:
        """The units off the RAM (8-bit moments, fixed), their state's reads and writes; the
        ``nvme-all`` units' copy-source reads and gradient writes per window, and what a step
        moves for them whatever the boundaries (the copies of a program without recomputes)."""
        cost, units, P = self.cost, self.units, self.per_load
        self.state_tiers = state_tiers if state_tiers and set(state_tiers) != {"ram"} else None
        tiers = self.state_tiers or ["ram"] * len(units)
        self.on_nvme = [t != "ram" for t in tiers]
        self.all_nvme = [t == "nvme-all" for t in tiers]
        nvme_moments = ["8bit" if nv else "fp32" for nv in self.on_nvme]
        src_read = [cost.nvme_read_s(cost.unit_source_bytes(u)) if a else 0.0 for u, a in zip(units, self.all_nvme)]
        grad = [cost.unit_grad_store_bytes(u, self.lands_once) if a else 0 for u, a in zip(units, self.all_nvme)]
        self.src_in = [r / P for r in src_read[1:-1]]
        """Per layer: a micro-batch's share of its copy source's read before each weight copy."""
        self.src_embed = src_read[0] / P
        self.grad_nv = [cost.nvme_write_s(g) / P for g in grad[1:-1]]
        """Per layer: a micro-batch's share of its gradient's write as it lands."""
        groups = -(-self.num_micro_batches // P)
        ops = micro_batch_program(["device"] * self.L)
        copies = Counter(copy_order(ops, self.shape.tied, frozenset(), groups, self.prefetch_depth))
        traffic = cost.nvme_traffic(nvme_moments, self.state_tiers, self.lands_once, copies,
                                    grad_landings(ops, self.shape.tied, groups))
        self.state_traffic = cost.traffic_s(traffic)
        """NVMe seconds per step moving the off-RAM units' state in and out, and the ``nvme-all``
        units' sources and gradients (a recompute's extra source read: ``src_recompute``)."""
        # the update reads its state (nvme-all: and its source and gradient), then writes back
        self.state_io = [(cost.state_read_s(u) + r + (cost.nvme_read_s(g) if a else 0.0),
                          cost.state_write_s(u) + (cost.nvme_write_s(cost.unit_source_bytes(u)) if a else 0.0))
                         if nv else (0.0, 0.0) for u, nv, a, r, g in zip(units, self.on_nvme, self.all_nvme, src_read, grad)]
        self.src_read = src_read

    def _capacities(self, g_item: int, moments: list[str] | None, device_reserve_bytes: int,
                    host_reserve_bytes: int) -> None:
        """Device memory at the head and at each layer's backward: the engine's slots (fetch
        slots counted whatever the tiers, so the constants do not depend on them) plus the op's
        transient; what the store leaves of host memory; NVMe."""
        cost, hw, shape, units = self.cost, self.hw, self.shape, self.units
        L, P, a = self.L, self.per_load, self.a_bytes
        self.dev_cap = hw.device_cap_bytes - device_reserve_bytes
        largest_w = max(cost.unit_weight_bytes(u) for u in units)
        grad_slots = GRAD_SLOTS * largest_w * g_item // cost.elem_bytes
        # the other micro-batches of a group: their masks (the op's own are in neither count) and
        # the hidden state or its gradient each carries between ops (``memory.carried``)
        masks = (P - 1) * (mask_bytes(shape, self.micro_batch_size, self.seq_len, cost.elem_bytes) + a)
        slots = ((self.prefetch_depth + 1) * largest_w + (0 if hw.synchronous else grad_slots)
                 + fetch_slot_count(L, P) * a + masks)
        self.c_bwd_mem = [slots + cost.op_transient_bytes(OpKind.LAYER_BWD, i) for i in range(L)]
        self.c_head_mem = slots + cost.op_transient_bytes(OpKind.HEAD)
        # host: what the store leaves (fp32 moments in RAM; each 8-bit unit there frees saving_8bit)
        fixed = ["8bit" if nv else "fp32" for nv in self.on_nvme]
        self.host_budget_fp32 = hw.host_cap_bytes - host_reserve_bytes - cost.host_store_bytes(
            fixed, self.lands_once, self.state_tiers)
        self.host_budget = self.host_budget_for(moments)
        self.nvme_cap = hw.nvme_capacity_bytes - cost.nvme_bytes(fixed, self.state_tiers, self.lands_once)
        self.nvme_rw = a / (hw.nvme_write_gbps * 1e9) + a / (hw.nvme_read_gbps * 1e9)
        self.nvme_read = a / (hw.nvme_read_gbps * 1e9)

    # capacity limits in units of boundaries
    def max_device_prefix(self, i: int) -> float:
        """Device-kept boundaries <= i plus held recomputed ones allowed at layer i's backward."""
        return (self.dev_cap - self.c_bwd_mem[i]) / self.a_bytes - 2

    def max_device_total(self) -> float:
        return min((self.dev_cap - self.c_head_mem) / self.a_bytes - 1, self.max_device_prefix(self.L - 1))

    def optimizer_bounds(self, moments: list[str] | None) -> tuple[float, list[float]]:
        """(when the embedding's update is on the device, per layer k the earliest end of its
        next forward: its update + its copy (a resident layer's refresh) + its compute for the first
        group), the optimizer running units in order (an ``nvme`` unit, 8-bit, once its state is
        read)."""
        mom = moments or ["fp32"] * len(self.units)
        opt = [self.opt_8bit[k] if m == "8bit" or self.on_nvme[k] else self.opt_fp32[k] for k, m in enumerate(mom)]
        cum, written = self._update_pipeline(opt)
        # an nvme-all unit's next copy reads the source its update wrote back
        ready = [max(c, written.get(k, 0.0) + self.src_read[k]) if self.all_nvme[k] else c for k, c in enumerate(cum)]
        return (ready[0] + self.emb_w_in,
                [ready[1 + k] + self.w_copy[k] + self.per_load * self.c_fwd[k] for k in range(self.L)])

    def _update_pipeline(self, opt_s: list[float]) -> tuple[list[float], dict[int, float]]:
        """(per unit its update's end after the optimizer starts; per unit off the RAM its write-back's
        end): the simulator's NVMe state pipeline on one lane, at most ``NVME_STATE_SLOTS - 1`` reads
        ahead, the first during the last group's backward."""
        seq = [k for k, nv in enumerate(self.on_nvme) if nv]
        slots = min(NVME_STATE_SLOTS, len(seq))
        lane = -self.per_load * (sum(self.b_lb) + self.head)  # the last group's backward
        reads: list[float] = []
        writes: list[float] = []
        written: dict[int, float] = {}

        def read_upto(n: int, t_issue: float) -> None:
            nonlocal lane
            for j in range(len(reads), min(n, len(seq))):
                free = writes[j - slots] if j >= slots else t_issue
                lane = max(lane, t_issue, free) + self.state_io[seq[j]][0]
                reads.append(lane)

        read_upto(NVME_STATE_SLOTS - 1, lane)
        t, ends = 0.0, []
        for k, s in enumerate(opt_s):
            if self.on_nvme[k]:
                j = seq.index(k)
                read_upto(j + slots, 0.0)
                t = max(t, reads[j])
            t += s
            ends.append(t)
            if self.on_nvme[k]:
                lane = max(lane, t) + self.state_io[k][1]
                writes.append(lane)
                written[k] = lane
        return ends, written

    def host_budget_for(self, moments: list[str] | None) -> float:
        """Host bytes left for offloaded boundaries (and NVMe staging) beside the store."""
        return self.host_budget_fp32 + sum(s for s, m in zip(self.saving_8bit, moments or []) if m == "8bit")

    def max_nvme(self) -> float:
        return self.nvme_cap / self.a_bytes

    def const_s(self) -> float:
        """Step seconds that no boundary choice changes."""
        return self.num_micro_batches * (self.e_fwd + self.head + self.e_bwd) + self.tail

    # ----- evaluate a fixed assignment ----------------------------------------------------

    def needed(self, tiers: list[str], internal: list[str]) -> tuple[list[float], list[float]]:
        """Per boundary: (needed by the backward, recomputed). A boundary is needed when its layer
        recomputes its internals, or when the boundary above is needed and dropped (the recompute
        of that one starts below it); a needed dropped boundary is recomputed once."""
        L = self.L
        needed, rec = [0.0] * L, [0.0] * L
        for i in reversed(range(L)):
            above = i + 1 < L and needed[i + 1] and tiers[i + 1] == "recompute"
            needed[i] = 1.0 if internal[i] == "recompute" or above else 0.0
            rec[i] = 1.0 if needed[i] and tiers[i] == "recompute" else 0.0
        return needed, rec

    def evaluate(self, tiers: list[str], include_stall: bool = True,
                 moments: list[str] | None = None, internal: list[str] | None = None,
                 resident: list[int] | None = None) -> ModelEval:
        """The model's step time for ``tiers`` and ``internal`` tiers (default: all recompute) with
        ``moments`` (default: the model's) and ``resident`` layers (default none); an upper bound
        on the MILP's value for that assignment."""
        L, P = self.L, self.per_load
        moments = moments if moments is not None else self.moments
        internal = internal or ["recompute"] * L
        res = [1.0 if i in set(resident or ()) else 0.0 for i in range(L)]
        embed_ready, layer_done = self.optimizer_bounds(moments)
        off = [1.0 if t in ("host", "nvme") else 0.0 for t in tiers]
        kept = [0.0 if t == "recompute" else 1.0 for t in internal]
        hostk = [1.0 if t == "host" else 0.0 for t in internal]
        w = [self.w_in[i] * (1.0 - res[i]) for i in range(L)]
        f = [max(w[i] + self.w_refresh[i] * res[i], self.c_fwd[i] + (self.c_fwd_keep[i] - self.c_fwd[i]) * kept[i],
                 self.a_out * off[i] + self.ws_out * hostk[i], self.src_in[i]) for i in range(L)]
        b = [max(w[i] + self.a_in * off[i] + self.ws_in * hostk[i], self.grad_out[i],
                 self.c_bwd[i] - (self.c_bwd[i] - self.c_bwd_kept[i]) * kept[i], self.src_in[i] + self.grad_nv[i])
             for i in range(L)]
        needed, recomputed = self.needed(tiers, internal)
        rec = sum(self.recompute[k] * recomputed[k] for k in range(L))
        for i in range(L):  # NVMe reads must fit in the two windows before their use
            if tiers[i] == "nvme":
                later = [j for j in (i + 1, i + 2) if j < L]
                have = sum(b[j] for j in later) + (self.head if i + 2 >= L else 0.0)
                if have < self.nvme_read:
                    b[later[0] if later else L - 1] += self.nvme_read - have
        n_nvme = sum(t == "nvme" for t in tiers)
        total = sum(f) + sum(b) + rec + self.e_fwd + self.head + self.e_bwd
        need = max(n_nvme * self.nvme_rw + self.state_traffic / self.num_micro_batches
                   + sum(self.src_recompute[k] * recomputed[k] for k in range(L)), self.accumulate)
        if need > total:
            b[0] += need - total
        stall = 0.0
        if include_stall:  # the first group's forward: P micro-batches through each layer
            stall = max(0.0, embed_ready)
            acc = P * self.e_fwd
            for k in range(L):
                acc += P * f[k]
                stall = max(stall, layer_done[k] - acc)
        step = self.num_micro_batches * (sum(f) + sum(b) + rec) + stall + self.const_s()
        viol, runs = self._violations(tiers, internal, recomputed, res, moments)
        return ModelEval(step, not viol, viol, f, b, runs, needed, recomputed, stall, res)

    def _violations(self, tiers: list[str], internal: list[str], recomputed: list[float], res: list[float],
                    moments: list[str] | None) -> tuple[dict[str, float], list[int]]:
        """Bytes over each capacity, in boundaries: per micro-batch of a group (``P`` of them)
        its kept boundaries, held recomputed ones (the run ending here), device internals of the
        layers at or below, host internals being fetched; the resident weights at every op."""
        L, P = self.L, self.per_load
        viol: dict[str, float] = {}
        hostk = [1.0 if t == "host" else 0.0 for t in internal]
        resident = sum(r * x for r, x in zip(self.resident_ratio, res))
        dev = 0.0
        run = 0
        runs = []
        for i in range(L):
            dev += (tiers[i] == "device") + self.ws_ratio * (internal[i] == "device")
            run = run + 1 if recomputed[i] else 0
            runs.append(run)
            fetched = self.ws_ratio * (hostk[i] + (hostk[i - 1] if i else 0.0))
            over = P * (dev + fetched + run) + resident - self.max_device_prefix(i)
            if over > 1e-9:
                viol["device"] = max(viol.get("device", 0.0), over * self.a_bytes)
        over = P * (dev + self.ws_ratio * hostk[L - 1]) + resident - self.max_device_total()
        if over > 1e-9:
            viol["device"] = max(viol.get("device", 0.0), over * self.a_bytes)
        n_nvme = sum(t == "nvme" for t in tiers)
        staging = NVME_STAGING if n_nvme else 0
        over = (P * (sum(t == "host" for t in tiers) + self.ws_ratio * sum(hostk)) + staging
                - self.host_budget_for(moments) / self.a_bytes)
        if over > 1e-9:
            viol["host"] = over * self.a_bytes
        over = P * n_nvme - self.max_nvme()
        if over > 1e-9:
            viol["nvme"] = over * self.a_bytes
        return viol, runs

