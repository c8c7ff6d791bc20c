"""The step program: the exact sequence of operations one micro-batch runs under a Plan.

Plain data, so the same list drives the executor, the weight prefetch, the memory prediction and
the simulator: what is predicted is what runs (op kinds: :class:`OpKind`; ``docs/planner.md``).
:func:`step_program` runs it micro-batch-major, or in groups of ``micro_batches_per_load``
sharing one weight copy (layer-major). :class:`WeightWindow` is the one rule for which weight
buffers the device holds."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import TYPE_CHECKING

from ..models.names import EMBED, HEAD, layer_unit

if TYPE_CHECKING:
    from .plan import Plan


class OpKind(str, Enum):
    """What an op does. A ``str`` subclass whose ``str()`` is its value, so logs, labels and
    JSON read ``layer_bwd``, exactly as when kinds were plain strings."""

    EMBED_FWD = "embed_fwd"
    LAYER_FWD = "layer_fwd"
    HEAD = "head"
    FETCH = "fetch"
    RECOMPUTE_EMBED = "recompute_embed"
    RECOMPUTE_LAYER = "recompute_layer"
    LAYER_BWD = "layer_bwd"
    LAYER_FWD_KEEP = "layer_fwd_keep"
    FETCH_INTERNALS = "fetch_internals"
    LAYER_BWD_KEPT = "layer_bwd_kept"
    EMBED_BWD = "embed_bwd"

    def __str__(self) -> str:
        return self.value


EMBED_OPS = (OpKind.EMBED_FWD, OpKind.RECOMPUTE_EMBED, OpKind.EMBED_BWD)
"""Ops that run the embedding (the forward ones read its weights; ``embed_bwd`` does not)."""
LAYER_OPS = (OpKind.LAYER_FWD, OpKind.RECOMPUTE_LAYER, OpKind.LAYER_BWD, OpKind.LAYER_FWD_KEEP,
             OpKind.LAYER_BWD_KEPT)
"""Ops that run decoder layer ``index``."""
COPY_OPS = (OpKind.FETCH, OpKind.FETCH_INTERNALS)
"""Ops that copy (priced by their bytes); every other op computes."""
RECOMPUTE_OPS = (OpKind.RECOMPUTE_EMBED, OpKind.RECOMPUTE_LAYER)
"""Ops that exist only because the plan dropped a boundary."""
FETCH_AHEAD = 2
"""Fetches (boundaries and internals) are issued this many ops before their own op, so the copy
overlaps the compute before it: the engine issues them then, the memory model counts their bytes
from then."""
FORWARD_OPS = (OpKind.LAYER_FWD, OpKind.LAYER_FWD_KEEP)
"""A layer's forward in the forward pass (its input boundary is stored per the plan first)."""
BACKWARD_OPS = (OpKind.LAYER_BWD, OpKind.LAYER_BWD_KEPT)
"""A layer's backward (its input boundary, if held, is dropped after it)."""


@dataclass(frozen=True)
class Op:
    kind: OpKind
    index: int = -1

    def units(self, tied: bool) -> tuple[str, ...]:
        """Units whose weights this op needs on the device, in order of first use."""
        if self.kind == OpKind.EMBED_BWD:
            return ()  # a dense embedding backward: token ids and the boundary gradient only
        if self.kind in EMBED_OPS:
            return (EMBED,)
        if self.kind in LAYER_OPS:
            return (layer_unit(self.index),)
        if self.kind == OpKind.HEAD:
            return (EMBED, HEAD) if tied else (HEAD,)
        return ()

    def grad_units(self, tied: bool) -> tuple[str, ...]:
        """Units whose gradient this op sends to the host, in the order it sends them (a tied
        head sends the lm_head's share of the embedding gradient after its own)."""
        if self.kind in BACKWARD_OPS:
            return (layer_unit(self.index),)
        if self.kind == OpKind.HEAD:
            return (HEAD, EMBED) if tied else (HEAD,)
        if self.kind == OpKind.EMBED_BWD:
            return (EMBED,)
        return ()

    def __str__(self) -> str:
        return str(self.kind) if self.index < 0 else f"{self.kind} {self.index}"


def forward_program(num_layers: int, internal_tiers: list[str] | None = None) -> list[Op]:
    """The forward half: embedding, every layer, then the head (also what inference runs, with
    no internal tiers)."""
    internal = internal_tiers or ["recompute"] * num_layers
    layers = [Op(OpKind.LAYER_FWD if internal[i] == "recompute" else OpKind.LAYER_FWD_KEEP, i)
              for i in range(num_layers)]
    return [Op(OpKind.EMBED_FWD)] + layers + [Op(OpKind.HEAD)]


def micro_batch_program(tiers: list[str], internal_tiers: list[str] | None = None) -> list[Op]:
    """The ops of one micro-batch for a plan's boundary and internal tiers (None: all recompute).
    A kept-internals layer's stored boundary still starts recomputes above it."""
    num_layers = len(tiers)
    internal = internal_tiers or ["recompute"] * num_layers
    ops = forward_program(num_layers, internal)
    on_device: set[int] = set()  # boundaries present on the device during the backward
    for i in reversed(range(num_layers)):
        if internal[i] != "recompute":
            if internal[i] == "host":
                ops.append(Op(OpKind.FETCH_INTERNALS, i))
            ops.append(Op(OpKind.LAYER_BWD_KEPT, i))
            on_device.discard(i)
            continue
        if i not in on_device:
            if tiers[i] != "recompute":
                ops.append(Op(OpKind.FETCH, i))
                on_device.add(i)
            else:
                below = [j for j in range(i) if tiers[j] != "recompute"]
                if below:
                    j = below[-1]
                    if j not in on_device:
                        ops.append(Op(OpKind.FETCH, j))
                        on_device.add(j)
                else:
                    j = 0
                    ops.append(Op(OpKind.RECOMPUTE_EMBED))
                    on_device.add(0)
                for k in range(j, i):
                    ops.append(Op(OpKind.RECOMPUTE_LAYER, k))
                    on_device.add(k + 1)
        ops.append(Op(OpKind.LAYER_BWD, i))
        on_device.discard(i)
    ops.append(Op(OpKind.EMBED_BWD))
    return ops


