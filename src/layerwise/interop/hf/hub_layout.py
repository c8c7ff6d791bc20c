"""The Hub's tensor layout ↔ the model's in-memory one, by transformers' own conversion mapping.

Many Hub checkpoints keep a layout the module no longer has (per-expert tensors, renamed
prefixes). :class:`HubLayout` runs the installed transformers' transforms on one group's keys at
a time, so a model never has to be in RAM whole."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from copy import deepcopy

import torch
from torch import nn
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import (
    WeightConverter,
    WeightRenaming,
    dot_natural_key,
    rename_source_key,
    revert_weight_conversion,
)


class HubLayout:
    """The conversion between ``model``'s (meta device) checkpoint keys and its own;
    ``hf_quantizer``: a dequantizing quantizer for a quantized release."""

    def __init__(self, model: nn.Module, hf_quantizer=None):
        self.model = model
        kwargs = {"hf_quantizer": hf_quantizer} if hf_quantizer is not None else {}
        transforms = get_model_conversion_mapping(model, add_legacy=True, **kwargs)
        self._renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
        self._converters = [t for t in transforms if isinstance(t, WeightConverter)]
        self._by_pattern = {p: c for c in self._converters for p in c.source_patterns}
        self._model_keys = model.state_dict()  # meta tensors: names only, no memory

    def model_name(self, hub_key: str) -> tuple[str, str | None]:
        """The in-memory name ``hub_key`` becomes (for a converter: its first target), and the
        converter's source pattern it matched (None: a rename or nothing)."""
        prefix = getattr(self.model, "base_model_prefix", None)
        renamed, pattern = rename_source_key(hub_key, self._renamings, self._converters, prefix,
                                             self._model_keys)
        if renamed not in self._model_keys and hub_key in self._model_keys:
            return hub_key, None  # already the in-memory name (e.g. an older layerwise export)
        return renamed, pattern

    def model_names(self, hub_key: str) -> list[str]:
        """Every in-memory name ``hub_key`` contributes to (a split gives several)."""
        renamed, pattern = self.model_name(hub_key)
        if pattern is None:
            return [renamed]
        targets = self._by_pattern[pattern].target_patterns
        return [renamed.replace(targets[0], t) for t in targets]

    def to_model(self, hub_keys: Iterable[str],
                 read: Callable[[str], torch.Tensor]) -> dict[str, torch.Tensor]:
        """The in-memory tensors made of ``hub_keys`` (every source of each converter among them:
        all experts of a layer), each key read by ``read`` as the conversion needs it."""
        mappings: dict[str, WeightRenaming | WeightConverter] = {}
        for key in sorted(hub_keys, key=dot_natural_key):  # expert order, as from_pretrained
            renamed, pattern = self.model_name(key)
            if pattern is None:
                mapping = mappings.setdefault(renamed, WeightRenaming(key, renamed))
                pattern = key
            else:
                mapping = mappings.setdefault(renamed, deepcopy(self._by_pattern[pattern]))
            mapping.add_tensor(renamed, key, pattern, lambda k=key: read(k))
        out: dict[str, torch.Tensor] = {}
        for first, mapping in mappings.items():
            for name, t in mapping.convert(first, model=self.model, config=self.model.config).items():
                out[name] = t[0] if isinstance(t, list) else t
        return out

    def to_hub(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` (in-memory names) in the layout ``save_pretrained`` writes."""
        return revert_weight_conversion(self.model, dict(tensors))
