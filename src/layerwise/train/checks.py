"""Checks of a run against the machine and the model, before any work: each refusal is one
``ValueError`` line that says what to do. layerwise never downloads: a hub id not in the local
cache is refused with the way to fetch it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import torch
from huggingface_hub import snapshot_download

from ..models import FLAVORS, get_flavor
from .config import TrainConfig

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
CUDA_WHEELS = "https://download.pytorch.org/whl/cu124"


def check_device(device: str) -> None:
    if device in ("cpu", "cpu-async"):
        return
    if not device.startswith("cuda"):
        raise ValueError(f"device={device}: use cpu or cuda[:N]")
    if torch.version.cuda is None:
        raise ValueError(
            f"device={device}, but this torch ({torch.__version__}) is a CPU-only build; install "
            f"a CUDA build (e.g. `pip install --force-reinstall torch --index-url {CUDA_WHEELS}`, "
            "the line for your CUDA at pytorch.org/get-started), or train with device=cpu")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device}, but no CUDA device is visible (CUDA_VISIBLE_DEVICES, "
                         "the driver: `nvidia-smi`); or train with device=cpu")
    index = torch.device(device).index or 0
    if index >= torch.cuda.device_count():
        raise ValueError(f"device={device}, but only {torch.cuda.device_count()} CUDA device(s) "
                         f"are visible (cuda:0..cuda:{torch.cuda.device_count() - 1})")


def _from_hf_cache(repo_id: str) -> str | None:
    """The local snapshot directory of ``repo_id`` in the Hugging Face cache, or None."""
    try:
        path = snapshot_download(repo_id, local_files_only=True)
    except Exception:  # noqa: BLE001  (not cached: the hub raises several kinds)
        return None
    return path if (Path(path) / "config.json").is_file() else None


def resolve_model(name: str) -> tuple[str, str | None]:
    """A flavor name, or a local model directory, for ``model=name``; and a line to say where
    it came from (None when it is what was given)."""
    if name in FLAVORS or Path(name).is_dir():
        return name, None
    if HUB_ID.match(name) and not Path(name).exists():
        cached = _from_hf_cache(name)
        if cached is not None:
            return cached, f"model {name}: from the local Hugging Face cache, {cached}"
        local = f"models/{name.split('/')[-1]}"
        raise ValueError(
            f"model={name} is a Hugging Face Hub id, and layerwise never downloads: fetch it "
            f"once with `hf download {name} --local-dir {local}` (or `huggingface-cli download "
            f"...`), then pass model={local}; once it is in the local Hugging Face cache, "
            f"model={name} works as it is (with HF_HUB_OFFLINE=1 to keep everything offline)")
    raise ValueError(f"model={name} is neither a known flavor ({', '.join(sorted(FLAVORS))}) nor "
                     "a local Hugging Face model directory"
                     + ("" if Path(name).exists() else f" (no such path: {name})"))


def _scaling(rope: object) -> dict | None:
    """A RoPE parameters dict that scales positions (None for plain RoPE)."""
    if not isinstance(rope, dict):
        return None
    kind = rope.get("rope_type", rope.get("type", "default"))
    return None if kind == "default" else rope


def context_length(model: str) -> tuple[int | None, dict | None]:
    """``max_position_embeddings`` and the RoPE scaling (None: none) of a flavor or a model
    directory (transformers 5 calls it ``rope_parameters``, 4.x ``rope_scaling``)."""
    if model in FLAVORS:
        c = vars(get_flavor(model).build_config())
    else:
        try:
            c = json.loads((Path(model) / "config.json").read_text())
        except (OSError, ValueError):
            return None, None  # the model loader says what is wrong with the directory
        c = c.get("text_config", c)
    return (c.get("max_position_embeddings"),
            _scaling(c.get("rope_parameters")) or _scaling(c.get("rope_scaling")))


def check_context(cfg: TrainConfig, model: str) -> None:
    """``seq_len`` within the model's context, or within what ``model.rope_scaling`` allows."""
    max_pos, existing = context_length(model)
    factor = cfg.model.rope_scaling
    if factor is not None and existing:
        raise ValueError(f"model.rope_scaling={factor:g}: {cfg.model.name} already scales RoPE "
                         f"({existing}); leave model.rope_scaling unset")
    if max_pos is None:
        return
    limit = int(max_pos * (factor or 1))
    if cfg.seq_len > limit:
        fix = (f"raise model.rope_scaling to at least {cfg.seq_len / max_pos:.3g}" if factor else
               f"lower seq_len, or set model.rope_scaling={cfg.seq_len / max_pos:.3g} (linear RoPE "
               "scaling; fine-tune long enough for the model to adapt)")
        raise ValueError(f"seq_len={cfg.seq_len} is beyond {cfg.model.name}'s context of {limit} "
                         f"positions (max_position_embeddings {max_pos}"
                         + (f" x rope_scaling {factor:g}" if factor else "") + f"); {fix}")


def check_report_to(sinks: list[str]) -> None:
    needs = {"tensorboard": "tensorboard", "wandb": "wandb"}
    for sink in sinks:
        if importlib.util.find_spec(needs[sink]) is None:
            raise ValueError(f"log.report_to={sink} needs the {needs[sink]} package: "
                             f"`pip install {needs[sink]}`, or drop it from log.report_to")