@dataclass(frozen=True)
class StepOp:
    """One op of the step, run for each micro-batch of ``micro_batches`` in turn (indices into
    the step's micro-batches) on one copy of its weights."""

    op: Op
    micro_batches: tuple[int, ...]

    def __str__(self) -> str:
        mbs = self.micro_batches
        return f"{self.op} [mb {mbs[0]}]" if len(mbs) == 1 else f"{self.op} [mb {mbs[0]}-{mbs[-1]}]"


def micro_batch_groups(num_micro_batches: int, per_load: int) -> list[tuple[int, ...]]:
    """The step's micro-batches in groups of ``per_load`` that share each weight load (the last
    group smaller when it does not divide)."""
    return [tuple(range(s, min(num_micro_batches, s + per_load)))
            for s in range(0, num_micro_batches, per_load)]


def step_program(tiers: list[str], internal_tiers: list[str] | None, num_micro_batches: int,
                 per_load: int = 1) -> list[StepOp]:
    """The ops of a whole step: for each group of ``per_load`` micro-batches, the micro-batch
    program with every op run for the group's micro-batches in turn (``per_load`` 1: each
    micro-batch runs the whole program before the next)."""
    ops = micro_batch_program(tiers, internal_tiers)
    return [StepOp(op, group) for group in micro_batch_groups(num_micro_batches, per_load)
            for op in ops]


def plan_step_program(plan: Plan, num_micro_batches: int | None = None) -> list[StepOp]:
    """:func:`step_program` of a :class:`~.plan.Plan` (default: its own ``num_micro_batches``)."""
    n = plan.num_micro_batches if num_micro_batches is None else num_micro_batches
    return step_program(plan.boundary_tiers, plan.internal_tiers, n, plan.micro_batches_per_load)


def resident_units(resident_layers) -> frozenset[str]:
    """Unit names of resident layers (``plan.resident_layers``)."""
    return frozenset(layer_unit(i) for i in resident_layers)


def weight_schedule(ops: list[Op], tied: bool, resident: frozenset[str] = frozenset()) -> list[str]:
    """Units in the order the ops need them (a unit used by consecutive ops appears once each),
    less the ``resident`` ones, which are never copied in. For a step program pass each
    :class:`StepOp`'s op once: its micro-batches share the copy."""
    return [u for op in ops for u in op.units(tied) if u not in resident]


class WeightWindow:
    """Which weight slots the device holds, use by use, for a weight schedule and a prefetch depth.

    ``depth + 1`` slots; the window holds the next ``depth`` uses as free slots allow (a tied head
    delays the next prefetch). A slot lives from the first use of its unit to the last release, so a
    unit needed again inside the window is copied once. Lowest index first."""

    def __init__(self, schedule: list[str], depth: int):
        if depth < 1:
            raise ValueError(f"prefetch_depth must be >= 1, got {depth}")
        self.depth = depth
        self.num_slots = depth + 1
        self._ahead: deque[str] = deque(schedule)
        """Uses not yet in the window."""
        self._window: deque[str] = deque()
        """Uses prefetched, not yet acquired."""
        self._refs: dict[str, int] = {}
        """Unit -> uses holding its slot (prefetched or running); a unit here has a slot."""
        self._slot_of: dict[str, int] = {}
        self._free = list(range(self.num_slots))

    def fill(self, ready: Callable[[str], bool] | None = None) -> list[tuple[str, int]]:
        """Pull uses into the window until ``depth`` are prefetched, a use needs a slot and none
        is free, or (``ready``) a unit to copy is not ready; returns the copies to start now
        (unit, slot), in schedule order."""
        copies = []
        while len(self._window) < self.depth and self._ahead:
            unit = self._ahead[0]
            if unit not in self._refs:
                if not self._free or (ready is not None and not ready(unit)):
                    break
                slot = self._free.pop(0)
                self._slot_of[unit] = slot
                self._refs[unit] = 0
                copies.append((unit, slot))
            self._ahead.popleft()
            self._refs[unit] += 1
            self._window.append(unit)
        return copies

    def acquire(self, unit: str, ready: Callable[[str], bool] | None = None) -> list[tuple[str, int]]:
        """Start the next use, which must be ``unit``; returns the copies this starts: its own if it
        was not prefetched (the caller made sure it is ready), then the prefetch."""
        copies = []
        if not self._window:
            copies = self.fill()
            assert self._window, "no free weight slot for an op's own unit"
        got = self._window.popleft()
        assert got == unit, f"weight schedule out of step: expected {got}, asked for {unit}"
        return copies + self.fill(ready)

    def slot(self, unit: str) -> int:
        return self._slot_of[unit]

    def release(self, unit: str) -> int | None:
        """End a use of ``unit``; the slot it frees (no use left holds it), else None. Call
        :meth:`fill` after: a freed slot may let the prefetch go on."""
        self._refs[unit] -= 1
        if self._refs[unit]:
            return None
        del self._refs[unit]
        slot = self._slot_of.pop(unit)
        self._free.append(slot)
        self._free.sort()
        return slot

    def resident(self) -> frozenset[str]:
        """Units whose slots hold (or are receiving) their weights now."""
        return frozenset(self._refs)

    def finished(self) -> bool:
        return not self._ahead and not self._window and not self._refs

