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
                                           r"dist.timeout_s=7 s.*resume=true"):
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
    with pytest.raises(RuntimeError, match="did not appear within dist.timeout_s=0.2"):
        b.zeros(10, torch.float32)  # file m-1 never comes
    with pytest.raises(ValueError, match="not a directory"):
        SharedAllocator(tmp_path / "nope", "x", creator=True, timeout_s=1)


def test_each_rank_takes_its_own_gpu():
    """``cuda`` under torchrun is the GPU of the rank's LOCAL_RANK; what would put two ranks
    of a node on one GPU is refused: more ranks than GPUs visible, or a fixed ``cuda:N``.

    Mutation seen failing: ``rank_device`` wrapping the local rank around the device count
    (``local_rank % device_count``): rank 2 of 2 GPUs lands on GPU 0."""
    from layerwise.train.dist.context import rank_device

    def ctx(local_rank, local_world=4):
        return DistContext(rank=local_rank, world_size=local_world, local_rank=local_rank,
                           local_world_size=local_world)

    assert rank_device(ctx(1), "cuda", 4) == "cuda:1"
    assert rank_device(ctx(0, 1), "cuda:3", 8) == "cuda:3"  # one rank a node: as asked
    assert rank_device(DistContext(), "cuda:2", 4) == "cuda:2"  # alone
    assert rank_device(ctx(3), "cpu", 0) == "cpu"
    with pytest.raises(ValueError, match=r"LOCAL_RANK=2 but this process sees 2 CUDA device.*share"):
        rank_device(ctx(2), "cuda", 2)
    with pytest.raises(ValueError, match=r"device=cuda:0 with 4 ranks a node puts every rank on GPU 0"):
        rank_device(ctx(1), "cuda:0", 4)


def test_ranks_driving_one_physical_gpu_are_found():
    """Device ids are per physical GPU (its UUID), so ranks whose CUDA_VISIBLE_DEVICES map
    different indices to one GPU are caught too."""
    from layerwise.train.dist.context import ranks_sharing_a_device

    assert ranks_sharing_a_device([11, 12, 13, 14]) == []
    assert ranks_sharing_a_device([11, 12, 11, 14]) == [[0, 2]]


def test_the_shared_store_is_refused_when_shm_is_too_small(tmp_path, monkeypatch):
    """A ``/dev/shm`` smaller than the store (Docker's default is 64 MB) is refused on every
    rank, with what it holds, what is needed and what to do, before any file is made (past its
    size, a tmpfs write is a SIGBUS). The free space comes from an injected reader.

    Mutation seen failing: ``host_allocator`` not calling ``shm_space_problem`` (the store is
    built and the first write past the tmpfs's size would kill the process)."""
    from layerwise.train.dist import setup
    from layerwise.train.dist.shm import shm_space_problem

    monkeypatch.setattr(setup, "any_rank", lambda ctx, flag, what: flag)  # the other ranks agree
    monkeypatch.setattr(setup, "broadcast_object", lambda ctx, obj, what: obj)
    ctx = DistContext(rank=0, world_size=2, local_rank=0, local_world_size=2)
    docker = lambda path: 64 * 2**20  # noqa: E731
    with pytest.raises(ValueError, match=r"has 67.11 MB free, but the node.s shared host store "
                                         r"needs 1.07 GB there.*SIGBUS.*--shm-size"):
        setup.host_allocator(ctx, str(tmp_path), lambda: 2**30, free_bytes=docker)
    assert list(tmp_path.iterdir()) == []
    alloc = setup.host_allocator(ctx, str(tmp_path), lambda: 32 * 2**20, free_bytes=docker)
    assert isinstance(alloc, SharedAllocator)
    assert shm_space_problem(tmp_path / "nope", 1, docker) is None  # the allocator says "not a directory"


@pytest.mark.parametrize("moments", [None, ["8bit", "fp32", "8bit", "fp32", "8bit", "fp32"]])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_shm_need_covers_what_the_store_maps(tmp_path, moments, dtype):
    """``shared_store_nbytes`` (from the config, nothing allocated) is at least what a shared
    store and its optimizer state really map, and over it by at most its per-file page slack."""
    from layerwise.engine.executor import EngineConfig, StreamingEngine
    from layerwise.plan import Plan
    from layerwise.train.dist.shm import _FILES_PER_UNIT, shared_store_nbytes
    from layerwise.util.host_memory import page_size

    cfg = get_flavor("llama-debug").build_config()
    alloc = SharedAllocator(tmp_path, "n", creator=True, timeout_s=5)
    _, store = init_store(cfg, compute_dtype=dtype, pin=False, alloc=alloc)
    plan = Plan.every_k(cfg.num_hidden_layers, 2)
    plan.moments = moments
    StreamingEngine(store.adapter, store, plan, EngineConfig(compute_dtype=dtype)).close()
    alloc.zeros(len(store.units), torch.int64)  # the update counters
    need = shared_store_nbytes(cfg, dtype, moments)
    slack = (_FILES_PER_UNIT * len(store.units) + 2) * page_size()
    assert alloc.mapped_nbytes <= need <= alloc.mapped_nbytes + slack, (alloc.mapped_nbytes, need)
    alloc.unlink()
