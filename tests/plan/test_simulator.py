"""The simulator against step times computed by hand on small cases."""

from dataclasses import replace

import pytest

from layerwise.planner.cost import CostModel
from layerwise.plan.shape import load_shape
from layerwise.planner.presets import PRESETS
from layerwise.plan.plan import Plan
from layerwise.planner.simulator import micro_batch_program, simulate

SHAPE = load_shape("llama-30m")  # 10 layers, untied
L = SHAPE.num_layers


def _cost(hw, mbs=1, seq=64):
    return CostModel(SHAPE, hw, mbs, seq)


def test_synchronous_step_is_the_sum_of_all_work():
    """CPU backend: one lane, so the steady step is every op, copy, accumulation and update added up."""
    hw = PRESETS["cpu"]
    m = 3
    plan = Plan(["device"] * L, micro_batch_size=2, num_micro_batches=m, seq_len=64)
    c = _cost(hw, 2, 64)
    compute = m * (2 * c.embed_s + c.head_s + sum(c.layer_fwd_s(i) + c.layer_bwd_s(i) for i in range(L)))
    w = lambda u: c.h2d_s(c.unit_weight_bytes(u))  # noqa: E731
    # weights: every layer twice and the head once per micro-batch; embed for each forward
    # (embed_bwd reads no weights)
    copies_in = m * (2 * sum(w(f"layers.{i}") for i in range(L)) + w("head") + w("embed"))
    # added in place, no copy; each unit's first landing of the step writes instead of adding
    grads = sum(c.grad_accumulate_s(u, first=True) + (m - 1) * c.grad_accumulate_s(u) for u in SHAPE.unit_names())
    optimizer = sum(c.optimizer_s(u) for u in SHAPE.unit_names())
    expect = compute + copies_in + grads + optimizer
    sim = simulate(plan, SHAPE, hw, steps=2)
    assert sim.step_s == pytest.approx(expect, rel=1e-9)
    assert sim.tokens_per_s == pytest.approx(m * 2 * 64 / expect)


def test_synchronous_recompute_adds_segment_forwards():
    hw = PRESETS["cpu"]
    c = _cost(hw)
    keep = simulate(Plan(["device"] * L, seq_len=64), SHAPE, hw)
    every2 = simulate(Plan(Plan.every_k(L, 2).boundary_tiers, seq_len=64), SHAPE, hw)
    # every-2 drops the odd boundaries: layer 2j's forward runs again, with its weights streamed again
    extra = sum(c.layer_fwd_s(i) + c.h2d_s(c.unit_weight_bytes(f"layers.{i}")) for i in range(0, L, 2))
    assert every2.step_s - keep.step_s == pytest.approx(extra, rel=1e-9)
    assert every2.recompute_s == pytest.approx(sum(c.layer_fwd_s(i) for i in range(0, L, 2)))


def _pcie_bound():
    # compute is free, host work is free: only copies take time, so the H2D lane is the step
    return replace(PRESETS["h200"], peak_tflops=1e9, device_mem_gbps=1e12, kernel_launch_s=0.0,
                   host_accum_gbps=1e9, host_accum_bf16_gbps=1e9,
                   pinned_copy_gbps=1e9, optimizer_params_per_s=1e18, optimizer_8bit_params_per_s=1e18)


