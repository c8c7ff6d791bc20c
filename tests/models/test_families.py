"""Every family beyond the first four, its quirks switched on (windows shorter than the batch,
soft caps, sinks, latent attention, dense-first and MoE layers with the router aux loss,
linear attention): the engine's loss and every gradient equal plain HF autograd under every-1,
every-2, recompute-all and kept internals, and the export loads with ``from_pretrained``."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Gemma3Config, GPT2Config, LlamaConfig, RobertaConfig

from family_cases import (QUIRKY, assert_grads_close, engine_run, hf_case, hf_reference, make_batch,
                          uses_aux)
from layerwise.engine import StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.interop.recipes.store_export import export_store
from layerwise.models import DecoderAdapter
from layerwise.models.families import attn_implementation, family_of, model_dropouts
from layerwise.plan import Plan
from layerwise.store import HostStore
from matrix import sampled


def _plans(n: int) -> dict[str, tuple[Plan, str]]:
    """(plan, engine device): kept internals on the asynchronous backend, host and device tiers."""
    return {
        "every-1": (Plan.every_k(n, 1), "cpu"),
        "every-2": (Plan.every_k(n, 2), "cpu"),
        "recompute-all": (Plan.recompute_all(n), "cpu"),
        "kept-internals": (Plan((["host", "device"] * n)[:n], internal_tiers=(["host", "device"] * n)[:n]),
                           "cpu-async"),
    }


@pytest.mark.parametrize("flavor", QUIRKY)
def test_units_cover_every_saved_hf_tensor_once(flavor):
    cfg, model, adapter = hf_case(flavor)
    saved = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    if adapter.tied:
        del saved["lm_head.weight"]
    assert {p.hf_name: p.shape for u in adapter.units for p in u.params} == saved
    frozen = {p.hf_name for u in adapter.units for p in u.params if not p.trainable}
    assert frozen == set(saved) - {n for n, _ in model.named_parameters()}


@pytest.mark.parametrize("flavor", sampled(QUIRKY, {"gemma2-debug", "gpt-oss-debug", "phi3-debug",
                                                    "deepseek-v3-debug", "qwen3-next-debug"}))
def test_engine_equals_hf_autograd_for_every_plan(flavor, tmp_path):
    """Mutations seen failing: the router logits' aux gradient dropped in ``LayerTail`` (the
    MoE flavors' router weights off by 100%); the embedding scale left out of
    ``embed_weight_grad`` (gemma); the logit soft cap left out of ``head_logits`` (gemma2)."""
    cfg, model, adapter = hf_case(flavor)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref_grads = hf_reference(model, cfg, [batch])
    for name, (plan, device) in _plans(adapter.num_layers).items():
        loss, grads, _ = engine_run(adapter, model, plan, [batch], device, str(tmp_path))
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_grads_close(grads, ref_grads)
        frozen = [p.hf_name for u in adapter.units for p in u.params if not p.trainable]
        assert all(not grads[n].any() for n in frozen), "a frozen tensor got a gradient"


@pytest.mark.parametrize("flavor", ["qwen3-moe-debug", "gpt-oss-debug"])
def test_aux_loss_of_several_micro_batches_is_their_token_weighted_mean(flavor):
    """Three micro-batches of different target counts: each adds HF's ``coef * aux`` of its own
    tokens weighted by its share of the step's target tokens (``models/moe.py``). Mutation seen
    failing: every micro-batch's aux loss added at weight 1 (HF Trainer's sum)."""
    cfg, model, adapter = hf_case(flavor)
    assert uses_aux(cfg)
    micro = [make_batch(cfg.vocab_size, batch=b, seq=10, seed=s) for b, s in ((1, 3), (2, 4), (1, 5))]
    micro[1].labels[1, :7] = -100
    ref_loss, ref_grads = hf_reference(model, cfg, micro)
    loss, grads, _ = engine_run(adapter, model, Plan.every_k(adapter.num_layers, 2), micro)
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("flavor", sampled(QUIRKY, {"gemma3-debug", "gpt-oss-debug", "glm4-debug",
                                                    "deepseek-v3-debug", "qwen3.5-moe-debug"}))
def test_export_loads_with_from_pretrained_and_gives_equal_logits(flavor, tmp_path):
    cfg, model, adapter = hf_case(flavor)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1))
    batch = make_batch(cfg.vocab_size, seed=2)
    engine.train_step([batch])
    engine.synchronize()
    frozen = {p.hf_name for u in adapter.units for p in u.params if not p.trainable}
    for name in frozen:  # a buffer saved with the weights is never trained
        assert torch.equal(store.state_dict()[name], model.state_dict()[name]), name
    out = export_store(store, tmp_path / "out")
    reloaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation=attn_implementation(cfg))
    ids = make_batch(cfg.vocab_size, seed=3).input_ids
    with torch.no_grad():
        ref = reloaded(ids).logits
        before = model(ids).logits
    got = engine.forward_logits(ids)
    engine.close()
    assert type(reloaded) is type(model)
    assert torch.allclose(got, ref, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(ref, before, atol=1e-4), "training changed nothing"


def test_refusal_names_the_layout_and_a_wrapper_gets_its_language_models_family():
    with pytest.raises(ValueError, match="unsupported architecture model_type='roberta'.*"
                                         "RobertaForCausalLM is an encoder model.*"
                                         "roberta.encoder.layer, BERT-style"):
        DecoderAdapter(RobertaConfig(num_hidden_layers=2))
    multimodal = family_of(Gemma3Config())  # its language model trains, its vision is carried
    assert (multimodal.text_model_type, multimodal.model_class_name) == \
        ("gemma3_text", "Gemma3ForConditionalGeneration")


def test_layers_of_different_structure_get_their_own_template():
    """DeepSeek-V3's dense first layer and its MoE layer; Qwen3-Next's linear- and
    full-attention layers; Gemma 3's sliding and full layers (same weights, other RoPE base)."""
    for flavor, templates, routers in (("deepseek-v3-debug", 2, ()), ("qwen3-next-debug", 2, (0, 1)),
                                       ("gemma3-debug", 2, ()), ("qwen3-moe-debug", 2, (1,))):
        _, _, adapter = hf_case(flavor)
        assert adapter.num_templates == templates, flavor
        assert adapter.router_layers == routers, flavor


def test_packed_batch_refuses_segment_ids_of_another_shape():
    cfg, model, adapter = hf_case("gemma-debug")
    batch = make_batch(cfg.vocab_size)
    store = HostStore(adapter)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1))
    with pytest.raises(ValueError, match="segment_ids .* must have the shape of input_ids"):
        engine.compute_grads([Batch(batch.input_ids, batch.labels, torch.zeros(2, 5, dtype=torch.long))])
    engine.close()


def test_the_models_own_dropout_is_named_where_its_config_sets_it():
    """A training run warns that these are off (the engine runs the modules as in eval)."""
    assert model_dropouts(GPT2Config()) == {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1}
    assert model_dropouts(LlamaConfig()) == {}
    assert model_dropouts(LlamaConfig(attention_dropout=0.05)) == {"attention_dropout": 0.05}
