"""Model adapters: units, key maps, templates, flavors."""

import pytest
import torch

from layerwise.models import DecoderAdapter, FLAVORS, get_flavor
from layerwise.models import adapter as A
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


def test_a_layer_binds_its_tensors_as_functional_call_does_and_gives_the_template_back():
    """The adapter's own binding (``adapter._functional_call``) computes what
    ``torch.func.functional_call`` computes, bit for bit (the module's forward is the same code
    on the same tensors), gradients included; the template holds its own tensors again after a
    call, and after one that raises; a missing or unknown name gets functional_call's error.

    Mutation seen caught: the template's tensors not put back (no ``finally``): the raising
    call leaves a layer's real weight in the meta template."""
    adapter = DecoderAdapter(get_flavor("qwen3-debug").build_config())
    layout = FlatLayout.of(adapter.units[1])
    flat = (torch.randn(layout.numel) * 0.02).requires_grad_()
    t = adapter._template_of_layer[0]
    module, params = t.module, layout.views(flat)
    ctx = adapter.layer_context((2, 8), "cpu", torch.float32, adapter.new_rotary("cpu"))
    kw = {"attention_mask": ctx.masks.get(adapter.layer_types[0]), "position_ids": ctx.position_ids,
          "position_embeddings": ctx.rope[adapter._rope_key[0]]}
    kw = {k: v for k, v in kw.items() if k in t.inputs}
    own = {n: t for n, t in list(module.named_parameters()) + list(module.named_buffers())}
    x = torch.randn(2, 8, adapter.config.hidden_size)
    mine = A._functional_call(module, params, (x,), kw, strict=True)[0]
    ref = torch.func.functional_call(module, params, (x,), kw, strict=True)[0]
    assert torch.equal(mine, ref)
    g_mine, = torch.autograd.grad(mine.square().sum(), flat)
    g_ref, = torch.autograd.grad(ref.square().sum(), flat)
    assert torch.equal(g_mine, g_ref)
    with pytest.raises(RuntimeError):
        A._functional_call(module, params, (torch.randn(2, 8, 3),), kw, strict=True)
    after = dict(list(module.named_parameters()) + list(module.named_buffers()))
    assert after.keys() == own.keys() and all(after[n] is own[n] for n in own)
    missing = dict(list(params.items())[1:])
    with pytest.raises((RuntimeError, KeyError, ValueError)):
        A._functional_call(module, missing, (x,), kw, strict=True)
    with pytest.raises((RuntimeError, KeyError, ValueError)):
        A._functional_call(module, {**params, "no.such": flat[:1]}, (x,), kw, strict=True)
