"""The engine's ordering, checked on the asynchronous CPU backend (the GPU's protocol on threads).

Each lane sleeps a seeded random delay before each item, so across seeds the copy lanes run ahead
of compute, fall behind it, and the host runs ahead of all of them. With every wait in place the
gradients equal plain autograd for every delay pattern.

Mutations checked by hand (each makes ``test_seeded_delay_patterns_match_autograd`` fail):
- slot free: ``WeightStreamer._issue`` copies without ``after=[slot.free_after]``;
- weights landed before compute reads them: ``WeightStreamer.acquire`` without
  ``backend.wait([res.ready])``;
- D2H before the host reads: ``GradSink._land_loop`` without ``ev.synchronize()``;
- offload before fetch: ``BoundaryTiers._issue_fetch`` without ``e.stored`` in ``after``;
- gradient slot free before it is rewritten: ``GradSink.begin`` without its ``backend.wait``
  (fails ``test_one_lane_far_behind_the_others[d2h]`` every time, the seeded patterns rarely);
- kept internals fetched before the backward reads them: ``KeptInternals.ready`` without its
  ``backend.wait`` (``internals``, with prefetch depth 2: at depth 1 the backward's weight copy
  follows the fetch on the H2D lane and covers it);
- kept internals' offload landed before their fetch: ``KeptInternals.fetch`` without
  ``s.stored`` in ``after`` together with ``OffloadWindow.next_op`` without its
  ``backend.wait`` (``internals``; either one alone orders the fetch after the offload: the
  fetch's ``record()`` follows the window's wait, one op after the forward).
(update-before-forward is ``test_training.test_update_of_a_layer_finishes_before_its_next_forward``.)
"""

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from layerwise.engine import AsyncCpuBackend, EngineConfig, StreamingEngine, executor
from layerwise.engine.batch import Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference

SEEDS = [pytest.param(range(16), id="seeds0-15"),
         pytest.param(range(16, 50), id="seeds16-49", marks=pytest.mark.sweep)]
"""50 delay patterns a plan: ``make test`` runs the first 16, ``make test-all`` all of them.
Seen with the 16 alone: ``WeightStreamer.acquire`` without its wait fails ``mixed-depth1``."""
CONCURRENT_SEEDS = 4
"""Seeds run at once, each with its own engine (adapter, lanes, store, spill dir): a seed's step
mostly waits on its lanes' delays, so four share the CPU without queueing, and the others' load
only adds jitter on top of each seed's delay pattern."""


@pytest.fixture(scope="module")
def setup():
    cfg = get_flavor("llama-debug-tied").build_config(num_hidden_layers=6)
    model = build_hf_model(cfg, seed=0)
    batches = [make_batch(cfg.vocab_size, batch=2, seq=16, seed=s) for s in (1, 2)]
    ref_loss, ref_grads = reference(model, batches)
    return cfg, model, batches, ref_loss, ref_grads


PLANS = {
    "mixed-depth1": Plan(["host", "device", "nvme", "recompute", "host", "recompute"],
                         head_chunk_tokens=9, prefetch_depth=1),
    "host-depth2": Plan(["host"] * 6, head_chunk_tokens=13, prefetch_depth=2),
    "internals": Plan(["host", "recompute", "nvme", "recompute", "device", "recompute"], prefetch_depth=2,
                      internal_tiers=["host", "device", "recompute", "host", "recompute", "host"]),
}


