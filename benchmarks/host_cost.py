"""The planner's predicted step and what each host term takes of it.

Two cases: the GPU check's model (``benchmarks/gpu_check`` defaults: llama3-8b widths with the
layers that fit a 137.4 GB host budget, 8 x 4096 tokens, one micro-batch, 8-bit moments) on the
``h200`` preset with that host budget, planned as the check plans it (``run_planner``); and
qwen2.5-14b on ``h200`` at 4096 tokens as ``layerwise plan`` plans it (batch auto).

For each: the planner's plan, its simulated step, and per host term the seconds of work inside
the step (the simulator's lane intervals, by label) and their share of the step: accumulation
(the ``host`` lane), the optimizer step (``update``), the pinned refresh (``refresh``: a separate
interval where the simulator models it, else 0), the reduction (``reduce``/``all-reduce``, data
parallel only: 0 here). ``host_exposed_s``: the step minus the same plan's step with every host
rate made free, the part of the step the GPU waits on the host.

    PYTHONPATH=src python benchmarks/host_cost.py [--milp-budget-s 6] [--cases gpu-check,qwen2.5-14b]

Runs on any source tree with the same planner API, so a change's before and after can be
compared with the same file.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: benchmarks.gpu_check

TERMS = {"accumulation": ("accumulate",), "optimizer": ("update",), "pinned_copies": ("refresh",),
         "reduction": ("reduce", "all-reduce")}
FREE_HOST = dict(host_accum_gbps=1e15, optimizer_params_per_s=1e21, optimizer_8bit_params_per_s=1e21)


def _free_host(hw):
    from layerwise.planner.hardware import HardwareProfile

    extra = {k: 1e15 for k in ("host_accum_bf16_gbps", "pinned_copy_gbps")
             if k in HardwareProfile.__dataclass_fields__}
    return replace(hw, **FREE_HOST, **extra)


def breakdown(plan, shape, hw) -> dict[str, Any]:
    from layerwise.planner.simulator import simulate

    sim = simulate(plan, shape, hw, steps=3)
    t0, t1 = sim.window
    out: dict[str, Any] = {"step_s": sim.step_s, "achieved_tflops": sim.achieved_tflops}
    for term, prefixes in TERMS.items():
        s = sum(max(0.0, min(iv.end, t1) - max(iv.start, t0)) for iv in sim.intervals
                if iv.label.split(" ")[0] in prefixes)
        out[f"{term}_s"] = s
        out[f"{term}_share"] = s / sim.step_s
    free = simulate(plan, shape, _free_host(hw), steps=3, keep_trace=False)
    out["step_s_host_free"] = free.step_s
    out["host_exposed_s"] = sim.step_s - free.step_s
    out["host_exposed_share"] = out["host_exposed_s"] / sim.step_s
    return out


def gpu_check_case(milp_budget_s: float) -> dict[str, Any]:
    from benchmarks.gpu_check.machine import Dev
    from benchmarks.gpu_check.model import Large, run_model
    from benchmarks.gpu_check.probes import run_planner

    lg = Large(dev=Dev(dry_run=True), flavor="llama3-8b", host_budget_bytes=int(137.4e9), mbs=8, seq=4096, nmb=1,
               moments_kind="8bit")
    model: dict[str, Any] = {}
    run_model(lg, 16, model)
    t = time.perf_counter()
    run_planner(lg, milp_budget_s, {})
    plan = lg.planner_plan
    return {"model": model["flavor"], "num_layers": model["num_layers"], "hardware": "h200 (host 137.4 GB)",
            "plan_s": time.perf_counter() - t, "micro_batch_size": plan.micro_batch_size,
            "num_micro_batches": plan.num_micro_batches, "seq_len": plan.seq_len, "source": plan.source,
            **breakdown(plan, lg.shape, lg.profiles["h200"])}


def plan_case(model: str, hardware: str, seq: int, milp_budget_s: float) -> dict[str, Any]:
    from layerwise.planner.presets import get_hardware
    from layerwise.planner.milp import MilpConfig
    from layerwise.planner.search import SearchConfig, search
    from layerwise.plan.shape import load_shape

    shape, hw = load_shape(model), get_hardware(hardware)
    t = time.perf_counter()
    res = search(shape, hw, seq, SearchConfig(milp=MilpConfig(time_limit_s=5.0), milp_budget_s=milp_budget_s))
    plan = res.plan
    return {"model": model, "hardware": hardware, "plan_s": time.perf_counter() - t,
            "micro_batch_size": plan.micro_batch_size, "num_micro_batches": plan.num_micro_batches,
            "seq_len": plan.seq_len, "source": plan.source, **breakdown(plan, shape, hw)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--milp-budget-s", type=float, default=6.0)
    ap.add_argument("--cases", default="gpu-check,qwen2.5-14b")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    out: dict[str, Any] = {}
    if "gpu-check" in cases:
        out["gpu-check"] = gpu_check_case(args.milp_budget_s)
    if "qwen2.5-14b" in cases:
        out["qwen2.5-14b"] = plan_case("qwen2.5-14b", "h200", 4096, args.milp_budget_s)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
