"""Read a local Hugging Face model dir: weights one group (or one tensor) at a time, from
memory-mapped shards, so peak host memory is the store plus one group."""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, PretrainedConfig

from ...models.adapter import DecoderAdapter
from ...models.names import config_is_tied, group_of, group_sort_key, is_head_name
from ...state_tier import NvmeStateTier
from ...store import PRIVATE, HostAllocator, HostStore
from ...util.safe_load import load_data_file
from ..layout import (
    CONFIG_NAME,
    GENERATION_CONFIG_NAME,
    PARAM,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    meta_model,
)
from .hub_layout import HubLayout
from .quantized import QUANT_KEY, dequantizer, quant_method, refusal


def read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _open_safetensors(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except SafetensorError as e:
        raise ValueError(f"{file} is not a readable safetensors file ({e}); it is probably "
                         "truncated or corrupt: copy it again") from None


def load_pt(path: Path) -> Any:
    """A foreign ``.pt``/``.bin`` file as data (``util.safe_load``), memory-mapped where it allows."""
    return load_data_file(path, mmap=True)


class HFModelDirSource:
    """Weights of a Hugging Face model dir (single or sharded safetensors, or ``pytorch_model.bin``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a directory")
        self._weight_files = self._find_weight_files()

    def _find_weight_files(self) -> dict[str, Path]:
        """Map every tensor name to the file that holds it, checking that every shard exists."""
        p = self.path
        for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
            if (p / index_name).is_file():
                weight_map = read_json(p / index_name).get("weight_map")
                if not isinstance(weight_map, dict):
                    raise ValueError(f"{p / index_name} has no weight_map; the index file is damaged")
                missing = sorted({f for f in weight_map.values() if not (p / f).is_file()})
                if missing:
                    raise ValueError(f"{p}: shard files named in {index_name} are missing: {missing}; "
                                     "copy the complete model directory")
                return {name: p / file for name, file in weight_map.items()}
        if (p / SAFE_WEIGHTS_NAME).is_file():
            with _open_safetensors(p / SAFE_WEIGHTS_NAME) as f:
                return {name: p / SAFE_WEIGHTS_NAME for name in f.keys()}
        if (p / WEIGHTS_NAME).is_file():
            return {name: p / WEIGHTS_NAME for name in self._bin(p / WEIGHTS_NAME)}
        raise FileNotFoundError(
            f"{p} holds no model weights: expected {SAFE_WEIGHTS_NAME}, {SAFE_WEIGHTS_INDEX_NAME}, "
            f"{WEIGHTS_NAME} or {WEIGHTS_INDEX_NAME}"
        )

    def _bin(self, path: Path) -> dict[str, torch.Tensor]:
        # Memory-mapped, so holding the dict costs address space, not RAM.
        cache = self.__dict__.setdefault("_bin_cache", {})
        if path not in cache:
            cache[path] = load_pt(path)
        return cache[path]

    @cached_property
    def config(self) -> dict | None:
        f = self.path / CONFIG_NAME
        return read_json(f) if f.is_file() else None

    @cached_property
    def _quantizer(self) -> Any | None:
        """transformers' quantizer reading this release dequantized (None: plain weights);
        ValueError for a quantization layerwise does not read (``quantized.py``)."""
        return dequantizer(self.config, self.path)

    @cached_property
    def _layout(self) -> HubLayout | None:
        """transformers' conversion between the files' names and the model's (None: a config
        transformers cannot build, whose names are taken as they are)."""
        quantizer = self._quantizer
        if self.config is None:
            return None
        try:
            model = meta_model(self.config)
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            if quantizer is not None:  # nothing to dequantize into
                raise refusal(self.path, quant_method(self.config),
                              f"transformers cannot build its model ({e})") from None
            return None
        if quantizer is not None:  # the quantizer's own errors are the user's to see
            return HubLayout(model, quantizer)
        try:
            return HubLayout(model)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None

    @cached_property
    def _model_names(self) -> dict[str, list[str]]:
        """File key → the model's (in-memory) names it contributes to."""
        layout = self._layout
        names = {k: layout.model_names(k) if layout else [k] for k in self._weight_files}
        self._refuse_unread_scales(names)
        return names

    def _refuse_unread_scales(self, names: dict[str, list[str]]) -> None:
        """Scales or packed blocks that no model tensor takes mean the weights beside them would
        load without them: refuse rather than train wrong weights."""
        model_keys = self._layout._model_keys if self._layout else {}
        unread = sorted(k for k, ns in names.items()
                        if QUANT_KEY.search(k) and not any(n in model_keys for n in ns))
        if unread:
            method = quant_method(self.config)
            said = f"its quant_method {method!r}" if method else "config.json has no quantization_config"
            raise ValueError(
                f"{self.path}: {len(unread)} tensors hold quantization scales or packed blocks that "
                f"nothing reads ({said}), e.g. {unread[:3]}; the weights would load without their "
                "scales: give the release's own config.json or a dequantized copy of the model")

    @cached_property
    def _groups(self) -> dict[str, list[str]]:
        """Group → the file keys it is read from (groups by the model's names)."""
        tied = config_is_tied(self.config)
        out: dict[str, list[str]] = {}
        for key, names in self._model_names.items():
            if tied and is_head_name(names[0]) and names[0].endswith(".weight"):
                continue  # a tied head is the embedding; some writers still store a copy
            out.setdefault(group_of(names[0], tied), []).append(key)
        return dict(sorted(out.items(), key=lambda kv: group_sort_key(kv[0])))

    def groups(self) -> list[str]:
        return list(self._groups)

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        """The group's tensors under the model's names (per-expert files fused, renamed keys
        mapped, as ``from_pretrained`` of the installed transformers does)."""
        if group not in self._groups:
            raise ValueError(f"{self.path} has no group {group!r}; it has {self.groups()}")
        keys = self._groups[group]
        raw = self._read_weights(keys)
        tensors = self._layout.to_model(keys, raw.pop) if self._layout else raw
        self._refuse_packed(tensors)
        return {PARAM + n: t for n, t in tensors.items()}

    def _refuse_packed(self, tensors: dict[str, torch.Tensor]) -> None:
        """A float parameter read as 8-bit or integer codes is a quantized weight no op turned
        back into numbers (a release without its ``quantization_config``): refuse it."""
        model_keys = self._layout._model_keys if self._layout else None
        for name, t in tensors.items():
            if model_keys is None:  # names unknown: only a float8 tensor is surely packed
                packed = t.is_floating_point() and t.element_size() == 1
            else:  # a float parameter of the model read as 8-bit or integer codes
                packed = (name in model_keys and model_keys[name].is_floating_point()
                          and (t.element_size() == 1 or not t.is_floating_point()))
            if packed:
                raise ValueError(
                    f"{self.path}: {name} is stored as {str(t.dtype).removeprefix('torch.')}, a "
                    "quantized weight that config.json's quantization_config does not describe; "
                    "give the release's own config.json or a dequantized copy of the model")

    def _read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._weight_files[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            if file.suffix == ".safetensors":
                with _open_safetensors(file) as f:
                    for n in file_names:
                        try:
                            out[n] = f.get_tensor(n)
                        except SafetensorError as e:
                            raise ValueError(f"{file}: cannot read {n} ({e}); the shard is damaged") from None
            else:
                sd = self._bin(file)
                for n in file_names:
                    out[n] = sd[n].clone()
        return out

    def packed_names(self) -> set[str]:
        """The model's names of the tensors a quantized release stores packed (read with scales
        or as packed blocks), the rest being plain."""
        return {n for k, names in self._model_names.items() if QUANT_KEY.search(k) for n in names}

    def hf_names(self) -> list[str]:
        """The model's names of every tensor the files hold (not the files' own keys)."""
        return list(dict.fromkeys(n for names in self._model_names.values() for n in names))

    def model_config(self) -> dict | None:
        return self.config

    def extra_state(self) -> dict:
        extra: dict[str, Any] = {"step": 0, "scheduler": None, "rng": None, "trainer_state": None}
        gen = self.path / GENERATION_CONFIG_NAME
        if gen.is_file():
            extra["generation_config"] = read_json(gen)
        return extra




def load_config(path: str | Path) -> PretrainedConfig:
    path = Path(path)
    if not (path / CONFIG_NAME).is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory: {CONFIG_NAME} is missing")
    _refuse_remote_code(path)
    return AutoConfig.from_pretrained(str(path), local_files_only=True, trust_remote_code=False)


def _refuse_remote_code(path: Path) -> None:
    """A model only the checkpoint's own code defines (``auto_map``, an unknown ``model_type``):
    refused in one line, as ``from_pretrained`` would without ``trust_remote_code``."""
    from transformers import __version__
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    raw = read_json(path / CONFIG_NAME)
    model_type = raw.get("model_type")
    if raw.get("auto_map") and model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"{path}: model_type {model_type!r} is defined only by the checkpoint's own code "
            f"(config.json's auto_map), which layerwise does not run: it trains the models "
            f"transformers defines ({__version__} has no {model_type!r}); use a transformers "
            "release that has it, or a conversion of the checkpoint to a family it has")


