"""Checkpoints under torchrun: which rank writes which groups, and each rank's checkpointer.

Groups are dealt over all ranks of all nodes by ``plan.owners.assign_owners``: on one node each
rank writes what it updates; across nodes (identical copies) the writes use every node's disk
or link, so the run directory must be on a shared filesystem (resuming needs that anyway).
Rank 0 checks that it sees every blob the others wrote."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ...ckpt.checkpointer import Checkpointer
from ...ckpt.collective import CollectiveTimeout, TorchExchange
from ...ckpt.provider import StateProvider
from ...models.names import group_of
from ...plan.owners import assign_owners
from ...store import HostStore
from .context import DistContext
from .setup import first_then_others


def group_writers(store: HostStore, world_size: int) -> dict[str, int]:
    """Each checkpoint group's writing rank (global)."""
    ranks = assign_owners([b.layout.numel for b in store], world_size)
    writers: dict[str, int] = {}
    for buf, rank in zip(store, ranks):
        for p in buf.unit.params:
            writers.setdefault(group_of(p.hf_name, store.adapter.tied), rank)
    return writers


def checkpointer(ctx: DistContext, run_dir: Path, provider: StateProvider, store: HostStore,
                 writes: bool, **options) -> Checkpointer:
    """This rank's checkpointer. ``writes`` (every rank calls it): a writer of its own groups,
    joined to the others by a ``TorchExchange``; else a reader (resume), made by the node's
    local rank 0 alone."""
    if not (ctx.enabled and writes):
        return Checkpointer(run_dir, provider=provider, **options)
    exchange = TorchExchange(ctx.timeout_s)  # on every rank, in the same order
    writers = group_writers(store, ctx.world_size)
    mine = {g for g, r in writers.items() if r == ctx.rank}
    # rank 0 first: it creates the run directory the others then open
    return first_then_others(ctx, lambda: Checkpointer(
        run_dir, provider=provider, exchange=exchange, mine=mine, **options),
        "opening the checkpoint run directory")


@contextmanager
def peer_failures(ctx: DistContext, what: str) -> Iterator[None]:
    """A checkpoint collective that failed (its writer thread's, raised by ``save``, ``wait``
    or ``close``) as the run's other collectives report theirs: a peer is gone, the timeout,
    the way back."""
    try:
        yield
    except CollectiveTimeout as e:
        raise ctx.peer_error(what, e) from e
