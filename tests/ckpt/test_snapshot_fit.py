"""A save whose host snapshot would not fit in the RAM available writes from the live tensors
(``ckpt.snapshot_fit``): nothing copied, the same bytes on disk, training waits for the write.

The available memory is injected (``Checkpointer(available_memory=)``), one byte short of the
copy's need plus the margin, or exactly enough. The writer is slowed down (``slow_writer``) so
that a live write left running in the background while training goes on would store a later
state: the tests below then see other bytes.
"""

from __future__ import annotations

import time

import pytest
import torch

from layerwise.ckpt import Checkpointer, RunDir
from layerwise.ckpt.collective import SingleProcess
from layerwise.ckpt.host_copies import HostBufferPool, stored_nbytes
from layerwise.ckpt.provider import ModuleStateProvider, group_tensors
from layerwise.ckpt.save_writer import SaveWriter
from layerwise.ckpt.snapshot_fit import MARGIN_BYTES, host_need_bytes

from log_lines import logged_lines
from test_ckpt_8bit import all_8bit, assert_same_state, fresh, unit_states
from test_core_deferred import held_helper  # noqa: F401  (fixture)
from test_core_helpers import make_training, snapshot, train_step
from test_engine_store_ckpt import data
from test_several_writers import _manifest, _on_every_rank, _ranks, _split

LIVE_LINE = "writes straight from the live tensors"


@pytest.fixture
def slow_writer(monkeypatch):
    run = SaveWriter.run

    def slow(self, job):
        time.sleep(0.3)
        return run(self, job)
    monkeypatch.setattr(SaveWriter, "run", slow)


@pytest.fixture
def copies(monkeypatch) -> list[int]:
    """The bytes of every host copy the checkpointers make (one entry per tensor copied)."""
    made: list[int] = []
    copy = HostBufferPool.copy

    def counted(self, t, key):
        out = copy(self, t, key)
        made.append(out.nbytes)
        return out
    monkeypatch.setattr(HostBufferPool, "copy", counted)
    return made


def full_bytes(model, opt) -> int:
    prov = ModuleStateProvider(model, opt)
    return sum(stored_nbytes(k, t) for g in prov.group_names()
               for k, t in group_tensors(prov, g).items())


def blobs(run) -> list[dict[str, str]]:
    store = RunDir.open(run)
    return [{g: e["blob"] for g, e in store.read_manifest(s)["groups"].items()}
            for s in store.committed_steps()]


def _run(run, short_by: int):
    """Saves at steps 2 and 4 of 5 (``full``, async, snapshot taken in ``save``), the RAM available the first copy's need
    plus the margin, less ``short_by``. Returns the reports, the state at each save (as each
    report was returned), the log lines."""
    torch.manual_seed(0)
    model, opt, sched = make_training(seed=3)
    train_step(model, opt, sched)
    avail = MARGIN_BYTES + full_bytes(model, opt) - short_by
    ck = Checkpointer(run, model, opt, sched, policy="full", snapshot="sync",
                      available_memory=lambda: avail)
    reports, states = [], {}
    with logged_lines() as lines:
        for step in range(2, 6):
            train_step(model, opt, sched)
            if step % 2 == 0:
                states[step] = snapshot(model, opt)
                reports.append(ck.save(step))
                reports[-1].returned_write_s = reports[-1].write_s
        ck.close()
    return reports, states, lines


def test_a_save_that_does_not_fit_writes_live_the_bytes_a_copy_writes(tmp_path, copies,
                                                                     slow_writer):
    """One byte short: both saves write from the live tensors (no host copy made), inside
    ``save`` (its write is adopted when it returns), report ``snapshot == "live"``, log one
    WARNING for the run, and store the same blobs (BLAKE3 names) as the same run with exactly
    enough memory, which copies in the background. Each step loads back bit-identical.

    Mutations this fails on (each made once, by hand): ``SnapshotFit.decide`` copying whatever
    the memory (the live run copies and reports ``copy``); ``_start_write`` ignoring
    ``prepared.copied`` (the live write on the writer thread: not adopted on return, and
    training goes on under it, so step 2's blob holds step 3's weights); the margin left out of
    the comparison (the short run copies)."""
    reps, states, lines = _run(tmp_path / "copy", 0)
    copied = list(copies)
    assert [r.snapshot for r in reps] == ["copy", "copy"]
    assert [r.returned_write_s for r in reps] == [None, None]  # written in the background
    assert sum(copied) == reps[0].snapshot_bytes + reps[1].snapshot_bytes > 0
    assert not [x for x in lines if LIVE_LINE in x]

    copies.clear()
    live_reps, live_states, live_lines = _run(tmp_path / "live", 1)
    assert copies == []  # no host buffer allocated, not one tensor copied
    assert [r.snapshot for r in live_reps] == ["live", "live"]
    assert all(r.returned_write_s is not None for r in live_reps)  # written inside save
    warned = [x for x in live_lines if LIVE_LINE in x]
    assert len(warned) == 1 and "ckpt.policy=parity" in warned[0], live_lines
    assert [r.snapshot_bytes for r in live_reps] == [r.snapshot_bytes for r in reps]

    assert blobs(tmp_path / "live") == blobs(tmp_path / "copy")
    for step, want in live_states.items():
        for a, b in zip(want.values(), states[step].values(), strict=True):
            assert all(torch.equal(a[k], b[k]) for k in a)  # the two runs are the same run
        model, opt, sched = make_training(seed=9)
        Checkpointer(tmp_path / "live", model, opt, sched).load(step)
        got = snapshot(model, opt)
        for g, tensors in want.items():
            for k, t in tensors.items():
                assert torch.equal(got[g][k].float(), t.float()), (step, g, k)


