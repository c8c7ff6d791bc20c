"""The search's screening simulation (``planner/screen.py``: ``simulate_fast``), which extrapolates
a long accumulation from 3 and 4 groups of micro-batches, against the full simulation."""

from __future__ import annotations

from layerwise.plan import Plan
from layerwise.planner.presets import PRESETS
from layerwise.planner.screen import extrapolated, simulate_fast
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate

_TIER = {"d": "device", "r": "recompute"}
# a MILP plan the search met (qwen-27b, h800, 64 sequences of 1024, one per micro-batch): its
# 64 gradient landings per step keep the copy-out lane behind the compute
_BOUNDARY = "ddrdddrdrddddddddddddddddddrddddddrdddddddrddddddddrdddrddddrrrr"
_INTERNAL = "rrdrrrdrdrrrrrrrrrrrrrrrrrrdrrrrrrdrrrrrrrdrrrrrrrrdrrrdrrrrrrrr"


def test_a_backlog_that_grows_with_the_micro_batches_fails_the_screen_as_in_full():
    """The copy-out lane falls behind: each head gradient waits on the device for it (fp32,
    3.1 GB), so the device peak grows with the number of micro-batches (71.5 GB at 4 groups,
    140 GB at 64). With a 73.5 GB cap the 4-group simulation fits; the screen must not say the
    plan fits when the full simulation says it does not. The step itself extrapolates exactly
    (linear after the first group). Mutation seen failing: the peaks taken from the 4-group
    simulation as they are (the screen says it fits, at 71.5 GB)."""
    shape = load_shape("qwen-27b")
    hw = PRESETS["h800"].with_memory(75, 512)
    n = shape.num_layers
    plan = Plan([_TIER[c] for c in _BOUNDARY], internal_tiers=[_TIER[c] for c in _INTERNAL],
                micro_batch_size=1, num_micro_batches=64, seq_len=1024, prefetch_depth=2,
                resident_layers=list(range(n)), head_chunk_tokens=1024, moments=["fp32"] * (n + 2))
    assert extrapolated(plan)
    short = Plan.from_dict({**plan.to_dict(), "num_micro_batches": 4})
    assert simulate(short, shape, hw, keep_trace=False).fits  # what the peaks of 4 groups say
    fast, full = simulate_fast(plan, shape, hw), simulate(plan, shape, hw, keep_trace=False)
    assert not full.fits and not fast.fits
    assert fast.peak_device_bytes >= full.peak_device_bytes
    assert abs(fast.step_s - full.step_s) <= 1e-9 * full.step_s
