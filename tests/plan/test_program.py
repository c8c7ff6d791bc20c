"""The step program's vocabulary and its one weight-window rule, against hand-checked examples
and against every consumer: the memory model, the engine's weight streamer, the simulator and
the MILP."""

import json
from dataclasses import replace

import pytest
import torch

from layerwise.engine.backend import CpuBackend
from layerwise.engine.streams import WeightStreamer
from layerwise.models.names import EMBED, HEAD, layer_unit
from layerwise.plan.hardware import PRESETS
from layerwise.plan.memory import device_bytes_per_op
from layerwise.plan.milp import StepModel
from layerwise.plan.plan import Plan
from layerwise.plan.program import Op, OpKind, micro_batch_program, weight_schedule, weight_windows
from layerwise.plan.shape import load_shape
from layerwise.plan.simulator import simulate

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
# weight schedule (untied): embed, layers.0, layers.1, head, layers.1, layers.0, embed
HAND_WINDOWS = {
    (False, 1): [{E, L0}, {L0, L1}, {L1, H}, {H, L1}, {L1}, {L1, L0}, {L0}, {L0, E}, {E}],
    # depth 2: layer_fwd 1 holds layers.1 once although it is both running and two uses ahead
    (False, 2): [{E, L0, L1}, {L0, L1, H}, {L1, H}, {H, L1, L0}, {L1, L0}, {L1, L0, E}, {L0, E},
                 {L0, E}, {E}],
    # tied: the head also runs the embedding (schedule: embed, l0, l1, embed, head, l1, l0, embed)
    (True, 1): [{E, L0}, {L0, L1}, {L1, E}, {E, H, L1}, {L1}, {L1, L0}, {L0}, {L0, E}, {E}],
}


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
    """The part of a HostStore the streamer reads: a fp32 master per unit, no compute copy."""

    def __init__(self, shape):
        self.bufs = {u: _Buf(torch.zeros(shape.unit_params(u))) for u in shape.unit_names()}

    def __getitem__(self, unit):
        return self.bufs[unit]


class _Buf:
    def __init__(self, master):
        self.master, self.compute = master, None


def _streamer_weight_bytes_per_op(shape, ops, depth):
    """Weight bytes the streamer holds during each op, driven as the executor drives it."""
    backend = CpuBackend()
    streamer = WeightStreamer(backend, _Store(shape), depth, wait_ready=lambda unit: None)
    streamer.begin(weight_schedule(ops, shape.tied))
    out = []
    for op in ops:
        units = op.units(shape.tied)
        for u in units:
            streamer.acquire(u)
        out.append(backend.ledger.by_kind.get("weights", 0))
        for u in units:
            streamer.release(u)
    assert streamer.finished() and backend.ledger.live_bytes == 0
    return out


@pytest.mark.parametrize("tied,depth", sorted(HAND_WINDOWS))
def test_memory_model_and_streamer_hold_the_hand_checked_windows(tied, depth):
    """The memory prediction counts, op by op, exactly the weight buffers the streamer holds.

    Mutations seen failing: the memory model pairing each op with the next op's window
    (``zip(ops, windows[1:] + [frozenset()])``); the streamer freeing a unit's buffer at its
    first release, ignoring uses still holding it (caught at depth 2, where ``layer_fwd 1``
    and the prefetch after it share ``layers.1``).
    """
    shape = _shape(2, tied)
    plan = Plan(["device", "device"], prefetch_depth=depth)
    ops = micro_batch_program(plan.boundary_tiers)
    expected = [sum(shape.unit_params(u) * 4 for u in w) for w in HAND_WINDOWS[(tied, depth)]]
    memory = [est.breakdown["weights"] for est in device_bytes_per_op(shape, plan, 1, 16, 4)]
    assert memory == expected
    assert _streamer_weight_bytes_per_op(shape, ops, depth) == expected


def _simulated_weights_at(sim, kind, index, mb):
    """Units with a weight buffer on the device when op (kind, index) of micro-batch ``mb`` starts."""
    start = next(o["start"] for o in sim.op_log if (o["kind"], o["index"], o["mb"]) == (kind, index, mb))
    return frozenset(a.label[len("weights "):] for a in sim.allocs
                     if a.label.startswith("weights ") and a.start <= start < a.end)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_milp_backward_schedule_is_the_programs(tied, depth):
    """The MILP's weight window at each layer's backward and at the head is what the device
    holds there when the program runs (simulated, first of two micro-batches, so the prefetch
    reaches into the next one), and its in-flight gradient is the previous backward's (the
    head's for the top layer).

    Mutations seen failing: the MILP's windows without the next micro-batch's uses
    (``then=None``: depth 4 at ``layer_bwd 0`` misses ``layers.1``); the in-flight gradient
    taken from the op right before the backward (a no-op ``fetch``, so none).
    """
    shape = _shape(3, tied)
    hw = PRESETS["h200"]
    model = StepModel(shape, hw, 1, 64, num_micro_batches=2, prefetch_depth=depth)
    sim = simulate(Plan(["device"] * 3, seq_len=64, num_micro_batches=2, prefetch_depth=depth),
                   shape, hw, steps=1)
    for i in range(3):
        assert model.bwd_windows[i] == _simulated_weights_at(sim, OpKind.LAYER_BWD, i, 0), i
    assert model.head_window == _simulated_weights_at(sim, OpKind.HEAD, -1, 0)
    cost = model.cost
    for i in range(3):
        in_flight = [H, E] if tied and i == 2 else [H] if i == 2 else [layer_unit(i + 1)]
        expect = (sum(cost.unit_weight_bytes(u) for u in model.bwd_windows[i])
                  + cost.op_transient_bytes(OpKind.LAYER_BWD, i) + sum(cost.grad_bytes(u) for u in in_flight))
        assert model.c_bwd_mem[i] == expect, i


def test_milp_backward_windows_by_hand():
    """Depth 1, 3 layers untied: layer_bwd i holds layers i and i-1; layer_bwd 0 the embedding."""
    model = StepModel(_shape(3, False), PRESETS["h200"], 1, 64, prefetch_depth=1)
    assert model.bwd_windows == [{L0, E}, {L1, L0}, {L2, L1}]
    assert model.head_window == {H, L2}
