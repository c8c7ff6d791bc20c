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
from layerwise.optim.adamw8bit import HostAdamW8bit
from layerwise.optim.clip import clip_coefficient
from layerwise.plan import Plan
from layerwise.store import HostStore, UnitBuffers
from layerwise.engine.batch import IGNORE_INDEX, Batch
from matrix import sampled


def batches(vocab, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (2, 12), generator=g)
        out.append(Batch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out


@pytest.mark.parametrize("flavor", sampled(["llama-debug", "qwen2-debug"], {"llama-debug"}))
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


def test_plan_moments_give_each_unit_its_own_optimizer_step():
    """Each unit's weights after two engine steps equal a reference step on the same gradients.

    Units the plan marks ``fp32`` must match ``HostAdamW``; units marked ``8bit`` must match
    ``HostAdamW8bit`` (8-bit moments only change the update from the second step on, when the
    moments are read back from their codes, hence two steps), must differ from the fp32 step
    (by far more than the tolerance: the check can tell the two apart) and must have moved about
    as far as an fp32 AdamW step would. Gradients are those the engine itself accumulated, read
    just before its update, so the comparison is of the optimizers alone. Clipping is active.

    Mutations this test was seen to catch:
    - ``HostAdamW8bit.step_unit`` made a no-op (8-bit units never move);
    - ``StreamingEngine._default_optimizers`` giving every unit ``HostAdamW`` (8-bit units silently
      trained with fp32 moments);
    - the plan's ``moments`` list applied to the units in reverse order.
    """
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    names = ["embed"] + [f"layers.{i}" for i in range(adapter.num_layers)] + ["head"]
    kinds = ["8bit", "fp32", "8bit", "8bit", "fp32", "fp32"]  # Plan.moments order: embed, layers, head
    assert len(kinds) == len(names)
    kind_of = dict(zip(names, kinds))
    opt_cfg = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, max_grad_norm=0.5)
    store = HostStore(adapter)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1, moments=kinds),
                             EngineConfig(optimizer=opt_cfg))
    assert sorted(b.name for b in store) == sorted(names)

    grads: dict[str, torch.Tensor] = {}
    compute_grads = engine.compute_grads

    def spy(micro_batches):  # the gradients the engine is about to update with
        out = compute_grads(micro_batches)
        grads.update({b.name: b.grad.clone() for b in store})
        return out

    engine.compute_grads = spy

    # Reference units: a copy of each unit's weights, stepped by both optimizers.
    refs = {}
    for b in store:
        for kind, make in (("fp32", HostAdamW), ("8bit", HostAdamW8bit)):
            ref = UnitBuffers(b.unit, b.layout, b.master.clone(), torch.zeros_like(b.grad))
            opt = make(opt_cfg)
            opt.init_state(ref)
            refs[b.name, kind] = ref, opt

    tol = 1e-5  # relative, on the step's update; measured ~2e-7
    for step, batch in enumerate(batches(cfg.vocab_size, 2)):
        before = {b.name: b.master.clone() for b in store}
        stats = engine.train_step([batch])
        engine.synchronize()
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads.values()))
        coef = clip_coefficient(norm, opt_cfg.max_grad_norm)
        assert coef < 1.0 and stats.clip_coef == pytest.approx(coef, rel=1e-6)
        for b in store:
            moved = b.master - before[b.name]
            err = {}
            for kind in ("fp32", "8bit"):
                ref, opt = refs[b.name, kind]
                ref_before = ref.master.clone()
                ref.grad.copy_(grads[b.name])
                opt.step_unit(ref, opt_cfg.lr, coef)
                ref_moved = ref.master - ref_before
                err[kind] = float((moved - ref_moved).norm() / ref_moved.norm())
            mine, other = kind_of[b.name], {"fp32": "8bit", "8bit": "fp32"}[kind_of[b.name]]
            where = f"step {step + 1}, {b.name} ({mine})"
            assert float(moved.abs().max()) > 0, f"{where}: weights did not move"
            assert err[mine] <= tol, f"{where}: update differs from the {mine} reference by {err}"
            if mine == "8bit":  # moved like AdamW, up to the moments' quantisation
                assert err["fp32"] < 0.05, f"{where}: far from an fp32 AdamW step: {err}"
            if step > 0:  # from step 2 the two optimizers differ, and the check tells them apart
                assert err[other] > 100 * tol, f"{where}: indistinguishable from {other}: {err}"
    engine.close()

    for b in store:
        has_codes = "exp_avg_codes" in b.state
        assert has_codes == (kind_of[b.name] == "8bit") and ("exp_avg" in b.state) != has_codes, b.name


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
