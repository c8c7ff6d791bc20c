"""A saved step of a LoRA run taken out as a PEFT adapter (``--format peft``) or the merged base
(``--format hf``): :func:`export_step`. The groups hold only adapters and moments; the rest
(LoRA settings, base model, dtype) comes from the run's ``run.json``."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PretrainedConfig

from ...adapters.config import LoraConfig
from ...adapters.lora_adapter import LoraAdapter
from ...adapters.lora_store import LoraStore
from ...ckpt.provider import PARAM
from ...ckpt.resolve import ResolvedStep
from ...ckpt.run_format import OUT_DIR_CKPT
from ...config import from_dict
from ...models import FLAVORS, DecoderAdapter, get_flavor
from ...models.init import build_hf_model
from ..hf.model_dir import HFModelDirSource, check_weights, fill_store, load_config
from ..hf.tokenizer_files import model_files_of
from ..recipes.merge import check_out, dir_bytes, merge
from ..sources import open_source
from .adapter_dir import ADAPTER_WEIGHTS, MergedSource, adapter_config, write_adapter_tensors

RUN_JSON = "run.json"
PEFT = "peft"
"""The export format of a LoRA run's step as a PEFT adapter directory (``ckpt merge --format``)."""


@dataclass(frozen=True)
class LoraRunStep:
    """A step of a LoRA run and the settings its export needs (from ``run.json``)."""

    step: ResolvedStep
    out_dir: Path
    lora: LoraConfig
    base: str
    """The base model: ``run.json``'s ``model_path`` (a directory or a flavor name), or ``--base``."""
    seed: int
    compute_dtype: torch.dtype

    def adapter(self) -> LoraAdapter:
        """The run's adapter structure (templates on the meta device: nothing allocated)."""
        return LoraAdapter(DecoderAdapter(self.model_config()), self.lora, self.compute_dtype,
                           self.seed)

    def model_config(self) -> PretrainedConfig:
        """The base's config: the flavor's, the base directory's, else (the base has moved) the
        one the checkpoint stores, which is all the adapters' names and shapes need."""
        if self.base in FLAVORS:
            return get_flavor(self.base).build_config()
        if Path(self.base).is_dir():
            return load_config(self.base)
        stored = dict(self.step.model_config() or {})
        if not stored.get("model_type"):
            raise self.base_missing()
        return AutoConfig.for_model(stored.pop("model_type"), **stored)

    def base_missing(self) -> ValueError:
        return ValueError(f"the base model {self.base} ({self.out_dir / RUN_JSON} model_path) is "
                          "not there; --base DIR names where it is now")

    def adapter_tensors(self, adapter: LoraAdapter) -> dict[str, torch.Tensor]:
        """The step's adapters (fp32 masters) by name, read group by group from the checkpoint;
        checked against the names and shapes ``adapter`` (run.json's settings) has."""
        want = {p.hf_name: p.shape for u in adapter.units for p in u.params}
        got: dict[str, torch.Tensor] = {}
        for group in self.step.groups():
            got.update({k[len(PARAM):]: t for k, t in self.step.load_group(group).items()
                        if k.startswith(PARAM)})
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        if missing or extra:
            raise ValueError(f"step {self.step.step} of {self.step.run_dir} does not hold the "
                             f"adapters {self.out_dir / RUN_JSON} describes: missing {missing[:3]}, "
                             f"unexpected {extra[:3]}")
        for name, shape in want.items():
            if tuple(got[name].shape) != tuple(shape):
                raise ValueError(f"{name}: stored shape {tuple(got[name].shape)} != {tuple(shape)} "
                                 f"(lora.r={self.lora.r} in {self.out_dir / RUN_JSON})")
        return {n: got[n] for n in want}


def run_info_of(source: object) -> tuple[Path, dict[str, Any]] | None:
    """(out_dir, its run.json) of the ``layerwise train`` run ``source`` is a step of; None when
    ``source`` is not a step of such a run."""
    if not isinstance(source, ResolvedStep):
        return None
    run_dir = Path(source.run_dir)
    if run_dir.name != OUT_DIR_CKPT:
        return None
    try:
        info = json.loads((run_dir.parent / RUN_JSON).read_text())
    except (OSError, ValueError):
        return None
    return (run_dir.parent, info) if isinstance(info, dict) else None


def lora_step_of(source: object, base: str | Path | None = None) -> LoraRunStep | None:
    """``source`` as a step of a LoRA run, or None when it is not one (any other source, a full
    run). ``base``: the base model's directory, when it is no longer at run.json's
    ``model_path``."""
    found = run_info_of(source)
    if found is None:
        return None
    out_dir, info = found
    cfg = info.get("config") or {}
    lora = from_dict(LoraConfig, cfg.get("lora") or {}, "lora.")
    if not lora.enabled:
        return None
    dtype = getattr(torch, str(info.get("compute_dtype", "float32")), None)
    return LoraRunStep(
        step=source, out_dir=out_dir, lora=lora,
        base=str(base) if base is not None else str(info.get("model_path") or cfg["model"]["name"]),
        seed=int(cfg.get("seed", 0)),
        compute_dtype=dtype if isinstance(dtype, torch.dtype) else torch.float32)


