"""Family facts: what differs between the decoder families layerwise trains, and what it
cannot read off transformers' modules.

Layers and heads run as HF's own modules, so any causal-LM ``model_type`` gets a spec
(:func:`derived_family`); the table holds only what that derivation gets wrong or the planner
and checkpoints need (eager attention where SDPA lacks soft caps or sinks, sliding windows, shape
facts, fused experts, multi-axis RoPE). Classes are named, not imported, so reading the table
imports no modeling file."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import transformers
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers import PretrainedConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LINEAR_ATTENTION = "linear_attention"
"""A recurrent token mixer (gated delta net): no mask; a packed row runs example by example."""
CHUNKED_ATTENTION = "chunked_attention"
"""Causal attention within chunks of ``attention_chunk_size`` positions (Llama 4)."""
ATTENTION_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION, LINEAR_ATTENTION, CHUNKED_ATTENTION)


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
    rope_position_axes: int = 0
    """The rotary module takes position ids per axis, ``[axes, b, s]`` (Qwen3.5's multimodal
    RoPE: text positions repeated on its 3 axes, as its text model does); 0: ``[b, s]``."""
    fused_experts: bool = False
    """Each MoE layer keeps its routed experts as fused ``[num_experts, ...]`` tensors
    (``mlp.experts.<proj>``), so a checkpoint may version each expert on its own: a slice of
    those tensors (``ckpt.expert_groups``)."""
    text_model_type: str | None = None
    """The language model's family of a multimodal checkpoint (None: a text-only model)."""
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
               closed_form_shape=True),
    FamilySpec("qwen2", "Qwen2Config", "Qwen2ForCausalLM", qkv_bias=True, closed_form_shape=True),
    FamilySpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", qk_norm=True, closed_form_shape=True),
    FamilySpec("gemma", "GemmaConfig", "GemmaForCausalLM"),
    FamilySpec("gemma2", "Gemma2Config", "Gemma2ForCausalLM", attn_implementation="eager"),
    FamilySpec("gemma3_text", "Gemma3TextConfig", "Gemma3ForCausalLM", qk_norm=True),
    FamilySpec("gpt_oss", "GptOssConfig", "GptOssForCausalLM", fused_experts=True,
               attn_implementation="eager"),
    FamilySpec("phi3", "Phi3Config", "Phi3ForCausalLM", window_on_every_layer=True),
    FamilySpec("glm4", "Glm4Config", "Glm4ForCausalLM", qkv_bias=True),
    FamilySpec("olmo2", "Olmo2Config", "Olmo2ForCausalLM"),
    FamilySpec("deepseek_v3", "DeepseekV3Config", "DeepseekV3ForCausalLM", fused_experts=True),
    FamilySpec("qwen3_moe", "Qwen3MoeConfig", "Qwen3MoeForCausalLM", fused_experts=True,
               qk_norm=True, window_on_every_layer=True),
    FamilySpec("mixtral", "MixtralConfig", "MixtralForCausalLM", fused_experts=True,
               window_on_every_layer=True),
    FamilySpec("qwen3_next", "Qwen3NextConfig", "Qwen3NextForCausalLM", fused_experts=True,
               qk_norm=True),
    FamilySpec("qwen3_5_text", "Qwen3_5TextConfig", "Qwen3_5ForCausalLM", qk_norm=True,
               rope_position_axes=3),
    FamilySpec("qwen3_5_moe_text", "Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM",
               fused_experts=True, qk_norm=True, rope_position_axes=3),
)}

def text_config(config: PretrainedConfig | Any) -> PretrainedConfig | Any:
    """The language model's config: a multimodal config's ``text_config``, else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


@functools.cache
def _exported() -> frozenset[str]:
    """The names transformers exports, read without importing them (``hasattr`` on its lazy
    module imports the modeling module: ~2 s of ``layerwise plan`` for a name check)."""
    return frozenset(dir(transformers))


def family_of(config: PretrainedConfig | Any) -> FamilySpec:
    """The family of ``config``: its table row, else derived from its ``model_type``'s causal-LM
    class, or a clear error; a multimodal config gets its language model's
    (:func:`multimodal_family`)."""
    model_type = getattr(config, "model_type", None)
    text = text_config(config)
    if text is not config:
        try:
            text_spec = family_of(text)
        except ValueError:
            if getattr(text, "model_type", None) in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
                raise  # a causal LM layerwise refuses, inside a multimodal model too
            text_spec = None  # a language model that exists only inside (Qwen3-VL's)
        return multimodal_family(model_type, type(config).__name__, text_spec,
                                 getattr(text, "model_type", None))
    spec = FAMILIES.get(model_type)
    if spec is not None and spec.model_class_name in _exported():
        return spec
    return derived_family(model_type, type(config).__name__)


def multimodal_family(model_type: str | None, config_class_name: str, text: FamilySpec | None,
                      text_type: str | None) -> FamilySpec:
    """A multimodal checkpoint whose language model is of family ``text``: that family's facts with
    the image-text-to-text class (vision tower and projector carried unchanged and frozen)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES

    class_name = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type)
    if class_name is None or not hasattr(transformers, class_name):
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}: a model with a "
            f"{text_type!r} language model inside, but transformers "
            f"{transformers.__version__} has no image-text-to-text class for it; use a "
            f"text-only checkpoint of its language model (model_type={text_type!r})")
    if text is None:
        text = FamilySpec(text_type or "", "", "", window_on_every_layer=True)
    sdpa = getattr(getattr(transformers, class_name), "_supports_sdpa", False)
    return dataclasses.replace(text, model_type=model_type, config_class_name=config_class_name,
                               model_class_name=class_name, text_model_type=text.model_type,
                               closed_form_shape=False,
                               attn_implementation=text.attn_implementation if sdpa else "eager")


