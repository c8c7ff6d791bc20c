"""The LoRA / QLoRA stage: the check's model widths with an NF4-quantised frozen base, built as
``train/lora_run.build_lora`` builds it (its RAM check given the host budget) and trained through
its adapters by ``run_plan`` as every plan is (the engine's shape knows the frozen base:
``LoraAdapter.plan_shape``). The adapters' loss must stay finite; whether it fell is recorded.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from .model import Large
from .plans import make_batches, run_plan
from .report import CheckFailed

LORA = "lora"
LORA_LAYERS = 1
"""Decoder layers of the check's widths: NF4 quantisation runs on the host (~25 s per
4096 x 14336 matrix on one core here), so one layer keeps the stage near 30 s on the GPU
machine while every kernel runs at the large model's shape."""
LORA_RANK = 16
LORA_ALPHA = 32.0
LORA_TARGETS = ("all-linear",)
LORA_BASE_DTYPE = "nf4"
LORA_LR = 1e-3
"""The adapters' learning rate (full fine-tuning's ``--lr`` is far too small for adapters
that start at B = 0 to move the loss in three steps)."""


def build_lora_store(lg: Large, seed: int):
    """(adapter, store, build seconds): the library's LoRA store over the check's widths."""
    import torch
    from layerwise.adapters.config import LoraConfig
    from layerwise.adapters.lora_adapter import LoraAdapter
    from layerwise.adapters.lora_store import LoraStore
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model

    layers = min(LORA_LAYERS, lg.shape.num_layers)
    cfg = get_flavor(lg.flavor).build_config(num_hidden_layers=layers)
    lora = LoraConfig(r=LORA_RANK, alpha=LORA_ALPHA, target_modules=list(LORA_TARGETS),
                      base_dtype=LORA_BASE_DTYPE)
    t = time.perf_counter()
    adapter = LoraAdapter(DecoderAdapter(cfg), lora, torch.bfloat16, seed)
    available = lg.host_available_bytes()
    store = LoraStore(adapter, torch.bfloat16, pin=lg.dev.is_cuda, mem_available=lambda: available)
    model = build_hf_model(cfg, seed)
    store.copy_from_model(model)  # quantised to NF4 as it is copied
    del model
    store.init_adapters(seed)
    return adapter, store, time.perf_counter() - t


def run_lora(lg: Large, args, data: dict[str, Any]) -> None:
    """``plan:lora``: every-1 over the LoRA model (each layer's forward again in its backward:
    the adapters' recompute), one micro-batch of the run's shape."""
    from layerwise.plan import Plan

    adapter, store, build_s = build_lora_store(lg, args.seed)
    shape = adapter.plan_shape()
    mine = dataclasses.replace(lg, shape=shape, adapter=adapter, store=store, nmb=1, measured={})
    plan = Plan.every_k(shape.num_layers, 1, micro_batch_size=lg.mbs, num_micro_batches=1, seq_len=lg.seq)
    plan.source = LORA
    layer_base = sum(e.numel for b in store.layers for e in b.layout.frozen)
    data["lora"] = {
        "r": LORA_RANK, "alpha": LORA_ALPHA, "target_modules": list(LORA_TARGETS),
        "base_dtype": LORA_BASE_DTYPE, "num_layers": shape.num_layers, "lr": LORA_LR,
        "adapter_params": adapter.num_params(), "base_params": adapter.num_base_params(),
        "base_host_bytes": store.base_nbytes(),
        "base_host_bytes_per_layer_param": store.base_nbytes(layers_only=True) / layer_base,
        "build_s": round(build_s, 3),
    }
    batches = make_batches(mine, args.seed + 3, 1)
    try:
        run_plan(mine, LORA, plan, batches, args.steps, LORA_LR, args.profile, args.trace_dir, data)
    finally:
        mine.store = store = None
    losses = data["losses"]
    data["lora"].update(loss_finite=all(math.isfinite(x) for x in losses), loss_decreased=losses[-1] < losses[0])
    if not data["lora"]["loss_finite"]:
        raise CheckFailed(f"the adapters' loss is not finite: {losses}")
