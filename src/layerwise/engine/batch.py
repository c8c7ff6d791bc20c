"""What one micro-batch is: token ids and already-shifted labels (the engine's input contract)."""

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

    @property
    def num_target_tokens(self) -> int:
        return int((self.labels != IGNORE_INDEX).sum())
