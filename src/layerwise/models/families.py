"""The one table of family facts: what differs between Llama, Mistral, Qwen2 and Qwen3.

Adapter, cost model and calibration read these facts from here instead of branching on
``model_type`` themselves, so a new family is one row.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PretrainedConfig,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"


@dataclass(frozen=True)
class FamilySpec:
    model_type: str
    """As in ``config.json``."""
    config_class: type
    model_class: type
    """The causal-LM class (``…ForCausalLM``)."""
    qkv_bias: bool
    """Biases on the q/k/v projections (Qwen2), whatever ``attention_bias`` says."""
    qk_norm: bool
    """RMSNorm on q and k per head (Qwen3): ``2 * head_dim`` extra weights per layer."""
    window_on_every_layer: bool
    """``sliding_window`` applies to every layer when the config has no ``layer_types`` (Mistral);
    otherwise only the layers ``layer_types`` marks ``sliding_attention`` are windowed."""


FAMILIES: dict[str, FamilySpec] = {s.model_type: s for s in (
    FamilySpec("llama", LlamaConfig, LlamaForCausalLM, False, False, False),
    FamilySpec("mistral", MistralConfig, MistralForCausalLM, False, False, True),
    FamilySpec("qwen2", Qwen2Config, Qwen2ForCausalLM, True, False, False),
    FamilySpec("qwen3", Qwen3Config, Qwen3ForCausalLM, False, True, False),
)}


def family_of(config: PretrainedConfig | Any) -> FamilySpec:
    """The family of ``config``, or a clear error for an unsupported one."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"unsupported architecture model_type={model_type!r}; layerwise supports "
            f"{sorted(FAMILIES)} (decoder-only causal LMs). Convert the model or open an issue."
        )
    return FAMILIES[model_type]


def layer_attention_types(config: PretrainedConfig | Any) -> list[str]:
    """``full_attention`` or ``sliding_attention`` for every decoder layer."""
    spec = family_of(config)
    types = getattr(config, "layer_types", None)
    if types:
        return list(types)
    windowed = spec.window_on_every_layer and getattr(config, "sliding_window", None)
    return [SLIDING_ATTENTION if windowed else FULL_ATTENTION] * config.num_hidden_layers


def layer_windows(config: PretrainedConfig | Any) -> tuple[int | None, ...]:
    """The attention window of every layer (None = full causal)."""
    window = getattr(config, "sliding_window", None)
    return tuple(window if t == SLIDING_ATTENTION else None for t in layer_attention_types(config))


def has_qkv_bias(config: PretrainedConfig | Any) -> bool:
    return family_of(config).qkv_bias or bool(getattr(config, "attention_bias", False))
