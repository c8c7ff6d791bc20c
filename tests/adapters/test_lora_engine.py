"""LoRA on the streaming engine: adapter gradients equal PEFT's own autograd for every plan; the
frozen base gets no gradient, no copy out, no master and no optimizer state."""

import pytest
import torch

from layerwise.adapters.config import LoraConfig
from layerwise.adapters.lora_store import lora_footprint
from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.optim.adamw import state_nbytes
from layerwise.plan import Plan

from family_cases import engine_loss
from sweep_cases import tiny_config as sweep_tiny_config
from lora_helpers import (engine_grads, lora_plans, lora_store, make_batch, peft_grads,
                          peft_model, tiny_config, worst_rel)


def test_lora_gradients_equal_peft_for_every_plan(engine_device, tmp_path, assert_engine_idle):
    """CPU fp32: each adapter's gradient equals ``peft.get_peft_model``'s autograd (same config,
    same adapter weights, B != 0) to 1e-5 relative, under every-1, every-2, recompute-all, kept
    internals (device, host) and a mix of every tier. Mutation seen failing: the frozen linear's
    backward returning a zero input gradient (adapters below the top layer go wrong).
    ``all-linear`` is covered by the QLoRA tests (``test_qlora.py``)."""
    cfg = tiny_config()
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    adapter, store = lora_store(cfg, lora)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref = peft_grads(peft_model(cfg, store, lora), batch)
    for name, plan in lora_plans(cfg.num_hidden_layers).items():
        engine = StreamingEngine(adapter, store, plan,
                                 EngineConfig(device=engine_device, spill_dir=str(tmp_path)))
        loss, sq = engine.compute_grads([batch])
        assert_engine_idle(engine)
        engine.close()
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert worst_rel(engine_grads(store), ref) <= 1e-5, name
        assert set(sq) == {b.name for b in store.layers}, "only the layers (with adapters) have gradients"


def test_frozen_base_has_no_gradient_master_or_state():
    """The base is frozen: what leaves the device per step is the adapters' gradients alone
    (the D2H counter of the asynchronous backend, a plan with no offloads), and the host holds
    fp32 master, gradient and AdamW state for the adapters only (storage sizes). Mutation seen
    failing: the head's gradient sent although the head is frozen (its fp32 chunk sum)."""
    cfg = tiny_config()
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    adapter, store = lora_store(cfg, lora)
    n_adapter = sum(b.layout.numel for b in store)
    assert n_adapter == adapter.num_params() == cfg.num_hidden_layers * 4 * (2 * 32 + 32 + 16)
    engine = StreamingEngine(adapter, store, Plan.every_k(cfg.num_hidden_layers, 1),
                             EngineConfig(device="cpu-async"))
    before = dict(engine.backend.copied_bytes)
    engine.train_step([make_batch(cfg.vocab_size)])
    engine.synchronize()
    d2h = engine.backend.copied_bytes["d2h"] - before["d2h"]
    engine.close()
    assert d2h == 4 * n_adapter
    fp = store.footprint()
    assert fp.master == fp.grad == 4 * n_adapter
    assert fp.state == sum(state_nbytes(b.layout.numel) for b in store)
    assert fp.total == lora_footprint(adapter, torch.float32, pin=False,
                                      state_nbytes=fp.state).total
    for b in (store["embed"], store["head"]):
        assert b.master.numel() == b.grad.numel() == 0 and b.state["exp_avg"].numel() == 0
    # the frozen units' weights never change
    head = store["head"].copy_source.clone()
    assert torch.equal(head, store["head"].copy_source)


def test_adapter_dropout_draws_one_mask_per_micro_batch(tmp_path):
    """With dropout, a micro-batch's forward, recompute and backward see the same mask: the
    gradients are the same under every plan (and differ from no dropout); eval draws none.
    Mutation seen failing: a new seed per layer call instead of one per micro-batch (the
    recomputing plans' gradients differ from every-1's). On the asynchronous backend, where the
    micro-batch starts on the compute lane."""
    engine_device = "cpu-async"
    cfg = tiny_config()
    batch = make_batch(cfg.vocab_size)
    got = {}
    plans = {k: v for k, v in lora_plans(cfg.num_hidden_layers).items()
             if k in ("every-1", "recompute-all", "kept-host", "mixed")}
    for p in (0.0, 0.3):
        lora = LoraConfig(r=4, alpha=8, dropout=p, target_modules=["q_proj", "v_proj", "down_proj"])
        for name, plan in (plans if p else {"every-1": plans["every-1"]}).items():
            adapter, store = lora_store(cfg, lora)
            engine = StreamingEngine(adapter, store, plan,
                                     EngineConfig(device=engine_device, spill_dir=str(tmp_path)))
            engine.compute_grads([batch])
            if p:
                adapter.eval()
                eval_logits = engine.forward_logits(batch.input_ids)
                adapter.train()
                got[(0.3, "eval")] = eval_logits
            else:
                got[(0.0, "eval")] = engine.forward_logits(batch.input_ids)
            engine.close()
            got[(p, name)] = engine_grads(store)
    for name in plans:
        assert worst_rel(got[(0.3, name)], got[(0.3, "every-1")]) <= 1e-5, name
    assert worst_rel(got[(0.3, "every-1")], got[(0.0, "every-1")]) > 1e-2
    assert torch.allclose(got[(0.3, "eval")], got[(0.0, "eval")], rtol=1e-5, atol=1e-6)


def test_lora_options_are_checked():
    """A user's mistakes are refused with what to do."""
    cfg = tiny_config()
    with pytest.raises(ValueError, match="match no linear"):
        lora_store(cfg, LoraConfig(r=4, target_modules=["qkv_proj"]))
    with pytest.raises(ValueError, match="base_dtype"):
        LoraConfig(r=4, base_dtype="fp4").check()
    with pytest.raises(ValueError, match="lm_head stay frozen"):
        lora_store(cfg, LoraConfig(r=4, target_modules=["lm_head"]))


@pytest.mark.parametrize("model_type", ["phimoe", "llama4_text"])
def test_lora_on_a_model_whose_router_is_a_linear_with_its_own_forward(model_type):
    """PhiMoE's and Llama 4's routers subclass ``nn.Linear`` and return a tuple: they keep their
    own forward (held in the compute dtype), and the adapters' gradients equal PEFT's. Mutation
    seen caught: every ``nn.Linear`` swapped for the streamed one (the router then returns one
    tensor: "too many values to unpack")."""
    cfg = sweep_tiny_config(model_type)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
    adapter, store = lora_store(cfg, lora)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref = peft_grads(peft_model(cfg, store, lora).eval(), batch)
    loss = engine_loss(adapter, store, Plan.every_k(adapter.num_layers, 1), [batch])
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert worst_rel(engine_grads(store), ref) <= 1e-5
