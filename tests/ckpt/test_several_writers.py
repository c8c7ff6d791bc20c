"""Saves written by several ranks (``Checkpointer(exchange=, mine=)``), each rank a thread of this
process with an in-memory exchange that makes the calls ``TorchExchange`` makes: the protocol
(rank 0 chooses, every rank writes its groups, rank 0 gathers and commits) and its failures.
The same saves by 2 gloo processes: ``tests/train/test_distributed.py``."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

from layerwise.ckpt import Checkpointer, RunDir
from layerwise.ckpt.errors import CheckpointError, CheckpointWriteError
from layerwise.ckpt.save_writer import SaveWriter

from test_core_helpers import make_training, train_step


class _Hub:
    """What the ranks share: a barrier and one slot per rank."""

    def __init__(self, n: int):
        self.n, self.slots, self.box = n, [None] * n, None
        self.meet = threading.Barrier(n, timeout=20)


class ThreadRank:
    """One thread's ``RankExchange``."""

    def __init__(self, hub: _Hub, rank: int):
        self.hub, self.rank, self.world_size = hub, rank, hub.n

    def broadcast(self, obj, src: int = 0):
        if self.rank == src:
            self.hub.box = obj
        self.hub.meet.wait()
        out = self.hub.box
        self.hub.meet.wait()
        return out

    def gather(self, obj, dst: int = 0):
        self.hub.slots[self.rank] = obj
        self.hub.meet.wait()
        out = list(self.hub.slots) if self.rank == dst else None
        self.hub.meet.wait()
        return out

    def barrier(self) -> None:
        self.hub.meet.wait()


def _ranks(n: int) -> list[ThreadRank]:
    hub = _Hub(n)
    return [ThreadRank(hub, r) for r in range(n)]


