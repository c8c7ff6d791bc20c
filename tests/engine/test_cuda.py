"""GPU paths: streams, pinned memory, non-blocking copies. Skipped without CUDA."""

import pytest
import torch

from layerwise.engine import CudaBackend, EngineConfig, StreamingEngine
from layerwise.models import DecoderAdapter, get_flavor
from layerwise.models.init import build_hf_model
from layerwise.plan import Plan
from layerwise.store import HostStore

from .test_gradients import assert_grads_close, engine_grads, make_batch, reference

pytestmark = pytest.mark.cuda


def test_backend_round_trip_through_pinned_memory():
    backend = CudaBackend()
    host = torch.randn(1 << 20).pin_memory()
    dev = backend.to_device(host).wait()
    assert dev.is_cuda
    back = backend.to_host(dev * 2).wait()
    assert back.is_pinned()
    assert torch.equal(back, host * 2)


@pytest.mark.parametrize("plan_name", ["k1", "mixed"])
def test_fp32_gradients_on_gpu_match_autograd(plan_name, tmp_path):
    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = get_flavor("llama-debug").build_config()
    model = build_hf_model(cfg, seed=0)
    batch = make_batch(cfg.vocab_size)
    ref_loss, ref_grads = reference(model, [batch])
    adapter = DecoderAdapter(cfg)
    store = HostStore(adapter)
    assert store.pinned
    store.copy_from_model(model)
    plan = (Plan.every_k(4, 1) if plan_name == "k1"
            else Plan(["host", "nvme", "recompute", "device"], prefetch_depth=2))
    engine = StreamingEngine(adapter, store, plan,
                             EngineConfig(device="cuda", spill_dir=str(tmp_path)))
    loss, _ = engine.compute_grads([batch])
    engine.close()
    assert loss == pytest.approx(ref_loss, rel=1e-4)
    assert_grads_close(engine_grads(store), ref_grads, rtol=1e-4)


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
    assert losses[-1] < losses[0] * 0.8
    assert torch.equal(store["layers.0"].compute, store["layers.0"].master.to(torch.bfloat16))
    peak = engine.backend.allocator_peak_bytes()
    assert peak is not None and peak > 0
    engine.close()
