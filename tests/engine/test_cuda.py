"""GPU paths: streams, pinned memory, bf16 numerics, device memory, copies hidden behind compute.

Tests marked ``cuda`` are skipped without CUDA (tests/conftest.py); ``make gpu-check`` runs them
(``pytest -m cuda`` over the test files that hold such tests) on a GPU machine. The helpers they
share with the check (``benchmarks/gpu_check``: trace analysis, the seeded store fill) are tested on the
CPU in ``test_gpu_check.py``; the bf16 gradient test also runs on the CPU backend.

What the GPU tests hold the engine to:

- bf16 gradients: per parameter, close to Hugging Face's own bf16 autograd on the same bf16
  weights, and no further from the fp32 gradient than HF's bf16 gradient is;
- device memory: the allocator's reserved peak (``torch.cuda.max_memory_reserved``, the memory
  the process actually took from the card) at most 1.1x ``engine.predict_memory`` for every-1
  and keep-all-host at prefetch depth 1 and 2;
- overlap: in a profiled step, most of the weight (H2D) and gradient (D2H) copy time runs on
  side streams while compute kernels run.
"""

from __future__ import annotations

import copy
import gc
import json
import os

import pytest
import torch
import torch.nn.functional as F

from benchmarks.gpu_check import store as check_store
from benchmarks.gpu_check import trace as check_trace
from layerwise.engine.backend import Ref
from layerwise.engine import CudaBackend, EngineConfig, StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.split_master import split_torch
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference

cuda = pytest.mark.cuda


