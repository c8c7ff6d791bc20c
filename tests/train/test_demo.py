"""``layerwise demo`` at test scale: the same path as the real demo (a BPE tokenizer learnt from
the stdlib source, a plan with 8-bit moments on the layers, filter-policy checkpoints, export
with the tokenizer, reload, sample, report) with the demo's own ``llama-demo`` model (0.9M
parameters) for a few steps on a small slice of the corpus.

Mutations seen failing: the demo plan without ``moments`` (no unit steps with the 8-bit
optimizer); ``model.tokenizer=`` not passed to ``train`` (the byte tokenizer trains, the export has
no tokenizer files); the earlier run's directory kept instead of replaced (the second run
resumes at step 4 and trains nothing).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from layerwise.ckpt import RunDir
from layerwise.cli import main
from layerwise.optim.adamw import HostAdamW
from layerwise.optim.adamw8bit import HostAdamW8bit
from layerwise.train.config import DataConfig, EvalConfig, LogConfig, ScheduleConfig
from layerwise.train.demo import DemoConfig, fresh_out_dir, run_demo
from layerwise.train.tokenizer import END_OF_TEXT, train_bpe_tokenizer

from ..log_lines import logged_lines

STEPS = 4
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
CODE = "class A:\n    def f(self, x):\n        return {'a': g(x , 1)}  # done\n\n\tpass\n"


def small(out_dir: Path) -> DemoConfig:
    return DemoConfig(steps=STEPS, out_dir=str(out_dir), tokenizer_chars=100_000,
                      data=DataConfig(corpus_tokens=12_000), seq_len=32, micro_batch_size=4,
                      schedule=ScheduleConfig(warmup_steps=1), eval=EvalConfig(every=0),
                      log=LogConfig(track_every=1, progress="lines"),
                      ckpt=replace(DemoConfig().ckpt, every=2), max_new_tokens=8)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """The demo at test scale, with a record of which optimizer stepped which unit."""
    out = tmp_path_factory.mktemp("demo") / "run"
    stepped: dict[str, set[str]] = {"8bit": set(), "fp32": set()}

    def spy(kind, original):
        def step_unit(self, buf, lr, clip_coef):
            stepped[kind].add(buf.name)
            return original(self, buf, lr, clip_coef)
        return step_unit

    with pytest.MonkeyPatch.context() as mp, logged_lines() as lines:
        mp.setattr(HostAdamW8bit, "step_unit", spy("8bit", HostAdamW8bit.step_unit))
        mp.setattr(HostAdamW, "step_unit", spy("fp32", HostAdamW.step_unit))
        result = run_demo(small(out))
    return out, result, stepped, lines


def test_export_loads_with_auto_classes_and_generates(demo_run):
    out, result, _, _ = demo_run
    model_dir = out / "model"
    assert result.train.model_dir == model_dir
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    assert tok.eos_token == END_OF_TEXT and tok.eos_token_id == 0 == model.config.eos_token_id
    assert len(tok) <= model.config.vocab_size == DemoConfig.vocab_size
    ids = tok(CODE, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == CODE and len(ids) < len(CODE)  # merges, exact round trip
    gen = model.generate(torch.tensor([ids]), max_new_tokens=3, do_sample=False,
                         pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > len(ids)
    # the demo's own sample: the prompt, continued, decoded with the trained tokenizer
    assert result.sample.startswith(DemoConfig.prompt) and len(result.sample) > len(DemoConfig.prompt)
    assert any(result.sample in line for line in demo_run[3])


def test_some_units_step_with_8bit_moments(demo_run):
    out, _, stepped, lines = demo_run
    plan = json.loads((out / "plan.json").read_text())
    layers = [f"layers.{i}" for i in range(4)]
    assert plan["moments"] == ["fp32", "8bit", "8bit", "8bit", "8bit", "fp32"]
    assert stepped["8bit"] == set(layers)
    assert stepped["fp32"] == {"embed", "head"}
    assert any("8-bit moments on 4 of 6 units" in line for line in lines)


def test_checkpoints_written_by_the_filter_policy(demo_run):
    out, _, _, _ = demo_run
    run = RunDir.open(out / "ckpt")
    assert run.committed_steps() == [2, 4]
    manifests = [run.read_manifest(s) for s in (2, 4)]
    assert {m["policy"] for m in manifests} == {"filter"}
    assert set(manifests[0]["groups_written"]) == set(manifests[0]["groups"])  # first save: all
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert [r["step"] for r in rows if "ckpt_groups" in r] == [2, 4]
    assert (out / "tracker.jsonl").stat().st_size > 0


def test_report_png_and_demo_record(demo_run):
    out, result, _, lines = demo_run
    assert result.report_path == out / "report.png"
    assert result.report_path.read_bytes()[:8] == PNG_SIGNATURE
    assert any(str(result.report_path) in line for line in lines)
    assert any(line.startswith("checkpoints: 2 saves (policy filter)") for line in lines)
    info = json.loads((out / "demo.json").read_text())
    assert info["format"] == "layerwise-demo" and info["finished"] is True
    assert info["sample"] == result.sample
    assert info["eval_loss_end"] == result.train.eval_loss_end


def test_a_second_demo_starts_fresh(demo_run):
    """Run again (shorter) into the same directory: it is replaced and every step trains (a
    resume would find the checkpoint at step 4 and train nothing)."""
    out, _, _, _ = demo_run
    (out / "stale.txt").write_text("from the earlier run")
    with logged_lines() as lines:
        run_demo(replace(small(out), steps=2, ckpt=replace(DemoConfig().ckpt, every=1)))
    assert "earlier demo run there was removed" in lines[0]
    assert not (out / "stale.txt").exists()
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert json.loads((out / "run.json").read_text())["resumed_from_step"] is None
    assert RunDir.open(out / "ckpt").committed_steps() == [1, 2]


def test_fresh_out_dir_replaces_only_a_demo_run(tmp_path):
    new = tmp_path / "new"
    assert "(new)" in fresh_out_dir(new) and new.is_dir()
    assert "(empty)" in fresh_out_dir(new)
    old_demo = tmp_path / "old"  # what the demo wrote before demo.json existed
    old_demo.mkdir()
    (old_demo / "run.json").write_text(json.dumps({"model": "llama-demo"}))
    (old_demo / "metrics.jsonl").write_text("{}\n")
    assert "removed" in fresh_out_dir(old_demo)
    assert list(old_demo.iterdir()) == []
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text(json.dumps({"model": "/models/qwen"}))
    (other / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="holds no earlier demo run"):
        fresh_out_dir(other)
    assert sorted(p.name for p in other.iterdir()) == ["notes.txt", "run.json"]


def test_demo_command_refuses_a_foreign_directory(tmp_path, capsys):
    other = tmp_path / "mine"
    other.mkdir()
    (other / "data.txt").write_text("x")
    assert main(["demo", "--out", str(other), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "holds no earlier demo run" in err and "Traceback" not in err
    assert [p.name for p in other.iterdir()] == ["data.txt"]


def test_train_bpe_tokenizer(tmp_path):
    tok = train_bpe_tokenizer([CODE * 20, "import os\nimport sys\n"] * 5, 300, tmp_path / "tok")
    assert len(tok) <= 300 and tok.eos_id == tok.pad_id == 0 and tok.bos_id is None
    assert tok.decode(tok.encode(CODE, bos=True, eos=False)) == CODE
    assert tok.encode("x", eos=True)[-1] == 0
    again = AutoTokenizer.from_pretrained(tmp_path / "tok", local_files_only=True)
    assert again("def f", add_special_tokens=False)["input_ids"] == tok.encode("def f", eos=False)
    with pytest.raises(ValueError, match="vocab_size must be >= 257"):
        train_bpe_tokenizer(["x"], 100, tmp_path / "small")
