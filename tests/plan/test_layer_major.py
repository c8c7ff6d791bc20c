"""Layer-major accumulation (micro-batches sharing each weight load) and resident layers, as
the memory model, the simulator, the checker and the MILP count them."""

from collections import Counter
from dataclasses import replace

import pytest

from layerwise.models.names import layer_unit
from layerwise.planner.check import check
from layerwise.planner.cost import CostModel
from layerwise.planner.presets import PRESETS
from layerwise.plan.memory import device_bytes_per_op, mask_bytes, op_transient_bytes
from layerwise.planner.milp import MilpConfig, StepModel, solve
from layerwise.plan.plan import Plan
from layerwise.plan.program import OpKind
from layerwise.plan.shape import load_shape
from layerwise.planner.simulator import simulate

SMALL = load_shape("llama-30m")  # 10 layers, untied
MBS, SEQ, E = 2, 128, 2


def _per_op(plan: Plan, **kw):
    return {e.peak_op: e for e in device_bytes_per_op(SMALL, plan, MBS, SEQ, E, grad_slots=False, **kw)}


def test_a_group_holds_every_micro_batchs_boundaries_and_masks_and_resident_weights_at_every_op():
    """Every boundary on the device, 2 micro-batches per load: at the head both hold all L
    boundaries; at the top layer's backward (run for the first micro-batch) still both; at
    layer 0's backward both hold boundary 0 alone; besides, the other micro-batch carries its
    hidden state or its gradient; each op holds both masks. A resident layer's
    weights are held at every op (the weight slots then sized for the largest streamed unit).
    One micro-batch per load: exactly the numbers of one micro-batch.

    Mutations seen failing: the activations counted for the running micro-batch alone (head:
    L·A instead of 2·L·A); the masks of one micro-batch only; ``memory.carried`` returning 0."""
    L = SMALL.num_layers
    a = MBS * SEQ * SMALL.hidden_size * E
    mask = mask_bytes(SMALL, MBS, SEQ, E)
    one = _per_op(Plan.every_k(L, 1, num_micro_batches=2))
    two = _per_op(Plan.every_k(L, 1, num_micro_batches=2, micro_batches_per_load=2))
    assert one["head"].breakdown["activations"] == L * a
    # + a: the other micro-batch's hidden state (or its gradient) carried between ops
    assert two["head"].breakdown["activations"] == (2 * L + 1) * a
    assert two[f"layer_bwd {L - 1}"].breakdown["activations"] == (2 * L + 1) * a
    assert two["layer_bwd 0"].breakdown["activations"] == 3 * a
    for op in ("head", "layer_fwd 3", "layer_bwd 0"):
        kind, _, i = op.partition(" ")
        t = op_transient_bytes(SMALL, OpKind(kind), int(i or -1), MBS * SEQ, E, 1024)
        assert one[op].breakdown["transient"] == t + mask
        assert two[op].breakdown["transient"] == t + 2 * mask
        assert two[op].peak_bytes == (two[op].breakdown["slots"] + two[op].breakdown["activations"]
                                      + two[op].breakdown["internals"] + t + 2 * mask)
    # per_load 1 with more micro-batches per step: the one-micro-batch numbers
    single = _per_op(Plan.every_k(L, 1))
    assert {k: v.peak_bytes for k, v in one.items()} == {k: v.peak_bytes for k, v in single.items()}
    resident = _per_op(Plan.every_k(L, 1, num_micro_batches=2, micro_batches_per_load=2, resident_layers=[4]))
    w4 = SMALL.unit_weight_bytes(layer_unit(4), E)
    largest = max(SMALL.unit_weight_bytes(u, E) for u in SMALL.unit_names())
    streamed = max(SMALL.unit_weight_bytes(u, E) for u in SMALL.unit_names() if u != layer_unit(4))
    for op, est in two.items():
        assert resident[op].breakdown["slots"] - est.breakdown["slots"] == w4 - 2 * (largest - streamed)
        assert resident[op].peak_bytes - est.peak_bytes == w4 - 2 * (largest - streamed)


def test_a_groups_embedding_backward_holds_its_joined_fp32_boundary_gradients():
    """In layer-major order ``embed_bwd`` runs once over the group's tokens, joining their
    boundary gradients in fp32 (``engine/op_handlers.py``): its transient grows by that, one
    micro-batch per load does not. Mutation seen failing: ``group_embed_bwd_bytes`` returning 0."""
    L = SMALL.num_layers
    t = op_transient_bytes(SMALL, OpKind.EMBED_BWD, -1, MBS * SEQ, E, 1024)
    mask = mask_bytes(SMALL, MBS, SEQ, E)
    one = _per_op(Plan.every_k(L, 1, num_micro_batches=4))
    four = _per_op(Plan.every_k(L, 1, num_micro_batches=4, micro_batches_per_load=4))
    assert one["embed_bwd"].breakdown["transient"] == t + mask
    assert four["embed_bwd"].breakdown["transient"] == t + 4 * mask + 4 * MBS * SEQ * SMALL.hidden_size * 4


