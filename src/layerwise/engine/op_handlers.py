"""The handlers of the step program's ops: what the host queues on the device for each op.

``OpHandlers`` dispatches ``{OpKind: method}`` and runs a step's program with fetches a few ops
ahead. A handler takes its weights once per group, queues a closure per micro-batch, and sends
the group's gradient once. ``forward_hidden`` is the forward alone (eval, export checks)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..models.adapter import DecoderAdapter, LayerContext
from ..models.names import EMBED, HEAD, layer_unit
from ..plan.plan import Plan
from ..plan.program import (FETCH_AHEAD, OpKind, StepOp, forward_program, resident_units,
                            weight_schedule)
from ..store import HostStore
from .backend import DeviceBackend, Ref
from .batch import IGNORE_INDEX, Batch
from .boundary_tiers import BoundaryTiers
from .grad_sink import GradSink
from .internals import KeptInternals
from .layer_ops import layer_backward, trained
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
        """The executor's dispatch table: op kind -> method queuing that op for a group."""
        self._step: StepOp | None = None
        self._ahead: list[StepOp] = []

    def run_step(self, steps: list[StepOp], batches: list[Batch], loss: torch.Tensor,
                 total_tokens: int) -> None:
        """Queue the step program ``steps`` for ``batches``; ``loss`` accumulates the step's
        loss (each micro-batch's share divided by ``total_tokens``). A group's micro-batch
        states are made at its first step op and let go after its last."""
        tiers = self.plan.boundary_tiers
        numel = max(b.input_ids.numel() for b in batches) * self.adapter.hidden_size
        self.acts.prepare(numel, self.compute_dtype, sum(t in ("host", "nvme") for t in tiers),
                          tiers.count("nvme"), self.plan.micro_batches_per_load)
        states: dict[int, MicroBatch] = {}
        last = len(batches) - 1
        try:
            for n, step in enumerate(steps):
                if step.micro_batches[0] not in states:  # a group starts
                    states = {k: self._begin(k, batches[k], loss, total_tokens,
                                             last in step.micro_batches)
                              for k in step.micro_batches}
                self._step, self._ahead = step, steps[n + 1:n + 1 + FETCH_AHEAD]
                self._next(0)
                with torch.profiler.record_function(str(step.op)):  # a memory probe's attribution
                    self.ops[step.op.kind]([states[k] for k in step.micro_batches], step.op.index)
        finally:
            self._step, self._ahead = None, []

    def _begin(self, k: int, batch: Batch, loss: torch.Tensor, total_tokens: int,
               final: bool) -> MicroBatch:
        shape = tuple(batch.input_ids.shape) + (self.adapter.hidden_size,)
        mb = MicroBatch(k, shape, loss, total_tokens, final, batch.num_target_tokens / total_tokens)
        self.backend.launch(lambda: self._start(mb, batch))
        return mb

    def _next(self, pos: int) -> None:
        """Before the compute at ``pos``: wait for the offloads k computes back (their memory goes
        before any fetch ahead takes more), then issue the next ``FETCH_AHEAD`` step ops' fetches in
        program order, each only beside a slot for every earlier one, so none waits on a later one.
        """
        self.acts.offloads.next_op()
        self.internals.offloads.next_op()
        step = self._step
        reserve = 0
        if step.op.kind == OpKind.FETCH:
            reserve = sum(self.acts.unfetched((k, step.op.index)) for k in step.micro_batches[pos:])
        for ahead in self._ahead:
            for k in ahead.micro_batches:
                key = (k, ahead.op.index)
                if ahead.op.kind == OpKind.FETCH:
                    self.acts.prefetch(key, keep_free=reserve)  # NVMe reads and H2D fetches run ahead
                    reserve += self.acts.unfetched(key)
                elif ahead.op.kind == OpKind.FETCH_INTERNALS:
                    self.internals.fetch(key)

    def _each(self, group: list[MicroBatch]):
        """The group's micro-batches in turn, with the per-compute bookkeeping (``_next``) before
        each but the first (the step loop did the first's)."""
        for pos, mb in enumerate(group):
            if pos:
                self._next(pos)
            yield mb

    def _start(self, mb: MicroBatch, batch: Batch) -> None:
        """Compute lane: the micro-batch's ids and labels on the device, and what every layer
        reads (positions restarting at each example, RoPE, masks keeping examples apart,
        the router logits' record when training an MoE with its aux loss)."""
        mb.ids = self._to_device(batch.input_ids)
        mb.labels = self._to_device(batch.labels)
        mb.ctx = self.adapter.layer_context(tuple(batch.input_ids.shape), self.device,
                                            self.compute_dtype, self.rotary, batch.segment_ids,
                                            router=mb.loss is not None)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _embed_fwd(self, group: list[MicroBatch], _i: int, recompute: bool = False) -> None:
        w = self.streamer.acquire(EMBED)
        for mb in self._each(group):
            out = Ref()

            def run(mb: MicroBatch = mb, out: Ref = out) -> None:
                with torch.no_grad():
                    h0 = self.adapter.embed(self.store[EMBED].layout.views(w), mb.ids,
                                            mb.ctx.position_ids)
                if recompute:
                    out.value = h0
                else:
                    mb.h = h0

            self.backend.launch(run)
            if recompute:
                self.acts.put_recomputed(mb.key(0), out)
        self.streamer.release(EMBED)

    def _recompute_embed(self, group: list[MicroBatch], i: int) -> None:
        self._embed_fwd(group, i, recompute=True)

    def _store_input(self, mb: MicroBatch, i: int) -> None:
        """Boundary i (the layer's input, as compute will have it) kept per its tier."""
        h = Ref()
        self.backend.launch(lambda: setattr(h, "value", mb.h))
        self.acts.store(mb.key(i), h, mb.shape, self.plan.boundary_tiers[i], self._place(mb, i))

    def _place(self, mb: MicroBatch, i: int) -> tuple[int, int]:
        """Which host buffers boundary (or layer) ``i`` of ``mb`` reuses: the micro-batch's
        place in its group (a group's are all fetched before the next group stores its own)."""
        return (mb.k % self.plan.micro_batches_per_load, i)

    def _layer_fwd(self, group: list[MicroBatch], i: int) -> None:
        def put(mb: MicroBatch, y: torch.Tensor) -> None:
            mb.h = y

        self._layer_no_grad(group, i, lambda mb: mb.h, put, store_input=True)

    def _layer_fwd_keep(self, group: list[MicroBatch], i: int) -> None:
        """The forward with a graph whose saved tensors are kept (``engine/internals.py``)."""
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        for mb in self._each(group):
            self._store_input(mb, i)
            g = self.internals.begin(mb.key(i), self.plan.internal_tiers[i], self._place(mb, i))

            def run(mb: MicroBatch = mb, g=g) -> None:
                leaves = self.store[unit].layout.leaves(w)
                mb.h = self.internals.forward(
                    g, lambda x: self.adapter.layer(i, leaves, x, mb.ctx), mb.h, w, leaves,
                    mb.ctx.shared_tensors())

            self.backend.launch(run)
            self.internals.forward_queued(g)
        self.streamer.release(unit)

    def _recompute_layer(self, group: list[MicroBatch], i: int) -> None:
        outs: dict[int, Ref] = {}

        def put(mb: MicroBatch, y: torch.Tensor) -> None:
            outs[mb.k].value = y

        def each(mb: MicroBatch) -> None:
            outs[mb.k] = Ref()

        def after(mb: MicroBatch) -> None:
            self.acts.put_recomputed(mb.key(i + 1), outs[mb.k])

        self._layer_no_grad(group, i, lambda mb: self.acts.on_device[mb.key(i)], put,
                            before=each, after=after)

    def _layer_no_grad(self, group: list[MicroBatch], i: int, get_input, put_output,
                       store_input: bool = False, before=None, after=None) -> None:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        for mb in self._each(group):
            if store_input:
                self._store_input(mb, i)
            if before is not None:
                before(mb)

            def run(mb: MicroBatch = mb) -> None:
                with torch.no_grad():
                    put_output(mb, self.adapter.layer(i, self.store[unit].layout.views(w),
                                                      get_input(mb), mb.ctx))

            self.backend.launch(run)
            if after is not None:
                after(mb)
        self.streamer.release(unit)

    def _fetch(self, group: list[MicroBatch], i: int) -> None:
        for mb in self._each(group):
            self.acts.fetch(mb.key(i))

    def _backward(self, group: list[MicroBatch], unit: str, grads_of, prepare=None,
                  after=None) -> None:
        """Queue ``unit``'s backward for each micro-batch of the group on one copy of its weights;
        ``grads_of`` returns (input gradient, parameter gradients summed into one grad slot).
        ``prepare(mb)``: host work handed to ``grads_of``; ``after(mb)``: once the compute is
        queued."""
        w = self.streamer.acquire(unit)
        ticket = self.sink.begin(unit, len(group))
        for pos, mb in enumerate(self._each(group)):
            prepared = prepare(mb) if prepare is not None else None

            def run(mb: MicroBatch = mb, prepared=prepared, add: bool = pos > 0) -> None:
                mb.grad_h, gw = grads_of(mb, w, prepared)
                self.sink.deposit(ticket, gw, add)

            self.backend.launch(run)
            if after is not None:
                after(mb)
        self.streamer.release(unit)
        self.sink.end(ticket, group[-1].final)

    def _layer_bwd(self, group: list[MicroBatch], i: int) -> None:
        layout = self.store[layer_unit(i)].layout
        self._backward(group, layer_unit(i), lambda mb, w, _: layer_backward(
            self.adapter, i, layout, w, self.acts.on_device[mb.key(i)], mb.grad_h, mb.ctx),
            after=lambda mb: self.acts.drop(mb.key(i)))

    def _fetch_internals(self, group: list[MicroBatch], i: int) -> None:
        for mb in self._each(group):
            self.internals.fetch(mb.key(i))

    def _layer_bwd_kept(self, group: list[MicroBatch], i: int) -> None:
        self._backward(group, layer_unit(i),
                       lambda mb, w, g: self.internals.backward(g, w, mb.grad_h),
                       prepare=lambda mb: self.internals.ready(mb.key(i)),
                       after=lambda mb: self.acts.drop(mb.key(i)))

    def _embed_bwd(self, group: list[MicroBatch], _i: int) -> None:
        """The embedding's gradient from the token ids and boundary 0's gradient: no weights
        streamed. In layer-major order one dense backward over the group's tokens sums the group's
        share."""
        if not self.store[EMBED].layout.numel:  # frozen (a LoRA run): no gradient to make
            for mb in self._each(group):
                self.backend.launch(lambda mb=mb: setattr(mb, "grad_h", None))
            return
        specs = self.store[EMBED].layout.specs
        ticket = self.sink.begin(EMBED)
        layer_major = self.plan.layer_major

        def run() -> None:
            if self.adapter.traced_embedding:  # positions too: per micro-batch, summed
                parts = None
                for mb in group:
                    g = self.adapter.embed_grads(mb.ids, mb.ctx.position_ids, mb.grad_h.float())
                    parts = g if parts is None else [a.add_(b) for a, b in zip(parts, g)]
                    mb.grad_h = None
                self.sink.deposit(ticket, parts)
                return
            (weight,) = specs  # nn.Embedding: one parameter
            out = None if ticket.device is None else ticket.device.view(weight.shape)
            if layer_major:
                ids = torch.cat([mb.ids.reshape(-1) for mb in group])
                grad_h = torch.cat([mb.grad_h.reshape(-1, mb.grad_h.shape[-1]).float()
                                    for mb in group])
            else:
                ids, grad_h = group[0].ids, group[0].grad_h
            for mb in group:
                mb.grad_h = None
            g = self.adapter.embed_weight_grad(ids, grad_h, out=out)
            if out is None:
                self.sink.deposit(ticket, [g])

        self.backend.launch(run)
        self.sink.end(ticket, group[-1].final)

    def _head(self, group: list[MicroBatch], _i: int) -> None:
        """Final norm + lm_head + loss in chunks of ``head_chunk_tokens``; the weight gradients
        are summed over chunks, and over the group's micro-batches, into one fp32 accumulator
        (in the compute dtype they would lose bits every chunk)."""
        ad, st = self.adapter, self.store
        units = (EMBED, HEAD) if ad.tied else (HEAD,)
        ws = {u: self.streamer.acquire(u) for u in units}
        grads = {u: Ref() for u in units}
        accs: dict[str, torch.Tensor] = {}
        for pos, mb in enumerate(self._each(group)):
            last = pos == len(group) - 1
            self.backend.launch(lambda mb=mb, last=last: self._head_run(mb, units, ws, accs,
                                                                        grads if last else None))
        for u in units:
            self.streamer.release(u)
        final = group[-1].final
        if st[HEAD].layout.numel:  # (none for a frozen head)
            self.sink.put_fp32(HEAD, grads[HEAD], st[HEAD].layout.numel, final)
        if ad.tied and st[EMBED].layout.numel:  # embed_bwd adds the rest
            self.sink.put_fp32(EMBED, grads[EMBED], st[EMBED].layout.numel, final=False)

    def _head_run(self, mb: MicroBatch, units, ws, accs: dict[str, torch.Tensor],
                  grads: dict[str, Ref] | None) -> None:
        """Compute lane: one micro-batch's head, its weight gradients added into ``accs`` (made
        by the group's first); ``grads``: the group's last hands the sums over."""
        ad, st = self.adapter, self.store
        leaves = {u: st[u].layout.leaves(ws[u]) for u in units}
        trained_leaves = {u: trained(leaves[u]) for u in units}
        wrt = [t for u in units for t in trained_leaves[u]]
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
            # a tied head reads the token embedding, not the rest of its unit (learned positions)
            g = torch.autograd.grad(loss, [hc, *wrt], allow_unused=True, materialize_grads=True)
            grad_h2[start:start + chunk] = g[0]
            parts = iter(g[1:])
            for u in units:
                unit_grads = [next(parts) for _ in trained_leaves[u]]
                if u not in accs:
                    flat = [gi.reshape(-1).float() for gi in unit_grads]
                    if flat and sum(f.numel() for f in flat) == st[u].layout.numel:
                        # the first gradient becomes the sum: no zero-filled accumulator (an
                        # embedding-sized pass per micro-batch on a tied head)
                        accs[u] = flat[0] if len(flat) == 1 else torch.cat(flat)
                        continue
                    accs[u] = torch.zeros(st[u].layout.numel, dtype=torch.float32,
                                          device=self.device)
                for acc, gi in zip(st[u].layout.views(accs[u]).values(), unit_grads):
                    acc += gi
            mb.loss += loss.detach()
            del g, logits, loss  # free this chunk's grads and logits before the next chunk
        aux = ad.router_aux_loss(mb.ctx, mb.aux_weight)  # MoE: its gradient waits for the layers
        if aux is not None:
            mb.loss += aux
        mb.grad_h = grad_h2.view_as(mb.h)
        mb.h = None
        if grads is not None:
            for u in units:
                grads[u].value = accs.pop(u)

    def forward_hidden(self, input_ids: torch.Tensor, chunk_tokens: int | None = None,
                       segment_ids: torch.Tensor | None = None):
        """Yield (sequence slice, final hidden chunk, head views, tied weight) per chunk; the
        caller has checked the ids and waited for the optimizer updates. ``segment_ids``: packed
        rows (``Batch.segment_ids``)."""
        ad, st = self.adapter, self.store
        batch, seq_len = input_ids.shape
        mb = MicroBatch(0, tuple(input_ids.shape) + (ad.hidden_size,), None, 0, False, 0.0)
        ops = forward_program(ad.num_layers)[:-1]  # the head runs on the host below
        units = (EMBED, HEAD) if ad.tied else (HEAD,)
        resident = resident_units(self.plan.resident_layers)
        self.streamer.begin(weight_schedule(ops, ad.tied, resident) + list(units))
        self.backend.launch(lambda: self._start(mb, Batch(input_ids, input_ids, segment_ids)))
        self._embed_fwd([mb], -1)

        def put(mb: MicroBatch, y: torch.Tensor) -> None:
            mb.h = y

        for i in range(ad.num_layers):
            self._layer_no_grad([mb], i, lambda mb: mb.h, put)
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

    k: int
    """Its index among the step's micro-batches (its boundaries' and internals' key)."""
    shape: tuple[int, ...]
    """[batch, seq, hidden] of a boundary activation."""
    loss: torch.Tensor | None
    total_tokens: int
    final: bool
    aux_weight: float
    """The micro-batch's share of the step's target tokens: the weight of its MoE aux loss."""
    ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    ctx: LayerContext | None = None
    """Positions, RoPE, masks, router record (``DecoderAdapter.layer_context``)."""
    h: torch.Tensor | None = None
    grad_h: torch.Tensor | None = None

    def key(self, i: int) -> tuple[int, int]:
        """Its boundary (or layer) ``i``'s key in the tiers."""
        return (self.k, i)

