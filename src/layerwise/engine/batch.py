"""What one micro-batch is: token ids, already-shifted labels and, for packed rows, which
example each position holds (the engine's input contract)."""

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