@pytest.fixture(scope="module")
def traces():
    """qwen2.5-7b on an h200, every boundary kept, 8 micro-batches: micro-batch-major, layer-major,
    and layer-major with layers 0-9 resident."""
    shape, hw = load_shape("qwen2.5-7b"), PRESETS["h200"]
    L = shape.num_layers
    kw = dict(seq_len=1024, micro_batch_size=1, num_micro_batches=8)
    plans = {"mb-major": Plan.every_k(L, 1, **kw),
             "layer-major": Plan.every_k(L, 1, micro_batches_per_load=8, **kw),
             "resident": Plan.every_k(L, 1, micro_batches_per_load=8, resident_layers=list(range(10)), **kw)}
    return shape, hw, {k: simulate(p, shape, hw) for k, p in plans.items()}


def _copies(sim, step=1):
    """Per unit: weight copies into slots, and resident refreshes, in step ``step``."""
    slots, refresh = Counter(), Counter()
    for iv in sim.intervals:
        if iv.label.startswith("w ") and iv.step == step:
            unit, slot = iv.label[2:].rsplit(" @", 1)
            (refresh if slot == "resident" else slots)[unit] += 1
    return slots, refresh


def test_layer_major_streams_each_layer_twice_per_step_and_resident_layers_once(traces):
    """Each layer's weights cross PCIe once for its forwards and once for its backwards per step
    in layer-major order (16 times micro-batch-major at 8 micro-batches); a resident layer's
    only once per step, its refresh; each layer's gradient once per step, in fp32; the checker
    passes on all three traces.

    Mutations seen failing: the simulator's groups of one micro-batch whatever
    ``micro_batches_per_load`` says (16 copies per layer); the weights acquired and released
    for every micro-batch of a group (the weight window then out of step)."""
    shape, hw, sims = traces
    L = shape.num_layers
    mb, _ = _copies(sims["mb-major"])
    lm, lm_refresh = _copies(sims["layer-major"])
    res, res_refresh = _copies(sims["resident"])
    for i in range(L):
        u = layer_unit(i)
        assert mb[u] == 16 and lm[u] == 2, (u, mb[u], lm[u])
        assert (res[u], res_refresh[u]) == ((0, 1) if i < 10 else (2, 0)), u
    assert not lm_refresh
    grads = Counter(iv.label for iv in sims["layer-major"].intervals if iv.label.startswith("grad ") and iv.step == 1)
    assert all(grads[f"grad {layer_unit(i)}"] == 1 for i in range(L))
    cost = CostModel(shape, hw, 1, 1024)
    g = next(iv for iv in sims["layer-major"].intervals if iv.label == "grad layers.3")
    assert g.end - g.start == pytest.approx(cost.d2h_s(shape.unit_params("layers.3") * 4))
    for name, sim in sims.items():
        rep = check(sim, shape, hw)
        assert rep.ok, (name, rep.violations[:3])
    assert sims["layer-major"].step_s < sims["mb-major"].step_s


def test_the_host_store_keeps_bf16_gradients_when_every_gradient_lands_once(traces):
    """Layer-major over all 8 micro-batches: each unit's gradient lands once, so the store's
    gradients are bf16 (2 B/param less than micro-batch-major's fp32 sums).

    Mutation seen failing: the simulator's store with bf16 gradients only at one micro-batch
    (``plan.num_micro_batches == 1``, as before layer-major order)."""
    shape, hw, sims = traces
    cost = CostModel(shape, hw, 1, 1024)
    assert sims["layer-major"].host_store_bytes == cost.host_store_bytes(bf16_grads=True)
    assert sims["mb-major"].host_store_bytes == cost.host_store_bytes()
    params = sum(shape.unit_params(u) for u in shape.unit_names())
    assert sims["mb-major"].host_store_bytes - sims["layer-major"].host_store_bytes > 1.8 * params


def test_checker_catches_a_resident_layer_used_before_its_refresh(traces):
    """The checker's resident rule: an op on a resident layer after that layer's refresh of the
    step; moving a refresh past its first use is a violation.

    Mutation seen failing: the rule's loop over the op's resident units removed."""
    shape, hw, sims = traces
    sim = sims["resident"]
    iv = next(iv for iv in sim.intervals if iv.label == "w layers.5 @resident" and iv.step == 1)
    first = min(o["start"] for o in sim.op_log if o["step"] == 1 and o["index"] == 5)
    moved = replace(iv, start=first + 1.0, end=first + 1.1)
    bad = replace(sim, intervals=[moved if x is iv else x for x in sim.intervals])
    assert any("resident weights of layers.5" in v for v in check(bad, shape, hw).violations)


