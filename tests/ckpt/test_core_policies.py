"""Selection policies on synthetic group statistics (no tensors)."""

from __future__ import annotations

import math

import pytest

from layerwise.ckpt.policies import GroupStatus, PolicyContext, make_policy

NAMES = ["embed", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]


def ctx(save_index, change, age=1, nbytes=None, step=None):
    nbytes = nbytes or {}
    ages = age if isinstance(age, dict) else {n: age for n in NAMES}
    return PolicyContext(step if step is not None else save_index * 10, save_index, [
        GroupStatus(n, nbytes.get(n, 100), change.get(n, 0.0), ages[n], i) for i, n in enumerate(NAMES)
    ])


def test_first_save_and_never_saved_groups_are_forced():
    for name in ("parity", "filter", "topk", "budget"):
        p = make_policy(name)
        assert p.select(ctx(0, {}, age=None)) == set(NAMES)
        ages = {n: 1 for n in NAMES} | {"layers.2": None}
        assert "layers.2" in p.select(ctx(3, {}, age=ages))


def test_full_and_parity():
    assert make_policy("full").select(ctx(5, {})) == set(NAMES)
    even = make_policy("parity").select(ctx(2, {}))
    odd = make_policy("parity").select(ctx(3, {}))
    assert even | odd == set(NAMES) and not even & odd
    assert even == {"embed", "layers.1", "layers.3", "lm_head"}


def test_filter_threshold_staleness_and_full_every():
    change = {"layers.0": 0.2, "layers.1": 0.05, "lm_head": 0.5}
    p = make_policy("filter", threshold=0.1)
    assert p.select(ctx(4, change)) == {"layers.0", "lm_head"}
    p = make_policy("filter:threshold=0.1,max_staleness=3")
    ages = {n: 1 for n in NAMES} | {"norm": 4, "layers.3": 3}
    assert p.select(ctx(4, change, age=ages)) == {"layers.0", "lm_head", "norm"}
    p = make_policy("filter", threshold=0.1, full_every=4)
    assert p.select(ctx(8, change)) == set(NAMES) and p.select(ctx(9, change)) != set(NAMES)
    assert make_policy("filter", max_staleness=0).select(ctx(4, {})) == set(NAMES)


def test_topk_and_budget():
    change = {"layers.0": 0.3, "layers.1": 0.2, "layers.2": 0.1, "embed": 0.05}
    assert make_policy("topk", k=2).select(ctx(3, change)) == {"layers.0", "layers.1"}
    ages = {n: 1 for n in NAMES} | {"norm": 9}
    assert make_policy("topk", k=2, max_staleness=5).select(ctx(3, change, age=ages)) == {"norm", "layers.0"}
    nbytes = {"layers.0": 1000, "layers.1": 100, "layers.2": 100, "embed": 10}
    # Budget 250 bytes, greedy by change per byte: embed (0.005/B), layers.1 (0.002/B),
    # layers.2 (0.001/B); layers.0 (0.0003/B) does not fit.
    assert make_policy("budget", budget_bytes=250).select(ctx(3, change, nbytes=nbytes)) == {
        "embed", "layers.1", "layers.2"}
    total = sum(nbytes.get(n, 100) for n in NAMES)
    got = make_policy("budget", budget_fraction=0.1).select(ctx(3, change, nbytes=nbytes))
    assert sum(nbytes.get(n, 100) for n in got) <= 0.1 * total


def test_unchanged_groups_are_not_chosen():
    change = {n: 0.0 for n in NAMES}
    assert make_policy("topk", k=3).select(ctx(2, change)) == set()
    assert make_policy("budget", budget_fraction=1.0).select(ctx(2, change)) == set()
    assert make_policy("filter", threshold=0.0).select(ctx(2, change)) == set()
    assert make_policy("filter", threshold=0.0).select(ctx(2, {"norm": math.inf})) == {"norm"}


def test_bad_options():
    with pytest.raises(ValueError, match="max_staleness"):
        make_policy("filter", max_staleness=-1)
    with pytest.raises(ValueError, match="key=value"):
        make_policy("filter:threshold")
    with pytest.raises(ValueError, match="budget_fraction"):
        make_policy("budget", budget_fraction=0)
    with pytest.raises(ValueError, match="k must be"):
        make_policy("topk", k=0)


def test_reasons_name_the_guard_before_the_criterion():
    """``select_reasons``: a group a guard forces counts for the guard even when the criterion
    would also pick it, so ``criterion_share`` (ckpt_savings) never credits the threshold with
    a guard's write.

    Mutation this fails on (made once, by hand): the criterion's choices written over the
    guards' (``out.update`` instead of ``setdefault``): ``norm`` reads "criterion"."""
    change = {"layers.0": 0.2, "layers.1": 0.05, "lm_head": 0.5, "norm": 0.3}
    p = make_policy("filter:threshold=0.1,max_staleness=3")
    ages = {n: 1 for n in NAMES} | {"norm": 4, "layers.3": None}
    got = p.select_reasons(ctx(4, change, age=ages))
    assert got == {"layers.3": "new", "norm": "stale", "layers.0": "criterion", "lm_head": "criterion"}
    assert set(got) == p.select(ctx(4, change, age=ages))
    full = make_policy("filter", threshold=0.1, full_every=4).select_reasons(ctx(8, change, age=ages))
    assert full["layers.3"] == "new" and {full[n] for n in NAMES if n != "layers.3"} == {"full_every"}
    assert set(make_policy("topk", k=2).select_reasons(ctx(3, change)).values()) == {"criterion"}


def test_filter_cap_spreads_groups_that_cross_together():
    """``max_fraction``: the most changed groups over the threshold first, up to the cap
    (forced groups count first); a group larger than the cap alone still goes when nothing
    else is written."""
    change = {"layers.0": 0.2, "layers.1": 0.3, "layers.2": 0.25, "layers.3": 0.05}
    p = make_policy("filter", threshold=0.1, max_fraction=2 / 7)  # 200 of 700 bytes
    assert p.select(ctx(4, change)) == {"layers.1", "layers.2"}
    ages = {n: 1 for n in NAMES} | {"norm": None}
    assert p.select(ctx(4, change, age=ages)) == {"norm", "layers.1"}
    big = {"layers.1": 1000}
    assert p.select(ctx(4, change, nbytes=big)) == {"layers.1"}
    assert make_policy("filter", threshold=0.1).select(ctx(4, change)) == {"layers.0", "layers.1", "layers.2"}
    with pytest.raises(ValueError, match="max_fraction"):
        make_policy("filter", max_fraction=0)
