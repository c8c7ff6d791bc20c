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

``--widths``: the same comparison across model widths, for the shape-aware device
cost model (``plan/device_cost.py``): Llama-style dense models of hidden 64, 128, 256, 512 and
1024 and a small MoE (Qwen3-MoE, 8 experts, top-2), 5 layers each, every plan above, the CPU
clock, each round calibrated once with ``calibrate``'s own layer (not the model's: the form has
to carry one measurement across widths), median of 3 rounds. Beside each prediction the FLOPs-only
pricing of the same profile (the model before format 5). Prints one JSON object with
``max_abs_error_pct_widths`` (and ``..._flops_only``).

Machine drift (``--widths``): a shared VM's speed moves while the benchmark runs (on a 2-core
AMD EPYC VM, one fixed workload's CPU time swung 21 -> 30 ms between 2-second windows), and a
prediction from one moment's calibration is compared with a later moment's step. So a fixed
workload (``_speed_probe``: a small decoder layer's forward, median of ~0.25 s of runs) is
timed right before and after each calibration and each engine measurement; ``drift`` is the
measurement's probe time over the calibration's. Each case reports it and
``error_drift_adjusted_pct`` (the prediction scaled by its drift) beside the raw error; the
headline ``max_abs_error_pct_widths`` stays the raw one, ``..._drift_adjusted`` says how much
of it the machine's drift explains.

    python benchmarks/sim_fidelity.py [--quick]
    python benchmarks/sim_fidelity.py --widths
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
    ap.add_argument("--widths", action="store_true", help="across model widths (dense and MoE), CPU clock")
    ap.add_argument("--only", default=None, help="with --widths: comma-separated model names (a smoke run)")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--micro-batch-size", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads for calibration and engine alike (1: robust on a shared machine, "
                         "where spinning OpenMP threads slow down many-fold when cores are oversubscribed)")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(args.threads)
    if args.widths:
        return widths(args)

    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.engine.calibrate import calibrate
    from layerwise.plan.shape import ModelShape
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
    plans = _plans(L, kw)
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


WIDTHS = (64, 128, 256, 512, 1024)


