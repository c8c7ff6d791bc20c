"""layerwise: train LLMs bigger than the GPU by streaming layers; checkpoint only what changed.

User-facing names, imported on first use so ``import layerwise`` stays free of torch
(``tests/test_public_api.py`` fails when a name disappears)."""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # a model directory in and out
    "load_store": "layerwise.interop.hf.model_dir",
    "export_store": "layerwise.interop.recipes.store_export",
    # the streaming engine
    "StreamingEngine": "layerwise.engine",
    "EngineConfig": "layerwise.engine",
    "Batch": "layerwise.engine.batch",
    "Plan": "layerwise.plan",
    # layer-wise checkpoints in any loop, and the other tools' loops
    "Checkpointer": "layerwise.ckpt",
    "ShardedCheckpointer": "layerwise.ckpt.sharded_checkpointer",
    "LayerwiseCheckpointCallback": "layerwise.interop.hooks.trainer_callback",
    "DeepSpeedCheckpointer": "layerwise.interop.hooks.deepspeed_loop",
    "fsdp_checkpointer": "layerwise.interop.hooks.fsdp2_loop",
    "merge": "layerwise.interop.recipes.merge",
    "import_checkpoints": "layerwise.interop.recipes.import_checkpoints",
    # `layerwise train` from Python
    "train": "layerwise.train.loop",
    "TrainConfig": "layerwise.train.config",
    # the 8-bit AdamW as a torch optimizer
    "AdamW8bit": "layerwise.optim.adamw8bit",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'layerwise' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
