"""Layer-wise checkpoints: write only the groups that changed, resume directly, never lose data.

Owns the checkpoint core, free of foreign formats (HF / Trainer formats, merge and recipes are
``layerwise.interop``; group names come from ``layerwise.models.names``):

- the API: ``protocol`` (``CheckpointerProtocol``: save, load, latest, close, which every
  checkpointer implements), ``reports`` (what a save and a load return, for all of them);
- saving: ``checkpointer`` (the plain-PyTorch API; ``checkpoint_config``),
  ``tracker`` (how much each group moved), ``policies`` (which groups a save writes),
  ``snapshot`` (deferred snapshots: helper thread, update gate), ``host_copies`` (the host
  buffer pool, the blob form of tensors), ``save_writer`` (the write, on the writer thread, and
  the several-writer protocol), ``commit`` and ``step_state`` (manifest, step files, committed
  versions; shared with ``sharded_checkpointer``);
- the run directory: ``run_dir`` (``RunDir``: steps, manifests, commit), ``blob_store``,
  ``blob_codec`` (fp32 weights delta-coded against a key frame),
  ``content_hash``, ``run_format`` (format.json), ``run_lock``, ``run_upkeep`` (verify, gc);
- reading: ``resolve`` (the state at step N, group by group);
- the live state: ``provider`` (the ``StateProvider`` protocol and blob keys),
  ``store_provider`` (the engine's HostStore), ``moments`` (8-bit moments);
- several ranks: ``collective`` (the ranks' exchange), ``shard_ranges`` and
  ``sharded_checkpointer`` (a group as one blob per rank).
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
