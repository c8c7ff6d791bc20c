"""The MILP as written in ``docs/planner.md`` ("MILP"), one function per constraint group, named
as the document names it. A new constraint is a new function in :data:`LAYER_GROUPS` or
:func:`step_groups`; constants are the step model's; rows are in milliseconds (:data:`MS`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from .columns import INF, Block, ColumnMap, Rows, to_lp
from ..plan.plan import INTERNAL_TIERS
from .step_model import NVME_STAGING, ModelEval, StepModel

ALL_TIERS = ("device", "host", "nvme", "recompute")
ALL_INTERNAL_TIERS = INTERNAL_TIERS
MS = 1e3
"""The solver works in milliseconds (better-scaled coefficients)."""
TIE = 1e-3
"""Fraction of a boundary's copy time charged to offloading, to break ties."""
QUALITY_8BIT = 0.2
"""Tolerance: where the store fits host memory with fp32 moments on every unit, 8-bit moments
are chosen only where, on every unit, they would shorten the step by more than this fraction of
its compute-and-copy lower bound (charged per unit by its share of the parameters). 8-bit
moments are the design's answer to short host memory and their quality cost is not measured
here; on a bandwidth-bound host they price faster than fp32 (14 bytes a parameter against 26:
``plan.host_rates``), so without this term the MILP would trade fp32 state for a shorter
optimizer stall (qwen2.5-7b on an h800 at 4 x 4096 tokens: 12% of the step, 18% of its lower
bound). Where the fp32 store does not fit, 8-bit is a memory measure and only the tie-break
below applies: a quality charge there would outweigh the host-over-NVMe tie-break and move
boundaries to NVMe to save 8-bit units the store needs anyway."""


class Choices(Protocol):
    """What a model may choose (``MilpConfig`` is one)."""

    tiers: tuple[str, ...]
    """Tiers a boundary may take."""
    internal_tiers: tuple[str, ...]
    """Tiers a layer's internals may take."""
    include_optimizer_stall: bool
    """Whether the next forward's wait for the optimizer is modelled (:func:`optimizer_overlap`)."""
    choose_moments: bool
    """Whether ``q_u`` is free (else fixed at the step model's ``moments``)."""
    resident: bool
    """Whether a layer's weights may stay on the device (``r_i`` free, else no such columns)."""


Row = tuple[float, float, dict[int, float]]
"""(lower, upper, {column: coefficient})."""


@dataclass(frozen=True)
class Vars:
    """The MILP's columns, by the names of ``docs/planner.md``."""

    tier: Block
    """``d_i, h_i, n_i, x_i``: boundary ``i`` on the device / host / NVMe, or recomputed
    (``tier[i, "host"]``; binary, one per boundary)."""
    f: Block
    """``f_i``: the forward window of layer ``i`` (ms)."""
    b: Block
    """``b_i``: the backward window of layer ``i`` (ms)."""
    run: Block
    """``ℓ_i``: recomputed boundaries held on the device at layer ``i``'s backward."""
    stall: int
    """``S``: the next step's forward waiting for the optimizer (ms)."""
    q: Block
    """``q_u``: unit ``u`` keeps 8-bit optimizer moments (binary)."""
    z: int
    """``z``: some boundary is on NVMe (binary)."""
    internal: Block
    """``kd_i, kh_i, kr_i``: layer ``i``'s internals kept on the device / on the host, or
    recomputed (``internal[i, "host"]``; binary)."""
    needed: Block
    """``ν_i``: the backward needs boundary ``i``."""
    recomputed: Block
    """``ρ_i``: boundary ``i`` is recomputed."""
    resident: Block | None
    """``r_i``: layer ``i``'s weights stay on the device (binary; None where the config rules
    resident layers out, so that model is the one without them, column for column)."""

    def resident_coefs(self, coef: Callable[[int], float], layers: range) -> dict[int, float]:
        """``{r_j: coef(j)}`` over ``layers`` (none without resident columns)."""
        return {} if self.resident is None else {self.resident[j]: coef(j) for j in layers}


