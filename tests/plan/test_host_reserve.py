"""The presets' host reserve ([HOSTRES] in planner/presets.py): its parts, the ring each model adds,
and profile files written before it."""

import json

import pytest
import torch

from layerwise.engine.grad_sink import HOST_GRAD_RING, ring_piece_bytes
from layerwise.models import get_flavor
from layerwise.planner import hardware, presets
from layerwise.planner.hardware import GB, HardwareProfile
from layerwise.planner.presets import PRESETS
from layerwise.planner.host_need import layer_grad_bytes
from layerwise.plan.shape import load_shape
from layerwise.store import init_store


def test_every_preset_reserve_is_its_parts_plus_the_margin():
    """A GPU preset's reserve is runtime (measured) + CUDA context (cited) + OS (assumed), times 1
    + the margin; the CPU preset's has no CUDA part. The parts are the figures the comment block
    states (1, 2 and 1 GB, 20%).

    Mutation seen caught: ``preset_host_reserve_bytes`` leaving the margin out (4.0 GB, not 4.8)."""
    assert (presets.RUNTIME_HOST_BYTES, presets.CUDA_HOST_BYTES, presets.OS_HOST_BYTES) == (GB, 2 * GB, GB)
    assert presets.HOST_RESERVE_MARGIN == 0.20
    gpu = (1 + 2 + 1) * GB * 1.2
    for name, hw in PRESETS.items():
        want = (1 + 1) * GB * 1.2 if name == "cpu" else gpu
        assert hw.host_reserved_bytes == pytest.approx(want, abs=1), name


def test_the_ring_is_the_engines():
    """``for_model`` adds ``HOST_GRAD_RING`` pinned buffers of the largest layer's gradient: the
    engine's own ring size (``ring_piece_bytes`` of a real bf16 store), each page-locked at its
    own size; nothing on the synchronous CPU profile.

    Mutation seen caught: the ring sized by the largest unit (the embedding) instead of the
    largest decoder layer."""
    assert hardware.HOST_GRAD_RING == HOST_GRAD_RING
    name = "qwen2-debug-untied"
    _, store = init_store(get_flavor(name).build_config(), compute_dtype=torch.bfloat16, pin=False)
    h200 = PRESETS["h200"]
    assert layer_grad_bytes(load_shape(name), h200) == ring_piece_bytes(store)
    layer = layer_grad_bytes(load_shape("qwen2.5-14b"), h200)  # 0.55 GB
    assert 2**29 < layer < 2**30
    assert h200.for_model(layer).host_reserved_bytes == h200.host_reserved_bytes + 4 * layer
    assert h200.for_model(layer).host_cap_bytes == h200.host_cap_bytes - 4 * layer
    cpu = PRESETS["cpu"]
    assert cpu.for_model(layer).host_reserved_bytes == cpu.host_reserved_bytes


def test_a_profile_file_keeps_its_own_reserve(tmp_path):
    """A calibrated profile with a reserve of its own (a flat 64 GB) loads with that figure
    (only a preset derives it), and the model's ring still adds to it; a reserve the RAM cannot
    hold is refused with both figures."""
    d = PRESETS["h100"].to_dict()
    d.update(host_reserved_bytes=64 * GB, name="my-box")
    path = tmp_path / "my-box.json"
    path.write_text(json.dumps(d))
    old = HardwareProfile.load(path)
    assert old.host_reserved_bytes == 64 * GB and old.host_cap_bytes == old.host_mem_bytes - 64 * GB
    assert old.for_model(2**20).host_reserved_bytes == 64 * GB + 4 * 2**20
    with pytest.raises(ValueError, match=r"host RAM \(60\.00 GB\) must exceed the host reserve \(64\.00 GB\)"):
        old.with_memory(host_mem_gb=60)
