"""The training loop around the StreamingEngine: data, schedule, eval, logging, export.

What a run writes in ``out_dir`` (schemas in ``docs/formats.md``): ``plan.json`` (the plan, with
the step time predicted for it), ``run.json`` (what ran, start/end evals, measured vs predicted
step time), ``metrics.jsonl`` (one row per step), ``tracker.jsonl`` (per-layer update
statistics, ``update_log.py``), ``ckpt/`` (layer-wise checkpoints) and ``model/`` (the export).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from ..ckpt.checkpointer import LoadResult
from ..ckpt.store_provider import HostStoreStateProvider
from ..engine import EngineConfig, StreamingEngine
from ..engine.batch import Batch
from ..interop.recipes.store_export import export_store
from ..interop.hf.model_dir import load_store
from ..models import FLAVORS, DecoderAdapter, get_flavor
from ..optim.adamw import AdamWConfig
from ..plan.cost import CostModel
from ..plan.hardware import PRESETS
from ..plan.plan import Plan
from ..plan.shape import ModelShape
from ..store import PRIVATE, HostAllocator, HostStore, init_store
from ..util.atomic import atomic_write_text
from ..util.logs import quiet_unless
from .data import DataSpec, prepare_data
from .dist import saving as dist_saving, setup as dist_setup
from .dist.context import DistContext, init as dist_init, shutdown as dist_shutdown
from .dist.reducer import DistReducer
from .planning import (HardwareChoice, auto_plan, check_hardware, check_profile, predict,
                       resolve_hardware)
from .progress import Progress, resolve_progress
from .schedule import lr_at
from .tokenizer import check_vocab, load_tokenizer
from .update_log import RunTracker

_log = logging.getLogger(__name__)

RUN_FORMAT_VERSION = 1
"""``run.json``'s format (docs/formats.md)."""


