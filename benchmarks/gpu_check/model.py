"""The large model and the plans it runs: ``Large`` carries what later stages need from earlier
ones; ``run_model`` sizes the model so the store fits the host budget and every candidate plan's
predicted peak fits the GPU. A dry run gives every stage a tiny model; the Python is the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .machine import Dev, process_rss_bytes

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


LAYER_MAJOR = "layer-major"
"""The production path of a step that lands each gradient once: layer-major order over
``LAYER_MAJOR_MICRO_BATCHES`` micro-batches (at least), bf16 host gradients, the split master
and the run's moments (8-bit by default), on a store rebuilt for it (``plans.run_layer_major``)."""
LAYER_MAJOR_MICRO_BATCHES = 2
PACKED = "packed"
"""every-4 over rows packed with examples of uneven lengths (``make_batches(packed=True)``):
the block-diagonal masks and restarted positions of packed rows on the device."""


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

    def best_profile(self) -> tuple[str, Any]:
        """The hardware profile the planner and the MFU use: calibrated at the run's shape, else
        calibrated, else the ``h200`` preset."""
        name = next(n for n in ("calibrated-shape", "calibrated", "h200") if n in self.profiles)
        return name, self.profiles[name]

    def host_available_bytes(self) -> int:
        """The host budget less this process's RSS: what a store's RAM check is given."""
        return self.host_budget_bytes - (process_rss_bytes() or 0)


def state_nbytes(numels: list[int], kind: str) -> int:
    from layerwise.optim import adamw, adamw8bit

    fn = adamw8bit.state_nbytes if kind == "8bit" else adamw.state_nbytes
    return sum(fn(n) for n in numels)


def cuda_peak_bytes(shape, plan, mbs: int, seq: int) -> int:
    """A plan's predicted device peak on CUDA in bf16, as the engine predicts it there (cuBLAS's
    flat workspace, the attention kernel's by shape)."""
    from layerwise.plan.memory import CUDA_WORKSPACE_BYTES, predict_peak_device_bytes

    return predict_peak_device_bytes(shape, plan, mbs, seq, 2, workspace_bytes=CUDA_WORKSPACE_BYTES,
                                     attention_workspace=True).peak_bytes


def tier_counts(tiers: list[str]) -> dict[str, int]:
    return {t: tiers.count(t) for t in ("device", "host", "nvme", "recompute")}


def count_moments(moments: list[str]) -> dict[str, int]:
    return {m: moments.count(m) for m in sorted(set(moments))}


def layer_major_plan(lg: Large):
    from layerwise.plan import Plan

    m = max(LAYER_MAJOR_MICRO_BATCHES, lg.nmb)
    plan = Plan.keep_all(lg.shape.num_layers, "host", micro_batch_size=lg.mbs, num_micro_batches=m,
                         micro_batches_per_load=m, seq_len=lg.seq, moments=list(lg.moments))
    plan.source = LAYER_MAJOR
    return plan


def candidate_plans(lg: Large) -> list[tuple[str, Any, int]]:
    """(name, plan, predicted device peak bytes): the planner's plan first (when the planner
    ran: the plan a user gets, so the budget never cuts it), then every-1, every-4 and
    keep-all-host, smallest predicted peak first, then ``packed`` and the layer-major production
    path (it rebuilds the store)."""
    from layerwise.plan import Plan

    L = lg.shape.num_layers
    kw = dict(micro_batch_size=lg.mbs, num_micro_batches=lg.nmb, seq_len=lg.seq, moments=list(lg.moments))
    rules = {"every-1": Plan.every_k(L, 1, **kw), "every-4": Plan.every_k(L, 4, **kw),
             "keep-all-host": Plan.keep_all(L, "host", **kw)}

    def peak(plan) -> int:
        return cuda_peak_bytes(lg.shape, plan, lg.mbs, lg.seq) if plan is not None else 0

    planner = [("planner", lg.planner_plan, peak(lg.planner_plan))]
    ordered = sorted(((n, p, peak(p)) for n, p in rules.items()), key=lambda x: x[2])
    packed = Plan.every_k(L, 4, **kw)
    packed.source = PACKED
    last = layer_major_plan(lg)
    return planner + ordered + [(PACKED, packed, peak(packed)), (LAYER_MAJOR, last, peak(last))]


def device_fit(lg: Large) -> tuple[str, int]:
    """The plan of the check with the largest predicted CUDA peak on ``lg.shape``, and that peak."""
    return max(((name, peak) for name, p, peak in candidate_plans(lg) if p is not None), key=lambda x: x[1])


def device_memory(lg: Large) -> tuple[int, str]:
    """The GPU's memory and where the figure comes from."""
    from layerwise.planner.presets import PRESETS

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
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS
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
        foot = store_footprint(adapter, torch.bfloat16, pin=True, state_nbytes=state_nbytes(numels, lg.moments_kind))
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
