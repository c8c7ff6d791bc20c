"""Simulator fidelity: calibrate this machine, predict the engine's step time, then measure it.

On this CPU, a ~30M-parameter Llama (``llama-30m``) is trained by the streaming engine under
several plans; for each, the simulator predicts the steady-state step time from a profile
measured by ``calibrate``, and the engine runs it. Calibration and measurement share their
window: every round calibrates afresh, then runs every plan (round-robin), and each
measurement is compared with the prediction from its own round's calibration, so a change of
load between rounds moves both sides. Per plan the error is the median over rounds; the load
average is recorded at the start and end of each round.

Two clocks, both sides timed alike: the process's CPU time (``time.process_time``: calibration
with ``calibrate(cpu_time=True)``, the engine's steps by the same clock), which is what the work
costs whatever other jobs share the cores, and the wall clock (``calibrate()`` and
``perf_counter``), which on a shared machine also counts the time others hold the cores. The
headline ``max_abs_error_pct`` uses the CPU clock (the simulator models a machine the engine
has to itself); ``max_abs_error_pct_wall`` is reported beside it. Prints one JSON object with
``cases`` (``predicted_s``, ``measured_s``, ``error_pct`` per round and their medians, and the
same with ``_wall``).

    python benchmarks/sim_fidelity.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--quick", action="store_true", help="fewer steps and rounds")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for calibration and engine alike (1: robust on a shared machine, "
                         "where spinning OpenMP threads slow down many-fold when cores are oversubscribed)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)

    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.engine.calibrate import calibrate
    from layerwise.plan.shape import ModelShape
    from layerwise.plan.plan import Plan
    from layerwise.plan.simulator import simulate
    from layerwise.store import HostStore
    from layerwise.engine.batch import Batch

    torch.manual_seed(0)
    flavor = "llama-30m"
    cfg = get_flavor(flavor).build_config()
    shape = ModelShape.from_config(cfg, name=flavor)
    L = shape.num_layers
    seq, mbs, m = args.seq_len, args.micro_batch_size, args.micro_batches
    kw = dict(micro_batch_size=mbs, num_micro_batches=m, seq_len=seq)
    plans = {
        "keep-all-device": Plan.keep_all(L, **kw),
        "every-4": Plan.every_k(L, 4, **kw),
        "recompute-all": Plan.recompute_all(L, **kw),
        "keep-all-host": Plan.keep_all(L, "host", **kw),
        "mixed-nvme": Plan(["device", "host", "nvme", "recompute", "recompute"] * (L // 5), source="mixed", **kw),
        # kept layer internals (issue 13): on the device, on the host, and mixed with the rest
        "every-4+internals-device": Plan(Plan.every_k(L, 4).boundary_tiers, internal_tiers=["device"] * L,
                                         source="every-4+internals-device", **kw),
        "internals-host": Plan(["recompute"] * L, internal_tiers=["host"] * L, source="internals-host", **kw),
        "mixed-internals": Plan(["device", "recompute", "host", "recompute", "recompute"] * (L // 5),
                                internal_tiers=["device", "host", "recompute", "recompute", "device"] * (L // 5),
                                source="mixed-internals", **kw),
    }
    t0 = time.perf_counter()

    model = build_hf_model(cfg, seed=0)
    adapter = DecoderAdapter(cfg)
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(m):
        ids = torch.randint(0, cfg.vocab_size, (mbs, seq), generator=g)
        batches.append(Batch(ids, torch.roll(ids, -1, dims=1)))
    spill = tempfile.mkdtemp(prefix="layerwise-fidelity-")
    engines = {}
    for name, plan in plans.items():
        store = HostStore(adapter)
        store.copy_from_model(model)
        engines[name] = StreamingEngine(adapter, store, plan, EngineConfig(spill_dir=spill))
    steps = 2 if args.quick else 3
    rounds = 3 if args.quick else 5
    clocks = {"cpu": time.process_time, "wall": time.perf_counter}
    times = {c: {name: [] for name in plans} for c in clocks}
    predicted = {c: {name: [] for name in plans} for c in clocks}
    profiles, loads, calibrate_s = [], [], []
    for _ in range(rounds):
        load_start = os.getloadavg()[0]
        t = time.perf_counter()
        for c in clocks:
            hw = calibrate(quick=args.quick, cpu_time=c == "cpu")
            profiles.append({"clock": c, **hw.to_dict()})
            for name, p in plans.items():
                predicted[c][name].append(simulate(p, shape, hw, steps=2, keep_trace=False).step_s)
        calibrate_s.append(time.perf_counter() - t)
        for name, eng in engines.items():
            eng.train_step(batches)  # warm-up; its optimizer update overlaps the next step
            start = {c: f() for c, f in clocks.items()}
            for _ in range(steps):
                eng.train_step(batches)
            eng.synchronize()
            for c, f in clocks.items():
                times[c][name].append((f() - start[c]) / steps)
        loads.append((load_start, os.getloadavg()[0]))
    for eng in engines.values():
        eng.close()
    cases = []
    for name in plans:
        case = {"plan": name, "boundary_tiers": plans[name].boundary_tiers,
                "internal_tiers": plans[name].internal_tiers}
        for c in clocks:
            sfx = "" if c == "cpu" else "_wall"
            errors = [100.0 * (p - m) / m for p, m in zip(predicted[c][name], times[c][name])]
            case.update({f"predicted{sfx}_s": statistics.median(predicted[c][name]),
                         f"measured{sfx}_s": statistics.median(times[c][name]),
                         f"predicted_rounds{sfx}_s": predicted[c][name], f"measured_rounds{sfx}_s": times[c][name],
                         f"error_rounds{sfx}_pct": errors, f"error{sfx}_pct": statistics.median(errors)})
        cases.append(case)
    out = {
        "benchmark": "sim_fidelity",
        "quick": args.quick,
        "inputs": {"model": flavor, "params": shape.num_params, "seq_len": seq, "micro_batch_size": mbs,
                   "num_micro_batches": m, "steps_per_round": steps, "rounds": rounds},
        "machine": {"platform": platform.platform(), "python": sys.version.split()[0], "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads(), "load_avg_1m": os.getloadavg()[0]},
        "load_avg_1m_rounds": loads,
        "profiles": profiles,
        "calibrate_s": calibrate_s,
        "cases": cases,
        "max_abs_error_pct": max(abs(c["error_pct"]) for c in cases),
        "max_abs_error_pct_wall": max(abs(c["error_wall_pct"]) for c in cases),
        "cases_within_20pct": sum(abs(c["error_pct"]) <= 20 for c in cases),
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
