"""Real DeepSpeed ZeRO checkpoints of a tiny Llama, made on CPU (gloo, 2 ranks), for the tests.

One spawned session trains the same model under ZeRO stages 1, 2 and 3 and saves each at steps
``SAVE_STEPS``. Beside each save it keeps DeepSpeed's own view of the full state
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, gathered across ranks) as
``reference_step{N}.pt``: what a reader of the files must reproduce.

Then, in the same session (a DeepSpeed start costs tens of seconds), rank 0 merges a recipe of
the two saves (layers below ``NUM_LAYERS // 2`` from the first, the rest from the second) with
``merge --format deepspeed``; every rank loads it with DeepSpeed's own ``load_checkpoint`` into
a fresh engine and keeps what DeepSpeed then holds (``resumed.pt``) and the loss of one more
step (``resumed_loss.json``).

The same loops also save layer-wise through the DeepSpeed hook at step ``SAVE_STEPS[0]``
(``zero{stage}/layerwise``, every rank its own pieces; what the live-state map says of tampered
partition metadata in ``layout_errors.json``), and an HF ``Trainer`` with DeepSpeed ZeRO-3 and
the layer-wise callback runs in the same session (``trainer/``). Afterwards, fresh processes
load the layer-wise save into an engine with other initial weights and train on to the last
step (``lw_resumed_step{N}.pt``); one process loads it at world size 1
(``ws1/zero{stage}/lw_loaded_step{N}.pt``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import yaml
from accelerate import PartialState
from transformers import Trainer, TrainingArguments

import multiproc
from layerwise.interop.hooks.trainer_callback import LayerwiseCheckpointCallback
from layerwise.interop.hooks.deepspeed_loop import DeepSpeedCheckpointer
from layerwise.interop.recipes.merge import merge
from layerwise.interop.recipes.recipe import load_recipe
from layerwise.interop.hf.trainer_checkpoint import trainer_param_groups
from layerwise.interop.hooks.zero_partitions import LiveZeroState
from layerwise.models.registry import FAMILIES, get_flavor
from trainer_helpers import TokenDataset

SAVE_STEPS = (2, 4)
WORLD_SIZE = 2
NUM_LAYERS = 4
LW_STEP = SAVE_STEPS[0]
"""The step the loops also save layer-wise (through the DeepSpeed hook)."""
TRAINER_STEPS = 4


BIG_LAYERS = 8


def big_config():
    """For the memory test: 8 layers of ~1.6M parameters (~20 MB a group with both moments)."""
    return get_flavor("llama-debug").build_config(num_hidden_layers=BIG_LAYERS, hidden_size=513, head_dim=8,
                                                  num_attention_heads=3, num_key_value_heads=1,
                                                  intermediate_size=1025)


def config():
    """Odd sizes (hidden 33, MLP 65), so parameters do not split evenly over 2 ranks: ZeRO pads."""
    return get_flavor("llama-debug").build_config(num_hidden_layers=NUM_LAYERS, hidden_size=33, head_dim=8,
                                                  num_attention_heads=3, num_key_value_heads=1,
                                                  intermediate_size=65)


def recipe(run: Path) -> dict:
    half = NUM_LAYERS // 2
    return {"slices": [
        {"sources": [{"model": str(run / f"global_step{SAVE_STEPS[0]}"), "layer_range": [0, half]}]},
        {"sources": [{"model": str(run / f"global_step{SAVE_STEPS[1]}"), "layer_range": [half, NUM_LAYERS]}]}]}


def _full_state(engine) -> dict:
    """DeepSpeed's own gathered view of every parameter's fp32 master and moments."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    return {n: {"param": safe_get_full_fp32_param(p).clone(),
                "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
            for n, p in engine.module.named_parameters()}


def _relink(engine, stage: int) -> None:
    if stage < 3:
        # DeepSpeed 0.19 links each parameter to its moments after the first group's step only,
        # before the second group has any; link again so safe_get_full_optimizer_state works.
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()


def _engine(stage: int, model_config=None, seed: int = 0):
    import deepspeed

    torch.manual_seed(seed)
    model = FAMILIES["llama"].model_class(model_config or config())
    named = dict(model.named_parameters())
    decay, no_decay = trainer_param_groups(model)
    groups = [{"params": [named[n] for n in decay], "weight_decay": 0.1},
              {"params": [named[n] for n in no_decay], "weight_decay": 0.0}]
    ds_config = {
        "train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
        "zero_optimization": {"stage": stage},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "betas": [0.8, 0.95], "torch_adam": True}},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    return engine


def _train_step(engine, gen) -> float:
    x = torch.randint(0, 96, (2, 8), generator=gen)
    loss = engine(x, labels=x).loss
    engine.backward(loss)
    engine.step()
    return float(loss)


