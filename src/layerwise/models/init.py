"""Seeded random initialisation from a config, with Hugging Face's own init."""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from ..store import HostStore
from .adapter import DecoderAdapter
from .registry import FAMILIES, check_family


def build_hf_model(config: PretrainedConfig, seed: int = 0) -> torch.nn.Module:
    """The plain HF model for ``config``, initialised under ``seed`` (fp32, CPU, SDPA)."""
    _, causal_cls = FAMILIES[check_family(config)]
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return causal_cls(config)


def init_store(config: PretrainedConfig, seed: int = 0, compute_dtype: torch.dtype = torch.float32,
               pin: bool | None = None) -> tuple[DecoderAdapter, HostStore]:
    """Adapter + HostStore holding exactly the weights ``build_hf_model(config, seed)`` has.

    The HF model is built on the host once and dropped; fine for the small models this is used
    for (tests, demo, CPU benchmarks). Large models are loaded from a directory instead.
    """
    adapter = DecoderAdapter(config)
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin)
    store.copy_from_model(build_hf_model(config, seed))
    return adapter, store
