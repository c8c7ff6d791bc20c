"""PEFT adapter directories in and out (PEFT itself not needed), and the merged model
(``B A * alpha / r`` added to each adapted weight) as an HF directory, a group at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ...adapters.lora_adapter import LoraAdapter
from ...adapters.lora_store import LoraStore
from ...ckpt.provider import PARAM
from ...ckpt.store_provider import PASSTHROUGH
from ...models.names import group_of
from ...util.atomic import fsync_dir
from ..hf.model_dir import HFModelDirSource
from ..recipes.merge import merge

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."


def adapter_config(adapter: LoraAdapter, base_model: str | None) -> dict[str, Any]:
    """``adapter_config.json`` of ``adapter``'s LoRA (r, alpha, targets) on ``base_model``. A
    model with linears outside its layers that the target names would also match (a multimodal
    model's vision tower) gets a regex PEFT matches against the full module names."""
    lora, target_names = adapter.lora, adapter.target_names
    targets: list[str] | str = sorted({n.rsplit(".", 1)[-1] for n in target_names})
    if adapter.passthrough_names:
        layers_path = f"{adapter.layout.base}.{adapter.layout.layers}"  # model.language_model.layers
        names = "|".join(re.escape(n) for n in sorted(set(target_names)))
        targets = rf"{re.escape(layers_path)}\.\d+\.(?:{names})"
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.r, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout,
        "target_modules": targets,
        "bias": "none", "fan_in_fan_out": False, "init_lora_weights": True,
        "inference_mode": True, "modules_to_save": None, "use_rslora": False, "use_dora": False,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {},
        "alpha_pattern": {}, "revision": None,
    }


def write_adapter(store: LoraStore, out_dir: str | Path, base_model: str | None = None,
                  overwrite: bool = False) -> Path:
    """Write the store's adapters as a PEFT adapter directory, atomically. Call
    ``engine.synchronize()`` first."""
    return write_adapter_tensors(store.adapter_tensors(), adapter_config(store.adapter, base_model),
                                 out_dir, overwrite)


def write_adapter_tensors(tensors: dict[str, torch.Tensor], config: dict[str, Any],
                          out_dir: str | Path, overwrite: bool = False) -> Path:
    """Adapter tensors by layerwise name and their ``adapter_config.json`` as a PEFT adapter
    directory, atomically."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} exists; pass overwrite=True to replace it")
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    try:
        save_file({PEFT_PREFIX + n: t.detach().clone().contiguous() for n, t in tensors.items()},
                  str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        for f in tmp.iterdir():
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def read_adapter(path: str | Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter tensors by layerwise name) of a PEFT LoRA directory."""
    path = Path(path)
    cfg_file, weights = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not cfg_file.is_file() or not weights.is_file():
        raise ValueError(f"{path} is not a PEFT adapter directory: it needs {ADAPTER_CONFIG} and "
                         f"{ADAPTER_WEIGHTS}")
    config = json.loads(cfg_file.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {config.get('peft_type')!r}, only LORA adapters load")
    for key in ("use_dora", "use_rslora"):
        if config.get(key):
            raise ValueError(f"{path}: {key}=true is not supported")
    tensors = {}
    for k, v in load_file(str(weights)).items():
        name = k.removeprefix(PEFT_PREFIX).replace(".default.", ".")
        tensors[name] = v.float()
    return config, tensors


def load_init_adapter(store: LoraStore, path: str | Path) -> None:
    """``lora.init=DIR``: start from an existing adapter; its r and alpha must be the run's."""
    config, tensors = read_adapter(path)
    lora = store.adapter.lora
    if int(config.get("r", -1)) != lora.r or float(config.get("lora_alpha", -1)) != float(lora.alpha):
        raise ValueError(f"{path}: the adapter has r={config.get('r')} lora_alpha="
                         f"{config.get('lora_alpha')}, the run lora.r={lora.r} lora.alpha="
                         f"{lora.alpha:g}; set them to the adapter's")
    store.load_adapters(tensors)


class MergedSource:
    """The store's base with its adapters merged in, as a ``CheckpointSource`` (HF groups).
    ``base_dir``: the base model's directory, which a multimodal model's vision tower and
    projector are read from as they are (the LoRA store does not hold them)."""

    def __init__(self, store: LoraStore, base_dir: str | Path | None = None):
        self.store = store
        tied = store.adapter.tied
        self._groups: dict[str, list[str]] = {}
        for name in store.adapter.hf_names():
            self._groups.setdefault(group_of(name, tied), []).append(name)
        self._base = None
        if store.adapter.passthrough_names:
            if base_dir is None:
                raise ValueError("a multimodal model's merged export needs its base directory "
                                 "(its vision tower is not in the LoRA store)")
            self._base = HFModelDirSource(base_dir)
            self._groups[PASSTHROUGH] = list(store.adapter.passthrough_names)

    def groups(self) -> list[str]:
        return list(self._groups)

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        names = self._groups[group]
        if group == PASSTHROUGH:  # only the base directory's groups that hold them
            wanted = {PARAM + n for n in names}
            groups = {group_of(n, self.store.adapter.tied) for n in names}
            return {k: t for g in self._base.groups() if g in groups
                    for k, t in self._base.load_group(g).items() if k in wanted}
        merged = self.store.merged_tensors(self.store.unit_of(names[0]))
        return {PARAM + n: merged[n] for n in names}

    def model_config(self) -> dict | None:
        return self.store.adapter.model_config.to_dict()

    def extra_state(self) -> dict[str, Any]:
        return {"step": 0, "scheduler": None, "rng": None, "trainer_state": None}


def write_merged(store: LoraStore, out_dir: str | Path, overwrite: bool = False,
                 dtype: str | None = None, base_dir: str | Path | None = None) -> Path:
    """The merged model as a ``from_pretrained``-loadable HF directory, atomically (``base_dir``:
    see :class:`MergedSource`)."""
    merge(MergedSource(store, base_dir), out_dir, "hf", dtype=dtype, overwrite=overwrite)
    return Path(out_dir)
