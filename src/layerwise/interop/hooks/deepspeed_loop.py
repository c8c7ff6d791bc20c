"""Layer-wise checkpoints written straight from a DeepSpeed ZeRO loop (stages 1, 2 and 3).

::

    engine, *_ = deepspeed.initialize(model=model, model_parameters=..., config=ds_config)
    ckpt = DeepSpeedCheckpointer("runs/a", engine, policy="filter", threshold=1e-3)
    if ckpt.has_checkpoint():
        start = ckpt.load().step + 1        # at this world size, whatever the save's was
    for step in range(start, n):
        loss = engine(batch).loss; engine.backward(loss); engine.step()
        if step % 100 == 0:
            ckpt.save(step)                 # on every rank

No rank gathers a full parameter. A load restores master, moments, step counters, scheduler and
hyper-parameters, so training continues exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from ...ckpt.checkpoint_config import DEFAULT_POLICY
from ...ckpt.collective import RankExchange, default_exchange
from ...ckpt.reports import LoadResult, SaveReport
from ...ckpt.sharded_checkpointer import ShardedCheckpointer
from .zero_partitions import LiveZeroState

ENGINE_COUNTERS = ("global_steps", "global_samples", "skipped_steps", "micro_steps")
"""The engine's own step counters, kept in a save's ``extra["deepspeed"]``."""


class DeepSpeedCheckpointer:
    """Create on every rank after ``deepspeed.initialize``; ``save``/``load`` are collectives
    (``ckpt.protocol.CheckpointerProtocol``)."""

    def __init__(self, run_dir: str | Path, engine: Any = None, *, module: nn.Module | None = None,
                 optimizer: Any = None, scheduler: Any = None, policy: str = DEFAULT_POLICY,
                 exchange: RankExchange | None = None, timeout_s: float = 600.0, **policy_options: Any):
        """``engine``: the DeepSpeed engine; or its parts (the Trainer's callbacks): ``module``,
        ``optimizer`` (ZeRO) and ``scheduler``. ``policy_options``: e.g. ``threshold=1e-3``."""
        if engine is not None:
            module, optimizer = engine.module, engine.optimizer
            scheduler = scheduler if scheduler is not None else engine.lr_scheduler
        if module is None or optimizer is None:
            raise ValueError("DeepSpeedCheckpointer needs the DeepSpeed engine (or module= and optimizer=)")
        self.engine = engine
        self.state = LiveZeroState(module, optimizer)
        self.exchange = exchange or default_exchange(timeout_s)
        self._check_cover()
        self.ckpt = ShardedCheckpointer(run_dir, self.state, self.exchange, policy, scheduler=scheduler,
                                        **policy_options)
        self.run_dir = self.ckpt.run_dir

    def _check_cover(self) -> None:
        """Every parameter covered exactly once by the ranks' pieces, checked on rank 0 before
        anything is written; every rank raises if not."""
        ranges = self.exchange.gather(self.state.ranges())
        error = None
        if self.exchange.rank == 0:
            try:
                self.state.check_cover(ranges)
            except ValueError as e:
                error = str(e)
        error = self.exchange.broadcast(error)
        if error:
            raise ValueError(error)

    def latest(self) -> int | None:
        return self.ckpt.latest()

    def has_checkpoint(self) -> bool:
        return self.ckpt.has_checkpoint()

    def close(self) -> None:
        self.ckpt.close()

    def save(self, step: int, extra: dict | None = None, *, data_position: Any = None,
             trainer_state: dict | None = None, every_group: bool = False) -> SaveReport:
        """Write this rank's pieces of the groups the policy picks at ``step`` (every rank;
        ``every_group``: all of them)."""
        counters = {k: getattr(self.engine, k) for k in ENGINE_COUNTERS if hasattr(self.engine, k)}
        extra = {**(extra or {}), "deepspeed": counters} if counters else extra
        return self.ckpt.save(step, extra, data_position=data_position,
                              trainer_state=trainer_state, every_group=every_group)

    def load(self, step: int | None = None) -> LoadResult | None:
        """Put the state at ``step`` (default: newest) into the engine, on every rank; None
        (the engine untouched) when the run has no committed step yet."""
        if step is None and self.latest() is None:
            return None
        self.state.begin_restore()
        result = self.ckpt.load(step)
        self.state.finish_restore()
        counters = (result.extra or {}).get("deepspeed") or {}
        for k, v in counters.items():
            if self.engine is not None and k in ENGINE_COUNTERS:
                setattr(self.engine, k, v)
        return result
