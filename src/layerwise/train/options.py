"""Checks of a run's settings that need the plan tables but not torch: the command runs them
before its heavy imports (and before it creates the out_dir), the loop again."""

from __future__ import annotations

import importlib
from pathlib import Path

from ..plan.plan import Plan
from .config import TrainConfig
from .progress import resolve_progress


FIT_RULES = ("keep-internals", "keep-all", "every-2", "every-4", "recompute-all")
"""``plan=fit`` takes the first of these (least recompute first) whose predicted device peak
fits the device."""


def resolve_plan(spec: str, num_layers: int, cfg: TrainConfig) -> Plan:
    """A rule or a plan file as a Plan (``plan=auto`` and ``plan=fit`` are ``choose_plan``'s)."""
    kw = dict(micro_batch_size=cfg.micro_batch_size, num_micro_batches=cfg.grad_accum,
              seq_len=cfg.seq_len)
    if spec.startswith("every-"):
        try:
            k = int(spec.split("-", 1)[1])
        except ValueError:
            raise ValueError(f"plan {spec!r}: expected every-K with an integer K") from None
        return Plan.every_k(num_layers, k, **kw)
    if spec == "recompute-all":
        return Plan.recompute_all(num_layers, **kw)
    if spec == "keep-all":
        return Plan.keep_all(num_layers, **kw)
    if spec == "keep-internals":
        return Plan.keep_internals(num_layers, **kw)
    if Path(spec).suffix == ".json":
        plan = Plan.load(spec)
        plan.validate(num_layers)
        return plan
    raise ValueError(f"plan {spec!r} is not fit, every-K, recompute-all, keep-all, keep-internals, "
                     "auto or a .json plan file")


def check_settings(cfg: TrainConfig) -> None:
    """Every check that needs neither torch nor the model: one ``ValueError`` naming the key."""
    cfg.check()
    resolve_progress(cfg.log.progress)
    if Path(cfg.plan).suffix == ".json":
        Plan.load(cfg.plan)  # a missing or malformed plan file's own error
    elif cfg.plan not in ("auto", "fit"):
        resolve_plan(cfg.plan, 1, cfg)  # a malformed rule's own error
    if cfg.plan == "auto":  # the hardware settings are the planner's alone
        importlib.import_module("layerwise.planner.hardware_choice").check_spec(cfg.hardware, cfg.profile)
