"""Layer-major order (micro-batches sharing each weight load) and resident layers: the same
numbers as plain autograd and as the streamed micro-batch-major engine, with the weight copies
the program says."""

import math
import time

import pytest
import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.optim.grad_accum import accumulate
from layerwise.plan import Plan
from layerwise.plan.program import WeightWindow, plan_step_program, resident_units, weight_schedule
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference
from matrix import sampled

L = 4
MIXED = ["host", "nvme", "recompute", "device"]


def layer_major_plans(n):
    """Every boundary tier and kept-internal tier in layer-major order (groups of 2, which do
    not divide the 5 micro-batches, and of 5), and resident layers (some, all) in both orders."""
    out = {f"{b}/2": Plan([b] * L, micro_batches_per_load=2)
           for b in ("device", "host", "nvme", "recompute")}
    for t in ("device", "host"):
        out[f"mixed+{t}/2"] = Plan(MIXED, internal_tiers=[t] * L, micro_batches_per_load=2)
    out["mixed-internals/5"] = Plan(["nvme", "recompute", "recompute", "host"],
                                    internal_tiers=["host", "recompute", "device", "recompute"],
                                    micro_batches_per_load=n, prefetch_depth=2)
    out["resident-some/1"] = Plan(MIXED, resident_layers=[1, 2])
    out["resident-some/2"] = Plan(MIXED, internal_tiers=["host", "device", "recompute", "host"],
                                  micro_batches_per_load=2, resident_layers=[0, 3])
    out["resident-all/1"] = Plan(["nvme"] * L, internal_tiers=["host"] * L,
                                 resident_layers=list(range(L)))
    out["resident-all/5"] = Plan(MIXED, micro_batches_per_load=n, resident_layers=list(range(L)))
    return out


@pytest.mark.parametrize("flavor", sampled(["llama-debug-tied", "qwen3-debug-untied"], {"llama-debug-tied"}))
def test_layer_major_and_resident_plans_match_autograd(flavor, tmp_path, engine_device,
                                                       assert_engine_idle):
    """Mutations seen failing: a later micro-batch's gradient written over the group's sum
    (``deposit`` ignoring ``add``); host-tier boundaries of a group sharing one host buffer
    (keyed by layer alone); host-tier internals keyed by layer alone;
    the tied head's accumulator made anew for each micro-batch of the group."""
    cfg = get_flavor(flavor).build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    batches = [make_batch(cfg.vocab_size, seed=s) for s in range(5)]
    ref_loss, ref_grads = reference(model, batches)
    adapter = DecoderAdapter(cfg)
    for name, plan in layer_major_plans(len(batches)).items():
        store = HostStore(adapter)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, plan,
                                 EngineConfig(device=engine_device, spill_dir=str(tmp_path)))
        loss, sq = engine.compute_grads(batches)
        assert_engine_idle(engine)
        engine.close()
        assert loss == pytest.approx(ref_loss, rel=1e-5), name
        assert_grads_close(engine_grads(store), ref_grads)
        assert set(sq) == {u.name for u in adapter.units}
    assert not list(tmp_path.glob("layerwise-spill-*")), "spill files left behind"


class SlowAdamW(HostAdamW):
    """Updates late: a refresh that did not wait for its unit's update would copy old weights."""

    def step_unit(self, buf, lr, clip_coef):
        time.sleep(0.005)
        super().step_unit(buf, lr, clip_coef)


def _train(cfg, model, plan, data, device):
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    opt = SlowAdamW(AdamWConfig(lr=1e-2, max_grad_norm=1.0))
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device=device),
                             optimizers={u.name: opt for u in adapter.units})
    losses = [engine.train_step(step).loss for step in data]
    evals = [engine.eval_loss(data[0])]  # (waits for the updates: only at the end)
    out = {k: v.clone() for k, v in store.state_dict().items()}
    engine.close()
    return losses, evals, out


