"""The host store of a LoRA run: the frozen base held once, in its streaming format (quantised
when loaded); fp32 master, gradient and state for the adapters alone, so the engine, optimizer
and checkpoints treat them as the unit's parameters."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ..models.adapter import DecoderAdapter
from ..models.init import build_hf_model
from ..store import (PRIVATE, HostAllocator, HostStore, StoreFootprint, UnitBuffers,
                     arena_offsets, check_host_memory)
from ..util.host_memory import locked_nbytes
from ..util.units import tensor_nbytes
from .layout import LoraLayout
from .linear import dense_weight
from .lora_adapter import LoraAdapter
from .quant import is_packed, quantize_into, roundtrips


@dataclass
class LoraUnitBuffers(UnitBuffers):
    source: torch.Tensor | None = None
    """The unit's whole copy source (adapters, then the frozen base) in the arena."""

    @property
    def copy_source(self) -> torch.Tensor:
        return self.source

    def refresh_compute(self) -> None:
        n = self.layout.numel
        if n and self.master.data_ptr() != self.source.data_ptr():
            self.source[:n].copy_(self.master)


def lora_footprint(adapter: LoraAdapter, compute_dtype: torch.dtype, *, pin: bool = True,
                   state_nbytes: int = 0) -> StoreFootprint:
    """Host bytes of ``LoraStore(adapter, compute_dtype)``, before allocating. ``master`` and
    ``grad`` are the adapters'; ``compute`` is the rest of the copy sources (the frozen base, plus
    the adapters' compute copy when that is not fp32)."""
    item = compute_dtype.itemsize
    layouts = [adapter.layouts[u.name] for u in adapter.units]
    trainable = sum(lay.numel for lay in layouts)
    source = sum(lay.source_numel for lay in layouts) * item
    _, arena_numel = arena_offsets([lay.source_numel for lay in layouts], item)
    separate = compute_dtype != torch.float32
    return StoreFootprint(
        numel=trainable, compute_itemsize=item, master=4 * trainable, grad=4 * trainable,
        compute=source - (0 if separate else 4 * trainable), state=state_nbytes, copy_source=source,
        arena=arena_numel * item, pinned=locked_nbytes(arena_numel * item) if pin else 0)


