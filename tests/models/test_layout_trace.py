"""Where a causal LM keeps its parts is read off the model (``models/layout.py``), not a table:
the meta-device trace of its base model's forward finds what runs before and after the layers
and what the layers are given."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.models.falcon.modeling_falcon import FalconDecoderLayer

from layerwise.models.layout import _uses_alibi, decoder_layout
from sweep_cases import tiny_config


def _layout(model_type: str):
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    return decoder_layout(model, model_type, model.config.num_hidden_layers)


def test_the_trace_finds_each_layout_and_what_its_layers_take():
    """Phi registers its final norm after a dropout and LFM2 calls its final norm
    ``embedding_norm``: the order is the forward's, the names the model's. Mutations seen failing:
    the probe not recording the required arguments given as None (Falcon's ``alibi`` where the
    installed transformers passes it; in the engine: ``missing 1 required positional
    argument``); the trace run with SDPA (no layer gets a 4-D mask, so a recurrent layer cannot
    be told from an attention one)."""
    llama = _layout("llama")
    assert (llama.base, llama.embed, llama.pre, llama.layers, llama.post, llama.head) == \
        ("model", "embed_tokens", (), "layers", ("norm",), "lm_head")
    assert llama.layer_inputs == {"attention_mask", "position_ids", "position_embeddings"}
    assert llama.masked_layers == {0, 1}
    gpt2 = _layout("gpt2")
    assert (gpt2.base, gpt2.embed, gpt2.pre, gpt2.layers, gpt2.post, gpt2.rotary) == \
        ("transformer", "wte", ("wpe",), "h", ("ln_f",), None)
    assert gpt2.layer_prefix(3) == "transformer.h.3."
    opt = _layout("opt")
    assert (opt.base, opt.pre, opt.post) == ("model.decoder", ("embed_positions",), ("final_layer_norm",))
    neox = _layout("gpt_neox_japanese")
    assert (neox.base, neox.post, neox.head) == ("gpt_neox_japanese", ("final_layer_norm",), "embed_out")
    assert _layout("phi").post == ("final_layernorm",)
    assert _layout("lfm2").post == ("embedding_norm",)
    # transformers up to 5.24 calls Falcon's layers with ``alibi=None``, a required argument;
    # 5.25 folds ALiBi into the mask and its layers take no ``alibi``
    takes_alibi = "alibi" in inspect.signature(FalconDecoderLayer.forward).parameters
    assert _layout("falcon").none_inputs == ({"alibi"} if takes_alibi else set())
    mamba = _layout("mamba")
    assert (mamba.base, mamba.embed, mamba.rotary, mamba.masked_layers) == \
        ("backbone", "embeddings", None, frozenset())


def test_a_falcon_with_alibi_is_refused_in_one_line():
    """Falcon's ALiBi biases are the base model's: transformers up to 5.24 gives them to every
    layer (refused as an input layerwise does not compute), 5.25 folds them into the attention
    mask, where the trace cannot see them, so the config is read. Mutation seen caught (with
    transformers 5.25): the check removed; the engine then trained the model without its biases
    (loss 4.48381 against HF's 4.48408 on the sweep's tiny model), with no error."""
    cfg = tiny_config("falcon")
    cfg.alibi = True
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg).eval()
    with pytest.raises(ValueError) as e:
        decoder_layout(model, "falcon", cfg.num_hidden_layers)
    assert "alibi" in str(e.value).lower() and "\n" not in str(e.value)  # either refusal
    assert str(e.value).startswith("unsupported architecture model_type='falcon'")


@pytest.mark.parametrize("model_type, alibi", [("falcon", False), ("mpt", True), ("bloom", True),
                                               ("llama", False), ("gpt2", False)])
def test_alibi_is_read_off_the_model(model_type, alibi):
    """Bloom and MPT are refused before this is asked (an embedding norm, ``position_bias``); the
    reading stands behind those for the day their biases move into the mask as Falcon's did.
    Mutation seen caught: Bloom's fallback (no flag: a base model that builds the biases) dropped."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(tiny_config(model_type)).eval()
    base = model.get_submodule(next(n for n, _ in model.named_children()))
    assert _uses_alibi(base) is alibi


@pytest.mark.parametrize("model_type, why", [
    ("bloom", "runs word_embeddings_layernorm (LayerNorm) on the embeddings"),
    ("mpt", "gives every layer position_bias"),
    ("roberta", "RobertaForCausalLM is an encoder model"),
])
def test_what_the_trace_cannot_run_is_refused_in_one_line(model_type, why):
    """An embedding norm would need the embedding's weights in its backward (the engine's has
    none); ALiBi biases are computed by the base model; an encoder is called one."""
    with pytest.raises(ValueError) as e:
        _layout(model_type)
    assert why in str(e.value) and "\n" not in str(e.value)
    assert str(e.value).startswith(f"unsupported architecture model_type={model_type!r}")


def test_buffers_are_rebuilt_for_the_building_thread_alone():
    """GPT-Neo's causal-mask tables are rebuilt by building the model with its parameters on the
    meta device; a module another thread builds meanwhile keeps real parameters (an engine may
    be running there). Mutation seen failing: the patch of ``register_parameter`` applied to
    every thread (the other thread's ``nn.Linear`` on meta)."""
    import threading

    from torch import nn

    from layerwise.models import DecoderAdapter
    from layerwise.models import adapter as adapter_module

    adapter = DecoderAdapter(tiny_config("gpt_neo"))
    masks = [b for n, b in adapter._transient.items() if n.endswith("attn.attention.bias")]
    assert masks and all(b.device.type == "cpu" and b.dtype == torch.bool for b in masks)
    seen = {}
    with adapter_module._parameters_on_meta():
        other = threading.Thread(target=lambda: seen.setdefault("other", nn.Linear(2, 2).weight.device.type))
        other.start()
        other.join()
        seen["own"] = nn.Linear(2, 2).weight.device.type
    assert seen == {"other": "cpu", "own": "meta"}
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone afterwards
