"""The large-model stages before the plans: the model (sized to the host budget), calibration,
the 8-bit optimizer on the device, the planner, and the 4.5B-parameter store.

``Large`` carries what later stages need from earlier ones. A dry run gives every stage a tiny
model and small probes; the Python that runs is the same.
"""

from __future__ import annotations

import inspect
import statistics
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

from gpu_check_device import Dev, process_rss_bytes

GIB = 2**30
GB = 10**9

HOST_MARGIN_BYTES = 16 * GIB
"""Host RAM kept free beside the store and the pinned activations: the process itself, the
CUDA context, the profiler's trace, the page cache of the NVMe tier."""
HOST_FRACTION = 0.85
"""At most this share of the host budget goes to the store, activations and margin."""
DEVICE_MARGIN_BYTES = 3 * GIB
"""GPU memory no plan's predicted peak may take: what the memory model does not see (the CUDA
context's share of the card, allocator fragmentation even with expandable segments, the
profiler's buffers, kernels' workspaces it does not price). The model is sized, and every engine
capped (``EngineConfig.device_mem_cap_bytes``), at the GPU's memory less this."""


@dataclass
class Large:
    dev: Dev
    flavor: str
    host_budget_bytes: int
    mbs: int
    seq: int
    nmb: int
    moments_kind: str
    shape: Any = None
    adapter: Any = None
    moments: list[str] = field(default_factory=list)
    profiles: dict[str, Any] = field(default_factory=dict)
    planner_plan: Any = None
    store: Any = None
    measured: dict[str, tuple[Any, dict[str, Any]]] = field(default_factory=dict)
    device_budget_bytes: int | None = None
    """The GPU's memory less ``DEVICE_MARGIN_BYTES`` (a dry run: the h200 preset's)."""

    def peak_tflops(self) -> float:
        for name in ("calibrated-shape", "calibrated", "h200"):
            if name in self.profiles:
                return self.profiles[name].peak_tflops
        raise AssertionError("no hardware profile")

    def planner_profile(self) -> tuple[str, Any]:
        for name in ("calibrated-shape", "calibrated", "h200"):
            if name in self.profiles:
                return name, self.profiles[name]
        raise AssertionError("no hardware profile")


def _state_nbytes(numels: list[int], kind: str) -> int:
    from layerwise.optim import adamw, adamw8bit

    fn = adamw8bit.state_nbytes if kind == "8bit" else adamw.state_nbytes
    return sum(fn(n) for n in numels)


def cuda_peak_bytes(shape, plan, mbs: int, seq: int) -> int:
    """A plan's predicted device peak on CUDA in bf16, as the engine predicts it there (cuBLAS's
    flat workspace, the attention kernel's by shape)."""
    from layerwise.plan.memory import CUDA_WORKSPACE_BYTES, predict_peak_device_bytes

    return predict_peak_device_bytes(shape, plan, mbs, seq, 2, workspace_bytes=CUDA_WORKSPACE_BYTES,
                                     attention_workspace=True).peak_bytes


def device_fit(lg: Large) -> tuple[str, int]:
    """The plan of the check with the largest predicted CUDA peak on ``lg.shape``, and that peak."""
    from gpu_check_plans import candidate_plans

    peaks = [(name, cuda_peak_bytes(lg.shape, p, lg.mbs, lg.seq)) for name, p, _ in candidate_plans(lg)
             if p is not None]
    return max(peaks, key=lambda x: x[1])


def device_memory(lg: Large) -> tuple[int, str]:
    """The GPU's memory and where the figure comes from."""
    from layerwise.plan.presets import PRESETS

    if lg.dev.is_cuda:
        return int(lg.dev.torch.cuda.get_device_properties(0).total_memory), "cuda total_memory"
    return PRESETS["h200"].device_mem_bytes, "h200 preset (dry run)"


