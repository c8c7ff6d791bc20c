"""``layerwise ckpt import``: compact a pile of ordinary checkpoints into a layer-wise run.

Each checkpoint becomes one step, oldest first, saved by a ``Checkpointer`` (same code, format
and commit protocol as training). An import into a run with steps continues it, so importing a
pile in two parts stores what one would."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from ...ckpt.checkpointer import Checkpointer
from ...ckpt.policies import make_policy
from ...ckpt.resolve import ResolvedStep, open_run_step
from ...ckpt.run_dir import RunDir
from ...ckpt.run_format import locate_run
from ...ckpt.provider import PARAM, rng_parts
from ...models.names import config_is_tied, group_of
from ..layout import CheckpointSource
from ..sources import open_source
from .merge import dir_bytes


@dataclass
class ImportedStep:
    step: int
    source: str
    input_bytes: int
    """Bytes of the checkpoint directory's files."""
    selected: list[str]
    """Groups the policy chose (all, under ``full``)."""
    written: list[str]
    """Chosen groups whose bytes were new (the rest equalled a stored version)."""
    bytes_written: int
    """New blob bytes plus the step's own files (``SaveReport.bytes_written``)."""


@dataclass
class ImportReport:
    run: str
    policy: str
    steps: list[ImportedStep]
    input_bytes: int
    """Sum of the imported checkpoints' file sizes."""
    stored_bytes: int
    """How much the run directory grew, measured on the disk."""

    def to_json(self) -> dict:
        return asdict(self)


class ImportProvider:
    """The checkpoint being imported as a ``StateProvider``: groups read on demand (the last one
    kept, so the size and change passes of a save read it once)."""

    def __init__(self, source: CheckpointSource, extra: dict[str, Any] | None = None):
        config = source.model_config()
        self.tied = config_is_tied(config) if config else False
        hf_names = getattr(source, "hf_names", None)
        if hf_names is None:
            raise ValueError(f"{source!r}: import reads HF model dirs, HF Trainer checkpoints, DeepSpeed "
                             "ZeRO saves and DCP dirs")
        self._groups: dict[str, list[str]] = {g: [] for g in source.groups()}
        for n in hf_names():
            g = group_of(n, self.tied)
            if g in self._groups:  # not e.g. a tied head's stored copy
                self._groups[g].append(n)
        self.use(source, extra)

    def use(self, source: CheckpointSource, extra: dict[str, Any] | None = None) -> None:
        """Serve ``source`` from now on; it must be a checkpoint of the same model. ``extra``:
        its ``extra_state()`` where already read (it reads files: scheduler, RNG, DCP values)."""
        if source.groups() != list(self._groups):
            raise ValueError(f"checkpoint groups {source.groups()} differ from the first "
                             f"checkpoint's {list(self._groups)}; import checkpoints of one model")
        self.source: CheckpointSource = source
        self._cached: tuple[str, dict[str, torch.Tensor]] | None = None
        self.extra: dict[str, Any] = source.extra_state() if extra is None else extra

    def _group(self, group: str) -> dict[str, torch.Tensor]:
        if self._cached is None or self._cached[0] != group:
            self._cached = None  # drop the previous group before reading the next
            self._cached = (group, self.source.load_group(group))
        return self._cached[1]

    def group_names(self) -> dict[str, list[str]]:
        return self._groups

    def params(self, group: str) -> dict[str, torch.Tensor]:
        return {k[len(PARAM):]: t for k, t in self._group(group).items() if k.startswith(PARAM)}

    def grads(self, group: str) -> dict[str, torch.Tensor]:
        return {}

    def optimizer_state(self, group: str) -> dict[str, torch.Tensor]:
        return {k: t for k, t in self._group(group).items() if not k.startswith(PARAM)}

    def load_group(self, group: str, tensors: dict[str, torch.Tensor]) -> None:
        raise ValueError("an imported checkpoint is read-only")

    def model_config(self) -> dict | None:
        return self.source.model_config()

    def param_groups_state(self) -> list[dict] | None:
        return self.extra.get("optimizer_param_groups")

    def rng_state(self) -> tuple[dict | None, dict[str, torch.Tensor]]:
        return rng_parts(self.extra.get("rng"))


