"""HostStore: all training state in host memory, one contiguous flat buffer per unit.

Per unit (``embed``, ``layers.{i}``, ``head``) the store keeps:

- ``master``: fp32 master weights, flat;
- ``grad``: fp32 gradient accumulator, flat, same layout;
- ``state``: the optimizer's buffers for this unit (created by the optimizer);
- ``compute``: optional copy of the weights in the compute dtype (e.g. bf16), refreshed after
  every update, so the device receives half the bytes and never sees the fp32 master.

A flat layout puts weight-decayed parameters first and the rest (norms, biases) after, so an
optimizer can treat each class as one contiguous slice.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from transformers import PretrainedConfig

from .models.adapter import DecoderAdapter, ParamSpec, Unit
from .models.init import build_hf_model


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lives inside its flat buffer."""

    specs: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]
    numel: int
    decay_numel: int
    """Elements ``[0, decay_numel)`` get weight decay; the rest (1-D params) do not."""

    @classmethod
    def of(cls, unit: Unit) -> FlatLayout:
        ordered = sorted(unit.params, key=lambda p: len(p.shape) < 2)  # stable: matrices first
        offsets, pos, decay = [], 0, 0
        for p in ordered:
            offsets.append(pos)
            pos += p.numel
            if len(p.shape) >= 2:
                decay = pos
        return cls(tuple(ordered), tuple(offsets), pos, decay)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views (no copies) into ``flat``, keyed by local name."""
        return {
            p.local: flat[o:o + p.numel].view(p.shape) for p, o in zip(self.specs, self.offsets)
        }

    def leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Like ``views``, but each view is its own autograd leaf (in layout order).

        Taking gradients w.r.t. these instead of w.r.t. ``flat`` itself avoids autograd
        scattering every parameter's gradient into a zero-filled full-size buffer; the parts
        are joined once (``torch.cat`` in layout order) or added straight into their slices.
        """
        return {k: v.detach().requires_grad_() for k, v in self.views(flat).items()}

    def slices(self) -> list[slice]:
        """Each parameter's range in the flat buffer, in layout order."""
        return [slice(o, o + p.numel) for p, o in zip(self.specs, self.offsets)]


@dataclass
class UnitBuffers:
    unit: Unit
    layout: FlatLayout
    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: torch.Tensor | None = None

    @property
    def name(self) -> str:
        return self.unit.name

    def weights(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.master)

    @property
    def copy_source(self) -> torch.Tensor:
        """What is copied to the device: the compute-dtype copy, or the fp32 master itself."""
        return self.compute if self.compute is not None else self.master

    def refresh_compute(self) -> None:
        if self.compute is not None:
            self.compute.copy_(self.master)


def _pin_available() -> bool:
    return torch.cuda.is_available()


class HostStore:
    """Flat host buffers for every unit of a model."""

    def __init__(self, adapter: DecoderAdapter, compute_dtype: torch.dtype = torch.float32,
                 pin: bool | None = None):
        self.adapter = adapter
        self.compute_dtype = compute_dtype
        self.pinned = _pin_available() if pin is None else pin
        self.units: list[UnitBuffers] = []
        for unit in adapter.units:
            layout = FlatLayout.of(unit)
            master = self._alloc(layout.numel, torch.float32)
            grad = self._alloc(layout.numel, torch.float32)
            compute = None if compute_dtype == torch.float32 else self._alloc(layout.numel, compute_dtype)
            self.units.append(UnitBuffers(unit, layout, master, grad, compute=compute))
        self.by_name = {b.name: b for b in self.units}

    def _alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.zeros(numel, dtype=dtype)
        return t.pin_memory() if self.pinned else t

    def __getitem__(self, name: str) -> UnitBuffers:
        return self.by_name[name]

    def __iter__(self) -> Iterator[UnitBuffers]:
        return iter(self.units)

    @property
    def layers(self) -> list[UnitBuffers]:
        return self.units[1:-1]

    def nbytes(self) -> int:
        total = 0
        for b in self.units:
            for t in (b.master, b.grad, b.compute, *b.state.values()):
                if t is not None:
                    total += t.numel() * t.element_size()
        return total

    # ----- moving weights in and out ------------------------------------------------------

    def load_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Copy one HF state-dict tensor into its place (shape-checked)."""
        mapping = self._hf_map()
        if hf_name not in mapping:
            raise KeyError(hf_name)
        unit_name, local = mapping[hf_name]
        view = self.by_name[unit_name].weights()[local]
        if tuple(tensor.shape) != tuple(view.shape):
            raise ValueError(
                f"{hf_name}: shape {tuple(tensor.shape)} does not match the model config's "
                f"{tuple(view.shape)}; the checkpoint and config.json disagree"
            )
        view.copy_(tensor)

    def _hf_map(self) -> dict[str, tuple[str, str]]:
        if not hasattr(self, "_hf_map_cache"):
            m = {p.hf_name: (u.unit.name, p.local) for u in self.units for p in u.unit.params}
            self._hf_map_cache = m
        return self._hf_map_cache

    def copy_from_model(self, model: torch.nn.Module) -> None:
        """Fill master weights from an HF model instance's state dict."""
        sd = model.state_dict()
        for name in self._hf_map():
            self.load_hf_tensor(name, sd[name])
        self.refresh_compute()

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, fp32 view) for every distinct tensor, unit by unit."""
        for b in self.units:
            views = b.weights()
            for p in b.unit.params:
                yield p.hf_name, views[p.local]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-keyed views of the master weights (tied head key included when tied)."""
        sd = dict(self.iter_hf_tensors())
        if self.adapter.tied:
            sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd

    def refresh_compute(self) -> None:
        for b in self.units:
            b.refresh_compute()

    def zero_grads(self) -> None:
        for b in self.units:
            b.grad.zero_()


def init_store(config: PretrainedConfig, seed: int = 0, compute_dtype: torch.dtype = torch.float32,
               pin: bool | None = None) -> tuple[DecoderAdapter, HostStore]:
    """Adapter + HostStore holding exactly the weights ``build_hf_model(config, seed)`` has.

    The HF model is built on the host once and dropped; fine for the small models this is used
    for (tests, demo, CPU benchmarks). Large models are loaded from a directory instead.
    """
    adapter = DecoderAdapter(config)
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin)
    store.copy_from_model(build_hf_model(config, seed))
    return adapter, store