def load_store(path: str | Path, compute_dtype: torch.dtype = torch.float32,
               pin: bool | None = None, alloc: HostAllocator = PRIVATE,
               config: PretrainedConfig | None = None,
               grad_dtype: torch.dtype = torch.float32,
               **tiers: NvmeStateTier) -> tuple[DecoderAdapter, HostStore]:
    """Build the adapter from ``config.json`` (or ``config``, that file's config as the caller
    adjusted it, e.g. its RoPE scaling) and fill a HostStore, one group at a time
    (``grad_dtype``, ``tiers``: the store's, see ``HostStore``)."""
    path = Path(path)
    adapter = DecoderAdapter(config if config is not None else load_config(path))
    source = HFModelDirSource(path)
    check_weights(source, [*adapter.hf_names(), *adapter.passthrough_names])
    store = HostStore(adapter, compute_dtype=compute_dtype, pin=pin, alloc=alloc,
                      grad_dtype=grad_dtype, **tiers)
    fill_store(source, store)
    return adapter, store


def check_weights(source: HFModelDirSource, needed: Iterable[str]) -> None:
    """Refuse a directory that lacks any of the model's tensors ``needed``, before allocating."""
    missing = sorted(set(needed) - set(source.hf_names()))
    if missing:
        raise ValueError(f"{source.path}: weights missing for {len(missing)} tensors, e.g. "
                         f"{missing[:3]}; the checkpoint does not match its config.json")


def fill_store(source: HFModelDirSource, store: Any) -> None:
    """Load every tensor ``store`` holds (``store.adapter.hf_names()``) from ``source``, one
    group at a time (a HostStore, or a LoRA run's store, which quantises its base on the way)."""
    needed = set(store.adapter.hf_names())
    if hasattr(store, "passthrough"):  # a HostStore keeps what it does not train (vision)
        needed |= set(store.adapter.passthrough_names)
    for group in source.groups():
        for key, tensor in source.load_group(group).items():
            if key[len(PARAM):] in needed:  # not e.g. a stored copy of a tied head
                store.load_hf_tensor(key[len(PARAM):], tensor)  # the copy source with it
