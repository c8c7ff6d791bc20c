"""Engine step time vs plain PyTorch training of the same model, same recompute policy.

Plain: the HF model with per-layer ``torch.utils.checkpoint`` (gradient checkpointing), AdamW
(fused) + ``clip_grad_norm_``. Engine: the K=1 plan (every boundary kept, each layer's inside
recomputed in its backward: the same policy), weights streamed from the HostStore, optimizer on
a host worker. Steps alternate between the two in one run; the medians are compared.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.models import get_flavor
from layerwise.models.init import build_hf_model
from layerwise.models.adapter import DecoderAdapter
from layerwise.optim.adamw import AdamWConfig
from layerwise.plan import Plan
from layerwise.store import HostStore
from layerwise.engine.batch import IGNORE_INDEX
from layerwise.engine.memory_probe import measure_step_peak
from layerwise.train.data import batches, corpus_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps (under 2 minutes)")
    ap.add_argument("--flavor", default="llama-30m")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=None)
    args = ap.parse_args()
    steps = args.steps or (6 if args.quick else 20)
    warmup = 2

    cfg = get_flavor(args.flavor).build_config()
    model = build_hf_model(cfg, seed=0)
    opt_cfg = AdamWConfig(lr=3e-4, max_grad_norm=1.0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = Plan.every_k(adapter.num_layers, 1)
    engine = StreamingEngine(adapter, store, plan, EngineConfig(optimizer=opt_cfg))

    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": opt_cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps, fused=True)

    tokens = corpus_tokens(args.batch * args.seq_len * (steps + warmup) * 2 + 1)
    data = batches(tokens, args.seq_len, args.batch, seed=0)

    def plain_step(b) -> float:
        opt.zero_grad(set_to_none=True)
        logits = model(b.input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        opt.step()
        return loss.item()

    engine_s, plain_s = [], []
    for k in range(steps + warmup):
        b = next(data)
        t0 = time.perf_counter()
        engine.train_step([b])
        # charge the engine for its whole step: forward, backward and the optimizer update
        # (the update overlaps the next forward in real training; here it is waited for)
        engine.synchronize()
        t1 = time.perf_counter()
        plain_step(b)
        t2 = time.perf_counter()
        if k >= warmup:
            engine_s.append(t1 - t0)
            plain_s.append(t2 - t1)

    e, p = statistics.median(engine_s), statistics.median(plain_s)
    # one more (untimed) step, its device peak measured from allocations
    batch = [next(data)]
    measured_peak = measure_step_peak(engine, batch)
    engine.store.zero_grads()
    predicted = engine.predict_memory(args.batch, args.seq_len).peak_bytes
    measured = measured_peak.peak_bytes
    engine.close()
    print(json.dumps({
        "benchmark": "engine_overhead",
        "model": args.flavor,
        "params": adapter.num_params(),
        "seq_len": args.seq_len,
        "batch": args.batch,
        "steps": steps,
        "plan": plan.source,
        "engine_step_s": round(e, 4),
        "plain_step_s": round(p, 4),
        "ratio": round(e / p, 4),
        "target_ratio": 1.15,
        "peak_device_bytes_predicted": predicted,
        "peak_device_bytes_measured": measured,
        "peak_measured_how": measured_peak.how,
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
    }))


if __name__ == "__main__":
    main()
