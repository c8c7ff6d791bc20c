"""Predicted data-parallel scaling: the simulator's speedup for 1/2/4/8 GPUs.

qwen2.5-14b on the h200 preset, 4096-token sequences, a fixed global batch of 64 sequences (262k
tokens per optimizer step): the planner makes the plan one of 8 GPUs runs (its 8 sequences), and
``layerwise.planner.scaling.predict_scaling`` simulates that plan's tiers on 1 GPU (the whole batch),
2, 4 and 8 GPUs of one node and 2 nodes of 8. Gradients summed on the host (what ``layerwise
train`` runs) and, for comparison, on the GPUs before the copy (``grad_reduce="device"``).

The simulation is deterministic, so it runs once (no medians); the wall time and load average
are reported for the record. The measured CPU part (``speedup_2proc``) is ``benchmarks/scaling.py``.

    python benchmarks/scaling_model.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

MODEL = "qwen2.5-14b"
HARDWARE = "h200"
SEQ_LEN = 4096
GLOBAL_BATCH = 64
GPUS = (1, 2, 4, 8)


def predicted(model: str = MODEL, hardware: str = HARDWARE, seq_len: int = SEQ_LEN,
              global_batch: int = GLOBAL_BATCH, milp_time_limit_s: float = 5.0) -> dict:
    """Predicted step, tokens/s and speedup vs 1 GPU for each GPU count (and 2 nodes of 8)."""
    from layerwise.planner.presets import PRESETS
    from layerwise.planner.milp import MilpConfig
    from layerwise.planner.scaling import predict_scaling
    from layerwise.planner.search import SearchConfig, search
    from layerwise.plan.shape import load_shape
    from layerwise.planner.topology import Topology

    shape = load_shape(model)
    hw = PRESETS[hardware]
    t0 = time.perf_counter()
    per_gpu = global_batch // max(GPUS)
    res = search(shape, hw, seq_len, SearchConfig(global_batch=per_gpu, milp=MilpConfig(time_limit_s=milp_time_limit_s)))
    out: dict = {"model": model, "hardware": hardware, "seq_len": seq_len, "global_batch": global_batch,
                 "tokens_per_step": global_batch * seq_len, "plan_source": res.plan.source,
                 "plan_micro_batch_size": res.plan.micro_batch_size}
    for reduce in ("host", "device"):
        topos = [Topology(g, 1, reduce) for g in GPUS] + [Topology(max(GPUS), 2, reduce)]
        points = predict_scaling(shape, hw, res.plan, global_batch, topos)
        rows = [pt.row() for pt in points]
        suffix = "" if reduce == "host" else "_device_reduce"
        for pt in points:
            t = pt.topology
            key = f"{t.world_size}gpu" if t.nodes == 1 else f"{t.gpus_per_node}x{t.nodes}nodes"
            out[f"predicted_speedup_{key}{suffix}"] = pt.speedup
        out[f"points{suffix}"] = [{k: r[k] for k in ("gpus_per_node", "nodes", "micro_batch_size", "num_micro_batches",
                                                     "step_s", "tokens_per_s", "speedup", "efficiency", "bound",
                                                     "busy_fraction", "fits")} for r in rows]
    out["wall_s"] = time.perf_counter() - t0
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="a 1 s MILP time limit instead of 5 s")
    args = ap.parse_args()
    out = predicted(milp_time_limit_s=1.0 if args.quick else 5.0)
    out["machine"] = {"python": platform.python_version(), "cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
