"""The plans on the large model (in ``model.candidate_plans``' order), and the simulator against
them. Every plan trains the one store (each continues from the last one's weights): a fresh
engine, a warm-up step, timed steps back to back, then one step under ``torch.profiler`` whose
trace gives the copies' bandwidth and overlap with compute.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .model import LAYER_MAJOR, Large, tier_counts
from .report import StageSkipped
from .store import host_allocator_stats, run_store
from .trace import copy_overlap, load_trace_events


def make_batches(lg: Large, seed: int, count: int | None = None, packed: bool = False):
    """Random micro-batches; ``packed``: each row holds examples of uneven lengths (about an
    eighth, a quarter and the rest of the row, then padding), as ``data.packing`` makes them."""
    import torch
    from layerwise.engine.batch import IGNORE_INDEX, Batch

    g = torch.Generator().manual_seed(seed)
    vocab = lg.shape.vocab_size
    out = []
    for _ in range(lg.nmb if count is None else count):
        ids = torch.randint(0, vocab, (lg.mbs, lg.seq), generator=g)
        labels = torch.randint(0, vocab, (lg.mbs, lg.seq), generator=g)
        seg = None
        if packed:
            s = lg.seq
            cuts = [0, max(1, s // 8), max(2, s // 8 + s // 4), max(3, s - s // 16), s]
            seg = torch.empty(lg.mbs, s, dtype=torch.long)
            for k, (a, b) in enumerate(zip(cuts, cuts[1:])):
                seg[:, a:b] = k if k < 3 else -1  # the last run is padding
            labels[seg < 0] = IGNORE_INDEX
        out.append(Batch(ids, labels, seg))
    return out


def _profiled_step(lg: Large, engine, batches, lr: float, name: str, trace_dir: str | None) -> dict[str, Any]:
    from torch.profiler import ProfilerActivity, profile

    dev = lg.dev
    with tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-trace-") as d:
        dev.sync()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.is_cuda else [])
        t = time.perf_counter()
        with profile(activities=activities) as prof:
            engine.train_step(batches, lr)
            engine.synchronize()
            dev.sync()
        step_s = time.perf_counter() - t
        path = Path(d) / f"trace-{name}.json"
        prof.export_chrome_trace(str(path))
        if trace_dir:
            Path(trace_dir).mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, Path(trace_dir) / path.name)
        ov = copy_overlap(load_trace_events(path))
        ov.update(profiled_step_s=step_s, trace_bytes=path.stat().st_size)
    return ov


def _examples_per_row(batch) -> int:
    """Examples in the first row (1: unpacked; padding not counted)."""
    seg = batch.segment_ids
    return 1 if seg is None else int(seg[0][seg[0] >= 0].unique().numel())


def run_plan(lg: Large, name: str, plan, batches, steps: int, lr: float, profile: bool,
             trace_dir: str | None, data: dict[str, Any]) -> None:
    import torch
    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS

    dev, mbs, nmb, seq = lg.dev, lg.mbs, plan.num_micro_batches, lg.seq
    store = lg.store
    data.update(source=plan.source, tiers=tier_counts(plan.boundary_tiers), boundaries=plan.boundary_tiers,
                prefetch_depth=plan.prefetch_depth, micro_batch_size=mbs, num_micro_batches=nmb, seq_len=seq,
                micro_batches_per_load=plan.micro_batches_per_load,
                examples_per_row=_examples_per_row(batches[0]),
                device_cap_bytes=lg.device_budget_bytes,
                store={"grad_dtype": str(store.layers[0].grad.dtype).removeprefix("torch."),
                       "split_master": bool(getattr(store, "split_master", False)),
                       "moments": dict(Counter(plan.moments or ["fp32"]))})
    dev.clean()
    dev.reset_peak()
    base_reserved, base_alloc = dev.mem("memory_reserved"), dev.mem("memory_allocated")
    spill = tempfile.mkdtemp(prefix="layerwise-gpu-check-spill-")
    t = time.perf_counter()
    engine = StreamingEngine(lg.adapter, lg.store, plan, EngineConfig(
        device=dev.engine_device, compute_dtype=torch.bfloat16, spill_dir=spill, async_seed=None,
        device_mem_cap_bytes=lg.device_budget_bytes))
    data["engine_init_s"] = round(time.perf_counter() - t, 3)
    try:
        pred = engine.predict_memory(mbs, seq)
        data.update(predicted_peak_bytes=pred.peak_bytes, predicted_peak_op=pred.peak_op,
                    predicted_breakdown=pred.breakdown)
        t = time.perf_counter()
        warm = engine.train_step(batches, lr)  # first-use costs: cuBLAS, pinned staging, kernels
        engine.synchronize()
        dev.sync()
        data["warmup_step_s"] = round(time.perf_counter() - t, 3)
        stats, marks = [], []
        t0 = time.perf_counter()
        for _ in range(steps):  # back to back: each forward waits per unit for the last update
            stats.append(engine.train_step(batches, lr))
            marks.append(time.perf_counter())
        engine.synchronize()
        dev.sync()
        step_s = (time.perf_counter() - t0) / steps
        flops = CostModel(lg.shape, PRESETS["h200"], mbs, seq).model_flops() * nmb
        peak_tflops = lg.best_profile()[1].peak_tflops
        reserved = dev.mem("max_memory_reserved") - base_reserved if dev.is_cuda else None
        allocated = dev.mem("max_memory_allocated") - base_alloc if dev.is_cuda else None
        data.update({
            "steps": steps, "step_s": step_s,
            "step_return_intervals_s": [b - a for a, b in zip([t0] + marks[:-1], marks)],
            "tokens_per_step": mbs * seq * nmb, "tokens_per_s": mbs * seq * nmb / step_s,
            "model_flops_per_step": flops, "tflops": flops / step_s / 1e12,
            "mfu": flops / step_s / 1e12 / peak_tflops, "mfu_peak_tflops": peak_tflops,
            "losses": [warm.loss] + [s.loss for s in stats],
            "grad_norms": [warm.grad_norm] + [s.grad_norm for s in stats],
            "skipped_steps": sum(s.skipped for s in [warm, *stats]),
            "device_peak_reserved_bytes": reserved, "device_peak_allocated_bytes": allocated,
            "reserved_over_predicted": reserved / pred.peak_bytes if reserved is not None else None,
            "allocated_over_predicted": allocated / pred.peak_bytes if allocated is not None else None,
            "profile": None, "h2d_gbps": None, "d2h_gbps": None, "copy_overlap_fraction": None,
        })
        lg.measured[name] = (plan, data)  # for the simulator, even if the profiled step fails
        if profile:
            ov = _profiled_step(lg, engine, batches, lr, name, trace_dir)
            data.update(profile=ov, h2d_gbps=ov["h2d"]["gbps_active"], d2h_gbps=ov["d2h"]["gbps_active"],
                        copy_overlap_fraction=ov["all_async_copies"]["overlap_fraction"])
        data["host_allocator_after"] = host_allocator_stats(torch)
    finally:
        engine.close()
        del engine
        shutil.rmtree(spill, ignore_errors=True)
        dev.clean()


def run_layer_major(lg: Large, plan, args, data: dict[str, Any]) -> None:
    """The production path: the store rebuilt with bf16 gradients (the previous one let go
    first), then the layer-major plan on batches of its own count."""
    lg.store = None
    lg.dev.clean()
    built: dict = {}
    run_store(lg, args.seed, built, grad_dtype="bfloat16")
    batches = make_batches(lg, args.seed + 1, plan.num_micro_batches)
    run_plan(lg, LAYER_MAJOR, plan, batches, args.steps, args.lr, args.profile, args.trace_dir, data)
    data["store_nbytes"] = built["store_nbytes"]


def run_simulator(lg: Large, data: dict[str, Any]) -> None:
    """The simulator's step for each measured plan under each profile, against the measurement."""
    from layerwise.planner.simulator import simulate

    if not lg.measured:
        raise StageSkipped("no plan was measured")
    data.update(profiles={n: p.to_dict() for n, p in lg.profiles.items()}, max_abs_error_pct={}, runs=[])
    for name, (plan, rec) in lg.measured.items():
        for pname, hw in lg.profiles.items():
            sim = simulate(plan, lg.shape, hw, keep_trace=False)
            err = (sim.step_s - rec["step_s"]) / rec["step_s"] * 100
            data["runs"].append({"plan": name, "profile": pname, "step_s": sim.step_s, "measured_step_s": rec["step_s"],
                                 "error_pct": err, "fits": sim.fits, "peak_device_bytes": sim.peak_device_bytes,
                                 "busy_s": sim.busy_s})
            cur = data["max_abs_error_pct"].get(pname)
            data["max_abs_error_pct"][pname] = abs(err) if cur is None else max(cur, abs(err))