def _init() -> None:
    """DeepSpeed's process group, from the launch's torchrun variables (``multiproc``; the fork
    server imported DeepSpeed with ``DS_ACCELERATOR=cpu``)."""
    import deepspeed
    # DeepSpeed's shared-memory all-reduce kernel only speeds up CPU collectives; without it
    # DeepSpeed uses gloo and skips a C++ build of a minute or more.
    # (``deepspeed.comm.torch`` as an attribute is the torch package, re-exported: go by module name.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")


def _batches(rank: int, done: int = 0) -> torch.Generator:
    """Rank ``rank``'s batch generator, past the batches of the first ``done`` steps."""
    gen = torch.Generator().manual_seed(rank)
    for _ in range(done):
        torch.randint(0, 96, (2, 8), generator=gen)
    return gen


def _worker(rank: int, out: str, stages: tuple[int, ...]) -> None:
    _init()
    for stage in stages:
        engine = _engine(stage)
        gen = _batches(rank)
        save_dir = Path(out) / f"zero{stage}"
        layerwise = DeepSpeedCheckpointer(save_dir / "layerwise", engine)
        for step in range(1, max(SAVE_STEPS) + 1):
            _train_step(engine, gen)
            if step == LW_STEP:
                if rank == 0:
                    (save_dir / "layout_errors.json").write_text(json.dumps(_layout_errors(engine, stage)))
                layerwise.save(step)
            if step in SAVE_STEPS:
                engine.save_checkpoint(str(save_dir), tag=f"global_step{step}")
                _relink(engine, stage)
                ref = _full_state(engine)
                if rank == 0:
                    torch.save(ref, save_dir / f"reference_step{step}.pt")
        if rank == 0:
            (save_dir / "config.json").write_text(json.dumps(config().to_dict()))
        engine.destroy()

        merged = save_dir / "merged"
        if rank == 0:
            (save_dir / "recipe.yaml").write_text(yaml.safe_dump(recipe(save_dir)))
            merge(load_recipe(save_dir / "recipe.yaml").open(), merged, format="deepspeed")
        dist.barrier()
        engine = _engine(stage)
        engine.load_checkpoint(str(merged))
        _relink(engine, stage)
        resumed = _full_state(engine)
        loss = _train_step(engine, torch.Generator().manual_seed(100 + rank))
        if rank == 0:
            torch.save(resumed, save_dir / "resumed.pt")
            (save_dir / "resumed_loss.json").write_text(json.dumps({"loss": loss}))
        engine.destroy()

        one_rank = Path(out) / "ws1" / f"zero{stage}" / f"global_step{WS1_STEPS[1]}"
        if one_rank.is_dir():  # world size 1 -> 2: into this run's own step-2 save as the template
            if rank == 0:
                merge(one_rank, save_dir / "from_ws1", format="deepspeed",
                      template=save_dir / f"global_step{SAVE_STEPS[0]}")
            dist.barrier()
            engine = _engine(stage)
            engine.load_checkpoint(str(save_dir / "from_ws1"))
            _relink(engine, stage)
            resumed = _full_state(engine)
            if rank == 0:
                torch.save(resumed, save_dir / "resumed_from_ws1.pt")
            engine.destroy()

    engine = _engine(3, big_config())  # one stage-3 save of the bigger model, for the memory test
    _train_step(engine, torch.Generator().manual_seed(rank))
    engine.save_checkpoint(str(Path(out) / "big"), tag="global_step1")
    if rank == 0:
        (Path(out) / "big" / "config.json").write_text(json.dumps(big_config().to_dict()))
    engine.destroy()
    _trainer_run(rank, Path(out) / "trainer")


def _keep(engine, stage: int, rank: int, path: Path) -> None:
    """DeepSpeed's gathered view of the state, saved by rank 0 (a collective)."""
    _relink(engine, stage)
    state = _full_state(engine)
    if rank == 0:
        torch.save(state, path)


def _layout_errors(engine, stage: int) -> dict[str, str]:
    """What ``LiveZeroState`` says when one parameter's partition metadata is off by one element
    (put back afterwards), and when another rank's piece overlaps this rank's by one element."""
    o, out = engine.optimizer, {}
    if stage == 3:
        pos = o.grad_position[o.get_param_id(o.fp16_groups[0][1])]
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
    """HF Trainer + DeepSpeed ZeRO-3 (2 ranks) with the layer-wise callback saving every 2
    steps; DeepSpeed's own view of the state at the end (``reference.pt``)."""
    # accelerate runs DeepSpeed on the CPU only in a state configured beforehand (gloo)
    os.environ["ACCELERATE_USE_DEEPSPEED"] = "true"
    PartialState(backend="gloo")
    del os.environ["ACCELERATE_USE_DEEPSPEED"]
    ds = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_clipping": "auto",
          "zero_optimization": {"stage": 3},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}
    args = TrainingArguments(output_dir=str(out / "hf_out"), max_steps=TRAINER_STEPS, per_device_train_batch_size=2,
                             learning_rate=1e-2, save_strategy="no", report_to=[], dataloader_num_workers=0,
                             seed=0, disable_tqdm=True, deepspeed=ds,
                             accelerator_config={"use_configured_state": True})
    torch.manual_seed(0)
    callback = LayerwiseCheckpointCallback(out / "layerwise", policy="full", every=2)
    trainer = Trainer(model=FAMILIES["llama"].model_class(config()), args=args, train_dataset=TokenDataset(),
                      callbacks=[callback])
    trainer.train()
    _relink(trainer.model_wrapped, 3)
    ref = _full_state(trainer.model_wrapped)
    if rank == 0:
        torch.save(ref, out / "reference.pt")
        (out / "saved_steps.json").write_text(json.dumps(callback.saved_steps))
    trainer.model_wrapped.destroy()


