"""The device cost model by shape (``planner/device_cost.py``): a roofline per GEMM,
attention and grouped expert GEMM, bytes for the elementwise work, a launch per kernel."""

from dataclasses import replace

import pytest
from transformers import LlamaConfig

from layerwise.planner.cost import CostModel
from layerwise.planner.device_cost import DeviceCost, LayerDims, gemm, kernels_s
from layerwise.planner.hardware import HardwareProfile
from layerwise.planner.presets import PRESETS
from layerwise.plan.plan import Plan
from layerwise.plan.shape import ModelShape, load_shape
from layerwise.planner.simulator import simulate

LAZYTRAIN_TOKENS_PER_S = 1361
"""LazyTrain, Table 1: Qwen ~27B, 64 layers, one H800 capped at 70 GB, seq 1024, batch 72."""
SMOLLM2_135M = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                           num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                           head_dim=64, tie_word_embeddings=True, max_position_embeddings=8192)
"""SmolLM2-135M's config.json (the sizes the planner reads)."""


def _lazytrain_tokens_per_s(hw: HardwareProfile) -> float:
    shape = load_shape("qwen-27b")
    plan = Plan.keep_all(shape.num_layers, "host", micro_batch_size=72, num_micro_batches=1, seq_len=1024)
    return simulate(plan, shape, hw.with_memory(gpu_mem_gb=70), keep_trace=False).tokens_per_s


def test_lazytrain_table1_is_predicted_within_20pct_of_the_published_rate():
    """``layerwise plan --model qwen-27b --hardware h800 --gpu-mem 70 --seq-len 1024 --batch 72``
    predicted 1,873 tokens/s by FLOPs alone (+38% on the published 1,361); by shape it predicts
    1,602 (+17.7%), and this test's plan (keep-all-host, 72 x 1, the planner's runner-up) 1,581.
    Nothing is fitted to the figure: the GEMMs run at [EFF-H]'s 0.40 of the datasheet's 989
    TFLOPS (compute-bound at these sizes, as before); what is new is the eager layer's
    elementwise work (fp32 norms, rotary, SwiGLU, residuals: ~15% of the GEMM time at hidden
    5120) at 0.85 of the datasheet's 3.35 TB/s ([MEM]), flash attention's 2.5x backward and the
    gradient's deposit into its slot. The issue's target, within 15%, is missed: the rest of the
    gap is LazyTrain's own executor, which this model does not know.

    Mutation seen failing: ``kernels_s`` pricing every kernel by FLOPs alone (the bytes term
    dropped): 1,856 tokens/s, +36%."""
    new = _lazytrain_tokens_per_s(PRESETS["h800"])
    assert abs(new / LAZYTRAIN_TOKENS_PER_S - 1) < 0.20, new


def _compute_only_tflops(shape: ModelShape, hw: HardwareProfile, mbs: int, seq: int) -> float:
    """Model TFLOPS if the device did nothing but compute, every layer's internals kept (no
    recompute): the ceiling of any plan's TFLOPS."""
    c = CostModel(shape, hw, mbs, seq)
    L = shape.num_layers
    t = sum(c.layer_fwd_keep_s(i) + c.layer_bwd_kept_s(i) for i in range(L)) + c.head_s + 2 * c.embed_s
    return c.model_flops() / t / 1e12


def test_smollm2_on_h200_runs_far_below_peak():
    """SmolLM2-135M (hidden 576) on an H200: ``layerwise plan`` predicted 382-386 TFLOPS (0.39
    of the 989 peak) by FLOPs alone (0.40: [EFF-H]), as fast per FLOP as a 27B model. By shape its narrow layers
    are bound by their elementwise bytes (as much time as their GEMMs at hidden 576) and its
    49k-word head by the fp32 loss: the compute-only ceiling (every layer's internals kept, no
    transfers) falls from 396 to 196 TFLOPS, below 0.25 of peak and 0.65x the old figure.

    Mutation seen failing: the elementwise kernels' bytes divided by 10 (``elementwise``): 340."""
    shape = ModelShape.from_config(SMOLLM2_135M, name="smollm2-135m")
    hw = PRESETS["h200"]
    new = _compute_only_tflops(shape, hw, 64, 2048)
    assert new < 0.25 * hw.peak_tflops, new


