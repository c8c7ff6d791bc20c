"""The step program and the device-memory prediction it drives."""

import pytest
import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.memory_probe import measure_step_peak
from layerwise.plan.program import micro_batch_program, weight_schedule
from layerwise.models import get_flavor
from layerwise.store import init_store
from layerwise.plan import Plan
from layerwise.engine.batch import Batch
from matrix import sampled


def ops_str(plan):
    return [str(op) for op in micro_batch_program(plan.boundary_tiers)]


def test_every_k_program_recomputes_segments_from_kept_boundaries():
    ops = ops_str(Plan.every_k(5, 3))  # keeps boundaries 0 and 3
    backward = ops[ops.index("head") + 1:]
    assert backward == [
        "fetch 3", "recompute_layer 3", "layer_bwd 4", "layer_bwd 3",
        "fetch 0", "recompute_layer 0", "recompute_layer 1", "layer_bwd 2",
        "layer_bwd 1", "layer_bwd 0", "embed_bwd",
    ]
    assert ops_str(Plan.every_k(5, 3))[:7] == [
        "embed_fwd", "layer_fwd 0", "layer_fwd 1", "layer_fwd 2", "layer_fwd 3", "layer_fwd 4", "head"]


def test_recompute_all_rebuilds_from_the_embedding():
    backward = ops_str(Plan.recompute_all(3))[5:]
    assert backward == ["recompute_embed", "recompute_layer 0", "recompute_layer 1", "layer_bwd 2",
                        "layer_bwd 1", "layer_bwd 0", "embed_bwd"]


def test_weight_schedule_streams_every_use():
    ops = micro_batch_program(Plan.every_k(2, 1).boundary_tiers)
    assert weight_schedule(ops, tied=True) == [
        "embed", "layers.0", "layers.1", "embed", "head", "layers.1", "layers.0"]  # embed_bwd: none


KEPT_PLANS = {
    "internals-device": Plan(["device"] * 10, internal_tiers=["device"] * 10, source="internals-device"),
    "internals-host": Plan(["recompute"] * 10, internal_tiers=["host"] * 10, source="internals-host"),
    "internals-mixed": Plan(Plan.every_k(10, 2).boundary_tiers, source="internals-mixed",
                            internal_tiers=["device", "recompute", "host", "recompute"] * 2 + ["device", "host"]),
}


@pytest.mark.parametrize("plan", sampled([Plan.every_k(10, 1), Plan.every_k(10, 3),
                                          Plan.recompute_all(10), Plan.keep_all(10, "host"),
                                          *KEPT_PLANS.values()],
                                         {"every-3", "keep-all-host", "internals-mixed"},
                                         ids=lambda p: p.source))
