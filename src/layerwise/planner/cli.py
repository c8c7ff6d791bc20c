"""``layerwise plan``: choose a plan for a model on a machine and compare it with the rules."""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from .check import CheckReport, check
from .hardware import HardwareProfile
from ..plan.finetune import BASE_DTYPES
from .hardware_choice import Machine, resolve_hardware
from .host_need import HostNeed, largest_fitting, layer_grad_bytes, plan_host_need
from .milp import MilpConfig
from .presets import preset_host_mem_bytes
from .report import (host_line, hours_per_billion_tokens, largest_line, nvme_state_line, print_report, print_scaling,
                     reserve_line, verdict_fits, verdict_unfit)
from .scaling import ScalingPoint, ladder, predict_scaling
from .search import PlanInfeasible, SearchConfig, SearchResult, search
from ..plan.shape import ModelShape, load_shape
from .simulator import simulate
from .state_traffic import nvme_state
from .timeline import draw_timeline
from .topology import GRAD_REDUCE, Topology


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan where activations live (MILP) and compare with fixed rules",
                       description="Choose, per layer boundary, keep on GPU / offload to host / NVMe / "
                                   "recompute, the micro-batch size and optimizer moments; print the plan "
                                   "against the fixed rules in the simulator and write the Plan JSON.")
    p.add_argument("--model", required=True, help="flavor name (e.g. qwen2.5-7b) or a local HF model directory")
    p.add_argument("--hardware", default=None,
                   help="preset (h200, h800, h100, a100-80g, rtx3090, rtx4090, cpu: each with the host RAM one "
                        "GPU of such a machine has, docs/planner.md) or a profile JSON from `layerwise calibrate`; "
                        "default: this machine (its GPU's preset, or cpu, with its own memory)")
    p.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    p.add_argument("--batch", default="auto", help="sequences per optimizer step (all GPUs together), or 'auto' "
                                                   "(default; with --gpus: the auto batch of one GPU, times the GPUs)")
    p.add_argument("--gpus", type=int, default=None, help="data parallel: GPUs per node; also print the predicted "
                                                          "step, tokens/s and speedup vs 1 GPU at 1, 2, 4, ... GPUs")
    p.add_argument("--nodes", type=int, default=1, help="data parallel: nodes (with --gpus)")
    p.add_argument("--grad-reduce", choices=GRAD_REDUCE, default="device",
                   help="where gradients are summed in the prediction: 'device' (reduced on the GPUs "
                        "before the copy: what `layerwise train` runs by default, dist.grad_reduce) "
                        "or 'host', see docs/design-notes.md")
    p.add_argument("--gpu-mem", type=float, default=None, help="override device memory, GB")
    p.add_argument("--host-mem", type=float, default=None,
                   help="override host memory, GB (also name the largest model of the family that fits)")
    p.add_argument("--lora", type=int, default=0, metavar="R",
                   help="plan a LoRA run of rank R (lora.r): the base frozen, only the adapters trained")
    p.add_argument("--base-dtype", choices=BASE_DTYPES, default="compute",
                   help="with --lora: the frozen base's format (lora.base_dtype): nf4 is QLoRA's 4-bit "
                        "(0.5625 B/param), int8 ~1 B/param, bf16 / compute 2 B/param")
    p.add_argument("--lora-targets", default="all-linear",
                   help="with --lora: the linears that get adapters, comma-separated (lora.target_modules)")
    p.add_argument("--prefetch-depth", type=int, default=None,
                   help="weight prefetch depth (1 = double buffer); default: the planner tries 1 and 2")
    p.add_argument("--time-limit", type=float, default=5.0, help="MILP time limit per micro-batch size, s")
    p.add_argument("--gap", type=float, default=1e-3, help="MILP relative gap to stop at")
    p.add_argument("--out", default=None, help="write the chosen Plan here (JSON the engine consumes)")
    p.add_argument("--timeline", default=None, help="write a PNG timeline of the chosen plan's step")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.set_defaults(func=plan_command, read_machine=READ_MACHINE)


