"""The CUDA attention kernel's workspace in the device memory model: priced from the shape (it
grows with the sequence and the heads, as flash-attn's backward allocates), held by every layer
backward, and what the engine predicts on CUDA."""

from dataclasses import replace

import pytest
import torch

from layerwise.engine import EngineConfig, StreamingEngine
from layerwise.models import get_flavor
from layerwise.plan.memory import (CUDA_WORKSPACE_BYTES, attention_workspace_bytes,
                                   device_bytes_per_op, predict_peak_device_bytes)
from layerwise.plan.plan import Plan
from layerwise.plan.program import OpKind, micro_batch_program
from layerwise.plan.shape import load_shape
from layerwise.store import init_store

LLAMA8B = load_shape("llama3-8b")  # 32 heads, 8 KV heads, head_dim 128


def test_the_fused_kernels_workspace_is_flash_attn_backwards_buffers():
    """Per row of 4096 tokens: softmax_d (fp32 heads x seq), the fp32 dq accumulator (seq x heads
    x head_dim) and, with grouped heads, dk and dv at the full head count in bf16. Mutation
    seen failing: dropping the grouped heads' dk/dv term."""
    h, d, s = 32, 128, 4096
    assert (LLAMA8B.num_heads, LLAMA8B.num_kv_heads, LLAMA8B.head_dim) == (h, 8, d)
    per_row = h * s * 4 + s * h * d * 4 + 2 * s * h * d * 2
    assert attention_workspace_bytes(LLAMA8B, 1, s, 2) == per_row
    assert attention_workspace_bytes(LLAMA8B, 8, s, 2) == 8 * per_row
    mha = replace(LLAMA8B, num_kv_heads=h)  # no grouping: no expanded dk/dv
    assert attention_workspace_bytes(mha, 1, s, 2) == h * s * 4 + s * h * d * 4


def test_the_workspace_grows_with_seq_and_heads():
    """Linear in seq and in heads for the fused kernels (seq past the 128 rounding), quadratic in
    seq for the eager (math) path. Mutations seen failing: a flat term (``return 64 << 20``);
    the eager path priced like the fused one."""
    w = attention_workspace_bytes
    assert w(LLAMA8B, 2, 2048, 2) == 2 * w(LLAMA8B, 2, 1024, 2)
    wide = replace(LLAMA8B, num_heads=64, num_kv_heads=16)
    assert w(wide, 2, 1024, 2) == 2 * w(LLAMA8B, 2, 1024, 2)
    assert w(LLAMA8B, 1, 100, 2) == w(LLAMA8B, 1, 128, 2) - 2 * 28 * 32 * 128 * 2  # fp32 buffers rounded
    eager = replace(LLAMA8B, eager_attention=True)
    assert w(eager, 1, 2048, 2) == 4 * w(eager, 1, 1024, 2) == 4 * 32 * 1024 * 1024 * 10


def test_every_layer_backward_holds_it_and_nothing_else_does():
    """With ``attention_workspace`` each layer backward's estimate grows by exactly one
    micro-batch's workspace (the op runs the group's micro-batches in turn); every other op is
    unchanged. Mutation seen failing: adding it to ``layer_fwd`` too."""
    L, mbs, seq = LLAMA8B.num_layers, 2, 1024
    plan = Plan.every_k(L, 2)
    ws = attention_workspace_bytes(LLAMA8B, mbs, seq, 2)
    off = device_bytes_per_op(LLAMA8B, plan, mbs, seq, 2)
    on = device_bytes_per_op(LLAMA8B, plan, mbs, seq, 2, attention_workspace=True)
    ops = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    for op, a, b in zip(ops, off, on):
        bwd = op.kind in (OpKind.LAYER_BWD, OpKind.LAYER_BWD_KEPT)
        assert b.peak_bytes - a.peak_bytes == (ws if bwd else 0), op
    assert any(op.kind == OpKind.LAYER_BWD for op in ops)
    peak_off = predict_peak_device_bytes(LLAMA8B, plan, mbs, seq, 2)
    peak_on = predict_peak_device_bytes(LLAMA8B, plan, mbs, seq, 2, attention_workspace=True)
    assert peak_off.peak_bytes <= peak_on.peak_bytes <= peak_off.peak_bytes + ws  # the head may stay the peak


@pytest.mark.parametrize("device,extra", [("cpu", False), ("cuda", True)])
def test_the_engine_predicts_the_cuda_workspaces_on_cuda_only(device, extra):
    """``engine.predict_memory`` adds cuBLAS's flat workspace and the attention workspace on
    CUDA; the CPU backends' fitted transients stay as they are. Mutation seen failing:
    ``attention_workspace=`` left out of ``StreamingEngine.predict_memory``."""
    cfg = get_flavor("llama-debug").build_config(num_hidden_layers=2)
    adapter, store = init_store(cfg)
    plan = Plan.every_k(2, 1)
    engine = StreamingEngine(adapter, store, plan, EngineConfig())
    try:
        engine.device = torch.device(device)  # only the prediction reads it
        got = engine.predict_memory(2, 256).peak_bytes
    finally:
        engine.close()
    elem = torch.empty((), dtype=engine.compute_dtype).element_size()
    want = predict_peak_device_bytes(engine.shape, plan, 2, 256, elem, grad_slots=not engine.sink.inline,
                                     workspace_bytes=CUDA_WORKSPACE_BYTES if extra else 0,
                                     attention_workspace=extra).peak_bytes
    assert got == want
    if extra:
        assert got > predict_peak_device_bytes(engine.shape, plan, 2, 256, elem,
                                               grad_slots=not engine.sink.inline).peak_bytes \
            + CUDA_WORKSPACE_BYTES
