"""Deferred snapshots: the statistics and the copy of a save (and ``observe``) taken on the helper
thread after ``save`` returns, while training goes on, must be those a synchronous save takes.

The helper thread is held on purpose (``held_helper``) until the training loop's next
``optimizer.step()`` is waiting for it (or ``wait()`` is called): the step must wait for it.
"""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from layerwise.ckpt import Checkpointer, RunDir
from layerwise.ckpt.snapshot import UpdateGate
from layerwise.ckpt.errors import StateModifiedError
from layerwise.ckpt.provider import DictStateProvider
from layerwise.ckpt.tracker import UpdateTracker

from test_core_helpers import make_training


@pytest.fixture
def held_helper(monkeypatch) -> threading.Event:
    """The helper thread's work (a deferred save's ``_prepare``, a deferred observation) starts
    only once the training loop waits for it: in the next optimizer step's hook, or in
    ``wait()``. Clear the returned event before a ``save``/``observe`` whose helper work should
    be held."""
    main = threading.current_thread()
    released = threading.Event()
    prepare, observe = Checkpointer._prepare, UpdateTracker.observe
    gate_wait, ck_wait = UpdateGate.wait, Checkpointer.wait

    def held(fn):
        def run(self, *a, **k):
            if threading.current_thread() is not main:
                assert released.wait(30), "the training loop never waited for the helper"
            return fn(self, *a, **k)
        return run

    def release(fn):
        def run(self, *a, **k):
            released.set()
            return fn(self, *a, **k)
        return run

    monkeypatch.setattr(Checkpointer, "_prepare", held(prepare))
    monkeypatch.setattr(UpdateTracker, "observe", held(observe))
    monkeypatch.setattr(UpdateGate, "wait", release(gate_wait))
    monkeypatch.setattr(Checkpointer, "wait", release(ck_wait))
    return released


def _batch(step: int) -> torch.Tensor:
    return torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(step))


def _train(run, snapshot: str, steps: int = 9, every: int = 3, zero_in_place: bool = False,
           held: threading.Event | None = None):
    """A short run saving every ``every`` steps under ``filter`` (a threshold that picks some
    groups, not all); observes and saves right after the optimizer step, as the HF callback
    does, and goes on training without waiting."""
    model, opt, sched = make_training(seed=3, lr=3e-3)
    ck = Checkpointer(run, model, opt, sched, policy="filter", threshold=0.02, max_staleness=2,
                      track_every_steps=every, snapshot=snapshot)
    stats, reports = [], []
    for step in range(1, steps + 1):
        x = _batch(step)
        model(input_ids=x, labels=x).loss.backward()
        opt.step()
        sched.step()
        if held is not None:
            held.clear()
        s = ck.observe(step)
        if s is not None:
            stats.append(s)
        opt.zero_grad(set_to_none=not zero_in_place)
        if step % every == 0:
            reports.append(ck.save(step, data_position=step))
    ck.close()
    return [{g: dict(v) for g, v in s.items()} for s in stats], reports


def _manifests(run) -> list[dict]:
    store = RunDir.open(run)
    return [store.read_manifest(s) for s in store.committed_steps()]


def test_a_deferred_save_stores_what_a_synchronous_save_stores(tmp_path, held_helper):
    """Same run twice, snapshots ``sync`` and deferred: the same groups are chosen for the same
    reasons, with the same blob bytes (BLAKE3 names), and the statistics are equal, although
    every deferred snapshot was still being taken when the next optimizer step came (it
    waited: ``stall_s`` > 0).

    Mutations this fails on (each made by hand): the update hook not waiting
    (``UpdateGate.wait`` returning at once): the copy races the optimizer step and the save
    fails with ``StateModifiedError``; that and ``_check_unmodified`` disabled: other blobs or
    other choices than the synchronous run's (2 of 3 tries; the third: ``stall_s`` 0, no step
    waited).
    """
    sync_stats, sync_reps = _train(tmp_path / "sync", "sync")
    def_stats, def_reps = _train(tmp_path / "deferred", "deferred", held=held_helper)
    assert not any(r.deferred for r in sync_reps) and all(r.deferred for r in def_reps)
    assert [r.selected for r in def_reps] == [r.selected for r in sync_reps]
    assert [r.reasons for r in def_reps] == [r.reasons for r in sync_reps]
    assert {"criterion"} <= {v for r in sync_reps for v in r.reasons.values()}
    assert any(len(r.selected) < len(sync_reps[0].selected) for r in sync_reps[1:])  # not all
    for a, b in zip(_manifests(tmp_path / "sync"), _manifests(tmp_path / "deferred"), strict=True):
        assert {g: e["blob"] for g, e in a["groups"].items()} == \
            {g: e["blob"] for g, e in b["groups"].items()}
        assert a["groups_written"] == b["groups_written"]
    assert def_stats == sync_stats
    logs = [[json.loads(x) for x in (tmp_path / r / "tracker.jsonl").read_text().splitlines()]
            for r in ("sync", "deferred")]
    assert logs[0] == logs[1] and len(logs[0]) == 3
    assert all(r.stall_s > 0 for r in def_reps[:-1]), [r.stall_s for r in def_reps]


