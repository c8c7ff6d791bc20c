"""The sizes a model family is released in, smallest first, for ``layerwise plan``'s "largest
model that fits": the registry's real shapes plus released sizes defined here from their public
config.json (planning only). Without a ladder, the registry's non-debug flavors."""

from __future__ import annotations

from ..models.registry import FLAVORS, Flavor

_LLAMA = dict(vocab_size=128256, num_key_value_heads=8, max_position_embeddings=131072, rope_theta=500000.0,
              rms_norm_eps=1e-5)
_QWEN2 = dict(vocab_size=151936, max_position_embeddings=32768, rms_norm_eps=1e-6)

SIZE_FLAVORS: dict[str, Flavor] = {f.name: f for f in (
    Flavor("llama3.2-1b", "llama",
           dict(_LLAMA, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                head_dim=64, tie_word_embeddings=True),
           "meta-llama/Llama-3.2-1B config.json (1.24B)"),
    Flavor("llama3.2-3b", "llama",
           dict(_LLAMA, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                head_dim=128, tie_word_embeddings=True),
           "meta-llama/Llama-3.2-3B config.json (3.21B)"),
    Flavor("llama3.1-405b", "llama",
           dict(_LLAMA, hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                tie_word_embeddings=False),
           "meta-llama/Llama-3.1-405B config.json (406B)"),
    Flavor("qwen2.5-0.5b", "qwen2",
           dict(_QWEN2, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                num_key_value_heads=2, tie_word_embeddings=True),
           "Qwen/Qwen2.5-0.5B config.json (0.49B)"),
    Flavor("qwen2.5-1.5b", "qwen2",
           dict(_QWEN2, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                num_key_value_heads=2, tie_word_embeddings=True),
           "Qwen/Qwen2.5-1.5B config.json (1.54B)"),
)}
"""Released sizes the registry does not carry (``layerwise plan --model NAME`` plans them too)."""

FAMILY_SIZES: dict[str, tuple[str, ...]] = {
    "llama": ("llama3.2-1b", "llama3.2-3b", "llama3-8b", "llama3-70b", "llama3.1-405b"),
    "qwen2": ("qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b", "qwen2.5-14b", "qwen2.5-32b",
              "qwen2.5-72b"),
}
"""Each family's released sizes, smallest first (Llama 3.1 / 3.2, Qwen2.5)."""


def flavor_of(name: str) -> Flavor | None:
    """A registry flavor or a size defined here (None: neither)."""
    return FLAVORS.get(name) or SIZE_FLAVORS.get(name)


def family_sizes(family: str | None) -> tuple[str, ...]:
    """The sizes of ``family`` the largest-model search tries: its ladder, else the registry's
    real shapes of it (no ``-debug`` flavor)."""
    if family in FAMILY_SIZES:
        return FAMILY_SIZES[family]
    return tuple(n for n, f in FLAVORS.items() if f.family == family and "debug" not in n)