def variables(cols: ColumnMap, m: StepModel, cfg: Choices) -> Vars:
    """Allocate the columns with their bounds: tiers a config rules out are fixed at 0, window
    lengths start at what no choice changes (``f_i ≥ w_i``, ``b_i ≥ max(B'_i, w_i, g_i)``; without
    ``w_i`` where a layer may be resident; an ``nvme-all`` layer's copy-source read ``s_i`` and
    gradient write ``G_i``: ``f_i ≥ s_i``, ``b_i ≥ s_i + G_i``, and it is never resident)."""
    L, U = m.L, len(m.units)
    tier = cols.add("tier", L, ALL_TIERS, integer=True)
    f = cols.add("f", L, upper=INF)
    b = cols.add("b", L, upper=INF)
    run = cols.add("run", L, upper=float(L))
    stall = cols.add("stall", upper=INF).start
    q = cols.add("q", U, integer=True)
    z = cols.add("z", integer=True).start
    internal = cols.add("internal", L, ALL_INTERNAL_TIERS, integer=True)
    needed = cols.add("needed", L)
    recomputed = cols.add("recomputed", L)
    resident = cols.add("resident", L, integer=True) if cfg.resident else None
    for i in range(L):
        for t in ALL_TIERS:
            cols.bound(tier[i, t], upper=1.0 if t in cfg.tiers else 0.0)
        for t in ALL_INTERNAL_TIERS:
            cols.bound(internal[i, t], upper=1.0 if t in cfg.internal_tiers else 0.0)
        w = 0.0 if cfg.resident else m.w_in[i]
        cols.bound(f[i], lower=max(w, m.src_in[i]) * MS)
        cols.bound(b[i], lower=max(w, m.grad_out[i], m.c_bwd_kept[i], m.src_in[i] + m.grad_nv[i]) * MS)
        if resident is not None and m.all_nvme[1 + i]:  # its weights come from NVMe each copy
            cols.bound(resident[i], upper=0.0)
    if not cfg.choose_moments:
        for u, mom in enumerate(m.moments or ["fp32"] * U):
            fixed = 1.0 if mom == "8bit" else 0.0
            cols.bound(q[u], lower=fixed, upper=fixed)
    for u in range(U):  # a unit whose state is on NVMe keeps 8-bit moments (fewer bytes to move)
        if m.on_nvme[u]:
            cols.bound(q[u], lower=1.0, upper=1.0)
    return Vars(tier, f, b, run, stall, q, z, internal, needed, recomputed, resident)


# ----- objective ---------------------------------------------------------------------------

def objective(cols: ColumnMap, x: Vars, m: StepModel, cfg: Choices) -> float:
    """Step milliseconds: ``M · (Σ f_i + Σ b_i + Σ R_k ρ_k) + S``; returns the constant part
    ``M · (E_f + H + E_b) + tail`` (the objective's offset)."""
    M = m.num_micro_batches
    for i in range(m.L):
        cols.cost[x.recomputed[i]] = M * m.recompute[i] * MS
        cols.cost[x.f[i]] = M
        cols.cost[x.b[i]] = M
    cols.cost[x.stall] = 1.0 if cfg.include_optimizer_stall else 0.0
    return m.const_s() * MS


def step_lower_bound_s(m: StepModel) -> float:
    """The step's compute-and-copy lower bound (every window at its bound, nothing stalls): the
    scale of ``QUALITY_8BIT``."""
    return m.num_micro_batches * (sum(m.f_lb) + sum(m.b_lb)) + m.const_s()


def tie_breaks(cols: ColumnMap, x: Vars, m: StepModel) -> list[int]:
    """Among choices the model prices equally: keep rather than move, host over NVMe, fp32
    moments where 8-bit buys less than ``QUALITY_8BIT`` of the step, a resident layer where
    device memory is left. Returns the columns charged (their cost is not step time)."""
    M = m.num_micro_batches
    for i in range(m.L):
        cols.cost[x.tier[i, "host"]] = TIE * M * m.a_in * MS
        cols.cost[x.tier[i, "nvme"]] = 2 * TIE * M * m.a_in * MS
        cols.cost[x.internal[i, "host"]] = TIE * M * m.ws_in * MS
        if x.resident is not None:  # resident where it is free: less PCIe traffic
            cols.cost[x.resident[i]] = -TIE * M * m.w_in[i] * MS
    quality = 0.0
    if m.host_budget_fp32 >= 0:  # host memory allows fp32 moments everywhere
        quality = QUALITY_8BIT * step_lower_bound_s(m) / max(1, sum(m.cost.shape.trainable_params(u) for u in m.units))
    for u in range(len(m.units)):
        cols.cost[x.q[u]] = (TIE * m.opt_fp32[u] + quality * m.cost.shape.trainable_params(m.units[u])) * MS
    return ([x.tier[i, t] for i in range(m.L) for t in ("host", "nvme")] + [x.q[u] for u in range(len(m.units))]
            + [x.internal[i, "host"] for i in range(m.L)] + (x.resident.at() if x.resident else []))


# ----- per-layer constraint groups -----------------------------------------------------------

