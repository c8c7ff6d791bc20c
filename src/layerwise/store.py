"""HostStore: all training state in host memory, one contiguous flat buffer per unit.

Per unit (``embed``, ``layers.{i}``, ``head``) the store keeps:

- ``master``: fp32 master weights, flat;
- ``grad``: fp32 gradient accumulator, flat, same layout;
- ``state``: the optimizer's buffers for this unit (created by the optimizer);
- ``compute``: optional copy of the weights in the compute dtype (e.g. bf16), refreshed after
  every update, so the device receives half the bytes and never sees the fp32 master.

A flat layout puts weight-decayed parameters first and the rest (norms, biases) after, so an
optimizer can treat each class as one contiguous slice.

Host memory. Only the *copy sources* (what the device reads: each unit's ``compute`` copy, or
its ``master`` when the compute dtype is fp32) are page-locked, all of them in one arena: one
exact-size allocation, page-locked in place, sliced per unit at ``ARENA_ALIGN_BYTES``
boundaries. fp32 masters that are not copy sources, gradients and optimizer state stay pageable
(the device never reads them; gradients come back through the engine's own pinned buffers).
Pinning tensor by tensor would cost 2x for a moment per tensor and a power-of-two rounding of
each block by the CUDA host allocator; how a region is locked, and how much RAM the machine has
left, is ``layerwise.util.host_memory``.

``StoreFootprint`` is the byte count of a store, computed without allocating (from a config,
an adapter or a list of unit sizes) or measured from a live one; ``check_host_memory`` refuses a
store that does not fit in the RAM the machine has available, before anything is allocated.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from transformers import PretrainedConfig

from .models.adapter import DecoderAdapter, ParamSpec, Unit
from .models.init import build_hf_model
from .util.host_memory import alloc_pinned, available_host_memory, locked_nbytes
from .util.units import human_bytes, tensor_nbytes


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


class HostAllocator(Protocol):
    """Where a store's shared buffers (masters, copy sources, optimizer state) live.

    The default is private memory; ``layerwise.train.dist`` maps them from one shared-memory
    file per node instead, so the local ranks of a node hold one copy. Gradients never go
    through it: they are a rank's own.
    """

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled flat tensor (zero as seen by the first process to map it)."""

    def arena(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, int]:
        """``nbytes`` of zero-filled uint8 for the copy sources, and the bytes page-locked
        (0 when ``pin`` is false or locking was refused)."""