@pytest.mark.parametrize("per_load", [1, 2])
def test_resident_layers_train_bit_identical_to_streamed(per_load, engine_device):
    """A few optimizer steps (then an eval) with resident layers give the weights, losses and
    eval loss of the same run with every layer streamed, bit for bit. Mutations
    seen failing: no refresh after an update (``mark_stale`` skipped); a refresh started before
    the unit's update is done (``refresh_ready`` not asking ``update_done``)."""
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    g = torch.Generator().manual_seed(3)
    data = [[make_batch(cfg.vocab_size, seed=int(torch.randint(0, 1000, (), generator=g)))
             for _ in range(2)] for _ in range(3)]
    base = dict(internal_tiers=["recompute", "device", "host", "recompute"],
                micro_batches_per_load=per_load)
    streamed = _train(cfg, model, Plan(MIXED, **base), data, engine_device)
    for resident in ([1, 3], list(range(L))):
        got = _train(cfg, model, Plan(MIXED, resident_layers=resident, **base), data,
                     engine_device)
        assert got[0] == streamed[0] and got[1] == streamed[1], resident
        for k, v in streamed[2].items():
            assert torch.equal(got[2][k], v), (resident, k)


def _streamed_copy_bytes(engine, n):
    """H2D bytes the weight window copies for one step of ``n`` micro-batches (streamed units)."""
    steps = plan_step_program(engine.plan, n)
    resident = resident_units(engine.plan.resident_layers)
    window = WeightWindow(weight_schedule([s.op for s in steps], engine.adapter.tied, resident),
                          engine.plan.prefetch_depth)
    copies = window.fill()
    for s in steps:
        units = [u for u in s.op.units(engine.adapter.tied) if u not in resident]
        for u in units:
            copies += window.acquire(u)
        for u in units:
            window.release(u)
        copies += window.fill()
    return sum(engine.store[u].copy_source.nbytes for u, _ in copies)


def _step_h2d_bytes(plan, n=8, steps=3):
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device="cpu-async"))
    per_step = []
    for s in range(steps):
        engine.synchronize()
        before = engine.backend.copied_bytes["h2d"]
        engine.train_step([make_batch(cfg.vocab_size, seed=10 * s + k) for k in range(n)])
        engine.backend.synchronize()
        per_step.append(engine.backend.copied_bytes["h2d"] - before)
    model_bytes = store.copy_source_nbytes()
    expect = _streamed_copy_bytes(engine, n)
    resident = sum(b.nbytes for b in engine.streamer.resident.buffers.values())
    engine.close()
    return per_step, model_bytes, expect, resident


def test_copy_lane_bytes_layer_major_and_resident():
    """The asynchronous backend's own H2D counter (every boundary on the device: the H2D lane
    moves weights only): a layer-major step of 8 micro-batches copies the weights about twice
    (forward and backward), where micro-batch-major copies them ~2 x 8 times; a resident layer
    costs its one refresh per step and nothing else. Mutations seen failing: resident buffers
    refreshed at every acquire (``_stale`` never cleared); no refresh after an update."""
    mb_major, model_bytes, mb_expect, _ = _step_h2d_bytes(Plan(["device"] * L))
    assert all(b == mb_expect for b in mb_major)
    assert mb_expect / model_bytes > 14
    lm, _, lm_expect, _ = _step_h2d_bytes(Plan(["device"] * L, micro_batches_per_load=8))
    assert all(b == lm_expect for b in lm)
    assert lm_expect / model_bytes <= 2.1
    res, _, res_expect, resident = _step_h2d_bytes(
        Plan(["device"] * L, micro_batches_per_load=8, resident_layers=[0, 2]))
    assert resident > 0 and res_expect < lm_expect
    assert all(b == res_expect + resident for b in res), (res, res_expect, resident)


def test_layer_major_bf16_gradients_land_once_and_train():
    """bf16 compute on the asynchronous backend, one group of 4 micro-batches, a store with
    bf16 gradients (they land once a step): the loss falls, and the first step's gradients are
    close to those of the micro-batch-major run into fp32 gradients. Mutation seen failing: a
    later micro-batch's gradient written over the group's sum (``deposit`` ignoring ``add``)."""
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L, tie_word_embeddings=False)
    model = build_hf_model(cfg, seed=0)
    data = [make_batch(cfg.vocab_size, batch=2, seq=16, seed=s) for s in range(4)]
    adapter = DecoderAdapter(cfg)
    runs = {}
    for name, plan, grad_dtype in (("lm", Plan(MIXED, micro_batches_per_load=4), torch.bfloat16),
                                   ("mb", Plan(MIXED), torch.float32)):
        store = HostStore(adapter, compute_dtype=torch.bfloat16, grad_dtype=grad_dtype)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, plan, EngineConfig(
            device="cpu-async", compute_dtype=torch.bfloat16,
            optimizer=AdamWConfig(lr=3e-3, max_grad_norm=None)))
        engine.compute_grads(data)
        assert store["layers.0"].grad.dtype == grad_dtype
        grads = {k: v.float().clone() for k, v in engine_grads(store).items()}
        losses = [engine.train_step(data).loss for _ in range(6)]
        engine.close()
        runs[name] = grads, losses
    (g_lm, losses), (g_mb, _) = runs["lm"], runs["mb"]
    assert losses[-1] < losses[0] - 0.05, losses
    assert_grads_close(g_lm, g_mb, rtol=2e-2)


