"""The host store's state on the machine's disk (``layerwise.state_tier``), trained against the
same run in RAM: the same bits at the end, the bytes each step moves, the page cache the files
take, and what the disk costs a step.

Two runs from the same weights and batches: every unit in RAM, then every decoder layer
``nvme-all`` (optimizer state, copy source and gradient in files) and the embedding and head
``nvme`` (optimizer state). The files go in a temporary directory beside the ``--out`` JSON:
the disk the check is run from, which must not live in RAM.

The sequence (``FirstSizes.steps_seq``) stays within one key block of the flash attention
kernel, whose backward only then sums in a fixed order, so two GPU runs of the same steps agree
to the bit.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from .first import FirstSizes
from .machine import Dev
from .report import CheckFailed

NVME_LAYERS = 6
NVME_STEPS = 3
"""Steps per run; the first (compiling kernels, first reads) is left out of the step time."""
NVME_LR = 3e-3
NVME_MOMENTS = "fp32"
"""The moments ``tiny_steps`` already compiled the kernels of: the 8-bit ones take a minute and
more to compile on a cold cache, which is the ``optimizer`` stage's to pay."""


def _train(dev: Dev, cfg, model, batches, plan, compute_dtype, tiers: dict[str, Any]) -> dict[str, Any]:
    """``NVME_STEPS`` steps of a store made with ``tiers`` (the store's keywords, none: all in
    RAM): step times, losses, the tiers' bytes after each step, and every unit's master and
    moments at the end."""
    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.models import DecoderAdapter
    from layerwise.optim.adamw import AdamWConfig
    from layerwise.store import HostStore

    out: dict[str, Any] = {"step_s": [], "losses": [], "page_cache_bytes": [],
                           "read_bytes": {k: [] for k in tiers}, "written_bytes": {k: [] for k in tiers}}
    try:
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter, compute_dtype=compute_dtype, pin=dev.is_cuda, **tiers)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, plan, EngineConfig(
            device=dev.engine_device, compute_dtype=compute_dtype, async_seed=None,
            optimizer=AdamWConfig(lr=NVME_LR, max_grad_norm=1.0)))
        try:
            for batch in batches:
                before = {k: (t.read_bytes, t.written_bytes) for k, t in tiers.items()}
                t0 = time.perf_counter()
                stats = engine.train_step([batch])
                engine.synchronize()
                out["step_s"].append(time.perf_counter() - t0)
                out["losses"].append(stats.loss)
                for k, t in tiers.items():  # counted as each transfer completes: writes behind may trail
                    out["read_bytes"][k].append(t.read_bytes - before[k][0])
                    out["written_bytes"][k].append(t.written_bytes - before[k][1])
                out["page_cache_bytes"].append(sum(t.page_cache_bytes() for t in tiers.values()))
            for t in tiers.values():  # the last step's writes, before the comparison reads
                t.drain()
            out["tiers"] = {k: {"units": len(t.names), "slots": t.slot_count, "file_bytes": t.nbytes(),
                                "staging_bytes": t.staging_nbytes(),
                                "o_direct": t.direct,
                                "read_bytes_per_step": out["read_bytes"][k],
                                "written_bytes_per_step": out["written_bytes"][k],
                                "read_bytes_total": t.read_bytes, "written_bytes_total": t.written_bytes}
                            for k, t in tiers.items()}
            out["units"] = {}
            for buf in store:
                with store.staged(buf.name):
                    out["units"][buf.name] = {"master": buf.read_master().clone(),
                                              **{k: v.clone() for k, v in buf.state.items()}}
        finally:
            engine.close()
    finally:
        for t in tiers.values():  # what the store's close does, also when the store was not made
            t.close()
    return out


def _median_after_first(times_s: list[float]) -> float:
    return statistics.median(times_s[1:] or times_s)


