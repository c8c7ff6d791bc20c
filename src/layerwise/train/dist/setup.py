"""What a data-parallel run does differently at start-up: one plan, one data cache, one host
store per node, one checkpoint load per node; each a no-op in a single process."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import TypeVar

from ...ckpt.checkpointer import Checkpointer, LoadResult
from ...store import PRIVATE, HostAllocator, HostStore
from .context import DistContext, barrier, broadcast_object
from .shm import SharedAllocator

T = TypeVar("T")


def host_allocator(ctx: DistContext, shm_dir: str) -> HostAllocator:
    """Single process: private memory. Data parallel: the node's shared store."""
    if not ctx.enabled:
        return PRIVATE
    run_id = broadcast_object(ctx, uuid.uuid4().hex[:12], "agreeing on the run's id")
    return SharedAllocator(shm_dir, f"layerwise-{run_id}-node{ctx.node}",
                           creator=ctx.local_rank == 0, timeout_s=ctx.timeout_s)


def store_ready(ctx: DistContext, alloc: HostAllocator) -> None:
    """Every local rank has mapped every buffer: the files can go (the memory stays)."""
    barrier(ctx, "building the shared host store")
    if isinstance(alloc, SharedAllocator):
        alloc.unlink()


def decided_by_rank0(ctx: DistContext, decide: Callable[[], T], what: str) -> T:
    """``decide()`` on rank 0, its result on every rank (a plan must be the same everywhere:
    the micro-batch shape and the moments' format of the shared optimizer state)."""
    return broadcast_object(ctx, decide() if ctx.rank == 0 else None, what)


def first_then_others(ctx: DistContext, fn: Callable[[], T], what: str) -> T:
    """``fn`` on rank 0, then on the others (e.g. the data cache: written once, then read)."""
    if ctx.rank == 0:
        out = fn()
        barrier(ctx, what)
        return out
    barrier(ctx, what)
    return fn()


def resume(ctx: DistContext, ckpt: Checkpointer | None, want: bool, optimizers: dict,
           store: HostStore, step: int | None = None) -> LoadResult | None:
    """Checkpoint ``step`` (None: the newest) loaded into each node's store once (by its local
    rank 0), its LoadResult on every rank. Ranks that did not load re-read the optimizers'
    cached step counts (another process wrote the shared ``step`` tensors)."""
    has = ckpt is not None and want and ckpt.has_checkpoint()
    if not ctx.enabled:
        return ckpt.load(step) if has else None
    if not decided_by_rank0(ctx, lambda: has, "agreeing whether to resume"):
        return None
    loaded = ckpt.load(step) if ctx.local_rank == 0 else None
    result = broadcast_object(ctx, loaded, "sharing the resumed step")
    barrier(ctx, "loading the checkpoint into the shared store")
    for buf in store:
        steps = getattr(optimizers[buf.name], "steps", None)  # HostAdamW8bit's HostSteps
        if steps is not None and "step" in buf.state:
            steps.seed(buf.state["step"], int(buf.state["step"]))
    return result
