"""A layer's internals (the tensors its forward saves for its backward) kept across the step.

Saved tensors go through ``saved_tensors_hooks``: a view of the layer's weights becomes a marker
(the slot holds other weights by the backward; unpacking views the backward's own copy); shared
tensors and host tensors (FlashAttention's seed) are kept as they are; activations stay on the
device or are copied to host storage-by-storage and fetched back. The graph's input leaf is
emptied after the forward, so the graph pins no boundary: only the saved tensors
(``plan.memory.layer_workspace_bytes``)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

import torch

from .backend import DeviceBackend, Event, HeldRef
from .slots import EventGroup, OffloadWindow


def _storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a flat uint8 tensor (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


@dataclass
class _Stored:
    """One activation storage offloaded to the host."""

    host: torch.Tensor
    stored: Event
    """The D2H copy's event."""
    device: torch.Tensor | None = None
    """Where it is fetched back to (set by :meth:`KeptInternals.fetch`)."""
    fetched: Event | None = None


@dataclass
class LayerGraph:
    """The kept forward of one layer: its graph's ends and how to unpack its saved tensors."""

    key: Hashable
    """The caller's (the executor's: (micro-batch of the step, layer))."""
    tier: str
    weight_ptr: int = 0
    """Data pointer of the storage of the forward's weights (a slot, or a resident buffer):
    what a weight view is recognised by."""
    shared_ptrs: frozenset[int] = frozenset()
    place: Hashable = None
    """Which host buffers the host tier reuses (default: ``key``)."""
    stored: dict[int, _Stored] = field(default_factory=dict)
    """Host tier: storage data pointer -> its host copy."""
    output: torch.autograd.graph.GradientEdge | None = None
    inputs: tuple = ()
    """(gradient edge of the input, weight leaves in layout order)."""
    backward_weights: torch.Tensor | None = None
    """The backward's copy of the layer's weights (bound just before backpropagating)."""
    sources: list[torch.Tensor] = field(default_factory=list)
    """Host tier, during the forward: the offloaded storages, held until the forward ends so that
    no later tensor of the forward reuses an address (storages are told apart by address)."""
    complete: bool = False
    """Set by the forward's compute closure once every saved tensor is packed."""
    forward_done: Event | None = None
    offloads: EventGroup = field(default_factory=EventGroup)
    """Host tier: the D2H copies the forward's closure queues (the offload window waits on it)."""


