"""The one way layerwise reads a ``torch.save`` file: as data, never as code.

Unpickling may call any function, so everything goes through ``torch.load(weights_only=True)``
plus an explicit allowlist (``ALLOWED_GLOBALS``); anything else is refused naming the class,
before it is called. ``training_args.bin`` is not read."""

from __future__ import annotations

import contextlib
import mmap as mmap_module
import pickle
import re
from pathlib import Path
from typing import Any, BinaryIO, Sequence

import numpy as np
import torch

ALLOWED_GLOBALS: list = [
    np.core.multiarray._reconstruct if not hasattr(np, "_core") else np._core.multiarray._reconstruct,
    np.ndarray,
    np.dtype,
    type(np.dtype(np.uint32)),
]
"""Beyond what ``weights_only`` allows by default: numpy's array rebuild, array and dtype classes
(the Trainer's ``rng_state.pth`` holds ``np.random.get_state()``; the same list as
``transformers.trainer_pt_utils.safe_globals``)."""


def load_data_file(path: str | Path | BinaryIO, *, mmap: bool = False, writable: bool = False,
                   allow: Sequence = ()) -> Any:
    """``torch.load`` onto the CPU, ``weights_only`` with ``ALLOWED_GLOBALS`` (+ ``allow`` pairs).
    ``mmap``: map tensors where the file allows; ``writable``: map shared. Raises ``ValueError``
    naming a class outside the allowlist."""
    if writable and not mmap:
        raise ValueError("writable=True needs mmap=True: only a shared mapping writes to the file")
    # Only a writable load changes the mapping mode (the default path works on any torch >= 2.4).
    shared = (torch.serialization.set_default_mmap_options(mmap_module.MAP_SHARED) if writable
              else contextlib.nullcontext())
    try:
        with torch.serialization.safe_globals([*ALLOWED_GLOBALS, *allow]), shared:
            try:
                return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
            except RuntimeError as e:
                if not mmap or writable or "mmap" not in str(e):
                    raise  # a writable load read into memory would drop every write
                return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL ([\w.]+)", str(e))
        what = found.group(1) if found else "an object that is not plain data"
        raise ValueError(
            f"{path} needs {what} to load, which layerwise does not allow: loading it could run "
            "code the file names. layerwise reads only tensors, containers, numbers and numpy "
            "RNG state from .pt/.pth/.bin files. If you trust the file, load it yourself and "
            "save the plain state (e.g. torch.save(obj.state_dict(), ...)); for weights, use "
            "safetensors (model.safetensors)."
        ) from None
