"""The training loop around the StreamingEngine: ``Trainer``, in named steps (``setup``,
``train_step``, ``evaluate``, ``save``, ``close``), and ``train(cfg)``, which runs them.
Rank 0 writes the files (``lead``); the other ranks run the same code and write nothing."""

from __future__ import annotations

import logging
import math
import signal
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from .. import config as config_lib
from ..ckpt.store_provider import HostStoreStateProvider
from ..engine import EngineConfig, StreamingEngine
from ..engine.batch import Batch
from ..models.families import model_dropouts
from ..util.errors import Interrupted
from ..util.logs import quiet_unless
from ..models.adapter import DecoderAdapter
from ..models.names import unit_names
from ..plan.plan import Plan
from ..store import HostStore
from .build import (FlopCounter, ModelSource, check_fits, check_options, choose_plan,
                    make_state_tiers, mem_cap_bytes, place_run_state, resolve_dtype)
from .config import TrainConfig
from .data import DataSpec, TrainData, prepare_data
from .dist import saving as dist_saving, setup as dist_setup
from .dist.context import DistContext, init as dist_init, shutdown as dist_shutdown
from .dist.reducer import DistReducer
from .dist.shm import shared_store_nbytes
from .checkpoints import CheckpointManager, StopFlag, due
from .lora_run import (build_lora, eval_mode, export_lora, lora_adapter, resolve_base_dtype,
                       resume_dropout)
from .outdir import RUN_FORMAT_VERSION, read_run_json
from .outdir import open_metrics as _open_metrics  # noqa: F401  (tests read it here)
from .progress import Progress
from .resume import Start, check_extension, data_start, decide_start, resume_command
from .run_files import RunFiles
from .run_records import (TrainResult, device_mem_reserved, step_record, throughput_text,
                          timing_summary)
from .sampling import greedy_continue, sample_prompts
from .schedule import Schedule
from .sinks import MetricsLog
from .state import TrainState
from .tokenizer import check_vocab, load_tokenizer
from .update_log import RunTracker

_log = logging.getLogger(__name__)

__all__ = ["RUN_FORMAT_VERSION", "TrainConfig", "TrainResult", "Trainer", "throughput_text",
           "train"]


def _rows_of(global_mb: Batch, rank: int, rows: int) -> Batch:
    """Rank ``rank``'s share of a global micro-batch (the whole of it in one process)."""
    if global_mb.input_ids.shape[0] == rows and rank == 0:
        return global_mb
    return global_mb.rows(slice(rank * rows, (rank + 1) * rows))


