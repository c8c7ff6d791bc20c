"""How a run starts in its ``out_dir``: fresh, continuing the run there, or from another run's
checkpoint; decided before the model is built, each choice said in one line.

| ``out_dir`` holds | ``resume=auto`` (default) | ``resume=true`` | ``resume=false`` |
|---|---|---|---|
| nothing | fresh | error | fresh |
| a run of this model with a checkpoint | continue it | continue it | error |
| a run without a checkpoint, same settings (killed before its first save) | start it again | error | error |
| a run without a checkpoint and other settings, or of another model | error | error | error |

Every error says the way out (``overwrite=true``, another ``out_dir``, the right ``resume``)."""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from .. import config as config_lib
from ..ckpt import CheckpointError, RunDir
from .config import TrainConfig
from .outdir import PER_INVOCATION_KEYS, holds_run, read_run_json, saved_config
from .state import TrainState


@dataclass
class Start:
    source: Path | None = None
    """The checkpoint run directory to load from (None: a fresh run)."""
    step: int | None = None
    """Its step to load (None: the newest)."""
    note: str | None = None
    """The line that says how the run starts."""
    clear: list[str] | None = None
    """Run files to remove first (``overwrite=true``)."""
    done: bool = False
    """The run already finished its ``steps``: nothing to train (``note`` says so)."""


def committed_steps(ckpt_dir: Path) -> list[int]:
    if not (ckpt_dir / "steps").is_dir():
        return []
    try:
        return RunDir.open(ckpt_dir).committed_steps()
    except (CheckpointError, ValueError, OSError):
        return []


def parse_checkpoint_path(spec: str) -> tuple[Path, int | None]:
    """``resume_from_checkpoint``: an out_dir or a ckpt dir (newest step), a step directory
    (``.../steps/000000000040``) or ``PATH@STEP``."""
    step = None
    m = re.fullmatch(r"(.*)@(\d+)", spec)
    path = Path(m.group(1) if m else spec)
    if m:
        step = int(m.group(2))
    if path.parent.name == "steps" and path.name.isdigit():
        step, path = int(path.name), path.parent.parent
    elif not (path / "steps").is_dir() and (path / "ckpt" / "steps").is_dir():
        path = path / "ckpt"
    steps = committed_steps(path)
    if not steps:
        raise ValueError(f"resume_from_checkpoint={spec}: no committed layer-wise checkpoint "
                         f"there (pass a run's out_dir, its ckpt/ directory, or PATH@STEP)")
    if step is not None and step not in steps:
        raise ValueError(f"resume_from_checkpoint={spec}: step {step} is not committed in {path}; "
                         f"its steps: {', '.join(map(str, steps[-8:]))}")
    return path, step


def _same_model(saved: str | None, given: str) -> bool:
    if saved is None or saved == given:
        return True
    a, b = Path(saved), Path(given)
    return a.is_dir() and b.is_dir() and a.resolve() == b.resolve()


def _saved_model(info: dict | None) -> str | None:
    if not info:
        return None
    model = (info.get("config") or {}).get("model")
    return model.get("name") if isinstance(model, dict) else info.get("model")


def _same_settings(cfg: TrainConfig, out_dir: Path) -> bool:
    """Whether the run in ``out_dir`` was started with ``cfg``'s settings (``run.json``'s,
    per-invocation keys aside, compared as JSON)."""
    saved = saved_config(out_dir)
    mine = {k: v for k, v in config_lib.to_dict(cfg).items() if k not in PER_INVOCATION_KEYS}
    return saved is not None and saved == json.loads(json.dumps(mine))


def resume_command(out_dir: Path) -> str:
    return f"layerwise train out_dir={shlex.quote(str(out_dir))}"


