"""``layerwise plan`` on a machine's real RAM: the presets' host memory, a LoRA / QLoRA run
(``--lora R --base-dtype``), and the largest size of the model's family that fits."""

import json
import re
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest

from layerwise.cli import main
from layerwise.planner.cost import CostModel
from layerwise.plan.family_sizes import FAMILY_SIZES, family_sizes
from layerwise.planner.hardware import GB
from layerwise.planner.host_need import host_floor, largest_fitting
from layerwise.planner.presets import PRESETS, preset_host_mem_bytes
from layerwise.plan.shape import load_shape


def _floor(model: str, preset: str, **lora) -> int:
    """A model's least host need on ``preset`` from the parts: the store with 8-bit moments (bf16
    gradients for a full run, the adapters' fp32 ones for LoRA), the preset's reserve and 4 pinned
    ring buffers of the largest layer's trained gradient in bf16."""
    shape = load_shape(model)
    if lora:
        shape = shape.with_lora(**lora)
    hw = PRESETS[preset]
    units = shape.unit_names()
    store = CostModel(shape, hw, 1, 1).host_store_bytes(["8bit"] * len(units), bf16_grads=not lora)
    ring = 4 * 2 * max(shape.trainable_params(u) for u in units[1:-1])
    return store + hw.host_reserved_bytes + ring


def test_presets_hold_the_ram_such_machines_ship_with():
    """A 4090 / 3090 workstation 64 GB; an H100 / H800 / H200 node's per-GPU share of 2 TB, an
    A100 node's of 1 TB; ``--gpus G`` on a preset plans on G shares (the node's GPUs share one
    store), at most the node's GPUs.

    Mutation seen caught: the rtx4090 back at its old 512 GB (``host_mem_bytes == 64 GB`` fails)."""
    assert PRESETS["rtx4090"].host_mem_bytes == PRESETS["rtx3090"].host_mem_bytes == 64 * GB
    assert {PRESETS[p].host_mem_bytes for p in ("h100", "h800", "h200")} == {250 * GB}
    assert PRESETS["a100-80g"].host_mem_bytes == 125 * GB
    assert preset_host_mem_bytes("h200", 8) == 2000 * GB and preset_host_mem_bytes("h200", 16) == 2000 * GB
    assert preset_host_mem_bytes("rtx4090", 2) == 128 * GB and preset_host_mem_bytes("cpu", 4) is None


