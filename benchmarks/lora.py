"""LoRA / QLoRA on the streaming engine, measured side by side in one run.

- ``bytes``: per base format (compute = fp32 here, bf16, int8, nf4), the frozen base's host bytes
  per decoder-layer base parameter (the store's tensors' storage: each frozen tensor's region of
  the arena) and the bytes streamed per decoder-layer base parameter per weight copy (the
  asynchronous CPU backend's H2D counter over one every-1 step, less the embedding and head,
  which stay in the compute dtype; the adapters' own bytes are included). Beside them the whole
  model's host bytes per parameter (embedding and head included).
- ``step``: a LoRA step of layerwise (CPU backend, fp32) against PEFT + plain autograd + torch
  AdamW on the same model, adapters and batch, with the same recompute: layerwise keeping every
  layer's internals (no recompute) vs PEFT without checkpointing (``step_ratio_vs_peft``), and
  layerwise every-1 (each layer's forward again in its backward) vs PEFT with gradient
  checkpointing on every layer (``step_ratio_vs_peft_checkpointed``); medians of 3 steps after a
  warm-up, the two interleaved. Beside it the host update of the adapters (seconds, and as a
  share of the step): why the adapters are updated on the host.
- ``planner``: the planner's predicted tokens/s on the h200 preset for llama3-70b, full
  fine-tuning against LoRA r=16 on all linears with the base in bf16, int8 and nf4 (``--quick``:
  the simulator on one fixed plan, every-2 at 4 x 2048 tokens x 4 micro-batches; otherwise the
  planner's search at 16 x 2048 tokens a step), with the host bytes each needs.

Prints one JSON object; the headline keys (``base_host_bytes_per_param_nf4``,
``base_streamed_bytes_per_param_nf4``, ``step_ratio_vs_peft``, ``planner_tokens_per_s``) are at
the top level. The load average is recorded before and after.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from layerwise.adapters.config import LoraConfig
from layerwise.adapters.lora_store import init_lora_store
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.models import get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.plan.finetune import lora_frozen_base
from layerwise.planner.presets import PRESETS
from layerwise.planner.search import SearchConfig, search
from layerwise.plan.shape import ModelShape
from layerwise.planner.simulator import simulate

ROUNDS = 3


def _config(layers: int):
    return get_flavor("llama-30m").build_config(num_hidden_layers=layers)


def _batch(vocab: int, rows: int, seq: int, seed: int = 0) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, seq), generator=g)
    return Batch(ids, torch.roll(ids, -1, 1))


def measure_bytes(layers: int) -> dict:
    cfg = _config(layers)
    out = {}
    for fmt in ("compute", "bf16", "int8", "nf4"):
        lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj"], base_dtype=fmt)
        adapter, store = init_lora_store(cfg, lora, pin=False)
        layer_params = sum(e.numel for b in store.layers for e in b.layout.frozen)
        engine = StreamingEngine(adapter, store, Plan.every_k(layers, 1), EngineConfig(device="cpu-async"))
        engine.compute_grads([_batch(cfg.vocab_size, 1, 16)])
        h2d = engine.backend.copied_bytes["h2d"]
        engine.close()
        ends = sum(store.copy_source(u).numel() * 4 for u in ("embed", "head"))
        out[fmt] = {
            "host_bytes_per_layer_param": store.base_nbytes(layers_only=True) / layer_params,
            "streamed_bytes_per_layer_param": (h2d - ends) / (2 * layer_params),
            "host_bytes_per_param_whole_model": store.base_nbytes() / adapter.num_base_params(),
            "h2d_bytes_per_step": h2d,
            "adapter_params": adapter.num_params(),
        }
    return out


def _peft(cfg, store, lora: LoraConfig, checkpointing: bool):
    from peft import LoraConfig as PeftLoraConfig  # noqa: PLC0415  (the benchmark's one optional dependency)
    from peft import get_peft_model  # noqa: PLC0415
    model = build_hf_model(cfg, 0)
    pm = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha,
                                              target_modules=list(lora.target_modules)))
    adapters = store.adapter_tensors()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[n.removeprefix("base_model.model.").replace(".default", "")])
    if checkpointing:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.train()
    opt = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=1e-4,
                            weight_decay=0.1, betas=(0.9, 0.95))
    return pm, opt


def _peft_step(pm, opt, batch: Batch) -> float:
    t0 = time.perf_counter()
    logits = pm(batch.input_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), reduction="sum") / batch.num_target_tokens
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in pm.parameters() if p.requires_grad], 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return time.perf_counter() - t0


def _engine_step(engine: StreamingEngine, batch: Batch) -> float:
    t0 = time.perf_counter()
    engine.train_step([batch], lr=1e-4)
    engine.synchronize()
    return time.perf_counter() - t0


def measure_step(layers: int, rows: int, seq: int) -> dict:
    cfg = _config(layers)
    lora = LoraConfig(r=8, alpha=16, target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    batch = _batch(cfg.vocab_size, rows, seq)
    pairs = {"kept_vs_plain": (Plan(["device"] * layers, internal_tiers=["device"] * layers), False),
             "every1_vs_checkpointed": (Plan.every_k(layers, 1), True)}
    out = {}
    for name, (plan, ckpt) in pairs.items():
        adapter, store = init_lora_store(cfg, lora, pin=False)
        pm, opt = _peft(cfg, store, lora, ckpt)
        engine = StreamingEngine(adapter, store, plan, EngineConfig())
        _engine_step(engine, batch), _peft_step(pm, opt, batch)  # warm-up
        ours, theirs, update = [], [], []
        for _ in range(ROUNDS):
            ours.append(_engine_step(engine, batch))
            update.append(sum(e - s for s, e in engine.updates.times.values()))
            theirs.append(_peft_step(pm, opt, batch))
        engine.close()
        out[name] = {"layerwise_step_s": statistics.median(ours), "peft_step_s": statistics.median(theirs),
                     "ratio": statistics.median(ours) / statistics.median(theirs),
                     "host_adapter_update_s": statistics.median(update),
                     "host_update_share_of_step": statistics.median(update) / statistics.median(ours)}
    return {"model": f"llama-30m shape, {layers} layers", "tokens_per_step": rows * seq,
            "lora": dataclasses.asdict(lora), **out}


def measure_planner(quick: bool) -> dict:
    shape = ModelShape.from_config(get_flavor("llama3-70b").build_config(), name="llama3-70b")
    hw = PRESETS["h200"]
    out = {}
    for fmt in ("full", "bf16", "int8", "nf4"):
        s = shape if fmt == "full" else dataclasses.replace(shape, frozen_base=lora_frozen_base(
            shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, 16, ["all-linear"], fmt))
        if quick:
            plan = Plan.every_k(shape.num_layers, 2, micro_batch_size=4, num_micro_batches=4, seq_len=2048)
            sim = simulate(plan, s, hw, keep_trace=False)
            out[fmt] = {"tokens_per_s": sim.tokens_per_s, "step_s": sim.step_s, "plan": plan.source,
                        "peak_host_bytes": sim.peak_host_bytes, "fits": sim.fits}
        else:
            res = search(s, hw, 2048, SearchConfig(global_batch=16, milp_budget_s=3.0))
            p = res.plan.predicted
            out[fmt] = {"tokens_per_s": p["tokens_per_s"], "step_s": p["step_s"],
                        "plan": f"{res.plan.source} mbs {res.plan.micro_batch_size} x {res.plan.num_micro_batches}",
                        "peak_host_bytes": p.get("peak_host_bytes")}
    for fmt in ("bf16", "int8", "nf4"):
        out[fmt]["speedup_vs_full"] = out[fmt]["tokens_per_s"] / out["full"]["tokens_per_s"]
    return {"model": "llama3-70b", "hardware": "h200", "seq_len": 2048,
            "mode": "simulate every-2" if quick else "search", **out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller models, the planner's simulator only")
    args = ap.parse_args()
    torch.manual_seed(0)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    by_fmt = measure_bytes(2 if args.quick else 4)
    step = measure_step(2 if args.quick else 4, 4, 64 if args.quick else 128)
    planner = measure_planner(args.quick)
    result = {
        "benchmark": "lora", "quick": args.quick,
        "machine": {"cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "load_avg_before": load_before, "load_avg_after": os.getloadavg(),
        "base_host_bytes_per_param_nf4": by_fmt["nf4"]["host_bytes_per_layer_param"],
        "base_streamed_bytes_per_param_nf4": by_fmt["nf4"]["streamed_bytes_per_layer_param"],
        "step_ratio_vs_peft": step["kept_vs_plain"]["ratio"],
        "step_ratio_vs_peft_checkpointed": step["every1_vs_checkpointed"]["ratio"],
        "planner_tokens_per_s": {k: planner[k]["tokens_per_s"] for k in ("full", "bf16", "int8", "nf4")},
        "bytes": by_fmt, "step": step, "planner": planner,
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
