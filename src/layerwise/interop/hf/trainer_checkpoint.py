"""HF Trainer ``checkpoint-N`` dirs: read them group by group, and write ones that
``Trainer.train(resume_from_checkpoint=dir)`` accepts (files: ``docs/formats.md``).

``optimizer.pt`` identifies parameters only by position, so :func:`trainer_param_groups` replays
``Trainer.create_optimizer``'s two groups on a meta-device model. It is assembled from
memory-mapped staging files, so its tensors come from the page cache, not the heap."""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import Trainer, TrainerState

from ...ckpt.moments import fp32_moments
from ...util.atomic import atomic_write_text
from ...util.jsonable import jsonable
from ...util.safe_load import load_data_file
from ...util.units import parse_size_bytes
from .model_dir import HFModelDirSource, load_pt, read_json
from .model_dir_writer import DEFAULT_MAX_SHARD_SIZE, WeightsWriter
from ..layout import (
    CONFIG_NAME,
    EXP_AVG,
    EXP_AVG_SQ,
    OPTIMIZER_NAME,
    PARAM,
    RNG_STATE_NAME,
    SCHEDULER_NAME,
    STEP,
    TRAINER_STATE_NAME,
    CheckpointSource,
    meta_model,
)


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Parameter names that transformers.Trainer puts in the weight-decay group."""
    # The method does not touch ``self``; calling it keeps us in step with the installed version.
    return list(Trainer.get_decay_parameter_names(None, model))


def trainer_param_groups(model: nn.Module) -> list[list[str]]:
    """The names of Trainer's two AdamW param groups (decay, no decay), each in model order."""
    decay = set(decay_parameter_names(model))
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    return [[n for n in names if n in decay], [n for n in names if n not in decay]]


@dataclass
class AdamWHParams:
    """AdamW hyper-parameters for ``optimizer.pt`` when the source does not carry its own."""

    lr: float = 5e-5
    """Peak (base) learning rate; the scheduler scales it. transformers' default."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam's (beta1, beta2)."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay of param group 0 (group 1, norms and biases, never decays)."""


def _param_group_template(hp: AdamWHParams) -> dict:
    """Every key torch's AdamW keeps in a param group, from a real instance (the set varies by version)."""
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(1))], lr=hp.lr, betas=tuple(hp.betas), eps=hp.eps,
                            weight_decay=hp.weight_decay)
    group = dict(opt.state_dict()["param_groups"][0])
    group.pop("params")
    return group


def _param_groups(extra: dict, hparams: AdamWHParams | None, scheduler: dict) -> list[dict]:
    """Hyper-parameters of Trainer's two groups: explicit, else the source's (a one-group source
    lends to both), else Trainer's defaults; the no-decay group gets weight_decay 0."""
    saved = [dict(g) for g in extra.get("optimizer_param_groups") or []]
    for g in saved:
        g.pop("params", None)
        if isinstance(g.get("betas"), list):
            g["betas"] = tuple(g["betas"])
    if hparams is None and len(saved) == 2:
        return saved
    if hparams is None and saved:
        template = {**_param_group_template(AdamWHParams()), **saved[0]}
        return [dict(template), {**template, "weight_decay": 0.0}]
    hp = hparams or AdamWHParams()
    groups = [{**_param_group_template(hp), "weight_decay": hp.weight_decay},
              {**_param_group_template(hp), "weight_decay": 0.0}]
    base = scheduler.get("base_lrs") or [hp.lr, hp.lr]
    last = scheduler.get("_last_lr") or base
    for g, b, lr in zip(groups, base, last):
        g["initial_lr"] = b
        g["lr"] = lr  # the rate of the next step, as a live optimizer would hold it
    return groups


def constant_scheduler_state(step: int, lr: float, num_groups: int = 2) -> dict:
    """A LambdaLR state at ``step``: only the position and base rates travel in the file (the lambda
    is rebuilt on resume), so this resumes any Trainer scheduler."""
    opt = torch.optim.AdamW([{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(num_groups)], lr=lr)
    state = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0).state_dict()
    state.update(last_epoch=step, _step_count=step + 1, _last_lr=[lr] * num_groups, base_lrs=[lr] * num_groups)
    return state


