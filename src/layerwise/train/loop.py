"""The training loop around the StreamingEngine: data, schedule, eval, logging, export."""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import torch

from ..ckpt.checkpointer import Checkpointer, LoadResult
from ..ckpt.store_state import HostStoreStateProvider
from ..engine import EngineConfig, StreamingEngine
from ..engine.batch import Batch
from ..interop.export import export_store
from ..interop.hf_dir import load_store
from ..models import FLAVORS, DecoderAdapter, get_flavor
from ..optim.adamw import AdamWConfig
from ..plan.plan import Plan
from ..store import HostStore, init_store
from ..util.atomic import atomic_write_text
from .data import DataSpec, prepare_data
from .schedule import lr_at
from .tokenizer import check_vocab, load_tokenizer


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
    """``every-K``, ``recompute-all``, ``keep-all``, or a plan JSON file from ``layerwise plan``."""
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
    """Print a progress line every N steps."""
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


@dataclass
class TrainResult:
    out_dir: Path
    eval_loss_start: float
    eval_loss_end: float
    steps: int
    tokens_per_s: float
    peak_device_bytes_predicted: int
    model_dir: Path | None


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.startswith("cuda") else torch.float32
    try:
        return {"float32": torch.float32, "bfloat16": torch.bfloat16}[name]
    except KeyError:
        raise ValueError(f"compute_dtype must be auto, float32 or bfloat16, got {name!r}") from None


def resolve_plan(spec: str, num_layers: int, cfg: TrainConfig) -> Plan:
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
    raise ValueError(f"plan {spec!r} is not every-K, recompute-all, keep-all or a .json plan file")


def build_model(cfg: TrainConfig, compute_dtype: torch.dtype) -> tuple[DecoderAdapter, HostStore]:
    if cfg.model in FLAVORS:
        return init_store(get_flavor(cfg.model).build_config(), seed=cfg.seed,
                          compute_dtype=compute_dtype)
    if Path(cfg.model).is_dir():
        return load_store(cfg.model, compute_dtype=compute_dtype)
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


