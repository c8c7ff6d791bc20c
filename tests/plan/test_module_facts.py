"""The planner's per-layer numbers read off the (meta) modules equal its closed forms where those
exist (Llama, Qwen2, Qwen3, Mistral): a family outside the table needs no formula of its own."""

from __future__ import annotations

import pytest

from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.structure import layer_facts
from layerwise.plan.shape import ModelShape


@pytest.mark.parametrize("flavor", ["llama-debug", "qwen2-debug", "qwen3-debug", "mistral-debug",
                                    "llama3-8b", "qwen2.5-14b"])
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
