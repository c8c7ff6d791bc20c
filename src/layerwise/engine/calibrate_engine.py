"""What a CPU step costs beyond its priced parts, per op, measured on a tiny step.

A step is more than its ops' kernels: around each op the executor picks the next fetches, takes
the weights, makes the micro-batches' contexts (positions, RoPE, masks), queues the closures,
lands the gradients tensor by tensor; the optimizer and the landing pay Python per unit; and an
op's kernels run colder between the engine's bookkeeping than in a hot loop of the layer alone,
where ``calibrate`` fits their launches. On the synchronous CPU backend all of it runs on the
compute lane (or, the optimizer, on its own thread, which the CPU clock counts), and at a narrow
model's widths it is a tenth of the step and more. ``measure_tiny_step`` runs a few steps
of a model too small for its compute or copies to matter (``llama-debug``, 8 tokens) and takes
the step's time less the simulator's price of the same step with no overhead, per compute op:
the profile's ``op_overhead_s``, which the cost model adds to every compute op. It is fitted
where these fixed costs are most of the step, on another model and shape than any run, so it
is what the simulator's form misses, not a correction to one run. A GPU's host issues the
engine's work ahead of the device, so there it is not measured.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..models.adapter import DecoderAdapter
from ..models.init import build_hf_model
from ..models.registry import get_flavor
from ..plan.hardware import HardwareProfile
from ..plan.plan import Plan
from ..plan.program import COPY_OPS, OpKind
from ..plan.shape import ModelShape
from ..plan.simulator import simulate
from ..store import HostStore
from .batch import Batch
from .executor import EngineConfig, StreamingEngine

OVERHEAD_FLAVOR = "llama-debug"
TINY_STEPS = 15
"""Steps the tiny step's median is taken over: its residual is ~5 of its ~20 ms, so a slow step
moves ``op_overhead_s`` by tens of percent. Eight fits in one process on a 2-core Xeon VM read
151-310 µs an op over 5 steps, 189-223 (one 303) over 15; the 10 more cost ~0.2 s."""


@dataclass(frozen=True)
class TinyStep:
    """The tiny step as measured and as the simulator prices it without ``op_overhead_s``."""

    step_s: float
    """The median step, updates included (the clock's: the CPU clock counts the optimizer's thread)."""
    simulated_s: float
    compute_ops: int
    """The ops a step runs that the simulator prices as compute (not its copies)."""
    plan: Plan
    shape: ModelShape

    @property
    def per_op_s(self) -> float:
        return max(0.0, (self.step_s - self.simulated_s) / max(1, self.compute_ops))


def measure_tiny_step(hw: HardwareProfile, steps: int = TINY_STEPS,
                      clock: Callable[[], float] = time.perf_counter) -> TinyStep:
    """``steps`` steps of ``OVERHEAD_FLAVOR`` at 1 x 8 tokens, 2 micro-batches, recompute-all, on
    the CPU backend, after a warm-up; each step with its updates waited for, as the simulator's
    synchronous step is; priced on ``hw`` with ``op_overhead_s`` 0."""
    cfg = get_flavor(OVERHEAD_FLAVOR).build_config()
    model, adapter = build_hf_model(cfg, seed=0), DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = Plan.recompute_all(cfg.num_hidden_layers, micro_batch_size=1, num_micro_batches=2, seq_len=8)
    engine = StreamingEngine(adapter, store, plan, EngineConfig())
    g = torch.Generator().manual_seed(0)
    batches = [Batch(ids, torch.roll(ids, -1, dims=1))
               for ids in (torch.randint(0, cfg.vocab_size, (1, 8), generator=g) for _ in range(2))]
    ops = [0]

    def counted(kind: OpKind, handler):
        def run(group, i) -> None:
            ops[0] += 0 if kind in COPY_OPS else len(group)  # the ops the simulator prices as compute
            handler(group, i)
        return run

    engine.handlers.ops = {k: counted(k, h) for k, h in engine.handlers.ops.items()}
    times = []
    try:
        for n in range(steps + 1):
            ops[0] = 0
            t = clock()
            engine.train_step(batches)
            engine.synchronize()
            if n:  # the first step warms up
                times.append(clock() - t)
    finally:
        engine.close()
    shape = ModelShape.from_config(cfg)
    simulated = simulate(plan, shape, replace(hw, op_overhead_s=0.0), steps=2, keep_trace=False).step_s
    return TinyStep(statistics.median(times), simulated, ops[0], plan, shape)

