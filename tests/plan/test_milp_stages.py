"""``milp.solve``'s stages: a HiGHS answer that does not match its objective is not trusted."""

from layerwise.planner import milp as milp_mod
from layerwise.planner.baselines import baseline_tiers
from layerwise.planner.presets import PRESETS
from layerwise.planner.milp import MilpConfig, StepModel, solve
from layerwise.plan.shape import load_shape


def test_a_run_that_hands_back_its_start_vector_is_solved_again_cold(monkeypatch):
    """HiGHS 1.16 can report an improved objective yet return the user's start vector. A stage
    that sees this solves the same model again without the start, and reports the cold answer
    (with both runs' seconds).

    Mutation seen failing: ``_answer`` without its objective-vs-vector check (the start's
    tiers come back under the optimum's objective)."""
    shape = load_shape("qwen2.5-3b")
    model = StepModel(shape, PRESETS["h200"].with_memory(gpu_mem_gb=20), 2, 4096, 4)
    cfg = MilpConfig(time_limit_s=5.0, internal_tiers=("recompute",))
    cold = solve(model, cfg)
    start = baseline_tiers(shape.num_layers)["every-8"]
    assert cold.tiers is not None and cold.tiers != start

    real_quiet = milp_mod._quiet_highs
    runs = []

    class StartEcho:
        """A Highs whose solution is the start it was given, when it was given one."""

        def __init__(self, h):
            self.h, self.start = h, None
            runs.append(self)

        def setSolution(self, sol):
            self.start = list(sol.col_value)
            return self.h.setSolution(sol)

        def getSolution(self):
            sol = self.h.getSolution()
            if self.start is not None:
                sol.col_value = self.start
            return sol

        def __getattr__(self, name):
            return getattr(self.h, name)

    monkeypatch.setattr(milp_mod, "_quiet_highs", lambda highspy: StartEcho(real_quiet(highspy)))
    res = solve(model, cfg, ("every-8", start))
    assert len(runs) == 2 and runs[0].start is not None and runs[1].start is None
    assert res.warm_start is None  # the cold run's answer
    assert res.tiers == cold.tiers and res.objective_s == cold.objective_s