@pytest.mark.parametrize("seeds", SEEDS)
@pytest.mark.parametrize("plan_name", PLANS)
def test_seeded_delay_patterns_match_autograd(setup, plan_name, seeds, tmp_path):
    cfg, model, batches, ref_loss, ref_grads = setup

    def one(seed: int) -> tuple[int, str] | None:
        adapter = DecoderAdapter(cfg)  # its layer templates are reparametrized per call
        store = HostStore(adapter)
        store.copy_from_model(model)
        spill = tmp_path / f"seed{seed}"
        spill.mkdir()
        engine = StreamingEngine(adapter, store, PLANS[plan_name],
                                 EngineConfig(device="cpu-async", async_seed=seed, spill_dir=str(spill)))
        try:
            loss, _ = engine.compute_grads(batches)
            assert loss == pytest.approx(ref_loss, rel=1e-5)
            assert_grads_close(engine_grads(store), ref_grads)
        except AssertionError as e:
            return seed, str(e)[:200]
        finally:
            engine.close()
        return None

    with ThreadPoolExecutor(CONCURRENT_SEEDS, thread_name_prefix="seed") as pool:
        failures = [f for f in pool.map(one, seeds) if f is not None]
    assert not failures, f"{len(failures)} of {len(seeds)} delay patterns went wrong: {failures[:3]}"


@pytest.mark.parametrize("plan_name", ["mixed-depth1", "internals"])
@pytest.mark.parametrize("slow_lane", ["compute", "h2d", "d2h"])
def test_one_lane_far_behind_the_others(setup, slow_lane, plan_name, monkeypatch, tmp_path):
    """One lane sleeps up to 20 ms before every item while the others run free: each wait is
    exercised in its worst case (e.g. a slow D2H lane with a fast compute lane is what the
    gradient slot's wait guards against: without it this fails for ``d2h``)."""
    cfg, model, batches, ref_loss, ref_grads = setup
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    monkeypatch.setattr(executor, "make_backend",
                        lambda device, seed: AsyncCpuBackend(lane_delays_s={slow_lane: 0.02}))
    engine = StreamingEngine(adapter, store, PLANS[plan_name],
                             EngineConfig(device="cpu-async", spill_dir=str(tmp_path)))
    loss, _ = engine.compute_grads(batches)
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)


def test_device_slots_are_allocated_once_and_bounded_by_prefetch_depth(setup):
    """The device memory the engine moves data through is allocated when it is built (weights,
    gradients) or at the first step (fetch slots), never again; weight slots are depth + 1.
    Mutation checked: allocating a fresh device buffer per weight copy (``backend.alloc`` in
    ``_issue``) makes ``allocated_bytes`` grow with every step."""
    cfg, model, batches, _, _ = setup
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = PLANS["mixed-depth1"]
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device="cpu-async", async_seed=3))
    assert len(engine.streamer.slots) == plan.prefetch_depth + 1
    engine.train_step(batches)
    after_first = engine.backend.allocated_bytes
    for _ in range(2):
        engine.train_step(batches)
    assert engine.backend.allocated_bytes == after_first
    largest_unit = max(b.copy_source.numel() for b in store) * 4
    weight_bytes = sum(s.buffer.untyped_storage().nbytes() for s in engine.streamer.slots)
    assert weight_bytes == (plan.prefetch_depth + 1) * largest_unit
    engine.close()


def test_a_unit_is_copied_once_per_use_window(setup):
    """A tied head needs the embedding right after the last layer's forward; the embedding copy
    of ``embed_fwd`` is not reused (its slot was freed), but within one window a unit is not
    copied twice: every-1 at prefetch depth 2 with two micro-batches copies each use of the
    schedule except ``layers.0``, shared by the first micro-batch's last backward and the
    second's first layer forward (two uses ahead: the embedding's forward is between them;
    ``embed_bwd`` reads no weights)."""
    cfg, model, batches, _, _ = setup
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = replace(Plan.every_k(adapter.num_layers, 1), prefetch_depth=2)
    engine = StreamingEngine(adapter, store, plan, EngineConfig(device="cpu-async", async_seed=None))
    engine.compute_grads(batches)
    uses_per_mb = 1 + 6 + 2 + 6  # embed_fwd, layers, head (embed + head), layers back
    assert engine.streamer.loads == 2 * uses_per_mb - 1
    engine.close()


def test_eval_and_logits_run_on_the_async_backend(setup):
    cfg, model, batches, _, _ = setup
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2),
                             EngineConfig(device="cpu-async", async_seed=5))
    ids = batches[0].input_ids
    got = engine.forward_logits(ids)
    with torch.no_grad():
        want = model(ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    engine.close()
    assert isinstance(batches[0], Batch)
