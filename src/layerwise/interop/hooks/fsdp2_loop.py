"""Layer-wise checkpoints for FSDP2 training loops: each rank writes its shards of the chosen groups.

::

    model = AutoModelForCausalLM.from_config(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ckpt = fsdp_checkpointer("runs/a", model, opt, policy="filter", threshold=1e-3)  # every rank
    start = ckpt.load().step + 1 if ckpt.has_checkpoint() else 0   # any world size
    for step in range(start, steps):
        ...; opt.step(); opt.zero_grad()
        if step % 100 == 0:
            ckpt.save(step)                                         # every rank

FSDP2's ``Shard(0)`` (``torch.chunk`` sizes) makes a rank's local tensor one flat range of the
full tensor, and its padding is not in the local tensor, so it is never stored. ``step`` is
handed by the rank with the first rows only; unsharded parameters by rank 0, whole. Names are
HF's, so the run merges and serves recipes like any other."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from ...ckpt.checkpoint_config import DEFAULT_POLICY
from ...ckpt.collective import RankExchange, default_exchange
from ...ckpt.sharded_checkpointer import FlatShard, GroupReader, ShardedCheckpointer
from ...ckpt.provider import PARAM, ModuleStateProvider

STATE_ORDER = ("step", "exp_avg", "exp_avg_sq")
"""The order in which torch's AdamW creates a parameter's state entries."""


def local_range(p: torch.Tensor) -> tuple[torch.Tensor, int, bool]:
    """(this rank's elements of ``p`` as a 1-D view, their flat start in the full tensor,
    whether this rank hands the values every rank holds (the ``step`` scalar))."""
    if not isinstance(p, DTensor):
        return p.detach().reshape(-1), 0, True
    if tuple(p.placements) != (Shard(0),):
        raise ValueError(f"parameter of shape {tuple(p.shape)} is placed {p.placements}; the FSDP2 "
                         "hook reads Shard(0) on a 1-D mesh only (plain fully_shard, not HSDP)")
    mesh = p.device_mesh
    coord, world = mesh.get_coordinate()[0], mesh.size()
    local = p.to_local()
    rows = p.shape[0] if p.dim() else 1
    row_numel = math.prod(p.shape[1:]) if p.dim() else 1
    chunk = math.ceil(rows / world)
    row0 = min(coord * chunk, rows)
    if local.shape[0] != max(0, min(chunk, rows - row0)):
        raise ValueError(f"local shard of {tuple(p.shape)} has {local.shape[0]} rows on mesh rank "
                         f"{coord} of {world}; expected torch.chunk's {min(chunk, rows - row0)}")
    return local.detach().reshape(-1), row0 * row_numel, coord == 0


class FSDPShardProvider:
    """An FSDP2-sharded model (HF parameter names) and its torch optimizer, seen by one rank."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
        self.model, self.optimizer = model, optimizer
        self._module = ModuleStateProvider(model, optimizer)  # groups and hyper-parameters
        self.tied = self._module.tied
        self._param = dict(model.named_parameters())
        dist = torch.distributed
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0

    def group_names(self) -> list[str]:
        return list(self._module.group_names())

    def shards(self, group: str) -> list[FlatShard]:
        out = []
        for n in self._module.group_names()[group]:
            p = self._param[n]
            if not isinstance(p, DTensor) and self.rank != 0:
                continue  # a plain tensor is whole on every rank: rank 0 hands it
            flat, start, first = local_range(p)
            shape = tuple(p.shape)
            out.append(FlatShard(PARAM + n, flat, start, shape))
            st = self.optimizer.state.get(p) if self.optimizer is not None else None
            for k, v in (st or {}).items():
                if isinstance(v, torch.Tensor) and tuple(v.shape) == shape and v.dim():
                    out.append(FlatShard(f"{k}/{n}", local_range(v)[0], start, shape))
                elif first and (isinstance(v, torch.Tensor) and v.numel() == 1 or
                                isinstance(v, (int, float)) and not isinstance(v, bool)):
                    out.append(FlatShard(f"{k}/{n}", torch.as_tensor(v, dtype=torch.float32)
                                         .reshape(1), 0, ()))
        return out

    def load_shards(self, group: str, reader: GroupReader) -> None:
        stored = reader.keys()
        names = self._module.group_names().get(group)
        if names is None:
            raise ValueError(f"checkpoint group {group!r} does not exist in this model")
        extra = [k for k in stored if k.partition("/")[2] not in names]
        if extra:
            raise ValueError(f"checkpoint group {group!r} has tensors for unknown parameters {extra[:3]}")
        for n in names:
            p = self._param[n]
            if PARAM + n not in stored:
                raise ValueError(f"checkpoint group {group!r} has no weights for {n!r}")
            if tuple(stored[PARAM + n][0]) != tuple(p.shape):
                raise ValueError(f"{n}: checkpoint shape {tuple(stored[PARAM + n][0])} != model "
                                 f"shape {tuple(p.shape)}; saved from a different model configuration")
            flat, start, _ = local_range(p)
            stop = start + flat.numel()
            with torch.no_grad():
                flat.copy_(reader.read(PARAM + n, start, stop))
            if self.optimizer is None:
                continue
            stored_kinds = {k.partition("/")[0] for k in stored if k.partition("/")[2] == n} - {"param"}
            # torch's own order (step, exp_avg, exp_avg_sq): code that walks the state and
            # gathers each DTensor (a full state dict) must meet the same order on every rank
            kinds = sorted(stored_kinds, key=lambda k: (STATE_ORDER.index(k) if k in STATE_ORDER
                                                        else len(STATE_ORDER), k))
            if not kinds:
                self.optimizer.state.pop(p, None)
                continue
            st = self.optimizer.state[p]  # defaultdict: creates the entry
            for k in kinds:
                shape, _ = stored[f"{k}/{n}"]
                if tuple(shape) == tuple(p.shape) and len(shape):
                    if not isinstance(st.get(k), torch.Tensor):
                        st[k] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    with torch.no_grad():
                        local_range(st[k])[0].copy_(reader.read(f"{k}/{n}", start, stop))
                else:  # torch.optim keeps ``step`` as a 0-d fp32 CPU tensor (non-capturable)
                    st[k] = reader.read(f"{k}/{n}", 0, 1).to(torch.float32).reshape(())

    def model_config(self) -> dict | None:
        return self._module.model_config()

    def param_groups_state(self) -> list[dict] | None:
        return self._module.param_groups_state()

    def load_param_groups_state(self, saved: list[dict] | None) -> None:
        self._module.load_param_groups_state(saved)


def fsdp_checkpointer(run_dir: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer | None,
                     policy: str = DEFAULT_POLICY, *, exchange: RankExchange | None = None,
                     timeout_s: float = 600.0, **options: Any) -> ShardedCheckpointer:
    """A ``ShardedCheckpointer`` for an FSDP2 model on every rank of the default process group
    (its exchange: a gloo group of its own with ``timeout_s``; one process: no exchange).
    ``options``: ``scheduler=``, ``save_rng=`` and the policy's own (``threshold=``…)."""
    return ShardedCheckpointer(run_dir, FSDPShardProvider(model, optimizer),
                               exchange or default_exchange(timeout_s), policy,
                               **options)
