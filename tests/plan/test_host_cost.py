"""The cost model's host terms: a bf16 gradient accumulates at the bf16 rate, the first landing
writes, the update pays the compute copy's refresh into pinned memory, gloo's reduction has its
own bandwidth, and a node's GPUs share all of it."""

from dataclasses import replace

import pytest

from layerwise.models import get_flavor
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.shape import ModelShape
from layerwise.planner.topology import Topology, host_reduce_s, intra_reduce_s, rank_hardware

SHAPE = ModelShape.from_config(get_flavor("llama-30m").build_config())
U = "layers.0"


def test_bf16_accumulation_is_priced_at_its_own_rate():
    """bf16 (GPU): ``P·10`` bytes (``P·6`` on the first landing) at ``host_accum_bf16_gbps``; fp32
    (the CPU backend): ``P·12`` at ``host_accum_gbps``.

    Mutation seen caught: ``grad_accumulate_s`` dividing by ``host_accum_gbps`` whatever the dtype."""
    p = SHAPE.unit_params(U)
    hw = replace(PRESETS["h200"], host_accum_gbps=100.0, host_accum_bf16_gbps=20.0)
    c = CostModel(SHAPE, hw, 1, 64)
    assert c.grad_accumulate_s(U) == pytest.approx(p * 10 / 20e9)
    assert c.grad_accumulate_s(U, first=True) == pytest.approx(p * 6 / 20e9)
    cpu = CostModel(SHAPE, replace(PRESETS["cpu"], host_accum_gbps=3.0, host_accum_bf16_gbps=1.0), 1, 64)
    assert cpu.grad_accumulate_s(U) == pytest.approx(p * 12 / 3e9)


def test_the_update_is_the_step_and_a_split_master_needs_no_refresh():
    """A unit's update is the AdamW step at the measured per-parameter rate. With bf16 compute
    the store's master is split (``layerwise.split_master``): the step writes the compute copy's
    bf16 halves itself, so no refresh into the pinned arena is charged; computing in fp32 the
    master is the copy source, no refresh either.

    Mutation seen caught: ``compute_refresh_s`` charging the refresh with a split master."""
    p = SHAPE.unit_params(U)
    hw = replace(PRESETS["h200"], optimizer_params_per_s=1e9, optimizer_8bit_params_per_s=5e8,
                 pinned_copy_gbps=6.0)
    c = CostModel(SHAPE, hw, 1, 64)
    assert c.split_master and c.compute_refresh_s(U) == 0.0
    assert c.optimizer_s(U) == pytest.approx(p / 1e9)
    assert c.optimizer_s(U, "8bit") == pytest.approx(p / 5e8)
    fp32 = CostModel(SHAPE, replace(PRESETS["cpu"], optimizer_params_per_s=1e9), 1, 64)
    assert fp32.compute_refresh_s(U) == 0.0 and fp32.optimizer_s(U) == pytest.approx(p / 1e9)


def test_gloo_reduction_has_its_own_bandwidth_and_the_node_shares_the_host():
    """With ``gloo_reduce_gbps`` the host-path reduction is timed at it (bus bandwidth, the
    ``(G-1)/G`` of intra_reduce_s); without it, as on the GPUs' link. ``rank_hardware`` divides
    the bf16 accumulation and the refresh by the GPUs per node, as it does the fp32 accumulation."""
    topo = Topology(4)
    hw = replace(PRESETS["h200"], gloo_reduce_gbps=2.0)
    assert host_reduce_s(8e9, hw, topo) == pytest.approx(0.75 * 8e9 / 2e9)
    plain = replace(hw, gloo_reduce_gbps=None)
    assert host_reduce_s(8e9, plain, topo) == intra_reduce_s(8e9, plain, topo)
    assert host_reduce_s(8e9, hw, Topology(1)) == 0.0
    r = rank_hardware(hw, topo)
    assert r.host_accum_bf16_gbps == hw.host_accum_bf16_gbps / 4
    assert r.pinned_copy_gbps == hw.pinned_copy_gbps / 4
    old = replace(hw, host_accum_bf16_gbps=None, pinned_copy_gbps=None)
    r_old = rank_hardware(old, topo)
    assert r_old.host_accum_bf16_gbps is None and r_old.accum_bf16_gbps == old.host_accum_gbps / 4