def test_state_written_in_place_before_the_snapshot_fails_the_save(tmp_path, held_helper):
    """A weight changed in place (not by the optimizer step, which waits) after ``save`` and
    before its deferred snapshot read it: the save fails, nothing of it is committed, and the
    next save writes what changed since the last commit.

    Mutations this fails on (each made once, by hand): the ``_check_unmodified`` call removed
    from ``_prepare`` (the step commits the weights as changed after ``save``);
    ``LiveGroup.modified`` always False."""
    model, opt, sched = make_training(seed=1)
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="full", tracker_log=False)
    x = _batch(0)
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    ck.save(1)
    ck.wait()
    model(input_ids=x, labels=x).loss.backward()
    opt.step()
    held_helper.clear()
    ck.save(2)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.add_(1.0)  # before the helper reads it
    with pytest.raises(StateModifiedError, match="written in place after save"):
        ck.wait()
    assert RunDir.open(tmp_path / "run").committed_steps() == [1]
    rep = ck.save(3)
    ck.wait()
    assert sorted(rep.written) == sorted(ck.groups)  # everything moved since step 1
    ck.close()


def test_a_deferred_observation_never_reports_a_later_gradient(tmp_path, held_helper):
    """Gradients zeroed in place (``zero_grad(set_to_none=False)``) before the helper thread
    read them: their norm is NaN (``null`` in tracker.jsonl), never the zeroed gradient's 0;
    weight changes and moment norms are still exact (the optimizer step waited).

    Mutation this fails on (made once, by hand): ``LiveGroup.modified`` always False (the norm
    of the zeroed gradients, 0.0, is reported)."""
    sync_stats, _ = _train(tmp_path / "sync", "sync", steps=3)
    def_stats, _ = _train(tmp_path / "deferred", "deferred", steps=3, zero_in_place=True,
                          held=held_helper)
    assert all(math.isnan(s["grad_norm"]) for s in def_stats[0].values())
    for g, s in def_stats[0].items():
        want = sync_stats[0][g]
        assert (s["change"], s["exp_avg_norm"], s["exp_avg_sq_norm"]) == \
            (want["change"], want["exp_avg_norm"], want["exp_avg_sq_norm"])
    log = json.loads((tmp_path / "deferred" / "tracker.jsonl").read_text().splitlines()[0])
    assert all(v["grad_norm"] is None for v in log["groups"].values())


def test_snapshot_modes(tmp_path):
    """``auto`` defers with a torch optimizer on the CPU and stays synchronous where nothing can
    hold updates back (a plain provider) or without ``async_save``; ``deferred`` refuses what
    it cannot do."""
    model, opt, sched = make_training()
    with Checkpointer(tmp_path / "a", model, opt, sched, tracker_log=False) as ck:
        assert ck.save(1).deferred
    with Checkpointer(tmp_path / "b", model, opt, sched, async_save=False, tracker_log=False) as ck:
        assert not ck.save(1).deferred
    prov = DictStateProvider({"layers.0": {"param/layers.0.w": torch.ones(4)}})
    with Checkpointer(tmp_path / "c", provider=prov, tracker_log=False) as ck:
        assert not ck.save(1).deferred
    with pytest.raises(ValueError, match="snapshot='deferred' needs"):
        Checkpointer(tmp_path / "d", provider=prov, snapshot="deferred")
    with pytest.raises(ValueError, match="snapshot must be one of"):
        Checkpointer(tmp_path / "e", model, opt, snapshot="later")
