"""A run with a rule or a plan file never loads the planner (``layerwise.planner``: search, MILP,
simulator, hardware profiles, calibration): the contract it obeys is ``layerwise.plan`` alone."""

from __future__ import annotations

import json
import subprocess
import sys

RUN = """
import sys
from layerwise.cli import main
for i, plan in enumerate(sys.argv[2:]):
    code = main(["train", "model=llama-demo", f"out_dir={sys.argv[1]}/{i}", "steps=1", "seq_len=16",
                 "micro_batch_size=1", "grad_accum=1", "eval.every=0", "plan=" + plan])
    print("PROBE", plan, code, sorted(m for m in sys.modules if m.startswith("layerwise.planner")))
"""


def test_the_planner_is_imported_for_plan_auto_only(tmp_path):
    """``sys.modules`` after runs in one fresh process: a rule (``every-2``), then a plan file,
    load no planner module; a ``plan=auto`` run after them does (the probe sees the import).
    Mutation seen failing: ``train/build.py`` importing ``run_plan`` at the top (every run loads
    the planner: the rule's run already has it)."""
    from layerwise.plan import Plan

    spec = str(tmp_path / "plan.json")
    Plan.every_k(4, 1, micro_batch_size=1, num_micro_batches=1, seq_len=16).save(spec)
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "run"), "every-2", spec,
                          "auto"], capture_output=True, text=True, timeout=600)
    rows = [x.split(" ", 3)[1:] for x in out.stdout.splitlines() if x.startswith("PROBE ")]
    assert [r[0] for r in rows] == ["every-2", spec, "auto"], out.stderr[-2000:]
    for plan, code, modules in rows:
        assert code == "0", (plan, out.stderr[-2000:])
        loaded = json.loads(modules.replace("'", '"'))
        if plan == "auto":
            assert "layerwise.planner.run_plan" in loaded
        else:
            assert loaded == [], (plan, loaded)
