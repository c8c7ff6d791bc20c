"""The engine's own work around its compute, per op, measured on a tiny step (the CPU backend).

A step is more than its ops' kernels: around each op the executor picks the next fetches, takes
the weights, makes the micro-batches' contexts (positions, RoPE, masks), queues the closures,
lands the gradients tensor by tensor. On the synchronous CPU backend that work runs on the
compute lane, and at a narrow model's layer widths it is a tenth of the step and more (a
dense layer of hidden 64: ~2.5 ms a step of ~40). ``measure_engine_overhead`` runs a few steps of
a model too small for its compute or copies to matter (``llama-debug``, 8 tokens) and times the
step less its compute closures, per compute op: the profile's ``op_overhead_s``,
which the cost model adds to every compute op. A GPU's host issues this work ahead of the
device, so there it is not measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from ..models.adapter import DecoderAdapter
from ..models.init import build_hf_model
from ..models.registry import get_flavor
from ..plan.plan import Plan
from ..plan.program import COPY_OPS, OpKind
from ..store import HostStore
from .batch import Batch
from .executor import EngineConfig, StreamingEngine

OVERHEAD_FLAVOR = "llama-debug"


def measure_engine_overhead(steps: int = 5, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds a CPU engine step spends outside its compute closures, per compute op (the
    median step of ``steps`` after a warm-up; each step's updates, priced apart, waited for
    outside the timed part)."""
    cfg = get_flavor(OVERHEAD_FLAVOR).build_config()
    model, adapter = build_hf_model(cfg, seed=0), DecoderAdapter(cfg)
    store = HostStore(adapter)
    store.copy_from_model(model)
    plan = Plan.recompute_all(cfg.num_hidden_layers, micro_batch_size=1, num_micro_batches=2, seq_len=8)
    engine = StreamingEngine(adapter, store, plan, EngineConfig())
    g = torch.Generator().manual_seed(0)
    batches = [Batch(ids, torch.roll(ids, -1, dims=1))
               for ids in (torch.randint(0, cfg.vocab_size, (1, 8), generator=g) for _ in range(2))]
    compute, ops = [0.0], [0]
    launch = engine.backend.launch

    def timed_launch(fn: Callable[[], None]) -> None:
        t = clock()
        launch(fn)
        compute[0] += clock() - t

    def counted(kind: OpKind, handler):
        def run(group, i) -> None:
            ops[0] += 0 if kind in COPY_OPS else len(group)  # the ops the simulator prices as compute
            handler(group, i)
        return run

    engine.backend.launch = timed_launch
    engine.handlers.ops = {k: counted(k, h) for k, h in engine.handlers.ops.items()}
    per_op = []
    try:
        for n in range(steps + 1):
            compute[0], ops[0] = 0.0, 0
            t = clock()
            engine.train_step(batches)
            around = clock() - t - compute[0]
            engine.updates.wait_own()
            if n:  # the first step warms up
                per_op.append(max(0.0, around) / max(1, ops[0]))
    finally:
        engine.close()
    return sorted(per_op)[len(per_op) // 2]
