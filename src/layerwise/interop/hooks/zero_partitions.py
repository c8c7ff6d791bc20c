"""A live DeepSpeed ZeRO engine's partitions (stages 1, 2 and 3), seen per layer-wise group.

A :class:`Piece` says which elements of a parameter's flattened full tensor a rank holds and
where in its flat partition (stages 1/2: ``param._hp_mapping``; stage 3: ``ds_tensor`` pieces).
Every piece is taken from DeepSpeed's metadata and checked against the layout the shapes give,
so a DeepSpeed whose layout differs is refused, never read by blind index. ``LiveZeroState`` is
the sharded save's ``ShardProvider``; ``finish_restore`` rebuilds the module's weights after a
load, as DeepSpeed's own load does."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ...ckpt.sharded_checkpointer import FlatShard, GroupReader
from ...models.names import groups_of_model, model_is_tied
from ...util.jsonable import jsonable
from ..layout import EXP_AVG, EXP_AVG_SQ, PARAM, STEP

MOMENTS = ((EXP_AVG, "exp_avg"), (EXP_AVG_SQ, "exp_avg_sq"))
"""Blob key prefix -> the torch AdamW state key."""


@dataclass(frozen=True)
class Piece:
    """The elements ``[start, start + numel)`` of one parameter's flattened full tensor that this
    rank holds, at ``offset`` in its flat partition number ``flat``."""

    shape: tuple[int, ...]
    start: int
    numel: int
    flat: int
    offset: int

    @property
    def stop(self) -> int:
        return self.start + self.numel


def _layout_error(what: str) -> ValueError:
    return ValueError(f"DeepSpeed's partition metadata disagrees with the layout of its parameters: "
                      f"{what}. layerwise reads this DeepSpeed version's ZeRO layout (stages 1-3, data "
                      "parallel, no offload); report the DeepSpeed version if it changed")


class LiveZeroState:
    """One rank's view of a live ZeRO optimizer (``engine.optimizer``) over ``module``
    (``engine.module``): its pieces of every parameter, by group."""

    def __init__(self, module: nn.Module, optimizer: Any):
        if hasattr(optimizer, "fp32_partitioned_groups_flat"):
            self.stage = 3
            self.flats: list[torch.Tensor] = list(optimizer.fp32_partitioned_groups_flat)
            group = optimizer.dp_process_group
        elif hasattr(optimizer, "single_partition_of_fp32_groups"):
            self.stage = 2 if optimizer.partition_gradients else 1
            self.flats = list(optimizer.single_partition_of_fp32_groups)
            group = optimizer.real_dp_process_group[0]
        else:
            raise ValueError(f"{type(optimizer).__name__} is not a DeepSpeed ZeRO optimizer; the layer-wise "
                             "DeepSpeed hook needs zero_optimization stage 1, 2 or 3")
        if getattr(optimizer, "cpu_offload", False) or getattr(optimizer, "offload_optimizer", False):
            raise ValueError("the layer-wise DeepSpeed hook does not support optimizer offload (its state "
                             "lives in DeepSpeed's swap buffers); switch offload_optimizer off")
        self.module, self.optimizer = module, optimizer
        self.rank, self.world_size = dist.get_rank(group=group), dist.get_world_size(group=group)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.groups = groups_of_model(module)
        self.pieces: dict[str, Piece] = {}
        self._restored_steps: dict[int, float] = {}
        """Per flat: the newest step a restore brought so far."""
        self.shapes: dict[str, tuple[int, ...]] = {}
        if self.stage == 3:
            self._map_stage3()
        else:
            self._map_stage12()
        missing = [n for names in self.groups.values() for n in names if n not in self.shapes]
        if missing:
            raise ValueError(f"{len(missing)} parameter(s) of the model are not in DeepSpeed's optimizer, "
                             f"e.g. {missing[0]}; the hook needs every parameter trained (no frozen ones)")

    # ----- the layout, from DeepSpeed's metadata, checked ----------------------------------

    def _name(self, p: torch.Tensor) -> str:
        name = self.names.get(id(p))
        if name is None:
            raise ValueError("DeepSpeed's optimizer holds a parameter that is not in the module; pass the "
                             "module the engine wraps (engine.module)")
        return name

    def _map_stage12(self) -> None:
        o = self.optimizer
        for i, params in enumerate(o.bit16_groups):
            flat = self.flats[i]
            size = o.bit16_groups_flat[i].numel() // o.partition_count[i]
            if flat.numel() != size:
                raise _layout_error(f"param group {i}: the partition holds {flat.numel()} elements, "
                                    f"the flat group {o.bit16_groups_flat[i].numel()} / {o.partition_count[i]}")
            lo, hi = self.rank * size, (self.rank + 1) * size
            offsets = {id(p): off for p, off in zip(o.round_robin_bit16_groups[i], o.round_robin_bit16_offsets[i])}
            for p in params:
                name, shape = self._name(p), tuple(p.shape)
                self.shapes[name] = shape
                numel, at = math.prod(shape), offsets[id(p)]
                overlap = max(0, min(at + numel, hi) - max(at, lo))
                m = getattr(p, "_hp_mapping", None)
                if m is None:
                    if overlap:
                        raise _layout_error(f"{name} has {overlap} elements in rank {self.rank}'s partition "
                                            "but no fragment mapping")
                    continue
                lp, hp = m.lp_fragment_address, m.hp_fragment_address
                if (lp.numel != hp.numel or lp.numel != overlap or lo + hp.start != at + lp.start
                        or lp.start + lp.numel > numel or hp.start + hp.numel > size
                        or m.hp_fragment.data_ptr() != flat.data_ptr() + hp.start * flat.element_size()):
                    raise _layout_error(
                        f"{name}: fragment (param elements {lp.start}+{lp.numel}, partition elements "
                        f"{hp.start}+{hp.numel}) is not where offset {at} in param group {i} puts it "
                        f"in rank {self.rank}'s partition [{lo}, {hi})")
                self.pieces[name] = Piece(shape, lp.start, lp.numel, i, hp.start)

    def _map_stage3(self) -> None:
        o = self.optimizer
        for i, params in enumerate(o.fp16_groups):
            offset = 0
            for p in params:
                name, shape = self._name(p), tuple(p.ds_shape)
                self.shapes[name] = shape
                numel = math.prod(shape)
                piece = math.ceil(numel / self.world_size)
                group, at, n = o.grad_position[o.get_param_id(p)]
                if (group, at, n) != (i, offset, piece) or p.ds_numel != numel or p.ds_tensor.numel() != piece:
                    raise _layout_error(
                        f"{name} ({numel} elements) is recorded at sub-group {group}, offset {at}, {n} "
                        f"elements ({p.ds_tensor.numel()} in its ds_tensor); its shape puts it at sub-group "
                        f"{i}, offset {offset}, {piece} elements")
                start = self.rank * piece
                if start < numel:
                    self.pieces[name] = Piece(shape, start, min(numel, start + piece) - start, i, offset)
                offset += piece
            if offset > self.flats[i].numel():
                raise _layout_error(f"sub-group {i}'s pieces need {offset} elements, its fp32 partition "
                                    f"holds {self.flats[i].numel()}")

    # ----- the ShardProvider protocol (ckpt.sharded_checkpointer) -----------------------

    def group_names(self) -> list[str]:
        return list(self.groups)

    @property
    def tied(self) -> bool:
        return model_is_tied(self.module)

    def model_config(self) -> dict | None:
        config = getattr(self.module, "config", None)
        return config.to_dict() if hasattr(config, "to_dict") else None

    def param_groups_state(self) -> list[dict]:
        """The AdamW hyper-parameters of each of DeepSpeed's param groups (lr moves with a
        scheduler), as a Trainer checkpoint's optimizer keeps them."""
        return [{k: jsonable(v) for k, v in pg.items() if k != "params"}
                for pg in self.optimizer.optimizer.param_groups]

    def load_param_groups_state(self, saved: list[dict] | None) -> None:
        groups = self.optimizer.optimizer.param_groups
        if not saved:
            return
        if len(saved) != len(groups):
            raise ValueError(f"the checkpoint has {len(saved)} optimizer param groups, DeepSpeed's optimizer "
                             f"{len(groups)}; build the engine's param groups as when saving")
        for pg, s in zip(groups, saved):
            pg.update({k: tuple(v) if isinstance(pg.get(k), tuple) else v for k, v in s.items()})

    def ranges(self) -> dict[str, tuple[int, int]]:
        """This rank's ``[start, stop)`` of every parameter it holds a piece of."""
        return {n: (p.start, p.stop) for n, p in self.pieces.items()}

    def check_cover(self, ranges_by_rank: list[dict[str, tuple[int, int]]]) -> None:
        """Every rank's ``ranges()``: each parameter's pieces must tile it exactly."""
        for name, shape in self.shapes.items():
            spans = sorted(r[name] for r in ranges_by_rank if name in r)
            bounds = [0] + [b for span in spans for b in span] + [math.prod(shape)]
            # tiled exactly: each piece starts where the previous ended, none is empty
            if bounds[1:-1:2] != bounds[:-2:2] or any(hi <= lo for lo, hi in spans) or bounds[-2] != bounds[-1]:
                raise _layout_error(f"the ranks' pieces of {name} {spans} do not cover its "
                                    f"{math.prod(shape)} elements exactly once")

    # ----- state ---------------------------------------------------------------------------

    def _state(self, flat: int, create: bool = False) -> dict:
        """The AdamW state of one flat. ``create``: a fresh engine has none before its first
        step; make the entries torch's AdamW would (zero moments, step 0) for a restore."""
        inner = self.optimizer.optimizer
        state = inner.state.get(self.flats[flat])
        if create and not state and isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            if any(g.get(k) for g in inner.param_groups for k in ("amsgrad", "fused", "capturable")):
                raise ValueError("the layer-wise DeepSpeed hook restores plain AdamW state only (no "
                                 "amsgrad, fused or capturable); take one step before loading")
            flat_t = self.flats[flat]
            state = inner.state[flat_t] = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(flat_t),
                                           "exp_avg_sq": torch.zeros_like(flat_t)}
        if not state or "exp_avg" not in state or "exp_avg_sq" not in state:
            raise ValueError("DeepSpeed's optimizer has no AdamW state (exp_avg, exp_avg_sq) yet: save "
                             "after the first optimizer step (engine.step()), or load into an engine "
                             "that uses torch's Adam/AdamW (torch_adam: true) or has taken a step")
        return state

    def _step(self, flat: int) -> float:
        step = self._state(flat).get("step", 0)
        return float(step.item() if isinstance(step, torch.Tensor) else step)

    def shards(self, group: str) -> list[FlatShard]:
        """This rank's pieces of ``group``: fp32 weights and both moments (views of the live
        partitions) and, from the rank holding each parameter's first element, its step."""
        out: list[FlatShard] = []
        for name in self.groups[group]:
            pc = self.pieces.get(name)
            if pc is None:
                continue
            state = self._state(pc.flat)
            sources = [(PARAM, self.flats[pc.flat])] + [(k, state[field]) for k, field in MOMENTS]
            for key, flat in sources:
                out.append(FlatShard(key + name, flat.narrow(0, pc.offset, pc.numel).detach(), pc.start, pc.shape))
            if pc.start == 0:  # one rank hands the step every rank holds
                out.append(FlatShard(STEP + name, torch.tensor([self._step(pc.flat)]), 0, ()))
        return out

    def load_shards(self, group: str, reader: GroupReader) -> None:
        """Read this rank's pieces of a stored ``group`` (any world size) into the partitions and
        moments; a flat's one step becomes the newest its parameters bring. Weights follow in
        ``finish_restore``."""
        keys = reader.keys()
        with torch.no_grad():
            for name in self.groups[group]:
                pc = self.pieces.get(name)
                if pc is None:
                    continue
                for key in (PARAM, EXP_AVG, EXP_AVG_SQ, STEP):
                    shape = keys.get(key + name, (None,))[0]
                    if shape != (pc.shape if key != STEP else ()):
                        raise ValueError(f"the checkpoint's group {group!r} has {key.rstrip('/')} of {name} "
                                         f"with shape {shape}, the engine needs {pc.shape if key != STEP else ()}; "
                                         "a DeepSpeed engine needs the weights, both AdamW moments and the step "
                                         "of the model it was saved from")
                state = self._state(pc.flat, create=True)
                targets = [(PARAM, self.flats[pc.flat])] + [(k, state[field]) for k, field in MOMENTS]
                for key, flat in targets:
                    flat.narrow(0, pc.offset, pc.numel).copy_(reader.read(key + name, pc.start, pc.stop))
                step = float(reader.read(STEP + name, 0, 1)[0])
                self._restored_steps[pc.flat] = max(step, self._restored_steps.get(pc.flat, step))
                if isinstance(state.get("step"), torch.Tensor):
                    state["step"].fill_(self._restored_steps[pc.flat])
                else:
                    state["step"] = self._restored_steps[pc.flat]

    def begin_restore(self) -> None:
        """Before ``load_shards``: stage 3 partitions every parameter (as DeepSpeed's load does)."""
        self._restored_steps.clear()
        if self.stage == 3:
            self.optimizer.checkpoint_event_prologue()

    @torch.no_grad()
    def finish_restore(self) -> None:
        """After every group's ``load_shards``: rebuild the module's (low-precision) weights
        from the fp32 partitions on every rank (a collective), as DeepSpeed's own load does."""
        o = self.optimizer
        if self.stage != 3:
            o.update_lp_params()  # each rank's partition into the bit16 flat, then all-gather
            return
        for i, fp32 in enumerate(self.flats):
            if fp32.numel():
                o.fp16_partitioned_groups_flat[i].data.copy_(fp32.data)
            parts = o.unflatten(o.fp16_partitioned_groups_flat[i], o.fp16_partitioned_groups[i])
            for ds_tensor, part in zip(o.fp16_partitioned_groups[i], parts):
                ds_tensor.data = part.data
        o.checkpoint_event_epilogue()  # gathers the persistent (always full) parameters again
