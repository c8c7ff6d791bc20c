"""Layer-wise checkpoints: write only the groups that changed, resume directly, never lose data.

Owns the checkpoint core, free of foreign formats: ``tracker`` (how much each group moved),
``policies`` (which groups a checkpoint writes), ``run_dir`` (content-addressed blobs + per-step
manifests, atomic commits), ``resolve`` (the state at step N, group by group), ``checkpointer``
(the plain-PyTorch API), ``provider`` (the ``StateProvider`` protocol and blob keys) and
``store_provider`` (the engine's HostStore as a provider); ``collective``, ``shard_ranges`` and
``sharded_checkpointer`` for saves written by every rank of a sharded loop (run format 4: a
group as one blob per rank). Group names come from ``layerwise.models.names``; HF / Trainer formats, merge and
recipes are ``layerwise.interop``.
"""

from .checkpoint_config import CheckpointConfig
from .checkpointer import Checkpointer, LoadResult, SaveReport
from .errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from .policies import POLICIES, BasePolicy, make_policy, register_policy
from .resolve import GroupEntry, ResolvedStep, open_run_step
from .provider import DictStateProvider, ModuleStateProvider, StateProvider
from .run_dir import RunDir
from .run_format import FORMAT_VERSION

__all__ = [
    "CheckpointConfig", "Checkpointer", "LoadResult", "SaveReport",
    "CheckpointCorruptError", "CheckpointError", "CheckpointWriteError",
    "FORMAT_VERSION", "RunDir",
    "POLICIES", "BasePolicy", "make_policy", "register_policy",
    "GroupEntry", "ResolvedStep", "open_run_step",
    "DictStateProvider", "ModuleStateProvider", "StateProvider",
]
