"""A HostStore's bytes, by buffer, before anything is allocated; the copy-source arena's layout;
the refusal of a store that does not fit in RAM. Apart from ``layerwise.store`` so the planner
shares the arithmetic without the store's buffers."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .models.names import EMBED, HEAD
from .util.host_memory import available_host_memory, locked_nbytes
from .util.units import human_bytes


# ----- the pinned arena ---------------------------------------------------------------------

ARENA_ALIGN_BYTES = 256
"""Each unit's copy source starts at a multiple of this many bytes inside the arena: the
alignment ``cudaMalloc`` gives device buffers, so a copy's source and destination line up."""


def arena_offsets(numels: Sequence[int], element_size: int) -> tuple[list[int], int]:
    """Offset (in elements) of each slice of ``numels`` in one arena, and the arena's length; slices
    start at ``ARENA_ALIGN_BYTES`` multiples, the padding counted as pinned."""
    align = ARENA_ALIGN_BYTES // element_size
    offsets, pos = [], 0
    for n in numels:
        pos = -(-pos // align) * align
        offsets.append(pos)
        pos += n
    return offsets, pos


# ----- bytes, before and after allocating ---------------------------------------------------

@dataclass(frozen=True)
class StoreFootprint:
    """Host bytes of a HostStore, by buffer (all RAM; the pinned bytes are part of it). bf16 split
    master: 2 (remainder) + 4 or 2 (grad) + 2 (compute, pinned) bytes per parameter, plus moments.
    """

    numel: int
    """Parameters."""
    compute_itemsize: int
    """Bytes per element of the compute dtype; 4 (fp32) means no compute copy."""
    master: int
    """The master apart from the compute copy: 4 bytes per parameter (fp32), or 2 when split
    (the remainder; the high halves are ``compute``)."""
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
    split_master: bool = False
    """The master is kept as the bf16 compute copy + a 16-bit remainder."""

    @classmethod
    def of_numels(cls, numels: Sequence[int], compute_itemsize: int, *, pin: bool = True,
                  state_nbytes: int = 0, split_master: bool | None = None,
                  grad_itemsizes: Sequence[int] | None = None) -> StoreFootprint:
        """The footprint of a store whose units hold ``numels`` parameters. ``split_master`` None:
        the default for a 2-byte compute dtype (bf16); False for fp16. ``grad_itemsizes``: default
        4."""
        n = sum(numels)
        separate = compute_itemsize != 4
        split = separate and compute_itemsize == 2 if split_master is None else split_master
        if split and compute_itemsize != 2:
            raise ValueError(f"a split master needs a 2-byte (bf16) compute dtype, got "
                             f"{compute_itemsize} bytes")
        copy_item = compute_itemsize if separate else 4
        _, arena_numel = arena_offsets(numels, copy_item)
        arena = arena_numel * copy_item
        grads = [4] * len(numels) if grad_itemsizes is None else list(grad_itemsizes)
        assert len(grads) == len(numels), "one gradient item size per unit"
        return cls(numel=n, compute_itemsize=compute_itemsize, master=(2 if split else 4) * n,
                   grad=sum(g * k for g, k in zip(grads, numels)), compute=copy_item * n if separate else 0, state=state_nbytes,
                   copy_source=copy_item * n, arena=arena,
                   pinned=locked_nbytes(arena) if pin else 0, split_master=split)

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
        if self.split_master:
            parts = [f"fp32 master as its bf16 compute copy {human_bytes(self.compute)} + "
                     f"16-bit remainder {human_bytes(self.master)}"]
        else:
            parts = [f"fp32 master {human_bytes(self.master)}"]
        grad_kind = "fp32 grad" if self.grad == 4 * self.numel else "bf16/fp32 grad"
        parts.append(f"{grad_kind} {human_bytes(self.grad)}")
        if self.compute and not self.split_master:
            parts.append(f"{self.compute_itemsize}-byte compute copy {human_bytes(self.compute)}")
        parts.append(f"optimizer state {human_bytes(self.state)}" if self.state
                     else "optimizer state not counted")
        pinned = f"; of which {human_bytes(self.pinned)} pinned (the copy sources)" if self.pinned else ""
        return " + ".join(parts) + pinned


def resolve_split_master(compute_dtype: torch.dtype, split_master: bool | None) -> bool:
    """Whether a store of ``compute_dtype`` splits its master: by default exactly with bf16
    (fp16 is not the top half of an fp32; fp32 compute has no separate copy to share)."""
    if split_master is None:
        return compute_dtype == torch.bfloat16
    if split_master and compute_dtype != torch.bfloat16:
        raise ValueError(f"split_master=True needs bf16 compute (the master's high halves are "
                         f"the bf16 copy the device reads), got {compute_dtype}; use "
                         "compute_dtype=torch.bfloat16 or split_master=False")
    return split_master


def grad_itemsizes_of(unit_names: Sequence[str], tied: bool, grad_dtype: torch.dtype,
                      compute_dtype: torch.dtype) -> list[int]:
    """Bytes per gradient element of each unit for ``grad_dtype``. bf16 applies where the device
    computes it in bf16 (decoder layers, an untied embedding); the head and a tied embedding are
    summed in fp32 and stay fp32."""
    if grad_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_dtype must be torch.float32 or torch.bfloat16, got {grad_dtype}")
    if grad_dtype == torch.bfloat16 and compute_dtype != torch.bfloat16:
        raise ValueError(f"grad_dtype=torch.bfloat16 needs bf16 compute (the gradient lands as "
                         f"the device computed it), got {compute_dtype}; use grad_dtype="
                         "torch.float32")
    if grad_dtype == torch.float32:
        return [4] * len(unit_names)
    return [4 if n == HEAD or (n == EMBED and tied) else 2 for n in unit_names]


def check_host_memory(need: StoreFootprint,
                      available: Callable[[], int | None] | None = None) -> None:
    """Refuse (``ValueError``, saying what to do) a store that would not fit in the RAM available
    now; ``available`` returning None checks nothing."""
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
