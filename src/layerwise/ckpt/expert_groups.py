"""Expert-level checkpoint groups: each routed expert of an MoE layer versioned on its own, so a
policy writes only the experts that moved.

An expert group (``layers.{i}.experts.{e}``) is expert ``e``'s contiguous flat range of the
layer's fused ``[num_experts, ...]`` tensors, stored as a one-shard entry marked ``slice_of``
its layer (``ckpt.shard_ranges``); ``resolve`` joins them back, so readers see ordinary layer
groups and loads go by whole layers. Every expert stores the fused tensor's one ``step`` counter
(a mixed composite takes the newest). 8-bit moments' blocks ignore expert rows: fp32 only."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..models.names import (expert_group, expert_item, expert_of, expert_range, is_fused_expert,
                            joined_group, layer_index)
from ..models.families import fused_expert_count
from ..util.safetensors_io import DTYPE_NAMES
from .host_copies import stored_dtype
from .moments import Q8_KINDS
from .provider import STEP, StateProvider, group_tensors
from .run_dir import RunDir

_log = logging.getLogger(__name__)

ExpertSlices = dict[str, tuple[int, int, tuple[int, ...]]]
"""Per HF name of a fused tensor: the group's ``(start, stop)`` in its flattened elements, and
its full shape."""


class ExpertGroupsProvider:
    """``inner``'s groups with every MoE layer split into its non-expert part and its experts
    (``num_experts`` each, dim 0 of the fused tensors); other attributes are ``inner``'s."""

    def __init__(self, inner: StateProvider, num_experts: int):
        if num_experts < 2:
            raise ValueError(f"expert groups need at least 2 routed experts, got {num_experts}")
        self.inner, self.num_experts = inner, num_experts
        self._groups: dict[str, list[str]] = {}
        self._slices: dict[str, ExpertSlices] = {}
        self._parts: dict[str, list[str]] = {}
        """Layer group -> its expert groups (only the layers that were split)."""
        for g, names in inner.group_names().items():
            fused = self._fused(g, names) if layer_index(g) is not None else {}
            if not fused:
                self._groups[g] = list(names)
                continue
            self._groups[g] = [n for n in names if n not in fused]
            self._parts[g] = []
            for e in range(num_experts):
                eg = expert_group(layer_index(g), e)
                mine = {n: (shape, e_of) for n, (shape, e_of) in fused.items() if e_of in (e, None)}
                self._groups[eg] = list(mine)
                self._slices[eg] = {n: (*(expert_range(shape, e) if e_of is None
                                          else (0, math.prod(shape))), shape)
                                    for n, (shape, e_of) in mine.items()}
                self._parts[g].append(eg)

    def _fused(self, group: str, names: list[str]) -> dict[str, tuple[tuple[int, ...], int | None]]:
        """A layer's expert tensors: name -> (shape, its expert, or None for a fused tensor
        that holds them all)."""
        params = self.inner.params(group)
        out: dict[str, tuple[tuple[int, ...], int | None]] = {}
        for n in names:
            shape = tuple(params[n].shape)
            if is_fused_expert(n) and len(shape) >= 1 and shape[0] == self.num_experts:
                out[n] = (shape, None)
            elif (e := expert_item(n)) is not None and e < self.num_experts:
                out[n] = (shape, e)
        return out

    def __getattr__(self, name: str) -> Any:  # model_config, tied, register_update_hook, ...
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    def expert_slices(self, group: str) -> ExpertSlices | None:
        """Where an expert group's tensors lie in the fused ones; None for any other group."""
        return self._slices.get(group)

    def group_names(self) -> dict[str, list[str]]:
        return self._groups

    def _sliced(self, group: str, tensors: dict[str, torch.Tensor],
                name_of: Callable[[str], str]) -> dict[str, torch.Tensor]:
        """Of the layer's ``tensors``, the ones of ``group``: whole for a non-expert part,
        expert ``e``'s flat range (a view) of each fused tensor for an expert group."""
        slices = self._slices.get(group)
        mine = set(self._groups[group])
        if slices is None:
            return {k: t for k, t in tensors.items() if name_of(k) in mine}
        out = {}
        for k, t in tensors.items():
            n = name_of(k)
            if n not in mine:
                continue
            if any(k.startswith(kind) for kind in Q8_KINDS):
                raise ValueError(f"{n}: expert groups need fp32 optimizer moments, this state "
                                 "keeps 8-bit ones (quantised in blocks across experts); set "
                                 "ckpt.expert_groups=false or use fp32 moments")
            start, stop, _ = slices[n]
            out[k] = t if k.startswith(STEP) else t.reshape(-1)[start:stop]
        return out

    def params(self, group: str) -> dict[str, torch.Tensor]:
        return self._sliced(group, self.inner.params(joined_group(group)), lambda n: n)

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        return self._sliced(group, self.inner.grads(joined_group(group)), lambda n: n)

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        return self._sliced(group, self.inner.optimizer_state(joined_group(group)),
                            lambda k: k.partition("/")[2])

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        """Load a whole layer (its joined tensors, ``resolve``): an expert group alone has no
        meaning to the wrapped state (its step counter is the whole tensor's)."""
        if expert_of(group) is not None:
            raise ValueError(f"load {joined_group(group)!r} as a whole (the joined versions of "
                             f"its experts), not {group!r} alone")
        self.inner.load_group(group, tensors)

    def split_params(self, group: str, params: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """A joined layer's weights (by HF name) as each of its groups has them (views)."""
        if group not in self._parts:
            return {group: params}
        return {g: self._sliced(g, params, lambda n: n) for g in [group, *self._parts[group]]}


def with_expert_groups(provider: StateProvider, store: RunDir) -> StateProvider:
    """``provider`` with its MoE layers split into expert groups, for a run of ``store``; as it
    is for a model without fused experts (nothing to split)."""
    num_experts = fused_expert_count(provider.model_config())
    if num_experts == 0:
        _log.info("ckpt.expert_groups: the model has no fused routed experts; layer groups kept")
        return provider
    return ExpertGroupsProvider(provider, num_experts)


def slice_records(slices: ExpertSlices, tensors: dict[str, torch.Tensor]) -> dict[str, dict]:
    """The ``tensors`` record of an expert group's one shard (``ckpt.shard_ranges``): per blob
    key its range in the flattened full tensor, the full shape, the dtype. A ``step/`` scalar
    is the whole (0-d) counter of its tensor."""
    out = {}
    for k, t in tensors.items():
        n = k.partition("/")[2]
        start, stop, shape = slices[n]
        if k.startswith(STEP):
            out[k] = {"range": [0, 1], "shape": []}
        else:
            assert t.numel() == stop - start, (k, t.numel(), start, stop)
            out[k] = {"range": [start, stop], "shape": list(shape)}
        out[k]["dtype"] = DTYPE_NAMES[stored_dtype(k, t)]
    return out


def chosen_slice_records(provider: StateProvider, selected: list[str],
                         snaps: Mapping[str, dict[str, torch.Tensor]]) -> dict[str, dict[str, dict]]:
    """The shard records of the chosen expert groups (``ckpt.expert_groups``): the ranges
    their tensors take in the layer's fused tensors (none for a provider without experts)."""
    slices_of = getattr(provider, "expert_slices", None)
    if slices_of is None:
        return {}
    out = {}
    for g in selected:
        slices = slices_of(g)
        if slices is not None:
            tensors = snaps[g] if g in snaps else group_tensors(provider, g)
            out[g] = slice_records(slices, tensors)
    return out