def run_nvme_state(dev: Dev, sizes: FirstSizes, out_json: Path, data: dict[str, Any]) -> None:
    """``llama-debug`` with ``NVME_LAYERS`` layers (the layer check's widths on a GPU, so a
    step moves megabytes), trained ``NVME_STEPS`` steps in RAM and again with its state on
    the disk beside ``out_json``: every unit's master and moments must be equal to the bit."""
    import torch
    from layerwise.engine.batch import Batch
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.plan import Plan
    from layerwise.plan.plan import NVME_GRAD_SLOTS, NVME_SOURCE_SLOTS, NVME_STATE_SLOTS
    from layerwise.state_tier import NvmeStateTier
    from layerwise.util import direct_io

    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=NVME_LAYERS, **sizes.layer_widths)
    # bf16 as a real run on the GPU; fp32 on the CPU, where bf16 matmuls are very slow
    compute_dtype = torch.float32 if dev.dry_run else torch.bfloat16
    n = cfg.num_hidden_layers
    moments = [NVME_MOMENTS] * (n + 2)
    state_tiers = ["nvme"] + ["nvme-all"] * n + ["nvme"]
    units = [u.name for u in DecoderAdapter(cfg).units]
    b, s = sizes.steps_batch, sizes.steps_seq
    g = torch.Generator().manual_seed(5)
    batches = []
    for _ in range(NVME_STEPS):
        ids = torch.randint(0, cfg.vocab_size, (b, s + 1), generator=g)
        batches.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    parent = out_json.resolve().parent
    parent.mkdir(parents=True, exist_ok=True)
    data.update(flavor="llama-debug", num_layers=n, hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size, batch=b, seq_len=s, steps=NVME_STEPS,
                compute_dtype=str(compute_dtype).removeprefix("torch."), moments=NVME_MOMENTS,
                state_tiers=state_tiers, directory=str(parent),
                filesystem_type=direct_io.filesystem_type(parent), in_ram=direct_io.in_ram(parent))
    if data["in_ram"]:
        raise CheckFailed(f"{parent} is on {data['filesystem_type']}, in RAM: write --out to a "
                          "directory on the disk to check the state on it")
    model = build_hf_model(cfg, seed=0)
    ram_plan = Plan.every_k(n, 2, moments=moments)
    nvme_plan = Plan.every_k(n, 2, moments=moments, state_tiers=state_tiers)
    ram = _train(dev, cfg, model, batches, ram_plan, compute_dtype, {})
    with tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-state-", dir=parent) as tmp:
        where = Path(tmp) / "nvme-state"
        everything = nvme_plan.nvme_units(units, source=True)
        tiers = {"state_tier": NvmeStateTier(where, nvme_plan.nvme_units(units), NVME_STATE_SLOTS),
                 "source_tier": NvmeStateTier(where, everything, NVME_SOURCE_SLOTS, kind="source",
                                              pinned=dev.is_cuda),
                 "grad_tier": NvmeStateTier(where, everything, NVME_GRAD_SLOTS, kind="grad")}
        nvme = _train(dev, cfg, model, batches, nvme_plan, compute_dtype, tiers)
        removed = not where.exists()
    unequal = {"master": [], "moments": []}
    for u in units:
        for k, v in ram["units"][u].items():
            if not torch.equal(v, nvme["units"][u][k]):
                unequal["master" if k == "master" else "moments"].append(f"{u}:{k}")
    ram_s, nvme_s = _median_after_first(ram["step_s"]), _median_after_first(nvme["step_s"])
    data.update(
        weights_equal=not unequal["master"], moments_equal=not unequal["moments"],
        unequal=unequal["master"] + unequal["moments"],
        ram_losses=ram["losses"], nvme_losses=nvme["losses"],
        ram_step_s=[round(x, 4) for x in ram["step_s"]], nvme_step_s=[round(x, 4) for x in nvme["step_s"]],
        ram_step_median_s=round(ram_s, 4), nvme_step_median_s=round(nvme_s, 4),
        step_time_over_ram=nvme_s / ram_s,
        tiers={k.removesuffix("_tier"): v for k, v in nvme["tiers"].items()},
        page_cache_bytes_per_step=nvme["page_cache_bytes"],
        page_cache_max_bytes=max(nvme["page_cache_bytes"]),
        files_removed_at_close=removed)
    if unequal["master"] or unequal["moments"]:
        raise CheckFailed(f"state on {data['filesystem_type']} trained other bits than in RAM: "
                          f"{', '.join(data['unequal'][:8])}")
