"""Layers that differ in the planner: per-layer bytes (every expert), FLOPs (routed experts at
top-k, latent and linear attention) and memory, for the families beyond the first four, and
the real shapes of their popular models as presets."""

from dataclasses import replace

import pytest

from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.attention import row_layout
from layerwise.models.registry import FAMILY_PRESETS, FLAVORS
from layerwise.models.structure import layer_facts, model_flops
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.memory import layer_workspace_bytes, mask_bytes
from layerwise.plan.plan import Plan
from layerwise.plan.shape import ModelShape, load_shape
from layerwise.planner.simulator import simulate
from matrix import sampled

PUBLISHED_B = {"gpt-oss-20b": (20.9, 3.6), "gpt-oss-120b": (116.8, 5.1), "qwen3-30b-a3b": (30.5, 3.3),
               "gemma-3-27b": (27.0, 27.0), "phi-4": (14.7, 14.7), "deepseek-v3": (671.0, 37.0),
               "qwen3-next-80b-a3b": (80.0, 3.0)}
"""(total, active) billions of parameters as published (active: without the input embedding,
as the model cards count it, rounded there: within 20%; DeepSeek-V3 without its MTP layer)."""


@pytest.mark.parametrize("name", sampled(FAMILY_PRESETS, {"gpt-oss-20b", "gemma-3-27b"}))
def test_presets_have_the_published_sizes(name):
    shape = load_shape(name)
    total, active = PUBLISHED_B[name]
    assert shape.num_params / 1e9 == pytest.approx(total, rel=0.01)
    assert (shape.active_params - shape.embed_params * (1 - shape.tied)) / 1e9 == pytest.approx(active, rel=0.2)


def test_deepseek_and_qwen3_next_layers_differ_where_their_configs_say():
    # the presets' configs cut to their first layers: the per-layer facts are the same
    ds = ModelShape.from_config(FLAVORS["deepseek-v3"].build_config(num_hidden_layers=4))
    assert [c.num_experts for c in ds.layers[:4]] == [0, 0, 0, 256]
    assert ds.unit_params("layers.3") > 20 * ds.unit_params("layers.0") / 2  # all 256 experts
    cfg = FLAVORS["qwen3-next-80b-a3b"].build_config()
    nxt = ModelShape.from_config(FLAVORS["qwen3-next-80b-a3b"].build_config(
        num_hidden_layers=4, layer_types=cfg.layer_types[:4]))
    assert [c.pair_flops > 0 for c in nxt.layers[:4]] == [False, False, False, True]
    assert all(c.mixer_flops_per_token > 0 for c in nxt.layers[:3])


def test_moe_layer_is_transfer_bound_where_a_dense_one_of_its_size_is_not():
    """Bytes are all experts, FLOPs the routed ones: qwen3-30b-a3b streams ~8x more bytes per
    FLOP than a dense layer of the same size would. Mutation seen failing: ``layer_fwd_flops``
    counting every expert (``matmul_params`` replaced by ``params``)."""
    shape = load_shape("qwen3-30b-a3b")
    cost = CostModel(shape, PRESETS["h200"], 1, 4096)
    c = shape.layers[0]
    dense_flops = 2.0 * c.params * cost.tokens + c.pair_flops * shape.attention_pairs(4096, None)
    assert cost.layer_fwd_flops(0) < dense_flops / 6
    assert cost.unit_weight_bytes("layers.0") == c.params * cost.elem_bytes


@pytest.mark.parametrize("flavor", ["qwen3-moe-debug", "deepseek-v3-debug", "qwen3-next-debug", "gemma3-debug"])
def test_cost_model_flops_are_the_training_reports(flavor):
    """One FLOP count: the planner's model FLOPs of a micro-batch equal the ones the training
    report divides by the step time (``models/structure.py``), per layer."""
    cfg = get_flavor(flavor).build_config()
    adapter = DecoderAdapter(cfg)
    reported = model_flops(layer_facts(adapter), cfg.hidden_size, cfg.vocab_size, row_layout((2, 12)))
    planned = CostModel(load_shape(flavor), PRESETS["cpu"], 2, 12).model_flops()
    assert planned == pytest.approx(reported, rel=1e-12)


def test_simulator_streams_each_layer_its_own_bytes():
    """deepseek-v3-debug: a dense first layer and an MoE one. The simulated H2D time is each
    layer's own bytes, twice (forward and backward, every-1): with every layer taken as the
    first, it is shorter by exactly the difference. Mutation seen failing: ``unit_params``
    returning the closed-form layer for every layer."""
    shape = load_shape("deepseek-v3-debug")
    hw = PRESETS["h200"]
    plan = Plan.every_k(shape.num_layers, 1, seq_len=512, micro_batch_size=2)
    uniform = replace(shape, layers=(shape.layers[0],) * shape.num_layers)
    extra = shape.unit_params("layers.1") - shape.unit_params("layers.0")
    assert extra > 0
    saved_s = simulate(plan, shape, hw).busy_s["h2d"] - simulate(plan, uniform, hw).busy_s["h2d"]
    assert saved_s == pytest.approx(2 * extra * hw.compute_dtype_bytes / (hw.h2d_gbps * 1e9), rel=1e-6)


def test_workspace_is_per_layer():
    shape = load_shape("qwen3-next-debug")
    linear, full = (layer_workspace_bytes(shape, 1024, 2, i) for i in range(2))
    assert linear != full and min(linear, full) > 0
    assert CostModel(shape, PRESETS["h200"], 1, 1024).layer_workspace_bytes == max(linear, full)


@pytest.mark.parametrize("flavor", ["llama-debug", "mistral-debug", "gpt-oss-debug", "gemma3-debug",
                                    "qwen3-next-debug"])
def test_mask_bytes_are_the_masks_the_adapter_builds(flavor):
    """Packed and unpacked rows, SDPA (boolean) and eager (float), sliding, full and linear
    layers: the memory model's mask bytes are the bytes of the masks a micro-batch's
    ``LayerContext`` holds. Mutation seen failing: one mask per micro-batch whatever the
    attention types (the model's count before per-type masks)."""
    import torch

    cfg = get_flavor(flavor).build_config()
    adapter = DecoderAdapter(cfg)
    shape = load_shape(flavor)
    rotary = adapter.new_rotary("cpu")
    seg = torch.tensor([[0] * 5 + [1] * 7, [2] * 12])
    for packed, segment_ids in ((True, seg), (False, None)):
        ctx = adapter.layer_context((2, 12), "cpu", torch.float32, rotary, segment_ids)
        built = sum(m.numel() * m.element_size() for m in ctx.masks.values() if m is not None)
        assert mask_bytes(shape, 2, 12, 4, packed=packed) == built, packed