class Trainer:
    """One run: ``setup()``, then ``fit()`` (``train_step`` for each step, ``evaluate`` and
    ``save`` on their cadence, ``close`` at the end); ``train(cfg)`` does exactly that."""

    cfg: TrainConfig  # with the base model's dtype resolved (``resolve_base_dtype``)
    ctx: DistContext
    out_dir: Path
    ckpt_dir: Path
    lead: bool  # rank 0: it writes the run's files and computes the evaluations for every rank
    files: RunFiles
    log: MetricsLog
    lock: Any = None  # the out_dir's lock while the run holds it
    start: Start  # how the run starts (fresh, continued, from another run; done already)
    model_path: str
    compute_dtype: torch.dtype
    plan: Plan
    hw: Any  # the hardware the plan was chosen for (None: a rule or plan file)
    alloc: Any  # host memory of the store (one shared store per node under torchrun)
    adapter: DecoderAdapter
    store: HostStore | None = None
    engine: StreamingEngine | None = None
    mbs: int  # rows of this rank's micro-batch
    accum: int  # micro-batches per optimizer step
    global_rows: int  # rows of a global micro-batch: rank r trains on [r*mbs, (r+1)*mbs) of each
    est: Any  # the engine's predicted memory (``peak_bytes``)
    tokenizer: Any
    tokenizer_line: str
    data: TrainData
    eval_set: list[Batch]  # this rank's pieces of the held-out global micro-batches
    steps: int  # the run's optimizer steps (``num_train_epochs`` resolved)
    checkpoints: CheckpointManager | None = None
    state: TrainState  # the resumed checkpoint's, else a fresh run's
    start_step: int = 0
    batches: Any  # iterator of global micro-batches, from the data position
    schedule: Schedule
    tracker: RunTracker | None = None
    prompts: list[list[int]]  # token ids continued at each eval
    predicted_step_s: float | None
    run_info: dict[str, Any]  # run.json
    eval_loss: float
    flop_count: FlopCounter
    t_start: float
    tokens_seen: int  # of every row trained on, all ranks (padding, masked prompts too)
    step_times: list[float]
    step_tokens_per_s: list[float]

    def __init__(self, cfg: TrainConfig, ctx: DistContext | None = None):
        self.cfg = cfg
        self.ctx = ctx or DistContext.from_env(timeout_s=cfg.dist.timeout_s)
        self.out_dir = Path(cfg.out_dir)
        self.ckpt_dir = self.out_dir / "ckpt"
        self.lead = self.ctx.rank == 0
        self.files, self.log = RunFiles(self.out_dir, self.lead), MetricsLog(self.out_dir, self.lead)
        self.start = Start()
        self.state = TrainState()
        self.step_times, self.step_tokens_per_s, self.tokens_seen = [], [], 0
        self._closed = False

    # ----- setup ----------------------------------------------------------------------------

    def setup(self) -> None:
        """Checks, the out_dir's lock and how the run starts, model, plan, engine, data,
        checkpoints, the resumed state, the start-of-run eval and the outputs."""
        cfg = self.cfg
        check_options(cfg)
        self.lock = self.files.claim()
        self.start = dist_setup.decided_by_rank0(
            self.ctx, lambda: decide_start(cfg, self.out_dir), "deciding how the run starts")
        if self.start.note and not self.start.done:  # a finished run's note: the command prints it
            _log.info(self.start.note)
        if self.start.done:
            return
        if self.start.clear:
            self.files.clear()
        self._build()
        self._prepare_data()
        self._resume()
        self._begin()

    def _build(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        source, line = ModelSource.resolve(cfg)
        if line:
            _log.info(line)
        self.model_path = source.name
        cfg = self.cfg = resolve_base_dtype(cfg, source.name)
        self.compute_dtype = resolve_dtype(cfg.model.compute_dtype, cfg.device)
        self.plan, self.hw = dist_setup.decided_by_rank0(
            ctx, lambda: choose_plan(cfg, source.config, self.compute_dtype), "sharing the plan")
        check_fits(cfg, source.config, self.plan, self.compute_dtype)
        self.alloc = dist_setup.host_allocator(ctx, cfg.dist.shm_dir, lambda: shared_store_nbytes(
            lora_adapter(source.name, source.config, cfg, self.compute_dtype) if cfg.lora.enabled
            else source.config, self.compute_dtype, self.plan.moments))
        tiers: dict = {}
        try:
            # every gradient lands once a step on one process (one micro-batch, or all of them
            # sharing each weight load): nothing is summed on the host, the bf16 gradient lands
            # as the device made it (2 bytes per parameter instead of 4)
            one = self.plan.lands_once() and not ctx.enabled
            grad_dtype = torch.bfloat16 if one and self.compute_dtype == torch.bfloat16 else torch.float32
            self.plan = place_run_state(cfg, source.config, self.plan, self.compute_dtype, grad_dtype)
            tiers = make_state_tiers(cfg, self.plan, unit_names(self.plan.num_layers),
                                     self.out_dir, ctx.enabled, torch.cuda.is_available())
            self.adapter, self.store = (
                build_lora(source.name, source.config, cfg, self.compute_dtype, self.alloc)
                if cfg.lora.enabled
                else source.build(cfg.seed, self.compute_dtype, self.alloc, grad_dtype, tiers))
            flags = self.alloc.zeros(len(self.store.units), torch.int64) if ctx.enabled else None
            self.engine = StreamingEngine(self.adapter, self.store, self.plan, EngineConfig(
                device=cfg.device, compute_dtype=self.compute_dtype,
                device_mem_cap_bytes=mem_cap_bytes(cfg), optimizer=cfg.optimizer),
                reducer=DistReducer(ctx, self.store, flags, cfg.dist.grad_reduce, cfg.device)
                if ctx.enabled else None)
            dist_setup.store_ready(ctx, self.alloc)
        except BaseException:
            if ctx.enabled:
                self.alloc.unlink()
            for tier in tiers.values():  # a store that was built closes them at the end
                tier.close()
            raise
        self.mbs, self.accum = self.plan.micro_batch_size, self.plan.num_micro_batches
        self.global_rows = self.mbs * ctx.world_size
        self.est = self.engine.check(self.mbs, cfg.seq_len)

    def _prepare_data(self) -> None:
        cfg, d = self.cfg, self.cfg.data
        self.tokenizer, self.tokenizer_line = load_tokenizer(cfg.model.tokenizer, self.model_path)
        check_vocab(self.adapter.vocab_size, self.tokenizer)
        self.data = dist_setup.first_then_others(self.ctx, lambda: prepare_data(DataSpec(
            data=d.path, data_format=d.format, eval_data=d.eval_path,
            eval_fraction=d.eval_fraction, seq_len=cfg.seq_len, pack=d.pack, skip_bad=d.skip_bad,
            seed=cfg.seed, cache=d.cache, corpus=d.corpus, corpus_tokens=d.corpus_tokens),
            self.tokenizer, self.out_dir), "preparing the data")
        # the global micro-batches' rows, in pieces of this rank's size (its device's plan)
        self.eval_set = [_rows_of(b, r, self.mbs) for b in self.data.eval_set(
            self.global_rows, cfg.eval.batches, seed=cfg.seed + 1)
            for r in range(-(-b.input_ids.shape[0] // self.mbs))]
        self.steps = cfg.steps
        if cfg.num_train_epochs is not None:
            per_step = self.global_rows * self.accum
            self.steps = max(1, math.ceil(cfg.num_train_epochs * len(self.data.train) / per_step))
            _log.info(f"num_train_epochs={cfg.num_train_epochs:g}: {self.steps} steps "
                      f"({len(self.data.train)} train rows, {per_step} a step)")

    def _resume(self) -> None:
        """The run's checkpointer (every rank writes its groups); weights, AdamW moments and
        step counts, RNG from the checkpoint to resume from (read by the run's checkpointer when
        it is this run's, else by a reader); the data position, the schedule and the run's
        start-of-training eval from its ``TrainState``."""
        cfg, ctx, start = self.cfg, self.ctx, self.start
        provider = HostStoreStateProvider(self.store, self.engine.optimizers)
        # the run's tracker.jsonl is written by RunTracker (with the engine's gradient norms)
        # state on NVMe: a save writes from the live state, a unit at a time, not a RAM copy
        ckpt_cfg = (replace(cfg.ckpt, async_save=False, sync_copy=False)
                    if self.store.state_tier is not None else cfg.ckpt)
        ckpt = dist_saving.checkpointer(
            ctx, self.ckpt_dir, provider, self.store, True, config=ckpt_cfg,
            tracker_log=False) if cfg.checkpoints else None
        self.checkpoints = CheckpointManager(ctx, cfg.ckpt, ckpt)
        reader = None
        if start.source is not None and (ckpt is None or start.source != self.ckpt_dir) \
                and ctx.local_rank == 0:
            reader = dist_saving.checkpointer(ctx, start.source, provider, self.store, False,
                                              policy="full", tracker_log=False,
                                              expert_groups=cfg.ckpt.expert_groups)
        resumed = dist_setup.resume(ctx, reader or ckpt, start.source is not None,
                                    self.engine.optimizers, self.store, start.step)
        if reader is not None:
            reader.close()
        if resumed is not None:
            where = start.source or self.ckpt_dir
            _log.info(f"resumed from layer-wise checkpoint step {resumed.step} in {where}")
            self.state = TrainState.from_checkpoint(resumed)
            if start.source == self.ckpt_dir:
                self.checkpoints.last_saved = resumed.step
                info = read_run_json(self.out_dir) or {}
                note = check_extension(self.out_dir, resumed.step, self.steps,
                                       bool(info.get("finished")))
                if note:
                    raise ValueError(note)  # num_train_epochs: known only once the data was read
        self.start_step = self.state.step
        resume_dropout(self.adapter, self.start_step * self.accum)
        first, warning = data_start(self.state, self.accum, self.global_rows)
        if warning:
            _log.warning(warning)
        self.batches = self.data.batches(self.global_rows, seed=self.cfg.seed, start=first)
        if self.state.data_key not in (None, self.data.key):
            _log.warning("warning: the data, tokenizer or data settings differ from the "
                         "checkpoint's; the data position now indexes the new data")
        self.schedule = self._schedule()

    def _schedule(self) -> Schedule:
        s, saved = self.cfg.schedule, self.state.schedule
        total = s.total_steps or (saved or {}).get("total_steps") or self.steps
        warmup = (saved or {}).get("warmup_steps", s.warmup_steps)
        sched = Schedule.resolve(s.name, self.cfg.optimizer.lr, total, warmup,
                                 None if saved and not s.total_steps else s.warmup_ratio,
                                 s.min_lr_ratio)
        if saved and not s.total_steps and total != self.steps:
            _log.info(f"schedule: the run keeps its {s.name} schedule over {total} steps (now "
                      f"steps={self.steps}; the LR stays at its floor past step {total}); "
                      f"schedule.total_steps={self.steps} stretches it")
        return sched

    def _begin(self) -> None:
        """The lines that describe the run, the start eval, run.json and the outputs."""
        cfg, ctx, plan = self.cfg, self.ctx, self.plan
        self.files.save_plan(plan)
        self.files.save_model_files(self.tokenizer, self.model_path)
        self.predicted_step_s = plan.predicted.get("step_s")
        base = getattr(self.adapter, "num_base_params", None)  # a LoRA run: the adapters train
        params = f"{self.adapter.num_params() / 1e6:.1f}M params" if base is None else \
            f"{base() / 1e6:.1f}M params ({self.adapter.num_params() / 1e6:.2f}M trainable: the adapters)"
        _log.info(f"model {cfg.model.name}: {params}, "
                  f"{self.adapter.num_layers} layers ({self.adapter.family}); host store "
                  f"{self.store.nbytes() / 2**20:.0f} MiB"
                  + (f"; data parallel over {ctx.world_size} ranks ({ctx.num_nodes} node(s) x "
                     f"{ctx.local_world_size}), one shared store per node" if ctx.enabled else ""))
        dropouts = model_dropouts(self.adapter.config)
        if dropouts:
            _log.warning("warning: the model's own dropout is off in training here ("
                         + ", ".join(f"{k}={v:g}" for k, v in dropouts.items())
                         + " in its config): layerwise runs its modules as in eval, so every plan "
                         "computes the same step; LoRA's lora.dropout is the adapters' own")
        for line in [self.tokenizer_line, *self.data.summary()]:
            _log.info(line)
        kept = "".join(t[0] for t in plan.internal_tiers)
        _log.info(f"plan {plan.source}: boundaries {''.join(t[0] for t in plan.boundary_tiers)}"
                  + (f", layer internals {kept}" if kept.strip("r") else "")
                  + f" (d=device h=host n=nvme r=recompute); micro-batch {self.mbs} x {cfg.seq_len}, "
                  f"accum {self.accum}; predicted device peak {self.est.peak_bytes / 2**20:.1f} MiB "
                  f"on {cfg.device}"
                  + (f"; 8-bit moments on {plan.moments.count('8bit')} of {len(plan.moments)} units"
                     if plan.moments and "8bit" in plan.moments else ""))
        if self.predicted_step_s is not None and self.hw is not None:
            _log.info(f"predicted step time {self.predicted_step_s:.4g} s on {self.hw.source}")
        self.prompts = sample_prompts(self.eval_set, cfg.eval.prompts, cfg.eval.samples,
                                      self.tokenizer)
        # a run started from another run's checkpoint logs its own steps only
        last = self.state.metrics_row
        self.log.start(self.start_step, last if self.start.source == self.ckpt_dir else None,
                       Progress(cfg.log.progress, self.steps, self.start_step, cfg.log.every),
                       cfg.log.report_to, config_lib.to_dict(cfg))
        if self.state.eval_loss_start is None:  # else the run's first eval, kept by its checkpoints
            self.state = replace(self.state, eval_loss_start=self.evaluate(self.start_step),
                                 eval_loss_start_step=self.start_step)
        self.state = replace(self.state, data_key=self.data.key, schedule=self.schedule.to_json(),
                             rows_per_micro_batch=self.global_rows)
        self.run_info = self._run_info()
        self.files.run_json(self.run_info)
        start_eval = self.state.eval_loss_start
        self.eval_loss = float(last.get("eval_loss", start_eval)) if last else start_eval
        track = cfg.log.track_every if self.lead else 0
        if track and self.store.on_nvme_any():
            track = 0  # its reference is an fp32 copy of every weight: the RAM the tiers saved
            _log.info("log.track_every: per-layer update statistics are off with state on NVMe "
                      "(they keep a RAM copy of every weight)")
        self.tracker = RunTracker(self.out_dir, track,
                                  self.adapter, self.store, self.engine.optimizers,
                                  self.checkpoints.ckpt, self.start_step)
        self.flop_count = FlopCounter(self.adapter, self.engine.shape)
        self.t_start = time.perf_counter()

    def _run_info(self) -> dict[str, Any]:
        cfg, hw = self.cfg, self.hw
        return {
            "format": "layerwise-train-run", "format_version": RUN_FORMAT_VERSION,
            "model": cfg.model.name, "model_path": self.model_path, "family": self.adapter.family,
            "num_params": self.adapter.num_params(), "num_layers": self.adapter.num_layers,
            "device": cfg.device, "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
            "steps": self.steps, "seq_len": cfg.seq_len, "plan": self.plan.source,
            "hardware": None if hw is None else hw.profile.name,
            "hardware_source": None if hw is None else hw.source,
            "predicted_step_s": self.predicted_step_s,
            "predicted_peak_device_bytes": self.est.peak_bytes,
            "eval_loss_start": self.state.eval_loss_start,
            "eval_loss_start_step": self.state.eval_loss_start_step,
            "resumed_from_step": self.start_step or None,
            "resumed_from": None if self.start.source is None else str(self.start.source),
            "world_size": self.ctx.world_size, "schedule": self.schedule.to_json(),
            "config": config_lib.to_dict(cfg), "started_unix_s": round(time.time(), 3),
            "finished": False, "interrupted_at_step": None}

    # ----- the steps --------------------------------------------------------------------------

    def train_step(self, step: int) -> tuple[dict[str, Any], Any]:
        """Optimizer step ``step + 1``: its micro-batches through the engine; its metrics row."""
        lr = self.schedule.lr(step)
        micro = [_rows_of(next(self.batches), self.ctx.rank, self.mbs) for _ in range(self.accum)]
        stats = self.engine.train_step(micro, lr=lr)
        if not math.isfinite(stats.loss):
            raise RuntimeError(f"loss is {stats.loss} at step {step + 1}; lower optimizer.lr")
        self.step_times.append(stats.step_s)
        record = step_record(step + 1, stats, lr, micro,
                              self.flop_count(micro) * self.ctx.world_size,
                              self.predicted_step_s, self.cfg.device,
                              time.perf_counter() - self.t_start, self.ctx.world_size)
        self.tokens_seen += record["tokens"]
        self.step_tokens_per_s.append(record["tokens_per_s"])
        return record, stats

    def evaluate(self, step: int) -> float:
        """The held-out loss (rank 0 alone: every rank would compute the same number from the
        same store), and the sample generations when asked for."""
        with eval_mode(self.adapter):
            loss = self.engine.eval_loss(self.eval_set) if self.lead else math.nan
            if step == self.start_step:
                _log.info(f"step {step}: eval loss {loss:.4f}")
            if self.prompts:
                self.log.sample(step, lambda: [(self.tokenizer.decode(ids), self.tokenizer.decode(
                    greedy_continue(self.engine.forward_logits, ids, self.cfg.eval.sample_tokens,
                                    self.cfg.seq_len))) for ids in self.prompts])
        return loss

    def save(self, step: int, record: dict[str, Any], every_group: bool = False) -> None:
        """A layer-wise checkpoint of ``step`` with the run's state (every rank writes its
        groups; in the background); what it wrote goes into the step's metrics row.
        ``every_group``: all of them, whatever the policy (the last save, an interrupt's)."""
        self.engine.synchronize()  # data parallel: every owner's updates
        rep = self.checkpoints.save(self.state.at(step, step * self.accum, record), every_group)
        record.update(ckpt_groups=len(rep.selected), ckpt_snapshot_bytes=rep.snapshot_bytes,
                      ckpt_snapshot=rep.snapshot, ckpt_blocked_s=rep.blocked_s)

    def fit(self) -> TrainResult:
        """Train from the start step to ``steps``; on SIGINT/SIGTERM save and raise
        ``Interrupted`` with the command that resumes."""
        if self.start.done:
            return self._result_of_finished_run()
        with StopFlag(self.ctx) as stop:
            for step in range(self.start_step, self.steps):
                record, stats = self.train_step(step)
                done = step + 1
                last = done == self.steps
                if due(self.cfg.eval.every, done, last):
                    self.eval_loss = record["eval_loss"] = self.evaluate(done)
                if self.tracker.due(done, last):
                    self.engine.synchronize()  # the step's updates applied: moments, weights
                    self.tracker.observe(done, stats.unit_grad_norms)
                stopping = not last and stop.stop_requested()
                if self.checkpoints.should_save(done, last, stopping):
                    self.save(done, record, every_group=last or stopping)
                self.log.row(record)
                if stopping:
                    self._interrupted(done, stop.signum)
        self.engine.synchronize()
        return self._finish()

    def _interrupted(self, step: int, signum: int) -> None:
        """Stopped after ``step``, which the loop saved whole: close, say how to resume."""
        name = signal.Signals(signum).name
        saved = self.checkpoints.last_saved
        self.close()  # the checkpoint committed, files closed
        self.run_info.update(interrupted_at_step=step)
        self.files.run_json(self.run_info)
        what = (f"checkpoint step {saved} is in {self.ckpt_dir}; resume with: "
                f"{resume_command(self.out_dir)}" if saved is not None else
                "no checkpoint was saved (checkpoints are off), nothing to resume")
        raise Interrupted(f"layerwise train: {name} at step {step} of {self.steps}: stopped; "
                          + what, 128 + signum)

    # ----- the end ----------------------------------------------------------------------------

    def _finish(self) -> TrainResult:
        cfg = self.cfg
        elapsed = max(1e-9, time.perf_counter() - self.t_start)
        self.close(keep_store=True)
        _log.info(timing_summary(self.step_times, self.predicted_step_s, self.plan, self.out_dir,
                                 self.model_path))
        mem = device_mem_reserved(cfg.device)
        if mem is not None:
            _log.info(f"device memory: {mem / 2**20:.1f} MiB reserved at peak (allocator), "
                      f"predicted {self.est.peak_bytes / 2**20:.1f} MiB")
        if cfg.export and cfg.lora.enabled:
            model_dir = export_lora(self.store, self.out_dir, self.model_path, cfg.lora.merge,
                                    self.tokenizer) if self.lead else None
        else:
            model_dir = self.files.export(self.store) if cfg.export else None
        times = self.step_times
        measured = statistics.median(times[1:]) if len(times) > 1 else None
        tps = self.step_tokens_per_s
        per_step = statistics.median(tps[1:] or tps) if tps else 0.0
        wall = self.tokens_seen / elapsed
        self.run_info.update(eval_loss_end=self.eval_loss, measured_step_s=measured,
                             tokens_per_s=per_step, tokens_per_s_wall=wall,
                             device_mem_reserved_bytes=mem, finished=True)
        self.files.run_json(self.run_info)
        return TrainResult(self.out_dir, self.state.eval_loss_start, self.eval_loss, self.steps, per_step,
                           self.est.peak_bytes, model_dir, measured, self.predicted_step_s,
                           self.ctx.rank, tokens_per_s_wall=wall)

    def _result_of_finished_run(self) -> TrainResult:
        info = read_run_json(self.out_dir) or {}
        model = self.out_dir / "model"
        return TrainResult(self.out_dir, info.get("eval_loss_start", math.nan),
                           info.get("eval_loss_end", math.nan), int(info.get("steps", 0)),
                           info.get("tokens_per_s", 0.0),
                           info.get("predicted_peak_device_bytes", 0),
                           model if model.is_dir() else None, info.get("measured_step_s"),
                           info.get("predicted_step_s"), self.ctx.rank, note=self.start.note,
                           tokens_per_s_wall=info.get("tokens_per_s_wall"))

    def close(self, keep_store: bool = False) -> None:
        """Close everything the run opened (idempotent): the outputs, the tracker, the engine,
        and the checkpointer, whose last background write is waited for (its error raised);
        then, unless ``keep_store`` (the export still reads it), the store's NVMe state."""
        try:
            if not self._closed:
                self._closed = True
                self._close_run()
        finally:
            if not keep_store and self.store is not None:
                self.store.close()

    def _close_run(self) -> None:
        try:
            self.log.close()
            if self.tracker is not None:
                self.tracker.close()
            if self.engine is not None:
                self.engine.close()
            if self.checkpoints is not None:
                self.checkpoints.close()
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None


def train(cfg: TrainConfig) -> TrainResult:
    """One process, or one rank of a ``torchrun`` launch (``train/dist``): N ranks of
    ``micro_batch_size`` rows train as one process of N x ``micro_batch_size`` rows would.
    What it says goes to this module's logger (rank 0's only: the others are quiet)."""
    cfg.check()
    ctx = DistContext.from_env(timeout_s=cfg.dist.timeout_s)
    if cfg.device == "auto":
        cuda = torch.cuda.is_available()
        cfg = replace(cfg, device="cuda" if cuda else "cpu")
        if ctx.rank == 0:
            _log.info(f"device=auto: {cfg.device} "
                      + ("(a CUDA GPU is there)" if cuda else "(no CUDA GPU; device=cuda asks for one)"))
    dist_init(ctx, cfg.device)
    trainer = Trainer(cfg, ctx)
    try:
        with quiet_unless(ctx.rank == 0):
            trainer.setup()
            return trainer.fit()
    finally:
        try:
            trainer.close()
        finally:
            dist_shutdown(ctx)