def test_pcie_bound_step_is_the_h2d_stream():
    hw = _pcie_bound()
    c = _cost(hw, 4, 256)
    w = lambda u: c.h2d_s(c.unit_weight_bytes(u))  # noqa: E731
    layers = sum(w(f"layers.{i}") for i in range(L))
    # H2D streams without a gap: embed, layers 0..9, head, layers 9..0; layer_bwd 0 then runs
    # (free) and its gradient leaves over D2H; the embedding's backward (no weights) finishes
    # meanwhile, so its gradient queues behind layer 0's on the D2H stream.
    tail = c.d2h_s(c.grad_bytes("layers.0")) + c.d2h_s(c.grad_bytes("embed"))
    base = w("embed") + 2 * layers + w("head") + tail
    keep = simulate(Plan(["device"] * L, micro_batch_size=4, seq_len=256), SHAPE, hw, steps=1)
    assert keep.step_s == pytest.approx(base, rel=1e-6)
    # every boundary on the host: each comes back over the same H2D stream
    host = simulate(Plan(["host"] * L, micro_batch_size=4, seq_len=256), SHAPE, hw, steps=1)
    assert host.step_s == pytest.approx(base + L * c.h2d_s(c.boundary_bytes), rel=1e-6)
    assert host.busy_s["h2d"] == pytest.approx(host.step_s - tail, rel=1e-6)


def test_compute_bound_step_is_the_compute_stream():
    hw = replace(PRESETS["h200"], peak_tflops=1e-3, h2d_gbps=1e9, d2h_gbps=1e9, host_accum_gbps=1e9,
                 host_accum_bf16_gbps=1e9, pinned_copy_gbps=1e9, nvme_read_gbps=1e9, nvme_write_gbps=1e9)
    c = _cost(hw)
    fwd = sum(c.layer_fwd_s(i) for i in range(L))
    bwd = sum(c.layer_bwd_s(i) for i in range(L))
    for tiers, recompute in ((["device"] * L, 0.0), (["nvme"] * L, 0.0),
                             (Plan.every_k(L, 4).boundary_tiers,
                              # boundary k dropped -> layer k-1 runs again: layers 0,1,2,4,5,6,8
                              sum(c.layer_fwd_s(i) for i in (0, 1, 2, 4, 5, 6, 8)))):
        sim = simulate(Plan(tiers, seq_len=64), SHAPE, hw, steps=1)
        assert sim.step_s == pytest.approx(fwd + bwd + c.head_s + recompute, rel=1e-6), tiers


def test_optimizer_overlaps_only_the_next_forward():
    """A slow optimizer delays the next step's forward by what the forward cannot hide."""
    base = _pcie_bound()
    c = _cost(base)
    fast = simulate(Plan(["device"] * L, seq_len=64), SHAPE, base)
    slow_hw = replace(base, optimizer_params_per_s=SHAPE.num_params / 10.0, pinned_copy_gbps=1e18)  # 10 s per step
    slow = simulate(Plan(["device"] * L, seq_len=64), SHAPE, slow_hw)
    # the last layer's update ends at 10 s * (all but the head) / all; its copy follows it,
    # then the rest of the step (head, backward) runs as before
    assert slow.step_s > fast.step_s + 9.0
    assert slow.busy_s["optimizer"] == pytest.approx(10.0, rel=1e-6)
    del c


def test_memory_peaks_and_capacity():
    hw = PRESETS["h200"]
    c = _cost(hw, 2, 128)
    keep = simulate(Plan(["device"] * L, micro_batch_size=2, seq_len=128), SHAPE, hw)
    host = simulate(Plan(["host"] * L, micro_batch_size=2, seq_len=128), SHAPE, hw)
    assert keep.peak_device_bytes > host.peak_device_bytes
    assert keep.peak_device_bytes - host.peak_device_bytes >= (L - 3) * c.boundary_bytes
    assert host.peak_pinned_act_bytes == L * c.boundary_bytes
    assert keep.peak_pinned_act_bytes == 0
    # one micro-batch: the store keeps bf16 gradients (layers, untied embedding); several: fp32
    assert keep.host_store_bytes == c.host_store_bytes(bf16_grads=True) < c.host_store_bytes()
    accum = simulate(Plan(["device"] * L, micro_batch_size=2, seq_len=128, num_micro_batches=2),
                     SHAPE, hw)
    assert accum.host_store_bytes == c.host_store_bytes()
    tight = replace(hw, device_mem_bytes=host.peak_device_bytes + hw.device_reserved_bytes)
    assert simulate(host.plan, SHAPE, tight).fits
    assert simulate(keep.plan, SHAPE, tight).over_capacity()["device"] > 0


