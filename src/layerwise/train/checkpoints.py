"""A run's checkpoints: when it saves, what it keeps (``save_total_limit``), and the close that
waits for the last background write. Every rank saves its groups.

Ctrl-C/SIGTERM only set a flag the loop reads between steps, so the checkpoint is of a whole
step; a second Ctrl-C stops at once without saving. Ranks may see the signal at different steps,
so they agree on the flag each step (one all-reduce) and all save the same one."""

from __future__ import annotations

import os
import signal
import threading
from types import FrameType

import torch
import torch.distributed as dist

from ..ckpt import RunDir, SaveReport
from ..ckpt.checkpointer import Checkpointer
from ..util.checkpoint_config import CheckpointConfig
from .dist import saving as dist_saving
from .dist.context import DistContext
from .state import TrainState


def due(every: int, step: int, last: bool) -> bool:
    """Whether something done every ``every`` steps (0: never on a schedule) and at the last
    step is due after ``step``."""
    return last or bool(every and step % every == 0)


class CheckpointManager:
    def __init__(self, ctx: DistContext, cfg: CheckpointConfig, ckpt: Checkpointer | None):
        self.ctx, self.cfg, self.ckpt = ctx, cfg, ckpt
        self.last_saved: int | None = None
        """The newest step this run's checkpoints hold (None: none yet)."""

    def should_save(self, step: int, last: bool, stopping: bool) -> bool:
        """Whether to save after ``step``: on ``ckpt.every``'s schedule, at the last step
        (``ckpt.at_end``), or when the run stops at an interrupt (``ckpt.at_end``; not when
        this step is saved already)."""
        if self.ckpt is None:
            return False
        return due(self.cfg.every, step, last and self.cfg.at_end) or (
            stopping and self.cfg.at_end and self.last_saved != step)

    def save(self, state: TrainState, every_group: bool = False) -> SaveReport:
        """A layer-wise checkpoint of ``state.step`` (in the background), after making room
        for it: the newest ``save_total_limit - 1`` stay. ``every_group``: whatever the policy
        (the run's last save, an interrupted run's: nothing it trained is left out)."""
        assert self.ckpt is not None
        with dist_saving.peer_failures(self.ctx, f"checkpointing step {state.step}"):
            if self.cfg.save_total_limit is not None:
                self._prune(max(1, self.cfg.save_total_limit - 1))
            rep = self.ckpt.save(state.step, data_position=state.data_position,
                                 trainer_state=state.to_json(), every_group=every_group)
        self.last_saved = state.step
        return rep

    def _prune(self, keep: int) -> None:
        if self.ctx.rank == 0:
            self.ckpt.wait()  # the save in flight committed: no blob is being written that gc takes
            RunDir.open(self.ckpt.run_dir).gc(keep)

    def close(self) -> None:
        """Wait for the last save (its error raised), then ``save_total_limit``'s clean-up."""
        if self.ckpt is None:
            return
        with dist_saving.peer_failures(self.ctx, "writing the last checkpoint"):
            self.ckpt.close()
        if self.cfg.save_total_limit is not None:
            self._prune(self.cfg.save_total_limit)


class StopFlag:
    """The signal handlers of one run (installed only from the main thread)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, ctx: DistContext):
        self.ctx = ctx
        self.signum: int | None = None
        self._saved: dict[int, object] = {}

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
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
