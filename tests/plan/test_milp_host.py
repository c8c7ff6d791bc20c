"""The MILP's host capacity, its per-unit 8-bit choice, the prefetch depth the search tries and the
largest micro-batch per rule it reports."""

from dataclasses import replace

import pytest

from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS

WORKSTATION_GB = 512
"""Host RAM these cases are about (a large workstation): what binds is the device, not the host."""
from layerwise.planner.milp import NVME_STAGING, MilpConfig, StepModel, solve
from layerwise.plan.plan import Plan
from layerwise.planner.search import SearchConfig, choose_moments, search
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate
from layerwise.store import StoreFootprint

BOUNDARIES_ONLY = MilpConfig(internal_tiers=("recompute",))
"""The MILP without the internals tier (every layer recomputes its internals)."""


@pytest.fixture(scope="module")
def tight():
    """qwen-27b on an h800 with 512 GB of host RAM less what the split master saves (the store
    these figures were sized on kept an fp32 master beside the bf16 copy): the fp32 store does
    not fit, the store with the fewest 8-bit units leaves ~0.2 GB, less than two 16 x 1024-token
    boundaries. The host rates and the 64 GB host reserve are the scenario's own (a fast host:
    the refresh nearly free, 8-bit at 0.8x fp32), so what is tested is the trade between 8-bit
    moments and host boundaries, not a preset's figures."""
    shape = load_shape("qwen-27b")
    numels = [shape.unit_params(u) for u in shape.unit_names()]
    saved = (StoreFootprint.of_numels(numels, 2, split_master=False).total
             - StoreFootprint.of_numels(numels, 2).total)
    hw = replace(PRESETS["h800"], optimizer_8bit_params_per_s=4e9, host_accum_bf16_gbps=150.0,
                 pinned_copy_gbps=1e4, host_reserved_bytes=64 * 10**9).with_memory(gpu_mem_gb=70, host_mem_gb=512 - saved / 1e9)
    return shape, hw, choose_moments(shape, hw)


def test_milp_is_feasible_when_host_memory_is_tight_and_no_boundary_is_offloaded(tight):
    """Every-1 fits this machine at micro-batch 16 (no boundary on the host, none on NVMe), so
    the MILP must find a plan too.

    Mutation seen caught: NVMe staging charged whatever the tiers (``max_host`` minus 2, the old
    code): the MILP is then infeasible from micro-batch 16 up."""
    shape, hw, moments = tight
    model = StepModel(shape, hw, 16, 1024, 4, moments=moments)
    every1 = Plan.every_k(shape.num_layers, 1, micro_batch_size=16, num_micro_batches=4, seq_len=1024,
                          moments=moments)
    assert simulate(every1, shape, hw, keep_trace=False).fits
    assert model.evaluate(every1.boundary_tiers).feasible
    r = solve(model, MilpConfig(choose_moments=False))
    assert r.tiers is not None, r.status
    sim = simulate(r.plan(model), shape, hw, keep_trace=False)
    assert sim.fits, sim.over_capacity()


def test_nvme_staging_is_charged_only_with_an_nvme_boundary(tight):
    """The ~0.2 GB the store leaves holds one 16 x 1024 boundary but not the two NVMe staging
    buffers the model reserves: one boundary on the host fits, one on NVMe does not. (The
    reserve is conservative: with a single NVMe boundary the simulator's write buffer and read
    staging never overlap, so it fits there; with several, writes queue behind each other.)

    Mutation seen caught: staging dropped from ``evaluate`` (the NVMe assignment then passes)."""
    shape, hw, moments = tight
    # two micro-batches: the gradients are summed on the host, so the store keeps them in fp32
    model = StepModel(shape, hw, 16, 1024, 2, moments=moments)
    assert 1 <= model.host_budget / model.a_bytes < NVME_STAGING
    one = ["device"] * shape.num_layers
    for tier, fits in (("host", True), ("nvme", False)):
        tiers = list(one)
        tiers[5] = tier
        assert model.evaluate(tiers).feasible is fits, tier
    plan = Plan(one[:5] + ["host"] + one[6:], micro_batch_size=16, num_micro_batches=2, seq_len=1024,
                moments=moments)
    assert simulate(plan, shape, hw, keep_trace=False).fits


