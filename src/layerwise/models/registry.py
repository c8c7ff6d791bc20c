"""Named model flavors: tiny ``debug`` ones for tests and the real shapes of popular models.

A flavor is only a config (shapes); nothing here holds or downloads weights."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from transformers import PretrainedConfig

from .families import FAMILIES


@dataclass(frozen=True)
class Flavor:
    name: str
    family: str
    """A key of FAMILIES."""
    config: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the family's config class."""
    note: str = ""
    """Where the shape comes from."""

    def build_config(self, **overrides: Any) -> PretrainedConfig:
        return FAMILIES[self.family].config_class(**{**self.config, **overrides})


def _debug(family: str, tied: bool, **extra: Any) -> dict[str, Any]:
    cfg = dict(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        rms_norm_eps=1e-6,
    )
    if family in ("qwen3",):
        cfg["head_dim"] = 8
    cfg.update(extra)
    return cfg


def _tiny(**extra: Any) -> dict[str, Any]:
    cfg = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8,
               max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
               pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg.update(extra)
    return cfg


_MOE = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02)
_LINEAR = dict(layer_types=["linear_attention", "full_attention"], linear_num_value_heads=4,
               linear_num_key_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
               linear_conv_kernel_dim=3)
_QUIRKY: list[tuple[str, str, dict[str, Any]]] = [
    ("gemma", "gemma", dict(tie_word_embeddings=True)),
    ("gemma2", "gemma2", dict(sliding_window=5, attn_logit_softcapping=20.0,
                              final_logit_softcapping=10.0, query_pre_attn_scalar=16,
                              tie_word_embeddings=True)),
    ("gemma3", "gemma3_text", dict(sliding_window=5, final_logit_softcapping=10.0,
                                   layer_types=["sliding_attention", "full_attention"],
                                   query_pre_attn_scalar=16, tie_word_embeddings=True)),
    ("gpt-oss", "gpt_oss", dict(num_local_experts=4, intermediate_size=32, sliding_window=5,
                                layer_types=["sliding_attention", "full_attention"],
                                attention_bias=True, **_MOE)),
    # LongRoPE (Phi-3-128k, Phi-4-mini): its factors switch when a position passes
    # original_max_position_embeddings, so RoPE depends on absolute positions
    ("phi3", "phi3", dict(partial_rotary_factor=0.5, sliding_window=5, original_max_position_embeddings=8,
                          rope_parameters=dict(rope_type="longrope", rope_theta=10000.0,
                                               short_factor=[1.0, 1.5], long_factor=[4.0, 8.0]))),
    ("glm4", "glm4", dict(partial_rotary_factor=0.5, attention_bias=True)),
    ("olmo2", "olmo2", dict()),
    ("deepseek-v3", "deepseek_v3", dict(first_k_dense_replace=1, n_routed_experts=4,
                                        n_shared_experts=1, moe_intermediate_size=16,
                                        q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4,
                                        qk_nope_head_dim=4, v_head_dim=8, n_group=2,
                                        topk_group=1, num_experts_per_tok=2, head_dim=4)),
    ("qwen3-moe", "qwen3_moe", dict(num_experts=4, moe_intermediate_size=16, mlp_only_layers=[0],
                                    norm_topk_prob=True, **_MOE)),
    ("mixtral", "mixtral", dict(num_local_experts=4, sliding_window=5, **_MOE)),
    ("qwen3-next", "qwen3_next", dict(num_experts=4, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=16, **_LINEAR, **_MOE)),
    ("qwen3.5", "qwen3_5_text", dict(**_LINEAR)),
    ("qwen3.5-moe", "qwen3_5_moe_text", dict(num_experts=4, moe_intermediate_size=16,
                                             shared_expert_intermediate_size=16, **_LINEAR,
                                             **_MOE)),
]
"""(flavor stem, family, config) of the tiny models of the families beyond the first four."""


