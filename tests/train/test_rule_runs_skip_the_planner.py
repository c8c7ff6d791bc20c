"""A run with a rule or a plan file never loads the planner (``layerwise.planner``: search, MILP,
simulator, hardware profiles, calibration): the contract it obeys is ``layerwise.plan`` alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

RUN = """
import sys
from layerwise.cli import main
code = main(["train", "model=llama-demo", "out_dir=" + sys.argv[1], "steps=1", "seq_len=16",
             "micro_batch_size=1", "grad_accum=1", "eval.every=0", "plan=" + sys.argv[2]])
print(code, sorted(m for m in sys.modules if m.startswith("layerwise.planner")))
"""


@pytest.mark.parametrize("plan", ["every-2", "file", "auto"])
def test_the_planner_is_imported_for_plan_auto_only(plan, tmp_path):
    """``sys.modules`` after a run in a fresh process. Mutation seen failing: ``train/build.py``
    importing ``run_plan`` at the top (every run loads the planner)."""
    spec = plan
    if plan == "file":
        from layerwise.plan import Plan

        spec = str(tmp_path / "plan.json")
        Plan.every_k(4, 1, micro_batch_size=1, num_micro_batches=1, seq_len=16).save(spec)
    out = subprocess.run([sys.executable, "-c", RUN, str(tmp_path / "run"), spec],
                         capture_output=True, text=True, timeout=300)
    code, modules = out.stdout.strip().splitlines()[-1].split(" ", 1)
    assert code == "0", out.stderr[-2000:]
    loaded = json.loads(modules.replace("'", '"'))
    if plan == "auto":
        assert "layerwise.planner.run_plan" in loaded
    else:
        assert loaded == [], loaded
