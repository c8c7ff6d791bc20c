"""Checkpoint groups: the unit a layer-wise checkpoint saves, versions and loads as one piece.

Every parameter belongs to exactly one group, named from its Hugging Face key through the model
adapter's key map: ``embed`` (``model.embed_tokens.*``), ``layers.{i}`` (``model.layers.{i}.*``),
``norm`` (``model.norm.*``), ``lm_head`` (``lm_head.*``; with tied embeddings the head *is* the
embedding, so it falls into ``embed``), and anything else a group of its own. Groups are finer
than the adapter's units (``head`` = ``norm`` + ``lm_head``) because the final norm and the head
change at very different rates and have very different sizes.
"""

from __future__ import annotations

import re

from torch import nn

from ..models.adapter import LAYER_PREFIX

_LAYER_RE = re.compile("^" + re.escape(LAYER_PREFIX).replace(r"\{\}", r"(\d+)"))
_EMBED_PREFIX = "model.embed_tokens."
_NORM_PREFIX = "model.norm."
_HEAD_PREFIX = "lm_head."


def group_of(hf_name: str, tied: bool = False) -> str:
    """The group of one HF state-dict key (``tied``: the model ties lm_head to the embedding)."""
    if hf_name.startswith(_EMBED_PREFIX):
        return "embed"
    m = _LAYER_RE.match(hf_name)
    if m:
        return f"layers.{int(m.group(1))}"
    if hf_name.startswith(_NORM_PREFIX):
        return "norm"
    if hf_name.startswith(_HEAD_PREFIX):
        return "embed" if tied else "lm_head"
    for suffix in (".weight", ".bias"):
        if hf_name.endswith(suffix):
            return hf_name[: -len(suffix)]
    return hf_name


def is_tied(model: nn.Module) -> bool:
    """Whether the model's lm_head shares its weight with the token embedding."""
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "tie_word_embeddings", False):
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
    tied = is_tied(model)
    out: dict[str, list[str]] = {}
    for name, _ in model.named_parameters():  # remove_duplicate=True: shared tensors once
        out.setdefault(group_of(name, tied), []).append(name)
    return out


def layer_index(group: str) -> int | None:
    """``i`` for ``layers.{i}``, else None."""
    if group.startswith("layers.") and group[7:].isdigit():
        return int(group[7:])
    return None
