"""What one micro-batch is: token ids, already-shifted labels and, for packed rows, which
example each position holds (the engine's input contract); ``Batch.from_hf`` builds one from
labels as Hugging Face takes them (unshifted)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100
"""Label of a position that carries no loss (as in Hugging Face)."""


@dataclass
class Batch:
    input_ids: torch.Tensor
    """``[batch, seq]`` token ids."""
    labels: torch.Tensor
    """``[batch, seq]``: the target of each position (already shifted), IGNORE_INDEX for none."""
    segment_ids: torch.Tensor | None = None
    """``[batch, seq]``: the example each position belongs to (numbered within the row or
    across rows, any integers), -1 for padding; None: one example a row. The engine restarts
    positions at each example and keeps attention inside it (``models/attention.py``)."""

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())

    def rows(self, sl: slice) -> Batch:
        """The micro-batch of rows ``sl`` (contiguous copies)."""
        seg = None if self.segment_ids is None else self.segment_ids[sl].contiguous()
        return Batch(self.input_ids[sl].contiguous(), self.labels[sl].contiguous(), seg)

    @classmethod
    def from_hf(cls, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Batch:
        """A micro-batch from ``input_ids`` and labels as ``model(input_ids, labels=labels)`` takes
        them (default: the ids; position t predicts ``labels[t + 1]``), so the engine's loss is
        HF's."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        labels = input_ids if labels is None else labels
        if labels.shape != input_ids.shape:
            raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids "
                             f"{tuple(input_ids.shape)} (unshifted, as Hugging Face takes them)")
        shifted = torch.full_like(labels, IGNORE_INDEX)
        shifted[:, :-1] = labels[:, 1:]
        return cls(input_ids, shifted)
