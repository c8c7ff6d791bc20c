"""The handlers of the step program's ops: what the host queues on the device for each op.

:class:`OpHandlers` holds the ``{OpKind: method}`` dispatch table and runs one micro-batch's
program through it (``micro_batch``), with the fetches a few ops ahead; each handler takes its
unit's weights from the streamer, queues a compute closure on the backend's compute lane,
releases the weights, and hands activations to their tier and gradients to the sink. The
closures share one :class:`MicroBatch`; the host never reads it. ``forward_hidden`` is the
forward alone (eval, export checks), through the same handlers.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.adapter import DecoderAdapter
from ..models.names import EMBED, HEAD, layer_unit
from ..plan.plan import Plan
from ..plan.program import FETCH_AHEAD, Op, OpKind, forward_program, weight_schedule
from ..store import HostStore
from .backend import DeviceBackend, Ref
from .batch import IGNORE_INDEX, Batch
from .boundary_tiers import BoundaryTiers
from .grad_sink import GradSink
from .internals import KeptInternals
from .layer_ops import layer_backward
from .weight_stream import WeightStreamer


class OpHandlers:
    def __init__(self, adapter: DecoderAdapter, store: HostStore, plan: Plan,
                 backend: DeviceBackend, compute_dtype: torch.dtype, streamer: WeightStreamer,
                 sink: GradSink, acts: BoundaryTiers, internals: KeptInternals):
        self.adapter, self.store, self.plan = adapter, store, plan
        self.backend, self.device, self.compute_dtype = backend, backend.device, compute_dtype
        self.streamer, self.sink, self.acts, self.internals = streamer, sink, acts, internals
        self.rotary = adapter.new_rotary(self.device)
        self.ops = {
            OpKind.EMBED_FWD: self._embed_fwd, OpKind.RECOMPUTE_EMBED: self._recompute_embed,
            OpKind.LAYER_FWD: self._layer_fwd, OpKind.RECOMPUTE_LAYER: self._recompute_layer,
            OpKind.HEAD: self._head, OpKind.FETCH: self._fetch, OpKind.LAYER_BWD: self._layer_bwd,
            OpKind.EMBED_BWD: self._embed_bwd, OpKind.LAYER_FWD_KEEP: self._layer_fwd_keep,
            OpKind.FETCH_INTERNALS: self._fetch_internals, OpKind.LAYER_BWD_KEPT: self._layer_bwd_kept,
        }
        """The executor's dispatch table: op kind -> method queuing that op."""

    def micro_batch(self, program: list[Op], batch: Batch, loss: torch.Tensor, total_tokens: int,
                    final: bool) -> None:
        """Queue ``program`` (the step program of one micro-batch) for ``batch``; ``loss``
        accumulates its share of the step's loss (divided by ``total_tokens``)."""
        shape = tuple(batch.input_ids.shape) + (self.adapter.hidden_size,)
        tiers = self.plan.boundary_tiers
        self.acts.prepare(math.prod(shape), self.compute_dtype,
                          sum(t in ("host", "nvme") for t in tiers), tiers.count("nvme"))
        mb = MicroBatch(shape, loss, total_tokens, final)
        self.backend.launch(lambda: self._start(mb, batch))
        for n, op in enumerate(program):
            # compute waits for the offloads of k ops back, and their memory goes before any
            # fetch ahead takes more (plan.memory.OFFLOAD_WINDOW_OPS)
            self.acts.offloads.next_op()
            self.internals.offloads.next_op()
            for ahead in program[n + 1:n + 1 + FETCH_AHEAD]:
                if ahead.kind == OpKind.FETCH:
                    self.acts.prefetch(ahead.index)  # NVMe reads and H2D fetches run ahead
                elif ahead.kind == OpKind.FETCH_INTERNALS:
                    self.internals.fetch(ahead.index)
            with torch.profiler.record_function(str(op)):  # lets a memory probe attribute its peak
                self.ops[op.kind](mb, op.index)

    def _start(self, mb: MicroBatch, batch: Batch) -> None:
        mb.ids = self._to_device(batch.input_ids)
        mb.labels = self._to_device(batch.labels)
        seq_len = batch.input_ids.shape[1]
        mb.pos = torch.arange(seq_len, device=self.device)[None]
        mb.masks = self.adapter.attention_masks(seq_len, self.device)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _embed_fwd(self, mb: MicroBatch, _i: int, recompute: bool = False) -> None:
        w = self.streamer.acquire(EMBED)
        out = Ref()

        def run() -> None:
            with torch.no_grad():
                h0 = self.adapter.embed(self.store[EMBED].layout.views(w), mb.ids)
                if mb.rope is None:
                    mb.rope = self.rotary(h0, mb.pos)
            if recompute:
                out.value = h0
            else:
                mb.h = h0

        self.backend.launch(run)
        self.streamer.release(EMBED)
        if recompute:
            self.acts.put_recomputed(0, out)

    def _recompute_embed(self, mb: MicroBatch, i: int) -> None:
        self._embed_fwd(mb, i, recompute=True)

    def _store_input(self, mb: MicroBatch, i: int) -> None:
        """Boundary i (the layer's input, as compute will have it) kept per its tier."""
        h = Ref()
        self.backend.launch(lambda: setattr(h, "value", mb.h))
        self.acts.store(i, h, mb.shape, self.plan.boundary_tiers[i])

    def _layer_fwd(self, mb: MicroBatch, i: int) -> None:
        self._store_input(mb, i)
        self._layer_no_grad(mb, i, lambda: mb.h, lambda y: setattr(mb, "h", y))

    def _layer_fwd_keep(self, mb: MicroBatch, i: int) -> None:
        """The forward with a graph whose saved tensors are kept (``engine/internals.py``)."""
        self._store_input(mb, i)
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        g = self.internals.begin(i, self.plan.internal_tiers[i])

        def run() -> None:
            leaves = self.store[unit].layout.leaves(w)
            shared = [t for t in (*mb.rope, mb.pos, *mb.masks.values()) if t is not None]
            mb.h = self.internals.forward(
                g, lambda x: self.adapter.layer(i, leaves, x, mb.rope, mb.pos, mb.masks),
                mb.h, w, leaves, shared)

        self.backend.launch(run)
        self.internals.forward_queued(g)
        self.streamer.release(unit)

    def _recompute_layer(self, mb: MicroBatch, i: int) -> None:
        out = Ref()
        self._layer_no_grad(mb, i, lambda: self.acts.on_device[i], lambda y: setattr(out, "value", y))
        self.acts.put_recomputed(i + 1, out)

    def _layer_no_grad(self, mb: MicroBatch, i: int, get_input, put_output) -> None:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)

        def run() -> None:
            with torch.no_grad():
                put_output(self.adapter.layer(i, self.store[unit].layout.views(w), get_input(),
                                              mb.rope, mb.pos, mb.masks))

        self.backend.launch(run)
        self.streamer.release(unit)

    def _fetch(self, mb: MicroBatch, i: int) -> None:
        self.acts.fetch(i)

    def _backward(self, mb: MicroBatch, unit: str, grads_of, prepare=None) -> None:
        """Queue ``unit``'s backward: its weights in; on the compute lane ``grads_of(w, prepared)``
        -> (gradient w.r.t. its input, which the next backward reads; its parameters' gradients
        in layout order, which leave through the sink). ``prepare``: host-side work queued once
        the weights and the grad slot are, its result handed to ``grads_of``."""
        w = self.streamer.acquire(unit)
        ticket = self.sink.begin(unit)
        prepared = prepare() if prepare is not None else None

        def run() -> None:
            mb.grad_h, gw = grads_of(w, prepared)
            self.sink.deposit(ticket, gw)

        self.backend.launch(run)
        self.streamer.release(unit)
        self.sink.end(ticket, mb.final)

    def _layer_bwd(self, mb: MicroBatch, i: int) -> None:
        layout = self.store[layer_unit(i)].layout
        self._backward(mb, layer_unit(i), lambda w, _: layer_backward(
            self.adapter, i, layout, w, self.acts.on_device[i], mb.grad_h, mb.rope, mb.pos, mb.masks))
        self.acts.drop(i)

    def _fetch_internals(self, mb: MicroBatch, i: int) -> None:
        self.internals.fetch(i)

    def _layer_bwd_kept(self, mb: MicroBatch, i: int) -> None:
        self._backward(mb, layer_unit(i), lambda w, g: self.internals.backward(g, w, mb.grad_h),
                       prepare=lambda: self.internals.ready(i))
        self.acts.drop(i)

    def _embed_bwd(self, mb: MicroBatch, _i: int) -> None:
        """The embedding's gradient from the token ids and boundary 0's gradient: no weights
        (with tied embeddings the head streamed them for its own op). On an asynchronous
        device it is written straight into the grad slot."""
        (weight,) = self.store[EMBED].layout.specs  # nn.Embedding: one parameter
        ticket = self.sink.begin(EMBED)

        def run() -> None:
            out = None if ticket.device is None else ticket.device.view(weight.shape)
            g = self.adapter.embed_weight_grad(mb.ids, mb.grad_h, out=out)
            mb.grad_h = None
            if out is None:
                self.sink.deposit(ticket, [g])

        self.backend.launch(run)
        self.sink.end(ticket, mb.final)

    def _head(self, mb: MicroBatch, _i: int) -> None:
        """Final norm + lm_head + loss in chunks of ``head_chunk_tokens``; the weight gradients
        are summed over chunks in fp32 (in the compute dtype they would lose bits every chunk)."""
        ad, st = self.adapter, self.store
        units = (EMBED, HEAD) if ad.tied else (HEAD,)
        ws = {u: self.streamer.acquire(u) for u in units}
        grads = {u: Ref() for u in units}

        def run() -> None:
            leaves = {u: st[u].layout.leaves(ws[u]) for u in units}
            accs = {u: torch.zeros(st[u].layout.numel, dtype=torch.float32, device=self.device)
                    for u in units}
            acc_views = [v for u in units for v in st[u].layout.views(accs[u]).values()]
            wrt = [t for u in units for t in leaves[u].values()]
            embed_weight = leaves[EMBED]["weight"] if ad.tied else None
            h2 = mb.h.reshape(-1, mb.h.shape[-1])
            lab = mb.labels.reshape(-1)
            grad_h2 = torch.empty_like(h2)
            chunk = self.plan.head_chunk_tokens
            for start in range(0, h2.shape[0], chunk):
                hc = h2[start:start + chunk].detach().requires_grad_()
                logits = ad.head_logits(leaves[HEAD], embed_weight, hc)
                loss = F.cross_entropy(logits.float(), lab[start:start + chunk],
                                       ignore_index=IGNORE_INDEX, reduction="sum") / mb.total_tokens
                g = torch.autograd.grad(loss, [hc, *wrt])
                grad_h2[start:start + chunk] = g[0]
                for acc, gi in zip(acc_views, g[1:]):
                    acc += gi
                mb.loss += loss.detach()
                del g, logits, loss  # free this chunk's grads and logits before the next chunk
            mb.grad_h = grad_h2.view_as(mb.h)
            mb.h = None
            for u in units:
                grads[u].value = accs[u]

        self.backend.launch(run)
        for u in units:
            self.streamer.release(u)
        self.sink.put_fp32(HEAD, grads[HEAD], st[HEAD].layout.numel, mb.final)
        if ad.tied:  # embed_bwd adds the rest
            self.sink.put_fp32(EMBED, grads[EMBED], st[EMBED].layout.numel, final=False)

    def forward_hidden(self, input_ids: torch.Tensor, chunk_tokens: int | None = None):
        """Yield (sequence slice, final hidden chunk, head views, tied weight) per chunk; the
        caller has checked the ids and waited for the optimizer updates."""
        ad, st = self.adapter, self.store
        batch, seq_len = input_ids.shape
        mb = MicroBatch(tuple(input_ids.shape) + (ad.hidden_size,), None, 0, False)
        ops = forward_program(ad.num_layers)[:-1]  # the head runs on the host below
        units = (EMBED, HEAD) if ad.tied else (HEAD,)
        self.streamer.begin(weight_schedule(ops, ad.tied) + list(units))
        self.backend.launch(lambda: self._start(mb, Batch(input_ids, input_ids)))
        self._embed_fwd(mb, -1)
        for i in range(ad.num_layers):
            self._layer_no_grad(mb, i, lambda: mb.h, lambda y: setattr(mb, "h", y))
        ws = [self.streamer.acquire(u) for u in units]
        self.backend.synchronize()  # the host reads the hidden states below
        head_views = st[HEAD].layout.views(ws[-1])
        embed_weight = st[EMBED].layout.views(ws[0])["weight"] if ad.tied else None
        step = max(1, (chunk_tokens or batch * seq_len) // batch)
        try:
            for start in range(0, seq_len, step):
                sl = slice(start, start + step)
                yield sl, mb.h[:, sl], head_views, embed_weight
        finally:
            for u in units:
                self.streamer.release(u)
            self.backend.synchronize()


@dataclass
class MicroBatch:
    """What the compute closures of one micro-batch share; the host never reads it."""

    shape: tuple[int, ...]
    """[batch, seq, hidden] of a boundary activation."""
    loss: torch.Tensor | None
    total_tokens: int
    final: bool
    ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    pos: torch.Tensor | None = None
    masks: dict | None = None
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    h: torch.Tensor | None = None
    grad_h: torch.Tensor | None = None

