"""The data-parallel scaling model: properties of its predictions, each able to fail."""

import json
from dataclasses import replace

import pytest

from layerwise.cli import main
from layerwise.planner.cost import CostModel
from layerwise.planner.hardware import HardwareProfile
from layerwise.planner.presets import PRESETS
from layerwise.plan.plan import Plan
from layerwise.plan.program import micro_batch_program
from layerwise.planner.scaling import ladder, predict_scaling, split_plan
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate
from layerwise.plan.owners import assign_owners
from layerwise.planner.topology import Topology

SHAPE = load_shape("llama-30m")  # 10 layers, untied: 12 units
L = SHAPE.num_layers
SEQ = 256
PLAN = Plan(Plan.every_k(L, 2).boundary_tiers, micro_batch_size=2, seq_len=SEQ)
H200 = PRESETS["h200"]


def _ideal(**kw) -> HardwareProfile:
    """Interconnects that cost nothing and a host side nobody waits for (not shared: no node link;
    accumulation and optimizer so fast that 1/G of them is still free)."""
    return replace(H200, intra_node_gbps=1e12, inter_node_gbps=1e12, node_host_link_gbps=None, gloo_reduce_gbps=1e12,
                   host_accum_gbps=1e12, host_accum_bf16_gbps=1e12, pinned_copy_gbps=1e12,
                   optimizer_params_per_s=1e21, optimizer_8bit_params_per_s=1e21, **kw)


@pytest.mark.parametrize("reduce", ["host", "device"])
def test_one_gpu_predicts_exactly_the_single_gpu_step(reduce):
    """A 1-GPU topology is the single-GPU simulator, to the last bit, busy lanes included.
    Mutation caught: ``rank_hardware`` dividing the accumulation bandwidth by ``g + 1``."""
    global_batch = 8
    point, = predict_scaling(SHAPE, H200, PLAN, global_batch, [Topology(1, 1, reduce)])
    single = simulate(split_plan(PLAN, global_batch, 1), SHAPE, H200)
    assert point.step_s == single.step_s
    assert point.sim.busy_s == single.busy_s
    assert point.speedup == 1.0
    assert point.tokens_per_s == single.tokens_per_s


def _compute_s(hw: HardwareProfile, plan: Plan) -> float:
    """Compute seconds of one micro-batch, from the cost model and the program (no simulator)."""
    c = CostModel(SHAPE, hw, plan.micro_batch_size, SEQ)
    return sum(c.op_s(op.kind, op.index) for op in micro_batch_program(plan.boundary_tiers))


@pytest.mark.parametrize("hw", [H200, replace(H200, peak_tflops=50.0), _ideal(peak_tflops=50.0)],
                         ids=["h200", "slow-gpu", "slow-gpu-ideal"])
def test_more_gpus_never_beat_the_compute_bound(hw):
    """Each GPU computes its share of the global batch at its own speed: the step is never shorter
    than that share's compute, and W GPUs never exceed W times one.
    Mutations caught: ``rank_hardware`` pretending the GPUs pool their FLOPs (``peak_tflops * g``;
    the slow-GPU cases, where compute is the step), and ``split_plan`` giving every GPU the whole
    batch."""
    global_batch = 32
    points = predict_scaling(SHAPE, hw, PLAN, global_batch, ladder(8, 2))
    for pt in points:
        share = global_batch // pt.topology.world_size
        assert pt.plan.micro_batch_size * pt.plan.num_micro_batches == share
        bound = pt.plan.num_micro_batches * _compute_s(hw, pt.plan)
        assert pt.step_s >= bound * (1 - 1e-9), pt.topology
        assert pt.speedup <= pt.topology.world_size * (1 + 1e-9)


def test_ideal_interconnect_and_unshared_host_scale_near_linearly():
    """Nothing shared, nothing to reduce: W GPUs on W times fewer micro-batches are ~W times faster.
    Mutation caught: ``split_plan`` giving every GPU the whole batch (speedup 1)."""
    hw = _ideal(peak_tflops=50.0)  # a slow GPU: compute dominates the fixed per-step costs
    points = predict_scaling(SHAPE, hw, PLAN, 64, ladder(8, 2))
    for pt in points:
        w = pt.topology.world_size
        assert 0.9 * w <= pt.speedup <= w * (1 + 1e-9), (w, pt.speedup)
        assert pt.bound == "compute"


@pytest.mark.parametrize("topo,field", [(Topology(4, 1), "intra_node_gbps"),
                                        (Topology(4, 1, "device"), "intra_node_gbps"),
                                        (Topology(1, 2), "inter_node_gbps")])
def test_a_tiny_interconnect_makes_the_reduction_the_bound(topo, field):
    """At 10 MB/s the reduction dominates: the step is slower than 1 GPU's (speedup < 1, reported),
    and the interconnect is named as the bound.
    Mutation caught (host-side case): the step's end not waiting for the reduction (``landed`` not
    taken from the ``intra`` lane) -- the slow reduction then hides behind the next step."""
    hw = replace(H200, **{field: 0.01})
    pt, = predict_scaling(SHAPE, hw, PLAN, 8, [topo])
    assert pt.speedup < 1.0
    assert pt.bound == "interconnect"
    assert pt.row()["speedup"] == pt.speedup and pt.row()["bound"] == "interconnect"


