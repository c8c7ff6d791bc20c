"""The shape facts of a model the planner needs (no tensors): sizes per unit, windows, heads.

The first four families are closed-form (held equal to the modules by
``tests/plan/test_module_facts.py``); every other has per-layer facts (:class:`LayerCost`, from
``models/structure.py`` and ``models/saved_bytes.py``), so dense and MoE, full and linear
attention layers are each costed as they are."""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from transformers import AutoConfig

from ..models.adapter import DecoderAdapter
from ..models.families import attn_implementation, family_of, layer_windows, text_config
from ..models.names import EMBED, HEAD, layer_index, unit_names
from ..models.registry import FLAVORS
from ..models.saved_bytes import SavedBytes, saved_bytes_by_layer
from ..models.structure import LayerFacts, layer_facts
from .family_sizes import SIZE_FLAVORS, flavor_of


@dataclass(frozen=True)
class LayerCost:
    """One decoder layer as the planner sees it: what it streams, computes and keeps."""

    params: int
    """Every tensor of the unit (streamed, stored, updated): all experts."""
    matmul_params: int
    """Weights one token multiplies through (routed experts: top-k of them)."""
    pair_flops: float
    """Forward FLOPs per causal (query, key) pair, all heads (0: linear attention)."""
    mixer_flops_per_token: float
    """Forward FLOPs per token of a recurrent token mixer (linear attention)."""
    window: int | None
    workspace_per_token: float
    """Elements per token autograd keeps for the layer's backward: what it saved when it ran
    (``models/saved_bytes.py``, fp32, in elements)."""
    widest_per_token: int
    """Elements per token of the widest intermediates of a forward without a graph (an
    estimate from the widths: the MLP's gate and up at the active width, each routed token's
    copy to its experts and back)."""
    num_experts: int = 0
    experts_per_token: int = 0
    active_params: int = 0
    """Of ``params``, what one token runs through (routed experts at top-k)."""
    workspace_per_token_pos: float = 0.0
    """Elements per token per position of its row (an eager kernel's attention probabilities)."""
    routed_params: int = 0
    """Of ``params``, all routed experts' (the grouped expert GEMMs read every one of them)."""
    mlp_matmul_params: int = 0
    """Of ``matmul_params``, the MLP's (routed experts at top-k, shared ones, the router); the
    rest is the token mixer's projections (``planner/device_cost.py`` prices each by its shape)."""

    @classmethod
    def of(cls, f: LayerFacts, hidden: int, saved: SavedBytes) -> LayerCost:
        mlp_width = f.mlp_active_matmul_params // (3 * hidden)  # gate, up, down at the active width
        dispatch = 2 * f.experts_per_token * hidden
        return cls(f.params, f.active_matmul_params, f.pair_flops, f.token_mixer_flops_per_token,
                   f.window, saved.per_token / 4, 2 * mlp_width + dispatch, f.num_experts,
                   f.experts_per_token,
                   f.params - f.routed_expert_params
                   + (f.routed_expert_params * f.experts_per_token // f.num_experts
                      if f.num_experts else 0),
                   saved.per_token_pos / 4, f.routed_expert_params, f.mlp_active_matmul_params)


