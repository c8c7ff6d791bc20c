"""Open any checkpoint by path: a layer-wise run, a DeepSpeed ZeRO save, an HF Trainer checkpoint, a DCP
dir or an HF model dir."""

from __future__ import annotations

from pathlib import Path

from ..ckpt.resolve import open_run_step
from ..ckpt.run_format import locate_run
from .torchdist.dcp_checkpoint import DCPCheckpointSource, is_dcp_checkpoint
from .hf.model_dir import HFModelDirSource
from .layout import OPTIMIZER_NAME, TRAINER_STATE_NAME, WEIGHT_FILE_NAMES, CheckpointSource
from .hf.trainer_checkpoint import TrainerCheckpointSource
from .deepspeed.zero_checkpoint import ZeroCheckpointSource, is_zero_checkpoint


def is_layerwise_run(path: Path) -> bool:
    """A layer-wise run, or a ``layerwise train`` out_dir holding one in ``ckpt/``."""
    return ((path / "format.json").is_file() or (path / "manifests").is_dir()
            or (locate_run(path) / "format.json").is_file())


def is_trainer_checkpoint(path: Path) -> bool:
    return (path / OPTIMIZER_NAME).is_file() or (path / TRAINER_STATE_NAME).is_file()


def open_source(path: str | Path, step: int | None = None, config: dict | str | Path | None = None
                ) -> CheckpointSource:
    """Open a layer-wise run (``path@N``: at step N), an HF Trainer checkpoint, a DCP dir or an HF
    model dir. ``config``: the HF config of a DCP dir, which records none."""
    p = Path(path)
    if not p.exists() and "@" in str(path):
        base, _, step_str = str(path).rpartition("@")
        if not step_str.isdigit():
            raise ValueError(f"{path!r}: the part after '@' must be a step number, e.g. runs/a@400")
        if step is not None and step != int(step_str):
            raise ValueError(f"{path!r} names step {step_str} but step={step} was also given")
        p, step = Path(base), int(step_str)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint source {p} does not exist or is not a directory")
    if is_layerwise_run(p):
        return open_run_step(p, step)
    if step is not None:
        kind = ("a DeepSpeed ZeRO checkpoint" if is_zero_checkpoint(p) else
                "an HF Trainer checkpoint" if is_trainer_checkpoint(p) else
                "a DCP checkpoint" if is_dcp_checkpoint(p) else "an HF model dir")
        raise ValueError(
            f"{p} is {kind}, which holds a single step; drop the step ({step}) or point at a "
            "layer-wise run dir"
        )
    if is_zero_checkpoint(p):  # before Trainer: a Trainer + DeepSpeed checkpoint-N holds a ZeRO save
        return ZeroCheckpointSource(p)
    if is_trainer_checkpoint(p):
        return TrainerCheckpointSource(p)
    if is_dcp_checkpoint(p):
        return DCPCheckpointSource(p, config)
    checkpoints = sorted(p.glob("checkpoint-*"), key=lambda c: (len(c.name), c.name))
    if checkpoints and not any((p / f).is_file() for f in WEIGHT_FILE_NAMES):
        raise ValueError(
            f"{p} looks like a Trainer output dir, not a checkpoint; point at one of its "
            f"checkpoints, e.g. {checkpoints[-1]}"
        )
    return HFModelDirSource(p)
