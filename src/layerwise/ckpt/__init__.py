"""Layer-wise checkpoints: write only the groups that changed, resume directly, never lose data.

The checkpoint core, free of foreign formats (HF / Trainer formats, merge and recipes are
``layerwise.interop``; group names come from ``layerwise.models.names``). Entry points:
``checkpointer`` (the plain-PyTorch API) and ``sharded_checkpointer`` (each rank its shard),
both held to ``protocol``; ``run_dir`` (the run directory); ``resolve`` (the state at step N,
group by group); ``provider`` (the ``StateProvider`` protocol and blob keys).
"""

from .checkpoint_config import CheckpointConfig
from .checkpointer import Checkpointer
from .errors import CheckpointCorruptError, CheckpointError, CheckpointWriteError
from .policies import POLICIES, BasePolicy, make_policy, register_policy
from .resolve import GroupEntry, ResolvedStep, open_run_step
from .protocol import CheckpointerProtocol
from .provider import DictStateProvider, ModuleStateProvider, StateProvider
from .reports import LoadResult, SaveReport
from .run_dir import RunDir
from .run_format import FORMAT_VERSION

__all__ = [
    "CheckpointConfig", "Checkpointer", "CheckpointerProtocol", "LoadResult", "SaveReport",
    "CheckpointCorruptError", "CheckpointError", "CheckpointWriteError",
    "FORMAT_VERSION", "RunDir",
    "POLICIES", "BasePolicy", "make_policy", "register_policy",
    "GroupEntry", "ResolvedStep", "open_run_step",
    "DictStateProvider", "ModuleStateProvider", "StateProvider",
]
