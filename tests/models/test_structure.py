"""Per-layer facts (bytes of every expert, FLOPs of the routed ones) and the model FLOPs of a
micro-batch, packed examples counting attention over their own spans only."""

import pytest
import torch

from family_cases import hf_case
from layerwise.models.attention import row_layout
from layerwise.models.structure import attention_pairs, layer_facts, model_flops
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.shape import ModelShape


def test_dense_model_flops_are_the_cost_models():
    cfg, _, adapter = hf_case("llama-debug")
    flops = model_flops(layer_facts(adapter), cfg.hidden_size, cfg.vocab_size, row_layout((2, 12)))
    assert flops == CostModel(ModelShape.from_config(cfg), PRESETS["cpu"], 2, 12).model_flops()


def test_moe_layer_streams_every_expert_and_computes_top_k():
    """qwen3-moe-debug: layer 0 dense (``mlp_only_layers``), layer 1 with 4 experts, top-2.
    Mutation seen failing: routed experts counted in full in the active weights."""
    cfg, model, adapter = hf_case("qwen3-moe-debug")
    dense, moe = layer_facts(adapter)
    assert (dense.num_experts, moe.num_experts, moe.experts_per_token) == (0, 4, 2)
    layer = model.model.layers[1]
    assert moe.params == sum(t.numel() for t in layer.state_dict().values())
    experts = sum(p.numel() for n, p in layer.named_parameters() if ".experts." in n)
    assert experts == moe.routed_expert_params == 4 * 3 * cfg.hidden_size * cfg.moe_intermediate_size
    matmul = sum(p.numel() for p in layer.parameters() if p.dim() >= 2)
    assert moe.active_matmul_params == matmul - experts + experts * 2 // 4


def test_packed_examples_count_attention_over_their_own_spans():
    """Rows of examples 5+4+3 and 6+3+(3 padding): the tokens' matmul FLOPs are the unpacked
    row's, the attention pairs each span's own. Mutation seen failing: a packed row's pairs
    counted over the whole row (``spans = [s] * b``)."""
    cfg, _, adapter = hf_case("gemma3-debug")  # a sliding (window 5) and a full layer
    facts = layer_facts(adapter)
    seg = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3, [3] * 6 + [4] * 3 + [-1] * 3])
    packed = model_flops(facts, cfg.hidden_size, cfg.vocab_size, row_layout((2, 12), seg))
    whole = model_flops(facts, cfg.hidden_size, cfg.vocab_size, row_layout((2, 12)))
    spans = (5, 4, 3, 6, 3, 3)
    saved = sum(f.pair_flops * (2 * attention_pairs(12, f.window)
                                - sum(attention_pairs(n, f.window) for n in spans)) for f in facts)
    assert saved > 0
    assert packed == pytest.approx(whole - 3.0 * saved, rel=1e-12)