def test_bf16_gradients_need_the_step_to_land_once():
    """A bf16-gradient store is refused for micro-batches summed on the host, and taken when
    they share one load."""
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=2)
    adapter = DecoderAdapter(cfg)
    data = [make_batch(cfg.vocab_size, seed=s) for s in range(3)]
    for per_load, ok in ((2, False), (3, True)):
        store = HostStore(adapter, compute_dtype=torch.bfloat16, grad_dtype=torch.bfloat16)
        store.copy_from_model(build_hf_model(cfg, seed=0))
        engine = StreamingEngine(adapter, store, Plan(["device"] * 2, micro_batches_per_load=per_load),
                                 EngineConfig(device="cpu-async", compute_dtype=torch.bfloat16))
        try:
            if ok:
                loss, _ = engine.compute_grads(data)
                assert math.isfinite(loss)
                assert float(store["layers.1"].grad.float().abs().sum()) > 0
            else:
                with pytest.raises(ValueError, match="micro_batches_per_load >= 3"):
                    engine.compute_grads(data)
        finally:
            engine.close()


def test_fp32_sum_lands_in_a_bf16_gradient_rounded_to_nearest():
    """A layer-major group's fp32 sum into a bf16 host gradient: ``.to(bfloat16)``'s bits."""
    src = torch.randn(10_000, generator=torch.Generator().manual_seed(0)) * 1e-3
    dst = torch.empty(10_000, dtype=torch.bfloat16)
    accumulate(dst, src, first=True)
    assert torch.equal(dst.view(torch.int16), src.to(torch.bfloat16).view(torch.int16))
    with pytest.raises(ValueError, match="not summed into"):
        accumulate(dst, src, first=False)


def test_forward_logits_with_resident_layers_equal_streamed(engine_device):
    """Eval before any step (buffers filled at first use) and after one (refreshed)."""
    cfg = get_flavor("qwen3-debug-untied").build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    ids = make_batch(cfg.vocab_size).input_ids
    out = []
    for resident in ([], [0, 1, 2, 3]):
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, Plan(MIXED, resident_layers=resident),
                                 EngineConfig(device=engine_device))
        before = engine.forward_logits(ids)
        engine.train_step([make_batch(cfg.vocab_size, seed=2)])
        out.append((before, engine.forward_logits(ids)))
        engine.close()
    (a0, a1), (b0, b1) = out
    assert torch.equal(a0, b0) and torch.equal(a1, b1)
    assert not torch.equal(a0, a1)
    with torch.no_grad():
        assert torch.allclose(a0, model(ids).logits, atol=1e-5)


def test_lora_layer_major_and_resident_equal_the_streamed_lora_run(engine_device, tmp_path):
    """A LoRA run (frozen base in the unit's copy source, adapters trained): layer-major and
    resident plans give the micro-batch-major streamed run's gradients (that run equals PEFT,
    ``tests/adapters``), and two optimizer steps with resident layers its adapter weights, bit
    for bit. Mutation seen failing: no refresh after an update (``mark_stale`` skipped)."""
    from layerwise.adapters.config import LoraConfig
    from layerwise.adapters.lora_store import init_lora_store

    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L)
    lora = LoraConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    batches = [make_batch(cfg.vocab_size, seed=s) for s in range(3)]

    def run(plan, steps):
        adapter, store = init_lora_store(cfg, lora, seed=0)
        store.init_adapters(0, init_b=lambda v, g: v.copy_(torch.randn(v.shape, generator=g) * 0.1))
        engine = StreamingEngine(adapter, store, plan,
                                 EngineConfig(device=engine_device, spill_dir=str(tmp_path)))
        engine.compute_grads(batches)
        grads = {b.name: b.grad.clone() for b in store if b.layout.numel}
        for _ in range(steps):
            engine.train_step(batches)
        engine.synchronize()
        weights = {b.name: b.master.clone() for b in store if b.layout.numel}
        engine.close()
        return grads, weights

    ref_grads, ref_weights = run(Plan(MIXED), 2)
    assert ref_grads and all(float(g.abs().sum()) > 0 for g in ref_grads.values())
    for plan in (Plan(MIXED, internal_tiers=["host", "device", "recompute", "host"],
                      micro_batches_per_load=2),
                 Plan(MIXED, micro_batches_per_load=3, resident_layers=[0, 2])):
        grads, _ = run(plan, 0)
        for u, g in ref_grads.items():
            rel = ((grads[u] - g).norm() / g.norm()).item()
            assert rel <= 1e-5, (plan.micro_batches_per_load, u, rel)
    _, weights = run(Plan(MIXED, resident_layers=[1, 3]), 2)
    for u, w in ref_weights.items():
        assert torch.equal(weights[u], w), u