REFUSED: dict[str, str] = {
    "doge": "its dynamic-mask attention needs the dense causal mask on every layer, where "
            "layerwise passes none",
    "nanochat": "its base model normalises the embeddings before the first layer, which the "
                "embedding unit does not",
    "beam": "its full-attention layers take a position-dependent attention scaling that the "
            "base model computes",
}
"""Causal LMs of the right layout whose model forward does something around the layers that
layerwise does not replicate (found by the sweep: the engine's loss differs from HF's), each
with why; refused rather than trained with wrong numbers."""


@functools.lru_cache(maxsize=None)
def derived_family(model_type: str | None, config_class_name: str) -> FamilySpec:
    """The spec of a family outside the table, from transformers alone: its causal-LM class, SDPA
    where supported (else eager), and ``sliding_window`` on every layer unless
    ``use_sliding_window`` says otherwise. ``tests/models/test_sweep.py`` checks this against HF
    autograd."""
    class_name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if class_name is None or not hasattr(transformers, class_name):
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}: transformers "
            f"{transformers.__version__} has no causal LM of that type (layerwise trains "
            "decoder-only causal LMs); upgrade transformers if the model is newer, or use a "
            "decoder-only checkpoint")
    if model_type in REFUSED:
        raise ValueError(f"unsupported architecture model_type={model_type!r}: "
                         f"{REFUSED[model_type]}; open an issue if you need it")
    cls = getattr(transformers, class_name)
    return FamilySpec(model_type, config_class_name, class_name, window_on_every_layer=True,
                      attn_implementation="sdpa" if getattr(cls, "_supports_sdpa", False) else "eager")
def attn_implementation(config: PretrainedConfig | Any, spec: FamilySpec | None = None) -> str:
    """The attention implementation the family's layers run with (the engine and the HF
    reference alike)."""
    if getattr(text_config(config), "attn_logit_softcapping", None) is not None:
        return "eager"  # SDPA has no soft-capped scores
    return (spec or family_of(config)).attn_implementation


WINDOW_ON_FULL_LAYERS = frozenset({"minimax"})
"""Families whose base model windows the layers ``layer_types`` marks ``full_attention`` by
``sliding_window`` when the config sets one (MiniMax gives them a sliding-window causal mask),
so those layers are sliding ones here. Found by setting config fields against HF
(``tests/models/test_sweep.py``); no module says it."""


def layer_attention_types(config: PretrainedConfig | Any,
                          recurrent: tuple[bool, ...] | None = None,
                          spec: FamilySpec | None = None) -> list[str]:
    """The token mixer of every decoder layer: one of ``ATTENTION_TYPES``. ``recurrent``: which
    layers hold a causal convolution (read off the modules); a layer type the list does not
    know is a recurrent token mixer on those (LFM2's ``conv``, Falcon-H1's ``mamba``). ``spec``:
    the family (default: ``config``'s; a multimodal model's language model has its model's)."""
    spec = spec or family_of(config)
    types = getattr(config, "layer_types", None)
    if types:
        types = list(types)[:config.num_hidden_layers]
        if recurrent is not None:
            types = [LINEAR_ATTENTION if t not in ATTENTION_TYPES and r else t
                     for t, r in zip(types, recurrent)]
        unknown = sorted(set(types) - set(ATTENTION_TYPES))
        if unknown:
            raise ValueError(f"layer_types {unknown} of {spec.model_type} are not supported; "
                             f"layerwise runs {list(ATTENTION_TYPES)}")
        if spec.model_type in WINDOW_ON_FULL_LAYERS and getattr(config, "sliding_window", None):
            types = [SLIDING_ATTENTION if t == FULL_ATTENTION else t for t in types]
        return types
    windowed = (spec.window_on_every_layer and getattr(config, "sliding_window", None)
                and getattr(config, "use_sliding_window", True))
    return [SLIDING_ATTENTION if windowed else FULL_ATTENTION] * config.num_hidden_layers


def layer_windows(config: PretrainedConfig | Any,
                  types: list[str] | None = None) -> tuple[int | None, ...]:
    """The attention window of every layer: a sliding layer's ``sliding_window``, a chunked
    layer's ``attention_chunk_size`` (None = full causal, or no attention scores)."""
    size = {SLIDING_ATTENTION: getattr(config, "sliding_window", None),
            CHUNKED_ATTENTION: getattr(config, "attention_chunk_size", None)}
    return tuple(size.get(t) for t in (types or layer_attention_types(config)))


def model_dropouts(config: PretrainedConfig | Any) -> dict[str, float]:
    """The language model's dropout probabilities its config sets above 0 (``attention_dropout``,
    GPT-2's ``resid_pdrop`` …): the engine runs the modules as in eval, so these are off."""
    items = text_config(config).to_dict().items() if hasattr(config, "to_dict") else ()
    return {k: v for k, v in items if ("dropout" in k or "pdrop" in k) and isinstance(v, float)
            and v > 0 and not k.startswith(("summary_", "classifier"))}  # heads a causal LM lacks


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
