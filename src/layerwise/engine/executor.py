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

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.adapter import DecoderAdapter
from ..models.names import EMBED, HEAD, layer_unit
from ..optim.adamw import AdamWConfig, HostAdamW, UnitOptimizer
from ..optim.clip import clip_or_skip, global_norm
from ..plan.shape import ModelShape
from ..plan.memory import MemoryEstimate, predict_peak_device_bytes
from ..plan.plan import Plan
from ..plan.program import Op, OpKind, forward_program, micro_batch_program, weight_schedule
from ..store import HostStore
from .batch import IGNORE_INDEX, Batch
from .backend import make_backend
from .streams import ActivationStore, GradSink, WeightStreamer


@dataclass
class EngineConfig:
    device: str = "cpu"
    """``cpu`` (synchronous backend) or ``cuda[:N]``."""
    compute_dtype: torch.dtype = torch.float32
    """Dtype of weights and activations on the device; use torch.bfloat16 on GPUs."""
    device_mem_cap_bytes: int | None = None
    """Refuse plans whose predicted device peak exceeds this (None: no cap)."""
    spill_dir: str | None = None
    """Directory for NVMe-tier activations (None: a temp dir)."""
    optimizer_threads: int = 1
    """Host worker threads running per-unit optimizer updates."""
    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    measure_workspace: bool = False
    """Measure autograd's saved bytes per layer (for the measured device peak on CPU); slower."""


@dataclass
class _MicroBatchRun:
    """What the ops of one micro-batch share: its inputs, and the values handed from op to op."""

    ids: torch.Tensor
    labels: torch.Tensor
    pos: torch.Tensor
    masks: object
    total_tokens: int
    """Target tokens of the whole step (the loss divisor)."""
    final: bool
    """The step's last micro-batch: gradients are final after it."""
    rope: object = None
    h: torch.Tensor | None = None
    """The forward's current hidden state."""
    grad_h: torch.Tensor | None = None
    """The gradient flowing backward."""
    loss: torch.Tensor | None = None


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


