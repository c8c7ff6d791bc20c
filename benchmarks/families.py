"""The families beyond the first four: engine step time vs plain HF autograd on this CPU, and the
planner's predicted throughput of their popular models on an H200.

Part 1, per family: the tiny flavor with its quirks on (``models/registry.py``: windows, soft
caps, sinks, latent attention, MoE with the router aux loss, linear attention), widened to
``--hidden`` and ``--layers``, trained on random tokens. Plain: the HF model with per-layer
gradient checkpointing (non-reentrant), fused ``torch.optim.AdamW`` + ``clip_grad_norm_``, its
loss HF's own (cross-entropy + ``coef * aux`` for an MoE). Engine: the every-1 plan (every
boundary kept, each layer's inside recomputed in its backward: the same policy), weights
streamed from the HostStore, the optimizer on a host worker; each engine step timed until its
update is done. Steps alternate between the two; medians compared.

Part 2, per preset (``FAMILY_PRESETS``): the planner's search on the ``h200`` profile at seq
4096, the emitted plan's simulated tokens/s, and what makes these models differ (total vs
active parameters, the bytes a layer streams per FLOP it computes).

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
from typing import Any

import torch
import torch.nn.functional as F

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import FLAVORS, DecoderAdapter
from layerwise.models.families import FAMILIES
from layerwise.models.init import build_hf_model
from layerwise.models.registry import FAMILY_PRESETS
from layerwise.optim.adamw import AdamWConfig
from layerwise.plan import Plan
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.planner.search import PlanInfeasible, SearchConfig, search
from layerwise.plan.shape import load_shape
from layerwise.store import HostStore

WIDENED = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
           "q_lora_rank", "kv_lora_rank", "head_dim", "qk_rope_head_dim", "qk_nope_head_dim",
           "v_head_dim", "linear_key_head_dim", "linear_value_head_dim", "query_pre_attn_scalar")


def bench_config(flavor: str, hidden: int, layers: int, seq: int):
    """The quirky tiny flavor, widened ``hidden / 32`` times, ``layers`` deep, windows a quarter
    of the sequence."""
    f = FLAVORS[flavor]
    cfg = dict(f.config)
    scale = hidden // cfg["hidden_size"]
    for k in WIDENED:
        if isinstance(cfg.get(k), int):
            cfg[k] = cfg[k] * scale
    cfg.update(num_hidden_layers=layers, vocab_size=512, max_position_embeddings=max(256, seq))
    rope = dict(cfg.get("rope_parameters") or {})
    if "short_factor" in rope:  # LongRoPE: one factor per rotary frequency of the wider heads
        n = int(cfg["head_dim"] * cfg.get("partial_rotary_factor", 1.0)) // 2
        for k in ("short_factor", "long_factor"):
            rope[k] = [x for x in rope[k] for _ in range(n // len(rope[k]))]
        cfg["rope_parameters"] = rope
    if cfg.get("sliding_window"):
        cfg["sliding_window"] = seq // 4
    if cfg.get("layer_types"):
        pattern = list(cfg["layer_types"])
        cfg["layer_types"] = [pattern[i % len(pattern)] for i in range(layers)]
    return FAMILIES[f.family].config_class(**cfg)


def time_family(flavor: str, args: argparse.Namespace, steps: int) -> dict[str, Any]:
    cfg = bench_config(flavor, args.hidden, args.layers, args.seq_len)
    model = build_hf_model(cfg, seed=0)
    opt_cfg = AdamWConfig(lr=1e-4, max_grad_norm=1.0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(optimizer=opt_cfg))
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    for m in model.modules():  # dropout off, as the engine runs
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": opt_cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps, fused=True)
    aux = bool(getattr(cfg, "output_router_logits", False))
    g = torch.Generator().manual_seed(0)

    def plain_step(b: Batch) -> None:
        opt.zero_grad(set_to_none=True)
        out = model(b.input_ids, output_router_logits=aux or None)
        loss = F.cross_entropy(out.logits.float().flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX)
        if aux:
            loss = loss + model.router_aux_loss_coef * out.aux_loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        opt.step()

    engine_s, plain_s = [], []
    for k in range(steps + 1):  # one warm-up step
        ids = torch.randint(3, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=g)
        b = Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous())
        t0 = time.perf_counter()
        engine.train_step([b])
        engine.synchronize()
        t1 = time.perf_counter()
        plain_step(b)
        t2 = time.perf_counter()
        if k:
            engine_s.append(t1 - t0)
            plain_s.append(t2 - t1)
    engine.close()
    e, p = statistics.median(engine_s), statistics.median(plain_s)
    return {"params": adapter.num_params(), "layer_templates": adapter.num_templates,
            "router_aux_loss": aux, "engine_step_s": round(e, 4), "plain_step_s": round(p, 4),
            "step_ratio_vs_hf": round(e / p, 4)}


def plan_preset(name: str, seq_len: int, quick: bool) -> dict[str, Any]:
    shape = load_shape(name)
    hw = PRESETS["h200"]
    cfg = SearchConfig(global_batch=8 if quick else None, milp_budget_s=2.0 if quick else 6.0)
    t0 = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        res = search(shape, hw, seq_len, cfg)
    except PlanInfeasible as e:
        if e.resource != "host":
            raise
        # one H200 host's RAM is too small for the whole host store (DeepSeek-V3): say so, and
        # predict with the host memory it would need
        need_gb = (hw.host_mem_bytes + e.over_bytes) * 1.05 / 1e9
        out.update(fits_on_one_h200_host=False, binding="host", host_mem_gb_assumed=round(need_gb))
        hw = hw.with_memory(host_mem_gb=need_gb)
        res = search(shape, hw, seq_len, cfg)
    plan_s = time.perf_counter() - t0
    cost = CostModel(shape, hw, 1, seq_len)
    per_layer = [cost.unit_weight_bytes(f"layers.{i}") / cost.layer_fwd_flops(i) for i in range(shape.num_layers)]
    return {**out, "params_b": round(shape.num_params / 1e9, 2), "active_params_b": round(shape.active_params / 1e9, 2),
            "distinct_layers": len(set(shape.layers)) if shape.layers else 1,
            "max_layer_bytes_per_gflop": round(max(per_layer) * 1e9, 1),
            "min_layer_bytes_per_gflop": round(min(per_layer) * 1e9, 1),
            "plan": res.best.name, "micro_batch_size": res.plan.micro_batch_size,
            "num_micro_batches": res.plan.num_micro_batches,
            "predicted_tokens_per_s": round(res.best.sim.tokens_per_s, 1),
            "predicted_step_s": round(res.best.sim.step_s, 3),
            "compute_busy_fraction": round(res.best.sim.busy_s["compute"] / res.best.sim.step_s, 3),
            "plan_s": round(plan_s, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="narrower models, 3 steps, a fixed batch for the planner")
    ap.add_argument("--hidden", type=int, default=None)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=None)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--families", default=None, help="comma-separated flavor stems (default: all)")
    ap.add_argument("--no-plan", action="store_true", help="skip the planner part")
    ap.add_argument("--presets", default=None, help="comma-separated presets (default: all)")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine part")
    args = ap.parse_args()
    args.hidden = args.hidden or (128 if args.quick else 256)
    args.seq_len = args.seq_len or (128 if args.quick else 256)
    steps = args.steps or (3 if args.quick else 8)
    flavors = [n for n, f in FLAVORS.items() if f.note.endswith("quirks on")]
    if args.families:
        flavors = [f"{s}-debug" for s in args.families.split(",")]
    t0 = time.perf_counter()
    families = {} if args.no_engine else {f[:-len("-debug")]: time_family(f, args, steps) for f in flavors}
    names = args.presets.split(",") if args.presets else FAMILY_PRESETS
    presets = {} if args.no_plan else {n: plan_preset(n, 4096, args.quick) for n in names}
    print(json.dumps({
        "benchmark": "families",
        "inputs": {"hidden": args.hidden, "layers": args.layers, "seq_len": args.seq_len,
                   "batch": args.batch, "steps": steps, "plan": "every-1", "preset_seq_len": 4096,
                   "hardware": "h200", "quick": args.quick},
        "max_step_ratio_vs_hf": max((r["step_ratio_vs_hf"] for r in families.values()), default=None),
        "target_max_step_ratio_vs_hf": 1.15,
        "families": families,
        "presets": presets,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": {"cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                    "loadavg": os.getloadavg(), "platform": platform.platform(),
                    "torch": torch.__version__, "python": sys.version.split()[0]},
    }))


if __name__ == "__main__":
    main()
