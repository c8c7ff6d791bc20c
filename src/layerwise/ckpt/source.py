"""Read any checkpoint one group at a time: layer-wise runs, HF Trainer ``checkpoint-N`` dirs, HF model dirs.

Merge and export only ever see a :class:`CheckpointSource`, so every writer (``hf``, ``trainer``) and the
recipe merge work on every kind of input, and all of them stream: a group (one decoder layer, the
embedding, the head) is loaded, written, and dropped before the next one is read.

Tensor keys of one group (the same in the layer-wise store): ``param/<hf_name>`` (weights),
``exp_avg/<hf_name>`` and ``exp_avg_sq/<hf_name>`` (AdamW moments, fp32; absent when the source has
no optimizer state) and ``step/<hf_name>`` (AdamW's per-parameter step, a 0-d fp32 tensor).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from .groups import group_of, layer_index  # noqa: F401  (part of this module's API for sources)

# HF file names (the same constants transformers uses).
CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
WEIGHTS_NAME = "pytorch_model.bin"
WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
OPTIMIZER_NAME = "optimizer.pt"
SCHEDULER_NAME = "scheduler.pt"
TRAINER_STATE_NAME = "trainer_state.json"
RNG_STATE_NAME = "rng_state.pth"

PARAM, EXP_AVG, EXP_AVG_SQ, STEP = "param/", "exp_avg/", "exp_avg_sq/", "step/"
OPTIM_KINDS = (EXP_AVG, EXP_AVG_SQ, STEP)


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


def group_sort_key(group: str) -> tuple[int, int, str]:
    """Model order: embedding, layers by index, final norm, head, then anything else by name."""
    if group == "embed":
        return (0, 0, group)
    if group.startswith("layers.") and group[len("layers."):].isdigit():
        return (1, int(group[len("layers."):]), group)
    if group == "norm":
        return (2, 0, group)
    if group == "lm_head":
        return (3, 0, group)
    return (4, 0, group)


def is_tied(config: dict | None) -> bool:
    return bool((config or {}).get("tie_word_embeddings", False))


def meta_model(config: dict) -> torch.nn.Module:
    """The causal LM of ``config`` on the meta device: parameter names, shapes and order, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    model_type = cfg.pop("model_type", None)
    if not model_type:
        raise ValueError("config.json has no 'model_type'; cannot tell which architecture it describes")
    hf_config = AutoConfig.for_model(model_type, **cfg)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config)


# ---------------------------------------------------------------------------------------------
# Plain HF model dirs and HF Trainer checkpoint dirs


