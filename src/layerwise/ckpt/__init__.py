"""Layer-wise checkpoints: write only the groups that changed, resume directly, never lose data.

The core, free of foreign formats (those are ``layerwise.interop``); the modules are mapped in
``docs/architecture.md``."""

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
