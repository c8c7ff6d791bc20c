"""What a ``lora.r > 0`` run does differently: a LoRA store over the frozen base, a planner shape
that knows the base is frozen, dropout off while evaluating, and the PEFT adapter (and, with
``lora.merge``, the merged model) as the export. Everything else is the full run's code."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import replace
from pathlib import Path

import torch
from transformers import PretrainedConfig

from ..adapters.lora_adapter import LoraAdapter
from ..adapters.lora_store import LoraStore
from ..interop.hf.model_dir import HFModelDirSource, check_weights, fill_store
from ..interop.hf.quantized import release_weight_format
from ..interop.peft.adapter_dir import load_init_adapter, write_adapter, write_merged
from ..models import FLAVORS, DecoderAdapter
from ..models.init import build_hf_model
from ..plan.shape import ModelShape
from ..store import PRIVATE, HostAllocator
from .config import TrainConfig

_log = logging.getLogger(__name__)


def lora_shape(cfg: TrainConfig, shape: ModelShape) -> ModelShape:
    """``shape`` with the run's frozen base, for planning (nothing built)."""
    if not cfg.lora.enabled:
        return shape
    return shape.with_lora(cfg.lora.r, cfg.lora.target_modules, cfg.lora.base_dtype)


def resolve_base_dtype(cfg: TrainConfig, name: str) -> TrainConfig:
    """``lora.base_dtype=auto``: the quantized release ``name``'s own format (its low-bit
    weights held as they are), else ``compute``."""
    if not cfg.lora.enabled or cfg.lora.base_dtype != "auto":
        return cfg
    fmt = release_weight_format(HFModelDirSource(name).config) if Path(name).is_dir() else None
    if fmt:
        _log.info(f"lora.base_dtype=auto: {fmt} (the release's own format, held as it is)")
    return replace(cfg, lora=replace(cfg.lora, base_dtype=fmt or "compute"))


def _release(name: str, cfg: TrainConfig) -> HFModelDirSource | None:
    """The model directory ``name``, when the base format is the quantized release's own."""
    if not Path(name).is_dir():
        return None
    source = HFModelDirSource(name)
    return source if cfg.lora.base_dtype == release_weight_format(source.config) else None


def lora_adapter(name: str, config: PretrainedConfig, cfg: TrainConfig, compute_dtype: torch.dtype
                 ) -> LoraAdapter:
    """The run's adapter (templates on the meta device: nothing allocated). Over a quantized
    release in its own format, only the tensors it packs are held packed."""
    release = _release(name, cfg)
    return LoraAdapter(DecoderAdapter(config), cfg.lora, compute_dtype, cfg.seed,
                       None if release is None else release.packed_names())


def build_lora(name: str, config: PretrainedConfig, cfg: TrainConfig, compute_dtype: torch.dtype,
               alloc: HostAllocator = PRIVATE) -> tuple[LoraAdapter, LoraStore]:
    """The base (quantised as read, one group at a time), then the adapters (PEFT's init under
    ``seed``, or ``lora.init``). Every local rank writes the same bytes into a shared store."""
    adapter = lora_adapter(name, config, cfg, compute_dtype)
    store = LoraStore(adapter, compute_dtype, alloc=alloc)
    if name in FLAVORS:
        store.copy_from_model(build_hf_model(config, cfg.seed))
    else:
        source = HFModelDirSource(name)
        check_weights(source, adapter.hf_names())
        store.release_format = adapter.packed_names is not None
        fill_store(source, store)
    store.init_adapters(cfg.seed)
    if cfg.lora.init:
        load_init_adapter(store, cfg.lora.init)
        _log.info(f"adapters start from {cfg.lora.init}")
    base_mib = store.base_nbytes() / 2**20
    layer_params = sum(e.numel for b in store.layers for e in b.layout.frozen)
    per_param = store.base_nbytes(layers_only=True) / max(layer_params, 1)
    _log.info(f"LoRA r={cfg.lora.r} on {', '.join(adapter.target_names)}: "
              f"{adapter.num_params() / 1e6:.2f}M adapter params; frozen base "
              f"{adapter.num_base_params() / 1e6:.1f}M params in {cfg.lora.base_dtype} "
              f"({base_mib:.1f} MiB on the host, {per_param:.3f} bytes per frozen layer parameter)")
    return adapter, store


@contextlib.contextmanager
def eval_mode(adapter):
    """No adapter dropout inside (a full run's adapter has no modes)."""
    train = getattr(adapter, "train", None)
    if train is None:
        yield
        return
    train(False)
    try:
        yield
    finally:
        train(True)


def resume_dropout(adapter, micro_batches_done: int) -> None:
    """A resumed run draws the dropout masks the uninterrupted run would (one per training
    micro-batch)."""
    if isinstance(adapter, LoraAdapter):
        adapter.dropout_draws = micro_batches_done


def export_lora(store: LoraStore, out_dir: Path, model_path: str, merge: bool, tokenizer) -> Path:
    """``out_dir/adapter`` (PEFT), and with ``merge`` ``out_dir/model`` (the merged HF model with
    the tokenizer). Returns the adapter directory."""
    adapter_dir = write_adapter(store, out_dir / "adapter", base_model=model_path, overwrite=True)
    _log.info(f"exported the PEFT adapter to {adapter_dir}")
    if merge:
        model_dir = write_merged(store, out_dir / "model", overwrite=True, base_dir=model_path)
        saved = tokenizer.save(model_dir) if tokenizer is not None else False
        _log.info(f"exported the merged Hugging Face model{' and tokenizer' if saved else ''} to "
                  f"{model_dir}")
    return adapter_dir