def check_extension(out_dir: Path, at_step: int, steps: int, finished: bool) -> str | None:
    """Refuse continuing a run at ``at_step`` with fewer ``steps``; the "nothing to do" line
    when it is finished at exactly ``steps`` (None: train on)."""
    if at_step > steps:
        raise ValueError(f"{out_dir} is already at step {at_step}, past steps={steps}: nothing to "
                         f"train. steps=N (> {at_step}) extends it; to go back to an earlier step, "
                         f"resume_from_checkpoint={out_dir / 'ckpt'}@STEP into another out_dir; "
                         "overwrite=true starts it again")
    if at_step == steps and finished:
        return (f"{out_dir} already finished step {steps} of steps={steps}: nothing to train "
                f"(steps=N extends it; overwrite=true starts it again)")
    return None


def decide_start(cfg: TrainConfig, out_dir: Path) -> Start:
    """How this run starts (module docstring); ``ValueError`` when it must not."""
    files = holds_run(out_dir)
    what = f"{out_dir} holds a run ({', '.join(files)})"
    if cfg.resume_from_checkpoint is not None:
        source, step = parse_checkpoint_path(cfg.resume_from_checkpoint)
        if source.resolve().is_relative_to(out_dir.resolve()):
            raise ValueError(f"resume_from_checkpoint={cfg.resume_from_checkpoint} is inside "
                             f"out_dir {out_dir}; pass another out_dir for the new run")
        if files and not cfg.overwrite:
            raise ValueError(f"{what}; resume_from_checkpoint starts a new run: pick an empty "
                             "out_dir, or overwrite=true to replace that run")
        return Start(source, step, f"starting from {source} step "
                     f"{step if step is not None else committed_steps(source)[-1]} "
                     "(resume_from_checkpoint)", files or None)
    if cfg.overwrite:
        return Start(note=f"overwrite=true: the run in {out_dir} is removed first" if files else None,
                     clear=files or None)
    steps = committed_steps(out_dir / "ckpt")
    if cfg.resume == "false":
        if files:
            raise ValueError(f"{what}; resume=false starts afresh only with overwrite=true; or "
                             "resume=auto continues it, or pick another out_dir")
        return Start()
    info = read_run_json(out_dir)
    if not steps:
        if cfg.resume == "true":
            raise ValueError(f"resume=true, but {out_dir / 'ckpt'} holds no checkpoint; "
                             "resume=auto (the default) starts afresh when there is none")
        if files and _same_settings(cfg, out_dir):
            return Start(note=f"{out_dir} holds a run with these settings that stopped before its "
                              "first checkpoint: nothing to lose, starting it again", clear=files)
        if files:
            raise ValueError(f"{what} that left no checkpoint to continue from, with other "
                             "settings than this command's; overwrite=true starts it again with "
                             "this command's, or pick another out_dir")
        return Start()
    theirs = _saved_model(info)
    if not _same_model(theirs, cfg.model.name):
        raise ValueError(f"{out_dir} holds a run of model {theirs}, not {cfg.model.name}: pick "
                         "another out_dir, or overwrite=true to replace that run")
    if cfg.num_train_epochs is None:
        done = check_extension(out_dir, steps[-1], cfg.steps, bool(info and info.get("finished")))
        if done:
            return Start(note=done, done=True)
    return Start(out_dir / "ckpt", None, f"resume={cfg.resume}: continuing the run in {out_dir} "
                 "(resume=false overwrite=true starts afresh)")


def data_start(state: TrainState, accum: int, global_rows: int) -> tuple[int, str | None]:
    """The first global micro-batch (of ``global_rows`` rows) to train on, and a warning when
    rows are skipped. A checkpoint written with another world size or micro-batch counted
    micro-batches of its own size: its position is converted through rows (rounded down)."""
    start = state.step * accum if state.data_position is None else state.data_position
    saved_rows = state.rows_per_micro_batch
    if not saved_rows or saved_rows == global_rows:
        return start, None
    rows = start * int(saved_rows)
    warning = None
    if rows % global_rows:
        warning = (f"warning: the checkpoint consumed {rows} rows, not a multiple of this run's "
                   f"{global_rows} rows per micro-batch; {rows % global_rows} rows are skipped")
    return rows // global_rows, warning
