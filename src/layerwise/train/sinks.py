"""Where a run's numbers go besides ``metrics.jsonl``: TensorBoard and Weights & Biases
(``log.report_to``), each an optional import used only when asked for; and the sample
generations at each evaluation (``eval.samples`` / ``eval.prompts``).

``RunOutput`` (rank 0) writes everything a run leaves in its ``out_dir``; every other rank of a
data-parallel run gets ``NullOutput``, which has the same methods and does nothing, so the
loop never asks which rank it is.
"""

from __future__ import annotations

import importlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import torch

from ..ckpt import RunDir
from ..engine.batch import Batch
from ..interop.recipes.store_export import export_store
from ..plan.plan import Plan
from ..store import HostStore
from ..util import dirlock
from .outdir import clear_run, open_metrics, write_run_json
from .progress import Progress
from .update_log import open_jsonl_upto

_log = logging.getLogger(__name__)

SCALARS = ("loss", "lr", "grad_norm", "tokens_per_s", "tflops", "step_s", "eval_loss")
SAMPLE_PROMPT_TOKENS = 16


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


def sample_prompts(eval_set: list[Batch], prompts: list[str], count: int, tokenizer
                   ) -> list[list[int]]:
    """Token ids of the prompts to continue at each eval: ``prompts`` encoded, else the first
    ``SAMPLE_PROMPT_TOKENS`` tokens of ``count`` held-out rows."""
    if prompts:
        return [tokenizer.encode(p, eos=False) for p in prompts]
    rows = [row for b in eval_set for row in b.input_ids][:count]
    return [row[:SAMPLE_PROMPT_TOKENS].tolist() for row in rows]


@torch.no_grad()
def greedy_continue(forward_logits, ids: list[int], new_tokens: int, max_len: int) -> list[int]:
    """``new_tokens`` greedy tokens after ``ids`` (each a full forward pass: no KV cache)."""
    out = list(ids)
    for _ in range(new_tokens):
        window = torch.tensor([out[-max_len:]])
        out.append(int(forward_logits(window)[0, -1].argmax()))
    return out[len(ids):]


class RunOutput:
    """What rank 0 writes in ``out_dir``: plan, run.json, metrics rows, progress, sinks,
    samples; and the evaluations (one rank computes them for all)."""

    lead = True

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.metrics: TextIO | None = None
        self.progress: Progress | None = None
        self.sinks: list = []
        self.samples: TextIO | None = None
        self.start_step = 0

    def save_plan(self, plan: Plan) -> None:
        plan.save(self.out_dir / "plan.json")

    def run_json(self, info: dict[str, Any]) -> None:
        write_run_json(self.out_dir, info)

    def claim(self) -> dirlock.DirLock:
        """The out_dir's lock: one run at a time."""
        return dirlock.acquire(self.out_dir)

    def clear(self) -> None:
        """Remove the run files of an earlier run (``overwrite=true``)."""
        clear_run(self.out_dir)

    def start(self, start_step: int, resumed_row: dict | None, progress: Progress,
              report_to: list[str], config: dict) -> None:
        """Open ``metrics.jsonl`` (kept up to ``start_step``), the display and the sinks."""
        self.metrics = open_metrics(self.out_dir / "metrics.jsonl", start_step, resumed_row)
        self.start_step = start_step
        self.progress, self.sinks = progress, open_sinks(report_to, self.out_dir, config)

    def tracker_every(self, every: int) -> int:
        return every

    def evaluate(self, fn) -> float:
        return fn()

    def row(self, rec: dict) -> None:
        assert self.metrics is not None and self.progress is not None
        self.metrics.write(json.dumps(rec) + "\n")
        self.metrics.flush()
        self.progress.step(rec)
        for sink in self.sinks:
            sink.log(rec["step"], rec)

    def prune(self, ckpt, keep: int) -> None:
        """Keep the newest ``keep`` committed checkpoints (``save_total_limit``), once the
        save in flight has committed (no blob is being written that gc could take)."""
        ckpt.wait()
        RunDir.open(ckpt.run_dir).gc(keep)

    def export(self, store: HostStore, tokenizer) -> Path:
        model_dir = export_store(store, self.out_dir / "model", overwrite=True)
        saved_tok = tokenizer.save(model_dir)
        _log.info(f"exported Hugging Face model{' and tokenizer' if saved_tok else ''} to "
                  f"{model_dir}")
        return model_dir

    def sample(self, step: int, make: Callable[[], list[tuple[str, str]]]) -> None:
        """The generations ``make()`` returns: logged, in ``samples.jsonl`` and the sinks."""
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


class NullOutput(RunOutput):
    """Every other rank's: nothing written, no evaluation (``nan``)."""

    lead = False

    def save_plan(self, plan: Plan) -> None:
        pass

    def run_json(self, info: dict[str, Any]) -> None:
        pass

    def claim(self) -> None:
        return None

    def clear(self) -> None:
        pass

    def start(self, start_step, resumed_row, progress, report_to, config) -> None:
        pass

    def prune(self, ckpt, keep: int) -> None:
        pass

    def export(self, store, tokenizer) -> None:
        return None

    def tracker_every(self, every: int) -> int:
        return 0

    def evaluate(self, fn) -> float:
        return float("nan")

    def row(self, rec: dict) -> None:
        pass

    def sample(self, step: int, make) -> None:
        pass
