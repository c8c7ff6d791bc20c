"""``StepReducer`` over torch.distributed: per-unit gradient reduction to the unit's owner.

Units are dealt to a node's local ranks by ``plan.owners.assign_owners`` (the assignment the
scaling model simulates); an owner updates its units on the shared store. ``grad_reduce``:
``device`` reduces each micro-batch's gradient to the owner on the backend's reduction lane
(a process group of its own); ``host`` reduces each landed fp32 gradient over gloo, overlapping
the rest of the backward. Across nodes, owners all-reduce once per step and apply the same
update, so nodes stay identical without broadcasting weights (2-4x the gradient's bytes).

Update visibility: a per-unit counter in shared memory, written by the owner after
``refresh_compute``; on x86 (TSO) a reader that sees it sees the weights written before it."""

from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

from ...optim.clip import sq_norm
from ...plan.owners import assign_owners
from ...store import HostStore
from .context import DistContext

_POLL_S = 0.0002
GRAD_REDUCE_MODES = ("device", "host")


class _CollectiveWork:
    """A collective's work whose failure reads as the run's other collective failures do."""

    def __init__(self, ctx: DistContext, what: str, work: dist.Work):
        self.ctx, self.what, self.work = ctx, what, work

    def wait(self) -> None:
        self.ctx.collective(self.what, self.work.wait)


class DistReducer:
    def __init__(self, ctx: DistContext, store: HostStore, flags: torch.Tensor,
                 grad_reduce: str = "device", device: str = "cpu"):
        """``flags``: one int64 per unit in the node's shared memory (zero at start).
        ``grad_reduce``: ``device`` or ``host`` (the module docstring); ``device``: the
        engine's device (``cuda...``: the reduction group is NCCL's)."""
        if grad_reduce not in GRAD_REDUCE_MODES:
            raise ValueError(f"dist.grad_reduce must be one of {GRAD_REDUCE_MODES}, got "
                             f"{grad_reduce!r}")
        self.ctx, self.store = ctx, store
        self.units = [b.name for b in store]
        self.index = {u: i for i, u in enumerate(self.units)}
        owners = assign_owners([b.layout.numel for b in store], ctx.local_world_size)
        self.owner = dict(zip(self.units, owners))  # the planner's assignment, so it predicts this one
        self.flags = flags
        self.applied = 0
        """Updates the run has made (steps not skipped)."""
        self._pending: list[tuple[str, dist.Work]] = []
        # every rank creates every group, in the same order (torch.distributed requires it)
        self.node_group = self._groups([[ctx.global_rank(n, r) for r in range(ctx.local_world_size)]
                                        for n in range(ctx.num_nodes)], ctx.node)
        self.cross_group = self._groups([[ctx.global_rank(n, r) for n in range(ctx.num_nodes)]
                                         for r in range(ctx.local_world_size)], ctx.local_rank)
        self.on_device = grad_reduce == "device" and ctx.local_world_size > 1
        """Reduced on the device (with one local rank it owns every unit: nothing to reduce
        within the node)."""
        self.grad_group = None
        if self.on_device:  # a group of its own even when the node is the world
            self.grad_group = self._groups(
                [[ctx.global_rank(n, r) for r in range(ctx.local_world_size)]
                 for n in range(ctx.num_nodes)], ctx.node,
                backend="nccl" if device.startswith("cuda") else "gloo", always=True)

    def _groups(self, members: list[list[int]], mine: int, backend: str = "gloo",
                always: bool = False):
        """This rank's group among ``members`` (None: the default group, when it is the world
        and not ``always``)."""
        if len(members) == 1 and not always:
            return None
        # a new group does not inherit the world group's timeout (it takes torch's 30-minute
        # default): without it a stalled rank would hold the others in this group's collectives
        timeout = timedelta(seconds=self.ctx.timeout_s)
        groups = [self.ctx.collective("creating process groups", lambda m=m: dist.new_group(
                      m, backend=backend, timeout=timeout)) for m in members]
        return groups[mine]

    def owns(self, unit: str) -> bool:
        return self.owner[unit] == self.ctx.local_rank

    def global_tokens(self, local_tokens: int) -> int:
        t = torch.tensor([local_tokens], dtype=torch.int64)
        self.ctx.collective("all-reducing the step's token count", lambda: dist.all_reduce(t))
        return int(t)

    def reduce_on_device(self, unit: str, grad: torch.Tensor) -> _CollectiveWork:
        dst = self.ctx.global_rank(self.ctx.node, self.owner[unit])
        what = f"reducing {unit}'s gradient on the device"
        work = self.ctx.collective(what, lambda: dist.reduce(
            grad, dst=dst, group=self.grad_group, async_op=True))
        return _CollectiveWork(self.ctx, what, work)

    def unit_landed(self, unit: str) -> None:
        if self.on_device or self.ctx.local_world_size == 1:
            return  # reduced before it landed / the only local rank owns every unit
        dst = self.ctx.global_rank(self.ctx.node, self.owner[unit])
        grad = self.store[unit].grad
        work = self.ctx.collective(f"reducing {unit}'s gradient", lambda: dist.reduce(
            grad, dst=dst, group=self.node_group, async_op=True))
        self._pending.append((unit, work))

    def finish(self, loss: float) -> tuple[dict[str, float], float]:
        pending, self._pending = self._pending, []
        for unit, work in pending:
            self.ctx.collective(f"reducing {unit}'s gradient", work.wait)
        mine = [u for u in self.units if self.owns(u)]
        if self.ctx.num_nodes > 1:
            for unit in mine:  # the same units, in the same order, on every node
                self.ctx.collective(f"all-reducing {unit}'s gradient across nodes",
                                    lambda u=unit: dist.all_reduce(self.store[u].grad,
                                                                   group=self.cross_group))
        vec = torch.zeros(len(self.units) + 1, dtype=torch.float64)
        if self.ctx.node == 0:
            for unit in mine:
                vec[self.index[unit]] = sq_norm(self.store[unit].grad)
        vec[-1] = loss
        self.ctx.collective("all-reducing the gradient norms", lambda: dist.all_reduce(vec))
        values = vec.tolist()
        return dict(zip(self.units, values[:-1])), values[-1]

    def begin_updates(self) -> None:
        self.applied += 1

    def published(self, unit: str) -> None:
        self.flags[self.index[unit]] = self.applied

    def update_done(self, unit: str, wait: bool) -> bool:
        flag = self.flags[self.index[unit]]
        if int(flag) >= self.applied:
            return True
        if not wait:
            return False
        deadline = time.monotonic() + self.ctx.timeout_s
        while int(flag) < self.applied:
            if time.monotonic() > deadline:
                raise self.ctx.peer_error(
                    f"waiting for local rank {self.owner[unit]}'s update {self.applied} of {unit}",
                    "timed out")
            time.sleep(_POLL_S)
        return True