@dataclass
class TrainConfig:
    model: str = "llama-demo"
    """A flavor name (``layerwise.models.FLAVORS``) or a local Hugging Face model directory."""
    seed: int = 0
    """Seed for initialisation (flavors) and data order."""
    seq_len: int = 128
    """Tokens per sequence."""
    micro_batch_size: int = 8
    """Sequences per micro-batch (a plan file's value wins)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step (a plan file's value wins)."""
    steps: int = 60
    """Optimizer steps."""
    optimizer: AdamWConfig = field(default_factory=lambda: AdamWConfig(lr=2e-3, weight_decay=0.1))
    warmup_steps: int = 5
    """Linear LR warmup steps before the cosine decay."""
    min_lr_ratio: float = 0.1
    """Cosine decay floor, as a fraction of the peak LR."""
    plan: str = "every-2"
    """``every-K``, ``recompute-all``, ``keep-all``, ``auto`` (the planner chooses boundary tiers,
    the micro-batch split of ``micro_batch_size x grad_accum`` sequences and per-unit moments for
    the hardware below) or a plan JSON file from ``layerwise plan``."""
    profile: str | None = None
    """Hardware profile file (``layerwise calibrate --out``) to plan and predict with; default:
    ``out_dir/profile.json`` when it exists."""
    hardware: str | None = None
    """Hardware preset (h200, h100, a100-80g, rtx4090, cpu, ...) when there is no calibrated
    profile; default: this machine (CPU: ``cpu``; CUDA: the preset matching the GPU's name, else
    a quick calibration for ``plan=auto``)."""
    plan_time_limit_s: float = 5.0
    """``plan=auto``: MILP time limit per micro-batch size tried, seconds."""
    device: str = "cpu"
    """``cpu`` or ``cuda[:N]``."""
    compute_dtype: str = "auto"
    """``float32``, ``bfloat16`` or ``auto`` (bf16 on CUDA, fp32 on CPU)."""
    device_mem_cap_gb: float | None = None
    """Refuse plans predicted to need more device memory than this."""
    corpus: str | None = None
    """Directory of ``.py`` text files; default: the Python standard library's source."""
    corpus_tokens: int = 2_000_000
    """Tokens read from the corpus (the last 5% are held out for eval)."""
    tokenizer: str = "auto"
    """``auto`` (the model directory's own tokenizer, else the byte tokenizer), ``byte``, or a
    directory with tokenizer files (loaded with local files only)."""
    data: str | None = None
    """A data file or directory (.jsonl, .json, .parquet, .txt/.md/.py); default: the corpus."""
    data_format: str = "auto"
    """``auto`` (by the fields present), ``text``, ``chat``, ``prompt_completion``, ``instruction``."""
    eval_data: str | None = None
    """Held-out data file or directory (same format); default: ``eval_fraction`` of ``data``."""
    eval_fraction: float = 0.05
    """Fraction of ``data``'s examples held out for eval when ``eval_data`` is not given."""
    pack: bool = True
    """Pack short examples into ``seq_len`` rows (loss never crosses examples; attention does,
    causally); false: one example a row, padded."""
    data_skip_bad: bool = False
    """Skip bad examples (malformed, missing fields, nothing to train on) and report the count,
    instead of stopping with an error naming the file and line."""
    data_cache: bool = True
    """Keep the tokenized data in ``out_dir/data_cache`` so a resumed run does not redo it."""
    eval_every: int = 20
    """Evaluate every N steps (0: only at the start and end)."""
    eval_batches: int = 4
    """Held-out micro-batches per evaluation."""
    log_every: int = 5
    """Print a progress line every N steps (plain-line progress)."""
    progress: str = "auto"
    """``auto`` (a progress bar on a terminal, plain lines otherwise), ``bar`` or ``lines``."""
    track_every: int = 10
    """Per-layer update statistics into ``tracker.jsonl`` every N steps and at the end (0: off)."""
    out_dir: str = "runs/demo"
    """Where metrics.jsonl, the plan and the exported model go."""
    export: bool = True
    """Write the trained model to ``out_dir/model`` as a Hugging Face directory."""
    ckpt_every: int = 0
    """Write a layer-wise checkpoint to ``out_dir/ckpt`` every N steps (0: never)."""
    ckpt_policy: str = "filter"
    """Which groups a checkpoint writes: full, parity, filter, topk, budget."""
    ckpt_options: dict[str, Any] = field(default_factory=dict)
    """Policy options, e.g. {threshold: 1e-3, max_staleness: 4, full_every: 10}."""
    resume: bool = True
    """Continue from the newest checkpoint in ``out_dir/ckpt`` when there is one."""
    dist_timeout_s: float = 600.0
    """Under torchrun: every collective, and every wait for another rank, gives up after this
    many seconds (a dead peer then ends the run with an error instead of a hang)."""
    dist_shm_dir: str = "/dev/shm"
    """Under torchrun: the tmpfs directory holding each node's shared host store while the local
    ranks map it (the files are removed once all have)."""


@dataclass
class TrainResult:
    out_dir: Path
    eval_loss_start: float
    eval_loss_end: float
    steps: int
    tokens_per_s: float
    peak_device_bytes_predicted: int
    model_dir: Path | None
    step_s_measured: float | None = None
    """Median engine step time of the run's steps after its first (None: fewer than 2 steps)."""
    step_s_predicted: float | None = None
    """The simulator's step time for the plan on the run's hardware profile (None: no profile)."""
    rank: int = 0
    """Under torchrun, this process's rank: only rank 0's result has the evals (and the export)."""


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"compute_dtype must be auto, float32 or bfloat16, got {name!r}") from None


