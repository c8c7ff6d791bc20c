"""Optimizer state on NVMe (``Plan.state_tiers``): where the planner puts it, what the simulator
and the MILP's step model charge for it, and what ``layerwise plan`` says of it.

The shape throughout: qwen2.5-7b on an h200 with 48 GB of RAM. Its store with 8-bit moments
everywhere and bf16 gradients (~62 GB) is over the RAM; its copy source and gradients (~31 GB)
are not, so some units' state goes to NVMe."""

import json
from dataclasses import replace

import pytest

from layerwise.cli import main
from layerwise.plan.plan import NVME_STATE_SLOTS, Plan
from layerwise.plan.shape import load_shape
from layerwise.planner.cost import CostModel
from layerwise.planner.hardware import GB
from layerwise.planner.host_fit import PlanInfeasible, choose_state
from layerwise.planner.presets import PRESETS
from layerwise.planner.report import nvme_state_line
from layerwise.planner.search import SearchConfig, search
from layerwise.planner.simulator import simulate
from layerwise.planner.state_traffic import nvme_state
from layerwise.planner.step_model import StepModel

SEQ = 1024
QUICK = dict(micro_batch_sizes=(8,), prefetch_depth=1, milp_budget_s=1.0)


def _short_hw():
    """An h200 with 48 GB of RAM, the reserve with qwen2.5-7b's gradient ring."""
    shape = load_shape("qwen2.5-7b")
    hw = PRESETS["h200"].with_memory(host_mem_gb=48)
    return shape, hw.for_model(max(shape.unit_params(u) for u in shape.unit_names()[1:-1]) * 2)


@pytest.fixture(scope="module")
def short():
    """The search's plan for the host-short shape, one step of 8 x 1024 tokens."""
    shape, hw = _short_hw()
    return shape, hw, search(shape, hw, SEQ, SearchConfig(global_batch=8, **QUICK))