from .finetune import BASE_DTYPES, FrozenBase, lora_frozen_base


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
    layers: tuple[LayerCost, ...] = ()
    """Per-layer facts; empty for a closed-form family (every layer the dense formula's)."""
    eager_attention: bool = False
    """The layers run HF's eager attention (sinks, soft-capped scores): float masks."""
    frozen_base: FrozenBase | None = None
    """A LoRA / QLoRA run: the base frozen, adapters trained (``plan/finetune.py``); None: every
    parameter is trained."""

    @classmethod
    def from_config(cls, config: Any, name: str | None = None, adapter: Any = None) -> ModelShape:
        """``adapter``: the run's ``DecoderAdapter`` (its family and per-layer facts; a
        multimodal model's language model has no family of its own)."""
        if adapter is None and text_config(config) is not config:  # a multimodal model
            adapter = DecoderAdapter(config)
        if adapter is not None:
            config = adapter.config
        family = adapter.spec if adapter is not None else family_of(config)
        h = config.hidden_size
        heads = getattr(config, "num_attention_heads", None) or 1  # none: a state-space model
        head_dim = getattr(config, "head_dim", None) or h // heads
        n = config.num_hidden_layers
        layers: tuple[LayerCost, ...] = ()
        windows = None
        if not family.closed_form_shape:
            adapter = adapter or DecoderAdapter(config)
            layers = tuple(LayerCost.of(f, h, b) for f, b in
                           zip(layer_facts(adapter), saved_bytes_by_layer(adapter)))
            windows = adapter.layer_windows
        return cls(
            name=name or getattr(config, "_name_or_path", "") or family.model_type,
            num_layers=n,
            hidden_size=h,
            intermediate_size=getattr(config, "intermediate_size", 0) or 0,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            vocab_size=config.vocab_size,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=family.qkv_bias or bool(getattr(config, "attention_bias", False)),
            qk_norm=family.qk_norm,
            layer_windows=windows or layer_windows(config),
            layers=layers,
            eager_attention=attn_implementation(config, family) == "eager",
        )

    def layer(self, i: int) -> LayerCost | None:
        """Layer ``i``'s own facts; None for a closed-form family."""
        return self.layers[i] if self.layers else None

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

    def layer_params_of(self, i: int) -> int:
        return self.layers[i].params if self.layers else self.layer_params

    @property
    def num_params(self) -> int:
        return (self.embed_params + sum(self.layer_params_of(i) for i in range(self.num_layers))
                + self.head_params)

    @property
    def active_params(self) -> int:
        """Parameters one token runs through (routed experts: top-k of them)."""
        if not self.layers:
            return self.num_params
        return self.num_params - sum(c.params - c.active_params for c in self.layers)

    def unit_names(self) -> list[str]:
        return unit_names(self.num_layers)

    def unit_params(self, unit: str) -> int:
        if unit == EMBED:
            return self.embed_params
        if unit == HEAD:
            return self.head_params
        i = layer_index(unit)
        assert i is not None, unit
        return self.layer_params_of(i)

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

    def with_lora(self, r: int, targets: list[str] | tuple[str, ...] = ("all-linear",),
                  base_dtype: str = "compute") -> ModelShape:
        """This shape as a LoRA / QLoRA run plans it (``lora.r=r lora.target_modules=targets
        lora.base_dtype=base_dtype``): the base frozen in ``base_dtype``, the adapters trained
        (``plan/finetune.py``); ``r`` 0: the shape itself."""
        if r <= 0:
            return self
        if base_dtype.startswith("fp8-"):  # a release's FP8 blocks: ~1 B/param whatever their size
            base_dtype = "fp8"
        if base_dtype not in BASE_DTYPES:
            raise ValueError(f"unknown base dtype {base_dtype!r}; use one of {', '.join(BASE_DTYPES)}")
        return replace(self, frozen_base=lora_frozen_base(
            self.hidden_size, self.intermediate_size, self.q_dim, self.kv_dim, r, targets, base_dtype))

    def attention_pairs(self, seq_len: int, window: int | None) -> int:
        """(query, key) pairs a causal (windowed) attention scores per sequence."""
        if window is None or window >= seq_len:
            return seq_len * (seq_len + 1) // 2
        return window * (window + 1) // 2 + (seq_len - window) * window


def load_shape(model: str) -> ModelShape:
    """A registry flavor name or a local Hugging Face model directory."""
    flavor = flavor_of(model)
    if flavor is not None:
        return ModelShape.from_config(flavor.build_config(), name=model)
    p = Path(model)
    if p.is_dir():
        if not (p / "config.json").exists():
            raise ValueError(f"{model} has no config.json; pass a Hugging Face model directory or a flavor name")
        return ModelShape.from_config(AutoConfig.from_pretrained(str(p)), name=p.name)
    raise ValueError(f"unknown model {model!r}: use a flavor ({', '.join(sorted([*FLAVORS, *SIZE_FLAVORS]))}) "
                     "or a local Hugging Face model directory")
