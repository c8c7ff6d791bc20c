"""Expert-level vs layer-level checkpoint groups on a tiny MoE (``ckpt_savings.py --moe``).

One training run of a tiny Qwen3-MoE (8 routed experts, top-2, 6 layers) on the built-in corpus;
every K steps the same state is checkpointed side by side by three checkpointers: ``full``
(the reference), and the same ``filter`` policy with layer groups and with expert groups
(``ckpt.expert_groups``). Reported: bytes each wrote, ``bytes_ratio_expert_vs_layer_groups``,
and, after loading each composite at the last checkpoint into a fresh model and training on for
the same steps, the eval losses: ``eval_loss_delta_pct`` is expert groups vs layer groups (the
cost of the finer choice), ``*_vs_full_pct`` each against the resume from ``full``.
"""

from __future__ import annotations

import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import torch

from ckpt_finetune_setup import next_token_loss
from layerwise.ckpt import Checkpointer
from layerwise.models.registry import FAMILIES, get_flavor
from layerwise.train.data import batches, corpus_tokens

MOE_SHAPE = dict(vocab_size=320, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
                 moe_intermediate_size=32, mlp_only_layers=[], decoder_sparse_step=1)
"""Every layer an MoE layer: 8 experts of 2 x 64 x 32 + 32 x 64 weights each."""


def build(seed: int, lr: float, warmup: int, total: int):
    torch.manual_seed(seed)
    cfg = get_flavor("qwen3-moe-debug").build_config()
    for k, v in MOE_SHAPE.items():
        setattr(cfg, k, v)
    cfg.output_router_logits = True  # the load-balancing loss, as HF trains MoE
    model = FAMILIES[cfg.model_type].model_class(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * max(0.1, 1 - s / total))
    return model, opt, sched


def train_step(model, opt, sched, batch) -> None:
    next_token_loss(model, batch).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()


@torch.no_grad()
def eval_loss(model, eval_set) -> float:
    model.eval()
    out = sum(float(next_token_loss(model, b)) for b in eval_set)
    model.train()
    return out / len(eval_set)


def run_moe(quick: bool, threshold: float, max_staleness: int, root: Path | None = None) -> dict:
    """The measurement (see the module docstring); one dict, the ``moe`` part of the JSON."""
    steps, every, resume_steps, bs, seq = (40, 4, 8, 4, 32) if quick else (120, 8, 24, 4, 32)
    lr, warmup = 3e-3, 8
    load_start = os.getloadavg()
    tmp = root is None
    root = Path(tempfile.mkdtemp(prefix="ckpt_moe_")) if root is None else root
    t0 = time.perf_counter()
    total = steps + resume_steps
    tokens = corpus_tokens((total + 4) * bs * seq + 4 * bs * seq + 2)
    split = (total + 4) * bs * seq + 1
    stream = batches(tokens[:split], seq, bs, seed=0)
    train = [next(stream) for _ in range(total)]
    eval_it = batches(tokens[split:], seq, bs, seed=99)
    eval_set = [next(eval_it) for _ in range(4)]

    model, opt, sched = build(0, lr, warmup, total)
    filt = dict(policy="filter", threshold=threshold, max_staleness=max_staleness)
    specs = {"full": dict(policy="full"), "layer_groups": filt,
             "expert_groups": {**filt, "expert_groups": True}}
    cks = {name: Checkpointer(root / name, model, opt, sched, track_every_steps=every,
                              tracker_log=False, **spec) for name, spec in specs.items()}
    written = {name: 0 for name in cks}
    for step in range(steps):
        train_step(model, opt, sched, train[step])
        if (step + 1) % every == 0:
            for name, ck in cks.items():
                ck.save(step + 1)
                written[name] += int(ck.wait().bytes_written or 0)
    for ck in cks.values():
        ck.close()
    groups = {name: len(ck.groups) for name, ck in cks.items()}

    after = {}
    for name in cks:
        m, o, s = build(123, lr, warmup, total)  # another init: everything comes from the load
        with Checkpointer(root / name, m, o, s) as ck:
            ck.load()
        for b in train[steps:]:
            train_step(m, o, s, b)
        after[name] = eval_loss(m, eval_set)
    if tmp:
        shutil.rmtree(root, ignore_errors=True)

    def pct(a: float, b: float) -> float:
        return 100.0 * (a - b) / b
    return {
        "model": {**MOE_SHAPE, "params": sum(p.numel() for p in model.parameters())},
        "inputs": {"steps": steps, "every": every, "resume_steps": resume_steps, "batch_size": bs,
                   "seq_len": seq, "lr": lr, "threshold": threshold, "max_staleness": max_staleness},
        "groups": groups,
        "bytes_written": written,
        "bytes_ratio_expert_vs_layer_groups": written["expert_groups"] / written["layer_groups"],
        "bytes_ratio_expert_groups_vs_full": written["expert_groups"] / written["full"],
        "bytes_ratio_layer_groups_vs_full": written["layer_groups"] / written["full"],
        "eval_loss_after_resume": after,
        "eval_loss_delta_pct": pct(after["expert_groups"], after["layer_groups"]),
        "eval_loss_expert_groups_vs_full_pct": pct(after["expert_groups"], after["full"]),
        "eval_loss_layer_groups_vs_full_pct": pct(after["layer_groups"], after["full"]),
        "machine": {"python": platform.python_version(), "torch": torch.__version__,
                    "cpus": os.cpu_count(), "load_avg_start": load_start,
                    "load_avg_end": os.getloadavg()},
        "wall_s": time.perf_counter() - t0,
    }