class _SourceScheduler:
    """The imported checkpoint's LR-scheduler state, where a ``Checkpointer`` reads a scheduler."""

    def __init__(self, provider: ImportProvider):
        self.provider = provider

    def state_dict(self) -> dict | None:
        return self.provider.extra.get("scheduler")


def _ordered(paths: list[str | Path], config: dict | str | Path | None
             ) -> list[tuple[int, Path, CheckpointSource, dict[str, Any]]]:
    """(step, path, source, its extra state) oldest first: by the checkpoints' own steps when
    each has one, else in the order given, numbered from 1."""
    opened = []
    for p in paths:
        src = open_source(p, config=config)
        if isinstance(src, ResolvedStep):
            raise ValueError(f"{p} is a layer-wise run already; import reads HF model dirs, HF "
                             "Trainer checkpoints, ZeRO saves and DCP dirs (merge a run's step to one first)")
        extra = src.extra_state()
        opened.append((int(extra.get("step") or 0), Path(p), src, extra))
    steps = [o[0] for o in opened]
    if all(s > 0 for s in steps):
        if len(set(steps)) != len(steps):
            dup = sorted({s for s in steps if steps.count(s) > 1})
            raise ValueError(f"several checkpoints are at step(s) {dup}; import each step once")
        return sorted(opened, key=lambda o: o[0])
    if any(s > 0 for s in steps):
        raise ValueError("some checkpoints have a step (Trainer checkpoints) and some do not (HF "
                         "model dirs); import them separately, or all in the order given as HF dirs")
    return [(i + 1, p, src, extra) for i, (_, p, src, extra) in enumerate(opened)]


def import_checkpoints(paths: list[str | Path], run_dir: str | Path, policy: str = "full",
                       on_step: Callable[[ImportedStep], None] | None = None,
                       config: dict | str | Path | None = None,
                       expert_groups: bool = False) -> ImportReport:
    """Import ``paths`` into ``run_dir`` under ``policy`` (e.g. ``filter:threshold=0.01``).
    ``on_step``: after each commit. ``config``: HF config of DCP dirs without one.
    ``expert_groups``: version each routed expert on its own."""
    if not paths:
        raise ValueError("give at least one checkpoint to import")
    make_policy(policy)  # a mistyped policy fails before any checkpoint is read
    ordered = _ordered(paths, config)
    provider = ImportProvider(ordered[0][2], ordered[0][3])
    run = locate_run(run_dir)  # a `layerwise train` out_dir: its ckpt/
    if (run / "format.json").exists():
        store = RunDir.open(run)
        latest = store.latest_step()
        if latest is not None:
            if latest >= ordered[0][0]:
                raise ValueError(f"{run} already has step {latest}; import only checkpoints after "
                                 f"it (the first one here is step {ordered[0][0]}), or into a new run")
            stored = open_run_step(run, latest).groups()  # as layers: expert groups joined
            if stored != list(provider.group_names()):
                raise ValueError(f"{run} holds groups {stored}, the checkpoints "
                                 f"{list(provider.group_names())}: another model; use a new run")
    before = dir_bytes(run) if run.exists() else 0
    steps: list[ImportedStep] = []
    with Checkpointer(run, provider=provider, scheduler=_SourceScheduler(provider), policy=policy,
                      async_save=False, sync_copy=False, snapshot="sync",
                      tracker_log=False, expert_groups=expert_groups) as ck:
        if ck.has_checkpoint() and getattr(ck.policy, "uses_change", True):
            # continuing an import: changes are measured against the versions stored so far
            ck.reset_references(open_run_step(run))
        for step, path, src, extra in ordered:
            provider.use(src, extra)
            rep = ck.save(step, trainer_state=provider.extra.get("trainer_state"),
                          extra={"imported_from": str(path)})
            done = ImportedStep(step, str(path), dir_bytes(path), list(rep.selected),
                                list(rep.written or []), int(rep.bytes_written or 0))
            steps.append(done)
            if on_step is not None:
                on_step(done)
        policy_name = ck.policy.name
    return ImportReport(str(run), policy_name, steps, sum(s.input_bytes for s in steps),
                        dir_bytes(run) - before)
