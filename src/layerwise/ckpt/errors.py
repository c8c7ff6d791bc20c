"""Checkpoint errors: what went wrong, and that the last committed checkpoint is still good."""

from __future__ import annotations

import errno
from pathlib import Path


class CheckpointError(RuntimeError):
    """Base class of every checkpoint failure that is not a user mistake (those are ValueError)."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, file too large, I/O error); nothing of it was committed."""


class CheckpointCorruptError(CheckpointError):
    """A stored file does not match its recorded checksum or size, or is missing."""


class StateModifiedError(CheckpointError):
    """Live state was written in place between ``save`` and its deferred snapshot (anything
    but the optimizer step, which waits for the snapshot); nothing of that save was committed."""


def write_error(e: OSError, path: Path) -> CheckpointWriteError:
    """The error a save raises for an OS error writing ``path``: why, in words, and what to do."""
    why = {
        errno.ENOSPC: "the disk is full",
        errno.EFBIG: "the file size limit was reached (ulimit -f / RLIMIT_FSIZE)",
        errno.EDQUOT: "the disk quota is exhausted",
    }.get(e.errno or 0, e.strerror or str(e))
    return CheckpointWriteError(
        f"checkpoint write to {path} failed: {why}. Nothing of this save was committed; the "
        "previous committed checkpoint is intact. Free space (e.g. `layerwise ckpt gc RUN --keep K`) "
        "or save elsewhere, then retry."
    )