def test_llama3_8b_full_fine_tune_does_not_fit_a_4090_workstation(capsys, monkeypatch):
    """On the rtx4090 preset (64 GB) without NVMe space (no optimizer state can leave the RAM;
    ``tests/planner/test_state_on_nvme.py`` has it with its drive) llama3-8b's full fine-tune is
    refused on host RAM, by the
    bytes of its leanest store (65.54 GB with 8-bit moments and bf16 gradients, 8.09 GB over the
    57.46 GB usable); its floor with the reserve and ring is 72.0 GB; the largest llama that fits
    is llama3.2-3b (and llama3-8b does not).

    Mutations seen caught: the preset back at 512 GB (``fits: yes``); the search's pre-check
    with fp32 gradients (the refusal names 80.55 GB, not 65.54); ``largest_fitting`` over the
    registry's llama flavors only (names llama-30m)."""
    monkeypatch.setitem(PRESETS, "rtx4090", replace(PRESETS["rtx4090"], nvme_capacity_bytes=0))
    assert main(["plan", "--model", "llama3-8b", "--hardware", "rtx4090", "--seq-len", "4096", "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["binding"] == "host"
    assert "needs 65.54 GB even with 8-bit optimizer moments everywhere and bf16 gradients" in d["message"]
    assert "but 57.46 GB is usable" in d["message"]
    assert re.match(r"fits: no — llama3-8b on rtx4090 at 4096 tokens per sequence: host RAM is short by 8\.1 GB",
                    d["verdict"]), d["verdict"]
    assert _floor("llama3-8b", "rtx4090") > 64 * GB
    big = d["largest_fitting_model"]
    assert big["model"] == "llama3.2-3b" and big["total_bytes"] == _floor("llama3.2-3b", "rtx4090")
    assert re.match(r"largest llama model that fits 64\.0 GB of host RAM on rtx4090 .*: llama3\.2-3b, 3\.21B params",
                    d["lines"][2]), d["lines"]


def test_qlora_fits_where_the_full_fine_tune_does_not(capsys):
    """``--lora 16 --base-dtype nf4`` plans llama3-8b as QLoRA on the same 64 GB 4090: the base at
    0.5625 B per matmul weight (``adapters.quant.packed_nbytes``: 32 B of codes + a 4 B scale per 64
    weights), embedding and head in bf16, fp32 master, gradient and moments for the adapters only;
    it fits, and the host line's store is those bytes; with ``--host-mem 64`` the largest llama
    whose QLoRA run fits is llama3-70b (llama3.1-405b's nf4 base alone is over 64 GB).

    Mutations seen caught: ``--lora`` ignored (refused as the full run); the nf4 base at 2 B/param
    (the store's bytes off); ``largest_fitting`` without the run's LoRA (names llama3.2-3b); the
    check's update order asking a frozen unit for its update (the emitted plan fails the check:
    the embedding has none)."""
    argv = ["plan", "--model", "llama3-8b", "--hardware", "rtx4090", "--seq-len", "4096", "--batch", "1",
            "--time-limit", "1", "--lora", "16", "--base-dtype", "nf4", "--host-mem", "64"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fits: yes — llama3-8b (LoRA r=16, nf4 base) on rtx4090, 1 x 4096 tokens"), lines[0]
    shape = load_shape("llama3-8b").with_lora(16, ["all-linear"], "nf4")
    s = load_shape("llama3-8b")
    adapters = s.num_layers * 16 * sum(i + o for i, o in (
        (4096, 4096), (4096, 1024), (4096, 1024), (4096, 4096), (4096, 14336), (4096, 14336), (14336, 4096)))
    assert shape.frozen_base.adapter_params_per_layer * s.num_layers == adapters
    base = s.num_layers * s.layer_matmul_params * 0.5625
    rest = s.embed_params + s.head_params + s.num_layers * (s.layer_params - s.layer_matmul_params)
    store = CostModel(shape, PRESETS["rtx4090"], 1, 1).host_store_bytes(["fp32"] * len(shape.unit_names()))
    # the copy source (nf4 base, bf16 rest and adapters) + fp32 master, gradient, 2 moments of the adapters
    assert store == pytest.approx(base + 2 * (rest + adapters) + 16 * adapters, rel=1e-3)
    m = re.match(r"host RAM: ([\d.]+) B/param for the store \(([\d.]+) GB, fp32 gradients\), .* of 64\.0 GB RAM on "
                 r"rtx4090 — fits$", lines[1])
    assert m and float(m.group(2)) == round(store / 1e9, 1), lines[1]
    assert re.match(r"largest llama model that fits 64\.0 GB of host RAM on rtx4090 \(LoRA r=16, nf4 base, 8-bit "
                    r"adapter moments, no host-tier activations\): llama3-70b, 70\.55B params", lines[2]), lines[2]
    assert _floor("llama3.1-405b", "rtx4090", r=16, base_dtype="nf4") > 64 * GB


def test_the_largest_size_is_searched_over_the_family_ladder():
    """The ladder holds the family's released sizes, smallest first by parameters; the search
    returns the largest whose floor fits and whose device check passes, and skips one the device
    refuses (on a 4090 without NVMe space: every store in RAM).

    Mutation seen caught: the search keeping the first size that fits (llama3.2-1b)."""
    for family, names in FAMILY_SIZES.items():
        params = [load_shape(n).num_params for n in names]
        assert params == sorted(params) and all(load_shape(n).name == n for n in names), family
    assert "llama-30m" not in family_sizes("llama") and "qwen-27b" in family_sizes("qwen3")
    hw = replace(PRESETS["rtx4090"], nvme_capacity_bytes=0)
    name, need = largest_fitting("llama3-8b", hw)
    assert name == "llama3.2-3b" and need.total_bytes == host_floor(load_shape(name), hw).total_bytes
    name, _ = largest_fitting("llama3-8b", hw, fits_device=lambda s: s.name != "llama3.2-3b")
    assert name == "llama3.2-1b"


def test_without_hardware_it_plans_for_this_machine(monkeypatch, capsys):
    """No ``--hardware``: the machine the reader returns, with its own RAM (a CPU box of 25 GB
    here): llama3-8b's full run does not fit it (its weights and gradients could leave the RAM, but
    the preset's 50 GB drive cannot take them: NVMe binds); llama3.2-3b's floor does, with units'
    weights and gradients on that drive.

    Mutation seen caught: ``machine_preset`` keeping the cpu preset's 16 GB, not the machine's RAM."""
    from layerwise.planner import cli as plan_cli
    from layerwise.planner.hardware_choice import Machine

    from layerwise.cli import build_parser

    monkeypatch.setitem(sys.modules, "fake_reader", SimpleNamespace(read=lambda: Machine(25 * GB)))
    parsed = build_parser("plan").parse_args(["plan", "--model", "llama3-8b", "--seq-len", "512", "--json"])
    assert parsed.read_machine == plan_cli.READ_MACHINE == "layerwise.planner.machine:this_machine_any"
    parsed.read_machine = "fake_reader:read"
    hw = plan_cli.plan_hardware(parsed)
    assert hw.name == "cpu" and hw.host_mem_bytes == 25 * GB
    assert plan_cli.plan_command(parsed) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["binding"] == "nvme" and d["largest_fitting_model"]["model"] == "llama3.2-3b"
    assert d["largest_fitting_model"]["nvme_all_units"] > 0
    assert d["largest_fitting_model"]["ram_bytes"] == 25 * GB


def test_base_dtypes_match_the_engine():
    from layerwise.adapters.config import BASE_DTYPES as ENGINE
    from layerwise.adapters.quant import packed_nbytes
    from layerwise.plan.finetune import BASE_BYTES_PER_PARAM, BASE_DTYPES

    assert BASE_DTYPES == ENGINE
    assert packed_nbytes("nf4", (4096, 4096)) == BASE_BYTES_PER_PARAM["nf4"] * 4096 * 4096 == 0.5625 * 4096 * 4096