def _scheduler_for_groups(state: dict, num_groups: int) -> dict:
    """A scheduler state with one entry per Trainer param group: LambdaLR zips rates with groups,
    so one entry would leave the second group at a stale rate."""
    out = dict(state)
    for key in ("base_lrs", "_last_lr", "lr_lambdas"):
        value = out.get(key)
        if not isinstance(value, list) or len(value) == num_groups:
            continue
        if len(value) != 1:
            raise ValueError(
                f"the source's LR scheduler has {len(value)} entries in {key!r}, but a Trainer "
                f"checkpoint has {num_groups} param groups; export with a matching optimizer layout"
            )
        out[key] = value * num_groups
    return out


def trainer_rng_state(rng: dict | None) -> dict | None:
    """Trainer's ``rng_state.pth`` contents from the source's RNG states (its layout or the
    JSON-able form), or None if none is usable."""
    if not rng:
        return None
    out: dict[str, Any] = {}
    py = rng.get("python")
    if py is not None:
        version, internal, gauss = py
        out["python"] = (int(version), tuple(int(x) for x in internal), gauss)
    npst = rng.get("numpy")
    if npst is not None:
        name, keys, pos, has_gauss, cached = npst
        out["numpy"] = (str(name), np.asarray(keys, dtype=np.uint32), int(pos), int(has_gauss), float(cached))
    cpu = rng.get("cpu", rng.get("torch"))
    if cpu is not None:
        out["cpu"] = torch.as_tensor(cpu, dtype=torch.uint8).clone() if not isinstance(cpu, torch.Tensor) else cpu
    for key in ("cuda", "xla", "npu", "hpu", "mlu", "musa"):
        if key in rng and rng[key] is not None:
            out[key] = rng[key]
    # Trainer restores python, numpy and cpu unconditionally: without all three the file would break resume.
    if not all(k in out for k in ("python", "numpy", "cpu")):
        return None
    return out


def trainer_state_dict(extra: dict, step: int) -> dict:
    """``trainer_state.json`` contents: the source's, positioned at ``step``, else a fresh TrainerState."""
    state = extra.get("trainer_state")
    if state is None:
        state = dataclasses.asdict(TrainerState(global_step=step))
    else:
        state = dict(state)
        known = {f.name for f in dataclasses.fields(TrainerState)}
        state = {k: v for k, v in state.items() if k in known}
    state["global_step"] = step
    return state


def write_trainer(source: CheckpointSource, out_dir: Path, config: dict, extra: dict,
                  dtype: torch.dtype | None, *, max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
                  hparams: AdamWHParams | None = None) -> dict[str, Any]:
    """``source`` as a Trainer checkpoint in the empty ``out_dir`` (but its config files); a summary."""
    out_dir = Path(out_dir)
    step = int(extra.get("step") or 0)

    order = trainer_param_groups(meta_model(config))
    position = {name: i for i, name in enumerate(n for g in order for n in g)}

    staging = out_dir / ".optimizer-staging"
    staging.mkdir()
    staged_files: list[Path] = []

    def stage(group: str, tensors: dict[str, torch.Tensor]) -> None:
        staged = _optimizer_entries(group, tensors, position)
        if staged:
            staged_files.append(staging / f"{len(staged_files):05d}.pt")
            torch.save(staged, staged_files[-1])

    summary = WeightsWriter(out_dir, config, parse_size_bytes(max_shard_size), dtype).write_all(source, stage)

    scheduler = extra.get("scheduler")
    if scheduler is None:
        # Trainer loads optimizer.pt only next to a scheduler.pt, so one is always written.
        saved_hp = extra.get("optimizer_param_groups") or [{}]
        base_lr = hparams.lr if hparams else saved_hp[0].get("initial_lr", saved_hp[0].get("lr", AdamWHParams().lr))
        scheduler = constant_scheduler_state(step, base_lr, num_groups=len(order))
    scheduler = _scheduler_for_groups(scheduler, len(order))
    param_groups = _param_groups(extra, hparams, scheduler)
    if len(param_groups) != len(order):
        raise ValueError(
            f"the source's optimizer has {len(param_groups)} param groups; a Trainer checkpoint needs "
            f"{len(order)} (weight decay, no weight decay)"
        )

    state: dict[int, dict[str, torch.Tensor]] = {}
    for f in staged_files:
        # Memory-mapped: torch.save below copies each tensor from the page cache, not from our heap.
        state.update(load_data_file(f, mmap=True))
    ids = iter(range(len(position)))
    for g, names in zip(param_groups, order):
        g["params"] = [next(ids) for _ in names]
    torch.save({"state": dict(sorted(state.items())), "param_groups": param_groups}, out_dir / OPTIMIZER_NAME)
    del state

    torch.save(scheduler, out_dir / SCHEDULER_NAME)
    rng = trainer_rng_state(extra.get("rng"))
    if rng is not None:
        torch.save(rng, out_dir / RNG_STATE_NAME)
    atomic_write_text(out_dir / TRAINER_STATE_NAME, json.dumps(trainer_state_dict(extra, step), indent=2, sort_keys=True) + "\n")
    for f in staged_files:
        f.unlink()
    staging.rmdir()
    return {
        **summary,
        "optimizer_state_params": len(position) if staged_files else 0,
        "rng_state": rng is not None,
    }


