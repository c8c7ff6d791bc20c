"""The host side of a step: what the copy lanes really move, gradients landing in pieces and
overwriting the previous step's, and the optimizer overlapping the next step's forward."""

import os
import threading
import time

import pytest
import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.engine.grad_sink import ring_piece_bytes
from layerwise.engine.host_threads import MAX_LANDING_THREADS, plan_host_threads
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.models.names import EMBED, HEAD
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.plan import Plan
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference


def _engine(flavor: str, device: str, plan_of=Plan.keep_all, **overrides):
    cfg = get_flavor(flavor).build_config(**overrides)
    model = build_hf_model(cfg, seed=0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    engine = StreamingEngine(adapter, store, plan_of(adapter.num_layers),
                             EngineConfig(device=device, async_seed=None))
    return model, store, engine


@pytest.mark.parametrize("flavor", ["llama-debug", "llama-debug-tied"])
@pytest.mark.parametrize("device", ["cpu", "cpu-async"])
def test_copy_lanes_move_each_weight_once_per_use_and_embed_bwd_none(flavor, device):
    """Counted by the backend's copy lanes as they copy: keeping every boundary on the device,
    one micro-batch streams the embedding once (its forward; a tied head once more), every layer
    twice and the head once; nothing for ``embed_bwd``, whose gradient comes from the token ids
    and boundary 0's gradient. The CPU backend copies no weight: its compute reads the host's
    (mutation seen failing: ``reads_host`` false on ``CpuBackend``). D2H carries each unit's gradient once (the head's in fp32).
    Mutation seen failing: ``Op.units`` giving ``embed_bwd`` the embedding again (its weights
    streamed for the backward: one embedding more on the H2D lane)."""
    model, store, engine = _engine(flavor, device)
    batch = make_batch(engine.adapter.vocab_size)
    ref_loss, ref_grads = reference(model, [batch])
    loss, _ = engine.compute_grads([batch])
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)
    w = {b.name: b.copy_source.numel() * b.copy_source.element_size() for b in store}
    layers = sum(v for u, v in w.items() if u not in (EMBED, HEAD))
    tied = engine.adapter.tied
    streamed = (2 if tied else 1) * w[EMBED] + w[HEAD] + 2 * layers
    # the CPU backend's compute reads the host weights in place: no copy at all
    assert engine.backend.copied_bytes["h2d"] == (0 if device == "cpu" else streamed)
    fp32 = {b.name: b.layout.numel * 4 for b in store}
    head_d2h = fp32[HEAD] + (fp32[EMBED] if tied else 0)
    assert engine.backend.copied_bytes["d2h"] == (0 if device == "cpu" else
                                                  layers + w[EMBED] + head_d2h)


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_larger_than_a_ring_buffer_land_in_pieces(tied):
    """A 2000-id vocabulary makes the embedding and head gradients several ring buffers long
    (a buffer holds one layer's gradient): the pieces land at their offsets, and the gradients
    still equal autograd. Mutation seen failing: ``_RefPiece.get`` reading from element 0 for
    every piece (``[:self.hi - self.lo]``)."""
    flavor = "llama-debug-tied" if tied else "llama-debug"
    model, store, engine = _engine(flavor, "cpu-async", vocab_size=2000)
    assert store[EMBED].layout.numel * 4 > 3 * ring_piece_bytes(store)
    batches = [make_batch(2000, seed=s) for s in (1, 2)]
    ref_loss, ref_grads = reference(model, batches)
    loss, _ = engine.compute_grads(batches)
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)


def test_first_landing_overwrites_the_spent_gradient(engine_device):
    """Nothing zeroes gradients between steps: a step's first landing of each unit writes it.
    With NaN left in every host gradient, the step's gradients still equal autograd.
    Mutation seen failing: ``GradSink._first`` always False (every landing adds)."""
    model, store, engine = _engine("llama-debug-tied", engine_device, lambda n: Plan.every_k(n, 2))
    batches = [make_batch(engine.adapter.vocab_size, seed=s) for s in (1, 2)]
    ref_loss, ref_grads = reference(model, batches)
    for buf in store:
        buf.grad.fill_(float("nan"))
    loss, _ = engine.compute_grads(batches)
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-5)
    assert_grads_close(engine_grads(store), ref_grads)


