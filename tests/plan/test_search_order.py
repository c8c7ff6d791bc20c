"""The search solves its MILPs on a thread of their own while it simulates (``search._explore``):
the solves must still run one at a time, in the search's order, each with what the ones before it
left of the budget, so that a search finds what it would one step at a time."""

from __future__ import annotations

import threading

from layerwise.planner import search as search_mod
from layerwise.planner.presets import PRESETS
from layerwise.planner.milp import MilpConfig
from layerwise.planner.search import MIN_SOLVE_S, SearchConfig, search
from layerwise.plan.shape import load_shape


def test_solves_run_one_at_a_time_in_order_on_the_budget_left(monkeypatch):
    """Mutations: submitting the next solve as soon as its configuration is prepared (solves
    overlap) and submitting it before ``tally.solve_s`` counts this one (its limit ignores what
    was just spent) each fail here."""
    calls, lock, busy = [], threading.Lock(), []
    real = search_mod.solve

    def recording(model, cfg, *a, **k):
        with lock:
            busy.append(1)
            overlap = len(busy) > 1
        res = real(model, cfg, *a, **k)
        calls.append(((model.micro_batch_size, model.prefetch_depth, model.per_load), cfg.time_limit_s,
                      res.solve_s, overlap))
        with lock:
            busy.pop()
        return res

    monkeypatch.setattr(search_mod, "solve", recording)
    shape, hw = load_shape("qwen2.5-3b"), PRESETS["rtx3090"].with_memory(None, 90)
    budget_s = 0.3
    cfg = SearchConfig(global_batch=8, milp=MilpConfig(time_limit_s=2.0), milp_budget_s=budget_s)
    res = search(shape, hw, 4096, cfg)
    assert len(calls) >= 6 and not any(c[-1] for c in calls)
    keys = [c[0] for c in calls]
    sizes = [k[0] for k in keys]
    assert sizes == sorted(sizes), keys  # smallest micro-batch first, as the budget promises
    spent = 0.0
    for key, limit, solve_s, _ in calls:
        # a re-solve of the same configuration (its plan overflowed in the simulator) follows it
        assert abs(limit - max(MIN_SOLVE_S, min(2.0, budget_s - spent))) < 1e-9, (key, limit, spent)
        spent += solve_s
    assert abs(res.solve_s - spent) < 1e-9
