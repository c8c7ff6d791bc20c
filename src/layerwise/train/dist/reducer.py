"""``StepReducer`` over torch.distributed: per-unit gradient reduction to the unit's owner.

Ownership. The units are dealt to the local ranks of a node, largest first to the least loaded
(``plan.owners.assign_owners``, the assignment the scaling model simulates: balanced by
parameters, ties in model order, the same on every node). A unit's owner runs its
optimizer update on the node's shared store; the other local ranks only read it.

Reduction, within the node (``grad_reduce``):

- ``device`` (the default): every micro-batch's gradient of a unit is summed into its owner's
  device buffer by an async ``dist.reduce`` on the device tensor (NCCL on CUDA; gloo on the CPU
  backends, whose device tensors are host tensors), issued by the gradient sink on the
  backend's reduction lane behind the backward that wrote it (``reduce_on_device``), over a
  process group of its own (the lane's collectives never interleave with the main thread's);
  only the owner copies the sum to the host and adds it up, the other ranks send nothing;
- ``host``: every rank lands its own gradient; once a unit's last micro-batch has landed
  (``unit_landed``, on the landing worker, or inline on the synchronous CPU backend) an async
  ``dist.reduce`` of the fp32 host gradient to the owner over the node's gloo group, so the
  reduction overlaps the backward of the units still to come.

Across nodes (``finish``, owners only, either way) ``all_reduce`` on the host among the ranks of
the same local rank, one per node, once per step: every node's owner then holds the same sum and
applies the same update to its node's copy, so the nodes stay identical without broadcasting
weights (the update is deterministic given the same gradient; an owner broadcast would move the
weights, 2-4x the gradient's bytes with a compute copy, over the slowest link).

The global clip norm is one all-reduce of a vector: every unit's squared norm (contributed by
its owner on node 0 only, since every node's owner holds the same sum) and the step's loss.

Update visibility: a per-unit counter in the node's shared memory. The owner writes the number
of the update it just applied (``published``); another local rank streams a unit only once the
counter has reached the number of updates the run has made (``update_done``), so updates keep
overlapping the next forward as in one process. On x86 (TSO) a reader that sees the counter sees
the weights written before it; the counter is written after ``refresh_compute``.
"""

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
