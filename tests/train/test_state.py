"""The run's ``TrainState``: one versioned part of each checkpoint step, read back on resume;
another version is refused."""

import json
from pathlib import Path

import pytest

from layerwise import config
from layerwise.ckpt import open_run_step
from layerwise.train.loop import TrainConfig, train
from layerwise.train.state import TRAIN_STATE_FORMAT, TRAIN_STATE_VERSION, TrainState


def _cfg(model_dir: Path, out: Path, steps: int) -> TrainConfig:
    return config.apply_overrides(TrainConfig(), [
        f"model.name={model_dir}", f"steps={steps}", "seq_len=32", "micro_batch_size=2",
        "grad_accum=2", "data.corpus_tokens=20000", "eval.every=0", "eval.batches=1",
        "log.every=100", "log.progress=lines", "export=false", "ckpt.every=2", "ckpt.policy=full",
        f"out_dir={out}"])


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


def test_a_train_state_of_another_version_is_refused_in_one_line():
    """Mutation seen failing: accepting version 0 (the refusal only of newer versions, as it was)."""
    for version in (0, TRAIN_STATE_VERSION + 1, None):
        with pytest.raises(ValueError) as err:
            TrainState.from_json({**TrainState().to_json(), "format_version": version})
        msg = str(err.value)
        assert "\n" not in msg and msg == (
            f"the checkpoint's train state is format_version {version}; this layerwise reads "
            f"{TRAIN_STATE_VERSION}: start the run again or use a layerwise that wrote it"), msg