def one_tier_each(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``d_i + h_i + n_i + x_i = 1`` and ``kd_i + kh_i + kr_i = 1``."""
    return [(1.0, 1.0, {x.tier[i, t]: 1.0 for t in ALL_TIERS}),
            (1.0, 1.0, {x.internal[i, t]: 1.0 for t in ALL_INTERNAL_TIERS})]


def copy_windows(m: StepModel, x: Vars, i: int) -> list[Row]:
    """The D2H lane in the forward window (offloaded boundary and host internals share it), the
    H2D lane in the backward window (their fetches share it with the weights, unless resident):
    ``b_i ≥ w_i (1 − r_i) + a_in (h_i + n_i) + v_in kh_i``."""
    off = (x.tier[i, "host"], x.tier[i, "nvme"])
    kh = x.internal[i, "host"]
    return [(0.0, INF, {x.f[i]: 1.0, **{c: -m.a_out * MS for c in off}, kh: -m.ws_out * MS}),
            (m.w_in[i] * MS, INF, {x.b[i]: 1.0, **{c: -m.a_in * MS for c in off}, kh: -m.ws_in * MS,
                                   **x.resident_coefs(lambda j: m.w_in[j] * MS, range(i, i + 1))})]


def streamed_weights(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``f_i ≥ w_i (1 − r_i) + u_i r_i``: a forward window holds its weight copy (streamed) or a
    micro-batch's share of its one refresh per step (resident, ``u_i = (W_i/h2d) / M``)."""
    if x.resident is None:
        return []
    return [(m.w_in[i] * MS, INF, {x.f[i]: 1.0, x.resident[i]: (m.w_in[i] - m.w_refresh[i]) * MS})]


def compute_windows(m: StepModel, x: Vars, i: int) -> list[Row]:
    """Compute in both windows: a layer that keeps its internals runs its forward with a graph
    (``c'_i``) and its backward without the forward (``B'_i``)."""
    kept = (x.internal[i, "device"], x.internal[i, "host"])
    return [(m.c_fwd[i] * MS, INF, {x.f[i]: 1.0, **{c: -(m.c_fwd_keep[i] - m.c_fwd[i]) * MS for c in kept}}),
            (m.c_bwd[i] * MS, INF, {x.b[i]: 1.0, **{c: (m.c_bwd[i] - m.c_bwd_kept[i]) * MS for c in kept}})]


def recompute_need(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``ν_i ≥ kr_i``, ``ν_i ≥ ν_{i+1} + x_{i+1} − 1``, ``ρ_i ≥ ν_i + x_i − 1``: boundary ``i`` is
    needed when its layer recomputes its internals or the boundary above is needed and dropped;
    a needed dropped boundary is recomputed (the objective pays for those)."""
    rows = [(0.0, INF, {x.needed[i]: 1.0, x.internal[i, "recompute"]: -1.0})]
    if i + 1 < m.L:
        rows.append((-1.0, INF, {x.needed[i]: 1.0, x.needed[i + 1]: -1.0, x.tier[i + 1, "recompute"]: -1.0}))
    rows.append((-1.0, INF, {x.recomputed[i]: 1.0, x.needed[i]: -1.0, x.tier[i, "recompute"]: -1.0}))
    return rows


def recompute_run(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``ℓ_i − ℓ_{i−1} − (L+1) ρ_i ≥ −L``: the run of recomputed boundaries held at layer ``i``'s
    backward grows by one with each recomputed boundary."""
    run = {x.run[i]: 1.0, x.recomputed[i]: -(m.L + 1.0)}
    if i > 0:
        run[x.run[i - 1]] = -1.0
    return [(-float(m.L), INF, run)]


def device_at_backward(m: StepModel, x: Vars, i: int) -> list[Row]:
    """Device memory at layer ``i``'s backward, in boundaries: for each of the ``P`` micro-batches
    of a group, kept boundaries and device internals of the layers at or below, host internals
    of this layer and the one below (fetched ahead), the held recomputed run; and every
    resident layer's weights (``r_j W_j / A``)."""
    P = m.per_load
    d, kd = x.tier.at("device"), x.internal.at("device")
    prefix = {d[j]: float(P) for j in range(i + 1)}
    prefix.update({kd[j]: P * m.ws_ratio for j in range(i + 1)})
    for j in (i, i - 1):
        if j >= 0:
            prefix[x.internal[j, "host"]] = P * m.ws_ratio
    prefix[x.run[i]] = float(P)
    prefix.update(x.resident_coefs(lambda j: m.resident_ratio[j], range(m.L)))
    return [(-INF, m.max_device_prefix(i), prefix)]


def nvme_read_ahead(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``b_{i+1} + b_{i+2} ≥ n_i · A/nvme_read``: an NVMe boundary's read fits in the two backward
    windows before its use (the head's window for the top two)."""
    read = {x.b[j]: 1.0 for j in (i + 1, i + 2) if j < m.L}
    read[x.tier[i, "nvme"]] = -m.nvme_read * MS
    return [(-(m.head * MS if i + 2 >= m.L else 0.0), INF, read)]


def nvme_flag(m: StepModel, x: Vars, i: int) -> list[Row]:
    """``z ≥ n_i``: the NVMe staging buffers are held once any boundary is on NVMe."""
    return [(0.0, INF, {x.z: 1.0, x.tier[i, "nvme"]: -1.0})]


LayerGroup = Callable[[StepModel, Vars, int], list[Row]]
LAYER_GROUPS: tuple[LayerGroup, ...] = (one_tier_each, copy_windows, streamed_weights, compute_windows,
                                        recompute_need, recompute_run, device_at_backward, nvme_read_ahead,
                                        nvme_flag)


# ----- per-step constraint groups --------------------------------------------------------------

def device_at_head(m: StepModel, x: Vars) -> list[Row]:
    """Device memory at the head: per micro-batch of a group every kept boundary and device
    internals, and the top layer's host internals (fetched ahead during the head); the resident
    weights."""
    P = m.per_load
    total = {x.tier[j, "device"]: float(P) for j in range(m.L)}
    total.update({x.internal[j, "device"]: P * m.ws_ratio for j in range(m.L)})
    total[x.internal[m.L - 1, "host"]] = P * m.ws_ratio
    total.update(x.resident_coefs(lambda j: m.resident_ratio[j], range(m.L)))
    return [(-INF, m.max_device_total(), total)]


def host_capacity(m: StepModel, x: Vars) -> list[Row]:
    """Host memory, in boundaries: offloaded boundaries + host internals (of each of the ``P``
    micro-batches of a group) + NVMe staging (with any NVMe) ≤ what the all-fp32 store leaves
    (with bf16 gradients when every unit lands once per step), which each 8-bit unit enlarges by
    ``s_u``."""
    P = m.per_load
    host = {x.tier[j, "host"]: float(P) for j in range(m.L)}
    host.update({x.internal[j, "host"]: P * m.ws_ratio for j in range(m.L)})
    host[x.z] = float(NVME_STAGING)
    host.update({x.q[u]: -m.saving_8bit[u] / m.a_bytes for u in range(len(m.units))})
    return [(-INF, m.host_budget_fp32 / m.a_bytes, host)]


def nvme_capacity(m: StepModel, x: Vars) -> list[Row]:
    """``P Σ n_k ≤ cap_nvme / A``."""
    return [(-INF, m.max_nvme(), {x.tier[j, "nvme"]: float(m.per_load) for j in range(m.L)})]


def nvme_lane(m: StepModel, x: Vars) -> list[Row]:
    """The NVMe thread (writes and reads) keeps up over a micro-batch, with its share of the
    store's traffic ``T_state`` (the off-RAM units' state in and out, the ``nvme-all`` units'
    sources and gradients, per step) and a recompute's source read ``s'_k``:
    ``Σ f + Σ b + Σ (R_k − s'_k) ρ_k + E_f + H + E_b ≥ Σ n_k · (A/nvme_write + A/nvme_read) + T_state / M``."""
    lane: dict[int, float] = {}
    for j in range(m.L):
        lane[x.f[j]] = 1.0
        lane[x.b[j]] = 1.0
        lane[x.recomputed[j]] = (m.recompute[j] - m.src_recompute[j]) * MS
        lane[x.tier[j, "nvme"]] = -m.nvme_rw * MS
    return [((m.state_traffic / m.num_micro_batches - m.e_fwd - m.head - m.e_bwd) * MS, INF, lane)]


def accumulation_lane(m: StepModel, x: Vars) -> list[Row]:
    """The host accumulation lane keeps up over a micro-batch:
    ``Σ f + Σ b + Σ R_k ρ_k + E_f + H + E_b ≥ Σ_units accumulate``."""
    busy: dict[int, float] = {}
    for j in range(m.L):
        busy[x.f[j]] = 1.0
        busy[x.b[j]] = 1.0
        if m.recompute[j] * MS > 0:
            busy[x.recomputed[j]] = m.recompute[j] * MS
    return [((m.accumulate - m.e_fwd - m.head - m.e_bwd) * MS, INF, busy)]


def optimizer_overlap(m: StepModel, x: Vars) -> list[Row]:
    """The next step's layer ``k`` forward ends after its update, copy and compute:
    ``S − δ_embed q_embed ≥ O_embed + w_embed`` and, per layer ``k``,
    ``S + P (E_f + Σ_{u≤k} f_u) − Σ_{u≤k+1} δ_u q_u ≥ O_k + W_k/h2d + P c_k``."""
    P = m.per_load
    d_opt = [0.0 if nv else b - a for a, b, nv in zip(m.opt_fp32, m.opt_8bit, m.on_nvme)]  # nvme: 8-bit in O
    embed_ready, layer_done = m.optimizer_bounds(None)
    rows = [(embed_ready * MS, INF, {x.stall: 1.0, x.q[0]: -d_opt[0] * MS})]
    f, q = x.f.at(), x.q.at()
    for j in range(m.L):
        r = {x.stall: 1.0, **{f[u]: float(P) for u in range(j + 1)}}
        r.update({q[u]: -d_opt[u] * MS for u in range(j + 2)})
        rows.append(((layer_done[j] - P * m.e_fwd) * MS, INF, r))
    return rows


StepGroup = Callable[[StepModel, Vars], list[Row]]


def step_groups(cfg: Choices) -> tuple[StepGroup, ...]:
    groups: tuple[StepGroup, ...] = (device_at_head, host_capacity, nvme_capacity, nvme_lane, accumulation_lane)
    return groups + ((optimizer_overlap,) if cfg.include_optimizer_stall else ())


# ----- the model ---------------------------------------------------------------------------------

@dataclass
class Formulation:
    """One built MILP: its columns (by name), rows (by group), tie-break columns and offset."""

    cols: ColumnMap
    rows: Rows
    x: Vars
    ties: list[int]
    """Columns whose cost is a tie-break, not step time (subtracted from what is reported)."""
    offset: float

    def lp(self, highspy: Any) -> Any:
        return to_lp(highspy, self.cols, self.rows, self.offset)

    def start_vector(self, ev: ModelEval, tiers: list[str], internal: list[str], moments: list[str]) -> list[float]:
        """A complete solution for a fixed assignment, from the step model's evaluation of it."""
        x = self.x
        vals = [0.0] * self.cols.count
        for i in range(len(tiers)):
            vals[x.tier[i, tiers[i]]] = 1.0
            vals[x.internal[i, internal[i]]] = 1.0
            vals[x.needed[i]], vals[x.recomputed[i]] = ev.needed[i], ev.recomputed[i]
            vals[x.f[i]], vals[x.b[i]], vals[x.run[i]] = ev.f[i] * MS, ev.b[i] * MS, float(ev.run[i])
        vals[x.stall] = ev.stall * MS
        for u, mom in enumerate(moments):
            vals[x.q[u]] = 1.0 if mom == "8bit" else 0.0
        vals[x.z] = 1.0 if "nvme" in tiers else 0.0
        for i, r in enumerate(ev.resident if x.resident is not None else ()):
            vals[x.resident[i]] = r
        return vals

    def decode(self, vals: list[float], cfg: Choices) -> tuple[list[str], list[str], list[str]]:
        """(boundary tiers, internal tiers, moments) of a solution vector."""
        x, L = self.x, self.x.f.count
        tiers = [max(cfg.tiers, key=lambda t: vals[x.tier[i, t]]) for i in range(L)]
        internal = [max(cfg.internal_tiers, key=lambda t: vals[x.internal[i, t]]) for i in range(L)]
        moments = ["8bit" if vals[x.q[u]] > 0.5 else "fp32" for u in range(x.q.count)]
        return tiers, internal, moments

    def decode_resident(self, vals: list[float]) -> list[int]:
        """The resident layers of a solution vector."""
        r = self.x.resident
        return [] if r is None else [i for i in range(r.count) if vals[r[i]] > 0.5]


def build(m: StepModel, cfg: Choices) -> Formulation:
    """The MILP for ``m`` under ``cfg``: variables, objective, then the constraint groups."""
    cols = ColumnMap()
    x = variables(cols, m, cfg)
    offset = objective(cols, x, m, cfg)
    ties = tie_breaks(cols, x, m)
    rows = Rows()
    for i in range(m.L):
        for layer_group in LAYER_GROUPS:
            for lo, hi, coefs in layer_group(m, x, i):
                rows.add(layer_group.__name__, lo, hi, coefs)
    for step_group in step_groups(cfg):
        for lo, hi, coefs in step_group(m, x):
            rows.add(step_group.__name__, lo, hi, coefs)
    return Formulation(cols, rows, x, ties, offset)