def run_model(lg: Large, layers_requested: int, data: dict[str, Any]) -> None:
    """The model every later stage uses: the flavor's widths with ``layers_requested`` layers,
    fewer (by two) until the store with its optimizer state, keep-all-host's pinned boundaries
    and ``HOST_MARGIN_BYTES`` fit in ``HOST_FRACTION`` of the host budget and every plan's
    predicted CUDA peak fits the GPU less ``DEVICE_MARGIN_BYTES``."""
    import torch
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.plan.cost import CostModel
    from layerwise.plan.presets import PRESETS
    from layerwise.plan.shape import ModelShape
    from layerwise.store import store_footprint

    flavor = get_flavor(lg.flavor)
    layers = layers_requested
    device_mem, device_figure = device_memory(lg)
    lg.device_budget_bytes = device_mem - DEVICE_MARGIN_BYTES
    while True:
        cfg = flavor.build_config(num_hidden_layers=layers)
        adapter = DecoderAdapter(cfg)
        shape = ModelShape.from_config(cfg, name=f"{lg.flavor}[{layers} layers]")
        numels = [shape.unit_params(u) for u in shape.unit_names()]
        foot = store_footprint(adapter, torch.bfloat16, pin=True, state_nbytes=_state_nbytes(numels, lg.moments_kind))
        acts = layers * lg.mbs * lg.seq * shape.hidden_size * 2 * lg.nmb
        lg.shape, lg.moments = shape, [lg.moments_kind] * len(numels)
        peak_plan, peak = device_fit(lg)
        fits_host = foot.total + acts + HOST_MARGIN_BYTES <= HOST_FRACTION * lg.host_budget_bytes
        if (fits_host and peak <= lg.device_budget_bytes) or layers <= 2:
            break
        layers -= 2
    lg.adapter = adapter
    lg.profiles["h200"] = PRESETS["h200"].with_memory(host_mem_gb=lg.host_budget_bytes / GB)
    data.update({
        "flavor": lg.flavor, "source": flavor.note, "family": flavor.family,
        "num_layers": layers, "num_layers_requested": layers_requested,
        "num_layers_full": flavor.build_config().num_hidden_layers,
        "hidden_size": shape.hidden_size, "intermediate_size": shape.intermediate_size,
        "num_heads": shape.num_heads, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
        "vocab_size": shape.vocab_size, "tied": shape.tied, "num_params": shape.num_params,
        "seq_len": lg.seq, "micro_batch_size": lg.mbs, "num_micro_batches": lg.nmb,
        "tokens_per_step": lg.mbs * lg.seq * lg.nmb,
        "model_flops_per_step": CostModel(shape, PRESETS["h200"], lg.mbs, lg.seq).model_flops() * lg.nmb,
        "compute_dtype": "bfloat16", "moments": lg.moments_kind,
        "store_bytes_estimate": foot.total, "store_pinned_bytes_estimate": foot.pinned,
        "host_activation_bytes_estimate": acts, "host_budget_bytes": lg.host_budget_bytes,
        "device_mem_bytes": device_mem, "device_mem_figure": device_figure,
        "device_margin_bytes": DEVICE_MARGIN_BYTES, "device_budget_bytes": lg.device_budget_bytes,
        "device_peak_predicted_bytes": peak, "device_peak_plan": peak_plan,
        "fits_device": peak <= lg.device_budget_bytes,
        "data": "random token ids and labels (seeded), every position a target",
    })


DRY_CALIBRATE = {
    "measure_layer": {"points": ((1, 16), (1, 8)), "repeats": 1},
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
    from layerwise.plan.cost import CostModel
    from layerwise.plan.presets import PRESETS
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

    def run():
        layer_backward(adapter, 0, layout, w, x, grad_out, ctx)

    run()
    dev.sync()
    times = []
    for _ in range(3):
        t = time.perf_counter()
        run()
        dev.sync()
        times.append(time.perf_counter() - t)
    flops = 3.0 * CostModel(shape, PRESETS["h200"], mbs, seq).layer_fwd_flops(0)
    w = x = grad_out = None  # freed before the cache is emptied
    dev.clean()
    return {"layer_bwd_s": min(times), "layer_bwd_flops": flops, "layer_bwd_tflops": flops / min(times) / 1e12}


def run_calibration(lg: Large, quick: bool, data: dict[str, Any]) -> None:
    from dataclasses import replace

    from layerwise.engine import calibrate as cal

    t = time.perf_counter()
    with ExitStack() as stack:
        if lg.dev.dry_run:
            for name, over in DRY_CALIBRATE.items():
                stack.enter_context(mock.patch.object(cal, name, _shrunk(getattr(cal, name), over)))
        profile = cal.calibrate(quick=quick, device=lg.dev.name, model=lg.adapter.config, seq_len=lg.seq,
                                micro_batch_size=lg.mbs)
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

    def timed(fn) -> float:
        dev.sync()
        t = time.perf_counter()
        fn()
        dev.sync()
        return time.perf_counter() - t

    q8_clip = AdamW8bit(q_p, moments="8bit", max_grad_norm=1.0, **hp)  # its own state, same params
    saved = [g.clone() for g in grads]  # clip_grad_norm_ scales the shared grads: restored each round

    def fused_clip():
        torch.nn.utils.clip_grad_norm_(fused_p, 1.0)
        fused.step()

    t_fused, t_q8, t_fused_clip, t_q8_clip = [], [], [], []
    for _ in range(rounds):  # interleaved, so drift hits both alike
        t_fused.append(timed(fused.step))
        t_q8.append(timed(q8.step))
        t_q8_clip.append(timed(q8_clip.step))
        t_fused_clip.append(timed(fused_clip))
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


def tier_counts(tiers: list[str]) -> dict[str, int]:
    return {t: tiers.count(t) for t in ("device", "host", "nvme", "recompute")}


def count_moments(moments: list[str]) -> dict[str, int]:
    return {m: moments.count(m) for m in sorted(set(moments))}


def run_planner(lg: Large, milp_budget_s: float, data: dict[str, Any]) -> None:
    """``plan.search`` at the run's micro-batch size and count with the best profile there is;
    its moments are replaced by the run's (one store serves every plan), both reported."""
    from layerwise.plan.search import SearchConfig, search

    name, hw = lg.planner_profile()
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


def fill_store_random(store, seed: int = 0, std: float = 0.02, device: str | None = None) -> None:
    """Seeded init written straight into a HostStore's fp32 masters (split or plain) and copy
    sources, no HF model built: matrices N(0, std²), 1-D parameters named ``*norm*`` 1, other
    1-D parameters (biases) 0. Random numbers are drawn on ``device`` (default: the GPU when
    there is one, where a 4.5B store fills in seconds) from one seeded generator, so a run is
    reproducible on the same device and torch version."""
    import torch

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed)
    for buf in store:
        for spec, offset in zip(buf.layout.specs, buf.layout.offsets):
            if len(spec.shape) >= 2:
                noise = torch.randn(spec.shape, generator=gen, device=dev, dtype=torch.float32)
                buf.write_master(noise.mul_(std), offset)
                del noise
            else:
                fill = 1.0 if "norm" in spec.local else 0.0
                buf.write_master(torch.full((spec.numel,), fill), offset)


