"""Which rank this process is, from torchrun's environment, and the process group. A failed or
timed-out collective is re-raised as one error naming the timeout and the way back (resume)."""

from __future__ import annotations

import hashlib
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
            f"(collectives give up after dist.timeout_s={self.timeout_s:g} s). The last committed "
            "checkpoint is intact: rerun (or let torchrun --max-restarts rerun) with resume=true, "
            "with any number of processes.")


def backend_for(device: str) -> str:
    """gloo for host tensors (the gradients land on the host); NCCL for CUDA tensors."""
    return "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"


def rank_device(ctx: DistContext, device: str, device_count: int) -> str:
    """The device this rank trains on: under torchrun, ``cuda`` is the GPU of its LOCAL_RANK.
    Refuses what would put two ranks of a node on one GPU (each would hold its own slots and
    context there, and the node would train at the speed of one shared device)."""
    if not ctx.enabled or not device.startswith("cuda"):
        return device
    index = torch.device(device).index
    if index is not None:
        if ctx.local_world_size > 1:
            raise ValueError(
                f"device={device} with {ctx.local_world_size} ranks a node puts every rank on GPU "
                f"{index}; use device=cuda: each rank takes the GPU of its LOCAL_RANK")
        return device
    if ctx.local_rank >= device_count:
        raise ValueError(
            f"{ctx.who()}: LOCAL_RANK={ctx.local_rank} but this process sees {device_count} CUDA "
            f"device(s), so two ranks would share a GPU; launch at most {device_count} ranks a "
            "node (torchrun --nproc-per-node), each seeing all of the node's GPUs (no "
            "CUDA_VISIBLE_DEVICES per rank)")
    return f"cuda:{ctx.local_rank}"


def ranks_sharing_a_device(device_ids: list[int]) -> list[list[int]]:
    """Groups of ranks (by index in ``device_ids``) whose devices are the same one."""
    by_id: dict[int, list[int]] = {}
    for rank, dev in enumerate(device_ids):
        by_id.setdefault(dev, []).append(rank)
    return [ranks for ranks in by_id.values() if len(ranks) > 1]


def _device_id(index: int) -> int:
    """A 56-bit id of physical GPU ``index`` (from its UUID): the same on every process that
    sees it, whatever CUDA_VISIBLE_DEVICES renumbers."""
    uuid = str(torch.cuda.get_device_properties(index).uuid)
    return int.from_bytes(hashlib.blake2b(uuid.encode(), digest_size=7).digest(), "little")


def check_distinct_devices(ctx: DistContext, index: int) -> None:
    """Refuse, on every rank, a launch where two ranks drive one physical GPU."""
    ids = torch.zeros(ctx.world_size, dtype=torch.int64)
    ids[ctx.rank] = _device_id(index)
    ctx.collective("comparing the ranks' GPUs", lambda: dist.all_reduce(ids))
    shared = ranks_sharing_a_device(ids.tolist())
    if shared:
        raise ValueError(
            f"ranks {' and '.join(map(str, shared[0]))} drive the same GPU (its UUID); give each "
            "rank its own GPU: launch at most as many ranks a node as it has GPUs, each seeing "
            "all of them, with device=cuda")


def init(ctx: DistContext, device: str) -> None:
    """Join the process group (torchrun's ``MASTER_ADDR``/``MASTER_PORT`` rendezvous); on
    CUDA, make this rank's GPU current and refuse ranks that would share one."""
    if not ctx.enabled or dist.is_initialized():
        return
    cuda = device.startswith("cuda")
    if cuda:
        index = torch.device(rank_device(ctx, device, torch.cuda.device_count())).index
        torch.cuda.set_device(index)
    ctx.collective("joining the process group", lambda: dist.init_process_group(
        backend=backend_for(device), rank=ctx.rank, world_size=ctx.world_size,
        timeout=timedelta(seconds=ctx.timeout_s)))
    if cuda:
        check_distinct_devices(ctx, index)


def shutdown(ctx: DistContext) -> None:
    if ctx.enabled and dist.is_initialized():
        dist.destroy_process_group()


def barrier(ctx: DistContext, what: str) -> None:
    if ctx.enabled:
        # an all-reduce of a host tensor: gloo even when NCCL is joined too (dist.barrier would
        # pick the CUDA backend), under the group's timeout
        ctx.collective(what, lambda: dist.all_reduce(torch.zeros(1)))


def any_rank(ctx: DistContext, flag: bool, what: str) -> bool:
    """Is ``flag`` true on any rank? (One gloo all-reduce; ``flag`` itself alone.)"""
    if not ctx.enabled:
        return flag
    t = torch.tensor([int(flag)], dtype=torch.int64)
    ctx.collective(what, lambda: dist.all_reduce(t, op=dist.ReduceOp.MAX))
    return bool(t)


def broadcast_object(ctx: DistContext, obj: T, what: str) -> T:
    """Rank 0's ``obj`` on every rank."""
    if not ctx.enabled:
        return obj
    box = [obj]
    ctx.collective(what, lambda: dist.broadcast_object_list(box, src=0, device=torch.device("cpu")))
    return box[0]
