import json
import re
from dataclasses import replace

import pytest

from layerwise.cli import main
from layerwise.plan.plan import Plan
from layerwise.planner.report import format_table, order_text


def _table(text: str) -> tuple[int, list[dict[str, str]]]:
    """The global batch the header names, and the plan table's rows as {column: cell}: cells are
    at least two spaces apart, so splitting on runs of 2+ spaces must give every cell back."""
    lines = text.splitlines()
    g = int(re.search(r"every row at global batch (\d+) sequences", text).group(1))
    k = next(i for i, line in enumerate(lines) if line.startswith("plan "))
    cols = re.split(r" {2,}", lines[k].strip())
    rows = []
    for line in lines[k + 2:]:
        if line.startswith(("MILP at", "chosen plan")):
            break
        cells = re.split(r" {2,}", line.strip())
        assert len(cells) in (len(cols), len(cols) + 1), f"columns run together: {line!r}"
        rows.append(dict(zip(cols + ["note"], cells)))
    return g, rows


def _check_rows(text: str, seq_len: int) -> list[dict[str, str]]:
    """Every row at the one global batch the header names; the row marked chosen first and not
    slower than any other row that fits; every row that does not fit says why."""
    g, rows = _table(text)
    for r in rows:
        mbs, n = map(int, r["mbs x n"].split(" x "))
        assert mbs * n == g, (r, g)  # equal tokens per step: g * seq_len
        float(r["step s"]), int(r["tokens/s"].replace(",", ""))  # each figure is one number
    tps = [int(r["tokens/s"].replace(",", "")) for r in rows]
    assert rows[0].get("note") == "chosen" and [r.get("note") for r in rows].count("chosen") == 1
    fitting = [t for t, r in zip(tps, rows) if not r.get("note", "").startswith("does not fit")]
    assert tps[0] == max(fitting), rows
    assert all(re.match(r"does not fit: .+ GB over", r["note"]) for r in rows if r.get("note", "") not in ("", "chosen"))
    return rows


def test_plan_prints_a_table_and_writes_the_plan(tmp_path, capsys):
    """Mutation this test was seen to catch: the written ``predicted.tokens_per_s`` taken from
    the MILP's objective instead of the simulator (they differ by 0.05% here)."""
    out, png = tmp_path / "plan.json", tmp_path / "plan.png"
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "8", "--gpu-mem", "12", "--host-mem", "512", "--out", str(out), "--timeline", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("chosen plan (milp): order micro-batch-major; resident layers", "every-4", "recompute-all",
                 "tokens/s", "check: ok"):
        assert word in text
    rows = _check_rows(text, 4096)
    assert _table(text)[0] == 8 and rows[0]["plan"] == "milp"
    assert re.search(r"MILP at micro-batch \d+: Optimal", text)
    plan = Plan.load(out)
    plan.validate(28)
    assert plan.source == "milp" and plan.seq_len == 4096
    assert plan.micro_batch_size * plan.num_micro_batches == 8
    # the prediction written with the plan is what the simulator says of the plan as loaded
    from layerwise.planner.presets import PRESETS
    from layerwise.plan.shape import load_shape
    from layerwise.planner.simulator import simulate

    sim = simulate(plan, load_shape("qwen2.5-7b"), PRESETS["rtx3090"].with_memory(gpu_mem_gb=12, host_mem_gb=512))
    assert plan.predicted["tokens_per_s"] == pytest.approx(sim.tokens_per_s, rel=1e-9)
    assert plan.predicted["peak_device_bytes"] == sim.peak_device_bytes
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # beside each rule, the largest micro-batch size that fits (the plan's own record of it)
    assert "max mbs" in text
    mx = plan.predicted["max_micro_batch_size"]
    by_rule = {r["plan"]: r for r in rows}
    for rule in ("every-4", "recompute-all"):
        assert int(by_rule[rule]["max mbs"]) == mx[rule]


def test_plan_json_and_auto_batch(tmp_path, capsys):
    profile = tmp_path / "hw.json"
    from layerwise.planner.presets import PRESETS

    PRESETS["h800"].save(profile)
    rc = main(["plan", "--model", "llama-30m", "--hardware", str(profile), "--seq-len", "512", "--json"])
    assert rc == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["check"]["ok"] and d["milp"]["status"] == "Optimal"
    assert set(d["rules"]) >= {"every-1", "every-2", "every-4", "every-8", "recompute-all"}
    best = d["plan"]["predicted"]["tokens_per_s"]
    assert all(best >= r["tokens_per_s"] * (1 - 1e-9) for r in d["rules"].values())
    # the host line's figures, and no largest-model search without --host-mem
    h = d["host"]
    assert h["total_bytes"] == h["store_bytes"] + h["activation_bytes"] + h["reserve_bytes"] <= h["ram_bytes"]
    assert h["fits_ram"] and h["bytes_per_param"] == round(h["total_bytes"] / h["num_params"], 3)
    assert h["reserve_bytes"] > PRESETS["h800"].host_reserved_bytes  # the model's ring on top
    assert d["lines"][1].startswith("host RAM: ") and "largest_fitting_model" not in d