def test_milp_makes_layers_resident_where_the_weights_fit_and_it_pays():
    """qwen2.5-7b on an h200 (with a fast host, so the gradients' accumulation and the optimizer
    do not bind) at 4 micro-batches of one 1024-token sequence, micro-batch-major, is PCIe-bound
    (a layer's copy outlasts its compute, and crosses 8 times per step): with resident layers
    allowed the MILP keeps layers on the device (one refresh per step), its step is shorter than
    without in the simulator too, and its plan fits and passes the checker. On qwen2.5-72b (145 GB of bf16 weights,
    more than the device) only some are resident and the plan still fits.

    Mutation seen failing: the resident weights left out of the device rows (every 72b layer
    resident: the simulator's device peak then over capacity)."""
    hw = replace(PRESETS["h200"], host_accum_bf16_gbps=1000.0, host_accum_gbps=1000.0,
                 optimizer_params_per_s=1e11, optimizer_8bit_params_per_s=1e11,
                 host_mem_bytes=2000 * 10**9)  # a whole node's RAM: the 72b store needs it
    shape = load_shape("qwen2.5-7b")
    model = StepModel(shape, hw, 1, 1024, 4)
    plain = solve(model, MilpConfig(internal_tiers=("recompute",)))
    res = solve(model, MilpConfig(internal_tiers=("recompute",), resident=True))
    assert len(res.resident_layers) > shape.num_layers // 2
    assert res.objective_s < plain.objective_s * 0.9
    sim = simulate(res.plan(model), shape, hw)
    assert sim.fits and check(sim, shape, hw).ok
    assert sim.step_s < 0.9 * simulate(plain.plan(model), shape, hw, keep_trace=False).step_s
    big = load_shape("qwen2.5-72b")
    model = StepModel(big, hw, 1, 1024, 4)
    r = solve(model, MilpConfig(internal_tiers=("recompute",), resident=True))
    assert 0 < len(r.resident_layers) < big.num_layers
    assert simulate(r.plan(model), big, hw, keep_trace=False).fits


def test_search_emits_layer_major_plans_with_their_fields_and_the_simulators_predictions():
    """qwen2.5-14b on an h200, 8 sequences of 4096 tokens as micro-batches of 1 or 2: the search
    with the new options emits a layer-major plan (every micro-batch sharing each weight load)
    at least as fast as the best plan without them; the plan carries ``micro_batches_per_load``
    and ``resident_layers`` through its JSON, and ``plan.predicted`` is what the simulator says of
    it. The MILP's own plan is never slower than a fixed rule.

    Mutation seen failing: the search's per-load options left at 1 (the plan then
    micro-batch-major)."""
    from layerwise.planner.search import SearchConfig, search

    shape, hw = load_shape("qwen2.5-14b"), PRESETS["h200"]
    cfg = dict(global_batch=8, micro_batch_sizes=(1, 2), prefetch_depth=1)
    new = search(shape, hw, 4096, SearchConfig(**cfg))
    old = search(shape, hw, 4096, SearchConfig(per_loads=(1,), resident=False, **cfg))
    p = new.plan
    assert p.layer_major and p.lands_once() and old.plan.micro_batches_per_load == 1
    assert new.best.sim.tokens_per_s > 1.05 * old.best.sim.tokens_per_s
    again = Plan.from_dict(p.to_dict())
    assert (again.micro_batches_per_load, again.resident_layers) == (p.micro_batches_per_load, p.resident_layers)
    sim = simulate(p, shape, hw)
    assert p.predicted["step_s"] == pytest.approx(sim.step_s, rel=1e-12)
    assert p.predicted["peak_host_bytes"] == sim.peak_host_bytes
    assert p.predicted["micro_batches_per_load"] == p.micro_batches_per_load
    assert p.predicted["resident_layers"] == p.resident_layers
    assert check(sim, shape, hw).ok
    milp = new.by_name["milp"].sim.tokens_per_s
    assert all(milp >= c.sim.tokens_per_s * (1 - 1e-3) for n, c in new.by_name.items() if n != "milp")


def test_a_store_that_fits_only_with_bf16_gradients_is_planned_layer_major():
    """qwen2.5-14b's store with 8-bit moments needs ~118 GB with bf16 gradients, ~148 GB with
    fp32 ones; with 124 GB usable on the host only a plan whose gradients land once fits, and
    the search finds one (layer-major over all micro-batches) where micro-batch-major alone
    finds none.

    Mutation seen failing: the host check of the search with fp32 gradients whatever the
    order (``choose_moments`` without ``bf16_grads``: the search refuses at once)."""
    from layerwise.planner.host_fit import PlanInfeasible
    from layerwise.planner.search import SearchConfig, search

    shape = load_shape("qwen2.5-14b")
    # no NVMe space: every unit's optimizer state stays in RAM
    hw = replace(PRESETS["h200"], host_mem_bytes=128 * 10**9, host_reserved_bytes=4 * 10**9, nvme_capacity_bytes=0)
    cost = CostModel(shape, hw, 1, 4096)
    eight = ["8bit"] * len(shape.unit_names())
    assert cost.host_store_bytes(eight, bf16_grads=True) < hw.host_cap_bytes < cost.host_store_bytes(eight)
    cfg = dict(global_batch=4, micro_batch_sizes=(1,), prefetch_depth=1)
    res = search(shape, hw, 4096, SearchConfig(**cfg))
    assert res.plan.lands_once() and res.best.sim.fits
    assert res.best.sim.host_store_bytes == cost.host_store_bytes(res.plan.moments, bf16_grads=True)
    with pytest.raises(PlanInfeasible):
        search(shape, hw, 4096, SearchConfig(per_loads=(1,), **cfg))
