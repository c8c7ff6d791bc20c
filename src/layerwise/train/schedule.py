"""Learning-rate schedules: linear warmup, then cosine or linear decay to a floor, or constant.

Fixed when the run starts and kept in its checkpoints, so extending ``steps`` later does not
redraw the curve (``schedule.total_steps`` asks for another span)."""

from __future__ import annotations

import math
from dataclasses import dataclass

SCHEDULES = ("cosine", "linear", "constant")


def lr_at(step: int, peak_lr: float, warmup_steps: int, total_steps: int,
          min_lr_ratio: float = 0.1, kind: str = "cosine") -> float:
    """LR for optimizer step ``step`` (0-based)."""
    if warmup_steps > 0 and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return peak_lr
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    floor = peak_lr * min_lr_ratio
    if kind == "linear":
        return peak_lr - (peak_lr - floor) * progress
    if kind != "cosine":
        raise ValueError(f"schedule {kind!r}: use one of {', '.join(SCHEDULES)}")
    return floor + (peak_lr - floor) * 0.5 * (1 + math.cos(math.pi * progress))


@dataclass(frozen=True)
class Schedule:
    kind: str
    peak_lr: float
    total_steps: int
    """Steps the decay spans."""
    warmup_steps: int
    min_lr_ratio: float

    @classmethod
    def resolve(cls, kind: str, peak_lr: float, total_steps: int, warmup_steps: int,
                warmup_ratio: float | None, min_lr_ratio: float) -> Schedule:
        """A schedule over ``total_steps``; ``warmup_ratio`` (when set) of them warm up."""
        if warmup_ratio is not None:
            warmup_steps = math.ceil(warmup_ratio * total_steps)
        return cls(kind, peak_lr, total_steps, warmup_steps, min_lr_ratio)

    def lr(self, step: int) -> float:
        return lr_at(step, self.peak_lr, self.warmup_steps, self.total_steps, self.min_lr_ratio,
                     self.kind)

    def to_json(self) -> dict:
        return {"kind": self.kind, "total_steps": self.total_steps,
                "warmup_steps": self.warmup_steps, "min_lr_ratio": self.min_lr_ratio}