READ_MACHINE = "layerwise.planner.machine:this_machine_any"
"""Without ``--hardware``: the function that reads this machine (it needs torch, imported only
then)."""


def plan_command(args: argparse.Namespace) -> int:
    """Search, check and write the plan; print the verdict and the table (or one JSON object)."""
    batch = _batch(args)
    if args.lora < 0:
        raise ValueError(f"--lora must be a rank >= 1 (0: train every parameter), got {args.lora}")
    shape = _run_shape(args, load_shape(args.model))
    machine = plan_hardware(args)
    hw = machine.for_model(layer_grad_bytes(shape, machine))  # the reserve with this model's ring
    topo = _topology(args, hw, batch)
    world = topo.world_size if topo else 1
    # the plan is what one GPU runs on its share of the batch
    cfg = SearchConfig(global_batch=None if batch is None else batch // world, prefetch_depth=args.prefetch_depth,
                       milp=MilpConfig(time_limit_s=args.time_limit, mip_rel_gap=args.gap))
    try:
        res = search(shape, hw, args.seq_len, cfg)
    except PlanInfeasible as e:
        verdict = verdict_unfit(shape, hw, args.seq_len, e)
        # the largest model that fits: asked for (--host-mem), or when host RAM binds (or the NVMe
        # that would take what the RAM cannot)
        largest = _largest(args, machine) if args.host_mem is not None or e.resource in ("host", "nvme") else _NOT_ASKED
        lines = [verdict] + ([reserve_line(machine, hw)] if e.resource == "host" else []) \
            + ([largest_line(shape, machine, largest)] if largest is not _NOT_ASKED else [])
        if args.json:
            print(json.dumps({"fits": False, "binding": e.resource, "over_bytes": e.over_bytes, "message": str(e),
                              "verdict": verdict, **_largest_json(largest, lines)}))
        else:
            print("\n".join(lines))
        return 1
    largest = _largest(args, machine) if args.host_mem is not None else _NOT_ASKED
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
    verdict = verdict_fits(shape, hw, args.seq_len, sim, global_batch, scaling)
    need = plan_host_need(shape, machine, res.plan, sim)
    lines = [verdict, host_line(shape, machine, need)]
    fig = nvme_state(shape, hw, res.plan, sim)
    nvme_row = None if fig is None else {**fig.row(), "batch": (res.plan.predicted.get("nvme_state") or {}).get("batch")}
    if fig is not None:
        lines.append(nvme_state_line(shape, res.plan, fig, nvme_row["batch"]))
    if largest is not _NOT_ASKED:
        lines.append(largest_line(shape, machine, largest))
    if args.json:
        out = _json_report(args, shape, hw, res, report, scaling, global_batch)
        print(json.dumps({**out, "verdict": verdict, "host": need.row(), "nvme_state": nvme_row,
                          **_largest_json(largest, lines)}, indent=2, default=str))
        return 0
    print("\n".join(lines))
    print_report(args.seq_len, shape, hw, res, sim, report)
    if scaling:
        print_scaling(scaling, global_batch, args.seq_len)
    if args.out:
        print(f"wrote {args.out}")
    if args.timeline:
        print(f"wrote {args.timeline}")
    return 0


