"""``plan=fit`` on the CPU: the plan that computes least where the RAM holds it."""

from __future__ import annotations

import torch

from layerwise.models import get_flavor
from layerwise.plan.shape import ModelShape
from layerwise.train import build
from layerwise.train.config import TrainConfig
from layerwise.util.host_memory import HOST_MEM_ENV


def test_fit_recomputes_nothing_where_the_ram_the_store_leaves_holds_it(monkeypatch):
    """With the RAM to spare, every layer's forward graph is kept for its backward
    (``keep-internals``: no forward runs twice); with the RAM the store leaves (less the margin)
    between the two predicted peaks, the boundaries alone (``keep-all``).

    Mutations seen failing: ``keep-internals`` dropped from ``FIT_RULES`` (keep-all chosen with
    RAM to spare: every layer's forward run again in its backward, 10-16% slower steps on
    SmolLM2); ``fit_cap_bytes`` returning ``mem_cap_bytes`` (no cap on the CPU: keep-internals
    chosen where its activations do not fit beside the store)."""
    model = get_flavor("llama-debug").build_config()
    cfg = TrainConfig(seq_len=256, micro_batch_size=4, device="cpu")
    peak = {rule: build._peak(cfg, model, build.resolve_plan(rule, model.num_hidden_layers, cfg),
                              torch.float32).peak_bytes for rule in ("keep-internals", "keep-all")}
    assert peak["keep-all"] < peak["keep-internals"]

    monkeypatch.setenv(HOST_MEM_ENV, str(64 << 30))
    assert build.fit_plan(cfg, model, torch.float32).source == "keep-internals-device"

    store = ModelShape.from_config(model).num_params * 16  # fp32 master, gradient, two moments
    between = (peak["keep-all"] + peak["keep-internals"]) // 2
    monkeypatch.setenv(HOST_MEM_ENV, str(store + (1 << 30) + between))  # the margin: 1 GiB there
    plan = build.fit_plan(cfg, model, torch.float32)
    assert plan.source == "keep-all-device" and set(plan.internal_tiers) == {"recompute"}