_FLAVORS: list[Flavor] = [
    # Tiny models for tests: every family, tied and untied embeddings.
    Flavor("llama-debug", "llama", _debug("llama", tied=False), "tiny test model"),
    Flavor("llama-debug-tied", "llama", _debug("llama", tied=True), "tiny test model"),
    Flavor("qwen2-debug", "qwen2", _debug("qwen2", tied=True), "tiny test model"),
    Flavor("qwen2-debug-untied", "qwen2", _debug("qwen2", tied=False), "tiny test model"),
    Flavor("qwen3-debug", "qwen3", _debug("qwen3", tied=True), "tiny test model"),
    Flavor("qwen3-debug-untied", "qwen3", _debug("qwen3", tied=False), "tiny test model"),
    Flavor("mistral-debug", "mistral", _debug("mistral", tied=False, sliding_window=None), "tiny test model"),
    # Tiny models of the other families, two layers, every quirk of the family switched on
    # (windows shorter than the tests' sequences, soft caps, MoE with the router aux loss).
    *(Flavor(f"{name}-debug", family, _tiny(**cfg), "tiny test model, quirks on")
      for name, family, cfg in _QUIRKY),
    # Small trainable models for CPU benchmarks (byte-level vocabulary) and the demo.
    Flavor(
        "llama-30m",
        "llama",
        dict(vocab_size=320, hidden_size=512, intermediate_size=1408, num_hidden_layers=10,
             num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=2048,
             tie_word_embeddings=False, rms_norm_eps=1e-5),
        "~30M-parameter Llama for CPU benchmarks",
    ),
    Flavor(
        "llama-demo",
        "llama",
        dict(vocab_size=1024, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
             tie_word_embeddings=True, rms_norm_eps=1e-5,
             bos_token_id=None, eos_token_id=0, pad_token_id=0),
        "~0.9M-parameter Llama for `layerwise demo`, sized to learn in its 2 CPU minutes; the "
        "vocabulary and special ids of the demo's BPE tokenizer (1024 ids, <|endoftext|> = 0 "
        "ends and pads, no BOS); the byte tokenizer fits too",
    ),
    # Real shapes (for planning only; no weights). Values from the public config.json files.
    Flavor(
        "llama3-8b", "llama",
        dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
             num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=131072,
             tie_word_embeddings=False, rope_theta=500000.0),
        "meta-llama/Llama-3.1-8B config.json",
    ),
    Flavor(
        "llama3-70b", "llama",
        dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
             tie_word_embeddings=False, rope_theta=500000.0),
        "meta-llama/Llama-3.1-70B config.json",
    ),
    Flavor(
        "qwen2.5-3b", "qwen2",
        dict(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
             num_attention_heads=16, num_key_value_heads=2, max_position_embeddings=32768,
             tie_word_embeddings=True),
        "Qwen/Qwen2.5-3B config.json",
    ),
    Flavor(
        "qwen2.5-7b", "qwen2",
        dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
             num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
             tie_word_embeddings=False),
        "Qwen/Qwen2.5-7B config.json",
    ),
    Flavor(
        "qwen2.5-14b", "qwen2",
        dict(vocab_size=152064, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
             num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
             tie_word_embeddings=False),
        "Qwen/Qwen2.5-14B config.json",
    ),
    Flavor(
        "qwen2.5-32b", "qwen2",
        dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
             num_attention_heads=40, num_key_value_heads=8, max_position_embeddings=131072,
             tie_word_embeddings=False),
        "Qwen/Qwen2.5-32B config.json",
    ),
    Flavor(
        "qwen2.5-72b", "qwen2",
        dict(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
             num_attention_heads=64, num_key_value_heads=8, max_position_embeddings=131072,
             tie_word_embeddings=False),
        "Qwen/Qwen2.5-72B config.json",
    ),
    Flavor(
        "qwen-27b", "qwen3",
        dict(vocab_size=151936, hidden_size=5120, intermediate_size=21760, num_hidden_layers=64,
             num_attention_heads=40, num_key_value_heads=8, head_dim=128,
             max_position_embeddings=40960, tie_word_embeddings=False),
        "~27B Qwen3-architecture shape (the size class LazyTrain evaluates); not an official checkpoint",
    ),
]

