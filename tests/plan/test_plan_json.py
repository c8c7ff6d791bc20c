"""Plan JSON: the current format round-trips, and plan files of the older format still load."""

import json

import pytest

from layerwise.plan.plan import FORMAT_VERSION, Plan

# A plan file exactly as format_version 1 (tiers under "boundaries") wrote it.
V1_PLAN_JSON = """{
  "boundaries": ["device", "recompute", "host", "nvme"],
  "micro_batch_size": 2,
  "num_micro_batches": 3,
  "seq_len": 512,
  "prefetch_depth": 2,
  "head_chunk_tokens": 256,
  "moments": ["fp32", "8bit", "fp32", "fp32", "fp32", "fp32"],
  "source": "milp",
  "predicted": {"step_s": 1.5},
  "format_version": 1
}
"""


def test_a_version_1_plan_file_loads_and_saves_as_the_current_version(tmp_path):
    """Old plan files keep working after the tiers were renamed to ``boundary_tiers``.

    Mutation seen failing: ``Plan.from_dict`` without its ``_upgrade`` call (the old file is
    refused: unknown key ``boundaries``).
    """
    old = tmp_path / "plan-v1.json"
    old.write_text(V1_PLAN_JSON)
    plan = Plan.load(old)
    assert plan.boundary_tiers == ["device", "recompute", "host", "nvme"]
    assert (plan.micro_batch_size, plan.num_micro_batches, plan.seq_len) == (2, 3, 512)
    assert (plan.prefetch_depth, plan.head_chunk_tokens, plan.source) == (2, 256, "milp")
    assert plan.moments == ["fp32", "8bit", "fp32", "fp32", "fp32", "fp32"]
    assert plan.predicted == {"step_s": 1.5}
    assert plan.format_version == FORMAT_VERSION == 4
    assert plan.internal_tiers == ["recompute"] * 4
    new = tmp_path / "plan-v4.json"
    plan.save(new)
    written = json.loads(new.read_text())
    assert "boundaries" not in written and written["boundary_tiers"] == plan.boundary_tiers
    assert written["format_version"] == 4
    assert Plan.load(new) == plan


def test_a_version_2_plan_reads_with_every_layers_internals_recomputed(tmp_path):
    """Version 2 had no ``internal_tiers``: every layer recomputed its internals.
    Mutation seen failing: ``_upgrade`` passing version 2 through (refused as unsupported)."""
    d = json.loads(V1_PLAN_JSON)
    d["boundary_tiers"] = d.pop("boundaries")
    d["format_version"] = 2
    plan = Plan.from_dict(d)
    assert plan.internal_tiers == ["recompute"] * 4 and plan.format_version == FORMAT_VERSION
    kept = Plan(["device"] * 4, internal_tiers=["device", "host", "recompute", "host"])
    path = tmp_path / "plan.json"
    kept.save(path)
    assert Plan.load(path).internal_tiers == ["device", "host", "recompute", "host"]
    with pytest.raises(ValueError, match="unknown internal tiers"):
        Plan(["device"] * 2, internal_tiers=["nvme", "device"])
    with pytest.raises(ValueError, match="2 internal tiers but 3 boundary"):
        Plan(["device"] * 3, internal_tiers=["host", "device"])


def test_a_version_1_plan_without_format_version_still_loads():
    d = json.loads(V1_PLAN_JSON)
    del d["format_version"]
    assert Plan.from_dict(d).boundary_tiers == ["device", "recompute", "host", "nvme"]


def test_unknown_versions_and_the_old_key_in_a_new_file_are_refused():
    current = Plan.every_k(4, 2).to_dict()
    with pytest.raises(ValueError, match="format_version 5 is not supported"):
        Plan.from_dict({**current, "format_version": 5})
    # the old key in a current-version file is a mistake, not something to guess about
    with pytest.raises(ValueError, match="unknown keys"):
        Plan.from_dict({**json.loads(V1_PLAN_JSON), "format_version": 2})