def _read_json(path: Path) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _load_pt(path: Path) -> Any:
    """``torch.load`` for foreign files: never unpickles code; memory-maps where the file allows it."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:
        if "mmap" not in str(e):  # legacy (non-zip) files cannot be memory-mapped; other errors are real
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


class HFModelDirSource:
    """Weights of a Hugging Face model dir (single or sharded safetensors, or ``pytorch_model.bin``)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a directory")
        self._weight_files = self._find_weight_files()

    def _find_weight_files(self) -> dict[str, Path]:
        """Map every tensor name to the file that holds it."""
        p = self.path
        if (p / SAFE_WEIGHTS_INDEX_NAME).is_file():
            index = _read_json(p / SAFE_WEIGHTS_INDEX_NAME)
            return {name: p / file for name, file in index["weight_map"].items()}
        if (p / SAFE_WEIGHTS_NAME).is_file():
            from safetensors import safe_open

            with safe_open(str(p / SAFE_WEIGHTS_NAME), framework="pt") as f:
                return {name: p / SAFE_WEIGHTS_NAME for name in f.keys()}
        if (p / WEIGHTS_INDEX_NAME).is_file():
            index = _read_json(p / WEIGHTS_INDEX_NAME)
            return {name: p / file for name, file in index["weight_map"].items()}
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
            cache[path] = _load_pt(path)
        return cache[path]

    @cached_property
    def _config(self) -> dict | None:
        f = self.path / CONFIG_NAME
        return _read_json(f) if f.is_file() else None

    @cached_property
    def _groups(self) -> dict[str, list[str]]:
        tied = is_tied(self._config)
        out: dict[str, list[str]] = {}
        for name in self._weight_files:
            if tied and name.startswith("lm_head."):
                continue  # a tied head is the embedding; some writers still store a copy
            out.setdefault(group_of(name, tied), []).append(name)
        return dict(sorted(out.items(), key=lambda kv: group_sort_key(kv[0])))

    def groups(self) -> list[str]:
        return list(self._groups)

    def _check_group(self, group: str) -> list[str]:
        try:
            return self._groups[group]
        except KeyError:
            raise ValueError(f"{self.path} has no group {group!r}; it has {self.groups()}") from None

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        names = self._check_group(group)
        return {PARAM + n: t for n, t in self._read_weights(names).items()}

    def _read_weights(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        by_file: dict[Path, list[str]] = {}
        for n in names:
            by_file.setdefault(self._weight_files[n], []).append(n)
        out: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.items():
            if file.suffix == ".safetensors":
                with safe_open(str(file), framework="pt") as f:
                    for n in file_names:
                        out[n] = f.get_tensor(n)
            else:
                sd = self._bin(file)
                for n in file_names:
                    out[n] = sd[n].clone()
        return out

    def model_config(self) -> dict | None:
        return self._config

    def extra_state(self) -> dict:
        extra: dict[str, Any] = {"step": 0, "scheduler": None, "rng": None, "trainer_state": None}
        gen = self.path / GENERATION_CONFIG_NAME
        if gen.is_file():
            extra["generation_config"] = _read_json(gen)
        return extra


class TrainerCheckpointSource(HFModelDirSource):
    """An HF Trainer ``checkpoint-N`` dir: weights plus AdamW moments, scheduler, RNG and trainer state.

    ``optimizer.pt`` names parameters by position only. The position of each parameter follows how
    ``transformers.Trainer.create_optimizer`` builds AdamW's param groups: first every parameter that
    gets weight decay, then every one that does not, each in ``model.named_parameters()`` order
    (tied parameters once). The model is rebuilt on the meta device from ``config.json`` to replay
    that order; a count or shape mismatch is reported instead of silently mis-assigning moments.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a directory")
        sharded = [d.name for d in self.path.iterdir() if d.is_dir() and d.name.startswith(("global_step", "optimizer_"))]
        if sharded and not (self.path / OPTIMIZER_NAME).is_file():
            raise ValueError(
                f"{path} holds a sharded optimizer state ({', '.join(sorted(sharded))}: DeepSpeed ZeRO or "
                "FSDP), which layerwise cannot read; consolidate it into optimizer.pt first, or export "
                "the weights only by pointing at a copy without it"
            )
        super().__init__(path)
        if self._config is None:
            raise ValueError(
                f"{self.path} has no {CONFIG_NAME}; it is needed to map optimizer.pt entries to parameters"
            )

    @cached_property
    def _optimizer(self) -> dict | None:
        f = self.path / OPTIMIZER_NAME
        return _load_pt(f) if f.is_file() else None

    @cached_property
    def _param_ids(self) -> dict[str, int]:
        """HF parameter name -> index in optimizer.pt's ``state``."""
        from layerwise.ckpt.formats.trainer import trainer_param_groups

        opt = self._optimizer
        if opt is None:
            return {}
        model = meta_model(self._config)
        named = trainer_param_groups(model)
        saved = opt["param_groups"]
        if len(saved) != len(named) or any(len(g["params"]) != len(n) for g, n in zip(saved, named)):
            raise ValueError(
                f"{self.path / OPTIMIZER_NAME} has param groups of sizes "
                f"{[len(g['params']) for g in saved]}, but transformers.Trainer would build "
                f"{[len(n) for n in named]} for this config (decay / no-decay). It was written by a "
                "different optimizer set-up (custom param groups, frozen parameters, another "
                "optimizer); layerwise can only read the default Trainer AdamW layout."
            )
        ids: dict[str, int] = {}
        for group, names in zip(saved, named):
            for pid, name in zip(group["params"], names):
                ids[name] = pid
        shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
        for name, pid in ids.items():
            st = opt["state"].get(pid)
            if st and "exp_avg" in st and tuple(st["exp_avg"].shape) != shapes[name]:
                raise ValueError(
                    f"{self.path / OPTIMIZER_NAME}: state #{pid} has shape {tuple(st['exp_avg'].shape)} "
                    f"but parameter {name} has shape {shapes[name]}; the optimizer state does not "
                    "match the model's config.json"
                )
        return ids

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        out = super().load_group(group)
        if self._optimizer is None:
            return out
        state = self._optimizer["state"]
        for key in list(out):
            name = key[len(PARAM):]
            pid = self._param_ids.get(name)
            st = state.get(pid) if pid is not None else None
            if not st:
                continue  # never stepped (e.g. frozen): no moments, as in torch
            if "exp_avg" in st:
                out[EXP_AVG + name] = st["exp_avg"].to(torch.float32, copy=True)
            if "exp_avg_sq" in st:
                out[EXP_AVG_SQ + name] = st["exp_avg_sq"].to(torch.float32, copy=True)
            if "step" in st:
                out[STEP + name] = torch.as_tensor(st["step"], dtype=torch.float32).reshape(()).clone()
        return out

    def optimizer_param_groups(self) -> list[dict] | None:
        if self._optimizer is None:
            return None
        return [{k: v for k, v in g.items() if k != "params"} for g in self._optimizer["param_groups"]]

    def extra_state(self) -> dict:
        extra = super().extra_state()
        ts_file = self.path / TRAINER_STATE_NAME
        trainer_state = _read_json(ts_file) if ts_file.is_file() else None
        extra["trainer_state"] = trainer_state
        if trainer_state is not None:
            extra["step"] = int(trainer_state.get("global_step", 0))
        else:
            m = re.search(r"(\d+)$", self.path.name)
            extra["step"] = int(m.group(1)) if m else 0
        sched = self.path / SCHEDULER_NAME
        extra["scheduler"] = _to_jsonable(_load_pt(sched)) if sched.is_file() else None
        rng = self.path / RNG_STATE_NAME
        extra["rng"] = load_trainer_rng(rng) if rng.is_file() else None
        extra["optimizer_param_groups"] = self.optimizer_param_groups()
        return extra


def load_trainer_rng(path: Path) -> dict:
    """Trainer's ``rng_state.pth`` (python, numpy, torch states), read with weights_only."""
    from transformers.trainer_pt_utils import safe_globals

    with safe_globals():
        return torch.load(path, map_location="cpu", weights_only=True)


def _to_jsonable(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: _to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------------


def is_layerwise_run(path: Path) -> bool:
    return (path / "manifests").is_dir() or (path / "latest").is_file()


def is_trainer_checkpoint(path: Path) -> bool:
    return (path / OPTIMIZER_NAME).is_file() or (path / TRAINER_STATE_NAME).is_file()


def open_source(path: str | Path, step: int | None = None) -> CheckpointSource:
    """Open a layer-wise run (at ``step``, default latest), an HF Trainer checkpoint or an HF model dir.

    ``path@N`` is accepted as a short form of ``path`` with ``step=N`` for layer-wise runs.
    """
    p = Path(path)
    if not p.exists() and "@" in str(path):
        base, _, step_str = str(path).rpartition("@")
        if not step_str.isdigit():
            raise ValueError(f"{path!r}: the part after '@' must be a step number, e.g. runs/a@400")
        if step is not None and step != int(step_str):
            raise ValueError(f"{path!r} names step {step_str} but step={step} was also given")
        p, step = Path(base), int(step_str)
    if not p.is_dir():
        raise FileNotFoundError(f"checkpoint source {p} does not exist or is not a directory")
    if is_layerwise_run(p):
        from layerwise.ckpt.resolve import open_run_step

        return open_run_step(p, step)
    if step is not None:
        kind = "an HF Trainer checkpoint" if is_trainer_checkpoint(p) else "an HF model dir"
        raise ValueError(
            f"{p} is {kind}, which holds a single step; drop the step ({step}) or point at a "
            "layer-wise run dir"
        )
    if is_trainer_checkpoint(p):
        return TrainerCheckpointSource(p)
    checkpoints = sorted(p.glob("checkpoint-*"), key=lambda c: (len(c.name), c.name))
    if checkpoints and not any((p / f).is_file() for f in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)):
        raise ValueError(
            f"{p} looks like a Trainer output dir, not a checkpoint; point at one of its "
            f"checkpoints, e.g. {checkpoints[-1]}"
        )
    return HFModelDirSource(p)
