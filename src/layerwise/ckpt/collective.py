"""How the ranks of a save agree: the only seam between checkpoint writing and torch.distributed.

Rank 0 decides (``broadcast``), every rank writes its own content-addressed blobs and sends
their records (``gather``), rank 0 alone commits. ``TorchExchange`` uses a gloo process group of
its own, with a timeout, so the checkpoint thread's collectives never interleave with training's."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist


class RankExchange(Protocol):
    rank: int
    world_size: int

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` from rank ``src`` on every rank (picklable)."""

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's ``obj`` in rank order on rank ``dst``; ``None`` elsewhere."""

    def barrier(self) -> None:
        """Returns once every rank has called it."""


class SingleProcess:
    rank, world_size = 0, 1

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return obj

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        return [obj]

    def barrier(self) -> None:
        pass


class CollectiveTimeout(RuntimeError):
    """Another rank did not take part in a checkpoint collective: it died, or it stalled past
    the timeout."""


class TorchExchange:
    """A ``RankExchange`` over a new gloo group of every rank of the default group (create it on
    every rank, in the same order relative to other ``new_group`` calls)."""

    def __init__(self, timeout_s: float):
        if not dist.is_initialized():
            raise ValueError("TorchExchange needs torch.distributed initialised "
                             "(launch with torchrun and call init_process_group first)")
        self.timeout_s = timeout_s
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def _failed(self, what: str, e: Exception) -> CollectiveTimeout:
        return CollectiveTimeout(
            f"rank {self.rank}: checkpoint {what} across {self.world_size} ranks failed (another "
            f"rank died, or stalled past the {self.timeout_s:g} s timeout): {e}; the last "
            "committed step is intact, restart the run with resume")

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        box = [obj if self.rank == src else None]
        try:
            dist.broadcast_object_list(box, src=src, group=self.group)
        except RuntimeError as e:
            raise self._failed("broadcast", e) from e
        return box[0]

    def gather(self, obj: Any, dst: int = 0) -> list[Any] | None:
        out = [None] * self.world_size if self.rank == dst else None
        try:
            dist.gather_object(obj, out, dst=dst, group=self.group)
        except RuntimeError as e:
            raise self._failed("gather", e) from e
        return out

    def barrier(self) -> None:
        try:
            dist.monitored_barrier(group=self.group, timeout=timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise self._failed("barrier", e) from e


def default_exchange(timeout_s: float) -> RankExchange:
    """The ranks of the default process group (one process when there is none, or one rank)."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return TorchExchange(timeout_s)
    return SingleProcess()
