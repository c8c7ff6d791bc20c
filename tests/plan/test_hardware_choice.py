"""Which hardware profile a command plans on (``planner.hardware_choice``): the order of the
sources, what adjusts the chosen profile, and ``layerwise train`` and ``layerwise plan`` agreeing."""

from __future__ import annotations

import logging
from dataclasses import replace

import pytest
import torch

from layerwise.cli import build_parser
from layerwise.planner.cli import plan_hardware
from layerwise.planner.hardware import GB
from layerwise.planner.presets import PRESETS
from layerwise.planner.hardware_choice import Machine, check_spec, cuda_preset_for, resolve_hardware
from layerwise.train.config import TrainConfig
from layerwise.planner.run_plan import run_hardware

CPU = Machine(ram_bytes=64 * GB)
T4 = Machine(ram_bytes=64 * GB, gpu_name="Tesla T4", gpu_mem_bytes=16 * GB)


def test_hardware_profile_resolution_order(tmp_path, caplog):
    """``profile=`` > ``RUN/profile.json`` > ``hardware=`` > this machine; the profile's element
    size follows the compute dtype and the memory cap bounds the device. Mutation seen failing:
    ``hardware=`` checked before the run's calibrated profile."""
    caplog.set_level(logging.INFO, logger="layerwise")
    calibrated = tmp_path / "run" / "profile.json"
    mine = resolve_hardware(calibrated=calibrated, machine=CPU, compute_dtype_bytes=4)
    assert mine.source.startswith("the cpu preset") and mine.profile.compute_dtype_bytes == 4
    assert mine.profile.host_mem_bytes == 64 * GB
    named = resolve_hardware("h100", calibrated=calibrated, machine=CPU, compute_dtype_bytes=4)
    assert named.profile.name == "h100" and named.profile.compute_dtype_bytes == 4
    assert resolve_hardware("h100", compute_dtype_bytes=2).profile.compute_dtype_bytes == 2
    calibrated.parent.mkdir()
    replace(PRESETS["rtx4090"], name="calibrated-here").save(calibrated)
    assert not caplog.messages  # nothing said while nothing is ignored
    cal = resolve_hardware("h100", calibrated=calibrated, machine=CPU)
    assert cal.profile.name == "calibrated-here" and "hardware=h100 ignored" in caplog.messages[0]
    replace(PRESETS["a100-80g"], name="given").save(tmp_path / "given.json")
    given = resolve_hardware(profile=str(tmp_path / "given.json"), calibrated=calibrated, machine=CPU)
    assert given.profile.name == "given"
    capped = resolve_hardware("h100", device_mem_cap_bytes=10**9)
    assert capped.profile.device_cap_bytes == 10**9
    sized = resolve_hardware("rtx3090", gpu_mem_gb=12, host_mem_gb=64)
    assert sized.profile.device_mem_bytes == 12 * GB and sized.profile.host_mem_bytes == 64 * GB


def test_a_gpu_no_preset_matches_is_calibrated_only_when_asked(tmp_path):
    """Without a calibration nothing resolves; with one it is used and saved for the next run,
    which then reads it back as the calibrated profile."""
    calibrated = tmp_path / "run" / "profile.json"
    assert resolve_hardware(calibrated=calibrated, machine=T4) is None
    measured = replace(PRESETS["rtx4090"], name="calibrated-cuda")
    now = resolve_hardware(calibrated=calibrated, machine=T4, calibrate=lambda: measured)
    assert now.profile == measured and "calibrated now" in now.source
    again = resolve_hardware(calibrated=calibrated, machine=T4, calibrate=pytest.fail)
    assert again.profile == measured and again.source == f"the calibrated profile {calibrated}"


def test_cuda_devices_match_presets_by_name():
    gb = 10**9
    assert cuda_preset_for("NVIDIA H200", 143 * gb) == "h200"
    assert cuda_preset_for("NVIDIA H100 80GB HBM3", 85 * gb) == "h100"
    assert cuda_preset_for("NVIDIA A100-SXM4-80GB", 85 * gb) == "a100-80g"
    assert cuda_preset_for("NVIDIA A100-SXM4-40GB", 42 * gb) is None  # calibrate instead
    assert cuda_preset_for("NVIDIA GeForce RTX 4090", 25 * gb) == "rtx4090"
    assert cuda_preset_for("Tesla T4", 16 * gb) is None
    h200 = resolve_hardware(machine=Machine(512 * GB, "NVIDIA H200", 143 * GB)).profile
    assert h200.name == "h200" and h200.device_mem_bytes == 143 * GB and h200.host_mem_bytes == 512 * GB


def test_bad_specs_are_refused_in_one_line(tmp_path):
    """Each names the setting and the fix (``layerwise train`` checks them before any work)."""
    with pytest.raises(ValueError, match=r"profile=/nonexistent.json: no such file; write one with"):
        check_spec(None, "/nonexistent.json")
    PRESETS["h100"].save(tmp_path / "p.json")
    with pytest.raises(ValueError, match=r"unknown hardware 'tpu-v9': use a preset \(h200"):
        check_spec("tpu-v9", str(tmp_path / "p.json"))  # checked though the profile would win
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(ValueError, match="bad.json is not valid JSON"):
        resolve_hardware(profile=str(tmp_path / "bad.json"))


@pytest.mark.parametrize("spec", ["h100", "profile.json"])
def test_plan_and_train_resolve_a_spec_to_the_same_profile(tmp_path, spec):
    """``layerwise plan --hardware SPEC`` and ``layerwise train hardware=SPEC`` (bf16, no cap)
    plan on the same profile, for a preset and for a profile file. Mutation seen failing:
    ``plan_hardware`` reading ``--hardware`` as a preset only (``PRESETS.get(spec)``, a
    profile file unread)."""
    if spec == "profile.json":
        spec = str(tmp_path / spec)
        replace(PRESETS["rtx4090"], name="calibrated-elsewhere", peak_tflops=123.0).save(spec)
    args = build_parser("plan").parse_args(["plan", "--model", "llama-demo", "--hardware", spec,
                                      "--seq-len", "64"])
    cfg = TrainConfig(hardware=spec, out_dir=str(tmp_path / "run"), device="cpu")
    train_hw = run_hardware(cfg.hardware, cfg.profile, cfg.out_dir, cfg.device, torch.bfloat16.itemsize,
                            may_calibrate=False)
    assert train_hw.profile == plan_hardware(args)
    assert train_hw.profile.name != "cpu"
