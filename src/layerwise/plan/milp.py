"""The MILP: where each layer boundary lives (device / host / NVMe) or whether it is recomputed,
where each layer's internals live (device / host) or whether they are recomputed, and which units
keep 8-bit optimizer moments.

Solved once, before training, with HiGHS. The step is cut into *windows*, one per compute op of
the engine's program; each window lasts as long as the slowest of the resources working in it
(compute, H2D, D2H, host accumulation), so a transfer that fits inside the compute of its window
costs nothing and one that does not shows up as exposed time. Weight and gradient traffic is
mandatory; the activation traffic each choice adds competes with it in the same windows. The
formulation (variables, constraints, objective) is written out in ``docs/planner.md``.

:class:`StepModel` holds the linear model's constants (from :class:`~.cost.CostModel`) and can
evaluate a fixed assignment; :func:`solve` builds and solves the MILP; :func:`dp_device_host`
is an exact dynamic program for the device/host-only case, used as a cross-check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..models.names import EMBED, layer_unit
from .cost import STATE_NBYTES, CostModel
from .shape import ModelShape
from .hardware import HardwareProfile
from .plan import INTERNAL_TIERS, Plan
from .memory import FETCH_SLOTS, GRAD_SLOTS
from .program import Op, OpKind

ALL_TIERS = ("device", "host", "nvme", "recompute")
ALL_INTERNAL_TIERS = INTERNAL_TIERS
MS = 1e3  # the solver works in milliseconds (better-scaled coefficients)
TIE = 1e-3  # fraction of a boundary's copy time charged to offloading, to break ties
NVME_STAGING = 2
"""Host buffers NVMe traffic holds: one boundary waiting for its write, one read back ahead of
its fetch. Only a plan with an NVMe boundary needs them (the simulator allocates them then)."""


@dataclass
class MilpConfig:
    time_limit_s: float = 5.0
    """Wall-clock limit for HiGHS; the incumbent is used when it runs out."""
    mip_rel_gap: float = 1e-3
    """Stop when (incumbent - bound) / incumbent is below this."""
    tiers: tuple[str, ...] = ALL_TIERS
    """Tiers a boundary may take (e.g. ("device", "host") for the DP cross-check)."""
    internal_tiers: tuple[str, ...] = ALL_INTERNAL_TIERS
    """Tiers a layer's internals may take (("recompute",): boundaries only, as before issue 13)."""
    include_optimizer_stall: bool = True
    """Model the next forward waiting for the host optimizer (couples the forward windows)."""
    threads: int = 1
    """HiGHS threads (the machines this runs on are often shared)."""
    choose_moments: bool = True
    """Let the MILP pick each unit's optimizer moments (8-bit frees host memory for offloaded
    boundaries, fp32 keeps the optimizer faster); False keeps the model's ``moments``."""


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


