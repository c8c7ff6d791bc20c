"""Plain JSON values from training state: checkpoints store state as JSON, never pickles."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


def jsonable(v: Any) -> Any:
    """``v`` as plain JSON types (tensors -> numbers/lists); raises ValueError otherwise."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [jsonable(x) for x in v]
    if isinstance(v, dict):
        return {str(k): jsonable(x) for k, x in v.items()}
    if isinstance(v, np.integer):
        return int(v)
    if isinstance(v, np.floating):
        return float(v)
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    raise ValueError(
        f"cannot store a {type(v).__name__} in checkpoint JSON state; checkpoints never pickle. "
        "Keep scheduler state and `extra` to numbers, strings, lists and dicts."
    )
