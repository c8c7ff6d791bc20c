"""DeepSpeed ZeRO checkpoints (stages 1, 2 and 3): read a layer group at a time, and written by
filling a template save's layout (``docs/formats.md``).

Reads are memory-mapped and checked against the model of ``config.json``: a save that does not
fit is refused, never mis-assigned. Pickles load ``weights_only`` with the four DeepSpeed classes
mapped to inert stand-ins: no DeepSpeed, no code from the file. :func:`write_zero` overwrites a
copied template's master, moments and step in place, so DeepSpeed's ``load_checkpoint`` resumes."""

from __future__ import annotations

import dataclasses
import enum
import math
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from ...models.names import group_sort_key, groups_of_model
from ...util.atomic import atomic_write_text
from ...util.jsonable import jsonable
from ...util.safe_load import load_data_file
from ..hf.model_dir import read_json
from ..layout import CONFIG_NAME, EXP_AVG, EXP_AVG_SQ, PARAM, STEP, CheckpointSource, meta_model

LATEST_NAME = "latest"
_OPTIM_RE = re.compile(r"^(?:bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_MODEL_RE = re.compile(r"^(?:zero_pp_rank_(\d+)_)?mp_rank_(\d+)_model_states\.pt$")


# ----- the classes ZeRO pickles, as inert stand-ins ----------------------------------------

class _ZeroStage(enum.IntEnum):
    disabled = 0
    optimizer_states = 1
    gradients = 2
    weights = 3


@dataclasses.dataclass
class _FragmentAddress:
    numel: int = 0
    start: int = 0


class _LossScaler:
    """State only (fp16 loss scaling); never used here."""


_ALLOWED = [
    (_ZeroStage, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (_FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (_LossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
]


def load_zero_file(path: Path, writable: bool = False) -> dict:
    """One ZeRO ``.pt`` file, memory-mapped, as data only (see the module docstring).
    ``writable``: mapped shared, so writes into its tensors go to the file."""
    return load_data_file(path, mmap=True, writable=writable, allow=_ALLOWED)


def is_zero_checkpoint(path: Path) -> bool:
    """A ``global_stepN`` dir, or a DeepSpeed save dir whose ``latest`` names one."""
    if any(_OPTIM_RE.match(p.name) for p in path.glob("*_optim_states.pt")):
        return True
    latest = path / LATEST_NAME
    return latest.is_file() and (path / latest.read_text().strip()).is_dir()


def _rank_files(tag_dir: Path, pattern: re.Pattern, what: str) -> list[Path]:
    by_rank: dict[int, Path] = {}
    for p in tag_dir.iterdir():
        m = pattern.match(p.name)
        if not m:
            continue
        if int(m.group(2)) != 0:
            raise ValueError(f"{p}: model-parallel rank {m.group(2)}; layerwise reads data-parallel ZeRO "
                             "checkpoints only (no tensor or pipeline parallelism)")
        by_rank[int(m.group(1) or 0)] = p
    if not by_rank:
        raise ValueError(f"{tag_dir} has no DeepSpeed {what} files")
    ranks = sorted(by_rank)
    if ranks != list(range(len(ranks))):
        raise ValueError(f"{tag_dir}: {what} files for ranks {ranks}; some ranks' files are missing")
    return [by_rank[r] for r in ranks]


@dataclasses.dataclass(frozen=True)
class _Slot:
    """Where one parameter lives in its param group's flat layout."""

    group: int
    offset: int
    """Stages 1/2: start in the group's whole flat vector; stage 3: start in each rank's flat."""
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


class ZeroCheckpointSource:
    """A DeepSpeed ZeRO checkpoint as a ``CheckpointSource``: ``path`` is ``global_stepN`` or the
    dir whose ``latest`` names it; ``config`` defaults to a ``config.json`` there or in the parent.
    """

    def __init__(self, path: str | Path, config: dict | None = None, *, writable: bool = False):
        path = Path(path)
        latest = path / LATEST_NAME
        if not any(_OPTIM_RE.match(p.name) for p in path.glob("*_optim_states.pt")) and latest.is_file():
            path = path / latest.read_text().strip()
        self.path = path
        if config is None:
            for d in (path, path.parent):
                if (d / CONFIG_NAME).is_file():
                    config = read_json(d / CONFIG_NAME)
                    break
        if config is None:
            raise ValueError(f"no {CONFIG_NAME} in {path} or {path.parent}; a ZeRO checkpoint records no "
                             "architecture, so put the model's config.json beside it (or pass config=)")
        self._config = config
        self._optim_files = _rank_files(path, _OPTIM_RE, "optimizer-state (*_optim_states.pt)")
        self._model_files = _rank_files(path, _MODEL_RE, "model-state (*_model_states.pt)")
        self._optim = [load_zero_file(f, writable)["optimizer_state_dict"] for f in self._optim_files]
        self._model_state = load_zero_file(self._model_files[0], writable)
        stages = [int(o["zero_stage"]) for o in self._optim]
        if len(set(stages)) > 1:
            raise ValueError(f"{path}: the ranks' optimizer files have ZeRO stages {stages}; the files do "
                             "not belong together (copied from different saves?)")
        self.stage = stages[0]
        if self.stage not in (1, 2, 3):
            raise ValueError(f"{path}: ZeRO stage {self.stage}; layerwise reads stages 1, 2 and 3")
        counts = self._optim[0]["partition_count"]
        self.world_size = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
        if len(self._optim_files) != self.world_size:
            raise ValueError(f"{path}: partition_count says {self.world_size} ranks but there are "
                             f"{len(self._optim_files)} optimizer-state files")
        self._model = meta_model(config)
        self._groups = groups_of_model(self._model)
        self._slots = self._layout()

    # ----- layout and checks -------------------------------------------------------------

    def _flat(self, rank: int, group: int) -> torch.Tensor:
        o = self._optim[rank]
        return o["fp32_flat_groups"][group] if self.stage == 3 else o["single_partition_of_fp32_groups"][group]

    def _inner(self, rank: int) -> dict:
        """The wrapped torch optimizer's state dict."""
        o = self._optim[rank]
        return o["optimizer_state_dict"] if self.stage == 3 else o["base_optimizer_state"]

    def _moments(self, rank: int, group: int) -> dict[str, torch.Tensor]:
        inner = self._inner(rank)
        (pid,) = inner["param_groups"][group]["params"]  # ZeRO's optimizer sees one flat param a group
        return inner["state"].get(pid, {})

    def _layout(self) -> dict[str, _Slot]:
        shapes: list[dict[str, Any]] = self._model_state["param_shapes"]
        frozen = self._model_state.get("frozen_param_shapes") or {}
        if frozen:
            raise ValueError(f"{self.path}: {len(frozen)} frozen parameter(s) (e.g. {next(iter(frozen))}); "
                             "layerwise reads ZeRO checkpoints of fully trained models only")
        expected = {n: tuple(p.shape) for n, p in self._model.named_parameters()}
        slots: dict[str, _Slot] = {}
        for g, group_shapes in enumerate(shapes):
            pads = None
            if self.stage != 3:
                pads = (self._optim[0].get("param_alignment_paddings") or [None] * len(shapes))[g]
            offset = 0
            for i, (name, shape) in enumerate(group_shapes.items()):
                shape = tuple(int(s) for s in shape)
                if name not in expected:
                    raise ValueError(f"{self.path}: parameter {name!r} is not in the model of config.json "
                                     "(another model, or a wrapper that renames parameters)")
                if shape != expected[name]:
                    raise ValueError(f"{self.path}: {name} has shape {shape} in the checkpoint, "
                                     f"{expected[name]} in config.json's model")
                slots[name] = _Slot(g, offset, shape)
                numel = math.prod(shape)
                offset += math.ceil(numel / self.world_size) if self.stage == 3 else numel
                if pads is not None:
                    offset += int(pads[i])
            self._check_group_size(g, offset)
        missing = sorted(set(expected) - set(slots))
        if missing:
            raise ValueError(f"{self.path}: no state for {len(missing)} parameter(s) of config.json's model, "
                             f"e.g. {missing[0]}")
        if self.stage != 3:
            self._check_fragments(slots)
        return slots

    def _check_group_size(self, group: int, used: int) -> None:
        sizes = [self._flat(r, group).numel() for r in range(self.world_size)]
        if self.stage == 3:
            short = [r for r, n in enumerate(sizes) if n < used]
            what = f"each rank needs {used} elements"
        else:  # equal partitions; the last one is saved without the group's padding
            fits = len(set(sizes[:-1])) <= 1 and sizes[-1] <= sizes[0] and sum(sizes) >= used
            short = [] if fits else list(range(len(sizes)))
            what = f"{used} elements in equal partitions (the last one may be shorter)"
        if short:
            raise ValueError(f"{self.path}: param group {group}'s partitions hold {sizes} elements, but the "
                             f"layout of param_shapes needs {what}; the files do not belong together")

    def _check_fragments(self, slots: dict[str, _Slot]) -> None:
        """Stages 1/2: each rank's recorded fragments must sit where the shapes put them."""
        for r in range(self.world_size):
            mappings = self._optim[r].get("param_slice_mappings")
            if not mappings:
                return  # older DeepSpeed: nothing recorded to check against
            for g, frags in enumerate(mappings):
                part = self._flat(0, g).numel()  # every partition's size but the (shorter) last
                for name, frag in frags.items():
                    s = slots.get(name)
                    lo = r * part + int(frag.start)
                    if s is None or s.group != g or not (s.offset <= lo and lo + int(frag.numel) <= s.offset + s.numel):
                        raise ValueError(f"{self.path}: rank {r}'s fragment of {name} (elements {lo}.."
                                         f"{lo + int(frag.numel)}) is not where param_shapes puts it; "
                                         "the checkpoint's layout is not the one layerwise expects")

    # ----- reading -----------------------------------------------------------------------

    def _gather(self, slot: _Slot, flats: list[torch.Tensor]) -> torch.Tensor:
        parts = [dst for dst, _, _ in self._pieces(slot, flats)]
        return torch.cat(parts).to(torch.float32).view(slot.shape).clone()

    def _pieces(self, slot: _Slot, flats: list[torch.Tensor]) -> list[tuple[torch.Tensor, int, int]]:
        """(rank's flat, start, end in the parameter's elements) for each piece of ``slot``."""
        n = slot.numel
        if self.stage == 3:
            piece = math.ceil(n / self.world_size)
            return [(f[slot.offset:slot.offset + min(piece, max(n - r * piece, 0))], r * piece,
                     min(n, (r + 1) * piece)) for r, f in enumerate(flats)]
        part = flats[0].numel()
        out = []
        for r in range(slot.offset // part, (slot.offset + n - 1) // part + 1):
            lo, hi = max(slot.offset, r * part), min(slot.offset + n, (r + 1) * part)
            out.append((flats[r][lo - r * part:hi - r * part], lo - slot.offset, hi - slot.offset))
        return out

    def _scatter(self, slot: _Slot, flats: list[torch.Tensor], value: torch.Tensor) -> None:
        flat_value = value.reshape(-1)
        for dst, lo, hi in self._pieces(slot, flats):
            dst.copy_(flat_value[lo:hi])

    def put_group(self, group: str, tensors: dict[str, torch.Tensor], step: float) -> None:
        """Write one group's weights and moments into the mapped files (``writable=True``)."""
        with torch.no_grad():
            for name in self._groups[group]:
                slot = self._slots[name]
                for key in (PARAM, EXP_AVG, EXP_AVG_SQ):
                    if key + name not in tensors:
                        raise ValueError(f"the source has no {key.rstrip('/')} for {name}; a DeepSpeed "
                                         "checkpoint needs weights and both AdamW moments of every parameter")
                flats = [self._flat(r, slot.group) for r in range(self.world_size)]
                self._scatter(slot, flats, tensors[PARAM + name])
                moments = [self._moments(r, slot.group) for r in range(self.world_size)]
                if not all("exp_avg" in m and "exp_avg_sq" in m for m in moments):
                    raise ValueError(f"{self.path} has no optimizer state for {name}: a template must be "
                                     "saved after the run's first optimizer step")
                for key, field in ((EXP_AVG, "exp_avg"), (EXP_AVG_SQ, "exp_avg_sq")):
                    self._scatter(slot, [m[field] for m in moments], tensors[key + name])
                for m in moments:
                    if isinstance(m.get("step"), torch.Tensor):
                        m["step"].fill_(step)
                module = self._model_state.get("module") or {}
                if self.stage != 3 and name in module:
                    module[name].copy_(tensors[PARAM + name])

    def groups(self) -> list[str]:
        return sorted(self._groups, key=group_sort_key)

    def hf_names(self) -> list[str]:
        """The parameters the save holds (a tied head once, as the embedding)."""
        return list(self._slots)

    def load_group(self, group: str) -> dict[str, torch.Tensor]:
        if group not in self._groups:
            raise KeyError(f"no group {group!r} in {self.path}; groups: {', '.join(self.groups())}")
        out: dict[str, torch.Tensor] = {}
        for name in self._groups[group]:
            slot = self._slots[name]
            out[PARAM + name] = self._gather(slot, [self._flat(r, slot.group) for r in range(self.world_size)])
            moments = [self._moments(r, slot.group) for r in range(self.world_size)]
            if all("exp_avg" in m and "exp_avg_sq" in m for m in moments):
                out[EXP_AVG + name] = self._gather(slot, [m["exp_avg"] for m in moments])
                out[EXP_AVG_SQ + name] = self._gather(slot, [m["exp_avg_sq"] for m in moments])
                out[STEP + name] = torch.as_tensor(moments[0].get("step", 0), dtype=torch.float32).reshape(()).clone()
        return out

    def model_config(self) -> dict | None:
        return dict(self._config)

    def extra_state(self) -> dict:
        sched = self._model_state.get("lr_scheduler")
        return {"step": int(self._model_state.get("global_steps") or 0),
                "scheduler": jsonable(sched) if sched else None, "rng": None, "trainer_state": None,
                "optimizer_param_groups": [{k: v for k, v in g.items() if k != "params"}
                                           for g in self._inner(0)["param_groups"]]}


# ----- writing -----------------------------------------------------------------------------


def write_zero(source: CheckpointSource, out_dir: Path, config: dict, extra: dict, *,
               template: str | Path) -> dict[str, Any]:
    """``source`` in a copy of the ZeRO save ``template`` under the empty ``out_dir``
    (``out_dir/<tag>/``, ``out_dir/latest``; config files apart); a summary."""
    tmpl = ZeroCheckpointSource(template, config=config)
    tag_dir = Path(out_dir) / tmpl.path.name
    tag_dir.mkdir()
    for f in [*tmpl._optim_files, *tmpl._model_files]:
        shutil.copyfile(f, tag_dir / f.name)
    target = ZeroCheckpointSource(tag_dir, config=config, writable=True)
    written_step = float(extra.get("step") or 0)  # ZeRO keeps one step per param group
    steps: set[float] = set()
    for group in source.groups():
        tensors = source.load_group(group)
        steps |= {float(t) for k, t in tensors.items() if k.startswith(STEP)}
        target.put_group(group, tensors, step=written_step)
    del target  # unmap; merge fsyncs the files, which writes the shared pages back
    atomic_write_text(Path(out_dir) / LATEST_NAME, tmpl.path.name)
    return {"step": int(tmpl._model_state.get("global_steps") or 0),
            "stage": tmpl.stage, "world_size": tmpl.world_size, "template": str(tmpl.path),
            "weight_files": sorted(f.name for f in tag_dir.iterdir()),
            "optimizer_step_written": written_step, "optimizer_steps_in_source": sorted(steps)}
