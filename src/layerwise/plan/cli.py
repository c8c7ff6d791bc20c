"""``layerwise plan``: choose a plan for a model on a machine and compare it with the rules."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .check import CheckReport, check
from .hardware import HardwareProfile, get_hardware
from .milp import MilpConfig
from .scaling import ScalingPoint, ladder, predict_scaling
from .search import Candidate, PlanInfeasible, SearchConfig, SearchResult, search
from .shape import ModelShape, load_shape
from .simulator import SimResult, simulate
from .timeline import draw_timeline
from .topology import GRAD_REDUCE, Topology


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan where activations live (MILP) and compare with fixed rules",
                       description="Choose, per layer boundary, keep on GPU / offload to host / NVMe / "
                                   "recompute, the micro-batch size and optimizer moments; print the plan "
                                   "against the fixed rules in the simulator and write the Plan JSON.")
    p.add_argument("--model", required=True, help="flavor name (e.g. qwen2.5-7b) or a local HF model directory")
    p.add_argument("--hardware", required=True, help="preset (h200, h800, h100, a100-80g, rtx3090, rtx4090, cpu) "
                                                     "or a profile JSON from `layerwise calibrate`")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", default="auto", help="sequences per optimizer step (all GPUs together), or 'auto' "
                                                   "(default; with --gpus: the auto batch of one GPU, times the GPUs)")
    p.add_argument("--gpus", type=int, default=None, help="data parallel: GPUs per node; also print the predicted "
                                                          "step, tokens/s and speedup vs 1 GPU at 1, 2, 4, ... GPUs")
    p.add_argument("--nodes", type=int, default=1, help="data parallel: nodes (with --gpus)")
    p.add_argument("--grad-reduce", choices=GRAD_REDUCE, default="host",
                   help="where gradients are summed in the prediction: 'host' (what `layerwise train` runs) or "
                        "'device' (reduced on the GPUs before the copy), see docs/design-notes.md")
    p.add_argument("--gpu-mem", type=float, default=None, help="override device memory, GB")
    p.add_argument("--host-mem", type=float, default=None, help="override host memory, GB")
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help="weight prefetch depth (1 = double buffer); default: the planner tries 1 and 2")
    p.add_argument("--time-limit", type=float, default=5.0, help="MILP time limit per micro-batch size, s")
    p.add_argument("--gap", type=float, default=1e-3, help="MILP relative gap to stop at")
    p.add_argument("--out", default=None, help="write the chosen Plan here (JSON the engine consumes)")
    p.add_argument("--timeline", default=None, help="write a PNG timeline of the chosen plan's step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=plan_command)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f}"


def plan_command(args: argparse.Namespace) -> int:
    """Search, check and write the plan; print the table (or one JSON object)."""
    batch = _batch(args)
    shape = load_shape(args.model)
    hw = get_hardware(args.hardware).with_memory(args.gpu_mem, args.host_mem)
    topo = _topology(args, hw, batch)
    world = topo.world_size if topo else 1
    # the plan is what one GPU runs on its share of the batch
    cfg = SearchConfig(global_batch=None if batch is None else batch // world, prefetch_depth=args.prefetch_depth,
                       milp=MilpConfig(time_limit_s=args.time_limit, mip_rel_gap=args.gap))
    try:
        res = search(shape, hw, args.seq_len, cfg)
    except PlanInfeasible as e:
        if args.json:
            print(json.dumps({"fits": False, "binding": e.resource, "over_bytes": e.over_bytes, "message": str(e)}))
        else:
            print(f"layerwise plan: {e}", file=sys.stderr)
        return 1
    sim = simulate(res.plan, shape, hw)
    report = check(sim, shape, hw)
    if not report.ok:  # the search only keeps fitting plans; this is a bug if it happens
        raise AssertionError("emitted plan fails the feasibility check: " + "; ".join(report.violations[:3]))
    if args.out:
        res.plan.save(args.out)
    if args.timeline:
        draw_timeline(sim, args.timeline)
    scaling: list[ScalingPoint] = []
    global_batch = res.plan.micro_batch_size * res.plan.num_micro_batches * world
    if topo is not None:
        scaling = predict_scaling(shape, hw, res.plan, global_batch,
                                  ladder(topo.gpus_per_node, topo.nodes, args.grad_reduce))
    if args.json:
        print(json.dumps(_json_report(args, shape, hw, res, report, scaling, global_batch), indent=2, default=str))
        return 0
    _print_report(args, shape, hw, res, sim, report)
    if scaling:
        _print_scaling(scaling, global_batch, args.seq_len)
    if args.out:
        print(f"wrote {args.out}")
    if args.timeline:
        print(f"wrote {args.timeline}")
    return 0


def _batch(args: argparse.Namespace) -> int | None:
    """``--batch`` in sequences (None: auto), after checking it and ``--seq-len``."""
    if args.seq_len < 1:
        raise ValueError(f"--seq-len must be >= 1, got {args.seq_len}")
    if args.batch == "auto":
        return None
    try:
        batch = int(args.batch)
    except ValueError:
        raise ValueError(f"--batch must be a number of sequences or 'auto', got {args.batch!r}") from None
    if batch < 1:
        raise ValueError(f"--batch must be >= 1, got {batch}")
    return batch


def _topology(args: argparse.Namespace, hw: HardwareProfile, batch: int | None) -> Topology | None:
    """The data-parallel topology of ``--gpus`` / ``--nodes`` (None: one GPU)."""
    if args.gpus is None and args.nodes == 1:
        return None
    topo = Topology(args.gpus or 1, args.nodes, args.grad_reduce)
    topo.check(hw)
    if batch is not None and batch % topo.world_size:
        raise ValueError(f"--batch {batch} does not split over {topo.world_size} GPUs; use a multiple of "
                         f"{topo.world_size}")
    return topo


def _rows(res: SearchResult) -> list[tuple[str, Candidate]]:
    """The emitted plan first, then every rule (and the MILP's own plan), fastest first."""
    return [("plan", res.best)] + sorted(((n, c) for n, c in res.by_name.items()),
                                         key=lambda nc: -nc[1].sim.tokens_per_s)


def _json_report(args: argparse.Namespace, shape: ModelShape, hw: HardwareProfile, res: SearchResult,
                 report: CheckReport, scaling: list[ScalingPoint], global_batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fits": True, "model": shape.name, "hardware": hw.name, "seq_len": args.seq_len,
        "plan": res.plan.to_dict(), "solve_s": res.solve_s, "plan_s": res.plan_s,
        "milp": None if res.milp is None else {
            "status": res.milp.status, "objective_s": res.milp.objective_s, "bound_s": res.milp.bound_s,
            "gap": res.milp.gap, "warm_start": res.milp.warm_start},
        "rules": {n: c.row() for n, c in _rows(res)[1:]},
        "max_micro_batch_size": res.max_micro_batch_size,
        "check": {"ok": report.ok, "peaks": report.peaks},
    }
    if scaling:
        out["scaling"] = {"global_batch": global_batch, "grad_reduce": args.grad_reduce,
                          "points": [pt.row() for pt in scaling]}
    return out


def _print_report(args: argparse.Namespace, shape: ModelShape, hw: HardwareProfile, res: SearchResult,
                  sim: SimResult, report: CheckReport) -> None:
    """The machine, the table of the plan against every rule, the MILP's figures, the plan."""
    p = res.plan
    counts = {t: p.boundary_tiers.count(t) for t in ("device", "host", "nvme", "recompute") if t in p.boundary_tiers}
    internal = {t: p.internal_tiers.count(t) for t in ("device", "host", "recompute") if t in p.internal_tiers}
    n8 = (p.moments or []).count("8bit")
    print(f"{shape.name} ({shape.num_params / 1e9:.2f}B params, {shape.num_layers} layers) on {hw.name}: "
          f"device {_gb(hw.device_cap_bytes)} GB usable, host {_gb(hw.host_cap_bytes)} GB usable; "
          f"seq {args.seq_len}, batch {p.micro_batch_size * p.num_micro_batches} "
          f"({p.micro_batch_size} x {p.num_micro_batches} micro-batches)")
    head = (f"{'rule':<30}{'mbs x n':>9}{'step s':>10}{'tokens/s':>11}{'TFLOPS':>8}{'dev GB':>8}{'host GB':>9}"
            f"{'vs plan':>9}{'max mbs':>9}")
    print(head)
    print("-" * len(head))
    best_tps = res.best.sim.tokens_per_s
    for name, c in _rows(res):
        label = f"plan ({p.source})" if name == "plan" else name
        s = c.sim
        print(f"{label:<30}{c.plan.micro_batch_size:>4} x{c.plan.num_micro_batches:>3}{s.step_s:>10.3f}"
              f"{s.tokens_per_s:>11,.0f}{s.achieved_tflops:>8.1f}{_gb(s.peak_device_bytes):>8}"
              f"{_gb(s.peak_host_bytes):>9}{s.tokens_per_s / best_tps:>9.2f}"
              f"{res.max_micro_batch_size.get(c.name, 0):>9}")
    m = res.milp
    if m is not None:
        print(f"MILP at micro-batch {p.micro_batch_size}: {m.status}, model step {m.objective_s:.3f} s, bound {m.bound_s:.3f} s, gap {m.gap:.2%}, "
              f"warm start {m.warm_start or 'none'}; HiGHS {res.solve_s:.2f} s, search {res.plan_s:.2f} s")
    print(f"boundaries: {', '.join(f'{v} {k}' for k, v in counts.items())}; "
          f"layer internals: {', '.join(f'{v} {k}' for k, v in internal.items())}; prefetch depth {p.prefetch_depth}; "
          f"optimizer moments: "
          f"{len(p.moments or []) - n8} units fp32, {n8} units 8-bit; check: ok "
          f"(peak device {_gb(report.peaks['device'])} GB, host {_gb(report.peaks['host'])} GB)")
    print("busy per step: " + ", ".join(f"{k} {v:.2f}s" for k, v in sim.busy_s.items() if v > 0))


def _print_scaling(points: list[ScalingPoint], global_batch: int, seq_len: int) -> None:
    reduce = points[0].topology.grad_reduce
    print(f"data parallel, predicted: global batch {global_batch} x {seq_len} tokens, the plan's tiers on every "
          f"GPU, gradients summed on the {reduce}; speedup vs 1 GPU on the same batch")
    head = f"{'GPUs':>6}{'nodes':>6}{'mbs x n':>9}{'step s':>10}{'tokens/s':>12}{'speedup':>9}{'eff':>6}  bound (busy share of the step)"
    print(head)
    print("-" * len(head))
    for pt in points:
        t, p = pt.topology, pt.plan
        busy = pt.busy_fractions()
        second = sorted(busy, key=lambda k: -busy[k])[1]
        fits = "" if pt.sim.fits else f"  DOES NOT FIT: {', '.join(pt.sim.over_capacity())}"
        print(f"{t.world_size:>6}{t.nodes:>6}{p.micro_batch_size:>4} x{p.num_micro_batches:>3}{pt.step_s:>10.3f}"
              f"{pt.tokens_per_s:>12,.0f}{pt.speedup:>9.2f}{pt.efficiency:>6.2f}  {pt.bound} {busy[pt.bound]:.0%}"
              f" (then {second} {busy[second]:.0%}){fits}")
