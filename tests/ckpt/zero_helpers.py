"""Real DeepSpeed ZeRO checkpoints of a tiny Llama, made on CPU (gloo, 2 ranks), for the tests.

One spawned session trains the same model under ZeRO stages 1, 2 and 3 and saves each at steps
``SAVE_STEPS``. Beside each save it keeps DeepSpeed's own view of the full state
(``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``, gathered across ranks) as
``reference_step{N}.pt``: what a reader of the files must reproduce.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp

from layerwise.interop.trainer import trainer_param_groups
from layerwise.models.registry import FAMILIES, get_flavor

SAVE_STEPS = (2, 4)
WORLD_SIZE = 2
NUM_LAYERS = 4


def config():
    """Odd sizes (hidden 33, MLP 65), so parameters do not split evenly over 2 ranks: ZeRO pads."""
    return get_flavor("llama-debug").build_config(num_hidden_layers=NUM_LAYERS, hidden_size=33, head_dim=8,
                                                  num_attention_heads=3, num_key_value_heads=1,
                                                  intermediate_size=65)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, out: str, stages: tuple[int, ...]) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(WORLD_SIZE))
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    # DeepSpeed's shared-memory all-reduce kernel only speeds up CPU collectives; without it
    # DeepSpeed uses gloo and skips a C++ build of a minute or more.
    # (``deepspeed.comm.torch`` as an attribute is the torch package, re-exported: go by module name.)
    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    for stage in stages:
        torch.manual_seed(0)
        model = FAMILIES["llama"].model_class(config())
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
        gen = torch.Generator().manual_seed(rank)
        save_dir = Path(out) / f"zero{stage}"
        for step in range(1, max(SAVE_STEPS) + 1):
            x = torch.randint(0, 96, (2, 8), generator=gen)
            engine.backward(engine(x, labels=x).loss)
            engine.step()
            if step in SAVE_STEPS:
                engine.save_checkpoint(str(save_dir), tag=f"global_step{step}")
                if stage < 3:
                    # DeepSpeed 0.19 links each parameter to its moments after the first group's
                    # step only, before the second group has any; link again for the reference.
                    engine.optimizer._hp_optimizer_states_linked = False
                    engine.optimizer._lazy_init_hp_params_optimizer_state()
                ref = {n: {"param": safe_get_full_fp32_param(p).clone(),
                           "exp_avg": safe_get_full_optimizer_state(p, "exp_avg").clone(),
                           "exp_avg_sq": safe_get_full_optimizer_state(p, "exp_avg_sq").clone()}
                       for n, p in engine.module.named_parameters()}
                if rank == 0:
                    torch.save(ref, save_dir / f"reference_step{step}.pt")
        if rank == 0:
            (save_dir / "config.json").write_text(json.dumps(config().to_dict()))
        engine.destroy()


def make_zero_checkpoints(out: Path, stages: tuple[int, ...] = (1, 2, 3)) -> Path:
    """``out/zero{stage}/global_step{N}`` for each stage, with references and config.json."""
    mp.spawn(_worker, args=(_free_port(), str(out), stages), nprocs=WORLD_SIZE)
    return out
