"""Planner benchmark: the MILP plan vs MegaTrain's every-K rule, in the simulator.

For each model shape x hardware preset x sequence length, at a fixed 32768 tokens per optimizer
step, the planner (outer search over micro-batch size + MILP per size) and every-K (K = 1, 2, 4,
8; each at its own best micro-batch size) are simulated side by side. Prints one JSON object.

    python benchmarks/planner.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time

TOKENS_PER_STEP = 32768  # default: a common fine-tuning batch (e.g. 8 x 4096 or 32 x 1024)
MODELS = ["qwen2.5-3b", "qwen2.5-7b", "llama3-8b", "qwen2.5-14b", "qwen2.5-32b"]
QUICK_MODELS = ["qwen2.5-3b", "llama3-8b", "qwen2.5-14b", "qwen2.5-32b"]
HARDWARE = ["h800", "h200", "rtx3090"]
SEQS = [1024, 4096]


def run_case(model: str, hw_name: str, seq: int, time_limit_s: float, tokens_per_step: int) -> dict:
    from layerwise.plan.check import check
    from layerwise.plan.shape import load_shape
    from layerwise.plan.hardware import PRESETS
    from layerwise.plan.milp import MilpConfig
    from layerwise.plan.search import PlanInfeasible, SearchConfig, search
    from layerwise.plan.simulator import simulate

    shape = load_shape(model)
    hw = PRESETS[hw_name]
    batch = max(1, tokens_per_step // seq)
    t0 = time.perf_counter()
    try:
        res = search(shape, hw, seq, SearchConfig(global_batch=batch, milp=MilpConfig(time_limit_s=time_limit_s)))
    except PlanInfeasible as e:
        return {"model": model, "hardware": hw_name, "seq": seq, "batch": batch, "fits": False,
                "binding": e.resource, "over_bytes": e.over_bytes}
    plan_s = time.perf_counter() - t0
    sim = simulate(res.plan, shape, hw)
    ok = check(sim, shape, hw).ok
    ks = {n: c for n, c in res.by_name.items() if n.startswith("every-")}
    best_k_name, best_k = max(ks.items(), key=lambda kv: kv[1].sim.tokens_per_s)
    k4 = ks.get("every-4")
    raw = res.by_name.get("milp")
    p = res.plan
    return {
        "model": model, "hardware": hw_name, "seq": seq, "batch": batch, "fits": True,
        "micro_batch_size": p.micro_batch_size, "num_micro_batches": p.num_micro_batches,
        "plan_source": p.source,
        "tiers": {t: p.boundary_tiers.count(t) for t in ("device", "host", "nvme", "recompute")},
        "moments_8bit_units": (p.moments or []).count("8bit"),
        "tokens_per_s_milp": sim.tokens_per_s,
        "tokens_per_s_milp_raw": raw.sim.tokens_per_s if raw else None,
        "tokens_per_s_k4": k4.sim.tokens_per_s if k4 else None,
        "k4_micro_batch_size": k4.plan.micro_batch_size if k4 else None,
        "tokens_per_s_best_k": best_k.sim.tokens_per_s,
        "best_k": best_k_name,
        "speedup_vs_k4": sim.tokens_per_s / k4.sim.tokens_per_s if k4 else None,
        "speedup_vs_best_k": sim.tokens_per_s / best_k.sim.tokens_per_s,
        "achieved_tflops": sim.achieved_tflops,
        "solve_s": plan_s,
        "milp_solve_s": res.solve_s,
        "milp_gap": res.milp.gap if res.milp else None,
        "peak_device_bytes": sim.peak_device_bytes,
        "device_cap_bytes": sim.device_cap_bytes,
        "check_ok": ok,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer models, shorter MILP time limit")
    ap.add_argument("--tokens-per-step", type=int, default=TOKENS_PER_STEP,
                    help="global batch in tokens (sequences = tokens // seq)")
    args = ap.parse_args()
    import highspy  # noqa: F401  (version in the output)
    from importlib.metadata import version

    models = QUICK_MODELS if args.quick else MODELS
    time_limit = 2.0 if args.quick else 10.0
    t0 = time.perf_counter()
    cases = [run_case(m, h, s, time_limit, args.tokens_per_step) for m in models for h in HARDWARE for s in SEQS]
    fit = [c for c in cases if c["fits"]]
    vs_k4 = [c["speedup_vs_k4"] for c in fit if c["speedup_vs_k4"]]
    out = {
        "benchmark": "planner",
        "quick": args.quick,
        "inputs": {"models": models, "hardware": HARDWARE, "seqs": SEQS, "tokens_per_step": args.tokens_per_step,
                   "milp_time_limit_s": time_limit},
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count(), "highspy": version("highspy")},
        "cases": cases,
        "min_speedup_vs_best_k": min(c["speedup_vs_best_k"] for c in fit),
        "geomean_speedup_vs_k4": math.exp(sum(math.log(x) for x in vs_k4) / len(vs_k4)),
        "max_speedup_vs_k4": max(vs_k4),
        "max_solve_s": max(c["solve_s"] for c in fit),
        "max_milp_solve_s": max(c["milp_solve_s"] for c in fit),
        "all_plans_pass_check": all(c["check_ok"] for c in fit),
        "cases_not_fitting": len(cases) - len(fit),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
