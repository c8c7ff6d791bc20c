"""Weights and gradients on NVMe too (``Plan.state_tiers`` ``nvme-all``): where the planner puts
units there, what a step moves for them, what the simulator and the step model charge, and what
``layerwise plan`` says.

The shape throughout: qwen2.5-7b on an h200 with 28 GB of RAM. Its bf16 copy source and
gradients (~30 GB) alone are over the RAM, so every unit's state on NVMe is not enough."""

from collections import Counter
from dataclasses import replace

import pytest

from layerwise.plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS, Plan
from layerwise.plan.shape import load_shape
from layerwise.planner.cost import CostModel
from layerwise.planner.host_fit import PlanInfeasible, choose_state
from layerwise.planner.presets import PRESETS
from layerwise.planner.report import nvme_state_line
from layerwise.planner.search import SearchConfig, search
from layerwise.planner.simulator import simulate
from layerwise.planner.state_traffic import nvme_state, store_traffic
from layerwise.planner.step_model import StepModel
from layerwise.planner.unit_copies import plan_grad_landings, weight_copies

SEQ = 1024
QUICK = dict(micro_batch_sizes=(8,), prefetch_depth=1, milp_budget_s=1.0)


def _hw(ram_gb: float):
    shape = load_shape("qwen2.5-7b")
    hw = PRESETS["h200"].with_memory(host_mem_gb=ram_gb)
    return shape, hw.for_model(max(shape.unit_params(u) for u in shape.unit_names()[1:-1]) * 2)


@pytest.fixture(scope="module")
def tight():
    """The search's plan for 28 GB of RAM, one step of 8 x 1024 tokens."""
    shape, hw = _hw(28)
    return shape, hw, search(shape, hw, SEQ, SearchConfig(global_batch=8, **QUICK))


def test_weights_over_the_ram_go_nvme_all_and_fit(tight):
    """The emitted plan has ``nvme-all`` units, fits in simulation, and its host store is the RAM
    store less those units' state, copy source and gradient (and the ``nvme`` units' state) plus
    the staging slots of the three kinds; ``choose_state`` moves the fewest units there: one
    fewer (back to ``nvme``) is over the RAM.

    Mutations seen failing: the source slots left out of ``CostModel.staging_bytes`` (the store
    differs from its parts); ``_fewest_all`` taking every unit (one fewer still fits)."""
    shape, hw, res = tight
    plan, sim = res.plan, res.best.sim
    units = shape.unit_names()
    full = plan.nvme_units(units, source=True)
    assert full and sim.fits and not set(plan.resident_layers) & {int(u.split(".")[1]) for u in full if "." in u}
    cost = CostModel(shape, hw, 1, 1)
    bf16 = plan.lands_once()
    off = plan.nvme_units(units)
    state = [cost.unit_state_bytes(u) for u in off]
    src = [cost.unit_source_bytes(u) for u in full]
    grad = [cost.unit_grad_store_bytes(u, bf16) for u in full]
    assert src[0] == 2 * shape.trainable_params(full[0])  # bf16 weights, 2 B/param
    parts = (cost.store_footprint(plan.moments, bf16).total - sum(state) - sum(src) - sum(grad)
             + NVME_STATE_SLOTS * max(state) + NVME_SOURCE_SLOTS * max(src) + NVME_GRAD_SLOTS * max(grad))
    assert abs(sim.host_store_bytes - parts) < 256 * len(units)  # the arena's padding aside
    assert sim.host_store_bytes == cost.host_store_bytes(plan.moments, bf16, plan.state_tiers) <= hw.host_cap_bytes
    assert sim.peak_nvme_bytes >= sum(state) + sum(src) + sum(grad)
    moments, tiers = choose_state(shape, hw, bf16_grads=True)
    fewer = list(tiers)
    fewer[fewer.index("nvme-all")] = "nvme"
    assert cost.host_store_bytes(moments, True, fewer) > hw.host_cap_bytes >= cost.host_store_bytes(
        moments, True, tiers)