ORDERING_PLAN = Plan(["host", "nvme", "recompute", "host"], prefetch_depth=2,
                     internal_tiers=["recompute", "host", "recompute", "device"],
                     micro_batches_per_load=2, resident_layers=[1, 2])


@pytest.mark.parametrize("slow_lane", sampled([None, "compute", "h2d", "d2h"], {"None", "d2h"}))
def test_layer_major_resident_ordering_under_lane_delays(slow_lane, monkeypatch, tmp_path):
    """Layer-major groups (2 of 3 micro-batches), resident layers, every offload kind, on the
    asynchronous backend: 12 seeded delay patterns (``None``), and each lane 20 ms behind the
    others, give autograd's gradients (the refresh's own wait is guarded by
    ``test_compute_waits_for_a_late_resident_refresh``)."""
    from concurrent.futures import ThreadPoolExecutor

    from layerwise.engine import AsyncCpuBackend, executor

    cfg = get_flavor("llama-debug-tied").build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    batches = [make_batch(cfg.vocab_size, seed=s) for s in range(3)]
    ref_loss, ref_grads = reference(model, batches)
    if slow_lane is not None:
        monkeypatch.setattr(executor, "make_backend",
                            lambda device, seed: AsyncCpuBackend(lane_delays_s={slow_lane: 0.02}))

    def one(seed: int):
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter)
        store.copy_from_model(model)
        spill = tmp_path / f"seed{seed}"
        spill.mkdir()
        engine = StreamingEngine(adapter, store, ORDERING_PLAN, EngineConfig(
            device="cpu-async", async_seed=seed, spill_dir=str(spill)))
        try:
            loss, _ = engine.compute_grads(batches)
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert_grads_close(engine_grads(store), ref_grads)
        except AssertionError as e:
            return seed, str(e)[:200]
        finally:
            engine.close()
        return None

    seeds = range(12) if slow_lane is None else range(1)
    with ThreadPoolExecutor(4) as pool:
        failures = [f for f in pool.map(one, seeds) if f is not None]
    assert not failures, failures[:3]


def test_a_fetch_ahead_never_takes_the_slot_of_an_earlier_fetch(engine_device, monkeypatch,
                                                                 tmp_path):
    """Slow NVMe reads, host boundaries below them, a group of 2: while the NVMe boundaries of
    the op being run are still being read, the host boundaries of the op after it could be
    fetched at once, and the ``fetch_slot_count`` (3) slots would run out before the op's own
    fetches. Mutation seen failing: ``_next`` prefetching without ``keep_free`` ("no free fetch
    slot")."""
    from layerwise.engine import boundary_tiers

    read = boundary_tiers.BoundaryTiers._read

    def slow_read(self, written, numel):
        time.sleep(0.05)
        return read(self, written, numel)

    monkeypatch.setattr(boundary_tiers.BoundaryTiers, "_read", slow_read)
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    batches = [make_batch(cfg.vocab_size, seed=s) for s in range(2)]
    ref_loss, ref_grads = reference(model, batches)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = Plan(["host", "nvme", "host", "nvme"], micro_batches_per_load=2)
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(device=engine_device, spill_dir=str(tmp_path)))
    try:
        loss, _ = engine.compute_grads(batches)
    finally:
        engine.close()
    assert len(engine.acts.slots) == 3
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)


