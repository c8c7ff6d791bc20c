"""Outer search: micro-batch size, accumulation, optimizer moments; the MILP inside.

The MILP plan and every baseline are simulated, and the fastest that fits (by simulation, the
more faithful model) is emitted, so it is never slower than a baseline tried
(``docs/planner.md``, "Outer search"). Every step reads and extends one tally of simulated
candidates, so "fits" and "fastest" mean the same for all of them."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

from .baselines import rules as fixed_rules
from .cost import CostModel
from .host_fit import PlanInfeasible, choose_moments, choose_state, human_bytes, infeasible, rule_state
from ..plan.shape import ModelShape
from .hardware import HardwareProfile
from .milp import MilpConfig, MilpResult, solve
from ..plan.plan import Plan
from .screen import Sims, extrapolated
from .simulator import SimResult
from .state_traffic import HIDE_FRACTION, MAX_HIDING_BATCH, STEP_SLACK, hiding_batch, nvme_state
from .step_model import StepModel

__all__ = ["Candidate", "PlanInfeasible", "SearchConfig", "SearchResult", "choose_moments", "human_bytes",
           "search", "with_micro_batches"]


@dataclass
class SearchConfig:
    global_batch: int | None = None
    """Sequences per optimizer step; None = choose (auto)."""
    micro_batch_sizes: tuple[int, ...] | None = None
    """Micro-batch sizes to try; None = the divisors of ``global_batch`` (auto: powers of 2)."""
    max_micro_batch_size: int = 64
    """Largest micro-batch size tried in auto mode."""
    auto_num_micro_batches: tuple[int, ...] = (1, 2, 4, 8, 16)
    """Accumulation counts tried in auto mode."""
    auto_tolerance: float = 0.03
    """Auto mode takes the smallest global batch within this fraction of the best tokens/s."""
    prefetch_depth: int | None = None
    """Weight prefetch depth of emitted plans (1 = double buffering); None = choose among
    ``prefetch_depths``."""
    prefetch_depths: tuple[int, ...] = (1, 2)
    """Depths tried when ``prefetch_depth`` is None."""
    milp: MilpConfig = field(default_factory=MilpConfig)
    per_loads: tuple[int, ...] | None = None
    """Micro-batches sharing each weight load to try (those that divide the step's count); None:
    1 (micro-batch-major) and all of them (layer-major: each unit's weights cross PCIe twice per
    step, its gradient once)."""
    resident: bool = True
    """Let the MILP keep layers' weights on the device where device memory allows."""
    milp_budget_s: float | None = 3.0
    """HiGHS time for the whole search (every micro-batch size and depth solves the MILP, twice
    with the internals tier); a solve gets at most what is left, but at least ``MIN_SOLVE_S``, in
    which it returns its warm start (the best fitting rule) or better. None: no budget. Sizes are
    solved smallest first, so a larger budget only reaches the largest sizes: in the planner
    benchmark (``--quick``, 2026-12-02) 6 s gave the same plans, bar one within 0.1% either way
    (HiGHS under a time limit varies with the load), at ~2 s more per search."""


MIN_SOLVE_S = 0.1


@dataclass
class Candidate:
    name: str
    """``milp`` or a baseline name."""
    plan: Plan
    sim: SimResult

    @property
    def fits(self) -> bool:
        return self.sim.fits

    def row(self) -> dict[str, Any]:
        return {"name": self.name, "micro_batch_size": self.plan.micro_batch_size,
                "num_micro_batches": self.plan.num_micro_batches, "prefetch_depth": self.plan.prefetch_depth,
                "micro_batches_per_load": self.plan.micro_batches_per_load,
                "resident_layers": len(self.plan.resident_layers),
                **self.sim.summary()}


@dataclass
class SearchResult:
    plan: Plan
    """The emitted plan (fastest that fits in simulation)."""
    best: Candidate
    milp: MilpResult | None
    """The MILP solve at the emitted micro-batch size."""
    by_name: dict[str, Candidate]
    """Per rule (``milp`` and each baseline): its fastest fitting candidate over micro-batch sizes,
    all at the emitted plan's global batch (so their tokens/s compare like for like)."""
    unfit: dict[str, Candidate]
    """Per rule with no fitting candidate at that global batch: its least over-capacity one."""
    tried: list[dict[str, Any]]
    moments: list[str]
    """The emitted plan's optimizer moments per unit."""
    max_micro_batch_size: dict[str, int]
    """Per rule (``milp`` and each baseline): the largest micro-batch size tried that fits (0: none)."""
    solve_s: float
    """Seconds spent inside HiGHS, all micro-batch sizes together."""
    plan_s: float
    """Wall seconds of the whole search."""

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step of the emitted plan (and of every row in ``by_name``)."""
        return self.plan.micro_batch_size * self.plan.num_micro_batches


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


AUTO_MICRO_BATCHES = 4
"""Accumulation the auto mode compares micro-batch sizes at (then it picks its own)."""

Rules = dict[str, tuple[list[str], list[str] | None]]


@dataclass
class _Tally:
    """What the search has found so far, over micro-batch sizes and depths."""

    max_mbs: dict[str, int]
    """Per rule and ``milp``: the largest micro-batch size tried that fits (0: none)."""
    sims: Sims
    tried: list[dict[str, Any]] = field(default_factory=list)
    cands: list[Candidate] = field(default_factory=list)
    """Every candidate screened, fitting or not."""
    by_name: dict[str, Candidate] = field(default_factory=dict)
    """Per rule and ``milp``: its fastest fitting candidate."""
    all_fit: list[Candidate] = field(default_factory=list)
    milp_at: dict[tuple[int, int, int], MilpResult] = field(default_factory=dict)
    """(micro-batch size, prefetch depth, micro-batches per load) -> the MILP solve there."""
    solve_s: float = 0.0
    """HiGHS seconds so far (the budget's spending)."""
    smallest_failure: Candidate | None = None
    """The least device-hungry candidate of the first size at which nothing fits."""
    batch_note: str | None = None
    """Auto mode with optimizer state on NVMe: the global batch chosen for its traffic, and why."""

    def add(self, mbs: int, cands: list[Candidate]) -> bool:
        """Record the candidates of micro-batch size ``mbs``; whether any fits."""
        any_fit = False
        for c in cands:
            self.tried.append(c.row())
            self.cands.append(c)
            if c.fits:
                any_fit = True
                self.all_fit.append(c)
                self.max_mbs[c.name] = max(self.max_mbs.get(c.name, 0), mbs)
                cur = self.by_name.get(c.name)
                if cur is None or c.sim.tokens_per_s > cur.sim.tokens_per_s:
                    self.by_name[c.name] = c
        if not any_fit and self.smallest_failure is None:
            self.smallest_failure = min(cands, key=lambda x: x.sim.peak_device_bytes)
        return any_fit


def search(shape: ModelShape, hw: HardwareProfile, seq_len: int, config: SearchConfig | None = None) -> SearchResult:
    """The fastest plan that fits in simulation, over micro-batch sizes, prefetch depths, every
    rule and the MILP (see the module docstring); PlanInfeasible when nothing fits."""
    cfg = config or SearchConfig()
    t_start = time.perf_counter()
    depths = _depths(cfg, seq_len)
    # the store must fit with 8-bit moments at most, or with state on NVMe (bf16 gradients where
    # a plan may land them once): else say so now
    lands_once = cfg.per_loads is None or max(cfg.per_loads) > 1 or cfg.global_batch in _micro_batch_sizes(cfg)
    choose_state(shape, hw, bf16_grads=lands_once)
    auto = cfg.global_batch is None
    rules = fixed_rules(shape.num_layers)
    tally = _Tally(dict.fromkeys([*rules, "milp"], 0), Sims(shape, hw))
    order = []
    for mbs in _micro_batch_sizes(cfg):
        m_count = AUTO_MICRO_BATCHES if auto else cfg.global_batch // mbs  # type: ignore[operator]
        order += [(mbs, m_count, depth, per_load) for depth in depths for per_load in _per_loads(cfg, m_count)
                  if per_load == 1 or depth == depths[0]]  # layer-major: P computes hide each copy
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="highs") as highs:
        _explore(shape, hw, seq_len, cfg, rules, order, tally, highs)
    pool = tally.cands
    if auto:
        g = _auto_global_batch(tally, shape, hw, seq_len, cfg)
        pool = _at_global_batch(tally.cands, g, tally.sims)
        if _state_tiers(shape, hw, True) is not None:
            pool = _hiding_pool(pool, g, tally, shape, hw, seq_len)
    by_name, unfit = _fastest_per_rule(pool, tally, shape, hw, seq_len)
    if "milp" in by_name:
        by_name["milp"] = polish(by_name["milp"], [c for n, c in by_name.items() if n != "milp"],
                                 shape, hw, POLISH_MOVES, tally.sims)
    best = _fewest_on_nvme(_fastest(by_name), shape, hw, tally.sims)
    by_name[best.name] = best
    plan = best.plan
    plan.source = "milp" if best.name == "milp" else f"planner:{best.name}"
    res = _milp_solve_of(tally, plan)
    plan.predicted = _predicted(shape, hw, best, res, tally)
    return SearchResult(plan, best, res, by_name, unfit, tally.tried, plan.moments or ["fp32"] * len(shape.unit_names()),
                        dict(tally.max_mbs), tally.solve_s, time.perf_counter() - t_start)


def _fewest_on_nvme(best: Candidate, shape: ModelShape, hw: HardwareProfile, sims: Sims) -> Candidate:
    """``best`` with the fewest units' state on NVMe for what it holds in RAM beside its store (its
    state tiers were placed for the micro-batch count it was screened at: fp32 gradients where it
    landed more than once), if that fits and is not slower in simulation."""
    plan = best.plan
    if not plan.nvme_units(shape.unit_names()):
        return best
    try:
        moments, tiers = choose_state(shape, hw, best.sim.peak_pinned_act_bytes, plan.lands_once())
    except PlanInfeasible:
        return best
    resident_all = tiers is not None and any(tiers[1 + i] == "nvme-all" for i in plan.resident_layers)
    if _off_ram(tiers) >= _off_ram(plan.state_tiers) or resident_all:  # a resident layer stays so
        return best
    trial = Plan.from_dict({**plan.to_dict(), "moments": moments, "state_tiers": tiers})
    sim = sims.full(trial)
    return Candidate(best.name, trial, sim) if sim.fits and sim.tokens_per_s >= best.sim.tokens_per_s else best


def _off_ram(tiers: list[str] | None) -> tuple[int, int]:
    """(``nvme-all`` units, units off the RAM) of state tiers: fewer is less NVMe traffic."""
    tiers = tiers or []
    return tiers.count("nvme-all"), len(tiers) - tiers.count("ram")


def _milp_solve_of(tally: _Tally, plan: Plan) -> MilpResult | None:
    """The MILP solve at the plan's micro-batch size, depth and order (auto mode may have moved
    a layer-major plan to another group size than it was solved at)."""
    mbs, depth = plan.micro_batch_size, plan.prefetch_depth
    res = tally.milp_at.get((mbs, depth, plan.micro_batches_per_load))
    if res is None:
        res = next((r for (m, d, p), r in tally.milp_at.items()
                    if (m, d) == (mbs, depth) and (p > 1) == plan.layer_major), None)
    return res


def _depths(cfg: SearchConfig, seq_len: int) -> tuple[int, ...]:
    """The prefetch depths to try, after checking the config's sizes."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    if cfg.global_batch is not None and cfg.global_batch < 1:
        raise ValueError(f"global batch must be >= 1 sequence, got {cfg.global_batch}")
    depths = (cfg.prefetch_depth,) if cfg.prefetch_depth is not None else tuple(sorted(set(cfg.prefetch_depths)))
    if not depths or min(depths) < 1:
        raise ValueError(f"prefetch depths must be >= 1, got {depths}")
    return depths


def _micro_batch_sizes(cfg: SearchConfig) -> list[int]:
    """The given sizes, the divisors of the global batch, or (auto) powers of 2."""
    if cfg.micro_batch_sizes is not None:
        sizes = sorted(set(cfg.micro_batch_sizes))
    elif cfg.global_batch is None:
        sizes = [2**k for k in range(0, 20) if 2**k <= cfg.max_micro_batch_size]
    else:
        sizes = _divisors(cfg.global_batch)
    if cfg.global_batch is not None:
        bad = [m for m in sizes if cfg.global_batch % m]
        if bad:
            raise ValueError(f"micro-batch sizes {bad} do not divide the global batch {cfg.global_batch}")
    return sizes


def _per_loads(cfg: SearchConfig, m_count: int) -> list[int]:
    """The micro-batches per weight load to try at ``m_count`` micro-batches per step."""
    options = cfg.per_loads if cfg.per_loads is not None else (1, m_count)
    return sorted({p for p in options if 1 <= p <= m_count and m_count % p == 0} or {1})


def with_micro_batches(plan: Plan, m: int) -> Plan:
    """``plan`` at ``m`` micro-batches per step: layer-major over all of them stays so, another
    group size is kept where it divides ``m`` (else micro-batch-major)."""
    d = plan.to_dict()
    per = plan.micro_batches_per_load
    d["micro_batches_per_load"] = m if per == plan.num_micro_batches and per > 1 else (per if m % per == 0 else 1)
    d["num_micro_batches"] = m
    return Plan.from_dict(d)


def _explore(shape: ModelShape, hw: HardwareProfile, seq_len: int, cfg: SearchConfig, rules: Rules,
             order: list[tuple[int, int, int, int]], tally: _Tally, highs: ThreadPoolExecutor) -> None:
    """Each configuration of ``order`` in turn, into ``tally``, until a micro-batch size fits
    nothing. HiGHS releases the GIL, so the next configuration simulates while a MILP solves; the
    solves still run in order, so the result is what a sequential search finds."""
    cur = _prepare(shape, hw, seq_len, cfg, rules, *order[0], tally)
    solving = highs.submit(_solve, cfg, cur, tally.solve_s)
    cands: list[Candidate] = []  # of the current micro-batch size
    for k, (mbs, *_) in enumerate(order):
        last_of_size = k + 1 == len(order) or order[k + 1][0] != mbs
        nxt = _prepare(shape, hw, seq_len, cfg, rules, *order[k + 1], tally) if k + 1 < len(order) else None
        res = solving.result()
        tally.solve_s += res.solve_s
        milp = None
        if res.tiers is not None:
            res, milp = _milp_candidate(shape, hw, seq_len, cfg, cur.model, res, tally)
        tally.milp_at[cur.key] = res
        # nothing fits at this size (the polish fits where the MILP's plan or a rule does): stop
        stop = last_of_size and bool(tally.by_name) and not any(
            c.fits for c in [*cands, *cur.rules, *([milp] if milp else [])])
        if nxt is not None and not stop:
            solving = highs.submit(_solve, cfg, nxt, tally.solve_s)
        cands += cur.rules
        if milp is not None:
            cands.append(polish(milp, cur.rules, shape, hw, sims=tally.sims))
        if last_of_size:
            tally.add(mbs, cands)
            cands = []
            if stop:
                return  # larger micro-batches only need more memory
        cur = nxt  # type: ignore[assignment]


@dataclass
class _Config:
    """One (micro-batch size, depth, micro-batches per load) of the search, ready for its MILP."""

    key: tuple[int, int, int]
    model: StepModel
    rules: list[Candidate]
    """The rules simulated here (none in layer-major order)."""
    warm: Plan | None
    """The MILP's warm start."""


def _prepare(shape: ModelShape, hw: HardwareProfile, seq_len: int, cfg: SearchConfig, rules: Rules, mbs: int,
             m_count: int, depth: int, per_load: int, tally: _Tally) -> _Config:
    """Every rule at this (micro-batch size, depth, micro-batches per load) through the
    simulator, and the MILP's warm start: the fastest rule that fits both models. In
    layer-major order (a step is one long group, simulated in full) no rule is simulated: the
    MILP starts from the rule the step model finds fastest, and its plan is simulated."""
    kw = dict(micro_batch_size=mbs, num_micro_batches=m_count, seq_len=seq_len, prefetch_depth=depth,
              micro_batches_per_load=per_load)
    once = m_count <= per_load
    mbs_cost = CostModel(shape, hw, mbs, seq_len)
    model = StepModel(shape, hw, mbs, seq_len, m_count, depth, per_load=per_load, state_tiers=_state_tiers(shape, hw, once))
    plans = []
    for name, (tiers, internal) in rules.items():
        moments, state = rule_state(shape, hw, tiers, mbs_cost.boundary_bytes, internal, mbs_cost.layer_workspace_bytes,
                                    per_load, once)
        plan = Plan(list(tiers), internal_tiers=internal, source=name, moments=moments, state_tiers=state, **kw)
        ev = model.evaluate(plan.boundary_tiers, moments=moments, internal=plan.internal_tiers)
        plans.append((name, plan, ev))
    if per_load > 1:
        here: list[Candidate] = []
        feasible = [(ev.step_s, plan) for _, plan, ev in plans if ev.feasible]
        warm = min(feasible, key=lambda p: p[0])[1] if feasible else None
    else:
        here = [Candidate(name, plan, tally.sims.fast(plan)) for name, plan, _ in plans]
        fitting = [c for c, (_, _, ev) in zip(here, plans) if c.fits and ev.feasible]
        warm = max(fitting, key=lambda c: c.sim.tokens_per_s).plan if fitting else None
    return _Config((mbs, depth, per_load), model, here, warm)


def _state_tiers(shape: ModelShape, hw: HardwareProfile, lands_once: bool) -> list[str] | None:
    """The MILP's state tiers: the fewest units on NVMe with which the store alone fits (the
    boundaries it puts on the host get what is left); None where it fits in RAM or nothing does."""
    try:
        return choose_state(shape, hw, bf16_grads=lands_once)[1]
    except PlanInfeasible:
        return None


def _solve(cfg: SearchConfig, c: _Config, spent_s: float) -> MilpResult:
    """The MILP of ``c`` from its warm start, with what ``spent_s`` left of the budget."""
    w = c.warm
    return solve(c.model, _budgeted(cfg, spent_s), (w.source, w.boundary_tiers) if w else None,
                 w.moments if w else None, w.internal_tiers if w else None)


def _milp_candidate(shape: ModelShape, hw: HardwareProfile, seq_len: int, cfg: SearchConfig, model: StepModel,
                    res: MilpResult, tally: _Tally) -> tuple[MilpResult, Candidate]:
    """The MILP's plan in the simulator. The simulator sees what the linear model does not (a
    gradient still in flight, a fetch slot): if the plan overflows device or host memory there,
    solve once more with that overflow held back from the model's capacity."""
    plan = res.plan(model)
    cand = Candidate("milp", plan, tally.sims.fast(plan))
    over = cand.sim.over_capacity()
    if set(over) <= {"device", "host"} and over:
        model = StepModel(shape, hw, model.micro_batch_size, seq_len, model.num_micro_batches, model.prefetch_depth,
                          model.head_chunk_tokens, device_reserve_bytes=over.get("device", 0),
                          host_reserve_bytes=over.get("host", 0), per_load=model.per_load,
                          state_tiers=model.state_tiers)
        again = solve(model, _budgeted(cfg, tally.solve_s))
        tally.solve_s += again.solve_s
        if again.tiers is not None:
            res = again
            plan = res.plan(model)
            cand = Candidate("milp", plan, tally.sims.fast(plan))
    return res, cand


POLISH_MOVES = 8
"""Simulations the end-of-search polish spends at most (each tries a run of layers at once)."""


def polish(milp: Candidate, rules: list[Candidate], shape: ModelShape, hw: HardwareProfile,
           moves: int = 0, sims: Sims | None = None) -> Candidate:
    """The MILP's plan, polished in the simulator (which sees what the linear model does not):
    never slower than the fitting rule beside it. Up to ``moves`` runs of differing layers take the
    other plan's choices where screening finds that faster, kept if the full simulation agrees.
    ``sims``: the search's simulations (else its own)."""
    sims = sims or Sims(shape, hw)
    per = milp.plan.micro_batches_per_load
    fitting = [c for c in rules if c.fits and c.plan.micro_batches_per_load == per]
    if not fitting:
        return milp
    rule = max(fitting, key=lambda c: c.sim.tokens_per_s)
    if rule.sim.tokens_per_s > milp.sim.tokens_per_s or not milp.fits:
        best, other = rule, milp.plan
    else:
        best, other = milp, rule.plan
    # (field, unit offset)
    fields = (("boundary_tiers", 0), ("internal_tiers", 0), ("moments", 1), ("state_tiers", 1))
    theirs = {k: (o, getattr(other, k)) for k, o in fields if getattr(other, k) is not None}
    mine = best.plan.to_dict()
    diff = [i for i in range(shape.num_layers)
            if any(mine.get(k) is not None and mine[k][i + o] != t[i + o] for k, (o, t) in theirs.items())]
    size = -(-len(diff) // moves) if moves else 0
    runs = [diff[a:a + size] for a in range(0, len(diff), size)] if size else []
    start = best
    screened = sims.fast(best.plan) if extrapolated(best.plan) else best.sim
    for run in runs:
        d = best.plan.to_dict()
        for i in run:
            for k, (o, t) in theirs.items():
                if d.get(k) is not None:
                    d[k][i + o] = t[i + o]
        trial = Plan.from_dict(d)
        if any((trial.state_tiers or {}) and trial.state_tiers[1 + i] == "nvme-all" for i in trial.resident_layers):
            continue  # a resident layer's weights cannot come from NVMe
        result = sims.fast(trial)
        if result.fits and result.tokens_per_s > screened.tokens_per_s:
            best, screened = Candidate(best.name, trial, result), result
    if best is not start and extrapolated(best.plan):
        full = sims.full(best.plan)
        best = Candidate(best.name, best.plan, full) if (
            full.fits and full.tokens_per_s > start.sim.tokens_per_s) else start
    plan = Plan.from_dict({**best.plan.to_dict(), "source": "milp"})
    return Candidate("milp", plan, best.sim)


def _fastest(by_name: dict[str, Candidate]) -> Candidate:
    """The fastest candidate; the MILP's own plan on a tie (within rounding)."""
    best = max(by_name.values(), key=lambda c: (c.sim.tokens_per_s, c.name == "milp"))
    if "milp" in by_name and by_name["milp"].sim.tokens_per_s >= best.sim.tokens_per_s * (1 - 1e-9):
        best = by_name["milp"]
    return best


def _over_bytes(c: Candidate) -> int:
    return sum(c.sim.over_capacity().values())


def _fastest_per_rule(pool: list[Candidate], tally: _Tally, shape: ModelShape, hw: HardwareProfile,
                      seq_len: int) -> tuple[dict[str, Candidate], dict[str, Candidate]]:
    """Per rule, its fastest candidate of ``pool`` that fits when simulated in full (screening
    may have extrapolated); the least over-capacity one of each rule with none that fits.
    PlanInfeasible when no rule fits."""
    by_name: dict[str, Candidate] = {}
    unfit: dict[str, Candidate] = {}
    for name in dict.fromkeys(c.name for c in pool):
        mine = [c for c in pool if c.name == name]
        for c in sorted((c for c in mine if c.fits), key=lambda c: -c.sim.tokens_per_s)[:3]:
            full = Candidate(name, c.plan, tally.sims.full(c.plan)) if extrapolated(c.plan) else c
            if full.fits:
                by_name[name] = full
                break
            mine.append(full)
        if name not in by_name:
            unfit[name] = min((c for c in mine if not c.fits), key=_over_bytes)
    if not by_name:
        raise infeasible(shape, hw, seq_len, tally.smallest_failure)
    return by_name, unfit


AT_BATCH_PER_RULE = 2
"""Auto mode: per rule, how many of its fastest screened candidates are simulated again at the
chosen global batch (each costs a simulation; the fastest at 4 micro-batches rarely loses)."""


def _at_global_batch(cands: list[Candidate], global_batch: int, sims: Sims, groups: bool = False) -> list[Candidate]:
    """Auto mode: screened candidates whose micro-batch size divides ``global_batch``, accumulation
    set to match; per rule the ``AT_BATCH_PER_RULE`` fastest that fit (or its least over-capacity)
    simulated again. ``groups``: layer-major ones in more groups, not larger ones."""
    out: list[Candidate] = []
    for name in dict.fromkeys(c.name for c in cands):
        mine = [c for c in cands if c.name == name and global_batch % c.plan.micro_batch_size == 0
                and (not groups or (c.plan.layer_major
                                    and global_batch // c.plan.micro_batch_size % c.plan.micro_batches_per_load == 0))]
        if not mine:
            continue
        fit = sorted((c for c in mine if c.fits), key=lambda c: -c.sim.tokens_per_s)[:AT_BATCH_PER_RULE]
        for c in fit or [min(mine, key=_over_bytes)]:
            m = global_batch // c.plan.micro_batch_size
            if m == c.plan.num_micro_batches:
                out.append(c)
                continue
            plan = with_micro_batches(c.plan, m)
            if groups:  # its gradients now land once per group (fp32): the state placed again
                plan = _regrouped(plan, c, sims)
                if plan is None:
                    continue
            out.append(Candidate(name, plan, sims.fast(plan)))
    return out


def _regrouped(plan: Plan, c: Candidate, sims: Sims) -> Plan | None:
    """``plan`` in groups of ``c``'s micro-batches per load, with the state tiers its store and
    host-tier activations need (None: none fit); resident layers going ``nvme-all`` are streamed."""
    d = {**plan.to_dict(), "micro_batches_per_load": c.plan.micro_batches_per_load}
    try:
        moments, tiers = choose_state(sims.shape, sims.hw, c.sim.peak_pinned_act_bytes,
                                      Plan.from_dict(d).lands_once())
    except PlanInfeasible:
        return None
    resident = [i for i in plan.resident_layers if tiers is None or tiers[1 + i] != "nvme-all"]
    return Plan.from_dict({**d, "moments": moments, "state_tiers": tiers, "resident_layers": resident})


def _auto_global_batch(tally: _Tally, shape: ModelShape, hw: HardwareProfile, seq_len: int,
                       cfg: SearchConfig) -> int:
    """Auto mode: the global batch of the smallest micro-batch within tolerance of the best
    tokens/s, then the smallest accumulation within tolerance."""
    by_name, _ = _fastest_per_rule(tally.cands, tally, shape, hw, seq_len)
    top = _fastest(by_name).sim.tokens_per_s
    pool = [c for c in tally.all_fit if c.sim.tokens_per_s >= top * (1 - cfg.auto_tolerance)]
    pick = min(pool, key=lambda c: (c.plan.micro_batch_size, c.name != "milp", -c.sim.tokens_per_s))
    best = _pick_accumulation(pick, tally.sims, cfg)
    return best.plan.micro_batch_size * best.plan.num_micro_batches


def _hiding_pool(pool: list[Candidate], g: int, tally: _Tally, shape: ModelShape, hw: HardwareProfile,
                 seq_len: int) -> list[Candidate]:
    """Auto mode with state on NVMe: the candidates at the smallest global batch from ``g`` at which
    a fitting plan hides its NVMe traffic, else ``pool``; says which in ``tally.batch_note``."""
    best = _fastest(_fastest_per_rule(pool, tally, shape, hw, seq_len)[0])
    fig = nvme_state(shape, hw, best.plan, best.sim)
    if fig is None:
        return pool
    every = "nvme-all" in (best.plan.state_tiers or ())
    estimate = hiding_batch(shape, hw, best.plan, best.sim)
    for g2 in sorted({b for b in (g, estimate, *(g * 2**k for k in range(1, 12))) if b and g <= b <= MAX_HIDING_BATCH}):
        here = pool if g2 == g else _at_global_batch(tally.cands, g2, tally.sims)
        if every:  # each group copies the weights: more groups of the same size, not a larger one
            here = here + _at_global_batch(tally.cands, g2, tally.sims, groups=True)
        fitting = [c for c in here if c.fits]
        if not fitting:
            break  # a larger batch (one landing per step: one group) only needs more memory
        hiding = [c for c in fitting if _hidden(shape, hw, c)]
        if hiding:
            tally.batch_note = (f"global batch {g2}{f' (not {g})' if g2 != g else ''}: the NVMe traffic of the "
                                f"optimizer state hides behind the compute (<= {HIDE_FRACTION:.0%} of it, the step "
                                f"within {STEP_SLACK:.0%} of it)")
            return hiding
    tally.batch_note = (f"global batch {g}: no batch that fits (up to {MAX_HIDING_BATCH} sequences) hides the "
                        f"NVMe traffic of the optimizer state")
    return pool


def _hidden(shape: ModelShape, hw: HardwareProfile, c: Candidate) -> bool:
    """``c``'s NVMe traffic hides behind its compute and its step is compute-bound."""
    fig = nvme_state(shape, hw, c.plan, c.sim)
    return fig is None or (fig.hides and fig.compute_bound)


def _predicted(shape: ModelShape, hw: HardwareProfile, best: Candidate, res: MilpResult | None,
               tally: _Tally) -> dict[str, Any]:
    """What the emitted plan says of itself (``plan.predicted``)."""
    plan, s = best.plan, best.sim
    return {
        "model": shape.name,
        "hardware": hw.name,
        "step_s": s.step_s,
        "tokens_per_s": s.tokens_per_s,
        "achieved_tflops": s.achieved_tflops,
        "peak_device_bytes": s.peak_device_bytes,
        "device_cap_bytes": s.device_cap_bytes,
        "peak_host_bytes": s.peak_host_bytes,
        "milp_objective_s": res.objective_s if res else None,
        "milp_bound_s": res.bound_s if res else None,
        "milp_gap": res.gap if res else None,
        "solve_s": tally.solve_s,
        "prefetch_depth": plan.prefetch_depth,
        "micro_batches_per_load": plan.micro_batches_per_load,
        "resident_layers": list(plan.resident_layers),
        "moments_8bit_units": (plan.moments or []).count("8bit"),
        "nvme_state": _nvme_row(shape, hw, best, tally),
        # per rule, the largest micro-batch size tried (up to the largest that fits any) that fits
        "max_micro_batch_size": dict(tally.max_mbs),
    }


def _nvme_row(shape: ModelShape, hw: HardwareProfile, best: Candidate, tally: _Tally) -> dict[str, Any] | None:
    """The emitted plan's optimizer state on NVMe and its traffic (None: all in RAM)."""
    fig = nvme_state(shape, hw, best.plan, best.sim)
    return None if fig is None else {**fig.row(), "batch": tally.batch_note or "the global batch was given"}


def _budgeted(cfg: SearchConfig, spent_s: float) -> MilpConfig:
    """``cfg.milp`` with its time limit cut to what is left of the search's budget."""
    milp = replace(cfg.milp, resident=cfg.milp.resident or cfg.resident)
    if cfg.milp_budget_s is None:
        return milp
    left_s = max(MIN_SOLVE_S, cfg.milp_budget_s - spent_s)
    return milp if left_s >= milp.time_limit_s else replace(milp, time_limit_s=left_s)


def _pick_accumulation(best: Candidate, sims: Sims, cfg: SearchConfig) -> Candidate:
    """Auto mode: the smallest accumulation count within tolerance of the best tokens/s."""
    options = []
    for m in cfg.auto_num_micro_batches:
        plan = with_micro_batches(best.plan, m)
        options.append(Candidate(best.name, plan, sims.fast(plan)))
    options = [o for o in options if o.fits] or [best]
    top = max(o.sim.tokens_per_s for o in options)
    return min((o for o in options if o.sim.tokens_per_s >= top * (1 - cfg.auto_tolerance)),
               key=lambda o: o.plan.num_micro_batches)


