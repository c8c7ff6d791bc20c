"""First contact with the GPU (well under 90 s): one decoder layer against autograd, two training
steps of a small model through every tier a plan has, the pinned arena, copy bandwidths.

Each stage fills the dict it is given (``data``) as it goes and raises ``CheckFailed`` when a
number is out of tolerance, so the JSON holds the figures of a failed stage too. The
references are plain autograd on the CPU in fp32; the device side runs in fp32 with TF32 off.
"""

from __future__ import annotations

import math
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

from .machine import Dev
from .report import CheckFailed


@dataclass
class FirstSizes:
    layer_widths: dict[str, int] = field(default_factory=lambda: dict(
        hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4))
    """Overrides of ``llama-debug`` for the layer check and ``nvme_state`` (GQA, several heads)."""
    layer_batch: int = 2
    layer_seq: int = 512
    steps_batch: int = 2
    steps_seq: int = 64
    lock_bytes: int = 3 << 28
    """Page-locked by ``alloc_pinned`` in the arena stage: not a power of two, so the fallback's
    rounding would show in the locked bytes as well as in its warning."""
    copy_bytes: int = 1 << 30
    copy_repeats: int = 5

    @classmethod
    def dry(cls) -> FirstSizes:
        return cls(layer_widths={}, layer_seq=16, steps_seq=12, lock_bytes=3 << 20, copy_bytes=8 << 20,
                   copy_repeats=2)


TOLERANCE = 1e-4
"""Largest relative error (‖a − b‖ / ‖b‖) of fp32 results on the device against the CPU."""

STEPS_BOUNDARIES = ["host", "nvme", "recompute", "device", "device", "host"]
STEPS_INTERNALS = ["recompute", "recompute", "recompute", "recompute", "device", "host"]
"""Six layers: boundaries offloaded to host and NVMe, recomputed and kept on the device, and
two layers that keep their internals (on the device, on the host)."""


def rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def run_layer_check(dev: Dev, sizes: FirstSizes, data: dict[str, Any]) -> None:
    """The engine's layer forward and ``layer_backward`` on the device against HF's decoder
    layer under plain autograd on the CPU, same weights and inputs."""
    import torch
    from layerwise.engine.layer_ops import layer_backward
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.store import HostStore

    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=1, **sizes.layer_widths)
    model = build_hf_model(cfg, seed=0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, pin=False)
    store.copy_from_model(model)
    buf = store["layers.0"]
    b, s, h = sizes.layer_batch, sizes.layer_seq, cfg.hidden_size
    data.update(flavor="llama-debug", hidden_size=h, intermediate_size=cfg.intermediate_size,
                num_heads=cfg.num_attention_heads, num_kv_heads=cfg.num_key_value_heads,
                params=buf.layout.numel, batch=b, seq_len=s, dtype="float32", tolerance=TOLERANCE,
                reference="HF decoder layer, plain autograd, CPU fp32")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(b, s, h, generator=g)
    grad_out = torch.randn(b, s, h, generator=g)
    pos = torch.arange(s)[None]
    layer = model.model.layers[0]
    x_ref = x.clone().requires_grad_()
    out = layer(x_ref, attention_mask=None, position_ids=pos, position_embeddings=model.model.rotary_emb(x, pos))
    y_ref = out[0] if isinstance(out, tuple) else out
    y_ref.backward(grad_out)
    ref_w = dict(layer.named_parameters())

    t = time.perf_counter()
    with dev.true_fp32():
        w = buf.read_master().to(dev.name)
        xd, gd = x.to(dev.name), grad_out.to(dev.name)
        ctx = adapter.layer_context((b, s), dev.name, xd.dtype, adapter.new_rotary(dev.name))
        with torch.no_grad():
            y = adapter.layer(0, buf.layout.views(w), xd, ctx)
        gx, gw = layer_backward(adapter, 0, buf.layout, w, xd, gd, ctx)
        dev.sync()
    data["device_s"] = round(time.perf_counter() - t, 4)
    errs = {spec.local: rel_err(gp.cpu(), ref_w[spec.local].grad) for spec, gp in zip(buf.layout.specs, gw)}
    worst, worst_err = max(errs.items(), key=lambda kv: kv[1])
    data.update(output_rel_err=rel_err(y.cpu(), y_ref.detach()), grad_input_rel_err=rel_err(gx.cpu(), x_ref.grad),
                max_grad_param_rel_err=worst_err, worst_param=worst)
    bad = {k: data[k] for k in ("output_rel_err", "grad_input_rel_err", "max_grad_param_rel_err")
           if not data[k] <= TOLERANCE}
    if bad:
        raise CheckFailed(f"layer on {dev.name} vs autograd over {TOLERANCE:g}: {bad} (worst param {worst})")


