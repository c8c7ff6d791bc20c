"""The measurements before the plans: calibration (with one layer timed at the run's shape),
the 8-bit optimizer against torch's fused AdamW on the device, and the planner's search.
"""

from __future__ import annotations

import inspect
import statistics
import time
from contextlib import ExitStack
from typing import Any
from unittest import mock

from .model import Large, count_moments, tier_counts

DRY_CALIBRATE = {
    "measure_mem_gbps": {"numel": 1 << 16, "repeats": 1},
    "measure_matmul_tflops": {"n": 128, "repeats": 1},
    "measure_copy_gbps": {"nbytes": 1 << 20, "repeats": 1},
    "measure_disk_gbps": {"nbytes": 1 << 20, "repeats": 1},
    "measure_optimizer": {"numel": 1 << 16, "repeats": 1},
    "measure_optimizer_8bit": {"numel": 1 << 16, "repeats": 1},
    "measure_accumulation": {"numel": 1 << 16, "repeats": 1},
    "measure_pinned_copy_gbps": {"numel": 1 << 16, "repeats": 1},
}
"""A dry run's probe sizes: ``calibrate`` has no size knob, so its probes are called with these
arguments (by name: a probe whose parameter is renamed fails the dry run)."""


def _shrunk(fn, overrides: dict[str, Any]):
    sig = inspect.signature(fn)
    missing = set(overrides) - set(sig.parameters)
    if missing:
        raise TypeError(f"calibrate.{fn.__name__} has no parameter {sorted(missing)}")

    def call(*args, **kwargs):
        bound = sig.bind(*args, **kwargs)
        bound.arguments.update(overrides)
        return fn(*bound.args, **bound.kwargs)
    return call


def measure_layer_at_shape(lg: Large) -> dict[str, Any]:
    """One decoder layer's backward as the engine runs it (``layer_ops.layer_backward``) at the
    run's micro-batch shape, in bf16 on a GPU: FLOP rate by the cost model's count (3x forward),
    best of 3."""
    import torch
    from layerwise.engine.layer_ops import layer_backward
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS
    from layerwise.store import FlatLayout

    dev, adapter, shape, mbs, seq = lg.dev, lg.adapter, lg.shape, lg.mbs, lg.seq
    dtype = torch.bfloat16 if dev.is_cuda else torch.float32  # as calibrate times each device
    layout = FlatLayout.of(adapter.units[1])
    gen = dev.generator(1)
    w = torch.randn(layout.numel, device=dev.name, generator=gen).mul_(0.02).to(dtype)
    for spec, view in zip(layout.specs, layout.views(w).values()):
        if len(spec.shape) < 2:
            view.fill_(1.0 if "norm" in spec.local else 0.0)
    x = torch.randn(mbs, seq, shape.hidden_size, device=dev.name, generator=gen).to(dtype)
    grad_out = torch.randn_like(x)
    ctx = adapter.layer_context((mbs, seq), dev.name, dtype, adapter.new_rotary(dev.name))

    best = dev.best_s(lambda: layer_backward(adapter, 0, layout, w, x, grad_out, ctx), 3)
    flops = 3.0 * CostModel(shape, PRESETS["h200"], mbs, seq).layer_fwd_flops(0)
    w = x = grad_out = None  # freed before the cache is emptied
    dev.clean()
    return {"layer_bwd_s": best, "layer_bwd_flops": flops, "layer_bwd_tflops": flops / best / 1e12}


def run_calibration(lg: Large, quick: bool, data: dict[str, Any]) -> None:
    from dataclasses import replace

    from layerwise.planner import calibrate as cal

    t = time.perf_counter()
    with ExitStack() as stack:
        if lg.dev.dry_run:
            for name, over in DRY_CALIBRATE.items():
                stack.enter_context(mock.patch.object(cal, name, _shrunk(getattr(cal, name), over)))
        profile = cal.calibrate(quick=quick, device=lg.dev.name, model=lg.adapter.config)
    cal_s = time.perf_counter() - t
    profile = replace(profile, host_mem_bytes=max(lg.host_budget_bytes, profile.host_reserved_bytes + 1))
    lg.profiles["calibrated"] = profile
    layer = measure_layer_at_shape(lg)
    peak = max(profile.peak_tflops, layer["layer_bwd_tflops"])
    shaped = replace(profile, name=f"{profile.name}-at-shape", peak_tflops=peak,
                     efficiency=min(1.0, layer["layer_bwd_tflops"] / peak))
    lg.profiles["calibrated-shape"] = shaped
    data.update(calibrate_s=round(cal_s, 3), quick=quick,
                probes="dry-run sizes" if lg.dev.dry_run else "calibrate's own", profile=profile.to_dict(), layer_at_shape=layer,
                profile_at_shape={"peak_tflops": shaped.peak_tflops, "efficiency": shaped.efficiency},
                host_mem_bytes=profile.host_mem_bytes, host_mem_figure="--host-budget-gb")