def refuse_peft(source: object) -> ValueError:
    """Why ``--format peft`` does not apply to ``source`` (not a step of a LoRA run)."""
    found = run_info_of(source)
    if found is not None:
        return ValueError(f"--format peft writes a LoRA run's adapters; {found[0]} is a full "
                          "fine-tune (lora.r=0 in its run.json): its checkpoints hold whole "
                          "weights, which --format hf writes")
    if isinstance(source, ResolvedStep):
        return ValueError(f"--format peft writes a LoRA run's adapters and needs the run's "
                          f"{RUN_JSON} (its r, alpha, target modules, base model) beside "
                          f"{source.run_dir}; there is none: point at the out_dir of a "
                          "`layerwise train ... lora.r=N` run")
    return ValueError("--format peft writes the adapters of a step of a LoRA run (`layerwise "
                      "train ... lora.r=N`, its out_dir); this source holds whole weights")


def write_peft(run: LoraRunStep, out: Path, dtype: str | None = None) -> dict[str, Any]:
    """The step's adapters as a PEFT adapter directory at ``out`` (replaced: the caller checked
    it may be). ``dtype``: cast the adapters (default: fp32, as stored)."""
    t0 = time.perf_counter()
    adapter = run.adapter()
    tensors = run.adapter_tensors(adapter)
    if dtype is not None:
        cast = getattr(torch, dtype, None)
        if not isinstance(cast, torch.dtype) or not cast.is_floating_point:
            raise ValueError(f"--dtype {dtype}: not a floating-point torch dtype")
        tensors = {n: t.to(cast) for n, t in tensors.items()}
    write_adapter_tensors(tensors, adapter_config(adapter, run.base), out, overwrite=True)
    return {"format": "peft", "step": run.step.step, "weight_files": [ADAPTER_WEIGHTS],
            "num_tensors": len(tensors), "base_model": run.base, "r": run.lora.r,
            "lora_alpha": run.lora.alpha, "tokenizer_from": None,
            "seconds": round(time.perf_counter() - t0, 3)}


def merged_source(run: LoraRunStep) -> MergedSource:
    """The run's base (as the run built it: quantised to ``lora.base_dtype``, a flavor from the
    run's seed) with the step's adapters in it, as an HF checkpoint source."""
    if run.base not in FLAVORS and not Path(run.base).is_dir():
        raise run.base_missing()
    adapter = run.adapter()
    tensors = run.adapter_tensors(adapter)
    store = LoraStore(adapter, run.compute_dtype, pin=False)
    if run.base in FLAVORS:
        store.copy_from_model(build_hf_model(adapter.config, run.seed))
    else:
        source = HFModelDirSource(run.base)
        check_weights(source, adapter.hf_names())
        fill_store(source, store)
    store.load_adapters(tensors)
    return MergedSource(store, None if run.base in FLAVORS else run.base)


def export_step(source: object, out_dir: str | Path, format: str = PEFT, *, step: int | None = None,
                base: str | Path | None = None, dtype: str | None = None,
                max_shard_size: int | str | None = "5GB", overwrite: bool = False,
                tokenizer: str | Path | None = None) -> dict[str, Any]:
    """Write a LoRA run's step as ``peft`` (its adapters) or ``hf`` (merged into the base); anything
    else is refused. ``base``: the base model's directory if it moved. Returns merge's summary."""
    if isinstance(source, (str, Path)):
        source = open_source(source, step)
    run = lora_step_of(source, base)
    if run is None:
        raise refuse_peft(source)
    if format not in (PEFT, "hf"):
        raise ValueError(f"{run.out_dir} is a LoRA run (lora.r={run.lora.r}): its checkpoints hold "
                         f"the adapters alone, not a {format} checkpoint; --format peft writes them "
                         "as a PEFT adapter, --format hf the base with them merged")
    out = check_out(out_dir, overwrite)
    t0 = time.perf_counter()
    if format == "hf":
        summary = merge(merged_source(run), out, "hf", max_shard_size=max_shard_size, dtype=dtype,
                        overwrite=True, tokenizer=model_files_of(run.step, tokenizer))
        summary["step"] = run.step.step
        summary["base_model"] = run.base
    else:
        out.parent.mkdir(parents=True, exist_ok=True)
        summary = write_peft(run, out, dtype)
        summary["out"] = str(out)
        summary["bytes"] = dir_bytes(out)
    older = {g: e.saved_step for g, e in run.step.entries.items() if e.saved_step < run.step.step}
    summary.update(older_groups=older, num_groups=len(run.step.groups()),
                   seconds=round(time.perf_counter() - t0, 3))
    return summary
