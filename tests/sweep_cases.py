"""Every causal-LM ``model_type`` transformers has, shrunk to a tiny config by one generic rule.

Used by ``tests/models/test_sweep.py`` (and runnable alone: ``python tests/sweep_cases.py``
prints the outcome of every type). A type is *buildable* when its tiny config builds with
``AutoModelForCausalLM.from_config`` here and runs a forward; the rest are excluded with the
reason its build gave.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

VOCAB = 96
HIDDEN = 32
MAX_PARAMS = 2_000_000

_SIZES = {
    # the common names of the size fields, each with its tiny value
    "vocab_size": VOCAB, "hidden_size": HIDDEN, "d_model": HIDDEN, "n_embd": HIDDEN,
    "intermediate_size": 64, "ffn_hidden_size": 64, "n_inner": 64,
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2,
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4,
    "num_key_value_heads": 2, "head_dim": 8,
    "max_position_embeddings": 128, "n_positions": 128,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 16, "kv_lora_rank": 16, "qk_rope_head_dim": 4, "qk_nope_head_dim": 4,
    "v_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "sliding_window": 6,
    "attention_chunk_size": 4, "word_embed_proj_dim": HIDDEN,
}


def causal_lm_types() -> list[str]:
    """Every ``model_type`` in transformers' causal-LM auto mapping, sorted."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrunk(base: dict, sizes: dict) -> dict:
    """``base`` (a config dict) with every known size field of ``sizes`` made tiny, token ids
    inside the tiny vocabulary, every per-layer list (``layer_types``, ``mlp_layer_types``) cut
    to its first two distinct items (so a hybrid keeps both kinds), dropout off."""
    values = {k: v for k, v in sizes.items()
              if isinstance(base.get(k), int) and not isinstance(base.get(k), bool)}
    if isinstance(base.get("qk_rope_head_dim"), int):
        values["head_dim"] = values["qk_rope_head_dim"]  # MLA: RoPE spans the rope part only
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(base.get(key), int) and base[key] >= VOCAB:
            values[key] = min(base[key], 2)
    layers = next((base[k] for k in ("num_hidden_layers", "n_layer", "num_layers")
                   if isinstance(base.get(k), int)), None)
    for key, per_layer in base.items():  # layer_types, mlp_layer_types, …: one item a layer
        if isinstance(per_layer, list) and per_layer and len(per_layer) == layers \
                and all(isinstance(v, (str, int)) for v in per_layer):
            distinct = list(dict.fromkeys(per_layer))
            values[key] = (distinct * 2)[:2]
    for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop", "embd_pdrop", "attn_pdrop"):
        if isinstance(base.get(key), float):
            values[key] = 0.0
    return {**base, **values}


def tiny_config(model_type: str):
    """The type's default config shrunk by :func:`_shrunk`, built through the config class so
    that its own checks run."""
    base = _shrunk(AutoConfig.for_model(model_type).to_dict(), _SIZES)
    base.pop("model_type", None)
    return AutoConfig.for_model(model_type, **base)


_VISION_SIZES = {**_SIZES, "num_hidden_layers": 1, "depth": 1, "embed_dim": HIDDEN,
                 "out_hidden_size": HIDDEN, "projection_dim": HIDDEN, "num_heads": 4,
                 "vision_output_dim": HIDDEN, "projector_input_dim": HIDDEN,
                 "projector_output_dim": HIDDEN}
"""A vision tower's size fields (Qwen-VL's ``depth`` / ``embed_dim``; its output projected to
the text model's hidden size)."""


def image_text_types() -> list[str]:
    """Every ``model_type`` of transformers' image-text-to-text auto mapping, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    return sorted(MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)


def tiny_multimodal_config(model_type: str):
    """An image-text model's default config with its text and vision configs shrunk (the text
    one as :func:`tiny_config`'s, the vision one to one layer) and its projector's sizes with
    them."""
    base = _shrunk(AutoConfig.for_model(model_type).to_dict(), {"projector_hidden_size": HIDDEN})
    for key, sizes in (("text_config", _SIZES), ("vision_config", _VISION_SIZES)):
        if isinstance(base.get(key), dict):
            base[key] = _shrunk(base[key], sizes)
    base.pop("model_type", None)
    return AutoConfig.for_model(model_type, **base)


def build_multimodal(model_type: str):
    """(config, model in eval mode) of an image-text type, or (None, why it does not build)."""
    from transformers import AutoModelForImageTextToText

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = tiny_multimodal_config(model_type)
            type(cfg).from_dict(json.loads(cfg.to_json_string()))
            with torch.device("meta"):
                numel = sum(p.numel() for p in AutoModelForImageTextToText.from_config(cfg).parameters())
            if numel > 4 * MAX_PARAMS:
                return None, f"the generic rule leaves {numel / 1e6:.1f}M parameters (a size field it does not know)"
            torch.manual_seed(0)
            model = AutoModelForImageTextToText.from_config(cfg).eval()
            with torch.no_grad():
                model(input_ids=torch.randint(3, VOCAB, (1, 8)))
    except Exception as e:  # noqa: BLE001 — any failure of the build itself excludes the type
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return cfg, model


def build(model_type: str):
    """(config, model in eval mode) or (None, the reason it does not build here)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cfg = tiny_config(model_type)
            type(cfg).from_dict(json.loads(cfg.to_json_string()))  # what from_pretrained reads
            with torch.device("meta"):
                numel = sum(p.numel() for p in AutoModelForCausalLM.from_config(cfg).parameters())
            if numel > MAX_PARAMS:
                return None, f"the generic rule leaves {numel / 1e6:.1f}M parameters (a size field it does not know)"
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(cfg).eval()
            with torch.no_grad():
                model(torch.randint(3, VOCAB, (1, 8)))
    except Exception as e:  # noqa: BLE001 — any failure of the build itself excludes the type
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    return cfg, model