class LoraStore(HostStore):
    """A ``HostStore`` whose units train their adapters and stream a frozen base."""

    def __init__(self, adapter: LoraAdapter, compute_dtype: torch.dtype = torch.float32,
                 pin: bool | None = None, *, state_nbytes: int | None = None,
                 mem_available: Callable[[], int | None] | None = None,
                 alloc: HostAllocator = PRIVATE):
        # not HostStore.__init__: the buffers differ (no base master or gradient)
        self.adapter = adapter
        self.state_tier = self.source_tier = self.grad_tier = None  # adapters are small: their state stays in RAM
        self.alloc = alloc
        self.compute_dtype = compute_dtype
        self.pinned = torch.cuda.is_available() if pin is None else pin
        check_host_memory(lora_footprint(adapter, compute_dtype, pin=self.pinned,
                                         state_nbytes=state_nbytes or 0), mem_available)
        layouts = [adapter.layouts[u.name] for u in adapter.units]
        offsets, arena_numel = arena_offsets([lay.source_numel for lay in layouts],
                                             compute_dtype.itemsize)
        self.arena, self._pinned_nbytes = self._alloc_arena(arena_numel, compute_dtype)
        separate = compute_dtype != torch.float32
        self.units: list[UnitBuffers] = []
        for unit, layout, off in zip(adapter.units, layouts, offsets):
            source = self.arena[off:off + layout.source_numel]
            master = (alloc.zeros(layout.numel, torch.float32) if separate
                      else source[:layout.numel])
            grad = torch.zeros(layout.numel)
            self.units.append(LoraUnitBuffers(unit, layout, master, grad, alloc=alloc,
                                              source=source))
        self.by_name = {b.name: b for b in self.units}
        self._frozen = {e.hf_name: (b, e) for b in self.units for e in b.layout.frozen}
        self.release_format = False
        """The base format is the release's own (``lora.base_dtype=auto`` on a quantized
        release): each packed tensor must give back the values read, or the run is refused."""

    # ----- bytes -------------------------------------------------------------------------------

    def footprint(self) -> StoreFootprint:
        source = self.copy_source_nbytes()
        in_arena = sum(tensor_nbytes(b.master) for b in self.units
                       if b.layout.numel and b.master.data_ptr() == b.source.data_ptr())
        return StoreFootprint(
            numel=sum(b.layout.numel for b in self.units), compute_itemsize=self.compute_dtype.itemsize,
            master=sum(tensor_nbytes(b.master) for b in self.units),
            grad=sum(tensor_nbytes(b.grad) for b in self.units), compute=source - in_arena,
            state=sum(tensor_nbytes(t) for b in self.units for t in b.state.values()),
            copy_source=source, arena=tensor_nbytes(self.arena), pinned=self._pinned_nbytes)

    def base_nbytes(self, layers_only: bool = False) -> int:
        """Host bytes holding the frozen base (each tensor's region in the arena, measured from the
        store's tensors); ``layers_only``: the decoder layers' alone."""
        units = self.layers if layers_only else self.units
        return sum(tensor_nbytes(e.view(b.source.view(torch.uint8))) for b in units
                   for e in b.layout.frozen)

    # ----- the base in ----------------------------------------------------------------------------

    def _hf_map(self) -> dict[str, tuple[str, str]]:
        return {name: (b.name, e.local) for name, (b, e) in self._frozen.items()}

    def load_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> None:
        """One base tensor into its place, quantised when its format is (shape-checked)."""
        if hf_name not in self._frozen:
            raise KeyError(hf_name)
        buf, entry = self._frozen[hf_name]
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{hf_name}: shape {tuple(tensor.shape)} does not match the model "
                             f"config's {entry.shape}; the checkpoint and config.json disagree")
        view = entry.view(buf.source.view(torch.uint8))
        if is_packed(entry.fmt):
            quantize_into(entry.fmt, tensor, view)
            if self.release_format and not roundtrips(entry.fmt, tensor, view):
                raise ValueError(
                    f"{hf_name}: the release's values do not pack back into {entry.fmt} exactly "
                    "(its blocks or scales are not the format's); set lora.base_dtype=bf16 to "
                    "hold the base dequantized")
        else:
            view.copy_(tensor)

    def copy_from_model(self, model: torch.nn.Module) -> None:
        sd = model.state_dict()
        for name in self._frozen:
            self.load_hf_tensor(name, sd[name])
        self.refresh_compute()

    def base_weight(self, hf_name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """A base tensor as the device computes with it (dequantised), on the host."""
        buf, entry = self._frozen[hf_name]
        return dense_weight(entry.view(buf.source.view(torch.uint8)), entry.fmt, entry.shape, dtype)

    # ----- adapters -------------------------------------------------------------------------------

    def init_adapters(self, seed: int, init_b: Callable[[torch.Tensor, torch.Generator], None] | None = None
                      ) -> None:
        """PEFT's default init: ``lora_A`` Kaiming-uniform (a = sqrt 5), ``lora_B`` zero (so the
        model starts as the base). ``init_b(B, generator)``: fill B instead (tests: B != 0)."""
        g = torch.Generator().manual_seed(seed)
        for b in self.units:
            for local, view in b.layout.trainable.views(b.master).items():
                if ".lora_A." in local:
                    bound = 1.0 / math.sqrt(view.shape[1])  # kaiming_uniform_(a=sqrt(5)) bound
                    view.copy_(torch.rand(view.shape, generator=g) * 2 * bound - bound)
                elif init_b is None:
                    view.zero_()
                else:
                    init_b(view, g)
        self.refresh_compute()

    def adapter_tensors(self) -> dict[str, torch.Tensor]:
        """Every adapter's fp32 master view, by its PEFT key without ``base_model.model.``."""
        out = {}
        for b in self.units:
            views = b.layout.trainable.views(b.master)
            out.update({p.hf_name: views[p.local] for p in b.unit.params})
        return out

    def load_adapters(self, tensors: dict[str, torch.Tensor]) -> None:
        """Adapter weights by name (a PEFT adapter's, prefix removed); every adapter is needed."""
        mine = self.adapter_tensors()
        missing, extra = sorted(set(mine) - set(tensors)), sorted(set(tensors) - set(mine))
        if missing or extra:
            raise ValueError(f"the adapter does not match lora.target_modules / the model: missing "
                             f"{missing[:3]}, unexpected {extra[:3]}")
        for name, view in mine.items():
            if tuple(tensors[name].shape) != tuple(view.shape):
                raise ValueError(f"{name}: adapter shape {tuple(tensors[name].shape)} != "
                                 f"{tuple(view.shape)} (a different lora.r?)")
            view.copy_(tensors[name])
        self.refresh_compute()

    # ----- out: merged weights ----------------------------------------------------------------------

    def merged_tensors(self, unit: str) -> dict[str, torch.Tensor]:
        """HF key -> fp32 tensor of ``unit``'s base with its adapters merged in (the dequantised
        weight + ``B A * alpha / r``), as PEFT's ``merge_and_unload`` computes it."""
        scaling = self.adapter.lora.scaling
        b = self.by_name[unit]
        adapters = b.layout.trainable.views(b.master)
        out = {}
        for entry in b.layout.frozen:
            w = self.base_weight(entry.hf_name)
            mod = entry.local.removesuffix(".weight")
            a = adapters.get(f"{mod}.lora_A.weight")
            if a is not None:
                w = w + scaling * (adapters[f"{mod}.lora_B.weight"] @ a)
            out[entry.hf_name] = w
        return out

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, fp32 tensor) of the merged model, unit by unit."""
        for b in self.units:
            yield from self.merged_tensors(b.name).items()

    def unit_of(self, hf_name: str) -> str:
        """The unit holding base tensor ``hf_name``."""
        return self._frozen[hf_name][0].name


def init_lora_store(config, lora, seed: int = 0, compute_dtype: torch.dtype = torch.float32,
                    pin: bool | None = None) -> tuple[LoraAdapter, LoraStore]:
    """A LoRA store over the base ``build_hf_model(config, seed)`` has, adapters PEFT-initialised."""
    adapter = LoraAdapter(DecoderAdapter(config), lora, compute_dtype, seed)
    store = LoraStore(adapter, compute_dtype, pin)
    store.copy_from_model(build_hf_model(config, seed))
    store.init_adapters(seed)
    return adapter, store
