"""Config loading/overrides and a short end-to-end training run."""

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from layerwise import config
from layerwise.cli import main
from layerwise.train.loop import TrainConfig, train
from layerwise.train.schedule import lr_at


def test_overrides_are_typed_and_nested():
    cfg = config.apply_overrides(TrainConfig(), ["steps=7", "optimizer.lr=0.01", "plan=every-3",
                                                 "optimizer.betas=[0.8, 0.9]"])
    assert cfg.steps == 7 and cfg.optimizer.lr == 0.01 and cfg.plan == "every-3"
    assert cfg.optimizer.betas == (0.8, 0.9)
    with pytest.raises(ValueError, match="steps: expected int"):
        config.apply_overrides(TrainConfig(), ["steps=abc"])
    with pytest.raises(ValueError, match="unknown key"):
        config.apply_overrides(TrainConfig(), ["stepz=3"])


def test_yaml_file_then_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("steps: 3\noptimizer:\n  lr: 0.5\n")
    cfg = config.load(TrainConfig, path, ["steps=4"])
    assert cfg.steps == 4 and cfg.optimizer.lr == 0.5
    path.write_text("- not a mapping\n")
    with pytest.raises(ValueError, match="mapping"):
        config.load(TrainConfig, path)


def test_schedule_warms_up_then_decays_to_floor():
    lrs = [lr_at(s, 1.0, 4, 20, 0.1) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[4:], lrs[5:]))
    assert lrs[-1] >= 0.1 and lr_at(20, 1.0, 4, 20, 0.1) == pytest.approx(0.1)


def test_short_training_run_learns_and_exports(tmp_path):
    cfg = TrainConfig(steps=12, seq_len=64, micro_batch_size=4, grad_accum=2, plan="every-3",
                      corpus_tokens=200_000, eval_every=0, eval_batches=2, out_dir=str(tmp_path),
                      log_every=100)
    result = train(cfg, log=lambda *_: None)
    assert result.eval_loss_end < result.eval_loss_start - 0.5
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == list(range(1, 13))
    model = AutoModelForCausalLM.from_pretrained(result.model_dir)
    assert model.config.num_hidden_layers == 6
    with torch.no_grad():
        assert torch.isfinite(model(torch.tensor([[256, 100, 101]])).logits).all()


def test_cli_reports_bad_plan_without_traceback(tmp_path, capsys):
    code = main(["train", f"out_dir={tmp_path}", "plan=every-x", "steps=1"])
    assert code == 2
    assert "every-K with an integer K" in capsys.readouterr().err


def test_interrupted_run_resumes_from_layerwise_checkpoint_identically(tmp_path):
    common = dict(seq_len=32, micro_batch_size=2, corpus_tokens=50_000, eval_every=0,
                  eval_batches=1, log_every=100, export=False, ckpt_every=3, ckpt_policy="full")
    quiet = lambda *_: None  # noqa: E731
    train(TrainConfig(steps=8, out_dir=str(tmp_path / "straight"), **common), log=quiet)
    train(TrainConfig(steps=6, out_dir=str(tmp_path / "cut"), **common), log=quiet)
    messages = []
    train(TrainConfig(steps=8, out_dir=str(tmp_path / "cut"), **common), log=messages.append)
    assert any("resumed from layer-wise checkpoint step 6" in m for m in messages)

    def losses(run):
        rows = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r["loss"] for r in rows}

    straight, cut = losses("straight"), losses("cut")
    assert sorted(cut) == list(range(1, 9))
    assert all(cut[s] == straight[s] for s in range(1, 9))