REFUSALS = ("unsupported architecture", "layer_types", "model_type=")
"""How layerwise's refusals begin: another layout or a family it names (``families.py``), an
attention type it does not run."""

ENCODER = "is an encoder model"
"""What a refusal says of a BERT-style model (its layers in an encoder stack): not a decoder."""

REFUSED_DECODERS = {
    # the decoder-only types layerwise refuses, each with its reason (the rest are encoders,
    # refused as such); any other refusal of a buildable type fails the sweep
    "beam": "a position-dependent attention scaling its base model computes for every layer",
    "blenderbot-small": "a LayerNorm on the embeddings before the first layer (not affine)",
    "bloom": "ALiBi biases, and a LayerNorm on the embeddings before the first layer",
    "doge": "a dynamic-mask attention that needs the dense mask on every layer",
    "hy_v4": "its base model's forward does not run on the meta device",
    "inkling_text": "a norm inside its token embedding (not affine)",
    "modernbert-decoder": "its head is not a plain lm_head Linear",
    "mpt": "ALiBi position biases its base model gives every layer",
    "nanochat": "a norm of the embeddings before the first layer (not affine)",
}
"""Decoder-only types refused, each with why (the stated exclusions of the sweep)."""


def check_refusal(model_type: str, error: ValueError) -> None:
    """A refusal is one line, begins as layerwise's do, and is expected: an encoder called one,
    or a decoder of :data:`REFUSED_DECODERS`."""
    text = str(error)
    assert "\n" not in text.strip(), "a refusal is one line"
    assert text.startswith(REFUSALS), f"{model_type}: not a refusal: {text}"
    assert ENCODER in text or model_type in REFUSED_DECODERS, \
        f"{model_type}: refused, and not one of the stated exclusions: {text}"


def saved_and_loaded(model_type: str, built, hub: Path, on_missing=None, refusal_expected=True):
    """(config, HF model, adapter, store): the built model saved to ``hub`` with
    ``save_pretrained`` and loaded by layerwise; the test skips, saying why, when the type does
    not build here or layerwise refuses it in one line (any other error fails it).
    ``on_missing(hub)``: called first when the directory's weights seem missing;
    ``refusal_expected``: a refusal must be a stated one (:func:`check_refusal`)."""
    import pytest

    from layerwise.interop.hf.model_dir import load_store

    cfg, model = built
    if cfg is None:
        pytest.skip(f"{model_type}: its tiny config does not build here ({model})")
    model.save_pretrained(hub)
    try:
        return (cfg, model, *load_store(hub))
    except ValueError as e:  # a clear refusal is the right answer for what cannot be trained
        if on_missing is not None and "weights missing" in str(e):
            on_missing(hub)
        if refusal_expected:
            check_refusal(model_type, e)
        else:
            assert "\n" not in str(e).strip() and str(e).startswith(REFUSALS), f"{model_type}: {e}"
        pytest.skip(f"{model_type}: refused: {e}")


def saved_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name → (shape, dtype) of every tensor in a model dir's safetensors files."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    out = {}
    for file in files:
        with safe_open(str(path / file), "pt") as f:
            for k in f.keys():
                t = f.get_slice(k)
                out[k] = (tuple(t.get_shape()), t.get_dtype())
    return out


def main() -> None:
    """Print every type's outcome (excluded: its build fails here; refused: layerwise's one-line
    reason; streamed: layerwise builds its units, and the sweep tests hold it to HF autograd)
    and the counts; ``--multimodal``: the image-text-to-text types."""
    import sys

    from layerwise.models import DecoderAdapter

    multimodal = "--multimodal" in sys.argv
    types, make = (image_text_types(), build_multimodal) if multimodal else (causal_lm_types(), build)
    counts: dict[str, int] = {}
    for t in types:
        cfg, model = make(t)
        if cfg is None:
            outcome, why = "excluded", model
        else:
            try:
                DecoderAdapter(cfg)
                outcome, why = "streamed", ""
            except ValueError as e:
                outcome, why = "refused", str(e)
        counts[outcome] = counts.get(outcome, 0) + 1
        print(f"{t:28s} {outcome:9s} {why}")
    built = counts.get("streamed", 0) + counts.get("refused", 0)
    print(json.dumps({"image_text_types" if multimodal else "causal_lm_types": len(types),
                      "buildable": built, **counts}))


if __name__ == "__main__":
    main()
