"""Make the Hugging Face ``Trainer`` write layer-wise checkpoints.

::

    cb = LayerwiseCheckpointCallback("runs/a", policy="filter", every=100, threshold=1e-3)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[cb])
    trainer.train()

To resume with the Trainer, export a step as ``checkpoint-N`` (:func:`export_for_resume`) and pass
it as ``resume_from_checkpoint``; set ``save_strategy="no"`` when these replace the Trainer's own.
With DeepSpeed ZeRO the callback drives a ``DeepSpeedCheckpointer`` on every rank (the Trainer's
own resume from it is not built: load it with ``DeepSpeedCheckpointer(...).load()``). FSDP is
refused."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from ...ckpt.checkpoint_config import DEFAULT_POLICY
from ...ckpt.checkpointer import Checkpointer
from ...ckpt.protocol import CheckpointerProtocol
from .deepspeed_loop import DeepSpeedCheckpointer
from ..recipes.merge import merge
from ..sources import open_source


def _unwrap(obj: Any, attr: str) -> Any:
    """accelerate wraps optimizers (``.optimizer``) and schedulers (``.scheduler``); the Checkpointer
    needs the torch objects that own the state."""
    inner = getattr(obj, attr, None)
    return inner if inner is not None and inner is not obj else obj


def trainer_state_json(state: Any) -> dict:
    """A ``TrainerState`` as the JSON dict ``trainer_state.json`` holds."""
    return json.loads(json.dumps(dataclasses.asdict(state), default=str))


class LayerwiseCheckpointCallback(TrainerCallback):
    """Write a layer-wise checkpoint every ``every`` steps (and at the end) of ``Trainer.train``."""

    def __init__(
        self,
        run_dir: str | Path,
        policy: str = DEFAULT_POLICY,
        every: int | None = None,
        *,
        save_at_end: bool = True,
        observe: bool = True,
        config: Any = None,
        **policy_options: Any,
    ):
        """``every``: optimizer steps between saves (None: ``args.save_steps``). ``save_at_end``:
        also save the last step off the grid. ``observe``: feed per-step statistics to the policy.
        ``config``: a ``CheckpointConfig`` (not under DeepSpeed, whose sharded saves are
        synchronous). ``policy_options``: e.g. ``threshold=1e-3, max_staleness=4``."""
        if every is not None and (not isinstance(every, int) or every <= 0):
            raise ValueError(f"every must be a positive number of steps or None (got {every!r})")
        self.run_dir = Path(run_dir)
        self.policy = policy
        self.every = every
        self.save_at_end = save_at_end
        self.observe = observe
        self.policy_options = policy_options
        self.config = config
        self.checkpointer: CheckpointerProtocol | None = None
        self.saved_steps: list[int] = []

    def _every(self, args: Any) -> int:
        if self.every is not None:
            return self.every
        steps = getattr(args, "save_steps", None)
        if not steps or steps < 1:
            raise ValueError(
                "LayerwiseCheckpointCallback(every=None) follows TrainingArguments.save_steps, which is "
                f"{steps!r}; pass every=N (a whole number of optimizer steps)"
            )
        return int(steps)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if model is None or optimizer is None:
            raise ValueError("LayerwiseCheckpointCallback needs the Trainer's model and optimizer")
        if getattr(args, "fsdp", None):
            # Each rank holds a shard of the state; the callback does not gather it.
            raise ValueError(
                "LayerwiseCheckpointCallback does not support FSDP; use the Trainer's own checkpoints "
                "there (DeepSpeed ZeRO is supported: each rank writes its own partition)"
            )
        self._every(args)  # fail early on a bad interval
        if getattr(args, "deepspeed", None):
            if self.config is not None:
                raise ValueError(
                    "LayerwiseCheckpointCallback(config=...) configures the one-process "
                    "Checkpointer; under DeepSpeed each rank writes its partition in a synchronous "
                    "sharded save, which takes none of it: leave config unset")
            if self.checkpointer is None:  # on every rank: each writes the pieces it holds
                self.checkpointer = DeepSpeedCheckpointer(
                    self.run_dir, module=model, optimizer=_unwrap(optimizer, "optimizer"),
                    scheduler=_unwrap(lr_scheduler, "scheduler"), policy=self.policy, **self.policy_options)
            return
        if not state.is_world_process_zero:
            return  # data parallel: every rank holds the same state; one writes it
        if self.checkpointer is None:
            self.checkpointer = Checkpointer(
                self.run_dir, model, _unwrap(optimizer, "optimizer"), _unwrap(lr_scheduler, "scheduler"),
                policy=self.policy, config=self.config, **self.policy_options,
            )

    def on_optimizer_step(self, args, state, control, **kwargs):
        # Gradients are still there (zero_grad comes next); global_step is incremented after this.
        # (A DeepSpeed save measures its statistics itself, across the ranks.)
        if self.observe and isinstance(self.checkpointer, Checkpointer):
            self.checkpointer.observe(state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.checkpointer is not None and state.global_step % self._every(args) == 0:
            self._save(state)

    def on_train_end(self, args, state, control, **kwargs):
        if self.checkpointer is None:
            return
        try:
            if self.save_at_end and state.global_step not in self.saved_steps:
                self._save(state)
        finally:
            self.checkpointer.close()
            self.checkpointer = None

    def _save(self, state: Any) -> None:
        self.checkpointer.save(state.global_step, trainer_state=trainer_state_json(state))
        self.saved_steps.append(state.global_step)


def export_for_resume(run_dir: str | Path, output_dir: str | Path, step: int | None = None) -> str:
    """Export a layer-wise step (default: the newest) as ``output_dir/checkpoint-N`` and return the
    path for ``resume_from_checkpoint``; an existing one is reused (exports are atomic)."""
    source = open_source(run_dir, step)
    n = int(source.extra_state()["step"])
    out = Path(output_dir) / f"checkpoint-{n}"
    if not out.is_dir():
        merge(source, out, format="trainer")
    return str(out)