def test_a_shape_that_fits_with_state_on_nvme_gets_no_nvme_all():
    """At 48 GB the state on NVMe is enough: ``nvme`` units, none ``nvme-all``.

    Mutation seen failing: ``choose_state`` skipping ``_fewest_on_nvme`` (straight to
    ``nvme-all``)."""
    shape, hw = _hw(48)
    _, tiers = choose_state(shape, hw, bf16_grads=True)
    assert "nvme" in tiers and "nvme-all" not in tiers


def test_an_nvme_all_unit_moves_what_the_contract_says(tight):
    """Per step an ``nvme-all`` unit's copy source is read once per weight copy the step program
    makes (as the simulator's trace copies it, recomputes included) and once more for the update,
    written once; its gradient written once per landing (once per group, layer-major) and read
    back by each later landing and by the update; its state read and written once. The trace's source reads and gradient writes are as
    many, and each copy starts after a read of its source has ended.

    Mutations seen failing: ``nvme_traffic`` without the update's read (``copies + 1``), or
    without a later landing's read of the partial sum (``g`` for ``grad_read``);
    ``weight_copies`` counting two copies a group (the recompute's copy missed); the simulator's
    copy not waiting for its source read."""
    shape, hw, res = tight
    d = res.plan.to_dict()
    d.update(boundary_tiers=["device" if i % 4 == 0 else "recompute" for i in range(shape.num_layers)],
             micro_batch_size=2, num_micro_batches=4, micro_batches_per_load=2, resident_layers=[])
    plan = Plan.from_dict(d)
    assert not plan.lands_once()
    moments, tiers = choose_state(shape, hw, bf16_grads=False)
    plan = Plan.from_dict({**plan.to_dict(), "moments": moments, "state_tiers": tiers})
    sim = simulate(plan, shape, hw, steps=2)
    cost = CostModel(shape, hw, plan.micro_batch_size, SEQ)
    copies, landings = weight_copies(plan, shape.tied), plan_grad_landings(plan, shape.tied)
    step1 = [iv for iv in sim.intervals if iv.step == 1]
    traced = Counter(iv.label[2:].split(" @")[0] for iv in step1 if iv.lane == "h2d" and iv.label.startswith("w "))
    reads = Counter(iv.label.rsplit(" ", 1)[1] for iv in step1 if iv.label.startswith("nvme source read"))
    writes = Counter(iv.label.rsplit(" ", 1)[1] for iv in sim.intervals if iv.label.startswith("nvme grad write"))
    full = plan.nvme_units(shape.unit_names(), source=True)
    assert {copies[u] for u in full} >= {2 * 2, 3 * 2}  # forward + backward per group; + a recompute's
    fig = nvme_state(shape, hw, plan, sim)
    by = fig.moved_by_kind
    w = {u: cost.unit_source_bytes(u) for u in full}
    g = {u: cost.unit_grad_store_bytes(u, False) for u in full}
    assert all(g[u] == 4 * shape.trainable_params(u) for u in full)  # fp32: lands twice a step
    assert by["source_read"] == sum(w[u] * (copies[u] + 1) for u in full)
    assert by["source_write"] == sum(w.values())
    assert by["grad_read"] == sum(g[u] * landings[u] for u in full)  # landings - 1, + the update
    assert by["grad_write"] == sum(g[u] * landings[u] for u in full) == 2 * sum(g.values())
    assert by["state_read"] == by["state_write"] == fig.state_bytes
    for u in full:
        assert traced[u] == copies[u] == reads[u], u
        assert writes[u] == 2 * landings[u]  # two steps simulated
    read_end = {}
    for iv in sorted(sim.intervals, key=lambda iv: iv.start):
        if iv.label.startswith("nvme source read"):
            read_end.setdefault(iv.label.rsplit(" ", 1)[1], []).append(iv.end)
        elif iv.lane == "h2d" and iv.label.startswith("w ") and (u := iv.label[2:].split(" @")[0]) in full:
            assert any(e <= iv.start + 1e-9 for e in read_end.get(u, ())), iv.label


