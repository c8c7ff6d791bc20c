"""``calibrate_engine``: the engine's own work around its compute, per op, on the CPU backend."""

import time

import pytest

from layerwise.engine import calibrate_engine
from layerwise.models.adapter import DecoderAdapter


def test_the_engine_s_work_is_what_a_step_spends_outside_its_compute(monkeypatch):
    """Each layer made ~2 ms of CPU work slower leaves the per-op figure where it was (within
    0.5 ms, against the ~1.5 ms a compute op more it would gain if the compute were not taken
    out), and the figure is a positive fraction of a millisecond on this tiny step. Clock: this
    thread's CPU time (the engine's compute runs on it; other threads' spin or load do not count). Mutation seen caught: the step's time not less its compute closures'
    (the slower layers then add ~1.5 ms an op)."""
    clock = time.thread_time
    base = calibrate_engine.measure_engine_overhead(steps=3, clock=clock)
    layer = DecoderAdapter.layer

    def slow_layer(self, *a, **kw):
        end = clock() + 2e-3
        while clock() < end:
            pass
        return layer(self, *a, **kw)

    monkeypatch.setattr(DecoderAdapter, "layer", slow_layer)
    slowed = calibrate_engine.measure_engine_overhead(steps=3, clock=clock)
    assert 0 < base < 1e-3
    assert slowed == pytest.approx(base, abs=5e-4)
