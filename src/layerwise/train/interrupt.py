"""Ctrl-C and SIGTERM during training: finish the step, save, then stop with the command that
resumes (``util.errors.Interrupted``).

The first signal only sets a flag (and says, at once, that the run will stop after this step);
the loop looks at it between steps, so the checkpoint is of a whole step. A second Ctrl-C
stops at once without saving (the last committed checkpoint stays intact). Data parallel:
every rank may see its signal at another step, so the ranks agree on the flag each step (one
all-reduce of one number) and all save the same step.
"""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from .dist.context import DistContext

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """The signal handlers of one run (installed only from the main thread)."""

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.signum: int | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._saved[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.signum = signum
        name = signal.Signals(signum).name
        os.write(2, f"\n{name}: stopping after this step, then saving (Ctrl-C again to stop "
                    "now, without saving)\n".encode())

    def stop_requested(self) -> bool:
        """Whether to stop now (data parallel: whether any rank was signalled)."""
        if not self.ctx.enabled:
            return self.signum is not None
        mine = torch.tensor([0 if self.signum is None else self.signum], dtype=torch.int64)
        self.ctx.collective("agreeing whether to stop",
                            lambda: dist.all_reduce(mine, op=dist.ReduceOp.MAX))
        if int(mine) and self.signum is None:
            self.signum = int(mine)
        return bool(int(mine))
