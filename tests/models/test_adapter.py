"""Model adapters: units, key maps, templates, flavors."""

import pytest
import torch

from layerwise.models import DecoderAdapter, FLAVORS, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.store import FlatLayout, HostStore


@pytest.mark.parametrize("flavor", ["llama-debug", "llama-debug-tied", "qwen2-debug", "qwen3-debug",
                                    "mistral-debug"])
def test_units_cover_every_hf_parameter_once(flavor):
    cfg = get_flavor(flavor).build_config()
    adapter = DecoderAdapter(cfg)
    model = build_hf_model(cfg)
    hf = {n: tuple(p.shape) for n, p in model.named_parameters()}  # tied head listed once
    mine = {p.hf_name: p.shape for u in adapter.units for p in u.params}
    assert mine == hf
    assert [u.name for u in adapter.units] == (
        ["embed"] + [f"layers.{i}" for i in range(cfg.num_hidden_layers)] + ["head"])
    assert adapter.num_params() == sum(p.numel() for p in model.parameters())
    assert adapter.num_templates == 1  # identical blocks share one meta template
    assert ("lm_head.weight" in mine) != adapter.tied


def test_flat_layout_puts_matrices_first_and_views_share_storage():
    """Mutations this test was seen to catch: ``decay_numel`` left at 0 (nothing decayed; the
    old ``all(...)`` over the decayed params passed on an empty list); 1-D params sorted first."""
    adapter = DecoderAdapter(get_flavor("qwen2-debug").build_config())
    layout = FlatLayout.of(adapter.units[1])
    flat = torch.arange(layout.numel, dtype=torch.float32)
    views = layout.views(flat)
    assert all(v.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for v in views.values())
    # exactly the matrices are decayed, and they form one slice at the front
    # (qwen2 has 1-D biases and norms in a layer, so both sides are non-empty)
    dims = [len(p.shape) for p in layout.specs]
    assert 1 in dims and 2 in dims
    decayed = [len(p.shape) >= 2 for p, o in zip(layout.specs, layout.offsets) if o < layout.decay_numel]
    assert decayed == [d >= 2 for d in dims][:len(decayed)] and decayed == [True] * dims.count(2)
    assert layout.decay_numel == sum(p.numel for p in layout.specs if len(p.shape) >= 2)
    assert sum(p.numel for p in layout.specs) == layout.numel


def test_store_round_trips_the_hf_state_dict():
    cfg = get_flavor("llama-debug-tied").build_config()
    model = build_hf_model(cfg, seed=3)
    store = HostStore(DecoderAdapter(cfg))
    store.copy_from_model(model)
    sd = store.state_dict()
    params = dict(model.named_parameters(remove_duplicate=False))
    assert set(sd) == set(params)
    for name, p in params.items():
        assert torch.equal(sd[name], p), name
    assert sd["lm_head.weight"] is sd["model.embed_tokens.weight"]


def test_real_shapes_have_the_published_sizes():
    expected_b = {"llama3-8b": 8.0, "llama3-70b": 70.6, "qwen2.5-7b": 7.6, "qwen2.5-32b": 32.8,
                  "qwen2.5-72b": 72.7, "qwen2.5-3b": 3.1, "qwen2.5-14b": 14.8}
    for name, billions in expected_b.items():
        adapter = DecoderAdapter(get_flavor(name).build_config())
        assert adapter.num_params() / 1e9 == pytest.approx(billions, rel=0.02), name


def test_unknown_flavor_lists_the_known_ones():
    with pytest.raises(ValueError, match="known flavors: .*llama-debug"):
        get_flavor("llama-9000")
    assert "qwen-27b" in FLAVORS
