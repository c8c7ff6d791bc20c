"""Local Hugging Face model directories: read into a HostStore one tensor at a time, write back.

Reading never holds the model twice: each tensor is read from its (memory-mapped) shard and
copied into its place in the store, so peak host memory is the store plus one tensor.
Writing goes to a temp directory renamed into place, so a failed export leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import AutoConfig, PretrainedConfig

from ..store import HostStore
from ..util.atomic import fsync_dir
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


def write_hf_dir(out_dir: str | Path, config: PretrainedConfig,
                 tensors: Iterable[tuple[str, torch.Tensor]],
                 max_shard_bytes: int = 2 * 2**30, dtype: torch.dtype | None = None,
                 overwrite: bool = False) -> Path:
    """Write sharded safetensors + index + config.json that ``from_pretrained`` loads.

    ``tensors`` is consumed lazily; at most one shard is held in memory. The directory appears
    only when complete (written under a temp name, then renamed); with ``overwrite`` an existing
    directory is replaced only after the new one is complete.
    """
    out_dir = Path(out_dir)
    if not overwrite and out_dir.exists() and any(out_dir.iterdir()):
        raise ValueError(f"output directory {out_dir} exists and is not empty; choose a new path")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        files: list[str] = []
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = 0

        def flush() -> None:
            name = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
            files.append(name)
            shard.clear()

        for key, t in tensors:
            t = t.detach().to("cpu", dtype=dtype or t.dtype).contiguous().clone()
            nbytes = t.numel() * t.element_size()
            if shard and shard_bytes + nbytes > max_shard_bytes:
                flush()
                shard_bytes = 0
            shard[key] = t
            shard_bytes += nbytes
        if shard or not files:
            flush()
        total = len(files)
        weight_map, total_bytes = {}, 0
        for k, name in enumerate(files):
            final_name = f"model-{k + 1:05d}-of-{total:05d}.safetensors"
            os.replace(tmp / name, tmp / final_name)
            with safe_open(str(tmp / final_name), framework="pt") as f:
                for key in f.keys():
                    weight_map[key] = final_name
            total_bytes += (tmp / final_name).stat().st_size
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        config.save_pretrained(str(tmp))
        for p in tmp.iterdir():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
        old = None
        if out_dir.exists():
            old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old)
        fsync_dir(out_dir.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def save_store(store: HostStore, out_dir: str | Path, max_shard_bytes: int = 2 * 2**30,
               dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Export the master weights as a ``save_pretrained``-compatible directory."""
    return write_hf_dir(out_dir, store.adapter.config, store.iter_hf_tensors(),
                        max_shard_bytes=max_shard_bytes, dtype=dtype, overwrite=overwrite)
