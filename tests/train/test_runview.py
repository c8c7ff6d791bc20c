"""Seeing a run: ``plan=auto``, the progress output, ``metrics.jsonl``, ``tracker.jsonl``,
``run.json`` and ``layerwise report``.

Two short runs on a tiny Llama (the ``llama-debug`` shape with the byte vocabulary), each made
once per module: ``layerwise train ... plan=auto`` (``cli.main`` in process) with its output to
streams that are not a terminal, checkpointing with the ``filter`` policy; and an in-process run with the ``every-2``
rule, accumulation 2 and no checkpoints (the tracker's own start-of-run reference).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import math
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerwise.ckpt import RunDir, open_run_step
from layerwise.cli import main
from layerwise.models import get_flavor
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.plan import Plan
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate
from layerwise.train import progress as progress_mod
from layerwise.train.config import CheckpointConfig
from layerwise.train.loop import TrainConfig, train
from layerwise.planner.run_plan import run_hardware
from layerwise.train.progress import Progress
from layerwise.train.report import load_run
from layerwise.train.update_log import open_jsonl_upto

from ..log_lines import logged_lines

STEPS = 6

METRICS_FIELDS = {"step", "loss", "lr", "grad_norm", "clip_coef", "skipped", "tokens",
                  "target_tokens", "tokens_per_s", "tflops", "step_s", "predicted_step_s",
                  "elapsed_s"}
"""Every ``metrics.jsonl`` row (docs/formats.md); ``eval_loss`` and ``ckpt_*`` when they happen."""
CKPT_FIELDS = {"ckpt_groups", "ckpt_snapshot_bytes", "ckpt_snapshot", "ckpt_blocked_s"}
TRACKER_FIELDS = {"change", "grad_norm", "exp_avg_norm", "exp_avg_sq_norm"}
RUN_FIELDS = {"format", "format_version", "model", "family", "num_params", "num_layers", "device",
              "compute_dtype", "steps", "seq_len", "plan", "hardware", "hardware_source",
              "predicted_step_s", "predicted_peak_device_bytes", "eval_loss_start",
              "resumed_from_step", "finished", "eval_loss_end", "measured_step_s",
              "tokens_per_s", "device_mem_reserved_bytes"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(get_flavor("llama-debug").build_config(vocab_size=258)) \
        .save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def auto_run(model_dir, tmp_path_factory):
    """``layerwise train plan=auto`` with its output to streams that are not a terminal (as a
    pipe is: ``isatty`` false), in process through ``cli.main`` (a fresh process only paid the
    imports again): (out_dir, stdout, stderr)."""
    out = tmp_path_factory.mktemp("auto") / "run"
    argv = ["train", f"model={model_dir}", "plan=auto",
            f"steps={STEPS}", "seq_len=32", "micro_batch_size=2", "grad_accum=2",
            "data.corpus_tokens=50000", "eval.every=3", "eval.batches=1", "log.every=2",
            "export=false", "log.track_every=2", "ckpt.every=3", "ckpt.policy=filter",
            f"out_dir={out}"]
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = main(argv)
    assert code == 0, stderr.getvalue()[-3000:]
    return out, stdout.getvalue(), stderr.getvalue()


@pytest.fixture(scope="module")
def rule_run(model_dir, tmp_path_factory):
    """In process: ``every-2``, 2 micro-batches per step, no checkpoints (turned off: they are
    on by default): (out_dir, log lines)."""
    out = tmp_path_factory.mktemp("rule") / "run"
    cfg = TrainConfig(model=str(model_dir), plan="every-2", steps=STEPS, seq_len=32,
                      micro_batch_size=2, grad_accum=2, data={"corpus_tokens": 50_000},
                      eval={"every": 0, "batches": 1}, export=False,
                      log={"every": 100, "track_every": 3, "progress": "lines"},
                      ckpt=CheckpointConfig(every=0, at_end=False), resume=False, out_dir=str(out))
    with logged_lines() as lines:
        train(cfg)
    return out, lines


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


# ----- plan=auto -----------------------------------------------------------------------------


def test_plan_auto_saves_the_planners_plan_and_its_predicted_step_time(auto_run, model_dir):
    """``plan.json`` is the planner's plan for this machine, with the simulator's step time for
    it; the metrics rows, ``run.json`` and the closing line carry that same prediction next to
    the measured step time. Mutation seen failing: the metrics' ``predicted_step_s`` taken from
    the MILP's own step model (``predicted["milp_objective_s"]``) instead of the simulator's."""
    out, stdout, _ = auto_run
    plan = Plan.load(out / "plan.json")
    assert plan.source == "milp" or plan.source.startswith("planner:")
    assert plan.micro_batch_size * plan.num_micro_batches == 4  # the run's sequences per step
    pred = plan.predicted["step_s"]
    assert pred > 0 and plan.predicted["hardware_source"].startswith("the cpu preset")
    cfg = TrainConfig(out_dir=str(out))
    hw = run_hardware(cfg.hardware, cfg.profile, cfg.out_dir, "cpu", torch.float32.itemsize)
    assert simulate(plan, load_shape(str(model_dir)), hw.profile, keep_trace=False).step_s \
        == pytest.approx(pred, rel=1e-9)
    assert {r["predicted_step_s"] for r in _rows(out / "metrics.jsonl")} == {pred}
    info = json.loads((out / "run.json").read_text())
    assert RUN_FIELDS <= set(info) and info["finished"] and info["predicted_step_s"] == pred
    assert info["measured_step_s"] > 0 and info["plan"] == plan.source
    [closing] = [x for x in stdout.splitlines() if x.startswith("step time: measured ")]
    assert f"predicted {pred:.4g} s" in closing and "measured / predicted" in closing


def test_a_rule_plan_is_not_priced(rule_run):
    """A rule plan is the rule: no hardware profile is resolved and no step time predicted (the
    planner is never loaded for it; ``test_rule_runs_skip_the_planner.py``)."""
    out, lines = rule_run
    plan = Plan.load(out / "plan.json")
    assert plan.source == "every-2" and "step_s" not in plan.predicted
    [closing] = [x for x in lines if x.startswith("step time: measured ")]
    assert "predicted" not in closing


def test_a_preset_far_off_the_measured_step_says_how_to_calibrate(tmp_path):
    """The closing line names ``layerwise calibrate`` and ``profile=`` only
    where the prediction came from a preset and is off by more than ``PRESET_OFF_BY`` either way."""
    from layerwise.train.run_records import PRESET_OFF_BY, timing_summary

    def closing(source: str, measured: float) -> str:
        name = "cpu" if "preset" in source else "calibrated-cpu"
        plan = Plan(["device"] * 2, source="every-1", seq_len=128, micro_batch_size=16,
                    predicted={"hardware": name, "hardware_source": source,
                               "hardware_preset": "preset" in source})
        return timing_summary([9.0, measured, measured], 1.0, plan, tmp_path, "llama-demo")

    preset = "the cpu preset (this machine's RAM)"
    hint = f"layerwise calibrate --model llama-demo --out {tmp_path / 'profile.json'}"
    assert hint in closing(preset, 0.47) and f"profile={tmp_path / 'profile.json'}" in closing(preset, 0.47)
    assert hint in closing(preset, 2.0)
    assert hint not in closing(preset, 1.0) and hint not in closing(preset, 0.99 * PRESET_OFF_BY)
    assert hint not in closing("the calibrated profile runs/x/profile.json", 0.47)


# ----- progress --------------------------------------------------------------------------------


def test_output_to_a_pipe_is_plain_lines_without_a_bar(auto_run):
    """Mutation seen failing: ``resolve_progress`` answering ``bar`` for ``auto`` whatever the
    streams (tqdm's carriage returns and ``step/s`` then fill the piped stderr)."""
    _, stdout, stderr = auto_run
    steps = [x for x in stdout.splitlines() if x.startswith("step ") and "/6: loss" in x]
    assert [x.split("/")[0] for x in steps] == ["step 2", "step 3", "step 4", "step 6"]  # 3: eval
    for x in steps:
        assert "tok/s" in x and "TFLOPS" in x and "ETA" in x and "predicted" not in x  # said once
    assert "\r" not in stdout + stderr and "step/s" not in stderr and "%|" not in stderr


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_bar_and_messages_do_not_break_it(monkeypatch, caplog):
    out, err = _Tty(), _Tty()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    assert progress_mod.resolve_progress("auto") == "bar"
    caplog.set_level(logging.INFO, logger="layerwise")
    p = Progress("auto", 3, 0, 1)
    for step in (1, 2, 3):
        rec = {"step": step, "loss": 2.0, "lr": 1e-3, "grad_norm": 1.0, "tokens_per_s": 1e4,
               "tflops": 0.5, "step_s": 0.1, "predicted_step_s": None,
               **({"eval_loss": 1.5} if step == 3 else {})}
        p.step(rec)
    p.close()
    assert "loss 2.0000, 10k tok/s, 0.5 TFLOPS" in err.getvalue() and "\r" in err.getvalue()
    assert caplog.messages == ["step 3/3: eval loss 1.5000"]  # per-step lines are the bar's job


# ----- metrics.jsonl ---------------------------------------------------------------------------


def test_metrics_rows_have_the_documented_fields_and_true_model_flops(rule_run, model_dir):
    """TFLOPS are the cost model's model FLOPs (forward + backward, no recompute) of every
    micro-batch of the step over the step's time. Mutations seen failing: counting one
    micro-batch per step (``flop_count(micro[:1])``); a step's tokens counted from its first
    micro-batch only."""
    out, _ = rule_run
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    shape = load_shape(str(model_dir))
    flops = 2 * CostModel(shape, PRESETS["cpu"], 2, 32).model_flops()
    for r in rows:
        assert METRICS_FIELDS <= set(r), METRICS_FIELDS - set(r)
        assert not CKPT_FIELDS & set(r) and "device_mem_reserved_bytes" not in r  # CPU
        assert r["tokens"] == 2 * 2 * 32 and r["tokens_per_s"] == pytest.approx(r["tokens"] / r["step_s"])
        assert r["tflops"] == pytest.approx(flops / r["step_s"] / 1e12, rel=1e-9)
    assert [r["step"] for r in rows if "eval_loss" in r] == [STEPS]


def test_metrics_rows_record_evals_and_checkpoints(auto_run):
    out, _, _ = auto_run
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval_loss" in r] == [3, 6]
    saved = [r for r in rows if CKPT_FIELDS <= set(r)]
    assert [r["step"] for r in saved] == [3, 6] == RunDir.open(out / "ckpt").committed_steps()
    assert all(r["ckpt_groups"] >= 1 and r["ckpt_snapshot_bytes"] > 0 for r in saved)
    assert [r["ckpt_snapshot"] for r in saved] == ["copy", "copy"]  # a tiny model's fits


# ----- tracker.jsonl ---------------------------------------------------------------------------


def _unit_norm(groups: dict) -> float:
    """The global gradient norm from a tracker row: each unit once (norm and lm_head share
    the head unit and its norm)."""
    units = {g: v["grad_norm"] for g, v in groups.items() if g != "lm_head"}
    return math.sqrt(sum(x * x for x in units.values()))


def test_tracker_rows_hold_change_and_the_steps_gradient_and_moment_norms(auto_run):
    """Gradient norms are the step's (their units make up the step's global norm), not the
    zeros the tracker reads after the engine's update cleared the gradients. Change is the
    Checkpointer's: since the group's last saved version, so absent before the first save, and
    at step 6 (measured before that step's save) exactly |w6 - w3| / |w3| from the two
    checkpoints' blobs. Mutations seen failing: grad norms from ``UpdateTracker.observe``
    (zeros); the run's tracker built apart from the Checkpointer's (change since the start,
    not since the save at step 3)."""
    out, _, _ = auto_run
    rows = _rows(out / "tracker.jsonl")
    assert [r["step"] for r in rows] == [2, 4, 6]
    metrics = {r["step"]: r for r in _rows(out / "metrics.jsonl")}
    for r in rows:
        assert r["reference"] == "saved"
        assert set(r["groups"]) == {"embed", "layers.0", "layers.1", "layers.2", "layers.3",
                                    "norm", "lm_head"}
        for v in r["groups"].values():
            assert set(v) == TRACKER_FIELDS and v["exp_avg_norm"] > 0 and v["exp_avg_sq_norm"] > 0
        assert _unit_norm(r["groups"]) == pytest.approx(metrics[r["step"]]["grad_norm"], rel=1e-5)
    assert all(v["change"] is None for v in rows[0]["groups"].values())  # nothing saved yet
    assert all(v["change"] > 0 for r in rows[1:] for v in r["groups"].values())

    at3, at6 = open_run_step(out / "ckpt", 3), open_run_step(out / "ckpt", 6)
    checked = 0
    for g, e in at6.entries.items():
        if e.saved_step != 6 or at3.entries[g].saved_step != 3:
            continue
        w6, w3 = at6.load_group(g), at3.load_group(g)
        keys = [k for k in w3 if k.startswith("param/")]
        num = math.sqrt(sum(float((w6[k] - w3[k]).norm()) ** 2 for k in keys))
        den = math.sqrt(sum(float(w3[k].norm()) ** 2 for k in keys))
        assert rows[-1]["groups"][g]["change"] == pytest.approx(num / den, rel=1e-5), g
        checked += 1
    assert checked >= 1


def test_without_checkpoints_the_tracker_measures_change_since_the_start(rule_run):
    """Mutation seen failing: the reference copy never taken (as if RAM were short: change
    stays null, reference ``none``)."""
    out, _ = rule_run
    rows = _rows(out / "tracker.jsonl")
    assert [r["step"] for r in rows] == [3, 6] and {r["reference"] for r in rows} == {"start"}
    for g, v in rows[0]["groups"].items():  # change since the start only grows here
        assert 0 < v["change"] < rows[1]["groups"][g]["change"], g
    assert not (out / "ckpt" / "tracker.jsonl").exists()


def test_a_resumed_log_keeps_whole_rows_up_to_the_resumed_step(tmp_path):
    """Mutation seen failing: ``open_jsonl_upto`` appending to the file as it is."""
    path = tmp_path / "tracker.jsonl"
    path.write_text('{"step": 2, "groups": {}}\n{"step": 4, "groups": {}}\n{"step": 6, "gr')
    open_jsonl_upto(path, 4).close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [2, 4]
    open_jsonl_upto(path, 0).close()
    assert path.read_text() == ""


# ----- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, message", [
    (["plan=nonsense"], "is not fit, every-K, recompute-all, keep-all, keep-internals, auto or a .json plan file"),
    (["plan=auto", "profile=/nonexistent/profile.json"], "profile=/nonexistent/profile.json: no such file"),
    (["plan=auto", "hardware=tpu-v9"], "unknown hardware 'tpu-v9'"),
    (["plan=/nonexistent/plan.json"], "plan file /nonexistent/plan.json does not exist"),
    (["log.progress=fancy"], "log.progress='fancy'"),
    (["log.track_every=-1"], "track_every must be >= 0"),
])
def test_bad_options_fail_before_any_work(tmp_path, capsys, overrides, message):
    """One clear line, exit 2, nothing written. Mutation seen failing: a missing ``profile=``
    file falling back to the preset (``check_profile`` and the ``profile`` branch skipped when
    the file is absent)."""
    out = tmp_path / "run"
    code = main(["train", "model=llama-demo", f"out_dir={out}", "steps=1", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err
    assert not out.exists()


# ----- layerwise report ------------------------------------------------------------------------


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def test_report_writes_a_png_and_prints_a_summary(auto_run, tmp_path, capsys):
    import matplotlib.image

    out, _, _ = auto_run
    png = tmp_path / "x.png"
    assert main(["report", str(out), "--out", str(png)]) == 0
    text = capsys.readouterr().out
    assert png.read_bytes()[:8] == PNG_SIGNATURE
    img = matplotlib.image.imread(png)
    assert img.ndim == 3 and img.shape[0] > 600 and img.shape[1] > 1000
    assert float(img[..., :3].std()) > 0.05  # drawn, not blank
    for part in (f"steps: {STEPS} of {STEPS}", "eval ", "throughput: median", "predicted",
                 "tracker: 3 observations of 7 groups (change since the last saved version)",
                 "checkpoints: 2 saves (policy filter)", f"wrote {png}"):
        assert part in text, part


def test_report_checkpoint_history_reads_the_manifests(auto_run):
    """The first save writes every group, so its bytes are exactly a full save's. Mutation
    seen failing: a full save's bytes counted without the step's state files."""
    out, _, _ = auto_run
    saves = load_run(out).saves
    assert [s.step for s in saves] == [3, 6]
    first = saves[0]
    assert first.written == first.groups == first.selected and len(first.groups) == 7
    assert first.bytes_written == first.full_bytes
    assert all(0 < s.bytes_written <= s.full_bytes for s in saves)
    assert set(saves[1].written) <= set(saves[1].selected)


def test_report_of_a_directory_without_a_run_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 2
    assert "nothing to report" in capsys.readouterr().err
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
