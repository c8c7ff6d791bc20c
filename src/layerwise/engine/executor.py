"""StreamingEngine: layer-by-layer training with all state in host memory.

One step = the step program (``plan.plan_step_program``), then the host optimizer on worker
threads, overlapping the next forward (on the CPU backend the step waits for it); the next
forward of unit ``u`` waits for ``u``'s update alone (``docs/design-notes.md``, "Engine").

With fp32 compute the numbers are those of plain autograd on the same model, for any plan:
a plan moves activations and adds recomputation, it never changes the arithmetic."""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..models.adapter import DecoderAdapter
from ..optim.adamw import AdamWConfig, HostAdamW, UnitOptimizer
from ..optim.adamw8bit import HostAdamW8bit
from ..optim.clip import clip_or_skip, global_norm
from ..plan.shape import ModelShape
from ..plan.memory import CUDA_WORKSPACE_BYTES, MemoryEstimate, predict_peak_device_bytes
from ..plan.plan import Plan
from ..plan.program import micro_batch_program, plan_step_program, resident_units, weight_schedule
from ..store import HostStore
from .batch import IGNORE_INDEX, Batch
from .boundary_tiers import BoundaryTiers
from .devices import make_backend
from .grad_sink import GradSink
from .host_threads import plan_host_threads
from .internals import KeptInternals
from .op_handlers import OpHandlers
from .reduce import LocalReducer, StepReducer
from .updates import HostUpdates
from .weight_stream import WeightStreamer


@dataclass
class EngineConfig:
    device: str = "cpu"
    """``cpu`` (synchronous backend), ``cpu-async`` (the GPU's protocol on threads, for tests)
    or ``cuda[:N]``."""
    compute_dtype: torch.dtype | None = None
    """Dtype of weights and activations on the device (None: bf16 on CUDA, fp32 on the CPU
    backends); the store must be built with the same."""
    device_mem_cap_bytes: int | None = None
    """Refuse plans whose predicted device peak exceeds this (None: no cap)."""
    spill_dir: str | None = None
    """Directory for NVMe-tier activations (None: a temp dir)."""
    optimizer_threads: int = 1
    """Host worker threads running per-unit optimizer updates."""
    landing_threads: int | None = None
    """Threads one gradient landing is split over (None: ``host_threads.plan_host_threads``'s
    choice: the CPUs but one on CUDA, 1 on the CPU backends)."""
    optimizer: AdamWConfig = field(default_factory=AdamWConfig)
    async_seed: int | None = 0
    """For ``device="cpu-async"``: seed of the lanes' random delays (None: no delays)."""


def default_compute_dtype(device: str | torch.device) -> torch.dtype:
    """bf16 on CUDA (fp32 weights and activations would double every copy and halve the
    tensor-core rate), fp32 on the CPU backends (exact against autograd)."""
    return torch.bfloat16 if str(device).startswith("cuda") else torch.float32


def pageable_copy_warning(device: torch.device, store: HostStore) -> str | None:
    """What to say when a GPU's weight copies would come from pageable memory (a store built
    with ``pin=False``, or whose page-locking was refused): the driver then stages every copy
    through a pinned buffer of its own, synchronously, at a fraction of the bandwidth."""
    if device.type != "cuda" or store.pinned_nbytes() > 0:
        return None
    return (f"the host store's copy sources ({store.copy_source_nbytes() / 2**30:.2f} GiB) are "
            "not page-locked: every weight copy to the GPU will come from pageable memory "
            "(staged by the driver, not overlapped with compute); build the store with pin=True "
            "(the default when CUDA is available)")


