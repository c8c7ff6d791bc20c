"""Device memory: the memory model's prediction against the step's real allocations.

Per plan, one warm-up step, then the device peak of ``compute_grads`` measured from allocations
(``layerwise.engine.memory_probe``: on CPU every allocation and free the torch profiler records,
plus the slots' storages; on CUDA ``max_memory_reserved``), median of 3 measurements, against
``engine.predict_memory``. On the asynchronous CPU backend (the GPU's protocol on threads) it
counts the distinct device buffers the weight copies wrote: the live weight slots, which must be
``prefetch_depth + 1`` whatever the host's pace. And the pinned host memory of a
qwen2.5-14b-shaped store (computed from its layouts on the meta device, nothing allocated)
against the bytes that are copied to the device.

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import Batch
from layerwise.engine.memory_probe import measure_step_peak
from layerwise.models import get_flavor
from layerwise.plan import Plan
from layerwise.store import init_store, store_footprint


FAMILIES = ("dense", "moe", "hybrid")


def plans(num_layers: int) -> dict[str, Plan]:
    mixed = (["host", "nvme", "recompute", "device"] * num_layers)[:num_layers]
    return {
        "every-1": Plan.every_k(num_layers, 1),
        "every-3": Plan.every_k(num_layers, 3),
        "recompute-all": Plan.recompute_all(num_layers),
        "keep-all-host": Plan.keep_all(num_layers, "host"),
        "mixed-depth2": Plan(mixed, prefetch_depth=2),
    }


def live_weight_slots(adapter, store, plan: Plan, batch: list[Batch], seed: int) -> int:
    """Distinct device buffers the weight copies of one step wrote, on the async CPU backend."""
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device="cpu-async", async_seed=seed))
    written: set[int] = set()
    copy = engine.backend.copy_h2d
    fetch = {s.buffer.untyped_storage().data_ptr() for s in engine.acts.slots}

    def recording_copy(dst, src, after=()):
        written.add(dst.untyped_storage().data_ptr())
        return copy(dst, src, after)

    engine.backend.copy_h2d = recording_copy
    engine.compute_grads(batch)
    fetch |= {s.buffer.untyped_storage().data_ptr() for s in engine.acts.slots}
    engine.close()
    store.zero_grads()
    return len(written - fetch)


def family_config(family: str, hidden: int, layers: int):
    """The benchmark's model of each kind, at one width: a dense Llama, a Qwen3-MoE (its first
    layer dense, 8 experts, top 2) and a Qwen3-Next hybrid (3 linear-attention layers to 1 full,
    every MLP routed, with a shared expert)."""
    heads = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4)
    if family == "dense":
        return get_flavor("llama-30m").build_config(num_hidden_layers=layers, hidden_size=hidden,
                                                    intermediate_size=hidden * 11 // 4,
                                                    **{k: v for k, v in heads.items() if k != "head_dim"})
    moe = dict(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
               moe_intermediate_size=hidden // 2, num_experts_per_tok=2, vocab_size=320,
               max_position_embeddings=2048, **heads)
    if family == "moe":
        return get_flavor("qwen3-moe-debug").build_config(num_local_experts=8, **moe)
    if family == "hybrid":
        types = ["linear_attention" if i % 4 != 3 else "full_attention" for i in range(layers)]
        return get_flavor("qwen3-next-debug").build_config(
            num_experts=8, layer_types=types, shared_expert_intermediate_size=hidden // 2,
            linear_key_head_dim=hidden // 8, linear_value_head_dim=hidden // 8,
            linear_num_key_heads=2, linear_num_value_heads=4, **moe)
    raise ValueError(family)


def measure_family(family: str, layers: int, hidden: int, seq: int, mbs: int) -> dict:
    cfg = family_config(family, hidden, layers)
    adapter, store = init_store(cfg)
    ids = torch.randint(0, cfg.vocab_size, (mbs, seq), generator=torch.Generator().manual_seed(0))
    batch = [Batch(ids, ids)]
    cases = {}
    measured = None
    for name, plan in plans(layers).items():
        engine = StreamingEngine(adapter, store, plan, EngineConfig())
        engine.compute_grads(batch)  # warm-up: fetch slots are allocated by the first step
        store.zero_grads()
        runs = []
        for _ in range(3):
            runs.append(measure_step_peak(engine, batch))
            store.zero_grads()
        measured = sorted(runs, key=lambda m: m.peak_bytes)[1]
        predicted = engine.predict_memory(mbs, seq)
        engine.close()
        slots = live_weight_slots(adapter, store, plan, batch, seed=len(cases))
        cases[name] = {
            "predicted_peak_bytes": predicted.peak_bytes, "predicted_peak_op": predicted.peak_op,
            "measured_peak_bytes": measured.peak_bytes, "measured_peak_op": measured.peak_op,
            "error_pct": round(100 * (predicted.peak_bytes - measured.peak_bytes) / measured.peak_bytes, 2),
            "prefetch_depth": plan.prefetch_depth, "live_weight_slots": slots,
        }
    return {
        "model": {"model_type": cfg.model_type, "layers": layers, "hidden_size": hidden,
                  "vocab_size": cfg.vocab_size},
        "measured_how": measured.how,
        "cases": cases,
        "max_peak_error_pct": max(abs(c["error_pct"]) for c in cases.values()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="a smaller model and sequence (about 1 minute)")
    ap.add_argument("--family", choices=FAMILIES, action="append",
                    help="only these kinds of model (default: all three)")
    args = ap.parse_args()
    layers, hidden, seq, mbs = (8, 128, 128, 2) if args.quick else (8, 256, 512, 2)
    families = {f: measure_family(f, layers, hidden, seq, mbs) for f in (args.family or FAMILIES)}
    cases = [c for f in families.values() for c in f["cases"].values()]
    big = store_footprint(get_flavor("qwen2.5-14b").build_config(), torch.bfloat16, pin=True)
    print(json.dumps({
        "benchmark": "memory_fidelity",
        "micro_batch": [mbs, seq],
        "families": families,
        "max_peak_error_pct": max(f["max_peak_error_pct"] for f in families.values()),
        "target_max_peak_error_pct": 3,
        "max_live_weight_slots_minus_depth": max(c["live_weight_slots"] - c["prefetch_depth"]
                                                 for c in cases),
        "target_max_live_weight_slots_minus_depth": 1,
        "pinned_over_copy_source": round(big.pinned_over_copy_source, 6),
        "pinned_bytes_qwen2.5-14b": big.pinned,
        "copy_source_bytes_qwen2.5-14b": big.copy_source,
        "target_pinned_over_copy_source": 1.05,
        "machine": {"cpu_count": os.cpu_count(), "load_avg_1m": round(os.getloadavg()[0], 2),
                    "platform": platform.platform(), "torch": torch.__version__,
                    "python": sys.version.split()[0]},
        "median_of": 3,
    }))


if __name__ == "__main__":
    main()