class KeptInternals:
    """Kept graphs by the caller's key (the executor's: (micro-batch, layer)); touched by the
    compute closures and, for the host tier's fetches, by the host thread (after the forward's
    closure has run)."""

    def __init__(self, backend: DeviceBackend):
        self.backend = backend
        self.layers: dict[Hashable, LayerGraph] = {}
        self._host_bufs: dict[tuple[Hashable, int], torch.Tensor] = {}
        """(place, k) -> host buffer of the k-th offloaded storage of the layer kept at that
        place, reused every step (the shapes repeat); rewritten only after the compute that read
        its last fetch (the D2H copy waits for a later compute position)."""
        self.offloads = OffloadWindow(backend)
        """Host tier: each forward's D2H copies, waited for by compute ``OFFLOAD_WINDOW_OPS`` ops
        later (``next_op``)."""

    # ----- forward (inside the compute closure) ---------------------------------------------

    def begin(self, i: Hashable, tier: str, place: Hashable = None) -> LayerGraph:
        """Host side, before the forward is queued. ``place``: which host buffers the host tier
        reuses (default ``i``; the executor: the micro-batch's place in its group and the
        layer, since a group's internals are all fetched before the next group keeps its own)."""
        g = self.layers[i] = LayerGraph(i, tier, place=i if place is None else place)
        if tier == "host":
            self.offloads.add(g.offloads, g.offloads)
        return g

    def forward(self, g: LayerGraph, run, x: torch.Tensor, weights: torch.Tensor,
                leaves: dict[str, torch.Tensor], shared: list[torch.Tensor]) -> torch.Tensor:
        """Compute lane: ``run(x)`` with a graph whose saved tensors ``g`` keeps; returns the output
        (detached: the next layer's input)."""
        g.weight_ptr = weights.untyped_storage().data_ptr()
        g.shared_ptrs = frozenset(t.untyped_storage().data_ptr() for t in shared)
        x = x.detach().requires_grad_()
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                lambda t: self._pack(g, t), lambda p: self._unpack(g, p)):
            y = run(x)
        g.output = torch.autograd.graph.get_gradient_edge(y)
        g.inputs = (x, tuple(p for p in leaves.values() if p.requires_grad))
        out = y.detach()
        # the input leaf stays in the graph (its AccumulateGrad node holds it): keep its identity
        # but not its data, which is boundary i (a saved use of it was packed separately)
        x.data = torch.empty((), dtype=x.dtype, device=x.device).expand(x.shape)
        g.sources.clear()
        g.complete = True
        return out

    def _pack(self, g: LayerGraph, t: torch.Tensor):
        ptr = t.untyped_storage().data_ptr()
        if ptr == g.weight_ptr:
            return ("weight", t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        if ptr in g.shared_ptrs or g.tier == "device" or t.device.type != self.backend.device.type:
            return ("tensor", t.detach())
        if ptr not in g.stored:
            src = _storage_bytes(t)
            key = (g.place, len(g.stored))
            host = self._host_bufs.get(key)
            if host is None or host.numel() < src.numel():
                host = self._host_bufs[key] = self.backend.host_alloc(src.numel(), torch.uint8)
            host = host[:src.numel()]
            held = HeldRef(src)  # let go once compute waits for the copy (OffloadWindow)
            ev = self.backend.copy_d2h(host, held, after=[self.backend.record()])
            g.offloads.add(ev, held)
            g.stored[ptr] = _Stored(host, ev)
            g.sources.append(src)
        return ("host", ptr, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())

    def _unpack(self, g: LayerGraph, packed) -> torch.Tensor:
        kind = packed[0]
        if kind == "tensor":
            return packed[1]
        if kind == "weight":
            _, dtype, size, stride, offset = packed
            w = g.backward_weights
            assert w is not None, "a kept graph was unpacked outside its backward"
            # a frozen base may be held in another dtype (or packed bytes) within the slot
            return torch.as_strided(w if w.dtype == dtype else w.view(dtype), size, stride, offset)
        _, ptr, dtype, size, stride, offset = packed
        dev = g.stored[ptr].device
        assert dev is not None, "host-tier internals were not fetched before the backward"
        return torch.as_strided(dev.view(dtype), size, stride, offset)

    # ----- backward ---------------------------------------------------------------------------

    def forward_queued(self, g: LayerGraph) -> None:
        """Host side, after the forward's closure is queued: the event fetches wait for before
        reading the list of stored tensors (which that closure fills)."""
        g.forward_done = self.backend.record()

    def fetch(self, i: Hashable) -> None:
        """Host side: queue the H2D copies of layer ``i``'s host-tier internals (once; not before
        its forward is queued)."""
        g = self.layers.get(i)
        if g is None or g.forward_done is None or g.tier != "host" or any(
                s.device is not None for s in g.stored.values()):
            return
        if not g.complete:  # an asynchronous backend may not have run the forward's closure yet
            g.forward_done.synchronize()
        # fresh device memory: the copy lane waits until the compute queued so far (which may
        # still read memory the allocator hands out again) has run
        now = self.backend.record()
        for s in g.stored.values():
            s.device = self.backend.alloc(s.host.numel(), torch.uint8)
            s.fetched = self.backend.copy_h2d(s.device, s.host, after=[now, s.stored])

    def ready(self, i: Hashable) -> LayerGraph:
        """Host side, queueing layer ``i``'s backward: compute waits until its internals are on
        the device; hands over (and forgets) its graph, since the next micro-batch's forward of
        the same layer may be queued before this backward runs."""
        g = self.layers[i]
        if g.tier == "host":
            self.fetch(i)
            self.backend.wait([s.fetched for s in g.stored.values()])
        return self.layers.pop(i)

    @staticmethod
    def backward(g: LayerGraph, weights: torch.Tensor, grad_out: torch.Tensor
                 ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Compute lane: (grad w.r.t. the layer's input, its parameters' grads in layout order),
        through the kept graph with ``weights`` (the backward's copy) in place of the forward's."""
        g.backward_weights = weights
        x, leaves = g.inputs
        gx, *gw = torch.autograd.grad([g.output], (x, *leaves), [grad_out], allow_unused=True,
                                      materialize_grads=True)  # as layer_ops.layer_backward
        return gx, gw

    def clear(self) -> None:
        """After a step (or a failed one): drop every kept graph; the lanes are idle."""
        self.layers.clear()
        self.offloads.clear()
