"""``ckpt.sharded`` without FSDP: ZeRO-style flat partitions (pieces that split rows, small
tensors wholly on one rank) saved by 2 gloo processes, read back at 1 and 3 ranks; the policy's
global statistics; per-shard dedup; a save whose shards do not cover a tensor exactly fails on
every rank and commits nothing."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.distributed as dist

import multiproc
from layerwise.ckpt import RunDir, open_run_step
from layerwise.ckpt.collective import SingleProcess, TorchExchange
from layerwise.ckpt.errors import CheckpointWriteError
from layerwise.ckpt.sharded_checkpointer import FlatShard, ShardedCheckpointer

GROUPS = ("layers.0", "layers.1")


def state(version: int) -> dict[str, dict[str, torch.Tensor]]:
    """Two groups; ``version`` 2 moves only ``layers.1``."""
    g = torch.Generator().manual_seed(0)
    out = {"layers.0": {"param/a": torch.randn(5, 3, generator=g), "exp_avg/a": torch.randn(5, 3, generator=g),
                        "param/c": torch.randn(2, generator=g), "step/a": torch.tensor(3.0)},
           "layers.1": {"param/b": torch.randn(7, generator=g), "exp_avg/b": torch.randn(7, generator=g)}}
    if version >= 2:
        out["layers.1"]["param/b"] += 0.5
    return out


class FlatPartitions:
    """ZeRO's layout: every tensor (but scalars) flattened into one buffer in a fixed order, the
    buffer cut into ``world`` equal partitions; this rank holds partition ``rank``; scalars are
    rank 0's (``double_scalars``: every rank hands them, which must fail)."""

    def __init__(self, full: dict, rank: int, world: int, double_scalars: bool = False):
        self.rank, self.world, self.double_scalars = rank, world, double_scalars
        self.shapes = {(g, k): tuple(t.shape) for g, ts in full.items() for k, t in ts.items()}
        self.order = [gk for gk in self.shapes if self.shapes[gk]]
        flat = torch.cat([full[g][k].reshape(-1) for g, k in self.order])
        part = math.ceil(flat.numel() / world)
        self.lo, self.hi = min(rank * part, flat.numel()), min((rank + 1) * part, flat.numel())
        self.mine = flat[self.lo:self.hi].clone()
        self.scalars = {gk: full[gk[0]][gk[1]].clone() for gk in self.shapes if not self.shapes[gk]}

    def _pieces(self, group: str):
        pos = 0
        for g, k in self.order:
            n = math.prod(self.shapes[g, k])
            lo, hi = max(pos, self.lo), min(pos + n, self.hi)
            if g == group and lo < hi:
                yield k, lo - pos, self.mine[lo - self.lo:hi - self.lo]
            pos += n

    def group_names(self) -> list[str]:
        return list(GROUPS)

    def shards(self, group: str) -> list[FlatShard]:
        out = [FlatShard(k, data, start, self.shapes[group, k]) for k, start, data in self._pieces(group)]
        if self.rank == 0 or self.double_scalars:
            out += [FlatShard(k, t.reshape(1), 0, ()) for (g, k), t in self.scalars.items() if g == group]
        return out

    def load_shards(self, group: str, reader) -> None:
        for k, start, data in self._pieces(group):
            data.copy_(reader.read(k, start, start + data.numel()))
        for (g, k), t in self.scalars.items():
            if g == group:
                t.copy_(reader.read(k, 0, 1).reshape(()))

    def model_config(self):
        return None


def _worker(rank: int, run: str, out: str) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ex = TorchExchange(timeout_s=30)
    log = []
    ck = ShardedCheckpointer(run, FlatPartitions(state(1), rank, 2), ex, "filter", threshold=1e-3)
    log.append(ck.save(1))
    ck.provider = FlatPartitions(state(2), rank, 2)
    log.append(ck.save(2))
    log.append(ck.save(3))  # nothing moved: no group chosen by the policy
    ck = ShardedCheckpointer(run, FlatPartitions(state(2), rank, 2), ex, "full")
    log.append(ck.save(4))  # every group chosen, no byte changed
    ck.provider = FlatPartitions(state(2), rank, 2, double_scalars=True)
    try:
        ck.save(5)
        log.append("saved")
    except CheckpointWriteError as e:
        log.append(str(e))
    torch.save([r if isinstance(r, str) else (r.selected, r.written, r.bytes_written, r.changes)
                for r in log], os.path.join(out, f"r{rank}.pt"))


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_zero_style_partitions_two_ranks_to_one_and_three(tmp_path):
    """Saved by 2 ranks whose partitions cut ``exp_avg/a`` mid-row and hold ``exp_avg/b`` whole:
    the policy sees the global change (only ``layers.1`` moved), an unchanged shard is not
    written again, doubled scalars fail on both ranks with nothing committed, and the run reads
    back whole and at 1 and 3 ranks. Mutation seen failing: ``_commit`` without the
    ``shard_layout`` check (step 5 commits with ``step/a`` held twice); ``_entry`` always
    recording ``written_step`` as the save's step."""
    run = tmp_path / "run"
    multiproc.run(_worker, (str(run), str(tmp_path)), log=tmp_path / "rank")
    r0, r1 = (torch.load(tmp_path / f"r{r}.pt", weights_only=False) for r in (0, 1))
    assert [(x[0], x[3]) for x in r0[:4]] == [(x[0], x[3]) for x in r1[:4]]  # one decision
    assert r0[1][0] == ["layers.1"] and r0[1][3]["layers.0"] == 0.0 and r0[1][3]["layers.1"] > 1e-3
    assert r0[2][0] == []
    assert r0[3][0] == list(GROUPS) and r0[3][1] == [] and r0[3][2] == 0  # dedup per shard
    for log in (r0, r1):
        assert "overlaps" in log[4] and "step/a" in log[4] and "Nothing of this save was committed" in log[4]
    assert RunDir.open(run).committed_steps() == [1, 2, 3, 4]
    assert RunDir.open(run).verify().ok
    resaved = RunDir.open(run).read_manifest(4)["groups"]  # every group again, same bytes
    assert [resaved[g]["written_step"] for g in GROUPS] == [1, 2]
    m = RunDir.open(run).read_manifest(2)
    cut = [s["tensors"]["exp_avg/a"]["range"] for s in m["groups"]["layers.0"]["shards"]
           if "exp_avg/a" in s["tensors"]]
    assert len(cut) == 2 and cut[0][1] % 3 != 0  # a partition boundary inside a row
    want = state(2)
    rs = open_run_step(run)
    for g in GROUPS:
        got = rs.load_group(g)
        assert got.keys() == want[g].keys() and all(torch.equal(got[k], want[g][k]) for k in got)
    full = FlatPartitions(want, 0, 1)
    for world in (1, 3):
        parts = [FlatPartitions(state(1), r, world) for r in range(world)]
        for p in parts:
            p.mine.zero_()
            ShardedCheckpointer(run, p, SingleProcess()).load()
        assert torch.equal(torch.cat([p.mine for p in parts]), full.mine)
        assert all(torch.equal(t, full.scalars[gk]) for gk, t in parts[0].scalars.items())