def train(cfg: TrainConfig, log=print) -> TrainResult:
    out_dir = Path(cfg.out_dir)
    compute_dtype = resolve_dtype(cfg.compute_dtype, cfg.device)
    adapter, store = build_model(cfg, compute_dtype)
    plan = resolve_plan(cfg.plan, adapter.num_layers, cfg)
    tokenizer, tokenizer_line = load_tokenizer(cfg.tokenizer, cfg.model)
    check_vocab(adapter.vocab_size, tokenizer)
    data = prepare_data(DataSpec(
        data=cfg.data, data_format=cfg.data_format, eval_data=cfg.eval_data,
        eval_fraction=cfg.eval_fraction, seq_len=cfg.seq_len, pack=cfg.pack,
        skip_bad=cfg.data_skip_bad, seed=cfg.seed, cache=cfg.data_cache, corpus=cfg.corpus,
        corpus_tokens=cfg.corpus_tokens), tokenizer, out_dir, log)
    cap = None if cfg.device_mem_cap_gb is None else int(cfg.device_mem_cap_gb * 2**30)
    engine = StreamingEngine(adapter, store, plan, EngineConfig(
        device=cfg.device, compute_dtype=compute_dtype, device_mem_cap_bytes=cap,
        optimizer=cfg.optimizer))
    mbs, accum = plan.micro_batch_size, plan.num_micro_batches
    est = engine.check(mbs, cfg.seq_len)
    out_dir.mkdir(parents=True, exist_ok=True)
    plan.save(out_dir / "plan.json")

    ckpt, resumed = None, None
    if cfg.ckpt_every or cfg.resume:

        provider = HostStoreStateProvider(store, engine.optimizers)
        ckpt = Checkpointer(out_dir / "ckpt", provider=provider, policy=cfg.ckpt_policy,
                            **cfg.ckpt_options)
        if cfg.resume and ckpt.has_checkpoint():
            # Weights, AdamW moments and step counts, RNG; the data position and the run's
            # start-of-training eval come back from the checkpoint's state below.
            resumed = ckpt.load()
            log(f"resumed from layer-wise checkpoint step {resumed.step} in {out_dir / 'ckpt'}")
        elif not cfg.ckpt_every:
            ckpt.close()
            ckpt = None
    start_step = resumed.step if resumed is not None else 0
    saved = (resumed.extra or {}) if resumed is not None else {}

    train_iter = data.batches(mbs, seed=cfg.seed, start=_data_position(resumed, accum))
    eval_set = data.eval_set(mbs, cfg.eval_batches, seed=cfg.seed + 1)
    if saved.get("data_key", data.key) != data.key:
        log("warning: the data, tokenizer or data settings differ from the checkpoint's; the "
            "data position now indexes the new data")

    log(f"model {cfg.model}: {adapter.num_params() / 1e6:.1f}M params, {adapter.num_layers} layers "
        f"({adapter.family}); host store {store.nbytes() / 2**20:.0f} MiB")
    for line in [tokenizer_line, *data.summary()]:
        log(line)
    log(f"plan {plan.source}: boundaries {''.join(t[0] for t in plan.boundary_tiers)} "
        f"(d=device h=host n=nvme r=recompute); micro-batch {mbs} x {cfg.seq_len}, accum {accum}; "
        f"predicted device peak {est.peak_bytes / 2**20:.1f} MiB on {cfg.device}")
    if "eval_loss_start" in saved:
        eval_start = float(saved["eval_loss_start"])
    else:
        eval_start = engine.eval_loss(eval_set)
        log(f"step 0: eval loss {eval_start:.4f}")

    last_row = saved.get("metrics_row")
    metrics = _open_metrics(out_dir / "metrics.jsonl", start_step, last_row)
    t_start, tokens_seen = time.perf_counter(), 0
    eval_loss = float(last_row.get("eval_loss", eval_start)) if last_row else eval_start
    try:
        for step in range(start_step, cfg.steps):
            lr = lr_at(step, cfg.optimizer.lr, cfg.warmup_steps, cfg.steps, cfg.min_lr_ratio)
            micro: list[Batch] = [next(train_iter) for _ in range(accum)]
            stats = engine.train_step(micro, lr=lr)
            if not math.isfinite(stats.loss):
                raise RuntimeError(f"loss is {stats.loss} at step {step + 1}; lower the learning rate")
            tokens_seen += stats.tokens
            elapsed = time.perf_counter() - t_start
            record = {"step": step + 1, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
                      "clip_coef": stats.clip_coef, "skipped": stats.skipped,
                      "tokens_per_s": tokens_seen / elapsed, "step_s": stats.step_s}
            last = step + 1 == cfg.steps
            if (cfg.eval_every and (step + 1) % cfg.eval_every == 0) or last:
                eval_loss = engine.eval_loss(eval_set)
                record["eval_loss"] = eval_loss
            if ckpt is not None and cfg.ckpt_every and ((step + 1) % cfg.ckpt_every == 0 or last):
                engine.synchronize()
                rep = ckpt.save(step + 1, data_position=(step + 1) * accum,
                                extra={"eval_loss_start": eval_start, "metrics_row": dict(record),
                                       "data_key": data.key})
                record["ckpt_groups"] = len(rep.selected)
                record["ckpt_blocked_s"] = rep.blocked_s
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if (step + 1) % cfg.log_every == 0 or last or "eval_loss" in record:
                extra = f" eval {record['eval_loss']:.4f}" if "eval_loss" in record else ""
                log(f"step {step + 1}/{cfg.steps}: loss {stats.loss:.4f}{extra} lr {lr:.2e} "
                    f"grad_norm {stats.grad_norm:.2f} {record['tokens_per_s']:.0f} tok/s")
        engine.synchronize()
    finally:
        metrics.close()
        engine.close()
        if ckpt is not None:
            ckpt.close()
    model_dir = None
    if cfg.export:

        model_dir = export_store(store, out_dir / "model", overwrite=True)
        saved_tok = tokenizer.save(model_dir)
        log(f"exported Hugging Face model{' and tokenizer' if saved_tok else ''} to {model_dir}")
    return TrainResult(out_dir, eval_start, eval_loss, cfg.steps,
                       tokens_seen / max(1e-9, time.perf_counter() - t_start), est.peak_bytes,
                       model_dir)
