"""Which rank this process is, from torchrun's environment, and the process group.

Alone (no ``WORLD_SIZE`` or ``WORLD_SIZE=1``) there is no process group and the training loop
runs as it always did. Under torchrun every collective has the configured timeout, and a failed
or timed-out one is re-raised as one error that names the timeout and the way back (resume).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    timeout_s: float = 600.0
    """Every collective (and every wait on another rank's update) gives up after this long."""

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, timeout_s: float = 600.0) -> DistContext:
        """torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``."""
        env = os.environ if env is None else env
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            rank = int(env.get("RANK", "0"))
            local_rank = int(env.get("LOCAL_RANK", str(rank)))
            local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
        except ValueError as e:
            raise ValueError(f"torchrun's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE must be "
                             f"integers: {e}") from None
        if not (0 <= rank < world and 0 <= local_rank < local_world and world % local_world == 0
                and rank % local_world == local_rank):
            raise ValueError(
                f"inconsistent distributed environment: RANK={rank} WORLD_SIZE={world} "
                f"LOCAL_RANK={local_rank} LOCAL_WORLD_SIZE={local_world}; launch with torchrun "
                "(the same --nproc-per-node on every node)")
        if timeout_s <= 0:
            raise ValueError(f"dist_timeout_s must be > 0, got {timeout_s}")
        return cls(rank, world, local_rank, local_world, timeout_s)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def node(self) -> int:
        """This rank's node: torchrun numbers ranks node by node."""
        return self.rank // self.local_world_size

    @property
    def num_nodes(self) -> int:
        return self.world_size // self.local_world_size

    def global_rank(self, node: int, local_rank: int) -> int:
        return node * self.local_world_size + local_rank

    def who(self) -> str:
        return f"rank {self.rank} of {self.world_size} (node {self.node}, local rank {self.local_rank})"

    def collective(self, what: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` (collectives); its failure becomes one clear error."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001  (gloo/NCCL raise several types)
            raise self.peer_error(what, e) from e

    def peer_error(self, what: str, cause: BaseException | str) -> RuntimeError:
        return RuntimeError(
            f"{self.who()}: {what} failed: {cause}. Another rank probably died or stalled "
            f"(collectives give up after dist_timeout_s={self.timeout_s:g} s). The last committed "
            "checkpoint is intact: rerun (or let torchrun --max-restarts rerun) with resume=true, "
            "with any number of processes.")


def backend_for(device: str) -> str:
    """gloo for host tensors (the gradients land on the host); NCCL for CUDA tensors."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def init(ctx: DistContext, device: str) -> None:
    """Join the process group (torchrun's ``MASTER_ADDR``/``MASTER_PORT`` rendezvous)."""
    if not ctx.enabled or dist.is_initialized():
        return
    if device.startswith("cuda"):
        torch.cuda.set_device(ctx.local_rank % max(1, torch.cuda.device_count()))
    ctx.collective("joining the process group", lambda: dist.init_process_group(
        backend=backend_for(device), rank=ctx.rank, world_size=ctx.world_size,
        timeout=timedelta(seconds=ctx.timeout_s)))


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext, what: str) -> None:
    if ctx.enabled:
        # an all-reduce of a host tensor: gloo even when NCCL is joined too (dist.barrier would
        # pick the CUDA backend), under the group's timeout
        ctx.collective(what, lambda: dist.all_reduce(torch.zeros(1)))


def broadcast_object(ctx: DistContext, obj: T, what: str) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.enabled:
        return obj
    box = [obj]
    ctx.collective(what, lambda: dist.broadcast_object_list(box, src=0, device=torch.device("cpu")))
    return box[0]