def test_plan_when_nothing_fits(capsys):
    rc = main(["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "1", "--gpu-mem", "2.5"])
    assert rc == 1
    out = capsys.readouterr().out
    verdict = out.splitlines()[0]
    assert re.match(r"fits: no — qwen2\.5-3b on rtx3090 at 4096 tokens per sequence: GPU memory is short by "
                    r"\d+\.\d GB\.", verdict), verdict
    assert "device memory binds" in verdict and "GB over" in verdict and len(out.splitlines()) == 1
    rc = main(["plan", "--model", "qwen2.5-3b", "--hardware", "rtx3090", "--seq-len", "4096",
               "--batch", "1", "--gpu-mem", "2.5", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 1 and d["binding"] == "device" and d["over_bytes"] > 0 and d["verdict"] == verdict


def test_verdict_rows_at_one_global_batch_and_separable_columns_on_a_tiny_model(capsys):
    """A tiny model at 16 tokens: the first line is the verdict (fits, tokens/s, hours per billion
    tokens, each memory's peak of its capacity); in auto mode every row is at the chosen global
    batch and the chosen row is the fastest that fits; figures of 7+ digits stay apart.

    Mutations seen caught: auto mode rows left at their own accumulation (``_at_global_batch``
    skipped: on 2 GB rows at global batches 4, 8 and 16); the chosen plan the first rule instead of the fastest
    (``best = next(iter(by_name.values()))``); the old fixed-width columns ("0.064254,517")."""
    assert main(["plan", "--model", "llama-30m", "--hardware", "h100", "--seq-len", "16"]) == 0
    text = capsys.readouterr().out
    verdict = text.splitlines()[0]
    m = re.match(r"fits: yes — llama-30m on h100, (\d+) x 16 tokens per step: ([\d,]+) tokens/s predicted, "
                 r"([\d.,]+) h per billion tokens \(peak GPU memory [\d.]+ of 78\.5 GB, host RAM [\d.]+ of [\d.]+ GB\)$",
                 verdict)
    assert m, verdict
    rows = _check_rows(text, 16)
    g, _ = _table(text)
    tps = int(m.group(2).replace(",", ""))
    assert int(m.group(1)) == g and rows[0]["tokens/s"] == m.group(2)
    assert float(m.group(3).replace(",", "")) == pytest.approx(1e9 / tps / 3600, rel=1e-2)
    assert len(rows) >= 10
    # 2 GB of GPU memory at 4,096 tokens: the rules' fastest micro-batch sizes differ
    assert main(["plan", "--model", "llama-30m", "--hardware", "rtx3090", "--seq-len", "4096", "--gpu-mem", "2"]) == 0
    rows = _check_rows(capsys.readouterr().out, 4096)
    assert len({r["mbs x n"] for r in rows}) > 1


def test_table_columns_never_run_together():
    """Cells as long as their header or longer (11-character figures under an 11-wide title)
    stay two spaces apart and right-aligned; a wide word column is left-aligned."""
    lines = format_table(["plan", "step s", "tokens/s", ""],
                         [["a", "0.000847", "847,752,278", "chosen"], ["much-longer-name", "10.5", "1", ""]])
    assert lines[2] == "a                 0.000847  847,752,278  chosen"
    assert lines[3] == "much-longer-name      10.5            1"
    assert lines[1] == "-" * len(lines[0])
    assert all(re.split(r" {2,}", ln.strip())[:3] == cells[:3] for ln, cells in
               zip(lines[2:], [["a", "0.000847", "847,752,278"], ["much-longer-name", "10.5", "1"]]))


def test_user_errors_are_one_line(capsys):
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "tpu", "--seq-len", "128"]) == 2
    assert "preset" in capsys.readouterr().err
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h200", "--seq-len", "128", "--batch", "x"]) == 2
    assert "--batch" in capsys.readouterr().err


def test_calibrate_pieces_are_quick(tmp_path):
    from layerwise.planner.calibrate import (measure_accumulation, measure_copy_gbps, measure_disk_gbps,
                                            measure_optimizer)

    h2d, d2h = measure_copy_gbps("cpu", 1 << 20, 2)
    r, w = measure_disk_gbps(str(tmp_path), 1 << 20, 1)
    opt = measure_optimizer(1 << 16, 2)
    acc16, acc = measure_accumulation(1 << 16, 2)
    assert min(h2d, d2h, r, w, acc, acc16) > 0 and opt > 0
    assert not list(tmp_path.iterdir())  # the probe file is gone


def _floor_bytes(model: str, preset: str, ram_gb: float) -> int:
    """A model's least host need, from the parts (not ``host_need``): the store with 8-bit moments
    and bf16 gradients, the preset's reserve, 4 pinned ring buffers of the largest layer's bf16
    gradient."""
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS
    from layerwise.plan.shape import load_shape

    shape, hw = load_shape(model), PRESETS[preset].with_memory(host_mem_gb=ram_gb)
    units = shape.unit_names()
    store = CostModel(shape, hw, 1, 1).host_store_bytes(["8bit"] * len(units), bf16_grads=True)
    layer = max(shape.unit_params(u) for u in units[1:-1]) * 2
    return store + hw.host_reserved_bytes + 4 * layer


def test_plan_prints_host_bytes_per_param_fits_ram_and_the_largest_model(tmp_path, capsys, monkeypatch):
    """The host line is the chosen plan's store (bf16 gradients: one micro-batch per step, bf16
    compute), its host-tier activations and the reserve with the model's pinned ring, per
    parameter, against the RAM; the largest-model line names the largest qwen2 flavor whose
    floor fits 40 GB, and the next larger one does not fit. On a 4090 without NVMe space: with
    it, units' weights and gradients on NVMe (``nvme-all``) let far larger flavors fit.

    Mutations seen caught: ``plan_host_need``'s bf16 gradients always False (the store printed at fp32 gradients,
    2 B/param more); the ring in torch's power-of-two pinned blocks (reserve 5.9 GB, not
    5.4); ``largest_fitting`` keeping the first flavor that fits (qwen2-debug)."""
    from layerwise.planner.cost import CostModel
    from layerwise.planner.presets import PRESETS
    from layerwise.plan.shape import load_shape
    from layerwise.planner.simulator import simulate

    monkeypatch.setitem(PRESETS, "rtx4090", replace(PRESETS["rtx4090"], nvme_capacity_bytes=0))
    out = tmp_path / "plan.json"
    assert main(["plan", "--model", "qwen2.5-3b", "--hardware", "rtx4090", "--host-mem", "40", "--seq-len", "1024",
                 "--batch", "1", "--time-limit", "1", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    plan, shape = Plan.load(out), load_shape("qwen2.5-3b")
    hw = PRESETS["rtx4090"].with_memory(host_mem_gb=40)
    assert plan.lands_once()
    store = CostModel(shape, hw, 1, 1).host_store_bytes(plan.moments, bf16_grads=True)
    layer = max(shape.unit_params(u) for u in shape.unit_names()[1:-1]) * 2
    reserve = hw.host_reserved_bytes + 4 * layer
    acts = simulate(plan, shape, hw.for_model(layer), keep_trace=False).peak_pinned_act_bytes
    total = store + acts + reserve
    m = re.match(r"host RAM: ([\d.]+) B/param for the store \(([\d.]+) GB, bf16 gradients .*\), ([\d.]+) B/param in "
                 r"all with ([\d.]+) GB of host-tier activations and the ([\d.]+) GB reserve .*: ([\d.]+) of 40\.0 GB "
                 r"RAM on rtx4090 — fits$", lines[1])
    assert m, lines[1]
    assert float(m.group(1)) == round(store / shape.num_params, 2) and float(m.group(2)) == round(store / 1e9, 1)
    assert float(m.group(3)) == round(total / shape.num_params, 2) and float(m.group(5)) == round(reserve / 1e9, 1)
    assert float(m.group(6)) == round(total / 1e9, 1) and total <= 40e9
    m = re.match(r"largest qwen2 model that fits 40\.0 GB of host RAM on rtx4090 \(8-bit moments, bf16 gradients, no "
                 r"host-tier activations\): (\S+), [\d.]+B params, ([\d.]+) GB", lines[2])
    assert m and m.group(1) == "qwen2.5-3b", lines[2]
    assert float(m.group(2)) == round(_floor_bytes("qwen2.5-3b", "rtx4090", 40) / 1e9, 1)
    assert _floor_bytes("qwen2.5-7b", "rtx4090", 40) > 40e9


def test_plan_json_says_host_ram_and_the_largest_model_when_nothing_fits(capsys, monkeypatch):
    """qwen2.5-7b's floor (69.2 GB) is over 60 GB of RAM on an h200 without NVMe space (where no
    optimizer state can leave the RAM): refused on host RAM, with the reserve's parts and the
    largest qwen2 that fits (qwen2.5-3b, 31.3 GB) in the lines and the JSON.

    Mutation seen caught: the pre-check without bf16 gradients (the refusal then names 76.39 GB,
    the store with fp32 gradients, not the 62.25 GB of the leanest store)."""
    from layerwise.planner.presets import PRESETS

    monkeypatch.setitem(PRESETS, "h200", replace(PRESETS["h200"], nvme_capacity_bytes=0))
    assert main(["plan", "--model", "qwen2.5-7b", "--hardware", "h200", "--host-mem", "60", "--seq-len", "4096",
                 "--json"]) == 1
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["binding"] == "host"
    assert "needs 62.25 GB even with 8-bit optimizer moments everywhere and bf16 gradients" in d["message"]
    assert re.match(r"host reserve: [\d.]+ of 60\.0 GB RAM = 4\.8 GB \(runtime, CUDA context, OS, margin\) \+ "
                    r"1\.9 GB pinned gradient ring$", d["lines"][1]), d["lines"]
    big = d["largest_fitting_model"]
    assert big["model"] == "qwen2.5-3b" and big["fits_ram"] and big["total_bytes"] == _floor_bytes(
        "qwen2.5-3b", "h200", 60)
    assert _floor_bytes("qwen2.5-7b", "h200", 60) > 60e9


def test_qwen2_5_14b_fits_an_h200_with_128_gb_of_host_ram(capsys):
    """The issue's figure (21, item 5): split master + 8-bit moments + bf16 gradients ~8.1 B/param
    (120.2 GB) plus the reserve fit 128 GB: a plan that lands each gradient once at the auto
    batch (the search's layer-major order) and the pinned gradient ring at its own size (2.2 GB,
    not torch's 4 x 1 GiB blocks). The largest qwen2 that fits is qwen2.5-72b, with units'
    weights and gradients on NVMe (``nvme-all``)."""
    rc = main(["plan", "--model", "qwen2.5-14b", "--hardware", "h200", "--host-mem", "128", "--seq-len", "4096"])
    lines = capsys.readouterr().out.splitlines()
    assert rc == 0 and lines[0].startswith("fits: yes — qwen2.5-14b on h200"), lines[:3]
    assert lines[1].startswith("host RAM: ") and lines[1].endswith("of 128.0 GB RAM on h200 — fits"), lines[1]
    assert re.search(r"largest qwen2 model that fits 128\.0 GB .*: qwen2\.5-72b,.* units nvme-all\)$", lines[2]), lines[2]


def test_qwen2_5_14b_at_one_micro_batch_fits_128_gb(capsys):
    """At one micro-batch per step (bf16 host gradients) the store is 120.18 GB; with the ring
    page-locked at its own size the reserve is 7.0 GB, and the plan fits 128 GB of RAM. The largest
    qwen2 that fits is qwen2.5-72b, with units' weights and gradients on NVMe (``nvme-all``).

    Mutations seen caught: the search's pre-check with fp32 gradients (refused: 148.16 GB); the
    ring in torch's power-of-two pinned blocks (refused: 1.3 GB short)."""
    argv = ["plan", "--model", "qwen2.5-14b", "--hardware", "h200", "--host-mem", "128", "--seq-len", "4096",
            "--batch", "1", "--time-limit", "1"]
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("fits: yes — qwen2.5-14b on h200, 1 x 4096 tokens per step"), lines[0]
    assert re.match(r"host RAM: 8\.14 B/param for the store \(120\.2 GB, bf16 gradients .* and the 7\.0 GB reserve "
                    r".*of 128\.0 GB RAM on h200 — fits$", lines[1]), lines[1]
    assert re.search(r": qwen2\.5-72b, 72\.71B params, .* units nvme-all\)$", lines[2]), lines[2]


def test_the_chosen_plan_says_its_order_and_resident_layers():
    """A layer-major plan names how many micro-batches share a weight load; resident layers are
    listed as runs, with their count of the model's layers."""
    lm = Plan(["device"] * 8, num_micro_batches=8, micro_batches_per_load=4, resident_layers=[5, 0, 1, 2])
    assert order_text(lm) == "order layer-major (4 micro-batches per weight load); resident layers 0-2, 5 (4 of 8)"
    assert order_text(Plan(["device"] * 8)) == "order micro-batch-major; no resident layers"
