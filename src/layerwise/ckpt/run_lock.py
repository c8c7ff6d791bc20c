"""The run's writer lock: one save or ``gc`` writes a run directory at a time (across processes)."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def run_lock(root: Path, blocking: bool = True) -> Iterator[None]:
    """Hold ``root/.lock`` exclusively (``flock``: released when the process dies). Non-blocking
    raises if another writer holds it."""
    fd = os.open(root / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            raise ValueError(
                f"{root} is being written by another process (a save or gc is running); "
                "retry when it has finished"
            ) from None
        yield
    finally:
        os.close(fd)  # closing releases the flock