class _SlowAdamW(HostAdamW):
    def step_unit(self, buf, lr, clip_coef):
        time.sleep(0.08)
        super().step_unit(buf, lr, clip_coef)


def test_updates_overlap_the_next_forward_and_each_unit_waits_for_its_own():
    """On the asynchronous backend, with slow updates (80 ms a unit): the next step's first
    forward (the embedding's) starts on the compute lane before the last unit's update ends,
    and no unit's next forward starts before its own update has ended.

    Mutations seen failing:
    - a drain at the step's start (``self.updates.wait_all()`` first in ``compute_grads``):
      the embedding's forward waits for every update;
    - ``WeightStreamer`` not waiting for the update (``acquire`` without ``wait_update`` and
      ``update_done`` always True): a layer's forward runs before its update ends.
    """
    cfg = get_flavor("llama-debug").build_config()
    model = build_hf_model(cfg, seed=0)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    slow = _SlowAdamW(AdamWConfig(lr=1e-3))
    engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 1),
                             EngineConfig(device="cpu-async", async_seed=None),
                             optimizers={u.name: slow for u in adapter.units})
    first_run: dict[str, float] = {}  # unit -> when its op first ran on the compute lane
    embed, layer = adapter.embed, adapter.layer

    def timed_embed(params, ids, *args):
        first_run.setdefault(EMBED, time.perf_counter())
        return embed(params, ids, *args)

    def timed_layer(i, *args):
        first_run.setdefault(f"layers.{i}", time.perf_counter())
        return layer(i, *args)

    batch = make_batch(adapter.vocab_size)
    engine.train_step([batch])  # its updates start as it returns
    adapter.embed, adapter.layer = timed_embed, timed_layer  # the next step's first runs
    engine.compute_grads([batch])
    engine.synchronize()  # step 1's updates all ended (step 2 submits none: no train_step)
    updates = dict(engine.updates.times)
    engine.close()
    assert set(first_run) == {EMBED} | {f"layers.{i}" for i in range(adapter.num_layers)}
    assert first_run[EMBED] < max(end for _, end in updates.values())
    early = {u: updates[u][1] - t for u, t in first_run.items() if t < updates[u][1]}
    assert not early, f"forwards started before their unit's update ended (by s): {early}"


def test_host_thread_layout_leaves_the_launchers_cpu_free():
    """On CUDA the landing and optimizer threads get every CPU of the process but one, and the
    threads they start inherit that; on the CPU backends nothing is pinned."""
    cpus = frozenset(range(16))
    one = plan_host_threads("cuda", 1, cpus)
    assert one.worker_cpus == frozenset(range(15))
    assert one.landing == MAX_LANDING_THREADS and one.optimizer_intra == 15
    assert plan_host_threads("cuda", 2, cpus).optimizer_intra == 7
    assert plan_host_threads("cuda", 1, frozenset({3})).worker_cpus is None
    cpu = plan_host_threads("cpu", 4)
    assert cpu.worker_cpus is None and cpu.optimizer_intra is None and cpu.landing == 1
    if not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs two CPUs to leave one free")
    mine = frozenset(os.sched_getaffinity(0))
    layout = plan_host_threads("cuda", 1, mine)
    seen = {}

    def worker():
        layout.pin_current_thread()
        child = threading.Thread(target=lambda: seen.setdefault("child", os.sched_getaffinity(0)))
        child.start()
        child.join()
        seen["worker"] = os.sched_getaffinity(0)

    th = threading.Thread(target=worker)
    th.start()
    th.join()
    assert seen["worker"] == seen["child"] == layout.worker_cpus == mine - {max(mine)}
    assert os.sched_getaffinity(0) == mine  # the caller's thread is left alone