def resolve_plan(spec: str, num_layers: int, cfg: TrainConfig) -> Plan:
    """A rule or a plan file as a Plan (``plan=auto`` is ``choose_plan``'s)."""
    kw = dict(micro_batch_size=cfg.micro_batch_size, num_micro_batches=cfg.grad_accum,
              seq_len=cfg.seq_len)
    if spec.startswith("every-"):
        try:
            k = int(spec.split("-", 1)[1])
        except ValueError:
            raise ValueError(f"plan {spec!r}: expected every-K with an integer K") from None
        return Plan.every_k(num_layers, k, **kw)
    if spec == "recompute-all":
        return Plan.recompute_all(num_layers, **kw)
    if spec == "keep-all":
        return Plan.keep_all(num_layers, **kw)
    if Path(spec).suffix == ".json":
        plan = Plan.load(spec)
        plan.validate(num_layers)
        return plan
    raise ValueError(f"plan {spec!r} is not every-K, recompute-all, keep-all, auto or a .json "
                     "plan file")


def _mem_cap_bytes(cfg: TrainConfig) -> int | None:
    return None if cfg.device_mem_cap_gb is None else int(cfg.device_mem_cap_gb * 2**30)


def choose_plan(cfg: TrainConfig, adapter: DecoderAdapter,
                compute_dtype: torch.dtype) -> tuple[Plan, HardwareChoice | None]:
    """The run's plan and the hardware profile its prediction is for (``train/planning.py``).

    ``plan=auto`` asks the planner; a rule or a plan file is simulated on the resolved profile.
    Either way ``plan.predicted["step_s"]`` is the predicted step time (absent only for a rule
    or file when no profile resolves without calibrating: a GPU no preset matches)."""
    auto = cfg.plan == "auto"
    plan = None if auto else resolve_plan(cfg.plan, adapter.num_layers, cfg)
    if auto and cfg.micro_batch_size * cfg.grad_accum < 1:
        raise ValueError("plan=auto needs micro_batch_size x grad_accum >= 1 sequences per step")
    hw = resolve_hardware(cfg.profile, cfg.hardware, cfg.device, Path(cfg.out_dir), compute_dtype,
                          _mem_cap_bytes(cfg), may_calibrate=auto)
    shape = ModelShape.from_config(adapter.config, name=Path(cfg.model).name)
    if auto:
        assert hw is not None
        plan = auto_plan(shape, hw, cfg.seq_len, cfg.micro_batch_size * cfg.grad_accum,
                         cfg.plan_time_limit_s)
    elif hw is not None:
        assert plan is not None
        before = dict(plan.predicted)
        plan.predicted = predict(plan, shape, hw, cfg.seq_len)
        if before:  # a plan file's own predictions, for the machine it was planned for
            plan.predicted["planned_for"] = before
    assert plan is not None
    return plan, hw


def build_model(cfg: TrainConfig, compute_dtype: torch.dtype, alloc: HostAllocator = PRIVATE
                ) -> tuple[DecoderAdapter, HostStore]:
    """Every local rank builds the same weights into the node's shared store (identical writes,
    before the store-ready barrier), so no rank needs to know which one wrote them."""
    if cfg.model in FLAVORS:
        return init_store(get_flavor(cfg.model).build_config(), seed=cfg.seed,
                          compute_dtype=compute_dtype, alloc=alloc)
    if Path(cfg.model).is_dir():
        return load_store(cfg.model, compute_dtype=compute_dtype, alloc=alloc)
    raise ValueError(f"model {cfg.model!r} is neither a known flavor ({', '.join(sorted(FLAVORS))}) "
                     "nor a local Hugging Face model directory")


def _data_position(resumed: LoadResult | None, accum: int) -> int:
    """Micro-batches of the training stream already consumed (0 for a fresh run)."""
    if resumed is None:
        return 0
    if resumed.data_position is None:  # a checkpoint written by another loop: one step = accum
        return resumed.step * accum
    return int(resumed.data_position)


def _open_metrics(path: Path, resumed_step: int, resumed_row: dict | None) -> TextIO:
    """``metrics.jsonl`` for appending. A fresh run starts it empty. A resumed run keeps the
    rows up to the step it resumed from and drops the rest: a killed run may have logged steps
    whose checkpoint never committed, and a line cut by the kill. The resumed step's own row,
    when the kill came before it was logged, is put back from the checkpoint."""
    if not resumed_step:
        return open(path, "w")
    kept, have_resumed = [], False
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            step = json.loads(line)["step"]
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
        if step <= resumed_step:
            kept.append(line + "\n")
            have_resumed |= step == resumed_step
    if resumed_row is not None and not have_resumed:
        kept.append(json.dumps(resumed_row) + "\n")
    atomic_write_text(path, "".join(kept))
    return open(path, "a")