@pytest.mark.parametrize("gpus", [1, 2, 4, 8])
def test_host_optimizer_share_shrinks_as_one_over_g(gpus):
    """The traced process (the busiest owner) updates ~1/G of the parameters, on 1/G of the cores:
    its optimizer lane's seconds times that 1/G rate, counted from the simulated trace, are its
    owned parameters, within one unit of total/G (largest-first balance).
    Mutations caught: every process updating every unit (the owner lane ignored: G x the
    parameters), and owners keeping all cores (the rate not split: 1/G of the seconds)."""
    hw = replace(H200, optimizer_params_per_s=1e9)
    sim = simulate(split_plan(PLAN, 8 * gpus, gpus), SHAPE, hw, topology=Topology(gpus, 1))
    updates = [iv for iv in sim.intervals if iv.lane == "optimizer" and iv.step == 0
               and iv.label.startswith("update ")]  # not the refreshes that follow them
    params = sum(iv.end - iv.start for iv in updates) * hw.optimizer_params_per_s / gpus
    units = SHAPE.unit_names()
    total = sum(SHAPE.unit_params(u) for u in units)
    largest = max(SHAPE.unit_params(u) for u in units)
    assert total / gpus * (1 - 1e-9) <= params <= (total / gpus + largest) * (1 + 1e-9)
    owned = {iv.label[len("update "):] for iv in updates}
    owners = assign_owners([SHAPE.unit_params(u) for u in units], gpus)
    assert len({owners[units.index(u)] for u in owned}) == 1  # one process's units only


def test_owners_balance_by_bytes():
    owners = assign_owners([10, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], 2)
    loads = [sum(p for p, o in zip([10] + [1] * 10, owners) if o == r) for r in range(2)]
    assert sorted(loads) == [10, 10]


def test_host_bytes_are_the_nodes():
    """A node holds one store, the other processes' fp32 gradients and everyone's activations."""
    plan = Plan(["host"] * L, micro_batch_size=2, seq_len=SEQ)
    one = simulate(plan, SHAPE, H200)
    four = simulate(plan, SHAPE, H200, topology=Topology(4, 1))
    # one process of one micro-batch keeps bf16 gradients; data parallel sums on the host: fp32
    one_fp32 = simulate(replace(plan, num_micro_batches=2), SHAPE, H200)
    assert one.host_store_bytes < one_fp32.host_store_bytes
    assert four.host_store_bytes == one_fp32.host_store_bytes + 3 * 4 * SHAPE.num_params
    assert four.peak_pinned_act_bytes == 4 * one.peak_pinned_act_bytes > 0
    # reduced on the GPUs, only owners land gradients: into the one store's
    on_gpus = simulate(plan, SHAPE, H200, topology=Topology(4, 1, "device"))
    assert on_gpus.host_store_bytes == one_fp32.host_store_bytes


def test_topologies_the_profile_cannot_price_are_refused():
    with pytest.raises(ValueError, match="node has 8"):
        predict_scaling(SHAPE, H200, PLAN, 16, [Topology(16, 1)])
    with pytest.raises(ValueError, match="intra_node_gbps"):
        predict_scaling(SHAPE, replace(PRESETS["cpu"], gpus_per_node=2), PLAN, 2, [Topology(2, 1)])
    with pytest.raises(ValueError, match="inter_node_gbps"):
        predict_scaling(SHAPE, replace(H200, inter_node_gbps=None), PLAN, 2, [Topology(1, 2)])
    with pytest.raises(ValueError, match="multiple of 4"):
        split_plan(PLAN, 6, 4)
    with pytest.raises(ValueError, match="grad_reduce"):
        Topology(2, 1, "nvme")


def test_plan_gpus_prints_the_predicted_scaling(capsys):
    rc = main(["plan", "--model", "llama-30m", "--hardware", "h200", "--seq-len", "256", "--batch", "16",
               "--gpus", "4", "--nodes", "2", "--time-limit", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "speedup vs 1 GPU" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit() and "x" in line]
    assert [r[:2] for r in rows[-4:]] == [["1", "1"], ["2", "1"], ["4", "1"], ["8", "2"]]
    assert rows[-4][7] == "1.00"  # 1 GPU against itself
    rc = main(["plan", "--model", "llama-30m", "--hardware", "h200", "--seq-len", "256", "--batch", "16",
               "--gpus", "2", "--time-limit", "1", "--json"])
    scaling = json.loads(capsys.readouterr().out)["scaling"]
    assert scaling["global_batch"] == 16
    assert [(p["gpus"], p["micro_batch_size"] * p["num_micro_batches"]) for p in scaling["points"]] == [(1, 16), (2, 8)]
    assert main(["plan", "--model", "llama-30m", "--hardware", "h200", "--seq-len", "256", "--batch", "6",
                 "--gpus", "4"]) == 2