def test_slow_nvme_makes_the_step_wait_and_the_report_says_so(tight):
    """Cut the NVMe to 1/20: the simulated step grows to at least the traffic (the copies wait
    for their sources), the report says it does not hide and names the ``nvme-all`` units; the
    step model grows too, and its fixed traffic is the store's traffic without recomputes.

    Mutations seen failing: the simulator's source reads taking no time (the step grows less
    than the traffic); the step model's ``state_traffic`` without the sources."""
    shape, hw, res = tight
    plan = res.plan
    slow = replace(hw, nvme_read_gbps=hw.nvme_read_gbps / 20, nvme_write_gbps=hw.nvme_write_gbps / 20)
    fast_sim, slow_sim = simulate(plan, shape, hw, steps=3), simulate(plan, shape, slow, steps=3)
    fig = nvme_state(shape, slow, plan, slow_sim)
    assert not fig.hides and fig.all_units > 0
    assert slow_sim.step_s > 10 * fast_sim.step_s and slow_sim.step_s >= 0.95 * fig.nvme_s
    line = nvme_state_line(shape, plan, fig, None)
    assert "does not hide" in line and f"{fig.all_units} of them nvme-all" in line and "source read" in line
    models = [StepModel(shape, h, plan.micro_batch_size, SEQ, plan.num_micro_batches, plan.prefetch_depth,
                        per_load=plan.micro_batches_per_load, state_tiers=plan.state_tiers) for h in (hw, slow)]
    cost = CostModel(shape, slow, plan.micro_batch_size, SEQ)
    no_recompute = Plan.from_dict({**plan.to_dict(), "boundary_tiers": ["device"] * shape.num_layers,
                                   "resident_layers": []})
    assert models[1].state_traffic == pytest.approx(cost.traffic_s(store_traffic(shape, cost, no_recompute)))
    assert models[1].state_traffic > 2 * cost.state_traffic_s(plan.moments, plan.state_tiers)
    ev = [m.evaluate(plan.boundary_tiers, moments=plan.moments, internal=plan.internal_tiers) for m in models]
    assert ev[1].step_s >= models[1].state_traffic > 10 * ev[0].step_s


def test_nothing_fits_when_even_every_unit_nvme_all_leaves_too_much():
    """With 12 GB of RAM even every unit ``nvme-all`` leaves the staging slots and the host
    reserve over it: the refusal names them. A drive too small for the weights refuses on NVMe.

    Mutation seen failing: the refusal without the staging (the old in-RAM message)."""
    shape, hw = _hw(12)
    with pytest.raises(PlanInfeasible) as e:
        choose_state(shape, hw, bf16_grads=True)
    assert e.value.resource == "host" and "nvme-all" in str(e.value)
    assert "of NVMe staging" in str(e.value) and "host reserve" in str(e.value)
    shape, hw = _hw(28)
    with pytest.raises(PlanInfeasible) as e:
        choose_state(shape, replace(hw, nvme_capacity_bytes=30 * 10**9), bf16_grads=True)
    assert e.value.resource == "nvme" and "weights, gradients and optimizer state" in str(e.value)


def test_a_resident_layer_cannot_be_nvme_all():
    """The simulator refuses a plan whose resident layer is ``nvme-all`` (the engine does too)."""
    shape, hw = _hw(28)
    units = shape.unit_names()
    tiers = ["ram"] * len(units)
    tiers[1] = "nvme-all"
    plan = Plan(["device"] * shape.num_layers, seq_len=SEQ, resident_layers=[0], state_tiers=tiers,
                moments=["8bit"] * len(units))
    with pytest.raises(ValueError, match="resident"):
        simulate(plan, shape, hw)