def host_allocator_stats(torch) -> dict[str, Any] | None:
    """The pinned host allocator's byte counters (current, peak), where torch has them."""
    fn = getattr(torch.cuda, "host_memory_stats", None)
    if fn is None or not torch.cuda.is_available():
        return None
    try:
        stats = fn()
    except Exception as e:  # noqa: BLE001
        return {"error": f"{type(e).__name__}: {e}"}
    return {k: v for k, v in stats.items() if "bytes" in k and (k.endswith(".current") or k.endswith(".peak"))}


def run_store(lg: Large, seed: int, data: dict[str, Any], grad_dtype: str = "float32") -> None:
    """The HostStore every plan trains (bf16 copy sources pinned as the store pins), its RAM
    check made against the host budget minus this process's RSS (not ``MemAvailable``), filled
    with seeded weights and given its optimizer state here, so its size is known before any plan.
    ``grad_dtype``: ``bfloat16`` for the layer-major production path (each gradient lands once)."""
    import torch
    from layerwise.optim.adamw import AdamWConfig, HostAdamW
    from layerwise.optim.adamw8bit import HostAdamW8bit
    from layerwise.store import HostStore, store_footprint

    numels = [lg.shape.unit_params(u) for u in lg.shape.unit_names()]
    state = _state_nbytes(numels, lg.moments_kind)
    rss = process_rss_bytes() or 0
    available = lg.host_budget_bytes - rss
    grads = getattr(torch, grad_dtype)
    need = store_footprint(lg.adapter, torch.bfloat16, pin=lg.dev.is_cuda, state_nbytes=state,
                           grad_dtype=grads)
    data["ram_check"] = {"figure_used": "--host-budget-gb minus this process's RSS",
                         "host_budget_bytes": lg.host_budget_bytes, "process_rss_bytes": rss,
                         "available_bytes": available, "need_bytes": need.total, "fits": need.total <= available}
    t = time.perf_counter()
    store = HostStore(lg.adapter, compute_dtype=torch.bfloat16, state_nbytes=state,
                      mem_available=lambda: available, grad_dtype=grads)
    data["alloc_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    fill_store_random(store, seed=seed, device=lg.dev.name)
    data["init_s"] = round(time.perf_counter() - t, 3)
    t = time.perf_counter()
    opt = HostAdamW8bit(AdamWConfig()) if lg.moments_kind == "8bit" else HostAdamW(AdamWConfig())
    for buf in store:
        opt.init_state(buf)
    lg.store = store
    data.update({
        "state_init_s": round(time.perf_counter() - t, 3),
        "init": f"seeded normal(0, 0.02) matrices, norms 1, biases 0 (seed {seed}, drawn on {lg.dev.name})",
        "footprint": dict(vars(store.footprint())),
        "store_nbytes": store.nbytes(), "pinned_nbytes": store.pinned_nbytes(),
        "copy_source_nbytes": store.copy_source_nbytes(),
        "pinned_over_copy_source": store.pinned_nbytes() / store.copy_source_nbytes(),
        "estimate_matches_store": need.total == store.nbytes(),
        "host_allocator": host_allocator_stats(torch),
    })
