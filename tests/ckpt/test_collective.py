"""The checkpoint exchange between ranks (``ckpt/collective.py``): two gloo processes agree on
what rank 0 decides, rank 0 gets every rank's records in rank order, and a rank that never
arrives makes the other fail within the timeout instead of hanging."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch.distributed as dist

import multiproc
from layerwise.ckpt.collective import CollectiveTimeout, SingleProcess, TorchExchange


def _worker(rank: int, out_dir: str, absent_rank: int) -> None:
    dist.init_process_group("gloo", rank=rank, world_size=2)
    ex = TorchExchange(timeout_s=3)
    chosen = ex.broadcast(["layers.0", "post"] if rank == 0 else None)
    got = ex.gather({"rank": rank, "chosen": chosen})
    ex.barrier()
    result = repr(got)
    if rank == absent_rank:  # never reaches the second gather: gone once the other has given up
        present = 1 - rank
        multiproc.wait_for(Path(out_dir, f"r{present}.txt").exists, 120, f"rank {present}'s result")
    else:
        t0 = time.monotonic()
        try:
            ex.gather(rank)
            result += " | second gather returned"
        except CollectiveTimeout as e:
            result += f" | timeout after {time.monotonic() - t0:.1f} s: {e}"
    part = os.path.join(out_dir, f"r{rank}.part")
    with open(part, "w") as f:
        f.write(result)
    os.replace(part, os.path.join(out_dir, f"r{rank}.txt"))
    multiproc.leave(0, barrier=False)  # the group is broken for the absent rank's peer


@pytest.mark.dist
@pytest.mark.timeout(300)
def test_exchange_across_two_ranks_and_a_missing_rank(tmp_path):
    """Mutation seen failing: ``gather`` passing ``dst=1`` through: rank 0 gets ``None``."""
    multiproc.run(_worker, (str(tmp_path), 1), log=tmp_path / "rank", timeout_s=240)
    r0 = (tmp_path / "r0.txt").read_text()
    assert r0.startswith("[{'rank': 0, 'chosen': ['layers.0', 'post']}, "
                         "{'rank': 1, 'chosen': ['layers.0', 'post']}]"), r0
    assert "timeout after" in r0 and "resume" in r0, r0
    waited_s = float(r0.split("timeout after ")[1].split(" s")[0])
    assert waited_s < 7.5, r0
    assert (tmp_path / "r1.txt").read_text() == "None"


def test_single_process_exchange_is_the_identity():
    ex = SingleProcess()
    assert (ex.broadcast(3), ex.gather("a"), ex.rank, ex.world_size) == (3, ["a"], 0, 1)
    ex.barrier()


def test_torch_exchange_needs_a_process_group():
    with pytest.raises(ValueError, match="init_process_group"):
        TorchExchange(timeout_s=1)
