"""The step program's vocabulary and its one weight-window rule, against hand-checked examples
and against every consumer: the memory model, the engine's weight streamer, the simulator and
the MILP."""

import json
from dataclasses import replace

import pytest
import torch

from layerwise.engine.backend import CpuBackend
from layerwise.engine.weight_stream import WeightStreamer
from layerwise.models.names import EMBED, HEAD, layer_unit
from layerwise.planner.presets import PRESETS
from layerwise.plan.memory import device_bytes_per_op
from layerwise.planner.milp import StepModel
from layerwise.plan.plan import Plan
from layerwise.plan.program import Op, OpKind, WeightWindow, micro_batch_program, weight_schedule
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate

E, H, L0, L1, L2 = EMBED, HEAD, layer_unit(0), layer_unit(1), layer_unit(2)


def _shape(num_layers: int, tied: bool):
    base = load_shape("llama-debug")
    return replace(base, num_layers=num_layers, layer_windows=(None,) * num_layers, tied=tied)


def test_op_kinds_read_as_the_strings_they_replaced():
    """Logs, timeline labels, plan predictions and JSON keep saying ``layer_bwd 3``.

    Mutation seen failing: ``OpKind`` without its ``__str__`` (str() and f-strings give
    ``OpKind.LAYER_BWD``).
    """
    assert str(Op(OpKind.LAYER_BWD, 3)) == "layer_bwd 3"
    assert str(Op(OpKind.EMBED_FWD)) == "embed_fwd"
    assert f"{OpKind.RECOMPUTE_LAYER} 2" == "recompute_layer 2"
    assert json.dumps({"kind": OpKind.HEAD}) == '{"kind": "head"}'
    assert OpKind("fetch") is OpKind.FETCH and OpKind.FETCH == "fetch"


# ops of a 2-layer plan keeping both boundaries:
#   embed_fwd, layer_fwd 0, layer_fwd 1, head, fetch 1, layer_bwd 1, fetch 0, layer_bwd 0, embed_bwd
# weight schedule (untied): embed, layers.0, layers.1, head, layers.1, layers.0 (embed_bwd reads
# no weights: its gradient comes from the token ids and boundary 0's gradient)
HAND_WINDOWS = {
    (False, 1): [{E, L0}, {L0, L1}, {L1, H}, {H, L1}, {L1}, {L1, L0}, {L0}, {L0}, set()],
    # depth 2: layer_fwd 1 holds layers.1 once although it is both running and two uses ahead
    (False, 2): [{E, L0, L1}, {L0, L1, H}, {L1, H}, {H, L1, L0}, {L1, L0}, {L1, L0}, {L0},
                 {L0}, set()],
    # tied: the head also runs the embedding (schedule: embed, l0, l1, embed, head, l1, l0)
    # tied, two slots: the head holds both, so layers.1's copy waits for the head to finish
    (True, 1): [{E, L0}, {L0, L1}, {L1, E}, {E, H}, {L1}, {L1, L0}, {L0}, {L0}, set()],
}


def weight_windows(ops, tied, depth):
    """Per op, the units whose weights are on the device while it runs (the window's rule)."""
    window = WeightWindow(weight_schedule(ops, tied), depth)
    window.fill()
    out = []
    for op in ops:
        units = op.units(tied)
        for u in units:
            window.acquire(u)
        out.append(window.resident())
        for u in units:
            window.release(u)
        window.fill()
    return out


@pytest.mark.parametrize("tied,depth", sorted(HAND_WINDOWS))
def test_weight_windows_by_hand(tied, depth):
    """Which weight buffers the device holds at each op, for depth 1 and 2.

    Mutation seen failing: ``WeightWindow.fill`` filling to ``depth + 1`` uses (every window
    one unit too many; the memory model and streamer would both over-hold).
    """
    ops = micro_batch_program(["device", "device"])
    assert [str(op) for op in ops] == ["embed_fwd", "layer_fwd 0", "layer_fwd 1", "head", "fetch 1",
                                      "layer_bwd 1", "fetch 0", "layer_bwd 0", "embed_bwd"]
    assert weight_windows(ops, tied, depth) == [frozenset(w) for w in HAND_WINDOWS[(tied, depth)]]


class _Store:
    """The part of a HostStore the streamer reads: a copy source per unit (all in RAM)."""

    source_tier = None

    def __init__(self, shape):
        self.compute_dtype = torch.float32
        self.bufs = {u: _Buf(u, torch.zeros(shape.unit_params(u))) for u in shape.unit_names()}

    def __getitem__(self, unit):
        return self.bufs[unit]

    def __iter__(self):
        return iter(self.bufs.values())


class _Buf:
    def __init__(self, name, master):
        self.name = name
        self.copy_source = master


