"""The planner's per-layer numbers read off the modules equal its closed forms where those exist
(Llama, Qwen2, Qwen3, Mistral): a family outside the table needs no formula of its own."""

from __future__ import annotations

import pytest

from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.saved_bytes import PROBE_SEQ_LENS, layer_saved_bytes, saved_bytes_by_layer
from layerwise.models.structure import layer_facts
from layerwise.plan.memory import layer_workspace_bytes
from layerwise.plan.shape import ModelShape

CLOSED_FORMS = ["llama-debug", "qwen2-debug", "qwen3-debug", "mistral-debug", "llama3-8b",
                "qwen2.5-14b"]


@pytest.mark.parametrize("flavor", CLOSED_FORMS)
def test_module_facts_equal_the_closed_forms(flavor):
    """Parameters, weights a token multiplies through, and FLOPs per attention pair, each
    within 2% (they are equal: the closed forms count the same tensors). Mutation seen failing:
    the pair FLOPs without the AV product (``_pair_flops``: ``2 * heads * qk``, half the closed
    form's ``4 * q_dim``)."""
    cfg = get_flavor(flavor).build_config()
    shape = ModelShape.from_config(cfg)
    assert not shape.layers, "a closed-form family: the planner uses the formulas"
    for f in layer_facts(DecoderAdapter(cfg)):
        assert f.params == pytest.approx(shape.layer_params, rel=0.02)
        assert f.active_matmul_params == pytest.approx(shape.layer_matmul_params, rel=0.02)
        assert f.pair_flops == pytest.approx(4.0 * shape.q_dim, rel=0.02)


@pytest.mark.parametrize("flavor", CLOSED_FORMS)
def test_saved_bytes_measured_equal_the_closed_form(flavor):
    """What a layer saves for its backward when it runs (transformers' module, SDPA) equals the
    memory model's formula within 2%, and grows with the tokens alone (SDPA keeps no attention
    probabilities). Mutations seen failing: the old formula (``4h + 3q + 4kv + 4i``: qwen3's
    q/k norms missing, 20% low), and the measurement counting the weights' storages (a
    llama-debug layer's weights are 12x its saved bytes at 16 tokens)."""
    cfg = get_flavor(flavor).build_config()
    shape = ModelShape.from_config(cfg)
    saved = layer_saved_bytes(DecoderAdapter(cfg), 0)
    assert saved.per_token_pos == 0
    assert saved.per_token == pytest.approx(layer_workspace_bytes(shape, 1, 4), rel=0.02)


def test_an_eager_kernel_s_probabilities_grow_with_the_row():
    """gpt-oss runs eager attention (sinks): its saved probabilities are ``heads`` fp32 values
    per token per position of the row; a kernel that saves none measures 0. Mutation seen
    failing: one probe length (the quadratic term folded into the per-token one: 0 here)."""
    cfg = get_flavor("gpt-oss-debug").build_config()
    saved = saved_bytes_by_layer(DecoderAdapter(cfg))
    heads = cfg.num_attention_heads
    assert all(s.per_token_pos == pytest.approx(4 * heads, rel=0.01) for s in saved)
    assert PROBE_SEQ_LENS[0] < PROBE_SEQ_LENS[1]


@pytest.mark.parametrize("flavor", ["qwen3-moe-debug", "qwen3-next-debug"])
def test_moe_and_hybrid_layers_are_measured_per_structure(flavor):
    """A MoE layer saves more than a dense one of the same attention (its routed tokens' copies),
    a linear-attention layer other than a full one; the shape carries each layer's own."""
    cfg = get_flavor(flavor).build_config()
    adapter = DecoderAdapter(cfg)
    shape = ModelShape.from_config(cfg, adapter=adapter)
    per_layer = {round(c.workspace_per_token, 3) for c in shape.layers}
    assert len(per_layer) == 2, per_layer
    assert all(c.workspace_per_token > 4 * cfg.hidden_size for c in shape.layers)
