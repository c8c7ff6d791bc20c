"""Read a local Hugging Face model directory into a HostStore, one tensor at a time.

Reading never holds the model twice: each tensor is read from its (memory-mapped) shard and
copied into its place in the store, so peak host memory is the store plus one tensor.
(Writing a store back as an HF directory is ``layerwise.ckpt.store_state.export_store``.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from ..store import HostStore
from .adapter import DecoderAdapter

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


def load_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory: config.json is missing")
    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def shard_map(path: str | Path) -> dict[str, Path]:
    """HF key -> shard file, checking that every shard the index names exists."""
    path = Path(path)
    if (path / INDEX_NAME).is_file():
        index = json.loads((path / INDEX_NAME).read_text())
        weight_map = index.get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{path / INDEX_NAME} has no weight_map; the index file is damaged")
        missing = sorted({f for f in weight_map.values() if not (path / f).is_file()})
        if missing:
            raise ValueError(
                f"{path}: shard files named in {INDEX_NAME} are missing: {missing}; "
                "copy the complete model directory"
            )
        return {k: path / f for k, f in weight_map.items()}
    if (path / SINGLE_NAME).is_file():
        with _open(path / SINGLE_NAME) as f:
            return {k: path / SINGLE_NAME for k in f.keys()}
    raise ValueError(
        f"{path} has no {SINGLE_NAME} or {INDEX_NAME}; layerwise reads safetensors weights "
        "(convert .bin checkpoints with save_pretrained(safe_serialization=True))"
    )


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); it is probably "
                         "truncated or corrupt: copy it again") from None


def load_store(path: str | Path, compute_dtype: torch.dtype = torch.float32,
               pin: bool | None = None) -> tuple[DecoderAdapter, HostStore]:
    """Build the adapter from ``config.json`` and fill a HostStore from the shards."""
    path = Path(path)
    adapter = DecoderAdapter(load_config(path))
    files = shard_map(path)
    needed = adapter.hf_names()
    missing = [k for k in needed if k not in files]
    if missing:
        raise ValueError(f"{path}: weights missing for {len(missing)} tensors, e.g. {missing[:3]}; "
                         "the checkpoint does not match its config.json")
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin)
    handles: dict[Path, object] = {}
    try:
        for key in needed:
            file = files[key]
            if file not in handles:
                handles[file] = _open(file).__enter__()
            try:
                tensor = handles[file].get_tensor(key)
            except SafetensorError as e:
                raise ValueError(f"{file}: cannot read {key} ({e}); the shard is damaged") from None
            store.load_hf_tensor(key, tensor)
            del tensor
    finally:
        for h in handles.values():
            h.__exit__(None, None, None)
    store.refresh_compute()
    return adapter, store
