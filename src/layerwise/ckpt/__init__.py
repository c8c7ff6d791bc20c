"""Layer-wise checkpoints: write only the groups that changed, resume directly, never lose data.

Core pieces: ``groups`` (which parameters form a group), ``tracker`` (how much each group moved),
``policies`` (which groups a checkpoint writes), ``layer_store`` (content-addressed blobs +
per-step manifests, atomic commits), ``resolve`` (the state at step N, group by group),
``checkpointer`` (the plain-PyTorch API), ``state`` (the ``StateProvider`` protocol).
"""

from .checkpointer import CheckpointConfig, Checkpointer, LoadResult, SaveReport
from .errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from .groups import group_of, groups_of_model
from .layer_store import FORMAT_VERSION, LayerStore
from .policies import POLICIES, BasePolicy, make_policy, register_policy
from .resolve import GroupEntry, ResolvedStep, open_run_step
from .state import DictStateProvider, ModuleStateProvider, StateProvider

__all__ = [
    "CheckpointConfig", "Checkpointer", "LoadResult", "SaveReport",
    "CheckpointCorruptError", "CheckpointError", "CheckpointWriteError",
    "group_of", "groups_of_model", "FORMAT_VERSION", "LayerStore",
    "POLICIES", "BasePolicy", "make_policy", "register_policy",
    "GroupEntry", "ResolvedStep", "open_run_step",
    "DictStateProvider", "ModuleStateProvider", "StateProvider",
]
