"""DeepSpeed loops (gloo, CPU) that save layer-wise with ``DeepSpeedCheckpointer`` and resume in
fresh processes, for the DeepSpeed hook's tests.

``make_runs(out)`` runs three sessions of spawned processes, for each stage of ``STAGES``:

1. 2 ranks train to ``END_STEP`` uninterrupted; at ``SAVE_STEP`` they save layer-wise
   (``zero{S}/layerwise``) and DeepSpeed saves its own checkpoint (``zero{S}/deepspeed``, for
   ``zero_to_fp32``). DeepSpeed's gathered view of the full state is kept at both steps
   (``reference_step{N}.pt``).
2. 2 new processes build an engine with other initial weights, load the layer-wise save and
   train on to ``END_STEP`` (``resumed_step{N}.pt``, ``resumed_counters.json``).
3. 1 process loads the 2-rank save (``ws1_step{SAVE_STEP}.pt``).

The first session also trains an HF ``Trainer`` with DeepSpeed ZeRO-3 and the layer-wise callback
(``trainer/``), and records what the live-state map says of tampered partition metadata
(``layout_errors.json``).
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from layerwise.interop.callback import LayerwiseCheckpointCallback
from layerwise.interop.deepspeed_hook import DeepSpeedCheckpointer
from layerwise.interop.zero_live import LiveZeroState
from layerwise.models.registry import FAMILIES
from trainer_helpers import TokenDataset
from zero_helpers import _engine, _free_port, _full_state, _init, _relink, config

WORLD_SIZE = 2
SAVE_STEP, END_STEP = 2, 4
STAGES = (2, 3)
TRAINER_STEPS = 4


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank ``rank``'s batch of ``step``: the same in a resumed run as in an uninterrupted one."""
    return torch.randint(0, 96, (2, 8), generator=torch.Generator().manual_seed(1000 * step + rank))


def train_step(engine, rank: int, step: int) -> float:
    x = batch(rank, step)
    loss = engine(x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _reference(engine, stage: int, path: Path, rank: int) -> None:
    _relink(engine, stage)
    ref = _full_state(engine)
    if rank == 0:
        torch.save(ref, path)


def _layout_errors(engine, stage: int) -> dict[str, str]:
    """What ``LiveZeroState`` says when one parameter's partition metadata is off by one
    element (restored afterwards)."""
    o, out = engine.optimizer, {}
    if stage == 3:
        p = o.fp16_groups[0][1]
        pos = o.grad_position[o.get_param_id(p)]
        pos[1] += 1
        try:
            LiveZeroState(engine.module, o)
        except ValueError as e:
            out["offset"] = str(e)
        pos[1] -= 1
    else:
        m = o.bit16_groups[0][1]._hp_mapping
        addr = m.hp_fragment_address
        m.hp_fragment_address = type(addr)(numel=addr.numel, start=addr.start + 1)
        try:
            LiveZeroState(engine.module, o)
        except ValueError as e:
            out["offset"] = str(e)
        m.hp_fragment_address = addr
    live = LiveZeroState(engine.module, o)
    mine = live.ranges()
    other = {}  # what the other rank holds: the rest of each parameter
    for n, shape in live.shapes.items():
        lo, hi = mine.get(n, (0, 0))
        rest = (hi, math.prod(shape)) if lo == 0 else (0, lo)
        if rest[1] > rest[0]:
            other[n] = rest
    name = next(iter(live.pieces))  # the embedding: rank 0 holds its first elements
    other[name] = (mine[name][1] - 1, math.prod(live.shapes[name]))  # overlaps by one element
    try:
        live.check_cover([mine, other])
    except ValueError as e:
        out["cover"] = str(e)
    return out


def _trainer_run(rank: int, out: Path) -> None:
    """HF Trainer + DeepSpeed ZeRO-3 (2 ranks) with the layer-wise callback, saving every 2
    steps; DeepSpeed's own view of the state at the end (``trainer/reference.pt``)."""
    from accelerate import PartialState
    from transformers import Trainer, TrainingArguments

    # accelerate runs DeepSpeed on CPU only in a state configured beforehand (gloo)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}
    args = TrainingArguments(output_dir=str(out / "hf_out"), max_steps=TRAINER_STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_strategy="no", report_to=[], dataloader_num_workers=0, seed=0,
                             disable_tqdm=True, deepspeed=ds, accelerator_config={"use_configured_state": True})
    torch.manual_seed(0)
    callback = LayerwiseCheckpointCallback(out / "layerwise", every=2)
    trainer = Trainer(model=FAMILIES["llama"].model_class(config()), args=args, train_dataset=TokenDataset(),
                      callbacks=[callback])
    trainer.train()
    _reference(trainer.model_wrapped, 3, out / "reference.pt", rank)
    if rank == 0:
        (out / "saved_steps.json").write_text(json.dumps(callback.saved_steps))
    trainer.model_wrapped.destroy()


def _save_session(rank: int, port: int, out: str) -> None:
    _init(rank, WORLD_SIZE, port)
    for stage in STAGES:
        run = Path(out) / f"zero{stage}"
        run.mkdir(parents=True, exist_ok=True)
        engine = _engine(stage)
        ckpt = DeepSpeedCheckpointer(run / "layerwise", engine)
        for step in range(1, END_STEP + 1):
            train_step(engine, rank, step)
            if step == SAVE_STEP:
                if rank == 0:
                    (run / "layout_errors.json").write_text(json.dumps(_layout_errors(engine, stage)))
                ckpt.save(step)
                engine.save_checkpoint(str(run / "deepspeed"), tag=f"global_step{step}")
            if step in (SAVE_STEP, END_STEP):
                _reference(engine, stage, run / f"reference_step{step}.pt", rank)
        engine.destroy()
    _trainer_run(rank, Path(out) / "trainer")
    dist.destroy_process_group()


def _resume_session(rank: int, port: int, out: str) -> None:
    _init(rank, WORLD_SIZE, port)
    for stage in STAGES:
        run = Path(out) / f"zero{stage}"
        engine = _engine(stage, seed=123)
        ckpt = DeepSpeedCheckpointer(run / "layerwise", engine)
        loaded = ckpt.load()
        if rank == 0:
            (run / "resumed_counters.json").write_text(json.dumps(
                {"step": loaded.step, "global_steps": engine.global_steps,
                 "world_size_saved": loaded.world_size_saved}))
        _reference(engine, stage, run / f"resumed_step{SAVE_STEP}.pt", rank)
        for step in range(loaded.step + 1, END_STEP + 1):
            train_step(engine, rank, step)
        _reference(engine, stage, run / f"resumed_step{END_STEP}.pt", rank)
        engine.destroy()
    dist.destroy_process_group()


def _one_rank_session(rank: int, port: int, out: str) -> None:
    _init(rank, 1, port)
    for stage in STAGES:
        run = Path(out) / f"zero{stage}"
        engine = _engine(stage, seed=123)
        DeepSpeedCheckpointer(run / "layerwise", engine).load()
        _reference(engine, stage, run / f"ws1_step{SAVE_STEP}.pt", rank)
        engine.destroy()
    dist.destroy_process_group()


def make_runs(out: Path) -> Path:
    mp.spawn(_save_session, args=(_free_port(), str(out)), nprocs=WORLD_SIZE)
    mp.spawn(_resume_session, args=(_free_port(), str(out)), nprocs=WORLD_SIZE)
    mp.spawn(_one_rank_session, args=(_free_port(), str(out)), nprocs=1)
    return out
