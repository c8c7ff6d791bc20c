import json
import re

import pytest

from layerwise.cli import main
from layerwise.plan.plan import Plan
from layerwise.plan.report import format_table


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
               "--batch", "8", "--gpu-mem", "12", "--out", str(out), "--timeline", str(png)])
    assert rc == 0
    text = capsys.readouterr().out
    for word in ("chosen plan (milp)", "every-4", "recompute-all", "tokens/s", "check: ok"):
        assert word in text
    rows = _check_rows(text, 4096)
    assert _table(text)[0] == 8 and rows[0]["plan"] == "milp"
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
    by_rule = {r["plan"]: r for r in rows}
    for rule in ("every-4", "recompute-all"):
        assert int(by_rule[rule]["max mbs"]) == mx[rule]


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
    out = capsys.readouterr().out
    verdict = out.splitlines()[0]
    assert re.match(r"fits: no — qwen2\.5-7b on rtx3090 at 4096 tokens per sequence: GPU memory is short by "
                    r"\d+\.\d GB\.", verdict), verdict
    assert "device memory binds" in verdict and "GB over" in verdict and len(out.splitlines()) == 1
    rc = main(["plan", "--model", "qwen2.5-7b", "--hardware", "rtx3090", "--seq-len", "4096",
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
    from layerwise.engine.calibrate import (measure_accumulation, measure_copy_gbps, measure_disk_gbps,
                                            measure_optimizer)

    h2d, d2h = measure_copy_gbps("cpu", 1 << 20, 2)
    r, w = measure_disk_gbps(str(tmp_path), 1 << 20, 1)
    opt = measure_optimizer(1 << 16, 2)
    acc16, acc = measure_accumulation(1 << 16, 2)
    assert min(h2d, d2h, r, w, acc, acc16) > 0 and opt > 0
    assert not list(tmp_path.iterdir())  # the probe file is gone
