"""Settings a user does not give: a pretrained model gets fine-tuning defaults (a built-in flavor
trained from scratch keeps its own), the names HF's ``TrainingArguments`` use are accepted, and
the device is the one the machine has. Torch-free: the settings resolve before any import."""

from __future__ import annotations

import pytest

from layerwise.cli import dashed_overrides, main
from layerwise.train.cli import resolve_config
from layerwise.train.config import FINETUNE_DEFAULTS, LORA_FINETUNE_LR, TrainConfig


@pytest.fixture
def model_dir(tmp_path):
    path = tmp_path / "model"
    path.mkdir()
    return path


def test_a_pretrained_model_gets_fine_tuning_defaults_and_says_so(model_dir, tmp_path):
    """Mutation seen failing: ``finetune_defaults`` returning nothing (a pretrained model trained
    at the from-scratch LR of 2e-3 with weight decay 0.1 for 60 steps: its general answers
    gone, as the real-model test shows)."""
    cfg, lines = resolve_config(None, [f"model={model_dir}", f"out_dir={tmp_path / 'a'}"])
    assert (cfg.optimizer.lr, cfg.optimizer.weight_decay) == (2e-5, 0.0)
    assert (cfg.schedule.warmup_ratio, cfg.num_train_epochs) == (0.03, 3.0)
    assert len(lines) == 1 and "fine-tuning defaults" in lines[0] and "optimizer.lr=2e-05" in lines[0]
    lora, _ = resolve_config(None, [f"model={model_dir}", "lora.r=8", f"out_dir={tmp_path / 'b'}"])
    assert lora.optimizer.lr == LORA_FINETUNE_LR
    scratch, lines = resolve_config(None, [f"out_dir={tmp_path / 'c'}"])
    assert (scratch.optimizer.lr, scratch.num_train_epochs, lines) == (TrainConfig().optimizer.lr, None, [])


def test_what_the_user_sets_wins_over_a_fine_tuning_default(model_dir, tmp_path):
    """``steps`` keeps the epochs default out (it would win over steps), ``warmup_steps`` the
    warm-up ratio; a key set is not named in the line."""
    cfg, lines = resolve_config(None, [f"model={model_dir}", "steps=7", "schedule.warmup_steps=2",
                                       "optimizer.lr=1e-4", f"out_dir={tmp_path}"])
    assert (cfg.steps, cfg.num_train_epochs, cfg.schedule.warmup_ratio) == (7, None, None)
    assert cfg.optimizer.lr == 1e-4 and cfg.optimizer.weight_decay == FINETUNE_DEFAULTS["optimizer.weight_decay"]
    assert "optimizer.lr" not in lines[0] and "num_train_epochs" not in lines[0]


def test_hf_training_argument_names_mean_what_they_mean_in_hf(tmp_path):
    """``learning_rate``, ``lr``, ``max_steps``, ``gradient_accumulation_steps``,
    ``per_device_train_batch_size``, ``output_dir``, and ``--learning_rate 1e-4`` as HF scripts
    pass them. Mutation seen failing: the alias table left out of ``config._rename`` ("unknown
    key 'learning_rate'")."""
    argv = dashed_overrides(["train", "--learning_rate", "3e-4", "--max_steps=9", "--bf16",
                             "--print-config"])
    assert argv == ["train", "learning_rate=3e-4", "max_steps=9", "bf16=true", "--print-config"]
    cfg, _ = resolve_config(None, ["learning_rate=3e-4", "max_steps=9", "gradient_accumulation_steps=4",
                                   "per_device_train_batch_size=2", f"output_dir={tmp_path}"])
    assert (cfg.optimizer.lr, cfg.steps, cfg.grad_accum, cfg.micro_batch_size, cfg.out_dir) == \
        (3e-4, 9, 4, 2, str(tmp_path))
    assert resolve_config(None, ["lr=1e-5", f"out_dir={tmp_path}"])[0].optimizer.lr == 1e-5


def test_a_key_hf_does_not_have_either_is_refused_with_a_suggestion(capsys):
    assert main(["train", "--learnin_rate", "1e-4", "--print-config"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown key 'learnin_rate'" in err


def test_the_device_is_auto_by_default():
    assert TrainConfig().device == "auto"


def test_print_config_is_yaml_alone_on_stdout(tmp_path, capsys):
    """The fine-tuning-defaults line goes to stderr with ``--print-config``: stdout stays the
    YAML a ``--config`` file takes. Mutation seen failing: the line printed on stdout."""
    import yaml

    model = tmp_path / "model"
    model.mkdir()
    assert main(["train", f"model={model}", f"out_dir={tmp_path / 'a'}", "--print-config"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["optimizer"]["lr"] == 2e-5 and "fine-tuning defaults" in err
