"""One run at a time in a directory: an exclusive ``flock`` on ``DIR/.train.lock``, naming its
holder. The kernel releases it however the holder ends, so a leftover file never blocks. Counted
within a process: the command takes it early and the loop again, harmlessly."""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

LOCK_NAME = ".train.lock"

_held: dict[Path, list] = {}  # resolved dir -> [fd, count, created by this lock]


class DirLocked(ValueError):
    """Another process holds the directory's lock."""


@dataclass
class DirLock:
    path: Path

    def release(self) -> None:
        """Count down; the last release unlocks, and removes the directory again when this
        lock created it and nothing else was written there (a run refused before any work)."""
        entry = _held.get(self.path)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _held[self.path]
            if entry[2] and [p.name for p in self.path.iterdir()] == [LOCK_NAME]:
                (self.path / LOCK_NAME).unlink()
                self.path.rmdir()
            os.close(entry[0])  # closing releases the flock


def _holder(lock_file: Path) -> str:
    try:
        info = json.loads(lock_file.read_text())
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info["started_unix_s"]))
        return f"pid {info['pid']} on {info['host']}, started {started}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that left no details"


def acquire(directory: str | Path) -> DirLock:
    """The exclusive lock of ``directory`` (created if missing), or ``DirLocked`` naming the
    holder. ``ValueError`` when the directory cannot be created or written."""
    directory = Path(directory)
    created = not directory.exists()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir {directory} cannot be created ({e.strerror or e}); pick "
                         "another out_dir") from None
    key = directory.resolve()
    if key in _held:
        _held[key][1] += 1
        return DirLock(key)
    lock_file = key / LOCK_NAME
    try:
        fd = os.open(lock_file, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"out_dir {directory} is not writable ({e.strerror or e}); pick another "
                         "out_dir or fix its permissions") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DirLocked(f"out_dir {directory} is in use by another run ({_holder(lock_file)}); "
                        "wait for it to finish, or pick another out_dir") from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started_unix_s": time.time(),
            "argv": sys.argv}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
    except OSError as e:
        os.close(fd)
        raise ValueError(f"out_dir {directory} is not writable ({e.strerror or e}); pick another "
                         "out_dir or fix its permissions") from None
    _held[key] = [fd, 1, created]
    return DirLock(key)