def _on_every_rank(cks: list[Checkpointer], step: int) -> list[BaseException | None]:
    """``save(step)`` then ``wait()`` on every rank at once; each rank's error (or None)."""
    errors: list[BaseException | None] = [None] * len(cks)

    def run(r: int) -> None:
        try:
            cks[r].save(step, extra={"at": step})
            cks[r].wait()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            errors[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(len(cks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def _split(cks_groups: list[str]) -> list[set[str]]:
    return [set(cks_groups[0::2]), set(cks_groups[1::2])]


def _manifest(run: Path, step: int) -> dict:
    return json.loads((run / "steps" / f"{step:012d}" / "manifest.json").read_text())


def test_two_writers_commit_what_one_process_commits(tmp_path):
    """Six saves under the ``topk`` policy (so each chooses some groups) of one training,
    written by two ranks that split the groups, commit the same manifests' groups (blob, digest,
    saved and written steps) as one process saving the same training; rank 1's checkpointer
    writes no step files, and loads back like any run.

    Mutation seen failing: rank 1 taking its choice from its own policy instead of rank 0's
    broadcast (its groups' versions then differ from the single process's)."""
    def train(run: Path, n: int) -> list[Checkpointer]:
        torch.manual_seed(0)
        model, opt, sched = make_training(seed=1)
        probe = Checkpointer(tmp_path / "probe", model, opt, async_save=False)
        mine = _split(probe.groups)
        probe.close()
        exchanges = _ranks(n) if n > 1 else [None]
        cks = [Checkpointer(run, model, opt, sched, "topk", k=3, max_staleness=4,
                            exchange=ex, mine=mine[r] if n > 1 else None)
               for r, ex in enumerate(exchanges)]
        for step in range(1, 7):
            for _ in range(step % 3 + 1):
                train_step(model, opt, sched)
            assert _on_every_rank(cks, step) == [None] * n
        return cks

    two, one = train(tmp_path / "two", 2), train(tmp_path / "one", 1)
    chosen = [len(two[0].reports[i].selected) for i in range(6)]
    assert 0 < min(chosen[1:]) and max(chosen[1:]) < len(two[0].groups), chosen  # a real choice
    for step in range(1, 7):
        a, b = _manifest(tmp_path / "two", step), _manifest(tmp_path / "one", step)
        assert a["groups"] == b["groups"] and a["groups_written"] == b["groups_written"], step
    assert [r.selected for r in two[1].reports] == [r.selected for r in two[0].reports]
    assert not list((tmp_path / "two" / "steps").rglob("*.tmp"))
    assert RunDir.open(tmp_path / "two").verify().ok
    for ck in [*two, *one]:
        ck.close()


def test_a_rank_that_cannot_write_fails_the_save_everywhere_and_commits_nothing(tmp_path, monkeypatch):
    """Rank 1's blob write fails (disk full): rank 1 raises its own error, rank 0 raises one
    naming rank 1's, the step is not committed, and the next save of both commits every group.

    Mutation seen failing: rank 1 raising before it joins the gather (rank 0 then waits at the
    gather until the exchange times out; here the thread barrier's 20 s)."""
    model, opt, sched = make_training()
    train_step(model, opt, sched)
    exchanges = _ranks(2)
    probe = Checkpointer(tmp_path / "probe", model, opt, async_save=False)
    mine = _split(probe.groups)
    probe.close()
    cks = [Checkpointer(tmp_path / "run", model, opt, sched, "full", exchange=ex, mine=mine[r])
           for r, ex in enumerate(exchanges)]
    assert _on_every_rank(cks, 1) == [None, None]
    write_blobs = SaveWriter._write_blobs

    def full_disk_on_rank_1(writer, job):
        if writer.exchange.rank == 1:
            raise CheckpointWriteError("checkpoint write failed: the disk is full")
        return write_blobs(writer, job)
    monkeypatch.setattr(SaveWriter, "_write_blobs", full_disk_on_rank_1)
    train_step(model, opt, sched)
    errors = _on_every_rank(cks, 2)
    assert isinstance(errors[1], CheckpointWriteError), errors
    assert isinstance(errors[0], CheckpointError) and "rank 1" in str(errors[0]), errors
    assert "disk is full" in str(errors[0])
    assert RunDir.open(tmp_path / "run").committed_steps() == [1]
    monkeypatch.undo()
    assert _on_every_rank(cks, 3) == [None, None]
    entries = _manifest(tmp_path / "run", 3)["groups"]
    assert {e["saved_step"] for e in entries.values()} == {3} and entries.keys() == set(cks[0].groups)
    assert RunDir.open(tmp_path / "run").verify().ok
    for ck in cks:
        ck.close()


def test_groups_no_rank_writes_and_blobs_rank_0_cannot_see_are_refused(tmp_path):
    """Rank 0 commits only when every chosen group has a record and every blob is in its run
    directory: mine= sets that leave a group out, and a rank writing into another directory
    (a node whose run directory is not the shared one), both fail on rank 0 with nothing
    committed.

    Mutation seen failing: dropping the visibility check (``_visible``): rank 0 commits a step
    naming blobs that are not in its run directory."""
    model, opt, sched = make_training()
    train_step(model, opt, sched)
    probe = Checkpointer(tmp_path / "probe", model, opt, async_save=False)
    groups = probe.groups
    probe.close()
    ex = _ranks(2)
    cks = [Checkpointer(tmp_path / "gap", model, opt, sched, "full", exchange=ex[0],
                        mine=set(groups[:2])),
           Checkpointer(tmp_path / "gap", model, opt, sched, "full", exchange=ex[1],
                        mine=set(groups[3:]))]
    errors = _on_every_rank(cks, 1)
    assert errors[1] is None and "no rank wrote" in str(errors[0]) and groups[2] in str(errors[0])
    ex = _ranks(2)
    elsewhere = [Checkpointer(tmp_path / "here", model, opt, sched, "full", exchange=ex[0],
                              mine=set(groups[:2])),
                 Checkpointer(tmp_path / "there", model, opt, sched, "full", exchange=ex[1],
                              mine=set(groups[2:]))]
    errors = _on_every_rank(elsewhere, 1)
    assert errors[1] is None and "filesystem every writing rank sees" in str(errors[0]), errors
    for run in ("gap", "here"):
        assert RunDir.open(tmp_path / run).committed_steps() == []
    for ck in [*cks, *elsewhere]:
        ck.close()


def test_several_writers_options_are_checked(tmp_path):
    model, opt, _ = make_training()
    with pytest.raises(ValueError, match="snapshot='deferred'"):
        Checkpointer(tmp_path / "a", model, opt, snapshot="deferred", exchange=_ranks(2)[0])
    with pytest.raises(ValueError, match="does not have"):
        Checkpointer(tmp_path / "b", model, opt, mine={"layers.99"})
    ck = Checkpointer(tmp_path / "c", model, opt, mine=lambda g: g.startswith("layers."))
    assert ck.mine == {g for g in ck.groups if g.startswith("layers.")} and ck.mine
    ck.close()