class SlowResidentAdamW(HostAdamW):
    """Updates ``layers.1`` (resident below) late: its refresh is issued at its own acquire."""

    def step_unit(self, buf, lr, clip_coef):
        if buf.name == "layers.1":
            time.sleep(0.05)
        super().step_unit(buf, lr, clip_coef)


def test_compute_waits_for_a_late_resident_refresh(monkeypatch):
    """A resident layer whose update finishes late is refreshed where the forward needs it,
    behind a slow H2D lane: the forward still reads the new weights (the run equals the streamed
    one, bit for bit). Mutation seen failing: ``ResidentWeights.acquire`` without its
    ``backend.wait`` (compute reads the previous step's weights)."""
    from layerwise.engine import AsyncCpuBackend, executor

    monkeypatch.setattr(executor, "make_backend",
                        lambda device, seed: AsyncCpuBackend(lane_delays_s={"h2d": 0.02}))
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=L)
    model = build_hf_model(cfg, seed=0)
    data = [[make_batch(cfg.vocab_size, seed=s)] for s in range(3)]
    out = []
    for resident in ([], [1]):
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter)
        store.copy_from_model(model)
        opt = SlowResidentAdamW(AdamWConfig(lr=1e-2))
        engine = StreamingEngine(adapter, store, Plan(["device"] * L, resident_layers=resident),
                                 EngineConfig(device="cpu-async"),
                                 optimizers={u.name: opt for u in adapter.units})
        losses = [engine.train_step(b).loss for b in data]
        engine.close()
        out.append(losses)
    assert out[0] == out[1]


@pytest.mark.parametrize("flavor", ["qwen3-moe-debug", "gpt-oss-debug"])
def test_layer_major_moe_aux_loss_equals_hf(flavor, engine_device):
    """Micro-batches of different sizes and target counts in layer-major groups: each keeps its
    own router record (its layer context), so the aux loss is HF's token-weighted mean as in
    micro-batch-major order (``tests/models/test_families.py``)."""
    import family_cases as fc

    cfg, model, adapter = fc.hf_case(flavor)
    micro = [fc.make_batch(cfg.vocab_size, batch=b, seq=10, seed=s)
             for b, s in ((1, 3), (2, 4), (1, 5))]
    micro[1].labels[1, :7] = -100
    ref_loss, ref_grads = fc.hf_reference(model, cfg, micro)
    n = adapter.num_layers
    for plan in (Plan.every_k(n, 2, micro_batches_per_load=3),
                 Plan(["host"] * n, micro_batches_per_load=2, resident_layers=[0])):
        loss, grads, _ = fc.engine_run(adapter, model, plan, micro, engine_device)
        assert loss == pytest.approx(ref_loss, rel=1e-5)
        fc.assert_grads_close(grads, ref_grads)


@pytest.mark.parametrize("per_load, grad_dtype", [(2, torch.bfloat16), (1, torch.float32)])
def test_trainer_keeps_bf16_gradients_when_they_land_once(per_load, grad_dtype, tmp_path):
    """``train/loop.py``: bf16 compute, 2 micro-batches a step on one process: the store's layer
    gradients are bf16 when the plan lands them once (one group of 2), fp32 when they are summed
    on the host; a step trains either way. Mutation seen failing: the loop keeping bf16
    gradients for one micro-batch per step only (``num_micro_batches == 1``)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "train"))
    from dist_child import BASE

    from layerwise import config
    from layerwise.train.loop import Trainer, TrainConfig

    layers = get_flavor(BASE["model"]).build_config().num_hidden_layers
    plan_path = tmp_path / "plan.json"
    Plan.every_k(layers, 2, micro_batch_size=1, num_micro_batches=2, seq_len=BASE["seq_len"],
                 micro_batches_per_load=per_load).save(plan_path)
    cfg = config.apply_overrides(TrainConfig(**BASE), [
        f"out_dir={tmp_path / 'out'}", "steps=1", f"plan={plan_path}", "micro_batch_size=1",
        "model.compute_dtype=bfloat16", "device=cpu-async", "ckpt.every=0", "ckpt.at_end=false",
        "export=false"])
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        assert trainer.store["layers.0"].grad.dtype == grad_dtype
        assert trainer.store["head"].grad.dtype == torch.float32
        trainer.fit()
    finally:
        trainer.close()
    assert (tmp_path / "out" / "metrics.jsonl").read_text().count('"step": 1') == 1
