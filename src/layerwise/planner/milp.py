"""The MILP: each boundary's and internals' tier (or recompute) and each unit's moments, solved
once before training with HiGHS (``docs/planner.md``, "MILP").

Each window lasts as long as its slowest resource, so a transfer inside its window's compute
costs nothing. Here: :func:`solve` as named steps (presolve, then build, seed, run, read back)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from .formulation import ALL_INTERNAL_TIERS, ALL_TIERS, MS, Formulation, build
from ..plan.plan import Plan
from .step_model import NVME_STAGING, StepModel

__all__ = ["MilpConfig", "MilpResult", "NVME_STAGING", "StepModel", "solve"]


@dataclass
class MilpConfig:
    time_limit_s: float = 5.0
    """Wall-clock limit for HiGHS; the incumbent is used when it runs out."""
    mip_rel_gap: float = 1e-3
    """Stop when (incumbent - bound) / incumbent is below this."""
    tiers: tuple[str, ...] = ALL_TIERS
    """Tiers a boundary may take (e.g. ("device", "host") for the DP cross-check)."""
    internal_tiers: tuple[str, ...] = ALL_INTERNAL_TIERS
    """Tiers a layer's internals may take (("recompute",): boundaries only)."""
    include_optimizer_stall: bool = True
    """Model the next forward waiting for the host optimizer (couples the forward windows)."""
    threads: int = 1
    """HiGHS threads (the machines this runs on are often shared)."""
    choose_moments: bool = True
    """Let the MILP pick each unit's optimizer moments (8-bit frees host memory for offloaded
    boundaries, fp32 keeps the optimizer faster); False keeps the model's ``moments``."""
    resident: bool = False
    """Let the MILP keep layers' weights on the device (no weight copies in their windows, one
    refresh per step) where device memory allows, jointly with the activation tiers."""

    def validated(self) -> MilpConfig:
        """This config, or a ValueError naming the tier set that is wrong."""
        if not self.tiers or set(self.tiers) - set(ALL_TIERS):
            raise ValueError(f"MilpConfig.tiers must be a non-empty subset of {ALL_TIERS}, got {self.tiers}")
        if not self.internal_tiers or set(self.internal_tiers) - set(ALL_INTERNAL_TIERS):
            raise ValueError(f"MilpConfig.internal_tiers must be a non-empty subset of {ALL_INTERNAL_TIERS}, "
                             f"got {self.internal_tiers}")
        return self

    @property
    def joint(self) -> bool:
        """Whether layer internals may be kept: the solve then runs the boundaries first."""
        return "recompute" in self.internal_tiers and len(self.internal_tiers) > 1


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
    resident_layers: list[int] | None = None
    """Layers whose weights stay on the device."""

    def plan(self, model: StepModel, **kw: Any) -> Plan:
        assert self.tiers is not None
        return Plan(list(self.tiers), internal_tiers=self.internal_tiers, micro_batch_size=model.micro_batch_size,
                    num_micro_batches=model.num_micro_batches, seq_len=model.seq_len,
                    prefetch_depth=model.prefetch_depth, head_chunk_tokens=model.head_chunk_tokens,
                    micro_batches_per_load=model.per_load, resident_layers=list(self.resident_layers or []),
                    moments=self.moments, state_tiers=model.state_tiers, source="milp", **kw)


@dataclass(frozen=True)
class Start:
    """An assignment to seed HiGHS with: ``moments`` None = the model's, ``internal`` None = every
    layer recomputes its internals."""

    name: str
    tiers: list[str]
    moments: list[str] | None = None
    internal: list[str] | None = None
    resident: list[int] | None = None

    def moments_for(self, model: StepModel, cfg: MilpConfig) -> list[str]:
        """The moments the start runs with: its own when the MILP chooses them, else the model's."""
        if cfg.choose_moments and self.moments is not None:
            return self.moments
        return model.moments or ["fp32"] * len(model.units)


def solve(model: StepModel, config: MilpConfig | None = None,
          warm_start: tuple[str, list[str]] | None = None,
          warm_moments: list[str] | None = None, warm_internal: list[str] | None = None) -> MilpResult:
    """Build and solve the MILP for ``model``; ``warm_start`` = (name, tiers), with
    ``warm_moments`` (default: the model's) and ``warm_internal`` (default: all recompute),
    seeds the search. One call's ``time_limit_s`` covers all its stages."""
    cfg = (config or MilpConfig()).validated()
    start = None if warm_start is None else Start(*warm_start, warm_moments, warm_internal)
    spent_s = 0.0
    if cfg.joint:
        start, spent_s = boundaries_first(model, cfg, start)
    # what the boundary stage left, and at least a tenth of the limit (in which HiGHS returns
    # its start or better)
    res = _stage(model, cfg, start, max(cfg.time_limit_s - spent_s, 0.1 * cfg.time_limit_s))
    res.solve_s += spent_s
    return res