def test_a_deferred_save_that_does_not_fit_holds_the_step_until_written(tmp_path, copies,
                                                                       slow_writer, held_helper):
    """Deferred snapshot, one byte short: the helper thread writes from the live tensors while
    the next optimizer step waits for it (``stall_s`` > 0), so the committed step is the state
    at ``save`` although training went on at once; nothing was copied.

    Mutation this fails on (made once, by hand): the live write submitted to the writer thread
    in ``snapshot_then_write``: the optimizer step no longer waits for the write (the step is
    not committed when it returns) and runs under it."""
    torch.manual_seed(0)
    model, opt, sched = make_training(seed=3)
    train_step(model, opt, sched)
    avail = MARGIN_BYTES + full_bytes(model, opt) - 1
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="full", snapshot="deferred",
                      available_memory=lambda: avail)
    want = snapshot(model, opt)
    held_helper.clear()
    rep = ck.save(1)
    train_step(model, opt, sched)  # its optimizer step waits for the helper's write
    assert RunDir.open(tmp_path / "run").committed_steps() == [1]
    ck.close()
    assert rep.deferred and rep.snapshot == "live" and rep.stall_s > 0 and copies == []
    model2, opt2, sched2 = make_training(seed=9)
    Checkpointer(tmp_path / "run", model2, opt2, sched2).load(1)
    got = snapshot(model2, opt2)
    for g, tensors in want.items():
        for k, t in tensors.items():
            assert torch.equal(got[g][k].float(), t.float()), (g, k)


def _engine_run(run, short_by: int, steps: int = 6, save_at: int = 3):
    """The streaming engine's store (8-bit moments), saved at ``save_at`` (``full``, async)
    with the RAM available short of the copy's need by ``short_by``; trains on at once."""
    batches = data(97, steps)
    engine, provider = fresh(all_8bit)
    losses = []
    for k, b in enumerate(batches):
        losses.append(engine.train_step([b]).loss)
        if k + 1 == save_at:
            engine.synchronize()
            need = sum(stored_nbytes(key, t) for g in provider.group_names()
                       for key, t in group_tensors(provider, g).items())
            ck = Checkpointer(run, provider=provider, policy="full", async_save=True,
                              available_memory=lambda: MARGIN_BYTES + need - short_by)
            rep = ck.save(save_at)
    engine.synchronize()
    ck.close()
    final = (unit_states(engine), {n: t.clone() for n, t in engine.store.state_dict().items()})
    engine.close()
    return rep, losses, final, batches


def test_a_run_resumes_bit_identical_from_a_live_save(tmp_path, slow_writer):
    """8-bit moments in the engine's host store, saved live (one byte short) while training
    goes on: the save stores the blobs a copying save stores, and a fresh engine (another
    init) resumed from it trains to a bit-identical state and the same losses.

    Mutation this fails on (made once, by hand): ``_start_write`` ignoring ``prepared.copied``
    (the live write runs on the writer thread under the next steps' updates: other blobs,
    another resumed state)."""
    copy_rep, _, _, _ = _engine_run(tmp_path / "copy", 0)
    rep, losses, final, batches = _engine_run(tmp_path / "live", 1)
    assert copy_rep.snapshot == "copy" and rep.snapshot == "live"
    assert blobs(tmp_path / "live") == blobs(tmp_path / "copy")
    engine2, provider2 = fresh(all_8bit, seed=123)
    assert Checkpointer(tmp_path / "live", provider=provider2, policy="full").load().step == 3
    resumed = [engine2.train_step([b]).loss for b in batches[3:]]
    engine2.synchronize()
    got = (unit_states(engine2), {n: t.clone() for n, t in engine2.store.state_dict().items()})
    engine2.close()
    assert resumed == losses[3:]
    assert_same_state(final, got)