def _alternating(n: int, period: int, last: str, other: str) -> list[str]:
    """``layer_types`` where every ``period``-th layer is ``last`` (Gemma 3: 5 sliding, 1 full)."""
    return [last if (i + 1) % period == 0 else other for i in range(n)]


_FLAVORS += [
    # Real shapes of the other families (planning only; no weights), from their config.json.
    Flavor("gpt-oss-20b", "gpt_oss",
           dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=32,
                num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                layer_types=_alternating(24, 2, "full_attention", "sliding_attention"),
                max_position_embeddings=131072, tie_word_embeddings=False),
           "openai/gpt-oss-20b config.json (21B, 3.6B active)"),
    Flavor("gpt-oss-120b", "gpt_oss",
           dict(vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
                num_attention_heads=64, num_key_value_heads=8, head_dim=64, num_local_experts=128,
                num_experts_per_tok=4, sliding_window=128, attention_bias=True,
                layer_types=_alternating(36, 2, "full_attention", "sliding_attention"),
                max_position_embeddings=131072, tie_word_embeddings=False),
           "openai/gpt-oss-120b config.json (117B, 5.1B active)"),
    Flavor("qwen3-30b-a3b", "qwen3_moe",
           dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                max_position_embeddings=40960, tie_word_embeddings=False),
           "Qwen/Qwen3-30B-A3B config.json (30.5B, 3.3B active)"),
    Flavor("gemma-3-27b", "gemma3_text",
           dict(vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
                num_attention_heads=32, num_key_value_heads=16, head_dim=128, sliding_window=1024,
                layer_types=_alternating(62, 6, "full_attention", "sliding_attention"),
                query_pre_attn_scalar=168, max_position_embeddings=131072, tie_word_embeddings=True),
           "google/gemma-3-27b-it text_config (the language model, 27B)"),
    Flavor("phi-4", "phi3",
           dict(vocab_size=100352, hidden_size=5120, intermediate_size=17920, num_hidden_layers=40,
                num_attention_heads=40, num_key_value_heads=10, max_position_embeddings=16384,
                tie_word_embeddings=False, sliding_window=None),
           "microsoft/phi-4 config.json (14.7B)"),
    Flavor("deepseek-v3", "deepseek_v3",
           dict(vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
                num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
                n_shared_experts=1, n_routed_experts=256, num_experts_per_tok=8, n_group=8,
                topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, head_dim=64,
                max_position_embeddings=163840, tie_word_embeddings=False),
           "deepseek-ai/DeepSeek-V3 config.json without the MTP layer (671B, 37B active)"),
    Flavor("qwen3-next-80b-a3b", "qwen3_next",
           dict(vocab_size=151936, hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
                shared_expert_intermediate_size=512, num_hidden_layers=48, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, num_experts=512, num_experts_per_tok=10,
                linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128,
                linear_value_head_dim=128, linear_conv_kernel_dim=4, partial_rotary_factor=0.25,
                layer_types=_alternating(48, 4, "full_attention", "linear_attention"),
                max_position_embeddings=262144, tie_word_embeddings=False),
           "Qwen/Qwen3-Next-80B-A3B config.json (80B, 3B active)"),
]

FAMILY_PRESETS = ("gpt-oss-20b", "gpt-oss-120b", "qwen3-30b-a3b", "gemma-3-27b", "phi-4",
                  "deepseek-v3", "qwen3-next-80b-a3b")
"""The real shapes of the families beyond the first four (``layerwise plan --model NAME``)."""

FLAVORS: dict[str, Flavor] = {f.name: f for f in _FLAVORS}


def get_flavor(name: str) -> Flavor:
    try:
        return FLAVORS[name]
    except KeyError:
        known = ", ".join(sorted(FLAVORS))
        raise ValueError(f"unknown model flavor {name!r}; known flavors: {known}") from None
