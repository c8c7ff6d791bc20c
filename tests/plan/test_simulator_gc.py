"""The simulator runs hundreds of times per search: it must leave nothing for the cyclic
garbage collector."""

import gc

from layerwise.planner.presets import PRESETS
from layerwise.plan.plan import Plan
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate


def test_a_simulation_leaves_no_reference_cycles():
    """Its trace is freed when the result drops it, not at the next full collection (which would
    then walk every allocation and interval the search has made).

    Mutation seen failing: the dispatch tables as bound methods stored on the simulation."""
    shape = load_shape("llama-30m")
    L = shape.num_layers
    plan = Plan(["device", "host", "nvme", "recompute", "recompute"] * (L // 5),
                internal_tiers=["host"] + ["recompute"] * (L - 1), micro_batch_size=2, num_micro_batches=2,
                seq_len=128)
    simulate(plan, shape, PRESETS["h800"], keep_trace=False)
    gc.collect()
    gc.disable()
    try:
        for _ in range(3):
            simulate(plan, shape, PRESETS["h800"], keep_trace=False)
        assert gc.collect() == 0
    finally:
        gc.enable()