def test_milp_switches_units_to_8bit_to_offload_boundaries(tight):
    """Device memory for 53 of 64 boundaries at micro-batch 64, host memory for none beside the
    minimal-8-bit store: the MILP puts more units in 8-bit to hold the rest on the host, rather
    than recompute them, and its plan fits in the simulator and matches its model's step.
    (Boundaries only: the internals stay recomputed, so the trade is the one between 8-bit
    moments and host boundaries.)

    Mutations seen caught: 8-bit savings left out of the host row (the MILP then recomputes, and
    its step is slower than this plan's); the moments of the result ignored (the plan then
    overflows host memory in the simulator)."""
    shape, hw, moments = tight
    model = StepModel(shape, hw, 64, 1024, 4)
    fixed = StepModel(shape, hw, 64, 1024, 4, moments=moments)
    r = solve(model, BOUNDARIES_ONLY)
    r_fixed = solve(fixed, MilpConfig(choose_moments=False, internal_tiers=("recompute",)))
    assert r.tiers is not None and r_fixed.tiers is not None
    assert r.tiers.count("host") > 1 and "recompute" not in r.tiers
    assert r.moments.count("8bit") > moments.count("8bit")
    assert r.objective_s < r_fixed.objective_s * (1 - 1e-3)
    ev = model.evaluate(r.tiers, moments=r.moments)
    assert ev.feasible and ev.step_s == pytest.approx(r.objective_s, rel=1e-6)
    assert r.plan(model).moments == r.moments
    cm = CostModel(shape, hw, 64, 1024)
    assert cm.host_store_bytes(r.moments) + r.tiers.count("host") * cm.boundary_bytes <= hw.host_cap_bytes
    # through the search (which re-solves once with the simulator's overflow held back): the
    # MILP's plan (polished in the simulator) fits, is emitted, and is as fast as every rule of
    # its space (internals recomputed) at
    # this micro-batch size (micro-batch-major, every layer streamed: the trade under test is
    # moments against boundaries; keep-all-host also keeps internals, outside BOUNDARIES_ONLY)
    res = search(shape, hw, 1024, SearchConfig(global_batch=256, micro_batch_sizes=(64,), prefetch_depth=1,
                                               milp=BOUNDARIES_ONLY, per_loads=(1,), resident=False))
    milp = res.by_name["milp"]
    assert milp.sim.fits and milp.plan.moments.count("8bit") > moments.count("8bit")
    assert milp.plan.boundary_tiers.count("host") >= 1
    rules = [c for n, c in res.by_name.items()
             if n != "milp" and set(c.plan.internal_tiers) == {"recompute"}]
    assert rules and all(milp.sim.tokens_per_s >= c.sim.tokens_per_s for c in rules)


def test_milp_keeps_fp32_moments_when_host_memory_is_plentiful():
    """When the store fits with room to spare every unit stays fp32, even when the solver is
    seeded with 8-bit everywhere: on the presets' bus-bound host 8-bit prices faster (the step
    12% shorter here), below ``QUALITY_8BIT``'s 20% of its lower bound.

    Mutations seen caught: the tie-break cost on 8-bit removed (HiGHS then keeps the seed's 8-bit
    units, which the optimizer's overlap with the forward makes free in time: with the old
    preset rates, 8-bit slower); ``QUALITY_8BIT`` at 0 (the MILP keeps 8-bit on all 29 units)."""
    shape = load_shape("qwen2.5-7b")
    model = StepModel(shape, PRESETS["h800"], 1, 4096, 4)
    units = len(shape.unit_names())
    assert model.evaluate(["device"] * shape.num_layers, moments=["8bit"] * units).feasible
    r = solve(model, warm_start=("keep-all-device", ["device"] * shape.num_layers), warm_moments=["8bit"] * units)
    assert r.warm_start == "keep-all-device"
    assert r.moments == ["fp32"] * units