def plan_hardware(args: argparse.Namespace) -> HardwareProfile:
    """``--hardware`` with ``--gpu-mem`` / ``--host-mem``, by the rules ``layerwise train`` uses
    (``planner.hardware_choice``); without ``--hardware``, this machine (``READ_MACHINE``). A preset
    planned for ``--gpus G`` has G GPUs' shares of host RAM ([HOSTMEM], ``planner/presets.py``)."""
    machine = None if args.hardware else _resolve(getattr(args, "read_machine", READ_MACHINE))()
    choice = resolve_hardware(args.hardware, machine=machine, gpu_mem_gb=args.gpu_mem, host_mem_gb=args.host_mem)
    if choice is None:
        raise ValueError("no hardware preset matches this machine's GPU; pass --hardware (a preset or a "
                         "profile from `layerwise calibrate --out profile.json`)")
    hw = choice.profile
    node_ram = preset_host_mem_bytes(args.hardware, args.gpus or 1) if args.hardware else None
    if node_ram is not None and args.host_mem is None:
        hw = replace(hw, host_mem_bytes=node_ram)
    return hw


def _resolve(spec: str) -> Callable[[], Machine]:
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _run_shape(args: argparse.Namespace, shape: ModelShape) -> ModelShape:
    """The shape of the run asked for: with ``--lora R``, a frozen base with rank-R adapters."""
    targets = [t.strip() for t in args.lora_targets.split(",") if t.strip()]
    return shape.with_lora(args.lora, targets, args.base_dtype)


_NOT_ASKED: Any = object()
"""No largest-model line: neither ``--host-mem`` nor a host-RAM refusal asked for it."""


LEANEST = SearchConfig(global_batch=1, micro_batch_sizes=(1,), prefetch_depths=(1,), per_loads=(1,),
                       milp=MilpConfig(time_limit_s=0.5), milp_budget_s=0.5)
"""The search a family size's device check runs: the least memory any plan needs (one sequence a
step, single buffering, one landing per step), so only whether a plan fits is asked."""


def _largest(args: argparse.Namespace, machine: HardwareProfile) -> tuple[str, HostNeed] | None:
    """The largest size of the model's family whose host floor fits the RAM and for which the
    search finds a plan the GPU holds (the run's LoRA settings on each size)."""
    def fits_device(shape: ModelShape) -> bool:
        try:
            search(shape, machine.for_model(layer_grad_bytes(shape, machine)), args.seq_len, LEANEST)
        except PlanInfeasible:
            return False
        return True

    return largest_fitting(args.model, machine, lambda s: _run_shape(args, s), fits_device)


def _largest_json(largest: tuple[str, HostNeed] | None, lines: list[str]) -> dict[str, Any]:
    """With ``--host-mem`` (or host RAM binding): the largest model of the family that fits, and
    the lines printed."""
    if largest is _NOT_ASKED:
        return {"lines": lines}
    fit = None if largest is None else {"model": largest[0], **largest[1].row()}
    return {"largest_fitting_model": fit, "lines": lines}


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


def _json_report(args: argparse.Namespace, shape: ModelShape, hw: HardwareProfile, res: SearchResult,
                 report: CheckReport, scaling: list[ScalingPoint], global_batch: int) -> dict[str, Any]:
    out: dict[str, Any] = {
        "fits": True, "model": shape.name, "hardware": hw.name, "seq_len": args.seq_len,
        "plan": res.plan.to_dict(), "solve_s": res.solve_s, "plan_s": res.plan_s,
        "milp": None if res.milp is None else {
            "status": res.milp.status, "objective_s": res.milp.objective_s, "bound_s": res.milp.bound_s,
            "gap": res.milp.gap, "warm_start": res.milp.warm_start},
        "global_batch": res.global_batch,
        "tokens_per_s": res.best.sim.tokens_per_s,
        "hours_per_billion_tokens": hours_per_billion_tokens(res.best.sim.tokens_per_s),
        "rules": {n: c.row() for n, c in res.by_name.items()},
        "unfit": {n: {**c.row(), "over_bytes": c.sim.over_capacity()} for n, c in res.unfit.items()},
        "max_micro_batch_size": res.max_micro_batch_size,
        "check": {"ok": report.ok, "peaks": report.peaks},
    }
    if scaling:
        out["scaling"] = {"global_batch": global_batch, "grad_reduce": args.grad_reduce,
                          "points": [pt.row() for pt in scaling]}
    return out