def _streamer_units_per_op(shape, ops, depth):
    """Units whose weights the streamer holds in a slot during each op, driven as the executor
    drives it."""
    streamer = WeightStreamer(CpuBackend(reads_host=False), _Store(shape), depth, wait_update=lambda unit: None,
                              update_done=lambda unit: True)
    streamer.begin(weight_schedule(ops, shape.tied))
    out = []
    for op in ops:
        units = op.units(shape.tied)
        for u in units:
            streamer.acquire(u)
        out.append(frozenset(streamer._ready))
        for u in units:
            streamer.release(u)
    assert streamer.finished()
    return out


@pytest.mark.parametrize("tied,depth", sorted(HAND_WINDOWS))
def test_streamer_holds_the_hand_checked_windows_and_memory_counts_its_slots(tied, depth):
    """The streamer holds, op by op, exactly the hand-checked windows, in ``depth + 1`` slots,
    and the memory model counts those slots (sized for the largest unit) at every op.

    Mutations seen failing: the streamer freeing a unit's slot at its first release, ignoring
    uses still holding it (caught at depth 2, where ``layer_fwd 1`` and the prefetch after it
    share ``layers.1``); a window allowed one slot more than ``depth + 1`` (tied, depth 1).
    """
    shape = _shape(2, tied)
    plan = Plan(["device", "device"], prefetch_depth=depth)
    ops = micro_batch_program(plan.boundary_tiers)
    assert _streamer_units_per_op(shape, ops, depth) == [frozenset(w) for w in HAND_WINDOWS[(tied, depth)]]
    largest = max(shape.unit_params(u) for u in shape.unit_names()) * 4
    memory = [est.breakdown["slots"] for est in device_bytes_per_op(shape, plan, 1, 16, 4, grad_slots=False)]
    assert memory == [(depth + 1) * largest] * len(ops)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_simulator_holds_the_windows_the_streamer_holds(tied, depth):
    """The simulator's copies follow the same window: at each op of the first micro-batch the
    slot of each of its units last received that unit's weights, and no slot is written while
    an op reads it (the checker's slot rule passes)."""
    from layerwise.planner.check import check

    shape = _shape(3, tied)
    hw = PRESETS["h200"]
    plan = Plan(["device"] * 3, seq_len=64, num_micro_batches=2, prefetch_depth=depth)
    sim = simulate(plan, shape, hw, steps=2)
    report = check(sim, shape, hw)
    assert report.ok, report.violations


def test_milp_device_memory_is_the_slots_plus_the_op():
    """The MILP's device constants are the engine's slots (fetch slots always counted) plus each
    op's transient, as in the memory model."""
    shape = _shape(3, False)
    hw = PRESETS["h200"]
    model = StepModel(shape, hw, 1, 64, prefetch_depth=2)
    cost = model.cost
    largest = max(cost.unit_weight_bytes(u) for u in shape.unit_names())
    slots = 3 * largest + 2 * largest + 2 * cost.boundary_bytes
    assert model.c_bwd_mem == [slots + cost.op_transient_bytes(OpKind.LAYER_BWD, i) for i in range(3)]
    assert model.c_head_mem == slots + cost.op_transient_bytes(OpKind.HEAD)


def test_layer_major_step_runs_each_op_for_its_group_and_shares_the_weight_copy():
    """Layer-major order: each op of the micro-batch program runs for every micro-batch of its
    group before the next op, and the weight schedule has one use per group op, so a unit's
    weights are copied once per group (mutation: groups of 1 -> the schedule doubles)."""
    from layerwise.plan.program import StepOp, plan_step_program, resident_units

    plan = Plan.every_k(3, 1, num_micro_batches=5, micro_batches_per_load=2)
    steps = plan_step_program(plan)
    ops = micro_batch_program(plan.boundary_tiers, plan.internal_tiers)
    assert steps == ([StepOp(op, (0, 1)) for op in ops] + [StepOp(op, (2, 3)) for op in ops]
                     + [StepOp(op, (4,)) for op in ops])
    per_group = weight_schedule(ops, False)
    assert weight_schedule([s.op for s in steps], False) == per_group * 3
    mb_major = plan_step_program(Plan.every_k(3, 1, num_micro_batches=5))
    assert len(weight_schedule([s.op for s in mb_major], False)) == 5 * len(per_group)
    # a resident layer is never in the schedule
    res = resident_units([1])
    assert "layers.1" not in weight_schedule(ops, False, res)
    assert weight_schedule(ops, False, res) == [u for u in per_group if u != "layers.1"]
    assert not plan.lands_once() and Plan.every_k(3, 1, num_micro_batches=4,
                                                  micro_batches_per_load=4).lands_once()


def test_plan_refuses_bad_resident_layers():
    with pytest.raises(ValueError, match="resident_layers"):
        Plan.every_k(3, 1, resident_layers=[3])
    with pytest.raises(ValueError, match="resident_layers"):
        Plan.every_k(3, 1, resident_layers=[1, 1])
    with pytest.raises(ValueError, match="micro_batches_per_load"):
        Plan.every_k(3, 1, micro_batches_per_load=0)
