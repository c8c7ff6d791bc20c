"""What a run reports: its ``TrainResult``, a step's ``metrics.jsonl`` row, the tokens/s and
step-time lines it prints at the end."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..engine.batch import Batch
from ..plan.plan import Plan


@dataclass
class TrainResult:
    out_dir: Path
    eval_loss_start: float
    eval_loss_end: float
    steps: int
    tokens_per_s: float
    """Median over the steps after the first of each step's tokens / its engine step time: the
    figure of every ``metrics.jsonl`` row and of the progress line (``tokens_per_s_figure``)."""
    peak_device_bytes_predicted: int
    model_dir: Path | None
    step_s_measured: float | None = None
    """Median engine step time of the run's steps after its first (None: fewer than 2 steps)."""
    step_s_predicted: float | None = None
    """The simulator's step time for the plan on the run's hardware profile (None: no profile)."""
    rank: int = 0
    """Under torchrun, this process's rank: only rank 0's result has the evals (and the export)."""
    note: str | None = None
    """Set when nothing was trained (the run had already finished): the line that says so."""
    tokens_per_s_wall: float | None = None
    """All the tokens this command trained on / its wall time from the first step to the last,
    evals, checkpoints and the tracker included."""


def throughput_text(result: TrainResult) -> str:
    """The run's tokens/s, saying what each figure counts: every row's tokens (padding and
    masked prompt tokens too) over the engine's step time, as the progress line and
    ``metrics.jsonl`` give it; and over the wall time, where evals and checkpoints count too."""
    text = (f"{result.tokens_per_s:,.0f} tokens/s a step (median of the steps' tokens / engine "
            "step time, as in the progress line)")
    if result.tokens_per_s_wall is not None:
        text += (f", {result.tokens_per_s_wall:,.0f} tokens/s over the wall time (evals and "
                 "checkpoints included)")
    return text


def device_mem_reserved(device: str) -> int | None:
    """Peak bytes the CUDA caching allocator reserved (None on CPU)."""
    if device.startswith("cuda") and torch.cuda.is_available():
        return int(torch.cuda.max_memory_reserved(torch.device(device)))
    return None


def step_record(step: int, stats, lr: float, micro: list[Batch], flops: float,
                 predicted_step_s: float | None, device: str, elapsed_s: float,
                 world_size: int = 1) -> dict[str, Any]:
    """The ``metrics.jsonl`` row of a step (before eval and checkpoint add theirs); tokens and
    FLOPs of all ranks (every rank's micro-batches have the same shape)."""
    tokens = sum(mb.input_ids.numel() for mb in micro) * world_size
    secs = max(stats.step_s, 1e-9)
    rec: dict[str, Any] = {
        "step": step, "loss": stats.loss, "lr": lr, "grad_norm": stats.grad_norm,
        "clip_coef": stats.clip_coef, "skipped": stats.skipped, "tokens": tokens,
        "target_tokens": stats.tokens, "tokens_per_s": tokens / secs,
        "tflops": flops / secs / 1e12, "step_s": stats.step_s,
        "predicted_step_s": predicted_step_s, "elapsed_s": elapsed_s}
    mem = device_mem_reserved(device)
    if mem is not None:
        rec["device_mem_reserved_bytes"] = mem
    return rec


PRESET_OFF_BY = 1.5
"""A preset's prediction this far from the measured step (either way) earns the calibrate hint."""


def timing_summary(step_times: list[float], predicted: float | None, plan: Plan,
                   out_dir: str | Path | None = None, model: str | None = None) -> str:
    """The closing line on step time; where a preset's prediction is far off, how to plan a run
    of ``model`` on this machine's own figures (a profile written under ``out_dir``)."""
    measured = statistics.median(step_times[1:]) if len(step_times) > 1 else None
    text = "step time: measured " + (f"{measured:.4g} s (median of {len(step_times) - 1} steps "
                                     "after the first)" if measured else "n/a (under 2 steps)")
    if predicted:
        hw = plan.predicted.get("hardware_source") or plan.predicted.get("hardware")
        text += f", predicted {predicted:.4g} s for plan {plan.source} on {hw}"
        if measured:
            ratio = measured / predicted
            text += f": measured / predicted {ratio:.2f}"
            if (out_dir is not None and model is not None and plan.predicted.get("hardware_preset")
                    and not 1 / PRESET_OFF_BY <= ratio <= PRESET_OFF_BY):
                profile = Path(out_dir) / "profile.json"
                text += (f"; a preset is not this machine: `layerwise calibrate --model {model} --out {profile}` "
                         f"measures it, and `profile={profile}` plans a run on that")
    return text