def boundaries_first(model: StepModel, cfg: MilpConfig, given: Start | None) -> tuple[Start | None, float]:
    """Solve with every layer's internals recomputed (its LP relaxation is tight), and return the
    better of that and ``given`` as the joint model's start, with the HiGHS seconds spent. Cold, the
    joint model can stall (qwen-27b, h800: 26% gap after 2 s; from this start: optimal in 0.75 s).
    """
    plain = given is not None and (given.internal is None or set(given.internal) == {"recompute"})
    first = _stage(model, replace(cfg, internal_tiers=("recompute",)), given if plain else None, cfg.time_limit_s)
    given_s = None
    if given is not None and len(given.tiers) == model.L:
        ev = model.evaluate(given.tiers, cfg.include_optimizer_stall, given.moments_for(model, cfg),
                            given.internal, given.resident)
        given_s = ev.step_s if ev.feasible else None
    if first.tiers is not None and (given_s is None or first.objective_s < given_s):
        # named after the start it came from, if any: the boundary solve began there
        name = given.name if given is not None else "boundaries"
        return Start(name, first.tiers, first.moments, resident=first.resident_layers), first.solve_s
    return given, first.solve_s


def _stage(model: StepModel, cfg: MilpConfig, start: Start | None, time_limit_s: float) -> MilpResult:
    """One HiGHS solve of the formulation under ``cfg``, from ``start`` if it is feasible. When
    HiGHS hands back a vector that does not match its objective (seen with a user solution),
    the same model is solved again without the start."""
    import highspy

    form = build(model, cfg)
    lp = form.lp(highspy)
    res, run_s = _run(highspy, lp, form, model, cfg, start, time_limit_s)
    if res is None:
        res, _ = _run(highspy, lp, form, model, cfg, None, time_limit_s)
        assert res is not None  # a cold run raises on a mismatch instead
        res.solve_s += run_s
    return res


def _run(highspy: Any, lp: Any, form: Formulation, model: StepModel, cfg: MilpConfig, start: Start | None,
         time_limit_s: float) -> tuple[MilpResult | None, float]:
    """One HiGHS run: (its result, None on a mismatch after a warm start; its seconds)."""
    h = _quiet_highs(highspy)
    h.setOptionValue("time_limit", time_limit_s)
    h.setOptionValue("mip_rel_gap", float(cfg.mip_rel_gap))
    h.setOptionValue("threads", int(cfg.threads))
    h.setOptionValue("random_seed", 0)
    h.passModel(lp)
    seeded = _seed(h, highspy, form, model, cfg, start)
    t0 = time.perf_counter()
    h.run()
    solve_s = time.perf_counter() - t0
    return _answer(h, form, model, cfg, solve_s, seeded.name if seeded else None), solve_s


def _seed(h: Any, highspy: Any, form: Formulation, model: StepModel, cfg: MilpConfig,
          start: Start | None) -> Start | None:
    """Pass ``start`` to HiGHS as a complete solution if the step model finds it feasible and the
    config allows its tiers; returns the start used (None: a cold solve)."""
    if start is None or len(start.tiers) != model.L:
        return None
    moments, internal = start.moments_for(model, cfg), start.internal or ["recompute"] * model.L
    ev = model.evaluate(start.tiers, cfg.include_optimizer_stall, moments, internal, start.resident)
    if not (ev.feasible and all(t in cfg.tiers for t in start.tiers)
            and all(mom == "8bit" for mom, nv in zip(moments, model.on_nvme) if nv)
            and all(t in cfg.internal_tiers for t in internal) and (cfg.resident or not start.resident)):
        return None
    sol = highspy.HighsSolution()
    sol.col_value = form.start_vector(ev, start.tiers, internal, moments)
    sol.value_valid = True
    h.setSolution(sol)
    # With presolve on, HiGHS 1.16 can report the improved objective but hand back the user's
    # solution vector; solving the full model avoids that.
    h.setOptionValue("presolve", "off")
    return start


def _answer(h: Any, form: Formulation, model: StepModel, cfg: MilpConfig, solve_s: float,
            seeded: str | None) -> MilpResult | None:
    """The solution as a result (step time without the tie-breaks); None when HiGHS's vector
    does not match its objective after a warm start (the caller then solves cold)."""
    status = h.modelStatusToString(h.getModelStatus())
    info = h.getInfo()
    if info.primal_solution_status != 2:  # 2 = feasible
        return MilpResult(None, float("inf"), float("inf"), float("inf"), status, solve_s, seeded)
    x = list(h.getSolution().col_value)
    tiers, internal, moments = form.decode(x, cfg)
    resident = form.decode_resident(x)
    obj = info.objective_function_value / MS
    x_obj = sum(c * v for c, v in zip(form.cols.cost, x)) / MS + model.const_s()
    ties = sum(form.cols.cost[c] * x[c] for c in form.ties) / MS
    if abs(x_obj - obj) > 1e-6 * max(1.0, abs(obj)):
        if seeded is not None:
            return None
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
        step_s = min(step_s, model.evaluate(tiers, cfg.include_optimizer_stall, moments, internal, resident).step_s)
    return MilpResult(tiers, step_s, min(bound - ties, step_s), gap, status, solve_s, seeded,
                      moments if cfg.choose_moments or model.moments is not None else None, internal, resident)


def _quiet_highs(highspy: Any) -> Any:
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
        finally:
            os.dup2(saved, 1)
            os.close(saved)
            os.close(devnull)
    h.setOptionValue("output_flag", False)
    return h
