"""What a run needs to continue besides weights and optimizer state: one typed, versioned
record, saved as each step's ``trainer_state``. RNGs are saved by the checkpointer, and dropout
masks are seeded from the step, so they need nothing here."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from ..ckpt import LoadResult

TRAIN_STATE_FORMAT = "layerwise-train-state"
TRAIN_STATE_VERSION = 1
"""``trainer_state``'s format (docs/formats.md); another version is refused."""


@dataclass
class TrainState:
    step: int = 0
    """Optimizer steps done."""
    data_position: int | None = 0
    """Global micro-batches consumed (None: another loop's checkpoint, which counts steps)."""
    rows_per_micro_batch: int | None = None
    """Rows of one global micro-batch (all ranks), so a resume at another world size or
    micro-batch size converts ``data_position`` through rows."""
    data_key: str | None = None
    """The key of the data trained on (a resume on other data warns)."""
    schedule: dict | None = None
    """The LR schedule the run started with (a resumed or extended run keeps it)."""
    eval_loss_start: float | None = None
    """The run's first eval (None: not measured yet)."""
    eval_loss_start_step: int = 0
    metrics_row: dict | None = None
    """The step's ``metrics.jsonl`` row, put back on resume when the kill came before it was
    logged."""

    def to_json(self) -> dict[str, Any]:
        return {"format": TRAIN_STATE_FORMAT, "format_version": TRAIN_STATE_VERSION,
                **asdict(self)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> TrainState:
        version = d.get("format_version")
        if version != TRAIN_STATE_VERSION:
            raise ValueError(f"the checkpoint's train state is format_version {version}; this "
                             f"layerwise reads {TRAIN_STATE_VERSION}: start the run again or use a "
                             "layerwise that wrote it")
        return cls(**{f.name: d[f.name] for f in fields(cls) if f.name in d})

    @classmethod
    def from_checkpoint(cls, loaded: LoadResult) -> TrainState:
        """The state of a loaded step: ``layerwise train``'s own, or another loop's (its step and
        data position alone)."""
        own = loaded.trainer_state
        if isinstance(own, dict) and own.get("format") == TRAIN_STATE_FORMAT:
            return replace(cls.from_json(own), step=loaded.step)  # the manifest's step wins
        position = loaded.data_position
        return cls(step=loaded.step, data_position=None if position is None else int(position))

    def at(self, step: int, data_position: int, metrics_row: dict) -> TrainState:
        """This state as a save at ``step`` records it."""
        return replace(self, step=step, data_position=data_position, metrics_row=dict(metrics_row))