def test_the_need_counts_only_buffers_the_pool_does_not_hold(tmp_path):
    """After a copying save the pool keeps the optimizer state's buffers (the weights' are the
    tracker's references until the next save commits): the second save needs fresh buffers for
    the weights alone, and copies when that much (plus the margin) is available; once it
    committed, the first save's references are free too and a third save allocates nothing.

    Mutation this fails on (made once, by hand): ``fresh_nbytes`` counting every tensor (the
    second save would write live)."""
    model, opt, sched = make_training(seed=3)
    train_step(model, opt, sched)
    prov = ModuleStateProvider(model, opt)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    assert full_bytes(model, opt) > 2 * weights  # fp32 AdamW: the moments are twice the weights
    avail = [MARGIN_BYTES + full_bytes(model, opt)]
    ck = Checkpointer(tmp_path / "run", model, opt, sched, policy="full", snapshot="sync",
                      available_memory=lambda: avail[0])
    assert ck.save(1).snapshot == "copy"
    ck.wait()
    pairs = [(k, t) for g in prov.group_names() for k, t in group_tensors(prov, g).items()]
    assert ck._buffers.fresh_nbytes(pairs) == weights
    train_step(model, opt, sched)
    avail[0] = MARGIN_BYTES + weights
    assert ck.save(2).snapshot == "copy"
    ck.wait()  # committed: step 1's weight references are back in the pool
    assert ck._buffers.fresh_nbytes(pairs) == 0
    avail[0] = 0
    train_step(model, opt, sched)
    assert ck.save(3).snapshot == "copy"  # allocates nothing
    ck.close()


class _Rank0Of3:
    """Rank 0 of 3, rank 1 on the same host, rank 2 on another: what rank 0's gather sees."""

    rank, world_size = 0, 3

    def __init__(self, host: str):
        self.host = host

    def gather(self, obj, dst: int = 0):
        return [obj, (self.host, 20), ("elsewhere", 400)]

    def broadcast(self, obj, src: int = 0):
        return obj


def test_ranks_of_one_host_sum_their_needs(monkeypatch):
    """The ranks of one host share its RAM: each compares the bytes all of them would copy.

    Mutation this fails on (made once, by hand): ``host_need_bytes`` returning the rank's own
    need."""
    monkeypatch.setattr("socket.gethostname", lambda: "node-a")
    assert host_need_bytes(_Rank0Of3("node-a"), 5) == 25
    assert host_need_bytes(_Rank0Of3("node-b"), 5) == 5
    assert host_need_bytes(SingleProcess(), 7) == 7


def test_pinned_buffers_count_as_the_caching_host_allocator_takes_them():
    """Copies of device tensors go to pinned buffers, which torch's caching host allocator
    rounds up to a power of two; host tensors' copies are their blob bytes. (A meta tensor
    stands for a device one: the pool pins the copy of anything not on the CPU.)

    Mutation this fails on (made once, by hand): the rounding left out (1200, not 2048)."""
    pool = HostBufferPool()
    dev = torch.empty(3, 100, device="meta")  # 1200 B in fp32
    assert pool.fresh_nbytes([("param/w", dev)]) == 2048
    assert pool.fresh_nbytes([("exp_avg/w", dev.half())]) == 2048  # stored as fp32
    assert pool.fresh_nbytes([("param/w", torch.empty(3, 100))]) == 1200
    assert pool.fresh_nbytes([("param/w", torch.empty(3, 100, dtype=torch.bfloat16)),
                              ("step/w", torch.tensor(1.0))]) == 604


def test_a_rank_of_a_host_without_room_writes_its_share_live(tmp_path):
    """Two writers (threads: one host): rank 1 has room for its own share but not for what
    both ranks would copy, so it writes its groups live inside ``save`` while rank 0, with room
    to spare, copies; the committed groups are those one copying process commits.

    Mutation this fails on (made once, by hand): ``host_need_bytes`` returning the rank's own
    need (rank 1 copies too)."""
    def run(path, n: int, avail: list[int]) -> list[Checkpointer]:
        torch.manual_seed(0)
        model, opt, sched = make_training(seed=1)
        train_step(model, opt, sched)
        whole = full_bytes(model, opt)
        probe = Checkpointer(tmp_path / f"probe{n}", model, opt, async_save=False)
        mine = _split(probe.groups)
        probe.close()
        exchanges = _ranks(n) if n > 1 else [None]
        cks = [Checkpointer(path, model, opt, sched, "full", exchange=ex,
                            mine=mine[r] if n > 1 else None,
                            available_memory=lambda a=avail[r]: MARGIN_BYTES + a * whole)
               for r, ex in enumerate(exchanges)]
        for step in (1, 2):
            train_step(model, opt, sched)
            assert _on_every_rank(cks, step) == [None] * n
        return cks

    two, one = run(tmp_path / "two", 2, [10, 1]), run(tmp_path / "one", 1, [10])
    assert [ck.reports[0].snapshot for ck in two] == ["copy", "live"]
    assert one[0].reports[0].snapshot == "copy"
    for step in (1, 2):
        a, b = _manifest(tmp_path / "two", step), _manifest(tmp_path / "one", step)
        assert a["groups"] == b["groups"], step
    for ck in [*two, *one]:
        ck.close()