def _reference(model, batch) -> tuple[float, dict[str, Any]]:
    """HF autograd on the CPU: loss summed over target tokens / their count, and the grads."""
    import torch.nn.functional as F
    from layerwise.engine.batch import IGNORE_INDEX

    model.zero_grad()
    logits = model(batch.input_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / batch.num_target_tokens
    loss.backward()
    return loss.detach().item(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _store_grads(store) -> dict[str, Any]:
    out = {}
    for buf in store:
        views = buf.layout.views(buf.grad)
        for p in buf.unit.params:
            out[p.hf_name] = views[p.local]
    if store.adapter.tied:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out


def run_tiny_steps(dev: Dev, sizes: FirstSizes, data: dict[str, Any]) -> None:
    """A six-layer model through every tier: the first step's gradients against HF autograd,
    then two training steps (finite, not skipped, the second loss below the first)."""
    import torch
    from layerwise.engine import EngineConfig, StreamingEngine
    from layerwise.engine.batch import IGNORE_INDEX, Batch
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.models.init import build_hf_model
    from layerwise.plan import Plan
    from layerwise.plan.program import micro_batch_program
    from layerwise.store import HostStore

    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=len(STEPS_BOUNDARIES))
    model = build_hf_model(cfg, seed=0)
    g = torch.Generator().manual_seed(1)
    b, s = sizes.steps_batch, sizes.steps_seq
    ids = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
    labels[0, : s // 4] = IGNORE_INDEX
    batch = Batch(ids, labels)
    plan = Plan(list(STEPS_BOUNDARIES), internal_tiers=list(STEPS_INTERNALS), prefetch_depth=2)
    ops: dict[str, int] = {}
    for op in micro_batch_program(plan.boundary_tiers, plan.internal_tiers):
        ops[str(op.kind)] = ops.get(str(op.kind), 0) + 1
    data.update(flavor="llama-debug", num_layers=len(STEPS_BOUNDARIES), boundary_tiers=plan.boundary_tiers,
                internal_tiers=plan.internal_tiers, prefetch_depth=plan.prefetch_depth, op_counts=ops,
                batch=b, seq_len=s, dtype="float32", tolerance=TOLERANCE)
    ref_loss, ref_grads = _reference(model, batch)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, pin=dev.is_cuda)
    store.copy_from_model(model)
    with dev.true_fp32(), tempfile.TemporaryDirectory(prefix="layerwise-gpu-check-nvme-") as spill:
        engine = StreamingEngine(adapter, store, plan, EngineConfig(
            device=dev.engine_device, compute_dtype=torch.float32, spill_dir=spill, async_seed=None))
        try:
            loss, _ = engine.compute_grads([batch])
            got = _store_grads(store)
            errs = {n: rel_err(got[n], ref_grads[n]) for n in ref_grads}
            worst, worst_err = max(errs.items(), key=lambda kv: kv[1])
            data.update(ref_loss=ref_loss, loss=loss, loss_rel_err=abs(loss - ref_loss) / abs(ref_loss),
                        max_grad_rel_err=worst_err, worst_param=worst)
            store.zero_grads()
            stats = []
            for _ in range(2):
                stats.append(engine.train_step([batch], lr=1e-2))
            engine.synchronize()
        finally:
            engine.close()
    data.update(train_losses=[st.loss for st in stats], skipped_steps=sum(st.skipped for st in stats),
                step_s=[round(st.step_s, 4) for st in stats])
    problems = []
    if not (data["loss_rel_err"] <= TOLERANCE and worst_err <= TOLERANCE):
        problems.append(f"first step vs autograd: loss {data['loss_rel_err']:.2e}, grads {worst_err:.2e} ({worst})")
    losses = data["train_losses"]
    if data["skipped_steps"] or not all(math.isfinite(x) for x in losses) or not losses[1] < losses[0]:
        problems.append(f"training steps: losses {losses}, skipped {data['skipped_steps']}")
    if problems:
        raise CheckFailed("; ".join(problems))


def run_pinned_arena(dev: Dev, sizes: FirstSizes, data: dict[str, Any]) -> None:
    """A store's copy-source arena page-locked in place (``cudaHostRegister``, exact to the
    page), not through torch's power-of-two fallback; and the time to lock ``lock_bytes``."""
    import torch
    from layerwise.models import DecoderAdapter, get_flavor
    from layerwise.store import HostStore
    from layerwise.util.host_memory import alloc_pinned, locked_nbytes, page_size

    store = HostStore(DecoderAdapter(get_flavor("llama-debug").build_config()), compute_dtype=torch.bfloat16,
                      pin=dev.is_cuda)
    arena = store.arena.numel() * store.arena.element_size()
    data.update(store_pinned=store.pinned, arena_bytes=arena, pinned_bytes=store.pinned_nbytes(),
                expected_pinned_bytes=locked_nbytes(arena) if store.pinned else 0, page_size_bytes=page_size(),
                arena_is_pinned=bool(store.arena.is_pinned()) if dev.is_cuda else None,
                probe_bytes=sizes.lock_bytes, probe_registered=None, probe_locked_bytes=None,
                probe_lock_s=None, fallback_warning=None)
    if not dev.is_cuda:
        return  # nothing is page-locked without CUDA
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = time.perf_counter()
        raw, locked = alloc_pinned(sizes.lock_bytes)
        data["probe_lock_s"] = round(time.perf_counter() - t, 4)
    fallback = [str(w.message) for w in caught if "page-locking" in str(w.message)]
    data.update(probe_locked_bytes=locked, probe_registered=not fallback and locked == locked_nbytes(sizes.lock_bytes),
                fallback_warning=fallback[0] if fallback else None)
    del raw
    problems = []
    if not (store.pinned and data["arena_is_pinned"] and data["pinned_bytes"] == data["expected_pinned_bytes"]):
        problems.append(f"store arena: pinned {store.pinned}, is_pinned {data['arena_is_pinned']}, "
                        f"{data['pinned_bytes']} bytes locked for {data['expected_pinned_bytes']} expected")
    if not data["probe_registered"]:
        problems.append(f"cudaHostRegister of {sizes.lock_bytes} bytes: {data['fallback_warning'] or locked}")
    if problems:
        raise CheckFailed("; ".join(problems))


def run_copy_bandwidth(dev: Dev, sizes: FirstSizes, data: dict[str, Any]) -> None:
    """H2D and D2H GB/s (best of ``copy_repeats`` after a warm-up) from memory registered in
    place as the store's arena is, from torch's pinned allocator, and from pageable memory."""
    import torch
    from layerwise.util.host_memory import alloc_pinned

    n = sizes.copy_bytes
    device_buf = torch.empty(n, dtype=torch.uint8, device=dev.name)
    hosts = {"registered": alloc_pinned(n)[0] if dev.is_cuda else torch.empty(n, dtype=torch.uint8),
             "pinned_alloc": torch.empty(n, dtype=torch.uint8, pin_memory=dev.is_cuda),
             "pageable": torch.empty(n, dtype=torch.uint8)}
    data.update(bytes=n, repeats=sizes.copy_repeats, timer="perf_counter around a synchronised copy")
    for kind, host in hosts.items():
        host.fill_(1)
        data[f"h2d_{kind}_gbps"] = n / dev.best_s(lambda: device_buf.copy_(host, non_blocking=True),
                                                  sizes.copy_repeats) / 1e9
        data[f"d2h_{kind}_gbps"] = n / dev.best_s(lambda: host.copy_(device_buf, non_blocking=True),
                                                  sizes.copy_repeats) / 1e9
    device_buf = hosts = None  # freed before the cache is emptied (the closures above are done)
    dev.clean()