def test_predicted_peak_matches_the_peak_measured_from_allocations(plan, streamed_cpu):
    """The memory model against the step's real allocations (torch profiler memory events plus
    the slots' storages), not against the engine's own bookkeeping: within 5%, at the same op.
    Mutations checked: dropping the layer backward's autograd workspace from the model (the
    prediction falls ~40% short); not counting host-tier internals fetched ahead (internals-host
    falls ~35% short); not swapping out a kept graph's input leaf data (internals-host: the
    boundary stays pinned)."""
    cfg = get_flavor("llama-30m").build_config(num_hidden_layers=10, hidden_size=128,
                                               intermediate_size=352, num_attention_heads=4,
                                               num_key_value_heads=2)
    adapter, store = init_store(cfg)
    engine = StreamingEngine(adapter, store, plan, EngineConfig())
    ids = torch.randint(0, cfg.vocab_size, (2, 128))
    engine.compute_grads([Batch(ids, ids)])  # warm-up: fetch slots are allocated by a first step
    measured = measure_step_peak(engine, [Batch(ids, ids)])
    predicted = engine.predict_memory(2, 128)
    engine.close()
    assert abs(predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.05, (predicted, measured)
    assert predicted.peak_op == measured.peak_op


def test_offloading_lowers_predicted_peak():
    cfg = get_flavor("llama-30m").build_config()
    from layerwise.plan.shape import ModelShape
    from layerwise.plan.memory import predict_peak_device_bytes

    shape = ModelShape.from_config(cfg)
    L = shape.num_layers
    keep = predict_peak_device_bytes(shape, Plan.every_k(L, 1), 4, 1024, 2).peak_bytes
    host = predict_peak_device_bytes(shape, Plan.keep_all(L, "host"), 4, 1024, 2).peak_bytes
    k4 = predict_peak_device_bytes(shape, Plan.every_k(L, 4), 4, 1024, 2).peak_bytes
    assert host < k4 < keep


@pytest.mark.parametrize("flavor", ["llama-debug", "llama-debug-tied", "qwen2-debug",
                                    "qwen3-debug-untied", "mistral-debug", "qwen-27b"])
def test_planner_shape_counts_the_parameters_the_adapter_holds(flavor):
    from layerwise.models import DecoderAdapter
    from layerwise.plan.shape import ModelShape

    cfg = get_flavor(flavor).build_config()
    adapter = DecoderAdapter(cfg)
    shape = ModelShape.from_config(cfg)
    assert {u.name: u.numel for u in adapter.units} == {u: shape.unit_params(u) for u in shape.unit_names()}


def test_kept_internals_skip_the_recompute_and_the_input_boundary():
    """A layer with kept internals runs its forward with a graph and backpropagates through it:
    no fetch or recompute of its input boundary, a fetch of its internals on the host tier only;
    a dropped boundary above it is still recomputed from the stored one below."""
    plan = Plan(["device", "recompute", "recompute", "host"], internal_tiers=["recompute", "host", "recompute", "device"])
    ops = [str(op) for op in micro_batch_program(plan.boundary_tiers, plan.internal_tiers)]
    assert ops == [
        "embed_fwd", "layer_fwd 0", "layer_fwd_keep 1", "layer_fwd 2", "layer_fwd_keep 3", "head",
        "layer_bwd_kept 3",
        "fetch 0", "recompute_layer 0", "recompute_layer 1", "layer_bwd 2",
        "fetch_internals 1", "layer_bwd_kept 1", "layer_bwd 0", "embed_bwd"]


LAYER_MAJOR_PLANS = {
    "every-1 x4": Plan.every_k(10, 1, num_micro_batches=4, micro_batches_per_load=4),
    "every-3 x4, 5 resident": Plan.every_k(10, 3, num_micro_batches=4, micro_batches_per_load=4,
                                           resident_layers=[0, 1, 2, 3, 4]),
    "host x4": Plan.keep_all(10, "host", num_micro_batches=4, micro_batches_per_load=4),
    "recompute-all x2": Plan.recompute_all(10, num_micro_batches=4, micro_batches_per_load=2),
    "internals-host x4": Plan(["recompute"] * 10, internal_tiers=["host"] * 10, num_micro_batches=4,
                              micro_batches_per_load=4),
    "all resident": Plan.every_k(10, 1, num_micro_batches=4, resident_layers=list(range(10))),
}


@pytest.mark.parametrize("name", sampled(LAYER_MAJOR_PLANS, {"every-3 x4, 5 resident", "internals-host x4"}))
def test_layer_major_and_resident_peaks_match_the_allocations(name, streamed_cpu):
    """Layer-major groups and resident layers against the step's real allocations: within 2%, at
    the same op. Mutation seen failing: ``memory.carried`` returning 0 (the group's other
    micro-batches' hidden states and their gradients uncounted: every-1 x4 3.9% short, host x4
    6.7%)."""
    plan = LAYER_MAJOR_PLANS[name]
    cfg = get_flavor("llama-30m").build_config(num_hidden_layers=10, hidden_size=128,
                                               intermediate_size=352, num_attention_heads=4,
                                               num_key_value_heads=2)
    adapter, store = init_store(cfg)
    engine = StreamingEngine(adapter, store, plan, EngineConfig())
    mbs = [Batch(ids, ids) for ids in torch.randint(0, cfg.vocab_size, (4, 2, 128))]
    engine.compute_grads(mbs)  # warm-up: fetch slots are allocated by a first step
    measured = measure_step_peak(engine, mbs)
    predicted = engine.predict_memory(2, 128)
    engine.close()
    assert abs(predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes < 0.02, (predicted, measured)
    assert predicted.peak_op == measured.peak_op
