import json
from dataclasses import replace

import pytest

from layerwise.models.adapter import DecoderAdapter
from layerwise.models.registry import get_flavor
from layerwise.planner.cost import CostModel
from layerwise.plan.shape import ModelShape, load_shape
from layerwise.planner.hardware import HardwareProfile
from layerwise.planner.presets import PRESETS, get_hardware


def test_presets_roundtrip_through_json(tmp_path):
    for name, hw in PRESETS.items():
        path = tmp_path / f"{name}.json"
        hw.save(path)
        assert get_hardware(str(path)) == hw
        assert hw.device_cap_bytes < hw.device_mem_bytes


def test_profile_errors_say_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        get_hardware("tpu-v9")
    bad = PRESETS["h200"].to_dict()
    bad["warp_drive"] = 1
    (tmp_path / "p.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="unknown keys"):
        get_hardware(str(tmp_path / "p.json"))
    del bad["warp_drive"], bad["h2d_gbps"]
    (tmp_path / "p.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="missing"):
        HardwareProfile.load(tmp_path / "p.json")
    with pytest.raises(ValueError, match="efficiency"):
        HardwareProfile.from_dict({**PRESETS["h200"].to_dict(), "efficiency": 1.5})


def test_memory_override():
    hw = PRESETS["rtx3090"].with_memory(gpu_mem_gb=12, host_mem_gb=64)
    assert hw.device_mem_bytes == 12 * 10**9 and hw.host_mem_bytes == 64 * 10**9


@pytest.mark.parametrize("flavor", ["llama-debug", "llama-debug-tied", "qwen2-debug", "qwen3-debug-untied",
                                    "mistral-debug", "llama-30m"])
def test_shape_param_counts_match_the_adapter(flavor):
    cfg = get_flavor(flavor).build_config()
    shape = ModelShape.from_config(cfg)
    ad = DecoderAdapter(cfg)
    by_name = {u.name: u.numel for u in ad.units}
    for unit in shape.unit_names():
        assert shape.unit_params(unit) == by_name[unit], unit
    assert shape.num_params == ad.num_params()


def test_real_shape_param_count():
    # Qwen2.5-7B has 7.62B parameters (model card)
    assert abs(load_shape("qwen2.5-7b").num_params / 1e9 - 7.62) < 0.01
    assert abs(load_shape("llama3-8b").num_params / 1e9 - 8.03) < 0.01


def test_flops_by_hand():
    # tiny llama: h=32, f=64, 4 heads x 8, 2 kv heads; matmul weights = 32*32 + 2*32*16 + 32*32 + 3*32*64
    shape = load_shape("llama-debug")
    assert shape.layer_matmul_params == 1024 + 1024 + 1024 + 6144
    cm = CostModel(shape, replace(PRESETS["cpu"], compute_dtype_bytes=2), micro_batch_size=2, seq_len=4)
    pairs = 4 * 5 // 2  # causal (q, k) pairs of a 4-token sequence
    expect = 2 * 9216 * 8 + 4 * 32 * pairs * 2
    assert cm.layer_fwd_flops(0) == expect
    assert sum(k.flops * k.count for k in cm.layer_forward(0)) == expect  # the kernels' FLOPs too
    assert cm.boundary_bytes == 2 * 4 * 32 * 2  # bf16
    assert shape.attention_pairs(10, 4) == 4 * 5 // 2 + 6 * 4  # sliding window


@pytest.mark.parametrize("moments", [None, "8bit", "mixed"])
def test_host_store_bytes_are_what_the_store_allocates(moments):
    """The cost model's host bytes equal a real HostStore's buffers plus the optimizer states.

    Mutations this test was seen to catch: the 8-bit block scales left out of ``MOMENT_BYTES``;
    the bf16 compute copy left out of ``host_store_bytes``; the arena's padding left out.
    """
    import torch

    from layerwise.optim.adamw import AdamWConfig, HostAdamW
    from layerwise.optim.adamw8bit import HostAdamW8bit
    from layerwise.store import HostStore

    cfg = get_flavor("llama-debug").build_config()
    shape = ModelShape.from_config(cfg)
    hw = PRESETS["h200"]
    assert hw.compute_dtype_bytes == 2  # so the store keeps a bf16 compute copy
    n_units = shape.num_layers + 2
    kinds = {None: ["fp32"] * n_units, "8bit": ["8bit"] * n_units,
             "mixed": (["8bit", "fp32"] * n_units)[:n_units]}[moments]
    store = HostStore(DecoderAdapter(cfg), compute_dtype=torch.bfloat16, pin=False)
    opts = {"fp32": HostAdamW(AdamWConfig()), "8bit": HostAdamW8bit(AdamWConfig())}
    for buf, kind in zip(store, kinds):
        opts[kind].init_state(buf)
    predicted = CostModel(shape, hw, 1, 16).host_store_bytes(None if moments is None else kinds)
    assert predicted == store.nbytes()


def test_load_shape_from_hf_dir(tmp_path):
    get_flavor("qwen2-debug").build_config().save_pretrained(tmp_path)
    assert load_shape(str(tmp_path)).num_params == load_shape("qwen2-debug").num_params
    with pytest.raises(ValueError, match="unknown model"):
        load_shape("no-such-model")
