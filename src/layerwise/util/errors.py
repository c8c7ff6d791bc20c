"""What the ``layerwise`` command tells a user when a run ends early."""

from __future__ import annotations


class Interrupted(Exception):
    """A run stopped by a signal after saving what it could; the message is the one line the
    command prints (what happened, what was saved, the command that resumes)."""

    def __init__(self, message: str, exit_code: int = 130):
        super().__init__(message)
        self.exit_code = exit_code
        """128 + the signal's number, as a shell reports a process ended by it."""


def one_line(e: BaseException) -> str:
    """An error's message on one line (a YAML or OS message may span several)."""
    text = " ".join(str(e).split())
    if isinstance(e, OSError) and e.filename and str(e.filename) not in text:
        text = f"{text}: {e.filename}"
    return text or type(e).__name__
