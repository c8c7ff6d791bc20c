"""Shared by the LoRA tests: a tiny Llama, a PEFT reference with the same adapter weights."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from peft import LoraConfig as PeftLoraConfig
from peft import get_peft_model

from layerwise.adapters.config import LoraConfig
from layerwise.adapters.lora_store import LoraStore, init_lora_store
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan

PEFT_PREFIX = "base_model.model."


def tiny_config(**overrides):
    return get_flavor("llama-debug").build_config(**overrides)


def lora_store(cfg, lora: LoraConfig, seed: int = 0):
    """A LoRA store whose ``lora_B`` is random (B = 0 would make every A gradient zero)."""
    adapter, store = init_lora_store(cfg, lora, seed=seed)
    store.init_adapters(seed, init_b=lambda v, g: v.copy_(torch.randn(v.shape, generator=g) * 0.1))
    return adapter, store


def make_batch(vocab, batch=2, seq=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    labels = torch.randint(0, vocab, (batch, seq), generator=g)
    labels[0, :3] = IGNORE_INDEX
    return Batch(ids, labels)


def peft_key(name: str) -> str:
    """A PEFT parameter's name as layerwise names the adapter."""
    return name.removeprefix(PEFT_PREFIX).replace(".default", "")


def peft_model(cfg, store: LoraStore, lora: LoraConfig, seed: int = 0, dequantised: bool = True):
    """``get_peft_model`` over the base (as the store holds it, dequantised) with the store's
    adapter weights."""
    model = build_hf_model(cfg, seed)
    if dequantised:
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(store.base_weight(n))
    targets = "all-linear" if lora.target_modules == ["all-linear"] else list(lora.target_modules)
    pm = get_peft_model(model, PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=0.0,
                                              target_modules=targets))
    adapters = store.adapter_tensors()
    with torch.no_grad():
        for n, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(adapters[peft_key(n)])
    return pm


def peft_grads(pm, batch: Batch) -> tuple[float, dict[str, torch.Tensor]]:
    pm.zero_grad()
    logits = pm(batch.input_ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), batch.labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum") / batch.num_target_tokens
    loss.backward()
    return loss.item(), {peft_key(n): p.grad.clone() for n, p in pm.named_parameters() if p.requires_grad}


def engine_grads(store: LoraStore) -> dict[str, torch.Tensor]:
    out = {}
    for b in store:
        views = b.layout.views(b.grad)
        out.update({p.hf_name: views[p.local].clone() for p in b.unit.params})
    return out


def worst_rel(got: dict, ref: dict) -> float:
    assert set(got) == set(ref), (sorted(set(got) ^ set(ref)))[:4]
    worst = 0.0
    for k, g in ref.items():
        assert g.norm() > 0, f"{k}: the reference gradient is zero (test would be vacuous)"
        worst = max(worst, ((got[k] - g).norm() / g.norm()).item())
    return worst


def lora_plans(n: int) -> dict[str, Plan]:
    return {
        "every-1": Plan.every_k(n, 1),
        "every-2": Plan.every_k(n, 2),
        "recompute-all": Plan.recompute_all(n),
        "kept-device": Plan(["device"] * n, internal_tiers=["device"] * n),
        "kept-host": Plan(["recompute"] * n, internal_tiers=["host"] * n),
        "mixed": Plan((["host", "nvme", "recompute", "device"] * n)[:n], head_chunk_tokens=7,
                      internal_tiers=(["device", "recompute", "host", "recompute"] * n)[:n],
                      prefetch_depth=2),
    }