class StreamingEngine:
    def __init__(self, adapter: DecoderAdapter, store: HostStore, plan: Plan,
                 config: EngineConfig | None = None,
                 optimizers: dict[str, UnitOptimizer] | None = None):
        self.config = config or EngineConfig()
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
        self.backend = make_backend(self.config.device)
        self.device = self.backend.device
        self.rotary = adapter.new_rotary(self.device)
        self.program = micro_batch_program(plan.boundary_tiers)
        self.shape = ModelShape.from_config(adapter.config)
        self.optimizers = optimizers or self._default_optimizers()
        for buf in store:
            if not buf.state:
                self.optimizers[buf.name].init_state(buf)
        self._pool = ThreadPoolExecutor(self.config.optimizer_threads, thread_name_prefix="optim")
        self._updates: dict[str, Future] = {}
        self.streamer = WeightStreamer(self.backend, store, plan.prefetch_depth, self._wait_update)
        self.sink = GradSink(self.backend, store)
        self.acts = ActivationStore(self.backend, self.config.spill_dir)
        self.steps_skipped = 0
        self._run_op = {
            OpKind.EMBED_FWD: self._op_embed_fwd, OpKind.LAYER_FWD: self._op_layer_fwd,
            OpKind.HEAD: self._op_head, OpKind.FETCH: self._op_fetch,
            OpKind.RECOMPUTE_EMBED: self._op_recompute_embed, OpKind.RECOMPUTE_LAYER: self._op_recompute_layer,
            OpKind.LAYER_BWD: self._op_layer_bwd, OpKind.EMBED_BWD: self._op_embed_bwd,
        }
        """How each kind of op of the step program runs: (layer index, micro-batch run) -> None."""

    def _default_optimizers(self) -> dict[str, UnitOptimizer]:
        kinds = self.plan.moments or ["fp32"] * len(self.store.units)
        fp32 = HostAdamW(self.config.optimizer)
        out: dict[str, UnitOptimizer] = {}
        eight = None
        for buf, kind in zip(self.store, kinds):
            if kind == "8bit":
                if eight is None:
                    from ..optim.adamw8bit import HostAdamW8bit  # heavier import, only if used

                    eight = HostAdamW8bit(self.config.optimizer)
                out[buf.name] = eight
            else:
                out[buf.name] = fp32
        return out

    # ----- checks -------------------------------------------------------------------------

    def predict_memory(self, micro_batch_size: int, seq_len: int) -> MemoryEstimate:
        elem = torch.empty((), dtype=self.config.compute_dtype).element_size()
        return predict_peak_device_bytes(self.shape, self.plan, micro_batch_size, seq_len, elem)

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
        fut = self._updates.pop(unit, None)
        if fut is not None:
            fut.result()

    def synchronize(self) -> None:
        """Wait for all pending optimizer updates (before reading the store, e.g. to save)."""
        for unit in list(self._updates):
            self._wait_update(unit)

    def compute_grads(self, micro_batches: list[Batch]) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch; grads accumulate in the store.

        Returns the loss (mean over all target tokens of the step) and per-unit squared grad norms.
        """
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        total = sum(mb.num_target_tokens for mb in micro_batches)
        if total == 0:
            raise ValueError("the step's batches have no target tokens (all labels are ignored)")
        self.check(*micro_batches[0].input_ids.shape)
        schedule = weight_schedule(self.program, self.adapter.tied) * len(micro_batches)
        self.streamer.begin(schedule)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            for k, mb in enumerate(micro_batches):
                loss += self._micro_batch(mb, total, final=k == len(micro_batches) - 1)
            assert self.streamer.finished()
            sq = self.sink.finish()
        except BaseException:
            self._abandon_step()
            raise
        finally:
            self.acts.clear()
        return float(loss), sq

    def _abandon_step(self) -> None:
        """After a failed step: drop its buffers and partial gradients so the next step is clean."""
        self.streamer.reset()
        self.sink.abandon()
        self.synchronize()  # the previous step's updates still read their gradients
        self.store.zero_grads()

    def train_step(self, micro_batches: list[Batch], lr: float | None = None) -> StepStats:
        t0 = time.perf_counter()
        loss, sq = self.compute_grads(micro_batches)
        norm = global_norm(list(sq.values()))
        tokens = sum(mb.num_target_tokens for mb in micro_batches)
        coef = clip_or_skip(norm, self.config.optimizer.max_grad_norm)
        if coef is None:  # non-finite gradients: no update
            self.steps_skipped += 1
            self.store.zero_grads()
            return StepStats(loss, norm, 0.0, tokens, True, time.perf_counter() - t0)
        lr = self.config.optimizer.lr if lr is None else lr
        # Safe to overwrite host weights now: each unit's last copy in the step fed an op whose
        # gradient has landed on the host (sink.finish), so every weight copy has completed.
        for buf in self.store:  # embed first: the next forward needs it first
            self._updates[buf.name] = self._pool.submit(self._update, buf.name, lr, coef)
        return StepStats(loss, norm, coef, tokens, False, time.perf_counter() - t0)

    def _update(self, unit: str, lr: float, coef: float) -> None:
        buf = self.store[unit]
        self.optimizers[unit].step_unit(buf, lr, coef)
        buf.grad.zero_()
        buf.refresh_compute()

    # ----- one micro-batch ----------------------------------------------------------------

    def _micro_batch(self, mb: Batch, total_tokens: int, final: bool) -> torch.Tensor:
        ids = mb.input_ids.to(self.device)
        seq_len = ids.shape[1]
        run = _MicroBatchRun(ids, mb.labels.to(self.device), torch.arange(seq_len, device=self.device)[None],
                             self.adapter.attention_masks(seq_len, self.device), total_tokens, final)
        ops = self.program
        for n, op in enumerate(ops):
            if n + 2 < len(ops) and ops[n + 2].kind == OpKind.FETCH:
                self.acts.prefetch(ops[n + 2].index)  # NVMe reads start two ops ahead
            self._run_op[op.kind](op.index, run)
        return run.loss

    def _op_embed_fwd(self, i: int, run: _MicroBatchRun) -> None:
        run.h = self._embed_no_grad(run)

    def _op_recompute_embed(self, i: int, run: _MicroBatchRun) -> None:
        self.acts.put_recomputed(0, self._embed_no_grad(run))

    def _op_layer_fwd(self, i: int, run: _MicroBatchRun) -> None:
        self.acts.store(i, run.h, self.plan.boundary_tiers[i])
        run.h = self._layer_no_grad(i, run.h, run.rope, run.pos, run.masks)

    def _op_recompute_layer(self, i: int, run: _MicroBatchRun) -> None:
        self.acts.put_recomputed(i + 1, self._layer_no_grad(i, self.acts.get(i), run.rope, run.pos, run.masks))

    def _op_head(self, i: int, run: _MicroBatchRun) -> None:
        run.grad_h, run.loss = self._head(run.h, run.labels, run.total_tokens, run.final)
        run.h = None

    def _op_fetch(self, i: int, run: _MicroBatchRun) -> None:
        self.acts.fetch(i)

    def _op_layer_bwd(self, i: int, run: _MicroBatchRun) -> None:
        run.grad_h = self._layer_backward(i, self.acts.get(i), run.grad_h, run.rope, run.pos, run.masks, run.final)
        self.acts.drop(i)

    def _op_embed_bwd(self, i: int, run: _MicroBatchRun) -> None:
        self._embed_backward(run.ids, run.grad_h, run.final)
        run.grad_h = None

    def _embed_no_grad(self, run: _MicroBatchRun) -> torch.Tensor:
        """Boundary 0 from the input ids; the rotary tables are made from the first one."""
        w = self.streamer.acquire(EMBED)
        with torch.no_grad():
            h0 = self.adapter.embed(self.store[EMBED].layout.views(w), run.ids)
        self.streamer.release(EMBED)
        if run.rope is None:
            with torch.no_grad():
                run.rope = self.rotary(h0, run.pos)
        return h0

    def _layer_no_grad(self, i, x, rope, pos, masks) -> torch.Tensor:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        with torch.no_grad():
            y = self.adapter.layer(i, self.store[unit].layout.views(w), x, rope, pos, masks)
        self.streamer.release(unit)
        return y

    def _layer_backward(self, i, x, grad_out, rope, pos, masks, final) -> torch.Tensor:
        unit = layer_unit(i)
        w = self.streamer.acquire(unit)
        x = x.detach().requires_grad_()
        params = self.store[unit].layout.leaves(w)
        if self.config.measure_workspace:
            saved = _SavedBytes(exclude=(x, w))  # both already counted
            with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
                y = self.adapter.layer(i, params, x, rope, pos, masks)
            # autograd's saved tensors + the output, both gradients, on top of what is live
            self.backend.ledger.peak_with(saved.nbytes + 3 * _nb(x) + _nb(w))
        else:
            y = self.adapter.layer(i, params, x, rope, pos, masks)
        gx, *gw = torch.autograd.grad(y, (x, *params.values()), grad_out)
        self.streamer.release(unit)
        self.sink.put(unit, gw, final)
        return gx

    def _embed_backward(self, ids, grad_h, final) -> None:
        w = self.streamer.acquire(EMBED)
        params = self.store[EMBED].layout.leaves(w)
        h0 = self.adapter.embed(params, ids)
        gw = torch.autograd.grad(h0, tuple(params.values()), grad_h)
        self.streamer.release(EMBED)
        self.sink.put(EMBED, list(gw), final)

    def _head(self, h, labels, total_tokens, final) -> tuple[torch.Tensor, torch.Tensor]:
        ad, st = self.adapter, self.store
        units = Op(OpKind.HEAD).units(ad.tied)
        leaves = {u: st[u].layout.leaves(self.streamer.acquire(u)) for u in units}
        head_params = leaves[HEAD]
        embed_weight = leaves[EMBED]["weight"] if ad.tied else None
        wrt = [t for u in units for t in leaves[u].values()]
        hidden = h.shape[-1]
        h2 = h.reshape(-1, hidden)
        lab = labels.reshape(-1)
        grad_h2 = torch.empty_like(h2)
        grads_w = [torch.zeros_like(t) for t in wrt]
        loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
        chunk = self.plan.head_chunk_tokens
        for start in range(0, h2.shape[0], chunk):
            hc = h2[start:start + chunk].detach().requires_grad_()
            logits = ad.head_logits(head_params, embed_weight, hc)
            loss = F.cross_entropy(logits.float(), lab[start:start + chunk],
                                   ignore_index=IGNORE_INDEX, reduction="sum") / total_tokens
            g = torch.autograd.grad(loss, [hc, *wrt])
            grad_h2[start:start + chunk] = g[0]
            for acc, gi in zip(grads_w, g[1:]):
                acc += gi
            loss_sum += loss.detach()
        for u in units:
            self.streamer.release(u)
        n_embed = len(leaves[EMBED]) if ad.tied else 0
        self.sink.put(HEAD, grads_w[n_embed:], final)
        if ad.tied:
            self.sink.put(EMBED, grads_w[:n_embed], final=False)  # embed_bwd adds the rest
        return grad_h2.view_as(h), loss_sum

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
        ids = input_ids.to(self.device)
        batch, seq_len = ids.shape
        pos = torch.arange(seq_len, device=self.device)[None]
        masks = ad.attention_masks(seq_len, self.device)
        self.streamer.begin(weight_schedule(forward_program(ad.num_layers), ad.tied))
        w = self.streamer.acquire(EMBED)
        h = ad.embed(st[EMBED].layout.views(w), ids)
        self.streamer.release(EMBED)
        rope = self.rotary(h, pos)
        for i in range(ad.num_layers):
            h = self._layer_no_grad(i, h, rope, pos, masks)
        units = Op(OpKind.HEAD).units(ad.tied)
        ws = [self.streamer.acquire(u) for u in units]
        head_views = st[HEAD].layout.views(ws[-1])
        embed_weight = st[EMBED].layout.views(ws[0])["weight"] if ad.tied else None
        step = max(1, (chunk_tokens or batch * seq_len) // batch)
        try:
            for start in range(0, seq_len, step):
                sl = slice(start, start + step)
                yield sl, h[:, sl], head_views, embed_weight
        finally:
            for u in units:
                self.streamer.release(u)

    def close(self) -> None:
        self.synchronize()
        self._pool.shutdown(wait=True)
        self.acts.close()


def _nb(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _SavedBytes:
    """Counts the distinct storages autograd saves for the backward."""

    def __init__(self, exclude: tuple[torch.Tensor, ...] = ()) -> None:
        self.nbytes = 0
        self._seen: set[int] = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage().data_ptr()
        if key not in self._seen:
            self._seen.add(key)
            self.nbytes += t.untyped_storage().nbytes()
        return t

    def unpack(self, t: torch.Tensor) -> torch.Tensor:
        return t
