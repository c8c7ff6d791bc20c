"""Export the engine's HostStore as a Hugging Face model directory (through ``merge``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ...ckpt.provider import PARAM
from ...ckpt.store_provider import HostStoreStateProvider
from ...store import HostStore
from .merge import merge


class StoreSource:
    """The store's current weights as a ``CheckpointSource`` (for export through ``merge``)."""

    def __init__(self, store: HostStore, step: int = 0):
        self.provider = HostStoreStateProvider(store)
        self.step = step

    def groups(self) -> list[str]:
        return list(self.provider.group_names())

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        return {PARAM + n: t for n, t in self.provider.params(group).items()}

    def model_config(self) -> dict | None:
        return self.provider.model_config()

    def extra_state(self) -> dict[str, Any]:
        return {"step": self.step, "scheduler": None, "rng": None, "trainer_state": None}


def export_store(store: HostStore, out_dir: str | Path, *, overwrite: bool = False,
                 max_shard_size: int | str = "5GB", dtype: str | None = None,
                 tokenizer: str | Path | None = None) -> Path:
    """Write the master weights as a ``from_pretrained``-loadable directory, atomically, one group
    at a time. Call ``engine.synchronize()`` first."""
    merge(StoreSource(store), out_dir, "hf", max_shard_size=max_shard_size, dtype=dtype,
          overwrite=overwrite, tokenizer=tokenizer)
    return Path(out_dir)
