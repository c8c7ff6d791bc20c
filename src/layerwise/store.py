"""HostStore: all training state in host memory, one contiguous flat buffer per unit.

With bf16 compute the fp32 master is *split* (``layerwise.split_master``): the bf16 copy the
device reads plus a 16-bit remainder, 4 bytes per parameter. Weight-decayed parameters come first,
so an optimizer treats each class as one slice. Only copy sources are page-locked, in one arena:
pinning per tensor would cost 2x for a moment and a power-of-two rounding. Units on an NVMe tier
are read or written inside ``staged(unit)`` (``staged_grad``)."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

import torch

from transformers import PretrainedConfig

from .models.adapter import DecoderAdapter, ParamSpec, Unit
from .models.init import build_hf_model
from .split_master import join, round_bf16_, split_
from .state_tier import META, PLACEHOLDER, NvmeStateTier
from .store_bytes import (ARENA_ALIGN_BYTES, StoreFootprint, arena_offsets, check_host_memory,
                          grad_itemsizes_of, resolve_split_master)
from .util.host_memory import alloc_pinned
from .util.units import tensor_nbytes

__all__ = ["ARENA_ALIGN_BYTES", "FlatLayout", "HostAllocator", "HostStore", "PRIVATE",
           "PrivateAllocator", "StoreFootprint", "UnitBuffers", "arena_offsets",
           "check_host_memory", "grad_itemsizes_of", "init_store", "resolve_split_master", "store_footprint"]


@dataclass(frozen=True)
class FlatLayout:
    """Where each parameter of a unit lives inside its flat buffer."""

    specs: tuple[ParamSpec, ...]
    offsets: tuple[int, ...]
    numel: int
    decay_numel: int
    """Elements ``[0, decay_numel)`` get weight decay: the trained matrices; the rest (1-D
    params, frozen tensors of any shape) do not."""

    @classmethod
    def of(cls, unit: Unit) -> FlatLayout:
        def decays(p: ParamSpec) -> bool:
            return p.trainable and len(p.shape) >= 2

        ordered = sorted(unit.params, key=lambda p: not decays(p))  # stable: matrices first
        offsets, pos, decay = [], 0, 0
        for p in ordered:
            offsets.append(pos)
            pos += p.numel
            if decays(p):
                decay = pos
        return cls(tuple(ordered), tuple(offsets), pos, decay)

    def find(self, local: str) -> tuple[ParamSpec, int]:
        """The spec of parameter ``local`` and its offset in the flat buffer."""
        for p, o in zip(self.specs, self.offsets):
            if p.local == local:
                return p, o
        raise KeyError(local)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views (no copies) into ``flat``, keyed by local name."""
        return {
            p.local: flat[o:o + p.numel].view(p.shape) for p, o in zip(self.specs, self.offsets)
        }

    def leaves(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Like ``views``, but each its own autograd leaf: gradients w.r.t. ``flat`` would make
        autograd scatter each into a zero-filled full-size buffer."""
        return {k: v.detach().requires_grad_() for k, v in self.views(flat).items()}

    def slices(self) -> list[slice]:
        """Each parameter's range in the flat buffer, in layout order."""
        return [slice(o, o + p.numel) for p, o in zip(self.specs, self.offsets)]


class HostAllocator(Protocol):
    """Where a store's shared buffers live: private memory by default; ``layerwise.train.dist`` maps
    one shared-memory file per node. Gradients never go through it: they are a rank's own."""

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
    master: torch.Tensor | None
    """The plain fp32 master, flat; None when the master is split (``remainder``)."""
    grad: torch.Tensor
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    compute: torch.Tensor | None = None
    alloc: HostAllocator = PRIVATE
    """Where ``state`` is allocated (``UnitOptimizer.init_state`` goes through it)."""
    remainder: torch.Tensor | None = None
    """Split master: the int16 low halves; ``compute`` (bf16) holds the high halves."""

    @property
    def name(self) -> str:
        return self.unit.name

    @property
    def split(self) -> bool:
        """Is the fp32 master kept as ``compute`` + ``remainder`` (``layerwise.split_master``)?"""
        return self.remainder is not None

    @property
    def copy_source(self) -> torch.Tensor:
        """What the device receives for this unit: ``compute``, or ``master`` when there is no
        compute copy (fp32 compute). A view into the store's arena: page-locked when the store
        is (``HostStore.pinned``), so it can be copied with ``non_blocking=True``."""
        return self.compute if self.compute is not None else self.master

    def read_master(self, start: int = 0, stop: int | None = None,
                    out: torch.Tensor | None = None) -> torch.Tensor:
        """The fp32 master of elements ``[start, stop)``, flat: a view of a plain master (a copy
        into ``out`` when given), decoded into ``out`` (or a new tensor) when split."""
        stop = self.layout.numel if stop is None else stop
        if not self.split:
            view = self.master[start:stop]
            if out is None:
                return view
            out.view(-1).copy_(view)
            return out
        assert self.compute is not None and self.remainder is not None
        got = join(self.compute[start:stop], self.remainder[start:stop],
                   None if out is None else out.view(-1))
        return got if out is None else out

    def write_master(self, values: torch.Tensor, start: int = 0) -> None:
        """Set the master of elements ``[start, start + values.numel())`` to ``values`` (any
        float dtype, read flat), and with it the copy source."""
        stop = start + values.numel()
        if not 0 <= start <= stop <= self.layout.numel:
            raise ValueError(f"{self.name}: elements [{start}, {stop}) are outside the unit's "
                             f"{self.layout.numel}")
        if self.split:
            assert self.compute is not None and self.remainder is not None
            split_(values, self.compute[start:stop], self.remainder[start:stop])
            return
        self.master[start:stop].copy_(values.detach().reshape(-1))
        if self.compute is not None:
            self._refresh(start, stop)

    def weights(self) -> dict[str, torch.Tensor]:
        """Each parameter's fp32 weights by local name: views of a plain master; decoded copies
        of a split one (write them back with ``write_master``)."""
        if not self.split:
            return self.layout.views(self.master)
        return {p.local: self.read_master(o, o + p.numel).view(p.shape)
                for p, o in zip(self.layout.specs, self.layout.offsets)}

    def refresh_compute(self) -> None:
        """Bring the compute copy up to the plain master (after an update wrote the master);
        nothing to do for a split master, whose update writes the copy source itself."""
        if self.compute is not None and not self.split:
            self._refresh(0, self.layout.numel)

    def _refresh(self, start: int, stop: int) -> None:
        # bf16: the split master's rounding (ties away from zero), so an fp32-master store
        # streams the very bits a split one does; other dtypes: torch's rounding
        assert self.compute is not None and self.master is not None
        if self.compute.dtype == torch.bfloat16:
            round_bf16_(self.master[start:stop], self.compute[start:stop])
        else:
            self.compute[start:stop].copy_(self.master[start:stop])


# ----- bytes, before allocating (the arithmetic is ``store_bytes``) -------------------------

def store_footprint(model: PretrainedConfig | DecoderAdapter, compute_dtype: torch.dtype, *,
                    pin: bool = True, state_nbytes: int = 0,
                    split_master: bool | None = None,
                    grad_dtype: torch.dtype = torch.float32) -> StoreFootprint:
    """Bytes a ``HostStore`` would take, without allocating it (cheap for any size: the layouts come
    from the meta model). ``state_nbytes``: optimizer state, if known."""
    adapter = model if isinstance(model, DecoderAdapter) else DecoderAdapter(model)
    numels = [FlatLayout.of(u).numel for u in adapter.units]
    grads = grad_itemsizes_of([u.name for u in adapter.units], adapter.tied, grad_dtype,
                              compute_dtype)
    return StoreFootprint.of_numels(numels, compute_dtype.itemsize, pin=pin,
                                    state_nbytes=state_nbytes,
                                    split_master=resolve_split_master(compute_dtype, split_master),
                                    grad_itemsizes=grads)


# ----- the store ----------------------------------------------------------------------------

class HostStore:
    """Flat host buffers for every unit of a model.

    ``pin``: page-lock copy sources (default: with CUDA). ``state_nbytes``: counted in the RAM
    check. ``alloc``: where masters, copy sources and state live. ``split_master``: default exactly
    with bf16 compute. ``grad_dtype``: bf16 for one micro-batch per step (2 bytes instead of 4; a
    second micro-batch is refused). ``*_tier``: units whose buffers live on NVMe (not in the RAM
    check)."""

    def __init__(self, adapter: DecoderAdapter, compute_dtype: torch.dtype = torch.float32,
                 pin: bool | None = None, *, state_nbytes: int | None = None,
                 mem_available: Callable[[], int | None] | None = None,
                 alloc: HostAllocator = PRIVATE, split_master: bool | None = None,
                 grad_dtype: torch.dtype = torch.float32, state_tier: NvmeStateTier | None = None,
                 source_tier: NvmeStateTier | None = None,
                 grad_tier: NvmeStateTier | None = None):
        self.adapter = adapter
        self.state_tier = state_tier
        """Where the state of the units it ``holds`` lives (None: all in RAM)."""
        self.source_tier = source_tier
        """Where the copy sources of the units it ``holds`` live (None: all in the arena)."""
        self.grad_tier = grad_tier
        """Where the gradients of the units it ``holds`` live (None: all in RAM)."""
        self.passthrough: dict[str, torch.Tensor] = {}
        """``adapter.passthrough_names``' tensors as the checkpoint holds them (vision tower)."""
        self.alloc = alloc
        self.compute_dtype = compute_dtype
        self.split_master = resolve_split_master(compute_dtype, split_master)
        self.pinned = torch.cuda.is_available() if pin is None else pin
        layouts = [FlatLayout.of(unit) for unit in adapter.units]
        numels = [lay.numel for lay in layouts]
        separate = compute_dtype != torch.float32
        grad_items = grad_itemsizes_of([u.name for u in adapter.units], adapter.tied, grad_dtype,
                                       compute_dtype)
        need = StoreFootprint.of_numels(numels, compute_dtype.itemsize, pin=self.pinned,
                                        state_nbytes=state_nbytes or 0,
                                        split_master=self.split_master, grad_itemsizes=grad_items)
        tiered = [state_tier is not None and state_tier.holds(u.name) for u in adapter.units]
        sourced = [source_tier is not None and source_tier.holds(u.name) for u in adapter.units]
        master_moved = sum(n for n, t, c in zip(numels, tiered, sourced)
                           if (t and (self.split_master or separate)) or (c and not separate))
        compute_moved = sum(n for n, c in zip(numels, sourced) if c and separate)
        need = dataclasses.replace(
            need, master=need.master - need.master // max(need.numel, 1) * master_moved,
            compute=need.compute - compute_dtype.itemsize * compute_moved)
        graded = [grad_tier is not None and grad_tier.holds(u.name) for u in adapter.units]
        need = dataclasses.replace(need, grad=need.grad - sum(
            n * item for n, item, g in zip(numels, grad_items, graded) if g))
        check_host_memory(need, mem_available)

        source_dtype = compute_dtype if separate else torch.float32
        offsets, arena_numel = arena_offsets([0 if c else n for n, c in zip(numels, sourced)],
                                             source_dtype.itemsize)
        self.arena, self._pinned_nbytes = self._alloc_arena(arena_numel, source_dtype)
        """Every unit's copy source, in one allocation (page-locked when ``pinned``)."""
        self.units: list[UnitBuffers] = []
        for unit, layout, off, grad_item, tier, on_source, on_grad in zip(
                adapter.units, layouts, offsets, grad_items, tiered, sourced, graded):
            source = (META.zeros(layout.numel, source_dtype) if on_source
                      else self.arena[off:off + layout.numel])
            unit_alloc = META if tier else alloc  # placeholders, filed by the tier
            master, remainder = source, None
            if self.split_master:
                master, remainder = None, unit_alloc.zeros(layout.numel, torch.int16)
            elif separate:
                master = unit_alloc.zeros(layout.numel, torch.float32)
            grad = (META if on_grad else PRIVATE).zeros(  # a rank's own, never shared
                layout.numel, torch.float32 if grad_item == 4 else torch.bfloat16)
            compute = source if separate else None
            buf = UnitBuffers(unit, layout, master, grad, compute=compute, alloc=unit_alloc,
                              remainder=remainder)
            if tier:
                state_tier.add(buf, {"remainder": remainder} if self.split_master else
                               {"master": master} if separate else {})
            if on_source:
                source_tier.add(buf, {"compute": compute} if separate else {"master": master})
            if on_grad:
                grad_tier.add(buf, {"grad": grad})
            self.units.append(buf)
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

    def staged(self, name: str, write: bool = False, flush: bool = False
               ) -> contextlib.AbstractContextManager:
        """Unit ``name``'s master and optimizer state are real inside (``NvmeStateTier.staged``;
        a unit in RAM always is); ``write``: they are written."""
        stack = contextlib.ExitStack()
        for tier in self._tiers():
            if tier.holds(name):  # a gradient is written by its landing alone (``staged_grad``)
                stack.enter_context(tier.staged(name, write and tier is not self.grad_tier, flush))
        return stack

    def staged_grad(self, name: str, write: bool = False, overwrite: bool = False
                    ) -> contextlib.AbstractContextManager:
        """Unit ``name``'s gradient is real inside; ``write``: it is written (back to NVMe at
        once); ``overwrite``: every element of it, so a gradient on NVMe is not read first."""
        if self.grad_tier is None or not self.grad_tier.holds(name):
            return contextlib.nullcontext()
        return _held(self.grad_tier, name, write, overwrite)

    def _tiers(self) -> list[NvmeStateTier]:
        return [t for t in (self.state_tier, self.source_tier, self.grad_tier) if t is not None]

    def on_nvme_any(self) -> bool:
        """Does any unit keep anything on NVMe?"""
        return bool(self._tiers())

    def on_nvme(self, name: str) -> bool:
        """Does unit ``name`` keep anything on NVMe (its state, its copy source)?"""
        return any(t.holds(name) for t in self._tiers())

    def adopt_state(self, buf: UnitBuffers) -> None:
        """After ``init_state``: file an NVMe unit's new optimizer state (nothing in RAM)."""
        if self.state_tier is not None and self.state_tier.holds(buf.name):
            self.state_tier.adopt_state(buf)

    def close(self) -> None:
        """Remove the NVMe state files (working memory; the checkpoints hold the state)."""
        for tier in self._tiers():
            tier.close()

    def copy_source(self, name: str) -> torch.Tensor:
        """Unit ``name``'s copy source (see ``UnitBuffers.copy_source``)."""
        return self.by_name[name].copy_source

    def footprint(self) -> StoreFootprint:
        """Bytes held now, measured from the buffers (optimizer state included)."""
        numel = sum(b.layout.numel for b in self.units)
        separate = self.units[0].compute is not None if self.units else False
        return StoreFootprint(
            numel=numel, compute_itemsize=self.compute_dtype.itemsize,
            master=sum(_ram_nbytes(b.remainder if b.split else b.master) for b in self.units),
            grad=sum(_ram_nbytes(b.grad) for b in self.units),
            compute=sum(_ram_nbytes(b.compute) for b in self.units) if separate else 0,
            state=sum(_ram_nbytes(t) for b in self.units for t in b.state.values()),
            copy_source=self.copy_source_nbytes(), arena=tensor_nbytes(self.arena),
            pinned=self._pinned_nbytes, split_master=self.split_master)

    def nbytes(self) -> int:
        """Host bytes of the whole store in RAM: buffers, optimizer state and the arena's
        padding (not the state on NVMe, nor its staging slots)."""
        return self.footprint().total

    def pinned_nbytes(self) -> int:
        """Page-locked bytes (0 when not pinned): the copy-source arena, in whole pages."""
        return self._pinned_nbytes

    def copy_source_nbytes(self) -> int:
        """Bytes of all units' copy sources (what one pass of weights streams to the device)."""
        return sum(tensor_nbytes(b.copy_source) for b in self.units)

    # ----- moving weights in and out ------------------------------------------------------

    def load_hf_tensor(self, hf_name: str, tensor: torch.Tensor) -> None:
        """Copy one HF state-dict tensor into its place (shape-checked), copy source included."""
        mapping = self._hf_map()
        if hf_name not in mapping and hf_name in self.adapter.passthrough_names:
            self.passthrough[hf_name] = tensor.detach().clone()  # as read: exported bit for bit
            return
        if hf_name not in mapping:
            raise KeyError(hf_name)
        unit_name, local = mapping[hf_name]
        buf = self.by_name[unit_name]
        spec, offset = buf.layout.find(local)
        if tuple(tensor.shape) != tuple(spec.shape):
            raise ValueError(
                f"{hf_name}: shape {tuple(tensor.shape)} does not match the model config's "
                f"{tuple(spec.shape)}; the checkpoint and config.json disagree"
            )
        with self.staged(unit_name, write=True):
            buf.write_master(tensor, offset)

    def _hf_map(self) -> dict[str, tuple[str, str]]:
        if not hasattr(self, "_hf_map_cache"):
            m = {p.hf_name: (u.unit.name, p.local) for u in self.units for p in u.unit.params}
            self._hf_map_cache = m
        return self._hf_map_cache

    def copy_from_model(self, model: torch.nn.Module) -> None:
        """Fill master weights (and copy sources) from an HF model instance's state dict."""
        sd = model.state_dict()
        for name in (*self._hf_map(), *self.adapter.passthrough_names):
            self.load_hf_tensor(name, sd[name])

    def iter_hf_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF key, fp32 weights) for every distinct tensor, unit by unit: views of a plain
        master, one decoded copy at a time of a split one."""
        for b in self.units:
            nvme = self.on_nvme(b.name)
            for p, o in zip(b.layout.specs, b.layout.offsets):
                with self.staged(b.name):
                    w = b.read_master(o, o + p.numel).view(p.shape)
                    if nvme and not b.split:
                        w = w.clone()  # a view into a staging slot outlives nothing
                yield p.hf_name, w

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-keyed fp32 weights (tied head key included when tied): views of plain masters,
        decoded copies of split ones (the whole model in fp32: for tests and small models)."""
        sd = dict(self.iter_hf_tensors())
        if self.adapter.tied:
            sd[self.adapter.head_weight_name] = sd[self.adapter.units[0].params[0].hf_name]
        return sd

    def refresh_compute(self) -> None:
        """Every unit's ``UnitBuffers.refresh_compute`` (after writing plain masters directly)."""
        for b in self.units:
            with self.staged(b.name):
                b.refresh_compute()

    def zero_grads(self) -> None:
        for b in self.units:
            with self.staged_grad(b.name, write=True, overwrite=True):
                b.grad.zero_()


@contextlib.contextmanager
def _held(tier: NvmeStateTier, name: str, write: bool, overwrite: bool) -> Iterator[None]:
    tier.acquire(name, overwrite)
    try:
        yield
    finally:
        tier.release(name, write, flush=write)


def _ram_nbytes(t: torch.Tensor | None) -> int:
    """Bytes ``t`` holds in RAM (an NVMe unit's placeholder: none)."""
    return 0 if t is None or t.device.type == PLACEHOLDER else tensor_nbytes(t)


def init_store(config: PretrainedConfig, seed: int = 0, compute_dtype: torch.dtype = torch.float32,
               pin: bool | None = None, *, alloc: HostAllocator = PRIVATE,
               split_master: bool | None = None, grad_dtype: torch.dtype = torch.float32,
               **tiers: NvmeStateTier) -> tuple[DecoderAdapter, HostStore]:
    """Adapter + HostStore holding exactly ``build_hf_model(config, seed)``'s weights, via an HF
    model built on the host once: for small models (tests, demo, CPU benchmarks)."""
    adapter = DecoderAdapter(config)
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin, alloc=alloc,
                      split_master=split_master, grad_dtype=grad_dtype, **tiers)
    store.copy_from_model(build_hf_model(config, seed))
    return adapter, store
