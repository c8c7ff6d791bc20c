import json

import pytest

import re

from layerwise.cli import main
from layerwise.plan.plan import Plan


def test_plan_prints_a_table_and_writes_the_plan(tmp_path, capsys):
    """Mutation this test was seen to catch: the written ``predicted.tokens_per_s`` taken from
    the MILP's objective instead of the simulator (they differ by 0.05% here)."""
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "8", "--gpu-mem", "12", "--out", str(out), "--timeline", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("plan (milp)", "every-4", "recompute-all", "tokens/s", "check: ok"):
        assert word in text
    assert re.search(r"MILP at micro-batch \d+: Optimal", text)
    plan = Plan.load(out)
    plan.validate(28)
    assert plan.source == "milp" and plan.seq_len == 4096
    assert plan.micro_batch_size * plan.num_micro_batches == 8
    # the prediction written with the plan is what the simulator says of the plan as loaded
    from layerwise.plan.hardware import PRESETS
    from layerwise.plan.shape import load_shape
    from layerwise.plan.simulator import simulate

    sim = simulate(plan, load_shape("qwen2.5-7b"), PRESETS["rtx3090"].with_memory(gpu_mem_gb=12))
    assert plan.predicted["tokens_per_s"] == pytest.approx(sim.tokens_per_s, rel=1e-9)
    assert plan.predicted["peak_device_bytes"] == sim.peak_device_bytes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # beside each rule, the largest micro-batch size that fits (the plan's own record of it)
    assert "max mbs" in text
    mx = plan.predicted["max_micro_batch_size"]
    for rule in ("every-4", "recompute-all"):
        row = next(line for line in text.splitlines() if line.startswith(rule + " "))
        assert int(row.split()[-1]) == mx[rule]


def test_plan_json_and_auto_batch(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    from layerwise.plan.hardware import PRESETS

    PRESETS["h800"].save(profile)
    rc = main(["plan", "--model", "llama-30m", "--hardware", str(profile), "--seq-len", "512", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["check"]["ok"] and d["milp"]["status"] == "Optimal"
    assert set(d["rules"]) >= {"every-1", "every-2", "every-4", "every-8", "recompute-all"}
    best = d["plan"]["predicted"]["tokens_per_s"]
    assert all(best >= r["tokens_per_s"] * (1 - 1e-9) for r in d["rules"].values())


def test_plan_when_nothing_fits(capsys):
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "1", "--gpu-mem", "2.5"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "device memory binds" in err and "GB over" in err
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "1", "--gpu-mem", "2.5", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1 and d["binding"] == "device" and d["over_bytes"] > 0


def test_user_errors_are_one_line(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "tpu", "--seq-len", "128"]) == 2
    assert "preset" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h200", "--seq-len", "128", "--batch", "x"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_calibrate_pieces_are_quick(tmp_path):
    from layerwise.engine.calibrate import (measure_accumulation, measure_copy_gbps, measure_disk_gbps,
                                            measure_optimizer)

    h2d, d2h = measure_copy_gbps("cpu", 1 << 20, 2)
    r, w = measure_disk_gbps(str(tmp_path), 1 << 20, 1)
    opt = measure_optimizer(1 << 16, 2)
    acc16, acc = measure_accumulation(1 << 16, 2)
    assert min(h2d, d2h, r, w, acc, acc16) > 0 and opt > 0
    assert not list(tmp_path.iterdir())  # the probe file is gone
