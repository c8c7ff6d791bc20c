"""The planner's models know a frozen base: weight bytes in the base format, no gradient, copy or
update for the base, a backward of input gradients only; and agree with the real store."""

import dataclasses

import pytest
import torch

from layerwise.adapters.config import LoraConfig
from layerwise.adapters.lora_adapter import LoraAdapter
from layerwise.adapters.lora_store import LoraStore
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.optim.adamw import state_nbytes
from layerwise.plan import Plan
from layerwise.planner.cost import CostModel
from layerwise.plan.finetune import lora_frozen_base
from layerwise.planner.presets import PRESETS
from layerwise.plan.shape import ModelShape
from layerwise.planner.simulator import simulate


def _cfg():
    return get_flavor("llama-30m").build_config(num_hidden_layers=2, hidden_size=256,
                                                intermediate_size=512)


@pytest.mark.parametrize("base_dtype", ["compute", "bf16", "int8", "nf4"])
def test_cost_model_counts_the_store_and_streams_of_a_frozen_base(base_dtype):
    """The host model equals the live store's bytes (within the per-tensor alignment) and the
    streamed bytes per layer its copy source's; the planner's own ``lora_frozen_base`` (what
    ``layerwise plan`` uses without building anything) gives the same shape. Mutation seen
    failing: ``grad_bytes`` left at the weight's size (the frozen embedding sends a gradient)."""
    cfg = _cfg()
    lora = LoraConfig(r=8, target_modules=["q_proj", "v_proj", "down_proj"], base_dtype=base_dtype)
    adapter = LoraAdapter(DecoderAdapter(cfg), lora)
    store = LoraStore(adapter, torch.float32, pin=False)
    for b in store:
        adapter_optimizer_state = {"exp_avg": torch.zeros(b.layout.numel),
                                   "exp_avg_sq": torch.zeros(b.layout.numel), "step": torch.zeros(())}
        b.state = adapter_optimizer_state
    shape = adapter.plan_shape()
    base = ModelShape.from_config(cfg)
    fb = lora_frozen_base(base.hidden_size, base.intermediate_size, base.q_dim, base.kv_dim, 8,
                          lora.target_modules, base_dtype)
    assert fb.adapter_params_per_layer == shape.frozen_base.adapter_params_per_layer
    if base_dtype != "compute":
        assert fb.base_bytes_per_param == pytest.approx(shape.frozen_base.base_bytes_per_param, rel=1e-3)
    cost = CostModel(shape, dataclasses.replace(PRESETS["cpu"], compute_dtype_bytes=4), 1, 64)
    fp = store.footprint()
    model = cost.store_footprint()
    assert model.master == fp.master and model.grad == fp.grad
    assert model.state == sum(state_nbytes(b.layout.numel) for b in store)
    assert abs(model.copy_source - fp.copy_source) <= 64 * 16 * len(store.units)
    for b in store:
        assert abs(cost.unit_weight_bytes(b.name) - b.copy_source.numel() * 4) <= 64 * 16
        assert cost.grad_bytes(b.name) == 4 * b.layout.numel
        assert cost.optimizer_s(b.name) == pytest.approx(b.layout.numel / PRESETS["cpu"].optimizer_params_per_s)
    full = CostModel(base, PRESETS["cpu"], 1, 64)
    assert cost.layer_bwd_s(0) < full.layer_bwd_s(0)
    assert cost.grad_bytes("embed") == cost.grad_bytes("head") == 0


def test_simulated_qlora_step_streams_less_and_updates_little():
    """On the h200 preset a 4-bit base streams ~1/3.5 of the bf16 bytes, and the simulated step of
    a frozen base has no optimizer time to speak of: LoRA is faster than full fine-tuning."""
    shape = ModelShape.from_config(get_flavor("llama3-8b").build_config(), name="llama3-8b")
    hw = PRESETS["h200"]
    plan = Plan.every_k(shape.num_layers, 2, micro_batch_size=4, seq_len=2048)
    step = {}
    for name, fmt in (("full", None), ("bf16", "bf16"), ("nf4", "nf4")):
        s = shape if fmt is None else dataclasses.replace(shape, frozen_base=lora_frozen_base(
            shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, 16, ["all-linear"], fmt))
        step[name] = simulate(plan, s, hw).step_s
    assert step["nf4"] <= step["bf16"] < step["full"]
    nf4 = dataclasses.replace(shape, frozen_base=lora_frozen_base(
        shape.hidden_size, shape.intermediate_size, shape.q_dim, shape.kv_dim, 16, ["all-linear"], "nf4"))
    ratio = shape.unit_weight_bytes("layers.0", 2) / nf4.unit_weight_bytes("layers.0", 2)
    assert 3.2 < ratio < 3.6