class PrivateAllocator:
    """This process's own memory: what a single-process store uses."""

    def zeros(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(numel, dtype=dtype)

    def arena(self, nbytes: int, pin: bool) -> tuple[torch.Tensor, int]:
        if not pin:
            return torch.zeros(nbytes, dtype=torch.uint8), 0
        raw, locked = alloc_pinned(nbytes)
        raw.zero_()
        return raw, locked


PRIVATE = PrivateAllocator()


@dataclass
class UnitBuffers:
    unit: Unit
    layout: FlatLayout
    master: torch.Tensor
    grad: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: torch.Tensor | None = None
    alloc: HostAllocator = PRIVATE
    """Where ``state`` is allocated (``UnitOptimizer.init_state`` goes through it)."""

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def copy_source(self) -> torch.Tensor:
        """What the device receives for this unit: ``compute``, or ``master`` when there is no
        compute copy (fp32 compute). A view into the store's arena: page-locked when the store
        is (``HostStore.pinned``), so it can be copied with ``non_blocking=True``."""
        return self.compute if self.compute is not None else self.master

    def weights(self) -> dict[str, torch.Tensor]:
        return self.layout.views(self.master)

    def refresh_compute(self) -> None:
        if self.compute is not None:
            self.compute.copy_(self.master)


# ----- the pinned arena ---------------------------------------------------------------------

ARENA_ALIGN_BYTES = 256
"""Each unit's copy source starts at a multiple of this many bytes inside the arena: the
alignment ``cudaMalloc`` gives device buffers, so a copy's source and destination line up."""


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def arena_offsets(numels: Sequence[int], element_size: int,
                  align_bytes: int = ARENA_ALIGN_BYTES) -> tuple[list[int], int]:
    """Offset (in elements) of each slice of ``numels`` in one arena, and the arena's length.

    Every slice starts at a multiple of ``align_bytes``; the padding between slices is part of
    the arena (and counted as pinned); there is none after the last slice.
    """
    if align_bytes % element_size:
        raise ValueError(f"align_bytes={align_bytes} is not a multiple of the element size "
                         f"{element_size}")
    align = align_bytes // element_size
    offsets, pos = [], 0
    for n in numels:
        pos = _round_up(pos, align)
        offsets.append(pos)
        pos += n
    return offsets, pos


# ----- bytes, before and after allocating ---------------------------------------------------

@dataclass(frozen=True)
class StoreFootprint:
    """Host bytes of a HostStore, by buffer. All host RAM: the pinned bytes are part of it.

    ``total`` = master + grad + compute + state + arena padding. With bf16 compute:
    4 + 4 + 2 (+ moments) bytes per parameter, of which the 2 of the compute copy are pinned.
    """

    numel: int
    """Parameters."""
    compute_itemsize: int
    """Bytes per element of the compute dtype; 4 (fp32) means no compute copy."""
    master: int
    grad: int
    compute: int
    """Separate compute copies (0 with fp32 compute, where the master is the copy source)."""
    state: int
    """Optimizer state (0 when not known)."""
    copy_source: int
    """Bytes the device reads: every unit's compute copy, or master with fp32 compute."""
    arena: int
    """The arena holding the copy sources: ``copy_source`` plus alignment padding."""
    pinned: int
    """Page-locked bytes (0 when the store is not pinned): the arena, in whole pages."""

    @classmethod
    def of_numels(cls, numels: Sequence[int], compute_itemsize: int, *, pin: bool = True,
                  state_nbytes: int = 0) -> StoreFootprint:
        """The footprint of a store whose units hold ``numels`` parameters (nothing allocated)."""
        n = sum(numels)
        separate = compute_itemsize != 4
        copy_item = compute_itemsize if separate else 4
        _, arena_numel = arena_offsets(numels, copy_item)
        arena = arena_numel * copy_item
        return cls(numel=n, compute_itemsize=compute_itemsize, master=4 * n, grad=4 * n,
                   compute=copy_item * n if separate else 0, state=state_nbytes,
                   copy_source=copy_item * n, arena=arena,
                   pinned=locked_nbytes(arena) if pin else 0)

    @property
    def padding(self) -> int:
        return self.arena - self.copy_source

    @property
    def total(self) -> int:
        return self.master + self.grad + self.compute + self.state + self.padding

    @property
    def pinned_over_copy_source(self) -> float:
        return self.pinned / self.copy_source if self.copy_source else 0.0

    def with_state(self, state_nbytes: int) -> StoreFootprint:
        return dataclasses.replace(self, state=state_nbytes)

    def describe(self) -> str:
        """``fp32 master 59.08 GB + fp32 grad 59.08 GB + 2-byte compute copy 29.54 GB + ...``"""
        parts = [f"fp32 master {human_bytes(self.master)}", f"fp32 grad {human_bytes(self.grad)}"]
        if self.compute:
            parts.append(f"{self.compute_itemsize}-byte compute copy {human_bytes(self.compute)}")
        parts.append(f"optimizer state {human_bytes(self.state)}" if self.state
                     else "optimizer state not counted")
        pinned = f"; of which {human_bytes(self.pinned)} pinned (the copy sources)" if self.pinned else ""
        return " + ".join(parts) + pinned


def store_footprint(model: PretrainedConfig | DecoderAdapter, compute_dtype: torch.dtype, *,
                    pin: bool = True, state_nbytes: int = 0) -> StoreFootprint:
    """Bytes a ``HostStore(adapter, compute_dtype, pin)`` would take, without allocating it.

    The unit layouts come from the adapter, which builds the model on the meta device, so this
    is cheap for any size (e.g. ``get_flavor("qwen2.5-14b").build_config()``); the arithmetic is
    the store's own. ``state_nbytes``: optimizer state, if known (``optim``'s ``state_nbytes``).
    """
    adapter = model if isinstance(model, DecoderAdapter) else DecoderAdapter(model)
    numels = [FlatLayout.of(u).numel for u in adapter.units]
    return StoreFootprint.of_numels(numels, compute_dtype.itemsize, pin=pin,
                                    state_nbytes=state_nbytes)


def check_host_memory(need: StoreFootprint,
                      available: Callable[[], int | None] | None = None) -> None:
    """Refuse (``ValueError``) a store that would not fit in the RAM available now.

    ``available`` reads the bytes available (default ``available_host_memory``; tests inject
    one); when it returns None nothing is checked. The message spells out what the store needs
    and what to do about it.
    """
    avail = (available or available_host_memory)()
    if avail is None or need.total <= avail:
        return
    hint = ""
    if not need.state:
        hint = (f"; AdamW moments will add about {human_bytes(8 * need.numel)} more in fp32, "
                f"{human_bytes(2.03 * need.numel)} in 8-bit")
    raise ValueError(
        f"the host store of {need.numel / 1e9:.2f}B parameters needs {human_bytes(need.total)} of "
        f"RAM ({need.describe()}){hint}, but only {human_bytes(avail)} is available. Use 8-bit "
        "optimizer moments (Plan.moments '8bit': about 2 bytes per parameter instead of 8; the "
        "planner picks them when host memory binds), a smaller model, or a machine with more RAM."
    )


# ----- the store ----------------------------------------------------------------------------

def _pin_available() -> bool:
    return torch.cuda.is_available()


class HostStore:
    """Flat host buffers for every unit of a model.

    ``pin``: page-lock the copy sources (default: when CUDA is available). ``state_nbytes``:
    the optimizer state the store will get, if known, so the RAM check counts it.
    ``mem_available``: reads the bytes of RAM available (default ``available_host_memory``).
    ``alloc``: where masters, copy sources and optimizer state live (default: this process's
    memory; gradients always do).
    """

    def __init__(self, adapter: DecoderAdapter, compute_dtype: torch.dtype = torch.float32,
                 pin: bool | None = None, *, state_nbytes: int | None = None,
                 mem_available: Callable[[], int | None] | None = None,
                 alloc: HostAllocator = PRIVATE):
        self.adapter = adapter
        self.alloc = alloc
        self.compute_dtype = compute_dtype
        self.pinned = _pin_available() if pin is None else pin
        layouts = [FlatLayout.of(unit) for unit in adapter.units]
        numels = [lay.numel for lay in layouts]
        separate = compute_dtype != torch.float32
        check_host_memory(StoreFootprint.of_numels(numels, compute_dtype.itemsize,
                                                   pin=self.pinned, state_nbytes=state_nbytes or 0),
                          mem_available)

        source_dtype = compute_dtype if separate else torch.float32
        offsets, arena_numel = arena_offsets(numels, source_dtype.itemsize)
        self.arena, self._pinned_nbytes = self._alloc_arena(arena_numel, source_dtype)
        """Every unit's copy source, in one allocation (page-locked when ``pinned``)."""
        self.units: list[UnitBuffers] = []
        for unit, layout, off in zip(adapter.units, layouts, offsets):
            source = self.arena[off:off + layout.numel]
            master = alloc.zeros(layout.numel, torch.float32) if separate else source
            grad = torch.zeros(layout.numel, dtype=torch.float32)
            compute = source if separate else None
            self.units.append(UnitBuffers(unit, layout, master, grad, compute=compute, alloc=alloc))
        self.by_name = {b.name: b for b in self.units}

    def _alloc_arena(self, numel: int, dtype: torch.dtype) -> tuple[torch.Tensor, int]:
        raw, locked = self.alloc.arena(numel * dtype.itemsize, self.pinned)
        return raw.view(dtype), locked

    def __getitem__(self, name: str) -> UnitBuffers:
        return self.by_name[name]

    def __iter__(self) -> Iterator[UnitBuffers]:
        return iter(self.units)

    @property
    def layers(self) -> list[UnitBuffers]:
        return self.units[1:-1]

    def copy_source(self, name: str) -> torch.Tensor:
        """Unit ``name``'s copy source (see ``UnitBuffers.copy_source``)."""
        return self.by_name[name].copy_source

    def footprint(self) -> StoreFootprint:
        """Bytes held now, measured from the buffers (optimizer state included)."""
        numel = sum(b.layout.numel for b in self.units)
        separate = self.units[0].compute is not None if self.units else False
        return StoreFootprint(
            numel=numel, compute_itemsize=self.compute_dtype.itemsize,
            master=sum(tensor_nbytes(b.master) for b in self.units),
            grad=sum(tensor_nbytes(b.grad) for b in self.units),
            compute=sum(tensor_nbytes(b.compute) for b in self.units) if separate else 0,
            state=sum(tensor_nbytes(t) for b in self.units for t in b.state.values()),
            copy_source=self.copy_source_nbytes(), arena=tensor_nbytes(self.arena),
            pinned=self._pinned_nbytes)

    def nbytes(self) -> int:
        """Host bytes of the whole store: buffers, optimizer state and the arena's padding."""
        return self.footprint().total

    def pinned_nbytes(self) -> int:
        """Page-locked bytes (0 when not pinned): the copy-source arena, in whole pages."""
        return self._pinned_nbytes

    def copy_source_nbytes(self) -> int:
        """Bytes of all units' copy sources (what one pass of weights streams to the device)."""
        return sum(tensor_nbytes(b.copy_source) for b in self.units)

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
               pin: bool | None = None, *, state_nbytes: int | None = None,
               mem_available: Callable[[], int | None] | None = None,
               alloc: HostAllocator = PRIVATE) -> tuple[DecoderAdapter, HostStore]:
    """Adapter + HostStore holding exactly the weights ``build_hf_model(config, seed)`` has.

    The HF model is built on the host once and dropped; fine for the small models this is used
    for (tests, demo, CPU benchmarks). Large models are loaded from a directory instead.
    """
    adapter = DecoderAdapter(config)
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin, state_nbytes=state_nbytes,
                      mem_available=mem_available, alloc=alloc)
    store.copy_from_model(build_hf_model(config, seed))
    return adapter, store
