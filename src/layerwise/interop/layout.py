"""Hugging Face and Trainer names and layouts, and the ``CheckpointSource`` protocol: the leaf of
``layerwise.interop``, which every interop module imports. Blob keys: ``docs/formats.md``."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..ckpt.provider import EXP_AVG, EXP_AVG_SQ, OPTIM_KINDS, PARAM, STEP
from ..models.families import family_of

__all__ = ["EXP_AVG", "EXP_AVG_SQ", "OPTIM_KINDS", "PARAM", "STEP", "CheckpointSource", "meta_model"]

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHT_FILE_NAMES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
RNG_STATE_NAME = "rng_state.pth"


@runtime_checkable
class CheckpointSource(Protocol):
    """One complete training state, readable a group at a time."""

    def groups(self) -> list[str]:
        """Group names in model order (``embed``, ``layers.0`` … ``layers.{L-1}``, ``norm``, ``lm_head``)."""
        ...

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        """The tensors of one group, keyed ``param/…``, ``exp_avg/…``, ``exp_avg_sq/…``, ``step/…``."""
        ...

    def model_config(self) -> dict | None:
        """The HF ``config.json`` contents, or None when the source does not know it."""
        ...

    def extra_state(self) -> dict:
        """``step`` (int), ``scheduler`` (JSON-able dict or None), ``rng`` (dict or None),
        ``trainer_state`` (dict or None); optionally ``optimizer_param_groups`` (a list with one dict of
        AdamW hyper-parameters per Trainer param group, without ``params``) and
        ``generation_config`` (dict)."""
        ...


def meta_model(config: dict) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device: parameter names, shapes and order, no memory."""
    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json has no 'model_type'; cannot tell which architecture it describes")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    try:
        model_class = family_of(hf_config).model_class  # a multimodal model's own class
    except ValueError:
        model_class = None
    with torch.device("meta"):
        if model_class is None:
            return AutoModelForCausalLM.from_config(hf_config)
        return model_class(hf_config)