def run_optimizer(lg: Large, layers: int, rounds: int, data: dict[str, Any]) -> None:
    """``AdamW8bit`` against ``torch.optim.AdamW(fused=True)`` on the same device params
    (``layers`` decoder layers' tensors), interleaved rounds, medians; with and without a clip."""
    import torch
    from layerwise.optim.adamw8bit import AdamW8bit

    dev = lg.dev
    shapes = [spec.shape for spec in lg.adapter.units[1].params] * layers
    gen = dev.generator(2)
    p0 = [torch.randn(s, device=dev.name, generator=gen).mul_(0.02) for s in shapes]
    grads = [torch.randn(s, device=dev.name, generator=gen).mul_(1e-3) for s in shapes]
    numel = sum(p.numel() for p in p0)
    hp = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)

    def params():
        ps = [torch.nn.Parameter(p.clone()) for p in p0]
        for p, g in zip(ps, grads):
            p.grad = g  # shared, read-only for both optimizers
        return ps

    fused_p, q_p = params(), params()
    fused = torch.optim.AdamW(fused_p, fused=True, **hp)
    q8 = AdamW8bit(q_p, moments="8bit", **hp)
    # three steps from one start: the 8-bit trajectory's distance from the fp32 one, relative
    # to how far the fp32 one moved (step 1 uses exact moments; later steps quantised ones)
    for _ in range(3):
        fused.step()
        q8.step()
    dev.sync()
    with torch.no_grad():
        moved = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(fused_p, p0)))
        diff = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(q_p, fused_p)))

    def state_bytes(opt) -> int:
        return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                   if torch.is_tensor(t) and t.dim() > 0)

    q8_clip = AdamW8bit(q_p, moments="8bit", max_grad_norm=1.0, **hp)  # its own state, same params
    saved = [g.clone() for g in grads]  # clip_grad_norm_ scales the shared grads: restored each round

    def fused_clip():
        torch.nn.utils.clip_grad_norm_(fused_p, 1.0)
        fused.step()

    t_fused, t_q8, t_fused_clip, t_q8_clip = [], [], [], []
    for _ in range(rounds):  # interleaved, so drift hits both alike
        t_fused.append(dev.timed(fused.step))
        t_q8.append(dev.timed(q8.step))
        t_q8_clip.append(dev.timed(q8_clip.step))
        t_fused_clip.append(dev.timed(fused_clip))
        for g, s in zip(grads, saved):
            g.copy_(s)
    med = statistics.median
    data.update({
        "params": numel, "tensors": len(shapes), "rounds": rounds,
        "shapes": f"{layers} x the decoder-layer parameters of {lg.flavor}",
        "adamw8bit_step_s": med(t_q8), "torch_fused_step_s": med(t_fused),
        "step_ratio_vs_torch_fused": med(t_q8) / med(t_fused),
        "adamw8bit_clip_step_s": med(t_q8_clip), "torch_fused_clip_step_s": med(t_fused_clip),
        "step_ratio_with_clip": med(t_q8_clip) / med(t_fused_clip),
        "adamw8bit_params_per_s": numel / med(t_q8), "torch_fused_params_per_s": numel / med(t_fused),
        "adamw8bit_state_bytes_per_param": state_bytes(q8) / numel,
        "torch_fused_state_bytes_per_param": state_bytes(fused) / numel,
        "update_rel_diff_after_3_steps": float(diff / moved),
    })
    fused = q8 = q8_clip = fused_p = q_p = p0 = grads = saved = None  # freed before the cache is emptied
    dev.clean()


def run_planner(lg: Large, milp_budget_s: float, data: dict[str, Any]) -> None:
    """``planner.search`` at the run's micro-batch size and count with the best profile there is;
    its moments are replaced by the run's (one store serves every plan), both reported."""
    from layerwise.planner.search import SearchConfig, search

    name, hw = lg.best_profile()
    cfg = SearchConfig(global_batch=lg.mbs * lg.nmb, micro_batch_sizes=(lg.mbs,), prefetch_depth=1,
                       milp_budget_s=milp_budget_s)
    res = search(lg.shape, hw, lg.seq, cfg)
    plan = res.plan
    chosen = list(plan.moments or [])
    plan.moments = list(lg.moments)
    lg.planner_plan = plan
    data.update({
        "hardware": name, "host_mem_bytes": hw.host_mem_bytes, "host_mem_figure": "--host-budget-gb",
        "milp_budget_s": milp_budget_s, "plan_s": res.plan_s, "milp_solve_s": res.solve_s,
        "source": plan.source, "boundaries": plan.boundary_tiers, "tiers": tier_counts(plan.boundary_tiers),
        "micro_batch_size": plan.micro_batch_size, "num_micro_batches": plan.num_micro_batches,
        "prefetch_depth": plan.prefetch_depth, "moments_chosen": count_moments(chosen),
        "moments_used": count_moments(plan.moments), "predicted": plan.predicted,
        "rules_simulated": {n: c.sim.summary()["step_s"] for n, c in res.by_name.items()},
    })
