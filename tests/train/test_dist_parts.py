"""The parts of data parallel that need no second process: torchrun's environment, the
assignment of units to owners, and the shared-memory allocator (two allocators in one process
play creator and mapper)."""

from __future__ import annotations

import pytest
import torch

from layerwise.store import HostStore, init_store
from layerwise.models import get_flavor
from layerwise.train.dist.context import DistContext
from layerwise.train.dist.shm import SharedAllocator


def test_context_from_torchrun_env():
    alone = DistContext.from_env({})
    assert not alone.enabled and alone.world_size == 1
    ctx = DistContext.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                "LOCAL_WORLD_SIZE": "4"}, timeout_s=30)
    assert ctx.enabled and (ctx.node, ctx.num_nodes, ctx.global_rank(1, 3)) == (1, 2, 7)
    with pytest.raises(ValueError, match="inconsistent distributed environment"):
        DistContext.from_env({"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "2",
                              "LOCAL_WORLD_SIZE": "4"})
    with pytest.raises(ValueError, match="dist_timeout_s"):
        DistContext.from_env({}, timeout_s=0)


def test_peer_errors_name_the_timeout_and_the_way_back():
    ctx = DistContext(rank=1, world_size=2, local_rank=1, local_world_size=2, timeout_s=7)

    def boom():
        raise RuntimeError("Connection closed by peer")

    with pytest.raises(RuntimeError, match=r"rank 1 of 2.*reducing x.*Connection closed.*"
                                           r"dist_timeout_s=7 s.*resume=true"):
        ctx.collective("reducing x", boom)


def test_shared_allocator_maps_one_copy(tmp_path):
    """A store built through a creator's allocator and one built through a mapper's are the same
    memory: a write through one is read through the other, the zeros are the file's, and the
    files can be unlinked while both stay valid.

    Mutation seen failing: ``_map`` of the mapper creating its own file (``creator`` ignored):
    the second store does not see the first's weights."""
    cfg = get_flavor("llama-debug").build_config()
    a = SharedAllocator(tmp_path, "t", creator=True, timeout_s=5)
    b = SharedAllocator(tmp_path, "t", creator=False, timeout_s=5)
    _, s1 = init_store(cfg, seed=3, alloc=a)
    s2 = HostStore(s1.adapter, alloc=b)  # maps the same files in the same order
    for u1, u2 in zip(s1, s2):
        assert torch.equal(u1.master, u2.master) and u1.master.abs().sum() > 0
    a.unlink()
    assert list(tmp_path.iterdir()) == []
    s1["layers.0"].master.fill_(2.5)
    assert bool((s2["layers.0"].master == 2.5).all())
    assert a.mapped_nbytes == b.mapped_nbytes >= s1.copy_source_nbytes()


def test_shared_allocator_refuses_a_mismatch_and_times_out(tmp_path):
    a = SharedAllocator(tmp_path, "m", creator=True, timeout_s=5)
    a.zeros(1000, torch.float32)
    b = SharedAllocator(tmp_path, "m", creator=False, timeout_s=0.2)
    with pytest.raises(RuntimeError, match="built different models"):
        b.zeros(100_000, torch.float32)
    with pytest.raises(RuntimeError, match="did not appear within dist_timeout_s=0.2"):
        b.zeros(10, torch.float32)  # file m-1 never comes
    with pytest.raises(ValueError, match="not a directory"):
        SharedAllocator(tmp_path / "nope", "x", creator=True, timeout_s=1)