def check_options(cfg: TrainConfig) -> None:
    """Cheap checks of the run's options, before the model is built (which can take minutes)."""
    resolve_progress(cfg.progress)
    if cfg.track_every < 0:
        raise ValueError(f"track_every must be >= 0 (0: no tracker), got {cfg.track_every}")
    if Path(cfg.plan).suffix == ".json":
        Plan.load(cfg.plan)  # a missing or malformed plan file's own error
    elif cfg.plan != "auto":
        resolve_plan(cfg.plan, 1, cfg)  # a malformed rule's own error
    check_profile(cfg.profile)
    check_hardware(cfg.hardware)


class _FlopCounter:
    """Model FLOPs of a step (forward + backward, no recompute: ``CostModel.model_flops``)."""

    def __init__(self, shape: ModelShape):
        self.shape, self._per_mb = shape, {}

    def __call__(self, micro: list[Batch]) -> float:
        total = 0.0
        for mb in micro:
            key = tuple(mb.input_ids.shape)
            if key not in self._per_mb:
                self._per_mb[key] = CostModel(self.shape, PRESETS["cpu"], *key).model_flops()
            total += self._per_mb[key]
        return total


def _device_mem_reserved(device: str) -> int | None:
    """Peak bytes the CUDA caching allocator reserved (None on CPU)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_reserved(torch.device(device)))
    return None


def _step_record(step: int, stats, lr: float, micro: list[Batch], flops: float,
                 predicted_step_s: float | None, device: str, elapsed_s: float,
                 world_size: int = 1) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of a step (before eval and checkpoint add theirs); tokens and
    FLOPs of all ranks (every rank's micro-batches have the same shape)."""
    tokens = sum(mb.input_ids.numel() for mb in micro) * world_size
    secs = max(stats.step_s, 1e-9)
    rec: dict[str, Any] = {
        "step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
        "clip_coef": stats.clip_coef, "skipped": stats.skipped, "tokens": tokens,
        "target_tokens": stats.tokens, "tokens_per_s": tokens / secs,
        "tflops": flops / secs / 1e12, "step_s": stats.step_s,
        "predicted_step_s": predicted_step_s, "elapsed_s": elapsed_s}
    mem = _device_mem_reserved(device)
    if mem is not None:
        rec["device_mem_reserved_bytes"] = mem
    return rec


def _write_run_json(out_dir: Path, info: dict[str, Any]) -> None:
    atomic_write_text(out_dir / "run.json", json.dumps(info, indent=2) + "\n")


def _timing_summary(step_times: list[float], predicted: float | None, plan: Plan) -> str:
    measured = statistics.median(step_times[1:]) if len(step_times) > 1 else None
    text = "step time: measured " + (f"{measured:.4g} s (median of {len(step_times) - 1} steps "
                                     "after the first)" if measured else "n/a (under 2 steps)")
    if predicted:
        hw = plan.predicted.get("hardware_source") or plan.predicted.get("hardware")
        text += f", predicted {predicted:.4g} s for plan {plan.source} on {hw}"
        if measured:
            text += f": measured / predicted {measured / predicted:.2f}"
    return text


def _data_start(resumed: LoadResult | None, accum: int, global_rows: int) -> int:
    """The first global micro-batch (of ``global_rows`` rows) to train on. A checkpoint written
    with another world size or micro-batch counted micro-batches of its own size: its position
    is converted through rows (rounded down when the sizes do not divide)."""
    start = _data_position(resumed, accum)
    saved_rows = ((resumed.extra or {}).get("data_rows_per_micro_batch")
                  if resumed is not None else None)
    if not saved_rows or saved_rows == global_rows:
        return start
    rows = start * int(saved_rows)
    if rows % global_rows:
        _log.warning(f"warning: the checkpoint consumed {rows} rows, not a multiple of this "
                     f"run's {global_rows} rows per micro-batch; {rows % global_rows} rows are "
                     "skipped")
    return rows // global_rows


