"""torchtitan's Llama parameter names and its RoPE layout of ``wq``/``wk``, mapped to Hugging
Face's.

torchtitan rotates interleaved pairs, HF the two halves of each head, so a head's row ``2j + c`` is
HF's ``c * d/2 + j`` (the moments too: they are elementwise). Everything else is renamed."""

from __future__ import annotations

import re

import torch

_LAYER_PARTS = {
    "self_attn.q_proj": "attention.wq", "self_attn.k_proj": "attention.wk",
    "self_attn.v_proj": "attention.wv", "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1", "mlp.down_proj": "feed_forward.w2",
    "mlp.up_proj": "feed_forward.w3",
    "input_layernorm": "attention_norm", "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight"}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)\.weight")


def titan_name(hf_name: str) -> str | None:
    """torchtitan's name of the HF Llama parameter ``hf_name`` (None: torchtitan's Llama has none)."""
    if hf_name in _TOP:
        return _TOP[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_PARTS:
        return f"layers.{m.group(1)}.{_LAYER_PARTS[m.group(2)]}.weight"
    return None


def rope_heads(hf_name: str, config: dict) -> int | None:
    """How many heads' rows of ``hf_name`` are in torchtitan's RoPE order (None: not permuted)."""
    heads = int(config["num_attention_heads"])
    if hf_name.endswith("self_attn.q_proj.weight"):
        return heads
    if hf_name.endswith("self_attn.k_proj.weight"):
        return int(config.get("num_key_value_heads") or heads)
    return None


def titan_rows_to_hf(t: torch.Tensor, heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs (torchtitan) to halves (HF)."""
    return t.reshape(heads, t.shape[0] // heads // 2, 2, *t.shape[1:]).transpose(1, 2).reshape(t.shape).contiguous()