class StepModel:
    """Constants of the linear step model for one (model, machine, micro-batch shape)."""

    def __init__(self, shape: ModelShape, hw: HardwareProfile, micro_batch_size: int, seq_len: int,
                 num_micro_batches: int = 1, prefetch_depth: int = 1, head_chunk_tokens: int = 1024,
                 moments: list[str] | None = None, device_reserve_bytes: int = 0, host_reserve_bytes: int = 0):
        """``device_reserve_bytes`` / ``host_reserve_bytes``: capacity held back from the linear
        model, for what it does not see (the search sets them from the simulator's overflow)."""
        self.shape, self.hw = shape, hw
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.num_micro_batches = num_micro_batches
        self.prefetch_depth = prefetch_depth
        self.head_chunk_tokens = head_chunk_tokens
        self.moments = moments
        cost = self.cost = CostModel(shape, hw, micro_batch_size, seq_len, head_chunk_tokens)
        L = self.L = shape.num_layers
        a = self.a_bytes = cost.boundary_bytes
        lw = [cost.unit_weight_bytes(layer_unit(i)) for i in range(L)]
        self.c_fwd = [cost.layer_fwd_s(i) for i in range(L)]
        self.w_in = [cost.h2d_s(b) for b in lw]
        self.a_out = cost.d2h_s(a)
        self.a_in = cost.h2d_s(a)
        # window lower bounds that do not depend on the choice
        self.f_lb = [max(self.c_fwd[i], self.w_in[i]) for i in range(L)]
        self.b_lb = [max(cost.layer_bwd_s(i), self.w_in[i], cost.d2h_s(lw[i])) for i in range(L)]
        # a layer with kept internals: forward with a graph, backward without the forward; its
        # internals (ws bytes) copied out in its forward window and back in its backward window
        # on the host tier
        self.c_fwd_keep = [cost.layer_fwd_keep_s(i) for i in range(L)]
        self.c_bwd = [cost.layer_bwd_s(i) for i in range(L)]
        self.c_bwd_kept = [cost.layer_bwd_kept_s(i) for i in range(L)]
        self.grad_out = [cost.d2h_s(b) for b in lw]
        ws = cost.layer_workspace_bytes
        self.ws_ratio = ws / a
        """One layer's internals in boundaries (the unit of the capacity rows)."""
        self.ws_out = cost.d2h_s(ws)
        self.ws_in = cost.h2d_s(ws)
        # the host accumulation lane queues: it only has to keep up over a whole micro-batch
        self.accumulate = sum(cost.grad_accumulate_s(u) for u in shape.unit_names()) + (
            cost.grad_accumulate_s(EMBED) if shape.tied else 0.0)
        emb_w = cost.unit_weight_bytes(EMBED)
        head_w = sum(cost.unit_weight_bytes(u) for u in Op(OpKind.HEAD).units(shape.tied))
        self.e_fwd = max(cost.embed_s, cost.h2d_s(emb_w))
        self.head = max(cost.head_s, cost.h2d_s(head_w), cost.d2h_s(head_w))
        self.e_bwd = max(cost.embed_s, cost.h2d_s(emb_w), cost.d2h_s(emb_w))
        # a dropped boundary k costs the forward of layer k-1 (boundary 0: the embedding) again,
        # with that layer's weights streamed again
        self.recompute = [self.e_fwd] + [max(self.c_fwd[k - 1], self.w_in[k - 1]) for k in range(1, L)]
        # after the last backward: the last gradient lands, then the optimizer starts
        self.tail = cost.d2h_s(emb_w) + cost.grad_accumulate_s(EMBED)
        units = self.units = shape.unit_names()
        self.emb_w_in = cost.h2d_s(emb_w)
        # per unit: optimizer seconds with fp32 and with 8-bit moments, and the host bytes 8-bit
        # moments free (the MILP may switch any unit; ``moments`` is the fixed choice evaluated)
        self.opt_fp32 = [cost.optimizer_s(u, "fp32") for u in units]
        self.opt_8bit = [cost.optimizer_s(u, "8bit") for u in units]
        self.saving_8bit = [STATE_NBYTES["fp32"](n) - STATE_NBYTES["8bit"](n)
                            for n in (shape.unit_params(u) for u in units)]
        # device memory at the head and at each layer's backward: the engine's slots (fetch
        # slots counted whatever the tiers, so the constants do not depend on them) plus the op's
        # transient
        self.dev_cap = hw.device_cap_bytes - device_reserve_bytes
        largest_w = max(cost.unit_weight_bytes(u) for u in units)
        slots = ((self.prefetch_depth + 1) * largest_w + (0 if hw.synchronous else GRAD_SLOTS * largest_w)
                 + FETCH_SLOTS * a)
        self.c_bwd_mem = [slots + cost.op_transient_bytes(OpKind.LAYER_BWD, i) for i in range(L)]
        self.c_head_mem = slots + cost.op_transient_bytes(OpKind.HEAD)
        # host: what the store leaves (all-fp32 moments; each 8-bit unit frees saving_8bit)
        self.host_budget_fp32 = hw.host_cap_bytes - host_reserve_bytes - cost.host_store_bytes(["fp32"] * len(units))
        self.host_budget = self.host_budget_for(moments)
        self.nvme_cap = hw.nvme_capacity_bytes
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
        next forward: its update + its copy + its compute), the optimizer running units in order."""
        mom = moments or ["fp32"] * len(self.units)
        t, cum = 0.0, []
        for k, m in enumerate(mom):
            t += self.opt_8bit[k] if m == "8bit" else self.opt_fp32[k]
            cum.append(t)
        return (cum[0] + self.emb_w_in,
                [cum[1 + k] + self.w_in[k] + self.c_fwd[k] for k in range(self.L)])

    def host_budget_for(self, moments: list[str] | None) -> float:
        """Host bytes left for offloaded boundaries (and NVMe staging) beside the store."""
        return self.host_budget_fp32 + sum(s for s, m in zip(self.saving_8bit, moments or []) if m == "8bit")

    def max_host(self) -> float:
        """Host-offloaded boundaries that fit beside the store (with ``moments``). NVMe staging
        (NVME_STAGING boundaries) is charged only when some boundary goes to NVMe."""
        return self.host_budget / self.a_bytes

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
                 moments: list[str] | None = None, internal: list[str] | None = None) -> ModelEval:
        """The model's step time for ``tiers`` and ``internal`` tiers (default: all recompute) with
        ``moments`` (default: the model's); an upper bound on the MILP's value for that assignment."""
        L = self.L
        moments = moments if moments is not None else self.moments
        internal = internal or ["recompute"] * L
        embed_ready, layer_done = self.optimizer_bounds(moments)
        viol: dict[str, float] = {}
        off = [1.0 if t in ("host", "nvme") else 0.0 for t in tiers]
        kept = [0.0 if t == "recompute" else 1.0 for t in internal]
        hostk = [1.0 if t == "host" else 0.0 for t in internal]
        f = [max(self.w_in[i], self.c_fwd[i] + (self.c_fwd_keep[i] - self.c_fwd[i]) * kept[i],
                 self.a_out * off[i] + self.ws_out * hostk[i]) for i in range(L)]
        b = [max(self.w_in[i] + self.a_in * off[i] + self.ws_in * hostk[i], self.grad_out[i],
                 self.c_bwd[i] - (self.c_bwd[i] - self.c_bwd_kept[i]) * kept[i]) for i in range(L)]
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
        need = max(n_nvme * self.nvme_rw, self.accumulate)
        if need > total:
            b[0] += need - total
        stall = 0.0
        if include_stall:
            stall = max(0.0, embed_ready)
            acc = self.e_fwd
            for k in range(L):
                acc += f[k]
                stall = max(stall, layer_done[k] - acc)
        step = self.num_micro_batches * (sum(f) + sum(b) + rec) + stall + self.const_s()
        # capacities, in boundaries: kept boundaries, held recomputed ones (the run of recomputed
        # ones ending here), device internals of the layers at or below, host internals being fetched
        dev = 0.0
        run = 0
        runs = []
        for i in range(L):
            dev += (tiers[i] == "device") + self.ws_ratio * (internal[i] == "device")
            run = run + 1 if recomputed[i] else 0
            runs.append(run)
            fetched = self.ws_ratio * (hostk[i] + (hostk[i - 1] if i else 0.0))
            over = dev + fetched + run - self.max_device_prefix(i)
            if over > 1e-9:
                viol["device"] = max(viol.get("device", 0.0), over * self.a_bytes)
        over = dev + self.ws_ratio * hostk[L - 1] - self.max_device_total()
        if over > 1e-9:
            viol["device"] = max(viol.get("device", 0.0), over * self.a_bytes)
        staging = NVME_STAGING if n_nvme else 0
        over = (sum(t == "host" for t in tiers) + staging + self.ws_ratio * sum(hostk)
                - self.host_budget_for(moments) / self.a_bytes)
        if over > 1e-9:
            viol["host"] = over * self.a_bytes
        over = n_nvme - self.max_nvme()
        if over > 1e-9:
            viol["nvme"] = over * self.a_bytes
        return ModelEval(step, not viol, viol, f, b, runs, needed, recomputed, stall)


@dataclass
class MilpResult:
    tiers: list[str] | None
    """Best assignment found (None when no feasible one exists)."""
    objective_s: float
    """Model step time of that assignment."""
    bound_s: float
    """Proven lower bound on the model step time."""
    gap: float
    status: str
    solve_s: float
    warm_start: str | None = None
    """Which assignment seeded the solver."""
    moments: list[str] | None = None
    """Per unit optimizer moments of that assignment (chosen by the MILP, or the model's)."""
    internal_tiers: list[str] | None = None
    """Per layer tier of its internals."""

    def plan(self, model: StepModel, **kw: Any) -> Plan:
        assert self.tiers is not None
        return Plan(list(self.tiers), internal_tiers=self.internal_tiers, micro_batch_size=model.micro_batch_size,
                    num_micro_batches=model.num_micro_batches, seq_len=model.seq_len,
                    prefetch_depth=model.prefetch_depth, head_chunk_tokens=model.head_chunk_tokens,
                    moments=self.moments, source="milp", **kw)


def solve(model: StepModel, config: MilpConfig | None = None,
          warm_start: tuple[str, list[str]] | None = None,
          warm_moments: list[str] | None = None, warm_internal: list[str] | None = None) -> MilpResult:
    """Build and solve the MILP for ``model``; ``warm_start`` = (name, tiers), with
    ``warm_moments`` (default: the model's) and ``warm_internal`` (default: all recompute),
    seeds the search."""
    import highspy

    cfg = config or MilpConfig()
    bad = set(cfg.tiers) - set(ALL_TIERS)
    if bad or not cfg.tiers:
        raise ValueError(f"MilpConfig.tiers must be a non-empty subset of {ALL_TIERS}, got {cfg.tiers}")
    if not cfg.internal_tiers or set(cfg.internal_tiers) - set(ALL_INTERNAL_TIERS):
        raise ValueError(f"MilpConfig.internal_tiers must be a non-empty subset of {ALL_INTERNAL_TIERS}, "
                         f"got {cfg.internal_tiers}")
    L = model.L
    presolved_s = 0.0
    if "recompute" in cfg.internal_tiers and len(cfg.internal_tiers) > 1:
        # Boundaries first (fast: its LP relaxation is tight), then everything warm-started from
        # the better of that and the given start: cold, the joint model can stall at its time
        # limit far from the optimum (qwen-27b, h800, micro-batch 4: 26% gap after 2 s, a plan
        # 18% slower than the boundary-only optimum; warm, optimal in 0.75 s).
        plain = warm_internal is None or set(warm_internal) == {"recompute"}
        first = solve(model, replace(cfg, internal_tiers=("recompute",)), warm_start if plain else None,
                      warm_moments if plain else None)
        presolved_s = first.solve_s
        given = None
        if warm_start is not None and len(warm_start[1]) == L:
            ev = model.evaluate(warm_start[1], cfg.include_optimizer_stall,
                                warm_moments if cfg.choose_moments and warm_moments is not None else model.moments,
                                warm_internal)
            given = ev.step_s if ev.feasible else None
        if first.tiers is not None and (given is None or first.objective_s < given):
            # (named after the start it came from, if any: the boundary solve began there)
            name = warm_start[0] if warm_start is not None else "boundaries"
            warm_start, warm_moments, warm_internal = (name, first.tiers), first.moments, None
    inf = highspy.kHighsInf
    M = model.num_micro_batches
    # columns: tier binaries (4L), f (L), b (L), run length l (L), stall (1), 8-bit moments per
    # unit (U), any boundary on NVMe (1), internal tier binaries (3L), boundary needed (L),
    # boundary recomputed (L)
    U = len(model.units)
    T = {t: k for k, t in enumerate(ALL_TIERS)}

    def y(i: int, t: str) -> int:
        return 4 * i + T[t]

    def fcol(i: int) -> int:
        return 4 * L + i

    def bcol(i: int) -> int:
        return 5 * L + i

    def lcol(i: int) -> int:
        return 6 * L + i

    scol = 7 * L

    def qcol(u: int) -> int:
        return 7 * L + 1 + u

    zcol = 7 * L + 1 + U
    IT = {t: k for k, t in enumerate(ALL_INTERNAL_TIERS)}

    def k(i: int, t: str) -> int:
        return zcol + 1 + 3 * i + IT[t]

    def needcol(i: int) -> int:
        return zcol + 1 + 3 * L + i

    def reccol(i: int) -> int:
        return zcol + 1 + 4 * L + i

    ncol = zcol + 1 + 5 * L
    fixed = model.moments or ["fp32"] * U
    lower = [0.0] * ncol
    upper = [1.0] * ncol
    cost = [0.0] * ncol
    integrality = [highspy.HighsVarType.kContinuous] * ncol
    for i in range(L):
        for t in ALL_TIERS:
            c = y(i, t)
            integrality[c] = highspy.HighsVarType.kInteger
            upper[c] = 1.0 if t in cfg.tiers else 0.0
        for t in ALL_INTERNAL_TIERS:
            integrality[k(i, t)] = highspy.HighsVarType.kInteger
            upper[k(i, t)] = 1.0 if t in cfg.internal_tiers else 0.0
        cost[reccol(i)] = M * model.recompute[i] * MS
        # tie-breaks among choices the model prices equally: keep rather than move, host over NVMe
        cost[y(i, "host")] = TIE * M * model.a_in * MS
        cost[y(i, "nvme")] = 2 * TIE * M * model.a_in * MS
        cost[k(i, "host")] = TIE * M * model.ws_in * MS
        lower[fcol(i)], upper[fcol(i)], cost[fcol(i)] = model.w_in[i] * MS, inf, M
        lower[bcol(i)], upper[bcol(i)], cost[bcol(i)] = max(
            model.w_in[i], model.grad_out[i], model.c_bwd_kept[i]) * MS, inf, M
        lower[lcol(i)], upper[lcol(i)] = 0.0, float(L)
    upper[scol] = inf
    cost[scol] = 1.0 if cfg.include_optimizer_stall else 0.0
    d_opt = [b - a for a, b in zip(model.opt_fp32, model.opt_8bit)]  # 8-bit's extra seconds
    for u in range(U):
        integrality[qcol(u)] = highspy.HighsVarType.kInteger
        if not cfg.choose_moments:
            lower[qcol(u)] = upper[qcol(u)] = 1.0 if fixed[u] == "8bit" else 0.0
        # tie-break: fp32 moments where 8-bit buys nothing (fewest parameters in 8-bit)
        cost[qcol(u)] = TIE * model.opt_fp32[u] * MS
    integrality[zcol] = highspy.HighsVarType.kInteger
    tie_cols = ([y(i, t) for i in range(L) for t in ("host", "nvme")] + [qcol(u) for u in range(U)]
                + [k(i, "host") for i in range(L)])

    rows: list[tuple[float, float, dict[int, float]]] = []
    for i in range(L):
        rows.append((1.0, 1.0, {y(i, t): 1.0 for t in ALL_TIERS}))
        rows.append((1.0, 1.0, {k(i, t): 1.0 for t in ALL_INTERNAL_TIERS}))
        off = {y(i, "host"): 1.0, y(i, "nvme"): 1.0}
        kept = (k(i, "device"), k(i, "host"))
        # windows: the D2H lane in the forward, the H2D lane in the backward, and compute (a
        # kept layer's forward runs with a graph, its backward without the forward)
        rows.append((0.0, inf, {fcol(i): 1.0, **{c: -model.a_out * MS for c in off},
                                k(i, "host"): -model.ws_out * MS}))
        rows.append((model.w_in[i] * MS, inf, {bcol(i): 1.0, **{c: -model.a_in * MS for c in off},
                                               k(i, "host"): -model.ws_in * MS}))
        rows.append((model.c_fwd[i] * MS, inf,
                     {fcol(i): 1.0, **{c: -(model.c_fwd_keep[i] - model.c_fwd[i]) * MS for c in kept}}))
        rows.append((model.c_bwd[i] * MS, inf,
                     {bcol(i): 1.0, **{c: (model.c_bwd[i] - model.c_bwd_kept[i]) * MS for c in kept}}))
        # boundary i is needed when layer i recomputes its internals or boundary i+1 is needed and
        # dropped; a needed dropped boundary is recomputed (the objective pays for those)
        rows.append((0.0, inf, {needcol(i): 1.0, k(i, "recompute"): -1.0}))
        if i + 1 < L:
            rows.append((-1.0, inf, {needcol(i): 1.0, needcol(i + 1): -1.0, y(i + 1, "recompute"): -1.0}))
        rows.append((-1.0, inf, {reccol(i): 1.0, needcol(i): -1.0, y(i, "recompute"): -1.0}))
        run = {lcol(i): 1.0, reccol(i): -(L + 1.0)}
        if i > 0:
            run[lcol(i - 1)] = -1.0
        rows.append((-float(L), inf, run))
        prefix = {y(j, "device"): 1.0 for j in range(i + 1)}
        prefix.update({k(j, "device"): model.ws_ratio for j in range(i + 1)})
        for j in (i, i - 1):  # host internals fetched for this backward and the next
            if j >= 0:
                prefix[k(j, "host")] = prefix.get(k(j, "host"), 0.0) + model.ws_ratio
        prefix[lcol(i)] = 1.0
        rows.append((-inf, model.max_device_prefix(i), prefix))
        # NVMe read of boundary i within the next two backward windows (the head for the top)
        read = {bcol(j): 1.0 for j in (i + 1, i + 2) if j < L}
        read[y(i, "nvme")] = -model.nvme_read * MS
        rows.append((-(model.head * MS if i + 2 >= L else 0.0), inf, read))
        rows.append((0.0, inf, {zcol: 1.0, y(i, "nvme"): -1.0}))
    total = {y(j, "device"): 1.0 for j in range(L)}
    total.update({k(j, "device"): model.ws_ratio for j in range(L)})
    total[k(L - 1, "host")] = model.ws_ratio  # fetched ahead, during the head
    rows.append((-inf, model.max_device_total(), total))
    # host, in boundaries: offloaded ones + host internals + NVMe staging (if any NVMe) <= what
    # the store leaves, which each 8-bit unit enlarges
    host = {y(j, "host"): 1.0 for j in range(L)}
    host.update({k(j, "host"): model.ws_ratio for j in range(L)})
    host[zcol] = float(NVME_STAGING)
    host.update({qcol(u): -model.saving_8bit[u] / model.a_bytes for u in range(U)})
    rows.append((-inf, model.host_budget_fp32 / model.a_bytes, host))
    rows.append((-inf, model.max_nvme(), {y(j, "nvme"): 1.0 for j in range(L)}))
    agg: dict[int, float] = {}
    for j in range(L):
        agg[fcol(j)] = 1.0
        agg[bcol(j)] = 1.0
        agg[reccol(j)] = model.recompute[j] * MS
        agg[y(j, "nvme")] = -model.nvme_rw * MS
    rows.append((-(model.e_fwd + model.head + model.e_bwd) * MS, inf, agg))
    acc = {c: v for c, v in agg.items() if v > 0}
    rows.append(((model.accumulate - model.e_fwd - model.head - model.e_bwd) * MS, inf, acc))
    if cfg.include_optimizer_stall:
        # the optimizer updates units in order; 8-bit moments make unit u's update d_opt[u] longer
        embed_ready, layer_done = model.optimizer_bounds(None)
        rows.append((embed_ready * MS, inf, {scol: 1.0, qcol(0): -d_opt[0] * MS}))
        for j in range(L):
            r = {scol: 1.0, **{fcol(u): 1.0 for u in range(j + 1)}}
            r.update({qcol(u): -d_opt[u] * MS for u in range(j + 2)})
            rows.append(((layer_done[j] - model.e_fwd) * MS, inf, r))

    lp = highspy.HighsLp()
    lp.num_col_, lp.num_row_ = ncol, len(rows)
    lp.col_cost_, lp.col_lower_, lp.col_upper_ = cost, lower, upper
    lp.row_lower_ = [r[0] for r in rows]
    lp.row_upper_ = [r[1] for r in rows]
    starts, index, value = [0], [], []
    for _, _, coefs in rows:
        for c, v in coefs.items():
            index.append(c)
            value.append(v)
        starts.append(len(index))
    lp.a_matrix_.format_ = highspy.MatrixFormat.kRowwise
    lp.a_matrix_.start_, lp.a_matrix_.index_, lp.a_matrix_.value_ = starts, index, value
    lp.integrality_ = integrality
    lp.offset_ = model.const_s() * MS

    h = _quiet_highs(highspy)
    # one call's limit covers both solves (a search's budget hands it what is left); the joint
    # solve keeps a tenth of it, in which it returns its warm start or better
    h.setOptionValue("time_limit", max(cfg.time_limit_s - presolved_s, 0.1 * cfg.time_limit_s))
    h.setOptionValue("mip_rel_gap", float(cfg.mip_rel_gap))
    h.setOptionValue("threads", int(cfg.threads))
    h.setOptionValue("random_seed", 0)
    h.passModel(lp)
    ws_name = None
    if warm_start is not None:
        ws_name, ws_tiers = warm_start
        ws_moments = warm_moments if cfg.choose_moments and warm_moments is not None else fixed
        ws_internal = warm_internal or ["recompute"] * L
        ev = (model.evaluate(ws_tiers, cfg.include_optimizer_stall, ws_moments, ws_internal)
              if len(ws_tiers) == L else None)
        if (ev is not None and ev.feasible and all(t in cfg.tiers for t in ws_tiers)
                and all(t in cfg.internal_tiers for t in ws_internal)):
            vals = [0.0] * ncol
            for i in range(L):
                vals[y(i, ws_tiers[i])] = 1.0
                vals[k(i, ws_internal[i])] = 1.0
                vals[needcol(i)], vals[reccol(i)] = ev.needed[i], ev.recomputed[i]
                vals[fcol(i)], vals[bcol(i)], vals[lcol(i)] = ev.f[i] * MS, ev.b[i] * MS, float(ev.run[i])
            vals[scol] = ev.stall * MS
            for u in range(U):
                vals[qcol(u)] = 1.0 if ws_moments[u] == "8bit" else 0.0
            vals[zcol] = 1.0 if "nvme" in ws_tiers else 0.0
            sol = highspy.HighsSolution()
            sol.col_value = vals
            sol.value_valid = True
            h.setSolution(sol)
            # With presolve on, HiGHS 1.16 can report the improved objective but hand back the
            # user's solution vector; solving the full model avoids that.
            h.setOptionValue("presolve", "off")
        else:
            ws_name = None
    t0 = time.perf_counter()
    h.run()
    solve_s = time.perf_counter() - t0 + presolved_s
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # 2 = feasible
        return MilpResult(None, float("inf"), float("inf"), float("inf"), status, solve_s, ws_name)
    x = list(h.getSolution().col_value)
    tiers = [max(cfg.tiers, key=lambda t: x[y(i, t)]) for i in range(L)]
    internal = [max(cfg.internal_tiers, key=lambda t: x[k(i, t)]) for i in range(L)]
    moments = ["8bit" if x[qcol(u)] > 0.5 else "fp32" for u in range(U)]
    obj = info.objective_function_value / MS
    x_obj = sum(c * v for c, v in zip(cost, x)) / MS + model.const_s()
    ties = sum(cost[c] * x[c] for c in tie_cols) / MS
    if abs(x_obj - obj) > 1e-6 * max(1.0, abs(obj)):
        if ws_name is not None:  # the solver's vector does not match its objective: solve cold
            cold = solve(model, cfg)
            cold.solve_s += solve_s
            return cold
        raise AssertionError(f"HiGHS objective {obj} does not match its solution ({x_obj})")
    bound = info.mip_dual_bound / MS
    gap = max(0.0, (obj - bound) / obj) if obj > 0 else 0.0
    step_s = obj - ties
    needed, _ = model.needed(tiers, internal)
    if "recompute" in cfg.tiers and not all(needed[i] or t == "recompute" for i, t in enumerate(tiers)):
        # a stored boundary no backward reads (its layer keeps its internals, no recompute starts
        # from it) costs copies and memory for nothing, and the model may leave one where its
        # copies hide in a window: drop it
        tiers = [t if needed[i] else "recompute" for i, t in enumerate(tiers)]
        step_s = min(step_s, model.evaluate(tiers, cfg.include_optimizer_stall, moments, internal).step_s)
    return MilpResult(tiers, step_s, min(bound - ties, step_s), gap, status, solve_s, ws_name,
                      moments if cfg.choose_moments or model.moments is not None else None, internal)


def _quiet_highs(highspy):
    """A Highs instance; its constructor's banner goes to fd 1, which would spoil JSON output."""
    import os
    import sys

    sys.stdout.flush()
    try:
        saved = os.dup(1)
    except OSError:  # no real stdout
        h = highspy.Highs()
    else:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, 1)
            h = highspy.Highs()
            h.setOptionValue("output_flag", False)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
    h.setOptionValue("output_flag", False)
    return h


def dp_device_host(model: StepModel) -> tuple[list[str] | None, float]:
    """Exact optimum over device/host only, without the optimizer stall (a cross-check).

    With no recompute or NVMe the model separates per boundary and the capacities reduce to a
    count of device boundaries (<= D) and of host boundaries (<= H): a DP over (layer, #device).
    """
    L = model.L
    dmax = min(int(model.max_device_total() + 1e-9),
               min(int(model.max_device_prefix(i) + 1e-9) for i in range(L)))
    hmax = int(model.max_host() + 1e-9)
    M = model.num_micro_batches

    def cost(i: int, tier: str) -> float:
        off = 1.0 if tier == "host" else 0.0
        return M * (max(model.f_lb[i], model.a_out * off) + max(model.b_lb[i], model.w_in[i] + model.a_in * off))

    INF = float("inf")
    # best[c] = (cost, tiers) over the layers seen so far with c device boundaries
    best: list[tuple[float, list[str]]] = [(0.0, [])] + [(INF, [])] * max(dmax, 0)
    if dmax < 0:
        return None, INF
    for i in range(L):
        new: list[tuple[float, list[str]]] = [(INF, [])] * (dmax + 1)
        for c, (v, tiers) in enumerate(best):
            if v == INF:
                continue
            hosts = i - c
            if hosts + 1 <= hmax:
                cand = v + cost(i, "host")
                if cand < new[c][0]:
                    new[c] = (cand, tiers + ["host"])
            if c + 1 <= dmax:
                cand = v + cost(i, "device")
                if cand < new[c + 1][0]:
                    new[c + 1] = (cand, tiers + ["device"])
        best = new
    v, tiers = min(best, key=lambda e: e[0])
    if v == INF:
        return None, INF
    return tiers, v + model.const_s()
