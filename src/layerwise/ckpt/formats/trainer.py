"""Export to an HF Trainer ``checkpoint-N`` dir that ``Trainer.train(resume_from_checkpoint=dir)`` accepts.

Files: ``model.safetensors`` (sharded with an index past the shard size), ``optimizer.pt`` (a torch
AdamW ``state_dict``), ``scheduler.pt``, ``rng_state.pth`` (when the source has RNG states),
``trainer_state.json`` and ``config.json``.

``optimizer.pt`` identifies parameters only by position, so it must follow the layout of
``transformers.Trainer.create_optimizer``: param group 0 holds the parameters that get weight decay,
group 1 the rest (biases, norms), each in ``model.named_parameters()`` order, positions numbered
across both groups. :func:`trainer_param_groups` replays that on a meta-device model.

Streaming: the moments of each group are staged in a small torch file as the group passes; the
final ``optimizer.pt`` is assembled from memory-mapped staging files, so its tensors are read from
the page cache rather than held in process memory.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layerwise.ckpt.source import (
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
from layerwise.util.atomic import atomic_write_text

from .hf import DEFAULT_MAX_SHARD_SIZE, WeightsWriter, parse_dtype, parse_size_bytes, require_config, write_config_files


def decay_parameter_names(model: nn.Module) -> list[str]:
    """Parameter names that transformers.Trainer puts in the weight-decay group."""
    from transformers import Trainer

    try:
        # The method does not touch ``self``; calling it keeps us in step with the installed version.
        return list(Trainer.get_decay_parameter_names(None, model))
    except AttributeError:
        from transformers.trainer_pt_utils import get_parameter_names

        patterns = [r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)"]
        return list(get_parameter_names(model, [nn.LayerNorm], patterns))


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
    """Hyper-parameters of Trainer's two groups: explicit ones, else the source's, else Trainer's defaults.

    A source optimizer with one param group (a plain ``AdamW(model.parameters())`` loop) lends its
    hyper-parameters to both groups; the no-decay group gets weight_decay 0, as the Trainer builds it.
    """
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
    """A LambdaLR state positioned at ``step``.

    Trainer's schedulers are LambdaLRs whose lambda is rebuilt on resume; only the position
    (``last_epoch``) and base rates travel in the file, so this resumes any of them at ``step``.
    """
    opt = torch.optim.AdamW([{"params": [nn.Parameter(torch.zeros(1))]} for _ in range(num_groups)], lr=lr)
    state = torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0).state_dict()
    state.update(last_epoch=step, _step_count=step + 1, _last_lr=[lr] * num_groups, base_lrs=[lr] * num_groups)
    return state


def _scheduler_for_groups(state: dict, num_groups: int) -> dict:
    """A scheduler state with one entry per Trainer param group in its per-group lists.

    A plain loop's optimizer has one group; LambdaLR zips its rates with the optimizer's groups, so
    a one-entry list would leave the Trainer's second group at a stale rate.
    """
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
    """Trainer's ``rng_state.pth`` contents from the source's RNG states, or None if it has none usable.

    Accepts the Trainer's own layout and its JSON-able form (lists for tuples, arrays and tensors).
    """
    if not rng:
        return None
    import numpy as np

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
    from transformers import TrainerState

    state = extra.get("trainer_state")
    if state is None:
        state = dataclasses.asdict(TrainerState(global_step=step))
    else:
        state = dict(state)
        known = {f.name for f in dataclasses.fields(TrainerState)}
        state = {k: v for k, v in state.items() if k in known}
    state["global_step"] = step
    return state


def write_trainer(
    source: CheckpointSource,
    out_dir: Path,
    *,
    max_shard_size: int | str | None = DEFAULT_MAX_SHARD_SIZE,
    dtype: str | torch.dtype | None = None,
    hparams: AdamWHParams | None = None,
) -> dict[str, Any]:
    """Write ``source`` as a Trainer checkpoint into the existing, empty ``out_dir``; return a summary.

    Not atomic by itself: :func:`layerwise.ckpt.merge.merge` points it at a temp dir and renames.
    """
    out_dir = Path(out_dir)
    config = require_config(source)
    torch_dtype = parse_dtype(dtype)
    extra = source.extra_state()
    step = int(extra.get("step") or 0)

    order = trainer_param_groups(meta_model(config))
    position = {name: i for i, name in enumerate(n for g in order for n in g)}

    staging = out_dir / ".optimizer-staging"
    staging.mkdir()
    weights = WeightsWriter(out_dir, config, parse_size_bytes(max_shard_size), torch_dtype)
    staged_files: list[Path] = []
    try:
        for group in source.groups():
            tensors = source.load_group(group)
            weights.add_group(group, tensors)
            staged = _optimizer_entries(group, tensors, position)
            if staged:
                f = staging / f"{len(staged_files):05d}.pt"
                torch.save(staged, f)
                staged_files.append(f)
            del tensors, staged
        summary = weights.finish()
    except BaseException:
        weights.abort()
        raise

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
        state.update(torch.load(f, map_location="cpu", weights_only=True, mmap=True))
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
    write_config_files(out_dir, config, torch_dtype, extra.get("generation_config"))
    for f in staged_files:
        f.unlink()
    staging.rmdir()
    return {
        "format": "trainer",
        "step": step,
        **summary,
        "optimizer_state_params": len(position) if staged_files else 0,
        "rng_state": rng is not None,
    }


def _optimizer_entries(group: str, tensors: dict[str, torch.Tensor], position: dict[str, int]) -> dict[int, dict]:
    """AdamW ``state`` entries (position -> {step, exp_avg, exp_avg_sq}) for one group's parameters."""
    out: dict[int, dict[str, torch.Tensor]] = {}
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