def _plans(L: int, kw: dict) -> dict:
    from layerwise.plan.plan import Plan

    return {
        "keep-all-device": Plan.keep_all(L, **kw),
        "every-4": Plan.every_k(L, 4, **kw),
        "recompute-all": Plan.recompute_all(L, **kw),
        "keep-all-host": Plan.keep_all(L, "host", **kw),
        "mixed-nvme": Plan(["device", "host", "nvme", "recompute", "recompute"] * (L // 5), source="mixed", **kw),
        # kept layer internals: on the device, on the host, and mixed with the rest
        "every-4+internals-device": Plan(Plan.every_k(L, 4).boundary_tiers, internal_tiers=["device"] * L,
                                         source="every-4+internals-device", **kw),
        "internals-host": Plan(["recompute"] * L, internal_tiers=["host"] * L, source="internals-host", **kw),
        "mixed-internals": Plan(["device", "recompute", "host", "recompute", "recompute"] * (L // 5),
                                internal_tiers=["device", "host", "recompute", "recompute", "device"] * (L // 5),
                                source="mixed-internals", **kw),
    }


def _width_models() -> dict:
    """name -> config: dense Llama-style at each width (64-dim heads, half as many KV heads,
    MLP 2.75x), and a small Qwen3-MoE; 5 layers and a byte-level vocabulary each."""
    from layerwise.models.registry import Flavor

    out = {}
    for h in WIDTHS:
        heads = max(1, h // 64)
        out[f"dense-h{h}"] = Flavor(f"dense-h{h}", "llama", dict(
            vocab_size=320, hidden_size=h, intermediate_size=int(2.75 * h) // 32 * 32, num_hidden_layers=5,
            num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64,
            max_position_embeddings=2048, tie_word_embeddings=False)).build_config()
    out["moe-h256-e8"] = Flavor("moe-h256-e8", "qwen3_moe", dict(
        vocab_size=320, hidden_size=256, intermediate_size=704, moe_intermediate_size=256, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, max_position_embeddings=2048,
        tie_word_embeddings=False)).build_config()
    return out


def _flops_only(hw):
    """The same profile priced as before format 5: FLOPs at ``efficiency``, and the layer op's
    fixed cost the fitted intercept (the by-shape residual plus calibrate's layer's kernels less
    its FLOP time at the small point)."""
    from dataclasses import replace

    from layerwise.engine.calibrate import DEFAULT_POINTS
    from layerwise.models import get_flavor
    from layerwise.plan.cost import CostModel
    from layerwise.plan.device_cost import DeviceCost
    from layerwise.plan.shape import ModelShape

    shape = ModelShape.from_config(get_flavor("llama-30m").build_config())
    pt = DEFAULT_POINTS[1]
    kernels = DeviceCost(shape, hw, *pt).layer_fwd_s(0)
    flops_s = CostModel(shape, hw, *pt).layer_fwd_flops(0) / hw.fwd_flops_per_s
    return replace(hw, device_mem_gbps=None, op_overhead_s=max(0.0, hw.op_overhead_s + kernels - flops_s))


def _speed_probe():
    """A fixed workload's CPU time per run, for machine drift: a Llama-style layer of hidden 128
    (no graph) at 2 x 128 tokens, its runs for ~0.25 s, their median."""
    import torch

    from layerwise.models import DecoderAdapter
    from layerwise.store import FlatLayout

    cfg = _width_models()["dense-h128"]
    adapter = DecoderAdapter(cfg)
    layout = FlatLayout.of(adapter.units[1])
    w = torch.randn(layout.numel, generator=torch.Generator().manual_seed(0)) * 0.02
    x = torch.randn(2, 128, cfg.hidden_size, generator=torch.Generator().manual_seed(1))
    ctx = adapter.layer_context((2, 128), "cpu", torch.float32, adapter.new_rotary("cpu"))

    def probe() -> float:
        times, end = [], time.process_time() + 0.25
        while time.process_time() < end or len(times) < 5:
            t = time.process_time()
            with torch.no_grad():
                adapter.layer(0, layout.views(w), x, ctx)
            times.append(time.process_time() - t)
        return statistics.median(times)

    probe()  # warm-up
    return probe


def widths(args) -> int:
    import torch

    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.engine.batch import Batch
    from layerwise.engine.calibrate import calibrate
    from layerwise.models import DecoderAdapter
    from layerwise.models.init import build_hf_model
    from layerwise.plan.shape import ModelShape
    from layerwise.plan.simulator import simulate
    from layerwise.store import HostStore

    t0 = time.perf_counter()
    seq, mbs, m = 128, 2, 2
    rounds, steps = (2, 1) if args.quick else (3, 2)
    kw = dict(micro_batch_size=mbs, num_micro_batches=m, seq_len=seq)
    models = _width_models()
    if args.only:
        models = {n: c for n, c in models.items() if n in args.only.split(",")}
    shapes = {n: ModelShape.from_config(c, name=n) for n, c in models.items()}
    plans = {n: _plans(s.num_layers, kw) for n, s in shapes.items()}
    pred = {(n, p): [] for n in models for p in plans[n]}
    pred_flops, meas = {k: [] for k in pred}, {k: [] for k in pred}
    spill = tempfile.mkdtemp(prefix="layerwise-fidelity-widths-")
    profiles, loads = [], []
    probe = _speed_probe()
    drift = {k: [] for k in pred}
    for _ in range(rounds):
        load = os.getloadavg()[0]
        before = probe()
        hw = calibrate(quick=args.quick, cpu_time=True)
        at_calibration = (before + probe()) / 2
        old = _flops_only(hw)
        profiles.append(hw.to_dict())
        for name, cfg in models.items():
            torch.manual_seed(0)
            model, adapter = build_hf_model(cfg, seed=0), DecoderAdapter(cfg)
            g = torch.Generator().manual_seed(0)
            batches = []
            for _ in range(m):
                ids = torch.randint(0, cfg.vocab_size, (mbs, seq), generator=g)
                batches.append(Batch(ids, torch.roll(ids, -1, dims=1)))
            for pname, plan in plans[name].items():
                pred[name, pname].append(simulate(plan, shapes[name], hw, steps=2, keep_trace=False).step_s)
                pred_flops[name, pname].append(simulate(plan, shapes[name], old, steps=2, keep_trace=False).step_s)
                store = HostStore(adapter)
                store.copy_from_model(model)
                eng = StreamingEngine(adapter, store, plan, EngineConfig(spill_dir=spill))
                eng.train_step(batches)  # warm-up
                eng.synchronize()
                before = probe()
                start = time.process_time()
                for _ in range(steps):
                    eng.train_step(batches)
                eng.synchronize()
                meas[name, pname].append((time.process_time() - start) / steps)
                drift[name, pname].append((before + probe()) / 2 / at_calibration)
                eng.close()
        loads.append((load, os.getloadavg()[0]))
    cases = []
    for (name, pname), p in pred.items():
        err = [100.0 * (a - b) / b for a, b in zip(p, meas[name, pname])]
        err_old = [100.0 * (a - b) / b for a, b in zip(pred_flops[name, pname], meas[name, pname])]
        err_adj = [100.0 * (a * d - b) / b for a, b, d in zip(p, meas[name, pname], drift[name, pname])]
        cases.append({"model": name, "plan": pname, "params": shapes[name].num_params,
                      "predicted_s": statistics.median(p), "measured_s": statistics.median(meas[name, pname]),
                      "predicted_flops_only_s": statistics.median(pred_flops[name, pname]),
                      "predicted_rounds_s": p, "measured_rounds_s": meas[name, pname],
                      "error_rounds_pct": err, "error_pct": statistics.median(err),
                      "error_flops_only_pct": statistics.median(err_old),
                      "drift_rounds": [round(d, 3) for d in drift[name, pname]],
                      "error_drift_adjusted_pct": statistics.median(err_adj)})
    per_model = {n: max(abs(c["error_pct"]) for c in cases if c["model"] == n) for n in models}
    all_drift = [d for c in cases for d in c["drift_rounds"]]
    out = {
        "benchmark": "sim_fidelity_widths", "quick": args.quick,
        "inputs": {"models": list(models), "seq_len": seq, "micro_batch_size": mbs, "num_micro_batches": m,
                   "steps_per_round": steps, "rounds": rounds, "clock": "cpu (process_time)"},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "torch_threads": torch.get_num_threads()},
        "load_avg_1m_rounds": loads,
        "profiles": profiles,
        "cases": cases,
        "max_abs_error_pct_by_model": per_model,
        "max_abs_error_pct_widths": max(per_model.values()),
        "max_abs_error_pct_widths_flops_only": max(abs(c["error_flops_only_pct"]) for c in cases),
        "max_abs_error_pct_widths_drift_adjusted": max(abs(c["error_drift_adjusted_pct"]) for c in cases),
        "drift_range": [min(all_drift), max(all_drift)],
        "wall_s": time.perf_counter() - t0,
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
