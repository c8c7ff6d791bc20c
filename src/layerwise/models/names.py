"""Names of units and checkpoint groups, and how Hugging Face keys map onto them.

Units (what the engine streams and updates): ``embed``, ``layers.{i}``, ``head``. Groups (what a
checkpoint versions) are finer: ``norm`` and ``lm_head`` apart, because they change at very
different rates and sizes; a tied lm_head is the embedding; any other key is its own group.
Expert groups split an MoE layer per routed expert (``ckpt.expert_groups``)."""

from __future__ import annotations

import math
import re

from torch import nn

EMBED = "embed"
HEAD = "head"
NORM = "norm"
LM_HEAD = "lm_head"
LAYER_GROUP_PREFIX = "layers."


_HF_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.[^.]+$")
"""A fused routed-expert tensor ``[num_experts, ...]`` (a direct parameter of the experts
module; shared experts live elsewhere)."""
_HF_EXPERT_ITEM_RE = re.compile(r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.")
"""A tensor of one routed expert as HF model dirs store them (``...experts.{e}.w1.weight``)."""
_EXPERT_GROUP_RE = re.compile(r"^layers\.(\d+)\.experts\.(\d+)$")

_TEXT_BASE = r"(?:model\.decoder\.|model\.|transformer\.|gpt_neox\.|gpt_neox_japanese\.|backbone\.)"
"""The attributes transformers' causal LMs keep their decoder under (``models/layout.py``
finds them on the model; checkpoints, which have only names, read them here)."""
_HF_LAYER_RE = re.compile(rf"^{_TEXT_BASE}(?:layers|h|blocks)\.(\d+)\.")
_HF_EMBED_RE = re.compile(
    rf"^{_TEXT_BASE}(?:embed_tokens|wte|wpe|word_embeddings|embed_in|embeddings|tokens_embed|"
    r"positions_embed|embed_positions)\.")
_HF_NORM_RE = re.compile(
    rf"^{_TEXT_BASE}(?:norm|ln_f|final_layer_norm|final_layernorm|norm_f|final_norm|"
    r"embedding_norm|layer_norm|layernorm|project_out)\.")
_HF_HEAD_RE = re.compile(r"^(?:lm_head|embed_out|output_projection)\.")


def layer_unit(i: int) -> str:
    """The unit (and group) name of decoder layer ``i``: ``layers.{i}``."""
    return f"{LAYER_GROUP_PREFIX}{i}"


def expert_group(i: int, e: int) -> str:
    """The checkpoint group of routed expert ``e`` of layer ``i``: ``layers.{i}.experts.{e}``."""
    return f"{LAYER_GROUP_PREFIX}{i}.experts.{e}"


def expert_of(group: str) -> tuple[int, int] | None:
    """``(i, e)`` for ``layers.{i}.experts.{e}``, else None."""
    m = _EXPERT_GROUP_RE.match(group)
    return (int(m.group(1)), int(m.group(2))) if m else None


def joined_group(group: str) -> str:
    """The group ``group`` is part of: its layer's for an expert group, else itself."""
    ie = expert_of(group)
    return group if ie is None else layer_unit(ie[0])


def is_fused_expert(hf_name: str) -> bool:
    """Whether ``hf_name`` is a fused routed-expert tensor (dim 0: the expert)."""
    return _HF_EXPERT_RE.match(hf_name) is not None


def expert_item(hf_name: str) -> int | None:
    """The expert ``e`` of a one-expert tensor (``model.layers.{i}.mlp.experts.{e}.…``, the
    layout HF model dirs keep), else None."""
    m = _HF_EXPERT_ITEM_RE.match(hf_name)
    return int(m.group(1)) if m else None


def expert_range(shape: tuple[int, ...], e: int) -> tuple[int, int]:
    """Elements ``[start, stop)`` of expert ``e`` in a flattened fused tensor of ``shape``."""
    per = math.prod(int(d) for d in shape[1:])
    return e * per, (e + 1) * per


def unit_names(num_layers: int) -> list[str]:
    """Units in forward order."""
    return [EMBED] + [layer_unit(i) for i in range(num_layers)] + [HEAD]


def layer_index(name: str) -> int | None:
    """``i`` for ``layers.{i}`` (a unit or a group), else None."""
    rest = name[len(LAYER_GROUP_PREFIX):]
    if name.startswith(LAYER_GROUP_PREFIX) and rest.isdigit():
        return int(rest)
    return None


def group_of(hf_name: str, tied: bool = False) -> str:
    """The checkpoint group of one HF state-dict key (``tied``: lm_head is the embedding)."""
    if _HF_EMBED_RE.match(hf_name):
        return EMBED
    m = _HF_LAYER_RE.match(hf_name)
    if m:
        return layer_unit(int(m.group(1)))
    if _HF_NORM_RE.match(hf_name):
        return NORM
    if _HF_HEAD_RE.match(hf_name):  # a tied head's weight is the embedding (a bias is its own)
        return EMBED if tied and hf_name.endswith(".weight") else LM_HEAD
    for suffix in (".weight", ".bias"):
        if hf_name.endswith(suffix):
            return hf_name[: -len(suffix)]
    return hf_name


def is_head_name(hf_name: str) -> bool:
    """Whether ``hf_name`` is a tensor of the lm_head (``lm_head``, ``embed_out``, …)."""
    return _HF_HEAD_RE.match(hf_name) is not None


def group_sort_key(group: str) -> tuple[int, int, int, str]:
    """Model order: embedding, layers by index (each followed by its experts by index), final
    norm, lm_head, then others by name."""
    i = layer_index(group)
    ie = expert_of(group)
    if group == EMBED:
        return (0, 0, 0, group)
    if i is not None:
        return (1, i, 0, group)
    if ie is not None:
        return (1, ie[0], 1 + ie[1], group)
    if group == NORM:
        return (2, 0, 0, group)
    if group == LM_HEAD:
        return (3, 0, 0, group)
    return (4, 0, 0, group)


def config_is_tied(config: object) -> bool:
    """Whether an HF config (object or ``config.json`` dict) ties lm_head to the embedding."""
    if isinstance(config, dict):
        return bool(config.get("tie_word_embeddings", False))
    return bool(getattr(config, "tie_word_embeddings", False))


def model_is_tied(model: nn.Module) -> bool:
    """Whether a live model's lm_head shares its weight with the token embedding (by config,
    or by tensor identity for models whose config does not say)."""
    config = getattr(model, "config", None)
    if config is not None and config_is_tied(config):
        return True
    get_in = getattr(model, "get_input_embeddings", None)
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_in) and callable(get_out):
        try:
            emb, head = get_in(), get_out()
        except (NotImplementedError, AttributeError):
            return False
        return emb is not None and head is not None and head.weight is emb.weight
    return False


def groups_of_model(model: nn.Module) -> dict[str, list[str]]:
    """Group -> HF parameter names, in model order; a tied (shared) parameter is listed once."""
    tied = model_is_tied(model)
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():  # remove_duplicate=True: shared tensors once
        out.setdefault(group_of(name, tied), []).append(name)
    return out
