"""The simulator's offload window: compute waits for the D2H offloads queued
``OFFLOAD_WINDOW_OPS`` ops back, as the engine's ``OffloadWindow`` makes it wait."""

from dataclasses import replace

import pytest

from layerwise.planner.presets import PRESETS
from layerwise.plan.memory import OFFLOAD_WINDOW_OPS
from layerwise.plan.plan import Plan
from layerwise.plan.program import OpKind, micro_batch_program
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate

SHAPE = load_shape("llama-30m")
L = SHAPE.num_layers


def _slow_d2h():
    """Compute, weights and the host side nearly free; one boundary's D2H copy takes ~1 ms."""
    a_bytes = 64 * SHAPE.hidden_size * 2
    return replace(PRESETS["h200"], peak_tflops=1e9, h2d_gbps=1e6, d2h_gbps=a_bytes / 1e-3 / 1e9,
                   host_accum_gbps=1e9, host_accum_bf16_gbps=1e9, pinned_copy_gbps=1e9,
                   optimizer_params_per_s=1e18, optimizer_8bit_params_per_s=1e18)


@pytest.mark.parametrize("internals", ["recompute", "host"])
def test_a_slow_d2h_lane_makes_compute_wait_by_the_window(internals):
    """Every boundary (and, in the second case, every layer's internals) offloaded over a D2H
    lane far slower than compute: each compute op ``OFFLOAD_WINDOW_OPS`` or more program ops
    after a forward starts no earlier than that forward's offloads end, and the next forward
    starts exactly then (the wait is what paces the forward); the forward phase lasts about one
    offload per layer instead of the compute's few microseconds.

    Mutation seen caught: the window's wait removed from ``_compute`` (compute then runs ahead,
    the next forward starts ~1 ms before the previous offload has left)."""
    plan = Plan(["host"] * L, seq_len=64, internal_tiers=[internals] * L)
    sim = simulate(plan, SHAPE, _slow_d2h(), steps=1)
    program = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    positions = [n for n, op in enumerate(program) if op.kind not in (OpKind.FETCH, OpKind.FETCH_INTERNALS)]
    ops = [o for o in sim.op_log if o["mb"] == 0 and o["step"] == 0]
    assert len(ops) == len(positions)
    offload_end = {}
    for iv in sim.intervals:
        if iv.lane == "d2h" and iv.label.startswith("offload") and iv.step == 0:
            i = int(iv.label.split()[1][1:])
            offload_end[i] = max(offload_end.get(i, 0.0), iv.end)
    forwards = [(pos, o) for pos, o in zip(positions, ops)
                if o["kind"] in (OpKind.LAYER_FWD, OpKind.LAYER_FWD_KEEP)]
    assert len(forwards) == L and len(offload_end) == L
    paced = 0
    for pos, fwd in forwards:
        e = offload_end[fwd["index"]]
        later = [o for p, o in zip(positions, ops) if p >= pos + OFFLOAD_WINDOW_OPS]
        assert all(o["start"] >= e - 1e-12 for o in later), fwd
        nxt = later[0]
        paced += nxt["start"] == pytest.approx(e, abs=1e-9)
    assert paced >= L - 1  # the first forward's offload may already be waited for by slower work
    d2h_s = min(offload_end[i] - o["start"] for (_, o), i in zip(forwards, range(L)))
    assert forwards[-1][1]["start"] - forwards[0][1]["start"] >= (L - 1) * d2h_s * 0.999
