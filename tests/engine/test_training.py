"""Training with the engine equals training the plain model with torch.optim.AdamW."""

import math
import time

import pytest
import torch
import torch.nn.functional as F

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.plan import Plan
from layerwise.store import HostStore
from layerwise.engine.batch import IGNORE_INDEX, Batch


def batches(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


@pytest.mark.parametrize("flavor", ["llama-debug", "qwen2-debug"])
def test_twenty_steps_equal_torch_adamw_with_clipping(flavor, engine_device):
    cfg = get_flavor(flavor).build_config()
    model = build_hf_model(cfg, seed=0)
    # lr and max_norm chosen so that clipping is active in some steps and not in others
    opt_cfg = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, max_grad_norm=1.5)
    data = batches(cfg.vocab_size, 20)

    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 3),
                             EngineConfig(device=engine_device, optimizer=opt_cfg))
    clipped = 0
    for b in data:
        stats = engine.train_step([b])
        clipped += stats.clip_coef < 1.0
    engine.synchronize()
    assert 0 < clipped < 20, "the test should exercise both clipped and unclipped steps"

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt_cfg.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps)
    for b in data:
        ref_opt.zero_grad()
        logits = model(b.input_ids).logits
        loss = F.cross_entropy(logits.flatten(0, 1), b.labels.flatten(), ignore_index=IGNORE_INDEX)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.max_grad_norm)
        ref_opt.step()

    got = store.state_dict()
    max_diff = max((got[n] - p.detach()).abs().max().item() for n, p in model.named_parameters())
    assert max_diff <= 1e-5
    engine.close()


def test_non_finite_gradient_skips_the_step_and_leaves_weights(engine_device):
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    store["layers.1"].master[0] = float("inf")  # poisons the forward -> non-finite grads
    before = {k: v.clone() for k, v in store.state_dict().items()}
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(device=engine_device))
    stats = engine.train_step(batches(cfg.vocab_size, 1))
    engine.synchronize()
    assert stats.skipped and not math.isfinite(stats.grad_norm)
    assert engine.steps_skipped == 1
    after = store.state_dict()
    for k in before:
        assert torch.equal(before[k], after[k]), k
    assert all(float(b.grad.abs().sum()) == 0 for b in store), "grads must be cleared"
    engine.close()


class SlowAdamW(HostAdamW):
    """Updates late, so a forward that did not wait for its layer would see stale weights."""

    def step_unit(self, buf, lr, clip_coef):
        time.sleep(0.01)
        super().step_unit(buf, lr, clip_coef)


def test_update_of_a_layer_finishes_before_its_next_forward(engine_device):
    """With late updates, the losses must still be those of plain sequential training.
    Mutation checked: making ``WeightStreamer._issue`` skip ``wait_update`` (copy a unit whose
    update is still running) fails this test."""
    cfg = get_flavor("llama-debug").build_config()
    model = build_hf_model(cfg, seed=0)
    opt_cfg = AdamWConfig(lr=1e-2, max_grad_norm=None)
    data = batches(cfg.vocab_size, 4)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    slow = SlowAdamW(opt_cfg)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(device=engine_device, optimizer=opt_cfg),
                             optimizers={u.name: slow for u in adapter.units})
    got = [engine.train_step([b]).loss for b in data]
    engine.close()

    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    ref_opt = torch.optim.AdamW([{"params": decay, "weight_decay": opt_cfg.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}],
                                lr=opt_cfg.lr, betas=opt_cfg.betas, eps=opt_cfg.eps)
    want = []
    for b in data:
        ref_opt.zero_grad()
        loss = F.cross_entropy(model(b.input_ids).logits.flatten(0, 1), b.labels.flatten())
        loss.backward()
        ref_opt.step()
        want.append(loss.item())
    assert got == pytest.approx(want, rel=1e-5)


def test_plan_moments_choose_8bit_per_unit_and_training_still_tracks_fp32():
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    data = batches(cfg.vocab_size, 10)
    losses = {}
    for kinds in (None, ["fp32", "8bit", "8bit", "fp32", "8bit", "fp32"]):
        store = HostStore(adapter)
        store.copy_from_model(build_hf_model(cfg, seed=0))
        plan = Plan.every_k(adapter.num_layers, 1, moments=kinds)
        engine = StreamingEngine(adapter, store, plan, EngineConfig(optimizer=AdamWConfig(lr=1e-2)))
        if kinds:
            assert "exp_avg" not in store["layers.0"].state and "exp_avg" in store["embed"].state
        losses[bool(kinds)] = [engine.train_step([b]).loss for b in data]
        engine.close()
    assert losses[True][0] == losses[False][0]
    assert losses[True] != losses[False]
    assert abs(losses[True][-1] - losses[False][-1]) < 0.05 * losses[False][-1]


def test_bad_token_ids_are_refused_on_the_host_before_any_work(engine_device):
    """On a GPU an out-of-range id trips a device-side assert that poisons the CUDA context;
    the engine refuses the batch on the host. Mutation checked: without ``check_batch`` the
    error is an IndexError from inside the step instead of this ValueError."""
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    good = batches(cfg.vocab_size, 1)[0]
    store = HostStore(adapter)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(device=engine_device))
    with pytest.raises(ValueError, match="labels must be in"):
        engine.train_step([Batch(good.input_ids, good.labels + cfg.vocab_size)])
    with pytest.raises(ValueError, match="token ids must be in"):
        engine.train_step([Batch(good.input_ids - 1000, good.labels)])
    assert engine.train_step([good]).loss > 0
    engine.close()


def test_a_failed_step_leaves_the_engine_usable_and_unchanged(engine_device, assert_engine_idle,
                                                             monkeypatch):
    """A step that fails in the middle of its backward (here: layer 1's) releases its slots and
    partial gradients: the next step gives exactly what it gives without the failure."""
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    good = batches(cfg.vocab_size, 2)

    def fresh():
        store = HostStore(adapter)
        store.copy_from_model(build_hf_model(cfg, seed=0))
        return StreamingEngine(adapter, store, Plan(["host", "recompute", "device", "nvme"]),
                               EngineConfig(device=engine_device))

    engine = fresh()
    engine.train_step([good[0]])
    real_layer = adapter.layer

    def failing_layer(index, params, *args):
        if index == 1 and any(p.requires_grad for p in params.values()):
            raise RuntimeError("injected failure in layer 1's backward")
        return real_layer(index, params, *args)

    monkeypatch.setattr(adapter, "layer", failing_layer)
    with pytest.raises(RuntimeError, match="injected failure"):
        engine.train_step([good[1]])
    monkeypatch.setattr(adapter, "layer", real_layer)
    assert_engine_idle(engine)
    after_failure = engine.train_step([good[1]]).loss
    engine.close()

    reference = fresh()
    reference.train_step([good[0]])
    assert reference.train_step([good[1]]).loss == after_failure
    reference.close()