@pytest.fixture
def no_tf32():
    """fp32 references on the GPU in true fp32 (restored afterwards)."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _clean_cuda() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


# ----- the engine on the GPU -------------------------------------------------------------------

@cuda
def test_backend_round_trip_through_pinned_memory():
    """A copy in, compute, a copy out, ordered only by events across the three streams."""
    backend = CudaBackend()
    host = backend.host_alloc(1 << 20, torch.float32)
    host.copy_(torch.randn(1 << 20))
    dev = backend.alloc(1 << 20, torch.float32)
    backend.wait([backend.copy_h2d(dev, host)])
    out = Ref()
    backend.launch(lambda: setattr(out, "value", dev * 2))
    back = backend.host_alloc(1 << 20, torch.float32)
    backend.copy_d2h(back, out, after=[backend.record()]).synchronize()
    assert back.is_pinned()
    assert torch.equal(back, host * 2)


@cuda
@pytest.mark.parametrize("plan_name", ["k1", "mixed", "internals"])
def test_fp32_gradients_on_gpu_match_autograd(plan_name, tmp_path, no_tf32):
    """``internals``: kept layer internals on the device and on the host (saved tensors copied
    out on the D2H stream, fetched back on the H2D stream into fresh allocator memory)."""
    cfg = get_flavor("llama-debug").build_config()
    model = build_hf_model(cfg, seed=0)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref_grads = reference(model, [batch])
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    assert store.pinned
    store.copy_from_model(model)
    plans = {"k1": Plan.every_k(4, 1), "mixed": Plan(["host", "nvme", "recompute", "device"], prefetch_depth=2),
             "internals": Plan(["recompute", "host", "recompute", "device"], prefetch_depth=2,
                               internal_tiers=["host", "device", "recompute", "host"])}
    engine = StreamingEngine(adapter, store, plans[plan_name],
                             EngineConfig(device="cuda", compute_dtype=torch.float32,
                                          spill_dir=str(tmp_path)))
    loss, _ = engine.compute_grads([batch])
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    assert_grads_close(engine_grads(store), ref_grads, rtol=1e-4)


def _hf_grads(model, batch: Batch, dtype: torch.dtype, device: str) -> tuple[float, dict[str, torch.Tensor]]:
    """Plain HF autograd with the parameters in ``dtype`` (buffers such as rotary ``inv_freq``
    stay fp32, as the engine keeps them); loss in fp32 over all target tokens."""
    m = copy.deepcopy(model)
    for p in m.parameters():
        p.data = p.data.to(dtype)
    m.to(device)
    try:
        logits = m(batch.input_ids.to(device)).logits
    except RuntimeError as e:
        # torch 2.13's bf16 SDPA on a CPU with AVX-512 run under ATEN_CPU_CAPABILITY=default
        # (the suite's other-kernel-path run) packs for AVX-512 anyway and raises: a torch
        # limit of that forced setting, not of this machine's kernels.
        if "pack_vnni2" in str(e) and os.environ.get("ATEN_CPU_CAPABILITY"):
            pytest.skip(f"torch's bf16 CPU attention under ATEN_CPU_CAPABILITY: {e}")
        raise
    loss = F.cross_entropy(logits.float().flatten(0, 1), batch.labels.to(device).flatten(),
                           ignore_index=IGNORE_INDEX, reduction="sum") / batch.num_target_tokens
    loss.backward()
    return loss.item(), {n: p.grad.float().cpu() for n, p in m.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
@pytest.mark.parametrize("flavor", ["llama-debug", "qwen2-debug"])
@pytest.mark.parametrize("plan_name", ["k1", "mixed"])
def test_bf16_gradients_match_hf_bf16_autograd(device, flavor, plan_name, tmp_path, no_tf32):
    """The engine in bf16 (weights streamed as the bf16 copy of the fp32 master) against HF
    autograd with the same bf16 weights, per parameter, and both against fp32 autograd.

    On the CPU backend (2026-11-29) the engine's grads were within 5.5e-3 of HF bf16 (0 for k1
    on llama), and HF bf16 itself was 5e-3..1e-2 from fp32. A wrong scale, a lost micro-batch
    or a stale weight gives errors of order 1.
    """
    cfg = get_flavor(flavor).build_config()
    model = build_hf_model(cfg, seed=0)
    batch = make_batch(cfg.vocab_size, batch=2, seq=64)
    loss32, ref32 = _hf_grads(model, batch, torch.float32, device)
    loss16, ref16 = _hf_grads(model, batch, torch.bfloat16, device)
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=torch.bfloat16)
    store.copy_from_model(model)
    plan = (Plan.every_k(4, 1) if plan_name == "k1"
            else Plan(["host", "nvme", "recompute", "device"], prefetch_depth=2, head_chunk_tokens=48))
    engine = StreamingEngine(adapter, store, plan, EngineConfig(
        device=device, compute_dtype=torch.bfloat16, spill_dir=str(tmp_path)))
    loss, _ = engine.compute_grads([batch])
    engine.close()
    got = engine_grads(store)
    assert loss == pytest.approx(loss16, rel=1e-2)
    assert loss == pytest.approx(loss32, rel=1e-2)
    problems = []
    for name in ref16:
        assert got[name].dtype == torch.float32, "host gradients are accumulated in fp32"
        e_hf = _rel(ref16[name], ref32[name])  # HF's own bf16 error
        e_engine = _rel(got[name], ref32[name])
        d = _rel(got[name], ref16[name])
        if not (d <= 3 * e_hf + 5e-3 and e_engine <= 2 * e_hf + 2e-3 and e_engine <= 5e-2):
            problems.append(f"{name}: vs HF bf16 {d:.2e}, vs fp32 {e_engine:.2e} (HF bf16 vs fp32 {e_hf:.2e})")
    assert not problems, "\n".join(problems)


@cuda
def test_bf16_training_keeps_fp32_master_and_learns():
    cfg = get_flavor("llama-debug").build_config()
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=torch.bfloat16)
    store.copy_from_model(build_hf_model(cfg, seed=0))
    assert store["layers.0"].split  # bf16 compute: the master is the copy plus a remainder
    assert store["layers.0"].read_master().dtype == torch.float32
    assert store["layers.0"].compute.dtype == torch.bfloat16
    engine = StreamingEngine(adapter, store, Plan.every_k(4, 2),
                             EngineConfig(device="cuda", compute_dtype=torch.bfloat16))
    batch = make_batch(cfg.vocab_size)
    losses = [engine.train_step([batch]).loss for _ in range(30)]
    engine.synchronize()
    engine.close()
    assert losses[-1] < losses[0] * 0.8
    for buf in store:  # the device only ever saw the bf16 part of the current fp32 master
        hi, _ = split_torch(buf.read_master())
        assert torch.equal(buf.compute, hi), buf.name


# ----- device memory: the allocator against the memory model --------------------------------

MEM_MODEL = dict(vocab_size=16384, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                 tie_word_embeddings=False)
"""A Llama of ~250M parameters: big enough that the prediction (~1.3 GB at 2 x 4096 tokens)
dwarfs the allocator's fixed costs (cuBLAS workspace, 2 MB block rounding), small enough to
build in a second."""


def _random_store(seed: int = 0, **model) -> tuple[DecoderAdapter, HostStore, object]:
    cfg = get_flavor("llama-debug").build_config(**{**MEM_MODEL, **model})
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=torch.bfloat16)
    check_store.fill_store_random(store, seed=seed)
    return adapter, store, cfg


def _bf16_engine(adapter: DecoderAdapter, store: HostStore, plan: Plan) -> StreamingEngine:
    return StreamingEngine(adapter, store, plan, EngineConfig(device="cuda", compute_dtype=torch.bfloat16))


def _random_engine(plan: Plan, seed: int = 0, **model) -> tuple[StreamingEngine, object]:
    adapter, store, cfg = _random_store(seed, **model)
    return _bf16_engine(adapter, store, plan), cfg


def _random_batch(vocab: int, batch: int, seq: int, seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, vocab, (batch, seq), generator=g),
                 torch.randint(0, vocab, (batch, seq), generator=g))


@cuda
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("rule", ["every-1", "keep-all-host"])
def test_reserved_device_peak_within_prediction(rule, depth):
    """Two training steps from an empty allocator cache: the memory the caching allocator
    reserved from before the engine was built stays within 1.1x of ``predict_memory`` (the
    engine's slots, fragmentation, the cuBLAS workspace and any buffer the model forgets all
    count). The baseline is taken before the engine exists: taken after, the slots it allocates
    at construction would be outside the measurement and the bound ~1.35x in truth."""
    mbs, seq = 2, 4096
    L = MEM_MODEL["num_hidden_layers"]
    plan = (Plan.every_k(L, 1, prefetch_depth=depth) if rule == "every-1"
            else Plan.keep_all(L, "host", prefetch_depth=depth))
    adapter, store, cfg = _random_store()
    batch = _random_batch(cfg.vocab_size, mbs, seq)
    _clean_cuda()  # drop the cached blocks of the random fill: only what the engine takes counts
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    engine = _bf16_engine(adapter, store, plan)
    try:
        predicted = engine.predict_memory(mbs, seq)
        for _ in range(2):
            stats = engine.train_step([batch], lr=1e-5)
            assert not stats.skipped
        engine.synchronize()
        torch.cuda.synchronize()
        reserved = torch.cuda.max_memory_reserved() - base
        allocated = torch.cuda.max_memory_allocated()
    finally:
        engine.close()
        del engine
        _clean_cuda()
    assert allocated > 0.3 * predicted.peak_bytes, "the steps did not run on the GPU"
    assert reserved <= 1.1 * predicted.peak_bytes, (
        f"{rule} depth {depth}: reserved peak {reserved / 2**20:.0f} MiB > 1.1 x predicted "
        f"{predicted.peak_bytes / 2**20:.0f} MiB (allocated peak {allocated / 2**20:.0f} MiB; "
        f"prediction at '{predicted.peak_op}': {predicted.describe()})")


# ----- copies hidden behind compute -------------------------------------------------------------

@cuda
def test_weight_and_gradient_copies_overlap_compute(tmp_path):
    """One profiled forward + backward (every-1, depth 1; the previous step's updates done):
    at least half of the H2D weight-copy time and of the D2H gradient-copy time runs while
    compute kernels run, on streams other than the compute stream.

    Sized so that hiding is possible: at 4 x 4096 tokens a layer's forward (~3 ms on an H100
    class GPU) is about as long as its ~90 MB weight copy, and its backward (~3x) longer than
    the weight copy in plus the gradient copy out; the first copies of the step and the last
    gradient copy have nothing to hide behind.
    """
    from torch.profiler import ProfilerActivity, profile

    L = MEM_MODEL["num_hidden_layers"] + 2
    engine, cfg = _random_engine(Plan.every_k(L, 1), num_hidden_layers=L)
    batch = _random_batch(cfg.vocab_size, 4, 4096)
    try:
        engine.train_step([batch], lr=1e-5)  # warm-up: kernels chosen, pinned staging allocated
        engine.synchronize()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            engine.compute_grads([batch])
            torch.cuda.synchronize()
        trace = tmp_path / "trace.json"
        prof.export_chrome_trace(str(trace))
    finally:
        engine.close()
        del engine
        _clean_cuda()
    ov = check_trace.copy_overlap(check_trace.load_trace_events(trace))
    summary = json.dumps({k: ov[k] for k in ("h2d", "d2h", "compute_stream", "compute_busy_s", "window_s")},
                         default=str)
    assert ov["kernels"] > 0 and ov["compute_stream"] is not None, summary
    # every unit's weights come in (embed, layers twice, head) and its gradient goes out
    assert ov["h2d"]["count"] >= 2 * L + 2, summary
    assert ov["d2h"]["count"] >= L + 2, summary
    assert ov["compute_stream"] not in ov["h2d"]["streams"] + ov["d2h"]["streams"], summary
    assert ov["h2d"]["overlap_fraction"] >= 0.5, summary
    assert ov["d2h"]["overlap_fraction"] >= 0.5, summary