def _optimizer_entries(group: str, tensors: dict[str, torch.Tensor], position: dict[str, int]) -> dict[int, dict]:
    """AdamW ``state`` entries (position -> {step, exp_avg, exp_avg_sq}) for one group's parameters."""
    out: dict[int, dict[str, torch.Tensor]] = {}
    tensors = fp32_moments(tensors)  # the Trainer's AdamW keeps fp32 moments
    for key, t in tensors.items():
        if not key.startswith(PARAM):
            continue
        name = key[len(PARAM):]
        if name not in position:
            continue  # e.g. a tied head's copy; the model has no such parameter of its own
        m, v, s = tensors.get(EXP_AVG + name), tensors.get(EXP_AVG_SQ + name), tensors.get(STEP + name)
        if m is None and v is None:
            continue  # no optimizer state: torch creates it on the first step, as for a fresh parameter
        if m is None or v is None or s is None:
            raise ValueError(
                f"parameter {name} (group {group!r}) has only part of its AdamW state "
                f"(exp_avg={m is not None}, exp_avg_sq={v is not None}, step={s is not None})"
            )
        for what, x in (("exp_avg", m), ("exp_avg_sq", v)):
            if tuple(x.shape) != tuple(t.shape):
                raise ValueError(f"{what} of {name} has shape {tuple(x.shape)}, its weight {tuple(t.shape)}")
        out[position[name]] = {
            "step": s.detach().to(torch.float32).reshape(()).clone(),
            "exp_avg": m.detach().to(torch.float32).contiguous(),
            "exp_avg_sq": v.detach().to(torch.float32).contiguous(),
        }
    return out


# ----- reading -------------------------------------------------------------------------


class TrainerCheckpointSource(HFModelDirSource):
    """An HF Trainer ``checkpoint-N`` dir; a count or shape mismatch in ``optimizer.pt``'s positions
    is refused rather than mis-assigning moments."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_dir():
            raise FileNotFoundError(f"{self.path} is not a directory")
        sharded = [d.name for d in self.path.iterdir() if d.is_dir() and d.name.startswith(("global_step", "optimizer_"))]
        if sharded and not (self.path / OPTIMIZER_NAME).is_file():
            raise ValueError(
                f"{path} holds a sharded optimizer state ({', '.join(sorted(sharded))}: DeepSpeed ZeRO or "
                "FSDP), not optimizer.pt; open it with layerwise.interop.sources.open_source (which "
                "reads a DeepSpeed ZeRO save, given its `latest` file or global_stepN dir), or, for "
                "FSDP, consolidate the optimizer state into optimizer.pt first"
            )
        super().__init__(path)
        if self.config is None:
            raise ValueError(
                f"{self.path} has no {CONFIG_NAME}; it is needed to map optimizer.pt entries to parameters"
            )

    @cached_property
    def _optimizer(self) -> dict | None:
        f = self.path / OPTIMIZER_NAME
        return load_pt(f) if f.is_file() else None

    @cached_property
    def _param_ids(self) -> dict[str, int]:
        """HF parameter name -> index in optimizer.pt's ``state``."""
        opt = self._optimizer
        if opt is None:
            return {}
        model = meta_model(self.config)
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
        trainer_state = read_json(ts_file) if ts_file.is_file() else None
        extra["trainer_state"] = trainer_state
        if trainer_state is not None:
            extra["step"] = int(trainer_state.get("global_step", 0))
        else:
            m = re.search(r"(\d+)$", self.path.name)
            extra["step"] = int(m.group(1)) if m else 0
        sched = self.path / SCHEDULER_NAME
        extra["scheduler"] = jsonable(load_pt(sched)) if sched.is_file() else None
        rng = self.path / RNG_STATE_NAME
        extra["rng"] = load_trainer_rng(rng) if rng.is_file() else None
        extra["optimizer_param_groups"] = self.optimizer_param_groups()
        return extra


def load_trainer_rng(path: Path) -> dict:
    """Trainer's ``rng_state.pth`` (python, numpy, torch states), read as data."""
    return load_data_file(path)
