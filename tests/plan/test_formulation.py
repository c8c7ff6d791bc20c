"""The MILP as written (planner/formulation.py): its columns, its constraint groups and the step
model it shares with the evaluation of a fixed assignment."""

from pathlib import Path

import pytest

from layerwise.planner.formulation import LAYER_GROUPS, MS, build, step_groups
from layerwise.planner.presets import PRESETS
from layerwise.planner.milp import MilpConfig, StepModel
from layerwise.plan.shape import load_shape

DOC = Path(__file__).resolve().parents[2] / "docs" / "planner.md"
LAYER_GROUP_NAMES = ["one_tier_each", "copy_windows", "streamed_weights", "compute_windows", "recompute_need",
                     "recompute_run", "device_at_backward", "nvme_read_ahead", "nvme_flag"]
STEP_GROUP_NAMES = ["device_at_head", "host_capacity", "nvme_capacity", "nvme_lane", "accumulation_lane",
                    "optimizer_overlap"]


@pytest.fixture(scope="module")
def model():
    shape = load_shape("qwen2.5-3b")
    return StepModel(shape, PRESETS["h200"], 2, 4096, 4)


def test_column_blocks_tile_the_columns_exactly(model):
    """Every named column is one column of the LP and no two names share one.

    Mutation seen failing: ``Block.__getitem__`` with ``i * len(self.labels)`` replaced by ``i``
    (the labelled blocks' columns overlap)."""
    form = build(model, MilpConfig())
    seen = []
    for block in form.cols.blocks.values():
        for label in block.labels or (None,):
            seen += block.at(label)
    assert sorted(seen) == list(range(form.cols.count))
    x = form.x
    assert x.tier[1, "device"] == x.tier.start + 4 and x.internal[0, "host"] == x.internal.start + 1
    with pytest.raises(AssertionError):
        x.f[model.L]  # one past the block is not the next block's first column


def test_every_constraint_group_is_named_in_docs_planner_md_and_adds_rows(model):
    """The groups are the ones docs/planner.md writes out, in its order, each adding rows.

    Mutation seen failing: ``nvme_read_ahead`` dropped from ``LAYER_GROUPS``."""
    doc = DOC.read_text()
    assert [g.__name__ for g in LAYER_GROUPS] == LAYER_GROUP_NAMES
    assert [g.__name__ for g in step_groups(MilpConfig())] == STEP_GROUP_NAMES
    assert "optimizer_overlap" not in [g.__name__ for g in step_groups(MilpConfig(include_optimizer_stall=False))]
    for name in LAYER_GROUP_NAMES + STEP_GROUP_NAMES:
        assert f"    {name}" in doc, f"{name} is not written out in docs/planner.md"
    rows = build(model, MilpConfig(resident=True)).rows
    assert sorted(set(rows.groups)) == sorted(LAYER_GROUP_NAMES + STEP_GROUP_NAMES)
    # layer by layer, each layer's rows in the groups' order, then the step's
    assert list(dict.fromkeys(rows.groups)) == LAYER_GROUP_NAMES + STEP_GROUP_NAMES
    assert rows.groups.index("nvme_flag") < rows.groups.index("one_tier_each", 2)


ASSIGNMENTS = {
    # name: (boundary tiers, internal tiers) by pattern over the layers
    "every-2": (["device", "recompute"], ["recompute"]),
    "keep-all-host": (["host"], ["recompute"]),
    "mixed-nvme": (["device", "host", "nvme", "recompute"], ["recompute"]),
    "internals-host": (["recompute"], ["host"]),
    "internals-device": (["recompute"], ["device"]),
    "mixed-internals": (["device", "recompute", "host", "recompute"], ["recompute", "device", "host", "recompute"]),
}


@pytest.fixture(scope="module")
def layer_major():
    """The same model with 4 micro-batches sharing each weight load."""
    return StepModel(load_shape("qwen2.5-3b"), PRESETS["h200"], 1, 2048, 4, per_load=4)


@pytest.mark.parametrize("resident", [None, [0, 3, 5]])
@pytest.mark.parametrize("order", ["micro-batch-major", "layer-major"])
@pytest.mark.parametrize("name", list(ASSIGNMENTS))
def test_a_fixed_assignment_meets_every_row_and_costs_what_the_step_model_says(model, layer_major, name, order,
                                                                              resident):
    """The MILP and ``StepModel.evaluate`` are one model: the evaluation of a feasible assignment,
    written as a solution vector, meets every row and every column bound, and the objective of
    that vector, less the tie-breaks, is the evaluated step time; in both orders, with and
    without resident layers.

    Mutations seen failing: ``recompute_need`` with ``ρ_i ≥ ν_i + x_i`` (its lower bound 0
    instead of -1: a needed stored boundary would count as recomputed); ``streamed_weights``
    without its ``r_i`` term (a resident layer's forward window then still holds its copy,
    against what ``evaluate`` says)."""
    model = layer_major if order == "layer-major" else model
    L = model.L
    tiers_p, internal_p = ASSIGNMENTS[name]
    tiers, internal = (tiers_p * L)[:L], (internal_p * L)[:L]
    moments = ["fp32"] * len(model.units)
    ev = model.evaluate(tiers, True, moments, internal, resident)
    assert ev.feasible, ev.violations
    form = build(model, MilpConfig(resident=resident is not None))
    vals = form.start_vector(ev, tiers, internal, moments)
    cols, rows = form.cols, form.rows
    for c, v in enumerate(vals):
        assert cols.lower[c] - 1e-9 <= v <= cols.upper[c] + 1e-9, c
    for k, coefs in enumerate(rows.coefs):
        lhs = sum(a * vals[c] for c, a in coefs.items())
        tol = 1e-7 * max(1.0, abs(lhs))
        assert rows.lower[k] - tol <= lhs <= rows.upper[k] + tol, (rows.groups[k], rows.lower[k], lhs, rows.upper[k])
    objective_s = (sum(c * v for c, v in zip(cols.cost, vals)) + form.offset) / MS
    ties_s = sum(cols.cost[c] * vals[c] for c in form.ties) / MS
    assert objective_s - ties_s == pytest.approx(ev.step_s, rel=1e-9)
    assert form.decode(vals, MilpConfig()) == (tiers, internal, moments)
    assert form.decode_resident(vals) == (resident or [])
