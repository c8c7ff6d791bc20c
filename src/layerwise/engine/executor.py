"""StreamingEngine: layer-by-layer training with all state in host memory.

One optimizer step = the step program (``layerwise.plan.program``) run for every micro-batch, then the
host optimizer. Weights stream in ahead of use, gradients stream out as each layer's backward
finishes, activations live where the plan says. The optimizer updates run on host worker
threads after the backward and overlap the next step's forward: a unit's weights are only
streamed in once its update is done.

With fp32 compute the numbers are those of plain autograd on the same model, for any plan:
a plan moves activations and adds recomputation, it never changes the arithmetic.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.adapter import DecoderAdapter
from ..models.names import EMBED, HEAD, layer_unit
from ..optim.adamw import AdamWConfig, HostAdamW, UnitOptimizer
from ..optim.adamw8bit import HostAdamW8bit
from ..optim.clip import clip_or_skip, global_norm
from ..plan.shape import ModelShape
from ..plan.memory import CUDA_WORKSPACE_BYTES, MemoryEstimate, predict_peak_device_bytes
from ..plan.plan import Plan
from ..plan.program import FETCH_AHEAD, OpKind, forward_program, micro_batch_program, weight_schedule
from ..store import HostStore
from .batch import IGNORE_INDEX, Batch
from .backend import Ref
from .devices import make_backend
from .internals import KeptInternals
from .layer_ops import layer_backward
from .reduce import StepReducer
from .streams import BoundaryTiers, GradSink, WeightStreamer


@dataclass
class EngineConfig:
    device: str = "cpu"
    """``cpu`` (synchronous backend), ``cpu-async`` (the GPU's protocol on threads, for tests)
    or ``cuda[:N]``."""
    compute_dtype: torch.dtype = torch.float32
    """Dtype of weights and activations on the device; use torch.bfloat16 on GPUs."""
    device_mem_cap_bytes: int | None = None
    """Refuse plans whose predicted device peak exceeds this (None: no cap)."""
    spill_dir: str | None = None
    """Directory for NVMe-tier activations (None: a temp dir)."""
    optimizer_threads: int = 1
    """Host worker threads running per-unit optimizer updates."""
    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    async_seed: int | None = 0
    """For ``device="cpu-async"``: seed of the lanes' random delays (None: no delays)."""


@dataclass
class StepStats:
    loss: float
    """Mean cross-entropy per target token over the whole step."""
    grad_norm: float
    clip_coef: float
    tokens: int
    skipped: bool
    """True when the gradient norm was not finite and no update was made."""
    step_s: float
    unit_grad_norms: dict[str, float] = field(default_factory=dict)
    """L2 norm of each unit's gradient over the whole step, before clipping (the per-unit
    norms the clip is computed from; the update clears the gradients themselves)."""


class StreamingEngine:
    def __init__(self, adapter: DecoderAdapter, store: HostStore, plan: Plan,
                 config: EngineConfig | None = None,
                 optimizers: dict[str, UnitOptimizer] | None = None,
                 reducer: StepReducer | None = None):
        """``reducer``: data parallel, the ranks' seam (``engine/reduce.py``); None: one process."""
        self.config = config or EngineConfig()
        self.reducer = reducer
        plan.validate(adapter.num_layers)
        if store.compute_dtype != self.config.compute_dtype:
            raise ValueError(
                f"store compute dtype {store.compute_dtype} != engine compute dtype "
                f"{self.config.compute_dtype}; build the HostStore with compute_dtype="
                f"{self.config.compute_dtype}"
            )
        self.adapter = adapter
        self.store = store
        self.plan = plan
        self.backend = make_backend(self.config.device, self.config.async_seed)
        self.device = self.backend.device
        self.rotary = adapter.new_rotary(self.device)
        self.program = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
        self.shape = ModelShape.from_config(adapter.config)
        self.optimizers = optimizers or self._default_optimizers()
        for buf in store:
            if not buf.state:
                self.optimizers[buf.name].init_state(buf)
        self._pool = ThreadPoolExecutor(self.config.optimizer_threads, thread_name_prefix="optim")
        self._updates: dict[str, Future] = {}
        self.streamer = WeightStreamer(self.backend, store, plan.prefetch_depth, self._wait_update,
                                       self._update_done)
        head_numel = store[HEAD].layout.numel + (store[EMBED].layout.numel if adapter.tied else 0)
        self.sink = GradSink(self.backend, store, fp32_numel=max(head_numel, store[EMBED].layout.numel),
                             on_final=None if reducer is None else reducer.unit_landed)
        self.acts = BoundaryTiers(self.backend, self.config.spill_dir)
        self.internals = KeptInternals(self.backend)
        self._ops = {
            OpKind.EMBED_FWD: self._embed_fwd, OpKind.RECOMPUTE_EMBED: self._recompute_embed,
            OpKind.LAYER_FWD: self._layer_fwd, OpKind.RECOMPUTE_LAYER: self._recompute_layer,
            OpKind.HEAD: self._head, OpKind.FETCH: self._fetch, OpKind.LAYER_BWD: self._layer_bwd,
            OpKind.EMBED_BWD: self._embed_bwd, OpKind.LAYER_FWD_KEEP: self._layer_fwd_keep,
            OpKind.FETCH_INTERNALS: self._fetch_internals, OpKind.LAYER_BWD_KEPT: self._layer_bwd_kept,
        }
        """The executor's dispatch table: op kind -> method queuing that op."""
        self.steps_skipped = 0
        self.step_tokens = 0
        """Target tokens of the last step, over all ranks (the loss's divisor)."""

    def _default_optimizers(self) -> dict[str, UnitOptimizer]:
        kinds = self.plan.moments or ["fp32"] * len(self.store.units)
        fp32 = HostAdamW(self.config.optimizer)
        out: dict[str, UnitOptimizer] = {}
        eight = None
        for buf, kind in zip(self.store, kinds):
            if kind == "8bit":
                if eight is None:
                    eight = HostAdamW8bit(self.config.optimizer)
                out[buf.name] = eight
            else:
                out[buf.name] = fp32
        return out

    # ----- checks -------------------------------------------------------------------------

    def predict_memory(self, micro_batch_size: int, seq_len: int) -> MemoryEstimate:
        elem = torch.empty((), dtype=self.config.compute_dtype).element_size()
        workspace = CUDA_WORKSPACE_BYTES if self.device.type == "cuda" else 0
        return predict_peak_device_bytes(self.shape, self.plan, micro_batch_size, seq_len, elem,
                                         grad_slots=self.backend.asynchronous, workspace_bytes=workspace)

    def check(self, micro_batch_size: int, seq_len: int) -> MemoryEstimate:
        """Refuse, before any work, a batch shape whose predicted device peak is over the cap."""
        est = self.predict_memory(micro_batch_size, seq_len)
        cap = self.config.device_mem_cap_bytes
        if cap is not None and est.peak_bytes > cap:
            raise ValueError(
                f"plan {self.plan.source!r} needs {est.peak_bytes / 2**20:.1f} MiB of device memory "
                f"at micro-batch {micro_batch_size} x seq {seq_len} (peak at '{est.peak_op}': "
                f"{est.describe()}), over the cap of {cap / 2**20:.1f} MiB; recompute or offload more "
                "boundaries, lower the micro-batch size, or raise the cap"
            )
        return est

    # ----- training -----------------------------------------------------------------------

    def _wait_update(self, unit: str) -> None:
        if self.reducer is not None and not self.reducer.owns(unit):
            self.reducer.update_done(unit, wait=True)
            return
        fut = self._updates.pop(unit, None)
        if fut is not None:
            fut.result()

    def _update_done(self, unit: str) -> bool:
        if self.reducer is not None and not self.reducer.owns(unit):
            return self.reducer.update_done(unit, wait=False)
        fut = self._updates.get(unit)
        if fut is None:
            return True
        if not fut.done():
            return False
        self._wait_update(unit)  # surfaces an error the update raised
        return True

    def synchronize(self) -> None:
        """Wait for all pending optimizer updates (before reading the store, e.g. to save);
        data parallel: the other owners' too."""
        self._wait_own_updates()
        if self.reducer is not None:
            for buf in self.store:
                self._wait_update(buf.name)

    def _wait_own_updates(self) -> None:
        """This process's updates only: on the way out of a failed step or at close, another
        rank's update may never come (that rank is why we are failing)."""
        for unit in list(self._updates):
            self._updates.pop(unit).result()

    def check_batch(self, mb: Batch) -> None:
        """Refuse, on the host, token ids or labels outside the vocabulary: on a GPU they would
        trip a device-side assert that poisons the CUDA context for the rest of the process."""
        vocab = self.adapter.vocab_size
        ids, labels = mb.input_ids, mb.labels
        if ids.shape != labels.shape or ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must "
                             "both be [batch, seq]")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}) for this model, got "
                             f"[{int(ids.min())}, {int(ids.max())}]; the tokenizer does not match the model")
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {vocab}) or {IGNORE_INDEX} (ignored), got "
                             f"{int(labels[bad][0])}")

    def compute_grads(self, micro_batches: list[Batch]) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch; grads accumulate in the store.

        Returns the loss (mean over all target tokens of the step) and per-unit squared grad norms.
        Data parallel: over all ranks' micro-batches (``self.step_tokens`` is the step's target
        tokens on all ranks), and a unit's gradient is summed only on its owner.
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        for mb in micro_batches:
            self.check_batch(mb)
        total = sum(mb.num_target_tokens for mb in micro_batches)
        if self.reducer is not None:
            total = self.reducer.global_tokens(total)
        self.step_tokens = total
        if total == 0:
            raise ValueError("the step's batches have no target tokens (all labels are ignored)")
        self.check(*micro_batches[0].input_ids.shape)
        schedule = weight_schedule(self.program, self.adapter.tied) * len(micro_batches)
        self.streamer.begin(schedule)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            for k, mb in enumerate(micro_batches):
                self._micro_batch(mb, loss, total, final=k == len(micro_batches) - 1)
            sq = self.sink.finish()
            self.backend.synchronize()
            assert self.streamer.finished()
            step_loss = float(loss)
            if self.reducer is not None:
                sq, step_loss = self.reducer.finish(step_loss)
        except BaseException:
            self._abandon_step()
            raise
        finally:
            self.acts.clear()
            self.internals.clear()
        return step_loss, sq

    def _abandon_step(self) -> None:
        """After a failed step: drop its buffers and partial gradients so the next step is clean."""
        try:
            self.backend.synchronize()  # let the lanes finish what was queued
        except BaseException:  # noqa: BLE001  (the step's own error is being raised)
            pass
        self.streamer.reset()
        self.sink.abandon()
        self._wait_own_updates()  # the previous step's updates still read their gradients
        self.store.zero_grads()

    def train_step(self, micro_batches: list[Batch], lr: float | None = None) -> StepStats:
        t0 = time.perf_counter()
        loss, sq = self.compute_grads(micro_batches)
        norm = global_norm(list(sq.values()))
        tokens = self.step_tokens
        coef = clip_or_skip(norm, self.config.optimizer.max_grad_norm)
        unit_norms = {u: math.sqrt(v) if v >= 0 else math.nan for u, v in sq.items()}
        if coef is None:  # non-finite gradients: no update
            self.steps_skipped += 1
            self.store.zero_grads()
            return StepStats(loss, norm, 0.0, tokens, True, time.perf_counter() - t0, unit_norms)
        lr = self.config.optimizer.lr if lr is None else lr
        # Safe to overwrite host weights now: every weight copy of the step fed an op whose
        # gradient has landed on the host (sink.finish), so every copy has completed. Data
        # parallel: on every rank (the reduction needed every rank's gradient of the unit).
        if self.reducer is not None:
            self.reducer.begin_updates()
        for buf in self.store:  # embed first: the next forward needs it first
            if self.reducer is not None and not self.reducer.owns(buf.name):
                buf.grad.zero_()  # reduced into the owner's; this rank's part is spent
                continue
            self._updates[buf.name] = self._pool.submit(self._update, buf.name, lr, coef)
        return StepStats(loss, norm, coef, tokens, False, time.perf_counter() - t0, unit_norms)

    def _update(self, unit: str, lr: float, coef: float) -> None:
        buf = self.store[unit]
        self.optimizers[unit].step_unit(buf, lr, coef)
        buf.grad.zero_()
        buf.refresh_compute()
        if self.reducer is not None:
            self.reducer.published(unit)

    # ----- one micro-batch: the host queues each op's work on the compute lane --------------

    def _micro_batch(self, batch: Batch, loss: torch.Tensor, total_tokens: int, final: bool) -> None:
        shape = tuple(batch.input_ids.shape) + (self.adapter.hidden_size,)
        tiers = self.plan.boundary_tiers
        self.acts.prepare(math.prod(shape), self.config.compute_dtype,
                          sum(t in ("host", "nvme") for t in tiers), tiers.count("nvme"))
        mb = _MicroBatch(shape, loss, total_tokens, final)
        self.backend.launch(lambda: self._start(mb, batch))
        ops = self.program
        for n, op in enumerate(ops):
            for ahead in ops[n + 1:n + 1 + FETCH_AHEAD]:
                if ahead.kind == OpKind.FETCH:
                    self.acts.prefetch(ahead.index)  # NVMe reads and H2D fetches run ahead
                elif ahead.kind == OpKind.FETCH_INTERNALS:
                    self.internals.fetch(ahead.index)
            with torch.profiler.record_function(str(op)):  # lets a memory probe attribute its peak
                self._ops[op.kind](mb, op.index)

    def _start(self, mb: _MicroBatch, batch: Batch) -> None:
        mb.ids = self._to_device(batch.input_ids)
        mb.labels = self._to_device(batch.labels)
        seq_len = batch.input_ids.shape[1]
        mb.pos = torch.arange(seq_len, device=self.device)[None]
        mb.masks = self.adapter.attention_masks(seq_len, self.device)

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return t
        return t.pin_memory().to(self.device, non_blocking=True)

    def _embed_fwd(self, mb: _MicroBatch, _i: int, recompute: bool = False) -> None:
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

    def _recompute_embed(self, mb: _MicroBatch, i: int) -> None:
        self._embed_fwd(mb, i, recompute=True)

    def _store_input(self, mb: _MicroBatch, i: int) -> None:
        """Boundary i (the layer's input, as compute will have it) kept per its tier."""
        h = Ref()
        self.backend.launch(lambda: setattr(h, "value", mb.h))
        self.acts.store(i, h, mb.shape, self.plan.boundary_tiers[i])

    def _layer_fwd(self, mb: _MicroBatch, i: int) -> None:
        self._store_input(mb, i)
        self._layer_no_grad(mb, i, lambda: mb.h, lambda y: setattr(mb, "h", y))

    def _layer_fwd_keep(self, mb: _MicroBatch, i: int) -> None:
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

    def _recompute_layer(self, mb: _MicroBatch, i: int) -> None:
        out = Ref()
        self._layer_no_grad(mb, i, lambda: self.acts.on_device[i], lambda y: setattr(out, "value", y))
        self.acts.put_recomputed(i + 1, out)

    def _layer_no_grad(self, mb: _MicroBatch, i: int, get_input, put_output) -> None:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)

        def run() -> None:
            with torch.no_grad():
                put_output(self.adapter.layer(i, self.store[unit].layout.views(w), get_input(),
                                              mb.rope, mb.pos, mb.masks))

        self.backend.launch(run)
        self.streamer.release(unit)

    def _fetch(self, mb: _MicroBatch, i: int) -> None:
        self.acts.fetch(i)

    def _layer_bwd(self, mb: _MicroBatch, i: int) -> None:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        ticket = self.sink.begin(unit)

        def run() -> None:
            gx, gw = layer_backward(self.adapter, i, self.store[unit].layout, w, self.acts.on_device[i],
                                    mb.grad_h, mb.rope, mb.pos, mb.masks)
            mb.grad_h = gx
            self.sink.deposit(ticket, gw)

        self.backend.launch(run)
        self.streamer.release(unit)
        self.sink.end(ticket, mb.final)
        self.acts.drop(i)

    def _fetch_internals(self, mb: _MicroBatch, i: int) -> None:
        self.internals.fetch(i)

    def _layer_bwd_kept(self, mb: _MicroBatch, i: int) -> None:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        ticket = self.sink.begin(unit)
        g = self.internals.ready(i)

        def run() -> None:
            gx, gw = self.internals.backward(g, w, mb.grad_h)
            mb.grad_h = gx
            self.sink.deposit(ticket, gw)

        self.backend.launch(run)
        self.streamer.release(unit)
        self.sink.end(ticket, mb.final)
        self.acts.drop(i)

    def _embed_bwd(self, mb: _MicroBatch, _i: int) -> None:
        w = self.streamer.acquire(EMBED)
        ticket = self.sink.begin(EMBED)

        def run() -> None:
            params = self.store[EMBED].layout.leaves(w)
            h0 = self.adapter.embed(params, mb.ids)
            gw = torch.autograd.grad(h0, tuple(params.values()), mb.grad_h)
            self.sink.deposit(ticket, list(gw))
            mb.grad_h = None

        self.backend.launch(run)
        self.streamer.release(EMBED)
        self.sink.end(ticket, mb.final)

    def _head(self, mb: _MicroBatch, _i: int) -> None:
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

    # ----- inference (eval, export checks) ------------------------------------------------

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of a batch, streamed layer by layer (``[batch, seq, vocab]`` on the host)."""
        parts = [self.adapter.head_logits(hv, ew, h).float().cpu()
                 for _, h, hv, ew in self._forward_hidden(input_ids)]
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean cross-entropy per target token over ``batches``."""
        total_loss, total_tokens = 0.0, 0
        for mb in batches:
            labels = mb.labels.to(self.device)
            for sl, h, hv, ew in self._forward_hidden(mb.input_ids, self.plan.head_chunk_tokens):
                logits = self.adapter.head_logits(hv, ew, h)
                total_loss += float(F.cross_entropy(
                    logits.float().flatten(0, 1), labels[:, sl].flatten(),
                    ignore_index=IGNORE_INDEX, reduction="sum"))
            total_tokens += mb.num_target_tokens
        if total_tokens == 0:
            raise ValueError("eval batches have no target tokens")
        return total_loss / total_tokens

    def _forward_hidden(self, input_ids: torch.Tensor, chunk_tokens: int | None = None):
        """Yield (sequence slice, final hidden chunk, head views, tied weight) per chunk."""
        self.synchronize()
        ad, st = self.adapter, self.store
        batch, seq_len = input_ids.shape
        self.check_batch(Batch(input_ids, input_ids))
        mb = _MicroBatch(tuple(input_ids.shape) + (ad.hidden_size,), None, 0, False)
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

    def close(self) -> None:
        self._wait_own_updates()
        self._pool.shutdown(wait=True)
        self.acts.close()
        self.sink.close()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()


@dataclass
class _MicroBatch:
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