def _layerwise_resume(rank: int, out: str, stages: tuple[int, ...]) -> None:
    """Fresh processes load each stage's layer-wise save into an engine with other initial
    weights and train on to the last step, keeping DeepSpeed's view after the load and at the
    end (``lw_resumed_step{N}.pt``) and the engine's counters (``lw_resumed_counters.json``)."""
    _init()
    for stage in stages:
        run = Path(out) / f"zero{stage}"
        engine = _engine(stage, seed=123)
        loaded = DeepSpeedCheckpointer(run / "layerwise", engine).load()
        if rank == 0:
            (run / "lw_resumed_counters.json").write_text(json.dumps(
                {"step": loaded.step, "global_steps": engine.global_steps,
                 "world_size_saved": loaded.world_size_saved}))
        _keep(engine, stage, rank, run / f"lw_resumed_step{loaded.step}.pt")
        gen = _batches(rank, done=loaded.step)
        for _ in range(loaded.step, max(SAVE_STEPS)):
            _train_step(engine, gen)
        _keep(engine, stage, rank, run / f"lw_resumed_step{max(SAVE_STEPS)}.pt")
        engine.destroy()


WS1_STEPS = (1, 3)
"""The 1-rank run's saves: step 1 is the template a 2-rank save is merged into (2 -> 1), step 3
the save merged into the 2-rank run's template (1 -> 2)."""


def _one_rank_saves(rank: int, out: str, stages: tuple[int, ...]) -> None:
    """Before the 2-rank session: a 1-rank run of each stage, saved at ``WS1_STEPS``."""
    _init()
    for stage in stages:
        run = Path(out) / "ws1" / f"zero{stage}"
        engine = _engine(stage)
        gen = torch.Generator().manual_seed(7)
        for step in range(1, max(WS1_STEPS) + 1):
            _train_step(engine, gen)
            if step in WS1_STEPS:
                engine.save_checkpoint(str(run), tag=f"global_step{step}")
                _relink(engine, stage)
                torch.save(_full_state(engine), run / f"reference_step{step}.pt")
        (run / "config.json").write_text(json.dumps(config().to_dict()))
        engine.destroy()


def _one_rank_resume(rank: int, out: str, stages: tuple[int, ...]) -> None:
    """World size 2 -> 1: the 2-rank step-4 save merged into the 1-rank run's step-1 template,
    loaded by DeepSpeed at world size 1 (``ws1/zero{stage}/resumed.pt``)."""
    _init()
    for stage in stages:
        run = Path(out) / "ws1" / f"zero{stage}"
        source = Path(out) / f"zero{stage}" / f"global_step{SAVE_STEPS[1]}"
        merge(source, run / "merged", format="deepspeed", template=run / f"global_step{WS1_STEPS[0]}")
        engine = _engine(stage)
        engine.load_checkpoint(str(run / "merged"))
        _relink(engine, stage)
        torch.save(_full_state(engine), run / "resumed.pt")
        engine.destroy()
        # the 2-rank run's layer-wise save (step LW_STEP), loaded at world size 1
        engine = _engine(stage, seed=123)
        DeepSpeedCheckpointer(Path(out) / f"zero{stage}" / "layerwise", engine).load()
        _keep(engine, stage, rank, run / f"lw_loaded_step{LW_STEP}.pt")
        engine.destroy()


def make_zero_checkpoints(out: Path, stages: tuple[int, ...] = (1, 2, 3)) -> Path:
    """``out/zero{stage}/global_step{N}`` for each stage, with references and config.json, the
    2-rank merge-and-resume of each, and (stages 2 and 3) world size 1 -> 2 and 2 -> 1; the
    layer-wise saves of the same loops, resumed by fresh processes (and, stages 2 and 3, loaded
    at world size 1); the Trainer run (``out/trainer``)."""
    resharded = tuple(s for s in stages if s >= 2)
    for fn, args, world in ((_one_rank_saves, resharded, 1), (_worker, stages, WORLD_SIZE),
                            (_layerwise_resume, stages, WORLD_SIZE),
                            (_one_rank_resume, resharded, 1)):
        multiproc.run(fn, (str(out), args), world, log=out / fn.__name__.strip("_"), timeout_s=900)
    return out