def train(cfg: TrainConfig) -> TrainResult:
    """One process, or one rank of a ``torchrun`` launch (``train/dist``): N ranks of
    ``micro_batch_size`` rows train as one process of N x ``micro_batch_size`` rows would.
    What it says goes to this module's logger (rank 0's only: the others are quiet)."""
    check_options(cfg)
    ctx = DistContext.from_env(timeout_s=cfg.dist_timeout_s)
    dist_init(ctx, cfg.device)
    try:
        with quiet_unless(ctx.rank == 0):
            return _train(cfg, ctx)
    finally:
        dist_shutdown(ctx)


def _train(cfg: TrainConfig, ctx: DistContext) -> TrainResult:
    lead = ctx.rank == 0  # alone logs, writes run.json, metrics, the plan, the export, and
    # commits checkpoints (every rank writes its own groups of them)
    out_dir = Path(cfg.out_dir)
    compute_dtype = resolve_dtype(cfg.compute_dtype, cfg.device)
    alloc = dist_setup.host_allocator(ctx, cfg.dist_shm_dir)
    try:
        adapter, store = build_model(cfg, compute_dtype, alloc)
        plan, hw = dist_setup.decided_by_rank0(
            ctx, lambda: choose_plan(cfg, adapter, compute_dtype), "sharing the plan")
        flags = alloc.zeros(len(store.units), torch.int64) if ctx.enabled else None
        engine = StreamingEngine(adapter, store, plan, EngineConfig(
            device=cfg.device, compute_dtype=compute_dtype,
            device_mem_cap_bytes=_mem_cap_bytes(cfg), optimizer=cfg.optimizer),
            reducer=DistReducer(ctx, store, flags) if ctx.enabled else None)
        dist_setup.store_ready(ctx, alloc)
    except BaseException:
        if ctx.enabled:
            alloc.unlink()
        raise
    predicted_step_s = plan.predicted.get("step_s")
    tokenizer, tokenizer_line = load_tokenizer(cfg.tokenizer, cfg.model)
    check_vocab(adapter.vocab_size, tokenizer)
    data = dist_setup.first_then_others(ctx, lambda: prepare_data(DataSpec(
        data=cfg.data, data_format=cfg.data_format, eval_data=cfg.eval_data,
        eval_fraction=cfg.eval_fraction, seq_len=cfg.seq_len, pack=cfg.pack,
        skip_bad=cfg.data_skip_bad, seed=cfg.seed, cache=cfg.data_cache, corpus=cfg.corpus,
        corpus_tokens=cfg.corpus_tokens), tokenizer, out_dir), "preparing the data")
    mbs, accum = plan.micro_batch_size, plan.num_micro_batches
    global_rows = mbs * ctx.world_size
    """Rows of a global micro-batch: rank r trains on rows [r*mbs, (r+1)*mbs) of each."""
    est = engine.check(mbs, cfg.seq_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    if lead:
        plan.save(out_dir / "plan.json")

    ckpt = None
    if cfg.ckpt_every or (cfg.resume and ctx.local_rank == 0):
        provider = HostStoreStateProvider(store, engine.optimizers)
        # the run's tracker.jsonl is written by RunTracker (with the engine's gradient norms)
        ckpt = dist_saving.checkpointer(ctx, out_dir / "ckpt", provider, store,
                                        bool(cfg.ckpt_every), policy=cfg.ckpt_policy,
                                        **{"tracker_log": False, **cfg.ckpt_options})
    # Weights, AdamW moments and step counts, RNG; the data position and the run's
    # start-of-training eval come back from the checkpoint's state below.
    resumed = dist_setup.resume(ctx, ckpt, cfg.resume, engine.optimizers, store)
    if resumed is not None:
        _log.info(f"resumed from layer-wise checkpoint step {resumed.step} in {out_dir / 'ckpt'}")
    if ckpt is not None and not cfg.ckpt_every and (not lead or resumed is None):
        ckpt.close()
        ckpt = None
    start_step = resumed.step if resumed is not None else 0
    saved = (resumed.extra or {}) if resumed is not None else {}

    global_iter = data.batches(global_rows, seed=cfg.seed,
                               start=_data_start(resumed, accum, global_rows))
    # the global micro-batches' rows, in pieces of this rank's size (its device's plan)
    eval_set = [_rows_of(b, r, mbs) for b in data.eval_set(global_rows, cfg.eval_batches,
                                                           seed=cfg.seed + 1)
                for r in range(-(-b.input_ids.shape[0] // mbs))]
    if saved.get("data_key", data.key) != data.key:
        _log.warning("warning: the data, tokenizer or data settings differ from the "
                     "checkpoint's; the data position now indexes the new data")

    _log.info(f"model {cfg.model}: {adapter.num_params() / 1e6:.1f}M params, "
              f"{adapter.num_layers} layers ({adapter.family}); host store "
              f"{store.nbytes() / 2**20:.0f} MiB"
              + (f"; data parallel over {ctx.world_size} ranks ({ctx.num_nodes} node(s) x "
                 f"{ctx.local_world_size}), one shared store per node" if ctx.enabled else ""))
    for line in [tokenizer_line, *data.summary()]:
        _log.info(line)
    _log.info(f"plan {plan.source}: boundaries {''.join(t[0] for t in plan.boundary_tiers)} "
              f"(d=device h=host n=nvme r=recompute); micro-batch {mbs} x {cfg.seq_len}, "
              f"accum {accum}; predicted device peak {est.peak_bytes / 2**20:.1f} MiB on "
              f"{cfg.device}"
              + (f"; 8-bit moments on {plan.moments.count('8bit')} of {len(plan.moments)} units"
                 if plan.moments and "8bit" in plan.moments else ""))
    if predicted_step_s is not None and hw is not None:
        _log.info(f"predicted step time {predicted_step_s:.4g} s on {hw.source}")
    # eval runs on rank 0 alone: every rank would compute the same number from the same store
    if "eval_loss_start" in saved:
        eval_start = float(saved["eval_loss_start"])
    else:
        eval_start = engine.eval_loss(eval_set) if lead else math.nan
        _log.info(f"step 0: eval loss {eval_start:.4f}")
    run_info: dict[str, Any] = {
        "format": "layerwise-train-run", "format_version": RUN_FORMAT_VERSION,
        "model": cfg.model, "family": adapter.family, "num_params": adapter.num_params(),
        "num_layers": adapter.num_layers, "device": cfg.device,
        "compute_dtype": str(compute_dtype).removeprefix("torch."), "steps": cfg.steps,
        "seq_len": cfg.seq_len, "plan": plan.source,
        "hardware": None if hw is None else hw.profile.name,
        "hardware_source": None if hw is None else hw.source,
        "predicted_step_s": predicted_step_s, "predicted_peak_device_bytes": est.peak_bytes,
        "eval_loss_start": eval_start, "resumed_from_step": start_step or None,
        "world_size": ctx.world_size, "finished": False}
    if lead:
        _write_run_json(out_dir, run_info)

    last_row = saved.get("metrics_row")
    metrics = _open_metrics(out_dir / "metrics.jsonl", start_step, last_row) if lead else None
    tracker = RunTracker(out_dir, cfg.track_every if lead else 0, adapter, store,
                         engine.optimizers, ckpt, start_step)
    flop_count = _FlopCounter(ModelShape.from_config(adapter.config))
    progress = Progress(cfg.progress if lead else "lines", cfg.steps, start_step, cfg.log_every)
    t_start, tokens_seen, step_times = time.perf_counter(), 0, []
    eval_loss = float(last_row.get("eval_loss", eval_start)) if last_row else eval_start
    try:
        for step in range(start_step, cfg.steps):
            lr = lr_at(step, cfg.optimizer.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
            micro: list[Batch] = [_rows_of(next(global_iter), ctx.rank, mbs) for _ in range(accum)]
            stats = engine.train_step(micro, lr=lr)
            if not math.isfinite(stats.loss):
                raise RuntimeError(f"loss is {stats.loss} at step {step + 1}; lower the learning rate")
            tokens_seen += stats.tokens
            step_times.append(stats.step_s)
            record = _step_record(step + 1, stats, lr, micro, flop_count(micro) * ctx.world_size,
                                  predicted_step_s, cfg.device, time.perf_counter() - t_start,
                                  ctx.world_size)
            last = step + 1 == cfg.steps
            if lead and ((cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last):
                eval_loss = engine.eval_loss(eval_set)
                record["eval_loss"] = eval_loss
            if tracker.due(step + 1, last):
                engine.synchronize()  # the step's updates applied: moments and weights current
                tracker.observe(step + 1, stats.unit_grad_norms)
            if ckpt is not None and cfg.ckpt_every and ((step + 1) % cfg.ckpt_every == 0 or last):
                engine.synchronize()  # data parallel: every owner's updates
                with dist_saving.peer_failures(ctx, f"checkpointing step {step + 1}"):
                    rep = ckpt.save(step + 1, data_position=(step + 1) * accum, extra={
                        "eval_loss_start": eval_start, "metrics_row": dict(record),
                        "data_key": data.key, "data_rows_per_micro_batch": global_rows})
                record["ckpt_groups"] = len(rep.selected)
                record["ckpt_snapshot_bytes"] = rep.snapshot_bytes
                record["ckpt_blocked_s"] = rep.blocked_s
            if metrics is not None:
                metrics.write(json.dumps(record) + "\n")
                metrics.flush()
                progress.step(record)
        engine.synchronize()
    finally:
        progress.close()
        tracker.close()
        if metrics is not None:
            metrics.close()
        engine.close()
        if ckpt is not None:
            with dist_saving.peer_failures(ctx, "writing the last checkpoint"):
                ckpt.close()
    elapsed = max(1e-9, time.perf_counter() - t_start)
    _log.info(_timing_summary(step_times, predicted_step_s, plan))
    mem = _device_mem_reserved(cfg.device)
    if mem is not None:
        _log.info(f"device memory: {mem / 2**20:.1f} MiB reserved at peak (allocator), "
                  f"predicted {est.peak_bytes / 2**20:.1f} MiB")
    model_dir = None
    if cfg.export and lead:
        model_dir = export_store(store, out_dir / "model", overwrite=True)
        saved_tok = tokenizer.save(model_dir)
        _log.info(f"exported Hugging Face model{' and tokenizer' if saved_tok else ''} to "
                  f"{model_dir}")
    measured = statistics.median(step_times[1:]) if len(step_times) > 1 else None
    run_info.update(eval_loss_end=eval_loss, measured_step_s=measured,
                    tokens_per_s=tokens_seen / elapsed, device_mem_reserved_bytes=mem,
                    finished=True)
    if lead:
        _write_run_json(out_dir, run_info)
    return TrainResult(out_dir, eval_start, eval_loss, cfg.steps, tokens_seen / elapsed,
                       est.peak_bytes, model_dir, measured, predicted_step_s, ctx.rank)


def _rows_of(global_mb: Batch, rank: int, rows: int) -> Batch:
    """Rank ``rank``'s share of a global micro-batch (the whole of it in one process)."""
    if global_mb.input_ids.shape[0] == rows and rank == 0:
        return global_mb
    sl = slice(rank * rows, (rank + 1) * rows)
    return Batch(global_mb.input_ids[sl].contiguous(), global_mb.labels[sl].contiguous())
