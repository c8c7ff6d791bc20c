"""Checkpoint errors: what went wrong, and that the last committed checkpoint is still good."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """Base class of every checkpoint failure that is not a user mistake (those are ValueError)."""


class CheckpointWriteError(CheckpointError):
    """A save failed (disk full, file too large, I/O error); nothing of it was committed."""


class CheckpointCorruptError(CheckpointError):
    """A stored file does not match its recorded checksum or size, or is missing."""


class StateModifiedError(CheckpointError):
    """Live state was written in place between ``save`` and its deferred snapshot (anything
    but the optimizer step, which waits for the snapshot); nothing of that save was committed."""
