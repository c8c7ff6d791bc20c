"""Where a run's numbers go (``metrics.jsonl``, progress, samples, TensorBoard, W&B), each an
optional import used only when asked. Non-lead ranks write nothing, so the loop never asks."""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from .outdir import open_metrics
from .progress import Progress
from .update_log import open_jsonl_upto

_log = logging.getLogger(__name__)

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "step_s", "eval_loss")


class TensorBoardSink:
    def __init__(self, out_dir: Path):
        writer = importlib.import_module("torch.utils.tensorboard").SummaryWriter
        self.writer = writer(log_dir=str(out_dir / "tensorboard"))

    def log(self, step: int, rec: dict) -> None:
        for key in SCALARS:
            if isinstance(rec.get(key), (int, float)):
                self.writer.add_scalar(f"train/{key}", rec[key], step)
        self.writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self.writer.add_text(tag, text, step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, out_dir: Path, config: dict):
        self.wandb = importlib.import_module("wandb")
        self.run = self.wandb.init(dir=str(out_dir), config=config, resume="allow")

    def log(self, step: int, rec: dict) -> None:
        self.run.log({f"train/{k}": rec[k] for k in SCALARS if isinstance(rec.get(k), (int, float))},
                     step=step)

    def text(self, step: int, tag: str, text: str) -> None:
        self.run.log({tag: text}, step=step)

    def close(self) -> None:
        self.run.finish()


def open_sinks(names: list[str], out_dir: Path, config: dict) -> list:
    return [TensorBoardSink(out_dir) if n == "tensorboard" else WandbSink(out_dir, config)
            for n in names]


class MetricsLog:
    """``metrics.jsonl`` (one row a step), the progress display, the sinks and
    ``samples.jsonl``: rank 0's (``lead``); the other ranks' write nothing."""

    def __init__(self, out_dir: Path, lead: bool):
        self.out_dir, self.lead = out_dir, lead
        self.metrics: TextIO | None = None
        self.progress: Progress | None = None
        self.sinks: list = []
        self.samples: TextIO | None = None
        self.start_step = 0

    def start(self, start_step: int, resumed_row: dict | None, progress: Progress,
              report_to: list[str], config: dict) -> None:
        """Open ``metrics.jsonl`` (kept up to ``start_step``), the display and the sinks."""
        self.start_step = start_step
        if self.lead:
            self.metrics = open_metrics(self.out_dir / "metrics.jsonl", start_step, resumed_row)
            self.progress, self.sinks = progress, open_sinks(report_to, self.out_dir, config)

    def row(self, rec: dict) -> None:
        if not self.lead:
            return
        assert self.metrics is not None and self.progress is not None
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.progress.step(rec)
        for sink in self.sinks:
            sink.log(rec["step"], rec)

    def sample(self, step: int, make: Callable[[], list[tuple[str, str]]]) -> None:
        """The generations ``make()`` returns: logged, in ``samples.jsonl`` and the sinks."""
        if not self.lead:
            return
        texts = make()
        if self.samples is None:  # rows up to the resumed step kept, as in metrics.jsonl
            self.samples = open_jsonl_upto(self.out_dir / "samples.jsonl", self.start_step)
        for prompt, text in texts:
            self.samples.write(json.dumps({"step": step, "prompt": prompt, "text": text}) + "\n")
            _log.info(f"step {step}: sample: {prompt!r} -> {text!r}")
            for sink in self.sinks:
                sink.text(step, "samples", f"{prompt} ⟶ {text}")
        self.samples.flush()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        for f in (self.metrics, self.samples):
            if f is not None:
                f.close()
        for sink in self.sinks:
            sink.close()
        self.metrics = self.samples = self.progress = None
        self.sinks = []
