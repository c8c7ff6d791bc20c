"""Shared by the family and packed-row tests: the tiny flavors of every family, their HF models
(built once per process), batches, and the plain-HF-autograd reference the engine must equal."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import FLAVORS, DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.store import HostStore

QUIRKY = [n for n, f in FLAVORS.items() if f.note.endswith("quirks on")]
"""The tiny flavors of the families beyond llama/mistral/qwen2/qwen3 (quirks switched on)."""


@functools.lru_cache(maxsize=None)
def hf_case(flavor: str):
    """(config, HF model, adapter) of ``flavor``, built once per process. Persistent buffers
    (DeepSeek-V3's expert-selection bias) are set to seeded non-zero values, so that they
    matter to the result."""
    cfg = get_flavor(flavor).build_config()
    model = build_hf_model(cfg, seed=0)
    model.eval()  # dropout off, as the engine runs
    g = torch.Generator().manual_seed(7)
    params = {n for n, _ in model.named_parameters()}
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if name not in params and t.is_floating_point():
                t.copy_(torch.randn(t.shape, generator=g) * 0.5)
    return cfg, model, DecoderAdapter(cfg)


def make_batch(vocab: int, batch: int = 2, seq: int = 12, seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :4] = IGNORE_INDEX
    return Batch(ids, labels)


def uses_aux(cfg) -> bool:
    return bool(getattr(cfg, "output_router_logits", False))


def hf_reference(model, cfg, batches: list[Batch]) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain autograd of HF's model: each batch's cross-entropy summed / the step's target
    tokens, plus (MoE with its aux loss) HF's own ``coef * aux_loss`` of that batch, weighted by
    the batch's share of the target tokens; padding (segment -1) masked out of the aux loss as
    HF's ``attention_mask`` does. Returns (loss, grads by HF name)."""
    model.zero_grad()
    total = sum(b.num_target_tokens for b in batches)
    loss = 0.0
    for b in batches:
        mask = None
        if b.segment_ids is not None and bool((b.segment_ids < 0).any()):
            mask = (b.segment_ids >= 0).long()
        out = model(b.input_ids, attention_mask=mask, output_router_logits=uses_aux(cfg) or None)
        part = F.cross_entropy(out.logits.float().flatten(0, 1), b.labels.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum") / total
        if uses_aux(cfg):
            part = part + model.router_aux_loss_coef * out.aux_loss * (b.num_target_tokens / total)
        part.backward()
        loss += part.item()
    return loss, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def engine_loss(adapter, store, plan, batches: list[Batch], config: EngineConfig | None = None) -> float:
    """The loss of one ``compute_grads`` on a fresh engine over ``store`` (its grads land there)."""
    engine = StreamingEngine(adapter, store, plan, config or EngineConfig())
    try:
        loss, _ = engine.compute_grads(batches)
    finally:
        engine.close()
    return loss


def engine_run(adapter, model, plan, batches: list[Batch], device: str = "cpu", spill_dir=None):
    """(loss, grads by HF name, store) of the engine's ``compute_grads`` from ``model``'s weights."""
    store = HostStore(adapter)
    store.copy_from_model(model)
    loss = engine_loss(adapter, store, plan, batches, EngineConfig(device=device, spill_dir=spill_dir))
    return loss, engine_grads(store), store


def engine_grads(store) -> dict[str, torch.Tensor]:
    out = {}
    for buf in store:
        views = buf.layout.views(buf.grad)
        for p in buf.unit.params:
            out[p.hf_name] = views[p.local]
    if store.adapter.tied:
        out[store.adapter.head_weight_name] = out[store.adapter.units[0].params[0].hf_name]
    return out


def assert_grads_close(got, ref, rtol=1e-4):
    assert ref and set(ref) <= set(got)
    for name, g in ref.items():
        rel = ((got[name] - g).norm() / g.norm().clamp_min(1e-30)).item()
        assert rel <= rtol, f"{name}: relative error {rel:.2e}"
