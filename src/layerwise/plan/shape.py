"""The shape facts of a model the planner needs (no tensors): sizes per unit, windows, heads."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ..models.families import family_of, has_qkv_bias, layer_windows
from ..models.names import EMBED, HEAD, unit_names
from ..models.registry import FLAVORS
from .finetune import FrozenBase


@dataclass(frozen=True)
class ModelShape:
    """The shape facts the planner needs, read from a Hugging Face config."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    """Qwen2 has biases on q/k/v."""
    qk_norm: bool
    """Qwen3 has RMSNorm on q and k (head_dim weights each)."""
    layer_windows: tuple[int | None, ...]
    """Attention window per layer (None = full causal)."""
    frozen_base: FrozenBase | None = None
    """A LoRA / QLoRA run: the base frozen, adapters trained (``plan/finetune.py``); None: every
    parameter is trained."""

    @classmethod
    def from_config(cls, config: Any, name: str | None = None) -> ModelShape:
        family = family_of(config)
        h = config.hidden_size
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or h // heads
        n = config.num_hidden_layers
        return cls(
            name=name or getattr(config, "_name_or_path", "") or family.model_type,
            num_layers=n,
            hidden_size=h,
            intermediate_size=config.intermediate_size,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=has_qkv_bias(config),
            qk_norm=family.qk_norm,
            layer_windows=layer_windows(config),
        )

    @property
    def q_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    @cached_property
    def layer_matmul_params(self) -> int:
        """Weights of a decoder layer that sit in matmuls (q, k, v, o, gate, up, down)."""
        h, f = self.hidden_size, self.intermediate_size
        return h * self.q_dim + 2 * h * self.kv_dim + self.q_dim * h + 3 * h * f

    @cached_property
    def layer_params(self) -> int:
        extra = 2 * self.hidden_size  # input and post-attention RMSNorm
        if self.qkv_bias:
            extra += self.q_dim + 2 * self.kv_dim
        if self.qk_norm:
            extra += 2 * self.head_dim
        return self.layer_matmul_params + extra

    @property
    def embed_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        """Final norm, plus lm_head when untied."""
        return self.hidden_size + (0 if self.tied else self.vocab_size * self.hidden_size)

    @property
    def num_params(self) -> int:
        return self.embed_params + self.num_layers * self.layer_params + self.head_params

    def unit_names(self) -> list[str]:
        return unit_names(self.num_layers)

    def unit_params(self, unit: str) -> int:
        if unit == EMBED:
            return self.embed_params
        if unit == HEAD:
            return self.head_params
        return self.layer_params

    def trainable_params(self, unit: str) -> int:
        """Parameters of ``unit`` that get gradients, updates and optimizer state."""
        if self.frozen_base is None:
            return self.unit_params(unit)
        return self.frozen_base.adapter_params_per_layer if unit not in (EMBED, HEAD) else 0

    def unit_weight_bytes(self, unit: str, elem_bytes: int) -> int:
        """Bytes of ``unit`` on the host's copy source and on the wire (one weight copy)."""
        fb = self.frozen_base
        if fb is None or unit in (EMBED, HEAD):
            return self.unit_params(unit) * elem_bytes
        per = elem_bytes if fb.base_bytes_per_param is None else fb.base_bytes_per_param
        rest = self.layer_params - self.layer_matmul_params  # norms, biases
        return int(self.layer_matmul_params * per) + (rest + fb.adapter_params_per_layer) * elem_bytes

    def attention_pairs(self, seq_len: int, window: int | None) -> int:
        """(query, key) pairs a causal (windowed) attention scores per sequence."""
        if window is None or window >= seq_len:
            return seq_len * (seq_len + 1) // 2
        return window * (window + 1) // 2 + (seq_len - window) * window


def load_shape(model: str) -> ModelShape:
    """A registry flavor name or a local Hugging Face model directory."""
    if model in FLAVORS:
        return ModelShape.from_config(FLAVORS[model].build_config(), name=model)
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{model} has no config.json; pass a Hugging Face model directory or a flavor name")
        return ModelShape.from_config(AutoConfig.from_pretrained(str(p)), name=p.name)
    raise ValueError(f"unknown model {model!r}: use a flavor ({', '.join(sorted(FLAVORS))}) "
                     "or a local Hugging Face model directory")