def test_engine_memory_model_agrees_when_copies_are_instant():
    from layerwise.plan import memory

    hw = replace(PRESETS["h200"], h2d_gbps=1e9, d2h_gbps=1e9, nvme_read_gbps=1e9, nvme_write_gbps=1e9)
    mixed = ["device", "recompute", "host", "recompute", "host"] * 2
    for tiers, internal in ((["device"] * L, None), (["recompute"] * L, None),
                            (Plan.every_k(L, 3).boundary_tiers, None), (["host"] * L, None),
                            (["device"] * L, ["device"] * L), (["recompute"] * L, ["host"] * L),
                            (Plan.every_k(L, 2).boundary_tiers, mixed)):
        plan = Plan(tiers, internal_tiers=internal, micro_batch_size=2, seq_len=128)
        est = memory.predict_peak_device_bytes(SHAPE, plan, 2, 128, 2)
        sim = simulate(plan, SHAPE, hw)
        # the simulator adds what is in flight (prefetched boundaries, grads being copied out)
        assert est.peak_bytes <= sim.peak_device_bytes <= est.peak_bytes * 1.25, tiers


def test_kept_internals_skip_the_backward_forward_and_host_ones_add_their_copies():
    """Synchronous (one lane): keeping every layer's internals on the device turns each layer's
    forward + (forward with graph + backward) into forward with graph + backward; the host tier
    adds each layer's internals copied out and back in. Mutation seen failing: timing
    ``layer_bwd_kept`` as ``layer_bwd`` (the difference vanishes)."""
    hw = PRESETS["cpu"]
    c = _cost(hw, 2, 64)
    base = simulate(Plan(["device"] * L, micro_batch_size=2, seq_len=64), SHAPE, hw)
    kept = simulate(Plan(["device"] * L, internal_tiers=["device"] * L, micro_batch_size=2, seq_len=64), SHAPE, hw)
    host = simulate(Plan(["device"] * L, internal_tiers=["host"] * L, micro_batch_size=2, seq_len=64), SHAPE, hw)
    saved = sum(c.layer_fwd_s(i) + c.layer_bwd_s(i) - c.layer_fwd_keep_s(i) - c.layer_bwd_kept_s(i)
                for i in range(L))
    assert saved > 0
    assert base.step_s - kept.step_s == pytest.approx(saved, rel=1e-9)
    copies = L * (c.internals_d2h_s + c.internals_h2d_s)
    assert host.step_s - kept.step_s == pytest.approx(copies, rel=1e-9)
    assert host.peak_pinned_act_bytes == L * c.layer_workspace_bytes  # all on the host after the forward
    assert kept.peak_device_bytes - base.peak_device_bytes >= (L - 1) * (c.layer_workspace_bytes - c.boundary_bytes)


def test_checker_passes_kept_internals_and_catches_a_missing_fetch():
    """Async machine: host-tier internals are fetched before their backward; the checker sees it,
    and sees the backward start early when the fetch is slowed and the wait removed."""
    from layerwise.planner.check import check

    hw = PRESETS["h200"]
    plan = Plan(Plan.every_k(L, 2).boundary_tiers, micro_batch_size=2, seq_len=128,
                internal_tiers=["host", "device", "recompute", "host", "recompute"] * 2)
    sim = simulate(plan, SHAPE, hw)
    assert check(sim, SHAPE, hw).ok, check(sim, SHAPE, hw).violations
    for iv in sim.intervals:  # a fetch that lands after its backward started
        if iv.label == "fetch_internals L3":
            iv.end = next(o["end"] for o in sim.op_log if o["kind"] == "layer_bwd_kept" and o["index"] == 3)
    assert any("internals of layer 3 not fetched" in v for v in check(sim, SHAPE, hw).violations)
