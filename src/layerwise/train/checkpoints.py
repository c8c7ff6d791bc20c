"""A run's checkpoints: when it saves (``ckpt.every``, at the end, at an interrupt), what it
keeps (``save_total_limit``, cleaned up by rank 0 once the save in flight committed) and the
close that waits for the last background write. Every rank saves (each writes its groups)."""

from __future__ import annotations

from ..ckpt import RunDir, SaveReport
from ..ckpt.checkpointer import Checkpointer
from .config import CheckpointConfig
from .dist import saving as dist_saving
from .dist.context import DistContext
from .state import TrainState


def due(every: int, step: int, last: bool) -> bool:
    """Whether something done every ``every`` steps (0: never on a schedule) and at the last
    step is due after ``step``."""
    return last or bool(every and step % every == 0)


class CheckpointManager:
    def __init__(self, ctx: DistContext, cfg: CheckpointConfig, ckpt: Checkpointer | None,
                 last_saved: int | None = None):
        self.ctx, self.cfg, self.ckpt = ctx, cfg, ckpt
        self.last_saved = last_saved
        """The newest step this run's checkpoints hold (None: none yet)."""

    def due(self, step: int, last: bool) -> bool:
        return self.ckpt is not None and due(self.cfg.every, step, last and self.cfg.at_end)

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

    def due_at_interrupt(self, step: int) -> bool:
        """Whether a run interrupted after ``step`` saves it: not when it is saved already or
        saves are only on a schedule (``ckpt.at_end=false``)."""
        return self.ckpt is not None and self.cfg.at_end and self.last_saved != step

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