@dataclass
class StepStats:
    loss: float
    """Mean cross-entropy per target token over the whole step (plus, for an MoE trained with
    its router aux loss, that loss as ``models/moe.py`` weights it)."""
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
        """``reducer``: data parallel, the ranks' seam (``engine/reduce.py``); None: one process
        (:class:`LocalReducer`)."""
        self.config = config or EngineConfig()
        self.reducer: StepReducer = LocalReducer(store) if reducer is None else reducer
        plan.validate(adapter.num_layers)
        self.compute_dtype = self.config.compute_dtype or default_compute_dtype(self.config.device)
        if store.compute_dtype != self.compute_dtype:
            raise ValueError(
                f"store compute dtype {store.compute_dtype} != engine compute dtype "
                f"{self.compute_dtype}; build the HostStore with compute_dtype="
                f"{self.compute_dtype}, or set EngineConfig.compute_dtype={store.compute_dtype}"
            )
        self.adapter = adapter
        self.store = store
        self.plan = plan
        self.backend = make_backend(self.config.device, self.config.async_seed)
        self.device = self.backend.device
        warning = pageable_copy_warning(self.device, store)
        if warning:
            warnings.warn(warning, RuntimeWarning, stacklevel=2)
        self.program = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
        """The ops of one micro-batch (a step runs each for every micro-batch of its group)."""
        self.resident = resident_units(plan.resident_layers)
        if store.source_tier is not None and any(store.source_tier.holds(u) for u in self.resident):
            raise ValueError("a resident layer's copy source cannot live on NVMe: drop it from "
                             "plan.resident_layers or keep its state_tiers entry off nvme-all")
        plan_shape = getattr(adapter, "plan_shape", None)  # a LoRA run's knows its frozen base
        self.shape = plan_shape() if plan_shape is not None else \
            ModelShape.from_config(adapter.config, adapter=adapter)
        self.optimizers = optimizers or self._default_optimizers()
        for buf in store:
            if not buf.state:
                self.optimizers[buf.name].init_state(buf)
                store.adopt_state(buf)  # an NVMe unit's state goes to its file
        threads = plan_host_threads(self.device.type, self.config.optimizer_threads)
        if threads.optimizer_intra is not None:
            torch.set_num_threads(threads.optimizer_intra)  # the launcher's CPU stays free
        self.host_threads = threads
        self.updates = HostUpdates(store, self.optimizers, self.reducer, self.config.optimizer_threads,
                                   initializer=self._thread_init)
        self.streamer = WeightStreamer(self.backend, store, plan.prefetch_depth, self.updates.wait,
                                       self.updates.done, self.resident)
        landing = self.config.landing_threads or threads.landing
        self.sink = GradSink(self.backend, store, on_final=self.reducer.unit_landed,
                             landing_threads=landing, thread_init=self._thread_init,
                             device_reduce=self.reducer if self.reducer.on_device else None,
                             per_load=plan.micro_batches_per_load)
        self.acts = BoundaryTiers(self.backend, self.config.spill_dir)
        self.internals = KeptInternals(self.backend)
        self.handlers = OpHandlers(adapter, store, plan, self.backend, self.compute_dtype,
                                   self.streamer, self.sink, self.acts, self.internals)
        self.steps_skipped = 0
        self.step_tokens = 0
        """Target tokens of the last step, over all ranks (the loss's divisor)."""

    def _thread_init(self) -> None:
        """Run first by every host worker thread the engine starts: the device its CUDA calls
        go to (else GPU 0, where each would create a context under LOCAL_RANK > 0), then its
        CPU mask."""
        self.backend.bind_thread()
        self.host_threads.pin_current_thread()

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
        elem = torch.empty((), dtype=self.compute_dtype).element_size()
        cuda = self.device.type == "cuda"  # the CUDA workspaces: cuBLAS's flat, attention's by shape
        return predict_peak_device_bytes(self.shape, self.plan, micro_batch_size, seq_len, elem,
                                         grad_slots=not self.sink.inline,
                                         workspace_bytes=CUDA_WORKSPACE_BYTES if cuda else 0,
                                         attention_workspace=cuda)

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

    def synchronize(self) -> None:
        """Wait for all pending optimizer updates (before reading the store, e.g. to save);
        data parallel: the other owners' too."""
        self.updates.wait_all()

    def check_batch(self, mb: Batch) -> None:
        """Refuse, on the host, token ids or labels outside the vocabulary: on a GPU they would
        trip a device-side assert that poisons the CUDA context for the rest of the process."""
        vocab = self.adapter.vocab_size
        ids, labels = mb.input_ids, mb.labels
        if ids.shape != labels.shape or ids.dim() != 2:
            raise ValueError(f"input_ids {tuple(ids.shape)} and labels {tuple(labels.shape)} must "
                             "both be [batch, seq]")
        if mb.segment_ids is not None and mb.segment_ids.shape != ids.shape:
            raise ValueError(f"segment_ids {tuple(mb.segment_ids.shape)} must have the shape of "
                             f"input_ids {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
            raise ValueError(f"token ids must be in [0, {vocab}) for this model, got "
                             f"[{int(ids.min())}, {int(ids.max())}]; the tokenizer does not match the model")
        bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab))
        if bool(bad.any()):
            raise ValueError(f"labels must be in [0, {vocab}) or {IGNORE_INDEX} (ignored), got "
                             f"{int(labels[bad][0])}")

    def compute_grads(self, micro_batches: list[Batch]) -> tuple[float, dict[str, float]]:
        """Forward + backward of every micro-batch; grads accumulate in the store. Returns the loss
        (mean over the step's target tokens, all ranks) and per-unit squared grad norms."""
        if not micro_batches:
            raise ValueError("a step needs at least one micro-batch")
        n = len(micro_batches)
        if not self.plan.lands_once(n) and any(b.grad.dtype != torch.float32 for b in self.store):
            raise ValueError(f"{n} micro-batches in a step in groups of "
                             f"{self.plan.micro_batches_per_load}, but the store keeps bf16 "
                             "gradients (they land once a step: nothing is summed on the host); "
                             "build the HostStore with grad_dtype=torch.float32 to accumulate, "
                             f"or use a plan with micro_batches_per_load >= {n}")
        for mb in micro_batches:
            self.check_batch(mb)
        total = self.reducer.global_tokens(sum(mb.num_target_tokens for mb in micro_batches))
        self.step_tokens = total
        if total == 0:
            raise ValueError("the step's batches have no target tokens (all labels are ignored)")
        self.check(*micro_batches[0].input_ids.shape)
        steps = plan_step_program(self.plan, n)
        self.streamer.begin(weight_schedule([s.op for s in steps], self.adapter.tied, self.resident))
        self.sink.begin_step()
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        try:
            self.handlers.run_step(steps, micro_batches, loss, total)
            # The step ends when its last gradient has landed: that gradient's copy followed the
            # last compute of the step, and the lanes run in order, so nothing of the step is
            # still running that the host or the updates could race. No drain of the device.
            self.sink.finish()
            self.backend.raise_errors()
            assert self.streamer.finished()
            assert self.sink.landed() == {b.name for b in self.store if b.layout.numel}, \
                "a unit got no gradient this step"
            sq, step_loss = self.reducer.finish(float(loss))
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
        self.updates.wait_own()  # the previous step's updates still read their gradients
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
        self.updates.submit(lr, coef)
        if not self.backend.asynchronous and self.store.state_tier is None:
            # the device is the host's cores: an update overlapping the next forward would only
            # take its CPU (3-5% slower steps measured); with state on NVMe the overlap hides I/O
            self.updates.wait_own()
        self.streamer.resident.mark_stale()  # each refreshed after its update, before its next use
        return StepStats(loss, norm, coef, tokens, False, time.perf_counter() - t0, unit_norms)

    # ----- inference (eval, export checks) ------------------------------------------------

    @torch.no_grad()
    def forward_logits(self, input_ids: torch.Tensor,
                       segment_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of a batch, streamed layer by layer (``[batch, seq, vocab]`` on the host);
        ``segment_ids``: packed rows (``Batch.segment_ids``)."""
        parts = [self.adapter.head_logits(hv, ew, h).float().cpu()
                 for _, h, hv, ew in self._forward_hidden(input_ids, None, segment_ids)]
        return torch.cat(parts, dim=1)

    @torch.no_grad()
    def eval_loss(self, batches: list[Batch]) -> float:
        """Mean cross-entropy per target token over ``batches``."""
        total_loss, total_tokens = 0.0, 0
        for mb in batches:
            labels = mb.labels.to(self.device)
            for sl, h, hv, ew in self._forward_hidden(mb.input_ids, self.plan.head_chunk_tokens,
                                                      mb.segment_ids):
                logits = self.adapter.head_logits(hv, ew, h)
                total_loss += float(F.cross_entropy(
                    logits.float().flatten(0, 1), labels[:, sl].flatten(),
                    ignore_index=IGNORE_INDEX, reduction="sum"))
            total_tokens += mb.num_target_tokens
        if total_tokens == 0:
            raise ValueError("eval batches have no target tokens")
        return total_loss / total_tokens

    def _forward_hidden(self, input_ids: torch.Tensor, chunk_tokens: int | None = None,
                        segment_ids: torch.Tensor | None = None):
        """Yield (sequence slice, final hidden chunk, head views, tied weight) per chunk."""
        self.synchronize()
        self.check_batch(Batch(input_ids, input_ids, segment_ids))
        yield from self.handlers.forward_hidden(input_ids, chunk_tokens, segment_ids)

    def close(self) -> None:
        self.updates.close()
        self.acts.close()
        self.sink.close()
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()