def test_fine_grained_experts_turn_bandwidth_bound_with_few_tokens():
    """Qwen3-30B-A3B (128 experts of width 768, top-8): at 1,024 tokens an expert gets 64 rows,
    computed in 128-row tiles ([TILE]), and its grouped GEMMs read every expert's weights for
    them. On an H800 (ridge 139 FLOP/byte) the weights' bytes bind; at 16k tokens (1,024 rows an
    expert) the FLOPs do. On an H200 a token's expert GEMMs cost 2x more on the short
    micro-batch, reaching half the GEMM roof in real FLOPs at most.

    Mutation seen failing: the grouped GEMM's weights counted once, not once per expert."""
    shape = load_shape("qwen3-30b-a3b")

    def experts(d: DeviceCost):  # the two grouped GEMMs, as the layer's forward holds them
        ld, tile = LayerDims.of(d.shape, 0), d.hw.gemm_tile_rows
        m, E = d.tokens * ld.top_k / ld.experts, ld.experts
        ks = [gemm(m, ld.hidden, 2 * ld.expert_width, d.e, tile, groups=E),
              gemm(m, ld.expert_width, ld.hidden, d.e, tile, groups=E)]
        assert all(k in d.layer_forward(0) for k in ks)
        return ks

    hw = PRESETS["h800"]

    def over_flops(d: DeviceCost) -> float:  # their time over their (tile-rounded) FLOPs' time
        ks = experts(d)
        return kernels_s(ks, hw) / sum(max(k.flops / hw.flops_per_s, hw.kernel_launch_s) for k in ks)

    assert over_flops(DeviceCost(shape, hw, 1, 1024)) > 1.1
    assert over_flops(DeviceCost(shape, hw, 4, 4096)) == pytest.approx(1.0, abs=1e-3)
    hw = PRESETS["h200"]
    few, many = DeviceCost(shape, hw, 1, 1024), DeviceCost(shape, hw, 4, 4096)
    real = 2 * 1024 * 8 * 3 * 2048 * 768  # the routed tokens' FLOPs: gate, up, down
    assert real / kernels_s(experts(few), hw) < 0.51 * hw.flops_per_s
    per_token = [kernels_s(experts(d), hw) / d.tokens for d in (few, many)]
    assert per_token[0] > 1.99 * per_token[1]


def test_a_tiny_layer_is_launch_bound_on_a_gpu_and_launches_add_on_a_cpu():
    """Asynchronous device: a kernel costs at least its launch (the host issues no faster), so a
    debug-sized layer's forward is its kernel count x ``kernel_launch_s``; synchronous: every
    launch adds to its kernel's work.

    Mutation seen failing: ``max(launch, roof)`` replaced by ``roof`` on the asynchronous path."""
    shape = load_shape("llama-debug")
    gpu = PRESETS["h200"]
    d = DeviceCost(shape, gpu, 1, 4)
    kernels = sum(k.count for k in d.layer_forward(0))
    assert d.layer_fwd_s(0) == pytest.approx(kernels * gpu.kernel_launch_s, rel=1e-3)
    cpu = replace(PRESETS["cpu"], device_mem_gbps=10.0, kernel_launch_s=1e-5)
    c, free = DeviceCost(shape, cpu, 1, 4), DeviceCost(shape, replace(cpu, kernel_launch_s=0.0), 1, 4)
    assert c.layer_fwd_s(0) == pytest.approx(free.layer_fwd_s(0) + kernels * 1e-5)


def test_a_gemm_s_rows_round_up_to_its_tile_and_its_weight_is_read_per_group():
    """A GEMM computes whole tiles of output rows, and a grouped expert GEMM reads every
    expert's weight: its roofline is the longer of its FLOPs at ``peak x efficiency`` and its
    bytes at ``device_mem_gbps``."""
    g = gemm(100, 64, 32, 2, tile=128)
    assert g.flops == 2 * 128 * 64 * 32
    assert gemm(8, 64, 32, 2, groups=4).nbytes == 4 * gemm(8, 64, 32, 2).nbytes == 4 * 2 * (8 * 96 + 64 * 32)
    hw = replace(PRESETS["h200"], kernel_launch_s=0.0)
    assert kernels_s([g], hw) == pytest.approx(max(g.flops / hw.flops_per_s, g.nbytes / (hw.device_mem_gbps * 1e9)))
