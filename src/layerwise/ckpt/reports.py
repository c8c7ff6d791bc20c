"""What ``save`` and ``load`` return, for both checkpointers. A ``ShardedCheckpointer`` save is
synchronous: ``blocked_s`` is the whole save, ``snapshot`` is ``"live"``, waits are 0."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SaveReport:
    step: int
    selected: list[str]
    """Groups the policy chose (in model order; filled when the snapshot is taken)."""
    blocked_s: float
    """Time ``save`` held the caller (includes ``wait_s``; not ``stall_s``)."""
    wait_s: float
    """Part of ``blocked_s`` spent waiting for the previous save to finish."""
    snapshot_bytes: int
    """Bytes of the chosen groups as the blobs store them, copied by the snapshot unless
    ``snapshot == "live"`` (filled when it is taken); with several writers (or shards), this
    rank's."""
    reasons: dict[str, str] = field(default_factory=dict)
    """Why each selected group was written: ``policies.REASONS`` (never saved, ``full_every``,
    ``max_staleness``, or the policy's own criterion)."""
    snapshot: str = "copy"
    """``"copy"``: the chosen groups were copied to host buffers and written from them (in the
    background with ``async_save``); ``"live"``: written from the live tensors before the next
    update, training waiting for the write: the configuration asks for no copy
    (``async_save=False, sync_copy=False``) or the copy would not fit in the RAM available
    (``ckpt.snapshot_fit``; logged once at WARNING). Filled when the snapshot is taken (after
    ``save`` returned, when ``deferred``). A sharded save: ``"live"``."""
    changes: dict[str, float] = field(default_factory=dict)
    """Every group's relative L2 change since its last saved version, as the policy saw it
    (``inf``: never saved; NaN: not measured, the policy does not read it). Filled with the
    snapshot, on the rank that chooses (a sharded save: every rank, the global change)."""
    deferred: bool = False
    """The statistics and the snapshot were taken on the helper thread, after ``save`` returned."""
    snapshot_s: float | None = None
    """Time to measure, choose and copy (inside ``blocked_s`` unless ``deferred``; a sharded
    save: to measure and choose, over the ranks)."""
    stall_s: float = 0.0
    """Time the training loop's next optimizer step waited for a deferred snapshot: blocked
    time outside ``save``."""
    write_s: float | None = None
    """Background time to write blobs, state and manifest (None until the checkpointer adopted
    the write: in ``wait``, the next ``save`` or ``close``; at once without ``async_save``). A
    sharded save: the write and commit over the ranks, inside ``blocked_s``."""
    written: list[str] | None = None
    """Groups whose bytes were new (the rest were deduplicated); on a rank other than 0 of
    several writers, of the groups it wrote; a sharded save: groups of which this rank wrote new
    shard bytes (None until adopted, as ``write_s``)."""
    bytes_written: int | None = None
    """New blob bytes plus the step's state files and manifest (rank 0's report only); a
    sharded save: the new shard bytes this rank wrote, without the step's files."""


@dataclass
class LoadResult:
    step: int
    """The committed step that was loaded."""
    extra: dict | None
    data_position: Any
    trainer_state: dict | None
    stale_groups: dict[str, int]
    """Groups whose version is older than ``step``: group -> step it was saved at."""
    world_size_saved: int | None = None
    """The world size of the newest sharded save in the loaded step (None: unsharded)."""
