"""A step's non-layer state (``state.json``, ``rng.safetensors``), captured when a save starts,
written before the manifest; shared by both checkpointers so their step files are the same bytes."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save as st_save

from .provider import capture_rng, jsonable, restore_rng, rng_dict
from .resolve import ResolvedStep
from .run_dir import RunDir
from .run_format import FORMAT_VERSION


@dataclass(frozen=True)
class StepState:
    """A step's files, captured: ``state.json``'s bytes and the torch RNG tensors."""

    state_json: bytes
    rng_tensors: dict[str, torch.Tensor]

    @classmethod
    def capture(cls, step: int, *, scheduler: Any, provider: Any, save_rng: bool,
                extra: dict | None, data_position: Any, trainer_state: dict | None,
                world_size: int | None = None) -> StepState:
        """The state now. ``world_size``: recorded by sharded saves. A provider with RNG states
        of its own (``rng_state()``: an imported checkpoint's) gives them instead of this
        process's."""
        state: dict[str, Any] = {"format_version": FORMAT_VERSION, "step": step}
        if world_size is not None:
            state["world_size"] = world_size
        state.update({
            "scheduler": jsonable(scheduler.state_dict()) if scheduler is not None else None,
            "optimizer_param_groups": (provider.param_groups_state()
                                       if hasattr(provider, "param_groups_state") else None),
            "data_position": jsonable(data_position),
            "trainer_state": jsonable(trainer_state),
            "extra": jsonable(extra),
        })
        rng_tensors: dict[str, torch.Tensor] = {}
        if save_rng:
            own = getattr(provider, "rng_state", None)
            state["rng"], rng_tensors = own() if own is not None else capture_rng()
        return cls((json.dumps(state) + "\n").encode(), rng_tensors)

    def write(self, store: RunDir, step: int) -> dict[str, dict]:
        """``state.json`` and ``rng.safetensors`` of ``step``, each durable; their manifest
        records."""
        files = {"state.json": store.write_step_file(step, "state.json", self.state_json)}
        if self.rng_tensors:
            files["rng.safetensors"] = store.write_step_file(
                step, "rng.safetensors", st_save(self.rng_tensors))
        return files


def restore_step_state(rs: ResolvedStep, *, scheduler: Any, provider: Any, save_rng: bool) -> dict:
    """Put a loaded step's scheduler, optimizer hyper-parameters and (with ``save_rng``) RNG
    states back; returns its ``state.json`` (for the data position, trainer state, extra)."""
    st = rs.state()
    if scheduler is not None and st.get("scheduler") is not None:
        scheduler.load_state_dict(st["scheduler"])
    if hasattr(provider, "load_param_groups_state"):
        provider.load_param_groups_state(st.get("optimizer_param_groups"))
    if save_rng:
        rng = rng_dict(st.get("rng"), rs._rng_tensors())
        if rng:
            restore_rng(rng)
    return st
