"""The search's polish of the MILP's plan in the simulator (``planner/search.py``: ``polish``)."""

from __future__ import annotations

from layerwise.plan import Plan
from layerwise.planner.presets import PRESETS
from layerwise.planner.screen import simulate_fast
from layerwise.planner.search import POLISH_MOVES, Candidate, polish
from layerwise.plan.shape import load_shape


def test_the_polished_plan_is_never_slower_than_a_rule_beside_it():
    """A MILP plan slower in the simulator than a rule (here: recompute everything, against
    keeping every boundary on the device, which fits) comes out at least as fast as that rule,
    named ``milp``, and still fits. Mutation seen failing: ``polish`` returning the MILP's plan
    as it came (its tokens/s below the rule's)."""
    shape = load_shape("qwen2.5-3b")
    hw = PRESETS["h200"]
    n = shape.num_layers
    kw = dict(micro_batch_size=1, num_micro_batches=4, seq_len=4096)
    slow = Plan(["recompute"] * n, source="milp", **kw)
    fast = Plan(["device"] * n, source="keep-all-device", **kw)
    milp = Candidate("milp", slow, simulate_fast(slow, shape, hw))
    rule = Candidate("keep-all-device", fast, simulate_fast(fast, shape, hw))
    assert rule.fits and rule.sim.tokens_per_s > milp.sim.tokens_per_s * 1.01
    for moves in (0, POLISH_MOVES):  # the best of the two; then runs of layers relinked
        out = polish(milp, [rule], shape, hw, moves)
        assert out.name == "milp" and out.plan.source == "milp" and out.fits
        assert out.sim.tokens_per_s >= rule.sim.tokens_per_s
