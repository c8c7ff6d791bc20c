"""The one table of family facts: what differs between the decoder families layerwise trains.

A unit of the engine runs Hugging Face's own decoder-layer module (``models/adapter.py``), so
everything *inside* a layer (fused projections, partial rotary, qk-norm, post-norms, multi-head
latent attention, attention sinks, linear attention, routed and shared experts) needs no code
here. What the table holds is what HF's *model* forward does around the layers, and the few
facts the engine cannot read off the modules:

- the attention implementation the layers must run with (``eager`` where SDPA lacks a feature
  the family uses: soft-capped scores, sinks);
- the embedding scale (Gemma multiplies the embeddings by ``sqrt(hidden)``);
- the final-logit soft cap (Gemma 2/3);
- where a ``sliding_window`` without ``layer_types`` applies (every layer: Mistral, Mixtral,
  Phi-3, Qwen3-MoE; otherwise ``layer_types`` says per layer).

Per-layer attention types, windows and RoPE bases come from the config (``layer_types``, the
rotary module's ``layer_type`` argument); MoE facts from the modules (``models/moe.py``). A new
family that follows HF's decoder-layer conventions is one row. Classes are named, not imported,
so that reading the table costs no import of a modeling file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import transformers
from transformers import PretrainedConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
"""A recurrent token mixer (gated delta net): no mask; a packed row runs example by example."""
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION)


def _sqrt_hidden(config: Any) -> float:
    return float(config.hidden_size) ** 0.5


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    """As in ``config.json``."""
    config_class_name: str
    model_class_name: str
    """The causal-LM class (``…ForCausalLM``) in ``transformers``."""
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2), whatever ``attention_bias`` says (shape facts)."""
    qk_norm: bool = False
    """RMSNorm on q and k per head (Qwen3): ``2 * head_dim`` extra weights per layer (shape facts)."""
    window_on_every_layer: bool = False
    """``sliding_window`` applies to every layer when the config has no ``layer_types``;
    otherwise only the layers ``layer_types`` marks ``sliding_attention`` are windowed."""
    attn_implementation: str = "sdpa"
    """``eager`` where HF's SDPA path lacks a feature of the family (gpt-oss's sinks, Gemma 2's
    soft-capped scores). Any config with ``attn_logit_softcapping`` set runs eager too."""
    embed_scale: Callable[[Any], float] | None = None
    """The factor HF's embedding multiplies its output by (cast to the weight dtype first)."""
    logit_softcap: str | None = None
    """The config attribute of the final-logit soft cap: ``cap * tanh(logits / cap)``."""
    rope_position_axes: int = 0
    """The rotary module takes position ids per axis, ``[axes, b, s]`` (Qwen3.5's multimodal
    RoPE: text positions repeated on its 3 axes, as its text model does); 0: ``[b, s]``."""
    quirks: str = ""
    """What the row's family brings (for the list of supported families)."""
    fused_experts: bool = False
    """Each MoE layer keeps its routed experts as fused ``[num_experts, ...]`` tensors
    (``mlp.experts.<proj>``), so a checkpoint may version each expert on its own: a slice of
    those tensors (``ckpt.expert_groups``)."""
    closed_form_shape: bool = False
    """Every layer is the same dense Llama-style block, so the planner's closed-form sizes and
    fitted memory formulas (``plan/shape.py``) are exact; otherwise the planner reads per-layer
    sizes and FLOPs off the (meta) modules (``models/structure.py``)."""

    @property
    def config_class(self) -> type:
        return getattr(transformers, self.config_class_name)

    @property
    def model_class(self) -> type:
        return getattr(transformers, self.model_class_name)


FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (
    FamilySpec("llama", "LlamaConfig", "LlamaForCausalLM", closed_form_shape=True),
    FamilySpec("mistral", "MistralConfig", "MistralForCausalLM", window_on_every_layer=True,
               quirks="sliding window", closed_form_shape=True),
    FamilySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", qkv_bias=True, quirks="qkv bias",
               closed_form_shape=True),
    FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", qk_norm=True, quirks="qk-norm",
               closed_form_shape=True),
    FamilySpec("gemma", "GemmaConfig", "GemmaForCausalLM", embed_scale=_sqrt_hidden,
               quirks="embedding scale"),
    FamilySpec("gemma2", "Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager",
               embed_scale=_sqrt_hidden, logit_softcap="final_logit_softcapping",
               quirks="attention and logit soft-capping, sliding layers, post-norms"),
    FamilySpec("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", qk_norm=True,
               embed_scale=_sqrt_hidden, logit_softcap="final_logit_softcapping",
               quirks="sliding/full layers with their own RoPE bases, qk-norm"),
    FamilySpec("gpt_oss", "GptOssConfig", "GptOssForCausalLM", fused_experts=True,
               attn_implementation="eager",
               quirks="attention sinks, sliding/full layers, MoE with biased experts"),
    FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM", window_on_every_layer=True,
               quirks="fused qkv and gate/up projections (Phi-3, Phi-4)"),
    FamilySpec("glm4", "Glm4Config", "Glm4ForCausalLM", qkv_bias=True,
               quirks="partial rotary, post-norms, fused gate/up"),
    FamilySpec("olmo2", "Olmo2Config", "Olmo2ForCausalLM", quirks="post-norms, full-width qk-norm"),
    FamilySpec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", fused_experts=True,
               quirks="multi-head latent attention, dense first layers, grouped routing, "
                      "shared experts"),
    FamilySpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", fused_experts=True,
               qk_norm=True,
               window_on_every_layer=True, quirks="MoE, mlp_only_layers"),
    FamilySpec("mixtral", "MixtralConfig", "MixtralForCausalLM", fused_experts=True,
               window_on_every_layer=True,
               quirks="MoE"),
    FamilySpec("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", fused_experts=True,
               qk_norm=True,
               quirks="linear-attention layers, gated attention, MoE with a gated shared expert"),
    FamilySpec("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qk_norm=True,
               rope_position_axes=3, quirks="linear-attention layers, multi-axis RoPE"),
    FamilySpec("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
               fused_experts=True, qk_norm=True,
               rope_position_axes=3, quirks="linear-attention layers, MoE with a gated shared expert"),
)}

TEXT_MODEL_OF = {"gemma3": "gemma3_text", "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
"""Multimodal wrappers whose language model is a supported family."""


def supported_families() -> str:
    """One line per family: its ``model_type`` and what it brings."""
    return "; ".join(f"{s.model_type}" + (f" ({s.quirks})" if s.quirks else "")
                     for s in FAMILIES.values())


def family_of(config: PretrainedConfig | Any) -> FamilySpec:
    """The family of ``config``, or a clear error for an unsupported one."""
    model_type = getattr(config, "model_type", None)
    if model_type in TEXT_MODEL_OF:
        raise ValueError(
            f"model_type={model_type!r} is a multimodal wrapper; layerwise trains decoder-only "
            f"causal LMs: use its language model's config (text_config, model_type="
            f"{TEXT_MODEL_OF[model_type]!r}) and a checkpoint with that model's keys")
    if model_type not in FAMILIES or not hasattr(transformers, FAMILIES[model_type].model_class_name):
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}; layerwise supports "
            f"(decoder-only causal LMs): {supported_families()}. A family that follows Hugging "
            "Face's decoder-layer conventions is one row of layerwise/models/families.py; "
            "convert the model or open an issue.")
    return FAMILIES[model_type]


def attn_implementation(config: PretrainedConfig | Any) -> str:
    """The attention implementation the family's layers run with (the engine and the HF
    reference alike)."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        return "eager"  # SDPA has no soft-capped scores
    return family_of(config).attn_implementation


def layer_attention_types(config: PretrainedConfig | Any) -> list[str]:
    """The token mixer of every decoder layer: one of ``ATTENTION_TYPES``."""
    spec = family_of(config)
    types = getattr(config, "layer_types", None)
    if types:
        types = list(types)[:config.num_hidden_layers]
        unknown = sorted(set(types) - set(ATTENTION_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} of {spec.model_type} are not supported; "
                             f"layerwise runs {list(ATTENTION_TYPES)}")
        return types
    windowed = spec.window_on_every_layer and getattr(config, "sliding_window", None)
    return [SLIDING_ATTENTION if windowed else FULL_ATTENTION] * config.num_hidden_layers


def layer_windows(config: PretrainedConfig | Any) -> tuple[int | None, ...]:
    """The attention window of every layer (None = full causal, or no attention scores)."""
    window = getattr(config, "sliding_window", None)
    return tuple(window if t == SLIDING_ATTENTION else None for t in layer_attention_types(config))


def has_qkv_bias(config: PretrainedConfig | Any) -> bool:
    return family_of(config).qkv_bias or bool(getattr(config, "attention_bias", False))


EXPERT_COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts")
"""Where the families' configs give their number of routed experts."""


def fused_expert_count(config: PretrainedConfig | dict | None) -> int:
    """Routed experts per MoE layer of a family that keeps them fused (``fused_experts``), from
    a config object or ``config.json`` dict; 0 for any other model (nothing to split)."""
    if config is None:
        return 0
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    spec = FAMILIES.get(get("model_type"))
    if spec is None or not spec.fused_experts:
        return 0
    return next((int(n) for k in EXPERT_COUNT_KEYS if isinstance(n := get(k), int) and n > 1), 0)
