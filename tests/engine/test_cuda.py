"""GPU paths: streams, pinned memory, bf16 numerics, device memory, copies hidden behind compute.

Tests marked ``cuda`` are skipped without CUDA (tests/conftest.py); ``make gpu-check`` runs them
(``pytest -m cuda``) on a GPU machine. The helpers they share with ``benchmarks/gpu_check.py``
(trace analysis, store sizing, seeded store fill) are tested here on the CPU too, and the bf16
gradient test also runs on the CPU backend.

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
import importlib.util
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from layerwise.engine.backend import Ref
from layerwise.engine import CudaBackend, EngineConfig, StreamingEngine
from layerwise.engine.batch import IGNORE_INDEX, Batch
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.optim.adamw import AdamWConfig, HostAdamW
from layerwise.optim.adamw8bit import HostAdamW8bit
from layerwise.plan import Plan
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference

cuda = pytest.mark.cuda


def _load_gpu_check():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("layerwise_gpu_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


gpu_check = _load_gpu_check()


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
                             EngineConfig(device="cuda", spill_dir=str(tmp_path)))
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
    logits = m(batch.input_ids.to(device)).logits
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
    assert store["layers.0"].master.dtype == torch.float32
    assert store["layers.0"].compute.dtype == torch.bfloat16
    engine = StreamingEngine(adapter, store, Plan.every_k(4, 2),
                             EngineConfig(device="cuda", compute_dtype=torch.bfloat16))
    batch = make_batch(cfg.vocab_size)
    losses = [engine.train_step([batch]).loss for _ in range(30)]
    engine.synchronize()
    engine.close()
    assert losses[-1] < losses[0] * 0.8
    for buf in store:  # the device only ever saw the bf16 copy of the current fp32 master
        assert torch.equal(buf.compute, buf.master.to(torch.bfloat16)), buf.name


# ----- device memory: the allocator against the memory model --------------------------------

MEM_MODEL = dict(vocab_size=16384, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                 num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=8192,
                 tie_word_embeddings=False)
"""A Llama of ~250M parameters: big enough that the prediction (~1.3 GB at 2 x 4096 tokens)
dwarfs the allocator's fixed costs (cuBLAS workspace, 2 MB block rounding), small enough to
build in a second."""


def _random_engine(plan: Plan, seed: int = 0, **model) -> tuple[StreamingEngine, object]:
    cfg = get_flavor("llama-debug").build_config(**{**MEM_MODEL, **model})
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter, compute_dtype=torch.bfloat16)
    gpu_check.fill_store_random(store, seed=seed)
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(device="cuda", compute_dtype=torch.bfloat16))
    return engine, cfg


def _random_batch(vocab: int, batch: int, seq: int, seed: int = 1) -> Batch:
    g = torch.Generator().manual_seed(seed)
    return Batch(torch.randint(0, vocab, (batch, seq), generator=g),
                 torch.randint(0, vocab, (batch, seq), generator=g))


@cuda
@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("rule", ["every-1", "keep-all-host"])
def test_reserved_device_peak_within_prediction(rule, depth):
    """Two training steps from an empty allocator cache: the memory the caching allocator
    reserved beyond what was already held stays within 1.1x of ``predict_memory`` (its
    fragmentation, the cuBLAS workspace and any buffer the model forgets all count)."""
    mbs, seq = 2, 4096
    L = MEM_MODEL["num_hidden_layers"]
    plan = (Plan.every_k(L, 1, prefetch_depth=depth) if rule == "every-1"
            else Plan.keep_all(L, "host", prefetch_depth=depth))
    engine, cfg = _random_engine(plan)
    batch = _random_batch(cfg.vocab_size, mbs, seq)
    _clean_cuda()  # drop the cached blocks of the random fill: what was reserved before counts not
    base = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
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
    ov = gpu_check.copy_overlap(gpu_check.load_trace_events(trace))
    summary = json.dumps({k: ov[k] for k in ("h2d", "d2h", "compute_stream", "compute_busy_s", "window_s")},
                         default=str)
    assert ov["kernels"] > 0 and ov["compute_stream"] is not None, summary
    # every unit's weights come in (embed, layers twice, head) and its gradient goes out
    assert ov["h2d"]["count"] >= 2 * L + 2, summary
    assert ov["d2h"]["count"] >= L + 2, summary
    assert ov["compute_stream"] not in ov["h2d"]["streams"] + ov["d2h"]["streams"], summary
    assert ov["h2d"]["overlap_fraction"] >= 0.5, summary
    assert ov["d2h"]["overlap_fraction"] >= 0.5, summary


# ----- the gpu_check helpers, on the CPU --------------------------------------------------------

def test_interval_union_and_intersection():
    assert gpu_check.merge_intervals([(3, 4), (0, 1), (0.5, 2), (2, 2.5), (5, 5)]) == [(0, 2.5), (3, 4)]
    assert gpu_check.measure([(0, 1), (0.5, 2), (3, 4)]) == pytest.approx(3.0)
    a = [(0, 2), (1, 3), (10, 11)]
    b = [(2.5, 10.5), (0, 0.5)]
    assert gpu_check.intersect_measure(a, b) == pytest.approx(0.5 + 0.5 + 0.5)
    assert gpu_check.intersect_measure(a, []) == 0.0


def _ev(cat, name, ts_us, dur_us, stream, nbytes=None):
    args = {"stream": stream}
    if nbytes is not None:
        args["bytes"] = nbytes
    return {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us, "pid": 0, "tid": stream,
            "args": args}


def test_copy_overlap_on_a_synthetic_trace(tmp_path):
    events = [
        # compute on stream 7: [0, 100) and [150, 300) us
        _ev("kernel", "gemm", 0, 100, 7), _ev("kernel", "gemm", 150, 150, 7),
        # H2D on stream 20: [50, 130): 50 of 80 us under compute; 1 GB in 80 us
        _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 80, 20, 10**9),
        # D2H on stream 21: [250, 350): 50 of 100 us under compute
        _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 250, 100, 21, 2 * 10**9),
        # a small pageable copy on the compute stream: serialised, reported apart
        _ev("gpu_memcpy", "Memcpy HtoD (Pageable -> Device)", 140, 5, 7, 1000),
        _ev("gpu_memset", "Memset (Device)", 0, 400, 22),  # neither compute nor copy
        {"ph": "i", "name": "marker", "ts": 0},
    ]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    ov = gpu_check.copy_overlap(gpu_check.load_trace_events(path))
    assert ov["compute_stream"] == 7
    assert ov["kernels"] == 2
    assert ov["compute_busy_s"] == pytest.approx(250e-6)
    assert ov["window_s"] == pytest.approx(350e-6)
    assert ov["compute_idle_fraction"] == pytest.approx(1 - 250 / 350)
    assert ov["h2d"]["count"] == 1 and ov["h2d"]["streams"] == [20]
    assert ov["h2d"]["overlap_fraction"] == pytest.approx(50 / 80)
    assert ov["h2d"]["gbps_active"] == pytest.approx(1.0 / 80e-6)
    assert ov["d2h"]["overlap_fraction"] == pytest.approx(0.5)
    assert ov["all_async_copies"]["overlap_fraction"] == pytest.approx(100 / 180)
    assert ov["copies_on_compute_stream"]["count"] == 1
    assert ov["pageable_copies"] == 1


def test_copy_overlap_reads_older_trace_spellings():
    """Older kineto: ``cat`` "Memcpy", the stream only in ``tid`` as "stream N"."""
    events = [{"ph": "X", "cat": "Kernel", "name": "k", "ts": 0, "dur": 10, "tid": "stream 7"},
              {"ph": "X", "cat": "Memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": 5, "dur": 10,
               "tid": "stream 13"}]
    ov = gpu_check.copy_overlap(events)
    assert ov["compute_stream"] == 7
    assert ov["h2d"]["streams"] == [13]
    assert ov["h2d"]["overlap_fraction"] == pytest.approx(0.5)
    assert ov["h2d"]["bytes"] == 0 and ov["h2d"]["gbps_active"] == 0.0


def test_parse_junit(tmp_path):
    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1" '
        'failures="1" skipped="1" tests="5">'
        '<testcase classname="tests.a" name="test_ok"/><testcase classname="tests.a" name="test_ok2"/>'
        '<testcase classname="tests.a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.b" name="test_err"><error message="y"/></testcase>'
        '<testcase classname="tests.b" name="test_skip"><skipped message="z"/></testcase>'
        '</testsuite></testsuites>')
    res = gpu_check.parse_junit(xml)
    assert (res["total"], res["passed"], res["failed"], res["errors"], res["skipped"]) == (5, 2, 1, 1, 1)
    assert res["failing_tests"] == ["tests.a::test_bad", "tests.b::test_err"]


@pytest.mark.parametrize("moments", ["8bit", "fp32"])
def test_store_bytes_estimate_matches_a_store(moments):
    cfg = get_flavor("qwen2-debug-untied").build_config()
    store = HostStore(DecoderAdapter(cfg), compute_dtype=torch.bfloat16, pin=False)
    opt = HostAdamW8bit(AdamWConfig()) if moments == "8bit" else HostAdamW(AdamWConfig())
    for buf in store:
        opt.init_state(buf)
    step_bytes = 4 * len(store.units)  # a 0-d fp32 step counter per unit
    logical, rounded = gpu_check.store_bytes_estimate([b.layout.numel for b in store], moments, 2)
    assert logical + step_bytes == store.nbytes()
    assert rounded >= logical
    assert gpu_check.pow2_ceil(1) == 1 and gpu_check.pow2_ceil(5) == 8 and gpu_check.pow2_ceil(8) == 8


def test_fill_store_random_is_seeded_and_shaped():
    cfg = get_flavor("qwen2-debug-untied").build_config()  # has q/k/v biases
    adapter = DecoderAdapter(cfg)
    stores = []
    for _ in range(2):
        store = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False)
        gpu_check.fill_store_random(store, seed=3, device="cpu")
        stores.append(store)
    a, b = stores
    for ua, ub in zip(a, b):
        assert torch.equal(ua.master, ub.master), "same seed, same weights"
        assert torch.equal(ua.compute, ua.master.to(torch.bfloat16))
        views = ua.weights()
        for spec in ua.layout.specs:
            v = views[spec.local]
            if len(spec.shape) >= 2:
                assert 0.015 < v.std().item() < 0.025, spec.local
            elif "norm" in spec.local:
                assert torch.all(v == 1), spec.local
            else:
                assert torch.all(v == 0), spec.local
    c = HostStore(adapter, compute_dtype=torch.bfloat16, pin=False)
    gpu_check.fill_store_random(c, seed=4, device="cpu")
    assert not torch.equal(c["layers.0"].master, a["layers.0"].master)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_gpu_check_without_cuda_says_so_and_exits_0(tmp_path, capsys):
    out = tmp_path / "gpu-check.json"
    assert gpu_check.main(["--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "no GPU" in printed
    assert json.loads(printed.strip().splitlines()[-1])["status"] == "no_cuda"
    assert not out.exists()


def test_gpu_check_dry_run_on_cpu(tmp_path, capsys):
    """The whole script (setup, optimizer timing, planner, store, every plan with its profiled
    step, simulator) on the CPU backend with a tiny model, so that it keeps working against
    the engine's API between GPU runs. The GPU-only figures come out as null."""
    out = tmp_path / "gpu-check.json"
    rc = gpu_check.main(["--device", "cpu", "--model", "llama-debug", "--layers", "4", "--seq-len", "32",
                         "--micro-batch-size", "2", "--steps", "1", "--optim-layers", "1",
                         "--optim-rounds", "1", "--sections", "optimizer,planner,plan,simulator",
                         "--out", str(out)])
    printed = capsys.readouterr().out
    res = json.loads(out.read_text())
    assert rc == 0, json.dumps({k: v for k, v in res["sections"].items() if v["error"]}, indent=1)
    assert res["status"] == "ok" and res["failed_sections"] == []
    assert res["sections"]["pytest"]["skipped"] == "not in --sections"
    assert set(res["plans"]) == {"every-1", "every-4", "keep-all-host", "planner"}
    for name, rec in res["plans"].items():
        assert rec["tokens_per_s"] > 0 and rec["tflops"] > 0, name
        assert rec["predicted_peak_bytes"] > 0 and rec["reserved_over_predicted"] is None, name
        assert set(rec["simulated"]) == {"h200"}, name
        assert len(rec["losses"]) == 2 and rec["skipped_steps"] == 0, name
        assert rec["profile"]["kernels"] == 0, name  # no GPU, no kernels
    assert res["plans"]["keep-all-host"]["tiers"]["host"] == 4
    assert res["planner"]["moments_used"] == {"8bit": 6}
    assert res["optimizer"]["adamw8bit_step_s"] > 0
    assert "every-4" in printed.splitlines()[-2] or "every-4" in printed