def test_bf16_landing_on_the_async_path_equals_the_synchronous_one_bit_for_bit():
    """bf16 compute: the asynchronous path's gradients (joined, copied through the ring in
    pieces, added by the fused kernel on the landing thread) are bit-equal to the synchronous
    path's (each parameter's part added straight into its slice), over two micro-batches.
    Mutation seen failing: ``_land_loop`` passing ``first=True`` for every piece (the second
    micro-batch overwrites the first)."""
    grads = {}
    for device in ("cpu", "cpu-async"):
        cfg = get_flavor("llama-debug").build_config(vocab_size=2000)
        model = build_hf_model(cfg, seed=0)
        adapter = DecoderAdapter(cfg)
        store = HostStore(adapter, compute_dtype=torch.bfloat16)
        store.copy_from_model(model)
        engine = StreamingEngine(adapter, store, Plan.every_k(adapter.num_layers, 2),
                                 EngineConfig(device=device, compute_dtype=torch.bfloat16,
                                              async_seed=None))
        engine.compute_grads([make_batch(2000, seed=s) for s in (1, 2)])
        engine.close()
        grads[device] = {b.name: b.grad.clone() for b in store}
    for unit, g in grads["cpu"].items():
        assert torch.equal(g.view(torch.int32), grads["cpu-async"][unit].view(torch.int32)), unit


def test_every_host_worker_thread_binds_the_engine_device(monkeypatch, tmp_path):
    """Each thread the engine starts (the gradient landing thread, every optimizer worker, the
    NVMe tier's I/O thread and its staging-return threads) runs the backend's ``bind_thread``
    before any work: on CUDA that is ``torch.cuda.set_device`` of the engine's device, so no
    thread of a rank with LOCAL_RANK > 0 makes a context on GPU 0. Recorded on the asynchronous
    backend: the landing thread and every thread that ran an update, wrote an NVMe boundary or
    waited for a staging buffer's copy had bound first.

    Mutations seen failing: the executor handing the workers ``threads.initializer`` (the CPU
    mask alone) instead of ``_thread_init``; the NVMe pool without its ``initializer``."""
    from layerwise.engine import AsyncCpuBackend, backend as backend_mod
    from layerwise.engine import boundary_tiers, updates as updates_mod

    bound: set[str] = set()
    monkeypatch.setattr(AsyncCpuBackend, "bind_thread",
                        lambda self: bound.add(threading.current_thread().name))
    worked_on: dict[str, set[str]] = {"update": set(), "nvme write": set(), "staging": set()}

    def recording(kind, fn):
        def run(*args, **kwargs):
            out = fn(*args, **kwargs)  # (bound first, where the method binds itself)
            worked_on[kind].add(threading.current_thread().name)
            return out
        return run

    monkeypatch.setattr(updates_mod.HostUpdates, "_update",
                        recording("update", updates_mod.HostUpdates._update))
    monkeypatch.setattr(boundary_tiers.BoundaryTiers, "_write",
                        recording("nvme write", boundary_tiers.BoundaryTiers._write))
    monkeypatch.setattr(boundary_tiers.BoundaryTiers, "_return_staging",
                        recording("staging", boundary_tiers.BoundaryTiers._return_staging))
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    plan = Plan(["nvme", "host", "device", "recompute"][:adapter.num_layers])
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(device="cpu-async", async_seed=None, optimizer_threads=2,
                                          spill_dir=str(tmp_path)))
    try:
        batch = make_batch(cfg.vocab_size)
        for _ in range(2):
            engine.train_step([batch])
        engine.synchronize()
    finally:
        engine.close()
    assert "grad-sink" in bound
    for kind, names in worked_on.items():
        assert names and names <= bound, (kind, names, bound)

    class Cuda(backend_mod.CudaBackend):
        def __init__(self):  # no GPU here: only the device it binds
            self.device = torch.device("cuda", 3)

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    Cuda().bind_thread()
    assert calls == [torch.device("cuda", 3)]
