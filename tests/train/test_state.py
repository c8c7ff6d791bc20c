"""The run's ``TrainState``: one versioned part of each checkpoint step, read back on resume,
and the ``extra`` of the format before it still read."""

import json
from pathlib import Path

import pytest

from layerwise import config
from layerwise.ckpt import open_run_step
from layerwise.train import checkpoints as checkpoints_module
from layerwise.train.loop import TrainConfig, train
from layerwise.train.state import TRAIN_STATE_FORMAT, TRAIN_STATE_VERSION, TrainState


def _cfg(model_dir: Path, out: Path, steps: int) -> TrainConfig:
    return config.apply_overrides(TrainConfig(), [
        f"model.name={model_dir}", f"steps={steps}", "seq_len=32", "micro_batch_size=2",
        "grad_accum=2", "data.corpus_tokens=20000", "eval.every=0", "eval.batches=1",
        "log.every=100", "log.progress=lines", "export=false", "ckpt.every=2", "ckpt.policy=full",
        f"out_dir={out}"])


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _run_json(out: Path) -> dict:
    return json.loads((out / "run.json").read_text())


def test_a_save_holds_the_run_state_as_one_versioned_part(model_dir, tmp_path):
    train(_cfg(model_dir, tmp_path, 4))
    saved = open_run_step(tmp_path / "ckpt", 4).state()
    part = saved["trainer_state"]
    assert part["format"] == TRAIN_STATE_FORMAT and part["format_version"] == TRAIN_STATE_VERSION
    state = TrainState.from_json(part)
    assert (state.step, state.data_position, state.rows_per_micro_batch) == (4, 8, 2)
    assert saved["data_position"] == 8 and saved["extra"] is None
    assert state.metrics_row["step"] == 4 and state.schedule == _run_json(tmp_path)["schedule"]
    assert state.eval_loss_start == _run_json(tmp_path)["eval_loss_start"]
    assert state.eval_loss_start_step == 0 and state.data_key


def test_a_newer_train_state_is_refused_in_one_line():
    with pytest.raises(ValueError, match="newer than this layerwise reads.*upgrade"):
        TrainState.from_json({**TrainState().to_json(), "format_version": TRAIN_STATE_VERSION + 1})


def test_a_checkpoint_of_the_format_before_resumes_as_one_of_today(model_dir, tmp_path,
                                                                   monkeypatch):
    """A run whose checkpoints kept the state in ``extra`` (as ``layerwise train`` wrote them
    before ``TrainState``; written here by the checkpointer as that code called it) continues
    as a run of today's checkpoints does: the same losses, the first run's start eval and the
    step it was measured at, the resumed step's metrics row. Mutation seen failing:
    ``from_checkpoint`` ignoring ``extra`` (the start eval is measured again, at step 2)."""
    today, before = tmp_path / "today", tmp_path / "before"
    train(_cfg(model_dir, today, 2))

    def save_as_before(self, state, every_group=False):
        legacy = {"eval_loss_start": state.eval_loss_start,
                  "eval_loss_start_step": state.eval_loss_start_step,
                  "metrics_row": state.metrics_row, "data_key": state.data_key,
                  "data_rows_per_micro_batch": state.rows_per_micro_batch,
                  "schedule": state.schedule}
        self.last_saved = state.step
        return self.ckpt.save(state.step, extra=legacy, data_position=state.data_position)

    with monkeypatch.context() as m:
        m.setattr(checkpoints_module.CheckpointManager, "save", save_as_before)
        train(_cfg(model_dir, before, 2))
    assert open_run_step(before / "ckpt", 2).state()["trainer_state"] is None

    for out in (today, before):
        train(_cfg(model_dir, out, 4))
    assert [r["loss"] for r in _rows(before)] == pytest.approx([r["loss"] for r in _rows(today)],
                                                               rel=1e-6)
    assert [r["step"] for r in _rows(before)] == [1, 2, 3, 4]
    for key in ("eval_loss_start", "eval_loss_start_step", "resumed_from_step", "schedule"):
        assert _run_json(before)[key] == _run_json(today)[key], key
