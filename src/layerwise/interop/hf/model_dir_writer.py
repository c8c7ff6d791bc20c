"""Export to a Hugging Face model dir: sharded safetensors + index + ``config.json``, with the
names and layout ``save_pretrained`` writes; a tied head is stored once, as the embedding."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, GenerationConfig

from ...models.names import config_is_tied, is_head_name
from ...util.atomic import atomic_write_text
from ...util.safetensors_io import ShardedSafetensorsWriter
from ...util.units import parse_size_bytes
from ..layout import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    PARAM,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    CheckpointSource,
    meta_model,
)
from .hub_layout import HubLayout

SHARD_PATTERN = "model-{:05d}-of-{:05d}.safetensors"
DEFAULT_MAX_SHARD_SIZE = "5GB"

class WeightsWriter:
    """Stream each group's ``param/…`` tensors into HF-named shards, checked by name and shape, so a
    merge of mismatched sources fails clearly instead of writing a model that will not load."""

    def __init__(self, out_dir: Path, config: dict, max_shard_bytes: int | None,
                 dtype: torch.dtype | None = None):
        self.out_dir = Path(out_dir)
        self.tied = config_is_tied(config)
        self.dtype = dtype
        self.expected: dict[str, tuple[int, ...]] | None = None
        self.layout: HubLayout | None = None
        try:
            model = meta_model(config)
        except (ValueError, KeyError):
            model = None  # an architecture transformers does not know: no name check possible
        if model is not None:
            # every tensor HF saves: parameters and persistent buffers (DeepSeek-V3's
            # expert-selection bias), which from_pretrained reads back alike
            self.expected = {n: tuple(t.shape) for n, t in model.state_dict().items()}
            self.layout = HubLayout(model)
        self.written: set[str] = set()
        self._writer = ShardedSafetensorsWriter(self.out_dir, max_shard_bytes)

    def write_all(self, source: CheckpointSource, each: Callable[[str, dict], None] | None = None
                  ) -> dict[str, Any]:
        """Every group of ``source`` (``each(group, tensors)`` after each), then :meth:`finish`;
        the shards are removed on any error."""
        try:
            for group in source.groups():
                tensors = source.load_group(group)
                self.add_group(group, tensors)
                if each is not None:
                    each(group, tensors)
                del tensors
            return self.finish()
        except BaseException:
            self._writer.abort()
            raise

    def add_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        """Check the group's ``param/…`` tensors (the model's names) and write them in the
        layout ``save_pretrained`` writes (``HubLayout.to_hub``: per-expert tensors and all)."""
        named: dict[str, torch.Tensor] = {}
        for key, t in tensors.items():
            if not key.startswith(PARAM):
                continue
            name = key[len(PARAM):]
            if self.tied and is_head_name(name) and name.endswith(".weight"):
                continue  # tied: the embedding is the head
            if name in self.written:
                raise ValueError(f"parameter {name} appears in more than one group (again in {group!r})")
            if self.expected is not None:
                if name not in self.expected:
                    raise ValueError(
                        f"group {group!r} has parameter {name}, which the model in config.json does not "
                        "have; the checkpoint and its config.json do not match"
                    )
                if tuple(t.shape) != self.expected[name]:
                    raise ValueError(
                        f"parameter {name} (group {group!r}) has shape {tuple(t.shape)} but the model in "
                        f"config.json expects {self.expected[name]}; the sources do not share one architecture"
                    )
            if self.dtype is not None and t.is_floating_point():
                t = t.to(self.dtype)
            named[name] = t
            self.written.add(name)
        for name, t in (self.layout.to_hub(named) if self.layout else named).items():
            self._writer.add(name, t.contiguous())

    def finish(self) -> dict[str, Any]:
        """Close the shards, write the index when there is more than one; return a summary."""
        if self.expected is not None:
            missing = sorted(n for n in set(self.expected) - self.written
                             if not (self.tied and is_head_name(n) and n.endswith(".weight")))
            if missing:
                raise ValueError(
                    f"the source lacks {len(missing)} parameter(s) of the model, e.g. {missing[:3]}; "
                    "a complete checkpoint (or recipe) must supply every group"
                )
        if not self.written:
            raise ValueError("the source has no weights to export")
        weight_map = self._writer.finish(SAFE_WEIGHTS_NAME, SHARD_PATTERN)
        files = sorted(set(weight_map.values()))
        if len(files) > 1:
            index = {"metadata": {"total_size": self._writer.total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
            atomic_write_text(self.out_dir / SAFE_WEIGHTS_INDEX_NAME, json.dumps(index, indent=2) + "\n")
        return {"weight_files": files, "num_tensors": len(weight_map), "weight_bytes": self._writer.total_bytes}


def export_config(config: dict, dtype: torch.dtype | None) -> dict:
    """``config.json`` contents for the output: the source's, with the dtype the weights are in
    and without a ``quantization_config`` (a quantized release is read dequantized, so what is
    written is plain weights, which ``from_pretrained`` must not try to unpack)."""
    out = dict(config)
    out.pop("quantization_config", None)
    if dtype is not None:
        name = str(dtype).removeprefix("torch.")
        out["dtype"] = name
        if "torch_dtype" in out:
            out["torch_dtype"] = name
    return out


def write_config_files(out_dir: Path, config: dict, dtype: torch.dtype | None, generation_config: dict | None) -> None:
    """``config.json`` and ``generation_config.json`` (the source's, else derived from the model
    config the way ``save_pretrained`` derives it)."""
    atomic_write_text(out_dir / CONFIG_NAME, json.dumps(export_config(config, dtype), indent=2, sort_keys=True) + "\n")
    if generation_config is None:
        generation_config = _derived_generation_config(config)
    if generation_config:
        atomic_write_text(out_dir / GENERATION_CONFIG_NAME, json.dumps(generation_config, indent=2, sort_keys=True) + "\n")


def _derived_generation_config(config: dict) -> dict | None:
    cfg = dict(config)
    try:
        hf_config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    except (KeyError, ValueError):
        return None
    return GenerationConfig.from_model_config(hf_config).to_diff_dict()


def require_config(source: CheckpointSource) -> dict:
    config = source.model_config()
    if config is None:
        raise ValueError(
            "the source has no model config (config.json), which an exported model needs; save the "
            "run with its model config or merge from a source that has one"
        )
    return config


def write_hf(source: CheckpointSource, out_dir: Path, config: dict, dtype: torch.dtype | None, *,
             max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE) -> dict[str, Any]:
    """The weights of ``source`` as an HF model dir in the empty ``out_dir``; a summary."""
    return WeightsWriter(Path(out_dir), config, parse_size_bytes(max_shard_size), dtype).write_all(source)