def test_search_tries_prefetch_depths_and_reports_max_micro_batch_per_rule():
    """The emitted plan is at least as fast as the best plan at each fixed depth (both depths
    are tried: depth 2 won here before the rules that keep internals, which win at depth 1); and
    the largest micro-batch that fits is reported per rule, consistent with what each rule fits
    in the simulator.

    Mutation seen caught: the search ignoring ``prefetch_depths`` (always depth 1)."""
    shape = load_shape("qwen2.5-3b")
    hw = PRESETS["rtx3090"].with_memory(host_mem_gb=90)
    auto = search(shape, hw, 4096, SearchConfig(global_batch=4, milp=BOUNDARIES_ONLY))
    fixed = {d: search(shape, hw, 4096, SearchConfig(global_batch=4, prefetch_depth=d, milp=BOUNDARIES_ONLY))
             for d in (1, 2)}
    best = max(fixed.values(), key=lambda r: r.best.sim.tokens_per_s)
    assert auto.best.sim.tokens_per_s >= best.best.sim.tokens_per_s * (1 - 1e-9)
    assert auto.plan.prefetch_depth == best.plan.prefetch_depth == auto.plan.predicted["prefetch_depth"]
    assert {row["prefetch_depth"] for row in auto.tried} == {1, 2}
    mx = auto.plan.predicted["max_micro_batch_size"]
    assert set(mx) >= {"every-1", "every-4", "keep-all-device", "recompute-all", "milp"}
    assert all(0 <= v <= 4 for v in mx.values())  # 0: the rule fits at no size tried
    assert all(mx[r] >= 1 for r in ("every-1", "every-4", "keep-all-device", "recompute-all", "milp"))
    # 12 GB of device memory: the rules stop fitting at different sizes (tried: 1, 2, 4, 8)
    small = PRESETS["rtx3090"].with_memory(gpu_mem_gb=12, host_mem_gb=WORKSTATION_GB)
    shape7 = load_shape("qwen2.5-7b")
    res = search(shape7, small, 4096, SearchConfig(global_batch=8))
    mx = res.max_micro_batch_size
    assert mx["keep-all-device"] == 0 and mx["every-2"] == 1 and mx["every-4"] == 2, mx
    tiers = {"keep-all-device": ["device"] * 28, "every-2": Plan.every_k(28, 2).boundary_tiers,
             "every-4": Plan.every_k(28, 4).boundary_tiers}
    for name, t in tiers.items():
        for mbs in (1, 2, 4):
            plan = Plan(t, micro_batch_size=mbs, num_micro_batches=8 // mbs, seq_len=4096)
            assert simulate(plan, shape7, small, keep_trace=False).fits is (mbs <= mx[name]), (name, mbs)


def test_a_milp_plan_over_capacity_in_the_simulator_is_solved_again():
    """qwen2.5-14b on a 24 GB rtx3090 at 8 x 4096 tokens: the linear model's plan overflows the
    simulated device by ~2.3 GB (the head's fp32 gradient still being copied out while the top
    layer's backward runs); the search re-solves with that much held back and its plan fits.

    Mutation seen caught: the re-solve removed (the MILP then has no fitting plan here).
    (Boundaries only: with kept internals the MILP's plan fits here at once.)"""
    shape = load_shape("qwen2.5-14b")
    hw = PRESETS["rtx3090"].with_memory(host_mem_gb=WORKSTATION_GB)
    model = StepModel(shape, hw, 8, 4096, 4)
    r = solve(model, BOUNDARIES_ONLY)
    assert simulate(r.plan(model), shape, hw, keep_trace=False).over_capacity().get("device", 0) > 0
    res = search(shape, hw, 4096, SearchConfig(global_batch=32, micro_batch_sizes=(8,), prefetch_depth=1,
                                               milp=BOUNDARIES_ONLY))
    milp = res.by_name["milp"]
    assert milp.sim.fits and milp.plan.micro_batch_size == 8
    best_rule = max(c.sim.tokens_per_s for n, c in res.by_name.items()
                    if n != "milp" and not n.startswith("internals-"))  # the rules it can express
    assert milp.sim.tokens_per_s >= best_rule * (1 - 1e-9)
