"""Seeded random initialisation from a config, with Hugging Face's own init."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from .families import attn_implementation, family_of


def build_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The plain HF model for ``config``, initialised under ``seed`` (fp32, CPU), with the
    attention implementation the engine runs the family with (``families.attn_implementation``)."""
    causal_cls = family_of(config).model_class
    config._attn_implementation = attn_implementation(config)
    torch.manual_seed(seed)
    return causal_cls(config)
