"""The host store every plan trains: its RAM check against the host budget, a seeded fill written
straight into it, its optimizer state; and the pinned host allocator's counters.
"""

from __future__ import annotations

import time
from typing import Any

from .model import Large, state_nbytes


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
    state = state_nbytes(numels, lg.moments_kind)
    available = lg.host_available_bytes()
    rss = lg.host_budget_bytes - available
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