def test_a_host_short_shape_puts_the_fewest_units_state_on_nvme_and_fits(short):
    """The emitted plan has ``nvme`` units (8-bit moments), fits in simulation, and its host store
    is the RAM store less those units' state plus ``NVME_STATE_SLOTS`` staging slots of the
    largest; one unit fewer on NVMe would be over the RAM.

    Mutations seen failing: the staging slots left out of ``CostModel.host_store_bytes`` (the
    store's bytes differ from the parts); ``_fewest_on_nvme`` taking every unit (one fewer still
    fits)."""
    shape, hw, res = short
    plan, sim = res.plan, res.best.sim
    units = shape.unit_names()
    on_nvme = plan.nvme_units(units)
    assert 0 < len(on_nvme) < len(units) and sim.fits
    assert all(m == "8bit" for m, t in zip(plan.moments, plan.state_tiers) if t == "nvme")
    cost = CostModel(shape, hw, 1, 1)
    state = [cost.unit_state_bytes(u) for u in on_nvme]
    parts = (cost.store_footprint(plan.moments, bf16_grads=True).total - sum(state)
             + NVME_STATE_SLOTS * max(state))
    assert sim.host_store_bytes == cost.host_store_bytes(plan.moments, True, plan.state_tiers) == parts
    assert sim.peak_nvme_bytes >= sum(state)
    # the moments moved are the 8-bit ones, beside the 16-bit master remainder
    u = on_nvme[0]
    n = shape.trainable_params(u)
    assert cost.unit_state_bytes(u) == 2 * n + 2 * n + 8 * -(-n // 256) + 4
    # fewest: with one unit fewer on NVMe (the later units go first) the store is over the RAM
    moments, tiers = choose_state(shape, hw, bf16_grads=True)
    fewer = list(tiers)
    fewer[fewer.index("nvme")] = "ram"
    assert cost.host_store_bytes(moments, True, fewer) > hw.host_cap_bytes >= cost.host_store_bytes(
        moments, True, tiers)


def test_a_shape_that_fits_ram_gets_no_nvme_units():
    """With the preset's 250 GB the same model keeps every unit's state in RAM with fp32 moments:
    ``state_tiers`` None, no NVMe figures, the store as before.

    Mutation seen failing: ``choose_state`` going to NVMe whenever NVMe space exists (a unit on
    NVMe here)."""
    shape = load_shape("qwen2.5-7b")
    hw = PRESETS["h200"]
    assert choose_state(shape, hw, bf16_grads=True) == (["fp32"] * len(shape.unit_names()), None)
    res = search(shape, hw, SEQ, SearchConfig(global_batch=8, **QUICK))
    assert res.plan.state_tiers is None and res.plan.predicted["nvme_state"] is None
    assert nvme_state(shape, hw, res.plan, res.best.sim) is None
    assert res.best.sim.host_store_bytes == CostModel(shape, hw, 1, 1).host_store_bytes(res.plan.moments, True)


def test_the_step_waits_for_nvme_that_cannot_keep_up_and_the_report_says_so(short):
    """Cut the NVMe to 1/20 of the preset's: the state's reads and writes take longer than the
    step's compute, so the simulated step grows to at least that traffic, and the report says it
    does not hide; the MILP's step model grows as well. At the preset's bandwidth the same plan
    at 64 micro-batches (the traffic spread over more compute) is within 10% of its compute.

    Mutations seen failing: the simulator's update not waiting for its state's read (``ready =
    done``: the step does not grow); the step model's NVMe lane without ``state_traffic``."""
    shape, hw, res = short
    plan = res.plan
    slow = replace(hw, nvme_read_gbps=hw.nvme_read_gbps / 20, nvme_write_gbps=hw.nvme_write_gbps / 20)
    fast_sim, slow_sim = simulate(plan, shape, hw, steps=3), simulate(plan, shape, slow, steps=3)
    fig = nvme_state(shape, slow, plan, slow_sim)
    assert fig is not None and not fig.hides
    assert slow_sim.step_s > 2 * fast_sim.step_s and slow_sim.step_s >= 0.95 * fig.nvme_s
    assert "does not hide" in nvme_state_line(shape, plan, fig, None)
    models = [StepModel(shape, h, plan.micro_batch_size, SEQ, plan.num_micro_batches, plan.prefetch_depth,
                        per_load=plan.micro_batches_per_load, state_tiers=plan.state_tiers) for h in (hw, slow)]
    ev = [m.evaluate(plan.boundary_tiers, moments=plan.moments, internal=plan.internal_tiers) for m in models]
    assert ev[1].step_s >= models[1].state_traffic > 2 * ev[0].step_s
    d = plan.to_dict()
    d.update(num_micro_batches=64, micro_batches_per_load=64)
    big = Plan.from_dict(d)
    sim = simulate(big, shape, hw, keep_trace=False)
    fig = nvme_state(shape, hw, big, sim)
    assert fig.hides and sim.step_s <= 1.1 * sim.busy_s["compute"]


def test_weights_over_the_ram_go_nvme_all():
    """llama3-70b's bf16 weights (141 GB) are over 128 GB of RAM: every unit's state on NVMe is
    not enough, so units go ``nvme-all`` (their weights and gradients on NVMe too) and the store
    fits; at 256 GB the weights fit but not with the bf16 gradients (~284 GB), so some still do; at
    384 GB state on NVMe is enough (none ``nvme-all``); a 100 GB drive cannot take the state.

    Mutation seen failing: ``choose_state`` refusing where ``_fewest_on_nvme`` finds nothing (the
    refusal before the ``nvme-all`` tier)."""
    shape = load_shape("llama3-70b")
    cost = CostModel(shape, PRESETS["h200"], 1, 1)
    for ram in (128, 256):
        hw = PRESETS["h200"].with_memory(host_mem_gb=ram)
        moments, tiers = choose_state(shape, hw, bf16_grads=True)
        assert "nvme-all" in tiers and cost.host_store_bytes(moments, True, tiers) <= hw.host_cap_bytes
    moments, tiers = choose_state(shape, PRESETS["h200"].with_memory(host_mem_gb=384), bf16_grads=True)
    assert "nvme" in tiers and "ram" in tiers and "nvme-all" not in tiers
    small_drive = replace(PRESETS["h200"].with_memory(host_mem_gb=384), nvme_capacity_bytes=100 * GB)
    with pytest.raises(PlanInfeasible) as e:
        choose_state(shape, small_drive, bf16_grads=True)
    assert e.value.resource == "nvme"


def test_plan_json_carries_the_nvme_figures(capsys):
    """``layerwise plan --json`` on the host-short shape: the plan's ``state_tiers``, the
    ``nvme_state`` figures (units, bytes on NVMe and moved per step, NVMe and compute seconds,
    hides) and the report's line; the host figures count the store without that state.

    Mutation seen failing: the JSON without ``nvme_state`` (None)."""
    argv = ["plan", "--model", "qwen2.5-7b", "--hardware", "h200", "--host-mem", "48", "--seq-len", str(SEQ),
            "--batch", "8", "--time-limit", "1", "--prefetch-depth", "1", "--json"]
    assert main(argv) == 0
    d = json.loads(capsys.readouterr().out)
    nv, plan = d["nvme_state"], d["plan"]
    assert nv["units"] == plan["state_tiers"].count("nvme") > 0
    shape, hw = _short_hw()
    cost = CostModel(shape, hw, plan["micro_batch_size"], SEQ)
    assert nv["state_bytes"] == cost.nvme_state_bytes(plan["moments"], plan["state_tiers"])
    assert nv["moved_bytes_per_step"] >= 2 * nv["state_bytes"]
    assert nv["nvme_s_per_step"] >= cost.state_traffic_s(plan["moments"], plan["state_tiers"]) > 0
    assert nv["hides"] == (nv["nvme_s_per_step"] <= 0.8 * nv["compute_s_per_step"])
    assert nv["batch"] == "the global batch was given"
    assert d["host"]["nvme_state_bytes"] == nv["state_bytes"] and d["host"]["fits_ram"]
    assert any(line.startswith(f"optimizer state on NVMe: {nv['units']} of 30 units") for line in d["lines"])
