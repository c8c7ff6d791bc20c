"""Where a LoRA unit's tensors live in its flat buffer: trainable adapters first, frozen base after.

:class:`LoraLayout` answers as ``store.FlatLayout`` does about the trainable part, and adds the
frozen part (plain views, each in its own format, aligned to ``FROZEN_ALIGN_BYTES``) when handed a
whole copy source. A unit without adapters has ``numel == 0``: no gradient, no update."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..models.adapter import ParamSpec
from ..store import FlatLayout
from .quant import dequantize

FROZEN_ALIGN_BYTES = 64
"""Each frozen tensor starts at a multiple of this many bytes (any dtype's view is aligned)."""


@dataclass(frozen=True)
class FrozenEntry:
    local: str
    """Name in the unit's template (the HF name's tail, e.g. ``self_attn.q_proj.weight``)."""
    hf_name: str
    shape: tuple[int, ...]
    fmt: str
    """``float`` (held in ``dtype``) or a format of ``adapters.quant`` (packed bytes)."""
    dtype: torch.dtype
    """The held dtype of a ``float`` entry; ``torch.uint8`` for a packed one."""
    byte_offset: int
    nbytes: int
    bind_dtype: torch.dtype | None = None
    """A packed entry no module unpacks itself (an expert tensor) is dequantised to this dtype
    when the layer is bound; None: bound as held."""

    @property
    def numel(self) -> int:
        """Parameters of the base this entry holds."""
        return math.prod(self.shape)

    def view(self, raw: torch.Tensor) -> torch.Tensor:
        """The held bytes (a packed entry) or tensor (a ``float`` one) in ``raw``."""
        part = raw[self.byte_offset:self.byte_offset + self.nbytes]
        return part if self.fmt != "float" else part.view(self.dtype).view(self.shape)

    def bound(self, raw: torch.Tensor) -> torch.Tensor:
        """What the layer's module is bound to: the held view, or dequantised (``bind_dtype``)."""
        held = self.view(raw)
        return held if self.bind_dtype is None else dequantize(self.fmt, held, self.shape, self.bind_dtype)


@dataclass(frozen=True)
class LoraLayout:
    trainable: FlatLayout
    frozen: tuple[FrozenEntry, ...]
    itemsize: int
    """Bytes per element of the compute dtype (the flat buffers' dtype)."""
    source_numel: int
    """Elements (compute dtype) of the whole copy source: adapters, then the frozen base."""

    @classmethod
    def build(cls, trainable: tuple[ParamSpec, ...],
              frozen: list[tuple[ParamSpec, str, torch.dtype, int, torch.dtype | None]],
              itemsize: int) -> LoraLayout:
        """``frozen``: (spec, format, held dtype, bytes, bind dtype) per base tensor, in order."""
        flat = FlatLayout.of(_TrainableUnit(trainable))
        pos = _round_up(flat.numel * itemsize, FROZEN_ALIGN_BYTES)
        entries = []
        for spec, fmt, dtype, nbytes, bind in frozen:
            entries.append(FrozenEntry(spec.local, spec.hf_name, spec.shape, fmt, dtype, pos, nbytes, bind))
            pos = _round_up(pos + nbytes, FROZEN_ALIGN_BYTES)
        return cls(flat, tuple(entries), itemsize, -(-pos // itemsize))

    # ----- the engine's questions, about the trainable part --------------------------------

    @property
    def specs(self) -> tuple[ParamSpec, ...]:
        return self.trainable.specs

    @property
    def offsets(self) -> tuple[int, ...]:
        return self.trainable.offsets

    @property
    def numel(self) -> int:
        return self.trainable.numel

    @property
    def decay_numel(self) -> int:
        return self.trainable.decay_numel

    def slices(self) -> list[slice]:
        return self.trainable.slices()

    def find(self, local: str) -> tuple[ParamSpec, int]:
        return self.trainable.find(local)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adapter views of ``flat`` (a master, gradient, moment: adapters only), plus the frozen
        base's when ``flat`` is a whole copy source or weight slot."""
        out = self.trainable.views(flat[:self.numel])
        out.update(self.frozen_views(flat))
        return out

    def leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Adapters as autograd leaves (in layout order, first), frozen base as plain views."""
        out = self.trainable.leaves(flat[:self.numel])
        out.update(self.frozen_views(flat))
        return out

    def frozen_views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        if flat.numel() < self.source_numel:
            return {}
        raw = flat.view(torch.uint8)
        return {e.local: e.bound(raw) for e in self.frozen}


@dataclass(frozen=True)
class _TrainableUnit:
    """What ``FlatLayout.of`` reads of a unit: its parameters."""

    params: tuple[ParamSpec, ...]


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
